"""Checks run inside 2 gloo workers for tests/offload/test_offload_host.py: offload_optimizer="cpu"
(the
host tier, [Note: host tier] in zero_kernels.offload.host) against the same run without it,
bitwise, on CPU params (where the tier's copies are host copies: the same code path as on a GPU
but for the streams and events, which bench/gpu_offload_check.py exercises); its copies per step,
memory counts, checkpoints both ways, state dicts, a skipped step, the refusals."""

from __future__ import annotations

import os
import tempfile

import torch
from dist_utils import run_checks
from offload_checks import model, same, snapshot, train
from zero_opt import zero_opt

import zero_kernels

DIR = os.environ.get("ZK_TEST_OFFLOAD_DIR") or tempfile.gettempdir()


def build(m, stage, host, bucket_mb=0.004, **kw):
    extra = {"offload_optimizer": "cpu"} if host else {}
    return zero_opt(
        m,
        torch.optim.AdamW,
        stage=stage,
        lr=1e-2,
        weight_decay=0.1,
        bucket_size_mb=bucket_mb,
        **(extra | kw),
    )


def _bitwise(stage, dtype, params_on_host=False, **kw):
    """The run with the host tier (and, ``params_on_host``, offload_params="cpu": the shards in
    host memory, stepped there in place and copied into the gathered bucket as each
    all-gather's input) against the same run without it: bitwise."""

    def check(rank, world):
        runs = []
        for host in (False, True):
            m = model(dtype, 128 if kw.get("bucket_mb") else 48)
            both = {"offload_params": "cpu"} if host and params_on_host else {}
            opt = build(m, stage, host, **(kw | both))
            if host:
                r, st = opt.parts.core.runner, opt.parts.core.store
                assert r.host is not None and r.state_device.type == "cpu"
                assert st.host_shards == r.host.params_on_host == params_on_host
                assert all(t.device.type == "cpu" for t in st.shards)
            train(m, opt, 4, rank)
            runs.append(snapshot(m, opt))
            opt.close()
        assert same(*runs), f"stage {stage} {dtype} {kw}: the host tier's run differs"
        return {}

    tags = ("_params_on_host" if params_on_host else "") + "".join(f"_{k}" for k in kw)
    check.__name__ = f"bitwise_stage{stage}_{str(dtype)[6:]}{tags}"
    return check


def params_on_host_copies(rank, world):
    """With both "cpu" tiers each step copies the gradient shards to the host and each bucket's
    param shard to the device once per all-gather (the forward's and the backward's at stage 3),
    never back: the step writes the host shard in place."""
    m = model(torch.bfloat16)
    opt = build(m, 3, True, offload_params="cpu")
    st, host = opt.parts.core.store, opt.parts.core.runner.host
    shard = sum(t.numel() for t in st.shards)
    gsz = opt.parts.core.runner.grads.shard(0, 0).element_size()
    base = st.bytes_to_device  # construction and the first forward's gathers
    train(m, opt, 3, rank)
    assert host.bytes_to_host == 3 * shard * gsz, (host.bytes_to_host, shard)
    assert host.bytes_to_device == 0 and host.staging_bytes == shard * gsz
    per_step = (st.bytes_to_device - base) / 3
    assert per_step == 2 * 2 * shard, (per_step, shard)  # bf16, forward + backward
    rep = opt.memory_report()
    assert rep["offload_param_host_bytes"] == 2 * shard
    assert rep["offload_to_device_bytes"] == st.bytes_to_device
    opt.close()
    return {"param_bytes_to_device_per_step": per_step}


def copies_per_step(rank, world):
    """Each step copies every bucket's gradient shard to the host and its new param shard back
    (fp32 params: their shard to the host too); memory_report counts the host's bytes."""
    got = {}
    for dtype in (torch.float32, torch.bfloat16):
        m = model(dtype)
        opt = build(m, 2, True)
        r = opt.parts.core.runner
        shard = sum(b.shard_numel(world) for b in r.layout.buffers)  # elements of the shard
        gsz = r.grads.shard(0, 0).element_size()
        psz = torch.empty((), dtype=dtype).element_size()
        train(m, opt, 3, rank)
        host = r.host
        fetch = psz if dtype == torch.float32 else 0  # fp32: the param shard goes over too
        assert host.bytes_to_host == 3 * shard * (gsz + fetch), (host.bytes_to_host, shard)
        assert host.bytes_to_device == 3 * shard * psz, (host.bytes_to_device, shard)
        rep = opt.memory_report()
        assert rep["offload_host_staging_bytes"] == host.staging_bytes == shard * (gsz + psz)
        assert rep["offload_to_host_bytes"] == host.bytes_to_host
        # the moments (and bf16's masters) are the runner's, on the host
        assert rep["optim_state_bytes"] >= 8 * shard, rep
        if dtype == torch.bfloat16:
            assert rep["master_bytes"] == 4 * shard, rep
            assert all(m.device.type == "cpu" for m in r.masters if m is not None)
        assert rep["offload_host_bytes"] == (
            rep["master_bytes"] + rep["optim_state_bytes"] + host.staging_bytes
        ), rep
        got[str(dtype)] = {"to_host": host.bytes_to_host, "to_device": host.bytes_to_device}
        opt.close()
    return got


def checkpoints(rank, world):
    """Saved with the host tier at stage 3, loaded without it at stage 2, and the other way
    round (bf16 params: their masters on the host); the same with the param shards on the host
    too: the next steps equal an uninterrupted run's."""
    m0 = model(torch.bfloat16)
    o0 = build(m0, 2, False)
    train(m0, o0, 5, rank)
    want = snapshot(m0, o0)
    o0.close()
    d = os.path.join(DIR, f"zk-host-ckpt-{os.getppid()}")
    both = {"offload_params": "cpu"}
    cases = [
        ((3, True, {}), (2, False, {})),
        ((2, False, {}), (3, True, {})),
        ((1, True, {}), (3, True, {})),
        ((3, True, both), (2, False, {})),
        ((2, False, {}), (3, True, both)),
    ]
    for first, second in cases:
        m = model(torch.bfloat16)
        o = build(m, *first[:2], **first[2])
        train(m, o, 3, rank)
        path = zero_kernels.save_checkpoint(d, m, o, extra={"step": 3})
        o.close()
        m2 = model(torch.bfloat16)
        with torch.no_grad():
            for p in m2.parameters():
                p.zero_()
        o2 = build(m2, *second[:2], **second[2])
        zero_kernels.load_checkpoint(path, m2, o2)
        train(m2, o2, 2, rank, start=3)
        got = snapshot(m2, o2)
        o2.close()
        assert same(got, want), f"saved {first}, loaded {second}: differs"
    torch.distributed.barrier()
    if rank == 0:
        import shutil

        shutil.rmtree(d, ignore_errors=True)
    return {}


def state_dict_and_model_edits(rank, world):
    """The optimizer's state dict round trip; an edit of the model's params between steps
    (model.load_state_dict) reaches the host masters, as without the tier."""
    runs = []
    for host in (False, True):
        m = model(torch.bfloat16)
        o = build(m, 1, host)
        train(m, o, 2, rank)
        sd = o.state_dict()
        m2 = model(torch.bfloat16)
        o2 = build(m2, 1, host)
        m2.load_state_dict(m.state_dict())
        o2.load_state_dict(sd)
        train(m, o, 2, rank, start=2)
        train(m2, o2, 2, rank, start=2)
        assert same(snapshot(m, o), snapshot(m2, o2)), f"host={host}: the round trip differs"
        with torch.no_grad():  # an edit from outside the optimizer
            m.load_state_dict({k: v * 0.5 for k, v in m.state_dict().items()})
        train(m, o, 1, rank, start=4)
        runs.append(snapshot(m, o))
        o.close()
        o2.close()
    assert same(*runs), "an edit of the params between steps: the host tier differs"
    return {}


def skipped_step(rank, world):
    """nonfinite="skip": a step with a NaN gradient on one rank is skipped on every rank, the
    host's masters and moments untouched, as without the tier."""
    runs = []
    for host in (False, True):
        m = model()
        o = build(m, 2, host, nonfinite="skip")
        train(m, o, 2, rank)
        o.zero_grad()
        x = torch.randn(6, 48, generator=torch.Generator().manual_seed(7))
        if rank == 1:
            x[0, 0] = float("nan")  # every gradient of rank 1 non-finite
        m(x).square().mean().backward()
        o.step()
        train(m, o, 1, rank, start=3)
        runs.append(snapshot(m, o))
        o.close()
    assert same(*runs), "a skipped step with the host tier differs"
    return {}


def thread_advice(rank, world):
    """A GPU rank left with one intra-op thread (torchrun's OMP_NUM_THREADS=1) where cores are
    to spare is told how many to use; CPU params, several threads or no spare core: silence."""
    from zero_kernels.optimizer.build import host_thread_advice

    msg = host_thread_advice("cuda", 1, 64, 8)
    assert msg and "torch.set_num_threads(8)" in msg and "OMP_NUM_THREADS=8" in msg, msg
    assert host_thread_advice("cpu", 1, 64, 8) is None
    assert host_thread_advice("cuda", 8, 64, 8) is None
    assert host_thread_advice("cuda", 1, 8, 8) is None
    return {}


def refusals(rank, world):
    msgs = {}
    cases = [
        ("SGD", torch.optim.SGD, dict(offload_optimizer="cpu"), NotImplementedError),
        (
            "with offload_params",
            torch.optim.AdamW,
            dict(offload_optimizer="cpu", offload_params="nvme", offload_dir=DIR),
            NotImplementedError,
        ),
        (
            "cuda kernel",
            torch.optim.AdamW,
            dict(offload_optimizer="cpu", kernel_backend="cuda"),
            ValueError,
        ),
        ("params cpu tier alone", torch.optim.AdamW, dict(offload_params="cpu"), ValueError),
        (
            "params cpu tier at quantized gathers",
            torch.optim.AdamW,
            dict(offload_optimizer="cpu", offload_params="cpu", quantize_weights="int8"),
            NotImplementedError,
        ),
        ("bad tier", torch.optim.AdamW, dict(offload_optimizer="gpu"), ValueError),
    ]
    for what, cls, kw, err in cases:
        try:
            zero_opt(model(), cls, stage=3, lr=1e-3, **kw)
            raise AssertionError(f"{what}: accepted")
        except err as e:
            assert "offload" in str(e), e
            msgs[what] = str(e)[:80]
    return msgs


CHECKS = [
    _bitwise(1, torch.float32),
    _bitwise(2, torch.bfloat16),
    _bitwise(3, torch.float32, bucket_mb=0.1),
    _bitwise(3, torch.bfloat16),
    _bitwise(2, torch.float32, amsgrad=True),
    _bitwise(3, torch.float32, state_dtype="int8", state_block=64),
    _bitwise(2, torch.bfloat16, state_dtype="bf16"),
    _bitwise(3, torch.bfloat16, bf16_stochastic_round=True),
    _bitwise(3, torch.float32, True, bucket_mb=0.1),
    _bitwise(3, torch.bfloat16, True, bucket_mb=0.1),
    _bitwise(3, torch.float32, True, bucket_mb=0.1, state_dtype="int8", state_block=64),
    _bitwise(3, torch.bfloat16, True, bucket_mb=0.1, bf16_stochastic_round=True),
    _bitwise(3, torch.bfloat16, True, bucket_mb=0.1, persist_below=64, prefetch=2),
    _bitwise(3, torch.float32, True, bucket_mb=0.1, secondary_shard=2),
    params_on_host_copies,
    copies_per_step,
    checkpoints,
    state_dict_and_model_edits,
    skipped_step,
    thread_advice,
    refusals,
]


def worker(rank, world):
    return run_checks(rank, world, CHECKS)


def _with_features(rank, world):
    """Other options beside the tier: overlapped param gathers (stage 2), a hierarchical shard
    group, quantized weight gathers (stage 3), and a param group added midway: the same run as
    without the tier, bitwise."""
    cases = [
        (2, dict(overlap_param_gather=True)),
        (2, dict(shard_group=1)),
        (3, dict(quantize_weights="int8")),
        (1, dict(add_group=True)),
    ]
    for stage, kw in cases:
        runs = []
        for host in (False, True):
            m = model(torch.bfloat16)
            add = kw.pop("add_group", False)
            params = list(m.parameters())
            if add:  # the last layer joins after two steps (progressive unfreezing)
                opt = build(params[:-2], stage, host)
            else:
                opt = build(m, stage, host, **kw)
            train(m, opt, 2, rank)
            if add:
                opt.add_param_group({"params": params[-2:], "lr": 5e-3})
                kw["add_group"] = True
            train(m, opt, 2, rank, start=2)
            if kw.get("overlap_param_gather"):
                opt.wait_params()
            runs.append(snapshot(m, opt))
            opt.close()
        assert same(*runs), f"stage {stage} {kw}: the host tier's run differs"
    return {}


_with_features.__name__ = "with_other_features"
CHECKS.insert(-1, _with_features)
