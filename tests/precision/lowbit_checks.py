"""Checks run inside 2 gloo workers for tests/precision/test_lowbit_zero.py:
ZeroOptimizer(state_dtype=
"bf16") at stages 1-3 against FusedAdamW(state_dtype="bf16") on the averaged gradients, its
memory count, checkpoints across stage and state dtype, and the refusals."""

from __future__ import annotations

import contextlib
import os
import tempfile

import pytest
import torch
from dist_utils import run_checks
from torch import nn
from zero_opt import zero_opt

import zero_kernels


def model(dtype=torch.float32):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(48, 96), nn.GELU(), nn.Linear(96, 48), nn.Linear(48, 8)).to(
        dtype
    )


def build(m, stage, **kw):
    kw = {"lr": 1e-2, "weight_decay": 0.1, "bucket_size_mb": 0.01, "state_dtype": "bf16"} | kw
    return zero_opt(m, torch.optim.AdamW, stage=stage, **kw)


def batch(step, rank, dtype):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(6, 48, generator=g).to(dtype)


def train(m, opt, steps, rank, start=0):
    dtype = next(m.parameters()).dtype
    for s in range(start, start + steps):
        opt.zero_grad()
        m(batch(s, rank, dtype)).float().square().mean().backward()
        opt.step()


def _parity(stage, dtype):
    def check(rank, world):
        m = model(dtype)
        opt = build(m, stage)
        train(m, opt, 4, rank)
        rep = opt.memory_report()
        got = {k: v.detach().float().clone() for k, v in m.state_dict().items()}
        states = [opt.full_state(p) for p in m.parameters()]
        opt.close()
        # the same steps, one process: the mean of both ranks' losses, FusedAdamW with bf16
        # moments on fp32 masters (bf16 params: masters kept here, cast after each step)
        ref = model(dtype)
        masters = [p.detach().float().clone().requires_grad_() for p in ref.parameters()]
        fo = zero_kernels.FusedAdamW(
            masters, lr=1e-2, weight_decay=0.1, state_dtype="bf16", min_lowbit_numel=0
        )
        for s in range(4):
            for p in ref.parameters():
                p.grad = None
            loss = sum(ref(batch(s, r, dtype)).float().square().mean() for r in range(world))
            (loss / world).backward()
            for mp, p in zip(masters, ref.parameters()):
                mp.grad = p.grad.float()
            fo.step()
            with torch.no_grad():
                for mp, p in zip(masters, ref.parameters()):
                    p.copy_(mp)
        tol = 1e-6 if dtype == torch.float32 else 1e-2
        for (k, v), p in zip(got.items(), ref.parameters()):
            assert torch.allclose(v, p.detach().float(), rtol=tol, atol=tol), (stage, dtype, k)
        for st, mp in zip(states, masters):
            assert st["exp_avg"].dtype == torch.bfloat16, st["exp_avg"].dtype
            want = fo.state[mp]["exp_avg"].view_as(st["exp_avg"])
            w = want.float()
            # fp32 params: one bf16 rounding apart at most; bf16 params: their grads are
            # reduced in another order than one process's backward, a few bf16 ulps
            rel, floor = (2**-7, 1e-6) if dtype == torch.float32 else (0.05, 1e-2 * w.abs().max())
            ok = (st["exp_avg"].float() - w).abs() <= rel * w.abs() + floor
            assert bool(ok.all()), (stage, dtype)
        n = sum(p.numel() for p in m.parameters())
        shard = rep["optim_state_bytes"]
        # bf16 moments: 4 bytes per element of this rank's shard (+ padding, + 0-dim steps)
        assert 4 * n / world <= shard <= 4 * n / world + 4096, (shard, n)
        return {"optim_state_bytes": shard}

    check.__name__ = f"parity_stage{stage}_{str(dtype)[6:]}"
    return check


def _full(m, opt):
    return [
        {k: v.clone() for k, v in opt.full_state(p).items() if torch.is_tensor(v)}
        for p in m.parameters()
    ]


def checkpoints(rank, world):
    """Saved with bf16 state at stage 3, loaded at stage 2 (bf16): the next steps equal an
    uninterrupted run's, bitwise; loaded with fp32 state: the moments are the bf16 ones,
    exactly; an fp32-state checkpoint loads into bf16 state rounded to nearest."""
    d = os.path.join(tempfile.gettempdir(), f"zk-lowbit-ckpt-{os.getppid()}")
    m0 = model()
    o0 = build(m0, 2)
    train(m0, o0, 5, rank)
    want = {k: v.clone() for k, v in m0.state_dict().items()}
    o0.close()
    m = model()
    o = build(m, 3)
    train(m, o, 3, rank)
    saved = _full(m, o)
    path = zero_kernels.save_checkpoint(d, m, o, extra={"step": 3})
    o.close()
    m2 = model()
    o2 = build(m2, 2)
    zero_kernels.load_checkpoint(path, m2, o2)
    train(m2, o2, 2, rank, start=3)
    assert all(torch.equal(v, want[k]) for k, v in m2.state_dict().items()), "resume differs"
    o2.close()
    m3 = model()
    o3 = build(m3, 2, state_dtype="fp32")
    zero_kernels.load_checkpoint(path, m3, o3)
    for a, b in zip(_full(m3, o3), saved):
        assert a["exp_avg"].dtype == torch.float32
        assert torch.equal(a["exp_avg"], b["exp_avg"].float()), "bf16 -> fp32 not exact"
    train(m3, o3, 1, rank, start=3)
    path32 = zero_kernels.save_checkpoint(d + "-32", m3, o3, extra={"step": 4})
    s32 = _full(m3, o3)
    o3.close()
    m4 = model()
    o4 = build(m4, 1)
    zero_kernels.load_checkpoint(path32, m4, o4)
    for a, b in zip(_full(m4, o4), s32):
        assert a["exp_avg"].dtype == torch.bfloat16
        assert torch.equal(a["exp_avg"], b["exp_avg"].bfloat16()), "fp32 -> bf16 not rounded"
    o4.close()
    torch.distributed.barrier()
    if rank == 0:
        import shutil

        for p in (d, d + "-32"):
            shutil.rmtree(p, ignore_errors=True)
    return {}


def _int8_parity(stage, dtype):
    def check(rank, world):
        """int8 moments on piece-aligned blocks: the native kernel against the reference
        backend over the same block tables (tight), and near the fp32-state run; the state is
        a quarter of fp32's; a state read (full_state, state_dict) leaves it bit for bit."""
        runs = {}
        for name, kw in (
            ("cpu", {"state_dtype": "int8", "state_block": 64}),
            (
                "reference",
                {"state_dtype": "int8", "state_block": 64, "kernel_backend": "reference"},
            ),
            ("fp32", {"state_dtype": "fp32"}),
        ):
            m = model(dtype)
            opt = build(m, stage, **kw)
            train(m, opt, 2, rank)
            if name == "cpu":  # reading the state decodes it; leaving must not re-encode it
                before = [t.clone() for t in opt.parts.core.runner.int8.whole.values()]
                full = opt.full_state(next(m.parameters()))
                assert full["exp_avg"].dtype == torch.float32
                opt.state_dict()
                after = list(opt.parts.core.runner.int8.whole.values())
                assert all(torch.equal(a, b) for a, b in zip(before, after)), "a read re-encoded"
                rep = opt.memory_report()
            train(m, opt, 3, rank, start=2)
            runs[name] = [v.detach().float().clone() for v in m.state_dict().values()]
            opt.close()
        for a, b in zip(runs["cpu"], runs["reference"]):
            # fp32: within a 1e-4 of an update of 1e-2; bf16 params: an ulp of the param apart
            rtol = 0 if dtype == torch.float32 else 2**-7
            assert torch.allclose(a, b, rtol=rtol, atol=1e-4), (a - b).abs().max()
        worst = max((a - b).abs().max().item() for a, b in zip(runs["cpu"], runs["fp32"]))
        assert worst < 5 * 1e-2 * 0.1, worst  # under a tenth of 5 steps of lr, quantization only
        n = sum(p.numel() for p in model().parameters())
        shard = rep["optim_state_bytes"]
        assert (2 + 8 / 64) * n / world <= shard <= (2 + 8 / 64) * n / world + 4096, (shard, n)
        return {"optim_state_bytes": shard, "worst_vs_fp32": worst}

    check.__name__ = f"int8_stage{stage}_{str(dtype)[6:]}"
    return check


def _rank_bytes(path):
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if "rank-" in f)


@contextlib.contextmanager
def _no_decode(opt):
    """Inside: every decode of ``opt``'s int8 shard state to fp32 is recorded in the list."""
    int8 = opt.parts.core.runner.int8
    calls, real = [], int8.decoded_view

    def counted(*a):
        calls.append(a)
        return real(*a)

    int8.decoded_view = counted
    try:
        yield calls
    finally:
        del int8.decoded_view


def int8_checkpoints(rank, world):
    """int8 state saved at stage 3 as codes and block scales (format 2, 2 bytes per element
    of moments): loaded at stage 3 (the same blocks: codes taken as saved, the next steps equal
    the uninterrupted run's bitwise), at stage 2 (decoded, re-encoded on its blocks: within a
    code step), into fp32 state (exactly the decoded moments); saving does not change the
    run; the fp32-state checkpoint of the same model is larger by the moments' 6 bytes."""
    from zero_kernels.checkpoint import inspect_checkpoint, verify_checkpoint
    from zero_kernels.checkpoint.format import read_meta

    d = os.path.join(tempfile.gettempdir(), f"zk-int8-ckpt-{os.getppid()}")
    kw = {"state_dtype": "int8", "state_block": 64}
    m0 = model()
    o0 = build(m0, 3, **kw)
    train(m0, o0, 5, rank)
    want = {k: v.clone() for k, v in m0.state_dict().items()}
    o0.close()
    m = model()
    o = build(m, 3, **kw)
    train(m, o, 3, rank)
    saved = _full(m, o)
    with _no_decode(o) as decoded:
        path = zero_kernels.save_checkpoint(d, m, o, extra={"step": 3})
    assert decoded == [], f"the save decoded {len(decoded)} int8 views (it writes the codes)"
    train(m, o, 2, rank, start=3)
    assert all(torch.equal(v, want[k]) for k, v in m.state_dict().items()), "a save changed it"
    o.close()
    meta = read_meta(path)
    assert meta["format_version"] == 2, meta["format_version"]
    sc = meta["params"][0]["state"]
    assert sc["elem"] == {"exp_avg": "int8", "exp_avg_sq": "uint8"}, sc["elem"]
    assert sc["lowbit"] == {"dtype": "int8", "block": 64, "origin": "piece"}, sc
    assert verify_checkpoint(path) == [] and inspect_checkpoint(path)["format_version"] == 2
    m2 = model()
    o2 = build(m2, 3, **kw)  # the saved layout: the same blocks
    zero_kernels.load_checkpoint(path, m2, o2)
    for a, b in zip(_full(m2, o2), saved):
        assert torch.equal(a["exp_avg"], b["exp_avg"]), "codes differ"
    train(m2, o2, 2, rank, start=3)
    for k, v in m2.state_dict().items():
        assert torch.equal(v, want[k]), (k, (v - want[k]).abs().max())
    o2.close()
    m2 = model()
    o2 = build(m2, 2, **kw, bucket_size_mb=0.004)  # another layout: re-encoded on its blocks
    zero_kernels.load_checkpoint(path, m2, o2)
    for a, b in zip(_full(m2, o2), saved):
        tol = 0.02 * b["exp_avg"].abs().max()  # a code step near the block max, at most
        assert torch.allclose(a["exp_avg"], b["exp_avg"], rtol=0, atol=tol), "re-encoded"
    train(m2, o2, 2, rank, start=3)
    for k, v in m2.state_dict().items():
        assert torch.allclose(v, want[k], rtol=0, atol=1e-3), (k, (v - want[k]).abs().max())
    o2.close()
    m3 = model()
    o3 = build(m3, 1, state_dtype="fp32")
    zero_kernels.load_checkpoint(path, m3, o3)
    for a, b in zip(_full(m3, o3), saved):
        assert torch.equal(a["exp_avg"], b["exp_avg"]) and torch.equal(
            a["exp_avg_sq"], b["exp_avg_sq"]
        )
    path32 = zero_kernels.save_checkpoint(d + "-32", m3, o3, extra={"step": 3})
    o3.close()
    n = sum(p.numel() for p in model().parameters())
    assert read_meta(path32)["format_version"] == 1
    grew = _rank_bytes(path32) - _rank_bytes(path)
    # 6 bytes per element of moments, less the scales (8 bytes per block) and their headers
    assert 0.9 * 6 * n <= grew <= 6 * n, (grew, 6 * n)
    torch.distributed.barrier()
    if rank == 0:
        import shutil

        for p in (d, d + "-32"):
            shutil.rmtree(p, ignore_errors=True)
    return {}


def fused_lowbit_checkpoints(rank, world):
    """A replicated model with FusedAdamW int8 and bf16 state through save_checkpoint (each
    rank writes half of each param, codes with the scales of the blocks they touch): back into
    FusedAdamW int8 its own state bit for bit; into torch's AdamW the decoded moments
    (fp32_state_dict's); into ZeroOptimizer int8 at stage 2 (other blocks: re-encoded); a
    ZeroOptimizer int8 checkpoint into FusedAdamW int8 (decoded, encoded on its blocks);
    FusedAdamW bf16 moments into ZeroOptimizer bf16 exactly."""
    from zero_kernels import FusedAdamW

    d = os.path.join(tempfile.gettempdir(), f"zk-fused-lowbit-{os.getppid()}")

    def fused(m, **kw):
        kw = {"lr": 1e-2, "weight_decay": 0.1, "state_block": 64, "min_lowbit_numel": 0} | kw
        return FusedAdamW(m.parameters(), **kw)

    for dt in ("int8", "bf16"):
        m = model()
        o = fused(m, state_dtype=dt)
        train(m, o, 3, rank=0)  # the same batches on both ranks: a replicated model
        sd = o.state_dict()
        path = zero_kernels.save_checkpoint(f"{d}-{dt}", m, o, extra={"step": 3})
        m2 = model()
        o2 = fused(m2, state_dtype=dt)
        zero_kernels.load_checkpoint(path, m2, o2)
        for k, st in o2.state_dict()["state"].items():
            for key, v in st.items():
                w = sd["state"][k][key]
                assert (v == w) if not torch.is_tensor(v) else torch.equal(v, w), (dt, key)
        ref = o.fp32_state_dict()["state"]
        m3 = model()
        o3 = torch.optim.AdamW(m3.parameters(), lr=1e-2)
        zero_kernels.load_checkpoint(path, m3, o3)
        for k, st in o3.state_dict()["state"].items():
            assert torch.equal(st["exp_avg"], ref[k]["exp_avg"]), (dt, k)
            assert torch.equal(st["exp_avg_sq"], ref[k]["exp_avg_sq"]), (dt, k)
        m4 = model()
        o4 = build(m4, 2, state_dtype=dt, state_block=64)
        zero_kernels.load_checkpoint(path, m4, o4)
        for p, k in zip(m4.parameters(), sorted(ref)):
            got = o4.full_state(p)["exp_avg"]
            want = ref[k]["exp_avg"].float()
            tol = 0 if dt == "bf16" else 0.02 * want.abs().max()
            assert torch.allclose(got.float(), want, rtol=0, atol=tol), (dt, k)
        train(m4, o4, 1, rank, start=3)
        zpath = zero_kernels.save_checkpoint(f"{d}-{dt}-zero", m4, o4, extra={"step": 4})
        zs = _full(m4, o4)
        o4.close()
        m5 = model()
        o5 = fused(m5, state_dtype=dt)
        zero_kernels.load_checkpoint(zpath, m5, o5)
        st5 = o5.fp32_state_dict()["state"]
        for k, z in enumerate(zs):
            got = st5[k]["exp_avg"]
            want = z["exp_avg"].float()
            tol = 0 if dt == "bf16" else 0.02 * want.abs().max()
            assert torch.allclose(got, want, rtol=0, atol=tol), dt
    torch.distributed.barrier()
    if rank == 0:
        import glob
        import shutil

        for p in glob.glob(f"{d}-*"):
            shutil.rmtree(p, ignore_errors=True)
    return {}


def int8_state_paths(rank, world):
    """int8 state through every other door: consolidated_state_dict is torch's format (a plain
    AdamW loads it) and loads back at another stage; set_full_state writes through (decoded,
    re-encoded); add_param_group rebuilds with the state kept; all near the fp32 values."""
    kw = {"state_dtype": "int8", "state_block": 64}
    m = model()
    o = build(m, 2, **kw)
    train(m, o, 3, rank)
    full = o.consolidated_state_dict(to=0)
    before = _full(m, o)
    if rank == 0:
        plain = torch.optim.AdamW(model().parameters(), lr=1e-2)
        plain.load_state_dict(full)
        st0 = plain.state[plain.param_groups[0]["params"][0]]
        assert st0["exp_avg"].dtype == torch.float32
        assert torch.equal(st0["exp_avg"], before[0]["exp_avg"]), "consolidated != full_state"
    full = [full]
    torch.distributed.broadcast_object_list(full, src=0)
    m2 = model()
    with torch.no_grad():
        for a, b in zip(m2.parameters(), m.parameters()):
            a.copy_(b)
    o2 = build(m2, 3, **kw)
    o2.load_state_dict(full[0])
    for a, b in zip(_full(m2, o2), before):
        tol = 0.02 * b["exp_avg"].abs().max()
        assert torch.allclose(a["exp_avg"], b["exp_avg"], rtol=0, atol=tol), "reloaded"
    o2.close()
    p0 = next(m.parameters())
    want = torch.full_like(before[0]["exp_avg"], 1e-3)
    o.set_full_state(p0, "exp_avg", want)
    got = o.full_state(p0)["exp_avg"]
    assert torch.allclose(got, want, rtol=1e-2, atol=0), "set_full_state"
    extra = nn.Linear(8, 8)
    o.add_param_group({"params": list(extra.parameters())})
    after = _full(m, o)
    assert torch.allclose(after[0]["exp_avg"], want, rtol=1e-2, atol=0), "add_param_group"
    for a, b in zip(after[1:], before[1:]):
        tol = 0.02 * b["exp_avg"].abs().max()
        assert torch.allclose(a["exp_avg"], b["exp_avg"], rtol=0, atol=tol), "add_param_group"
    train(m, o, 1, rank, start=3)
    assert all(torch.isfinite(v).all() for v in m.state_dict().values())
    o.close()
    return {}


def refusals(rank, world):
    for kw, exc, match in (
        ({"state_dtype": "int8", "state_block": 100}, ValueError, "multiple of 64"),
        ({"state_dtype": "int8", "kernel_backend": "triton"}, NotImplementedError, "Triton"),
        ({"state_dtype": "fp16"}, ValueError, "state_dtype must be one of"),
        ({"amsgrad": True}, ValueError, "amsgrad"),
        ({"fused_adam": False}, ValueError, "fused Adam step's format"),
    ):
        with pytest.raises(exc, match=match):
            build(model(), 2, **kw)
    return {}


CHECKS = [
    _parity(1, torch.float32),
    _parity(2, torch.bfloat16),
    _parity(3, torch.float32),
    _int8_parity(2, torch.float32),
    _int8_parity(3, torch.bfloat16),
    checkpoints,
    int8_checkpoints,
    fused_lowbit_checkpoints,
    int8_state_paths,
    refusals,
]


def worker(rank, world):
    return run_checks(rank, world, CHECKS)
