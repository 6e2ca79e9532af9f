"""Checks of stage 3's secondary shard (``secondary_shard``, ZeRO++'s hpZ), run by
tests/topology/test_secondary.py on 4 gloo ranks in blocks of 2: results bit for bit those of plain
stage 3 (fp32 and bf16 params, activation checkpointing of both kinds, a module run twice, a
gradient-accumulation pass, params and state offloaded to NVMe), every all-gather of a
backward inside the block, the kept bytes, quantized weights equal on every rank, a resume,
and bad values."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from dist_utils import run_checks
from stage3_checks import Net3, _batch, _loss
from zero_opt import zero_opt

from zero_kernels import ZeroOptimizer, comm

O = torch.optim


def _train(rank, steps=3, setup=None, dtype=None, accumulate=1, spy=None, **kw):
    """Params (gathered, exact) and losses after ``steps`` AdamW steps of Net3 at stage 3."""
    torch.manual_seed(0)
    m = Net3()
    if setup:
        setup(m)
    if dtype is not None:
        m = m.to(dtype)
    zo = zero_opt(m, O.AdamW, stage=3, bucket_size_mb=0.002, lr=1e-2, weight_decay=0.1, **kw)
    losses = []
    for step in range(steps):
        zo.zero_grad()
        for mb in range(accumulate):
            x, y = _batch(rank, step * accumulate + mb)
            loss = _loss(m(x), y)
            if spy is not None:
                spy(zo, "forward")
            loss.div(accumulate).backward()
            if spy is not None:
                spy(zo, "backward")
            losses.append(loss.item())
        zo.step()
    with zo.gathered_params():
        params = [p.detach().clone() for p in m.parameters()]
    zo.close()
    return params, losses


def _same(a, b, what):
    pa, la = a
    pb, lb = b
    assert la == lb, f"{what}: losses {la} vs {lb}"
    for k, (x, y) in enumerate(zip(pa, pb)):
        assert torch.equal(x, y), f"{what}: param {k} differs by {(x - y).abs().max().item():.3g}"


_CASES = {
    "plain": None,
    "checkpointing": lambda m: setattr(m, "ckpt", "plain"),
    "reentrant checkpointing": lambda m: setattr(m, "ckpt", "reentrant"),
    "module run twice": lambda m: setattr(m, "reuse", True),
    "last block unused": lambda m: setattr(m, "skip_last", True),
}


def check_bitwise_plain_stage3(rank, world):
    """Each case: the same params and losses as plain stage 3, bit for bit."""
    for name, setup in _CASES.items():
        ref = _train(rank, setup=setup)
        got = _train(rank, setup=setup, secondary_shard=2)
        _same(ref, got, name)
    ref = _train(rank, accumulate=2)  # accumulation: two forwards and backwards per step
    _same(ref, _train(rank, accumulate=2, secondary_shard=2), "accumulation")
    ref = _train(rank, dtype=torch.bfloat16)
    _same(ref, _train(rank, dtype=torch.bfloat16, secondary_shard=2), "bf16 params")


def check_with_offload(rank, world):
    """With params and optimizer state offloaded to NVMe: bit for bit plain stage 3 with the
    same offload, and the run in RAM (the secondary copies come from the gathered buckets, not
    from the offloaded shards)."""
    import shutil
    import tempfile

    root = tempfile.mkdtemp(prefix="zk-hpz-offload-") if rank == 0 else None
    box = [root]
    dist.broadcast_object_list(box, src=0)
    kw = dict(offload_params="nvme", offload_optimizer="nvme", offload_dir=box[0])
    got = _train(rank, secondary_shard=2, **kw)
    _same(_train(rank, **kw), got, "offloaded")
    _same(_train(rank), got, "offloaded vs in RAM")
    dist.barrier()
    if rank == 0:
        shutil.rmtree(box[0], ignore_errors=True)


def _gather_spy():
    """Wraps comm.all_gather: the group size of every all-gather, tagged by phase."""
    seen = {"forward": [], "backward": []}
    phase = ["forward"]
    real = comm.all_gather

    def spy(output, input, *, group=None, **kw):
        seen[phase[0]].append(comm.world_size(group))
        return real(output, input, group=group, **kw)

    def mark(zo, what):  # called after the forward (then backward runs) and after backward
        phase[0] = "backward" if what == "forward" else "forward"

    return seen, spy, mark, real


def check_backward_gathers_stay_in_block(rank, world):
    """Plain stage 3's backward all-gathers go over all 4 ranks; with secondary_shard=2 every
    one of them goes over the block of 2, and the forward's still over 4."""
    out = {}
    for ss in (None, 2):
        seen, spy, mark, real = _gather_spy()
        comm.all_gather = spy  # the module every gather goes through
        try:
            _train(rank, steps=2, spy=mark, secondary_shard=ss)
        finally:
            comm.all_gather = real
        fwd, bwd = seen["forward"], seen["backward"]
        assert fwd and bwd, seen
        out[str(ss)] = {"forward": sorted(set(fwd)), "backward": sorted(set(bwd))}
    assert out["None"]["backward"] == [world], out
    assert out["2"]["backward"] == [2], out  # the root unit is gathered once, in the forward
    assert world in out["2"]["forward"], out
    return out


def check_kept_bytes(rank, world):
    """After a forward 1/2 of every unit's gathered buckets is kept; nothing after the backward;
    a forward whose backward never ran leaves nothing behind at the next forward."""
    torch.manual_seed(0)
    m = Net3()
    zo = zero_opt(m, O.AdamW, stage=3, bucket_size_mb=0.002, lr=1e-2, secondary_shard=2)
    sched = zo.parts.core.units
    lay = zo.parts.core.layout
    want = sum(
        lay.buffers[i].buckets[b].numel(lay.world_size) * 4 // 2
        for u in sched.units
        for i, b in u.buckets  # every block unit (the root unit keeps none)
    )
    x, y = _batch(rank, 0)
    loss = _loss(m(x), y)
    after_fwd = zo.memory_report()["secondary_shard_bytes"]
    assert after_fwd == want, (after_fwd, want)
    loss.backward()
    assert zo.memory_report()["secondary_shard_bytes"] == 0
    _loss(m(x), y)  # no backward
    _loss(m(x), y).backward()  # the next forward dropped the first one's
    rep = zo.memory_report()
    assert rep["secondary_shard_bytes"] == 0 and rep["secondary_shard_peak_bytes"] == want, rep
    # the estimator's figure for it (the non-root params / K), short of it by at most the
    # buckets' padding (each bucket padded for its ranks' aligned chunks)
    from zero_kernels.tools.estimate import estimate_stage

    root_n = sum(lay.buffers[i].buckets[b].numel(lay.world_size) for i, b in sched.root.buckets)
    n = sum(p.numel() for p in zo.parts.core.trainable.values())
    e = estimate_stage(3, n, world, precision="fp32", secondary_shard=2, root_params=root_n)
    padded = sum(bk.numel(lay.world_size) for buf in lay.buffers for bk in buf.buckets)
    pad = (padded - n) * 4 // 2
    assert 0 <= want - e.secondary_bytes <= pad, (e.secondary_bytes, want, pad)
    zo.step()
    # comm_stats: one step's backward gathers every block unit from the kept slices, counted
    # apart (bytes of the whole gathered buckets), and not in all_gather_bytes
    zo.reset_comm_stats()
    _loss(m(x), y).backward()
    cs = zo.comm_stats
    full = 2 * want  # the gathered buckets' bytes
    assert cs["secondary_all_gather_bytes"] == full, (cs, full)
    root = sum(lay.buffers[i].buckets[b].numel(lay.world_size) * 4 for i, b in sched.root.buckets)
    assert cs["all_gather_bytes"] == full + root, (cs, full, root)  # the forward's only
    zo.close()
    return {"kept_bytes": want}


def check_quantized_same_on_every_rank(rank, world):
    """With int8 weights every rank computes with the same dequantized values, forward and
    backward: the run equals plain quantized stage 3 made to dequantize its own chunk too, bit
    for bit, and stays within int8's error of the unquantized run."""
    torch.manual_seed(0)
    ref = _train(rank, quantize_weights="int8")
    orig = ZeroOptimizer._build

    def own_dequantized(self, *a, **k):  # plain quantized stage 3 with own_exact=False
        orig(self, *a, **k)
        self.parts.core.runner.own_exact = False

    ZeroOptimizer._build = own_dequantized
    try:
        uniform = _train(rank, quantize_weights="int8")
    finally:
        ZeroOptimizer._build = orig
    got = _train(rank, quantize_weights="int8", secondary_shard=2)
    _same(uniform, got, "int8 weights, own chunk dequantized")
    exact = _train(rank)

    def dist_(a):  # relative distance over all params at once
        num = sum((x - y).float().pow(2).sum() for x, y in zip(a[0], exact[0]))
        return (num / sum(y.float().pow(2).sum() for y in exact[0])).sqrt().item()

    d, d_plain = dist_(got), dist_(ref)
    # int8's error, no more than plain quantized stage 3's (whose own chunk is exact)
    assert 0 < d <= 1.5 * d_plain and d < 5e-2, (d, d_plain)
    losses = torch.tensor(got[1])
    every = [torch.zeros_like(losses) for _ in range(world)]
    dist.all_gather(every, losses)  # each rank's losses over its own batches: finite
    assert all(torch.isfinite(t).all() for t in every)
    return {"vs_unquantized": d, "plain_int8_vs_unquantized": d_plain}


def check_resume_equals_uninterrupted(rank, world):
    """A checkpoint saved under secondary_shard (int8 weights and grads too) resumes into a
    fresh model and optimizer with it, and into plain stage 3: the continued losses and params
    are those of the uninterrupted run, bit for bit (a bad loss after a load: DeepSpeed#7164)."""
    import shutil
    import tempfile

    from zero_kernels.checkpoint import load_checkpoint, save_checkpoint

    root = tempfile.mkdtemp(prefix="zk-hpz-ckpt-") if rank == 0 else None
    box = [root]
    dist.broadcast_object_list(box, src=0)
    root = box[0]
    q = dict(quantize_weights="int8", quantize_grads="int8")

    def run(m, zo, steps, first):
        out = []
        for step in range(first, first + steps):
            zo.zero_grad()
            x, y = _batch(rank, step)
            loss = _loss(m(x), y)
            loss.backward()
            zo.step()
            out.append(loss.item())
        return out

    def fresh(seed, **kw):
        torch.manual_seed(seed)
        m = Net3()
        kw = dict(secondary_shard=2, **q) | kw
        return m, zero_opt(m, O.AdamW, stage=3, bucket_size_mb=0.002, lr=1e-2, **kw)

    m, zo = fresh(0)
    run(m, zo, 2, 0)
    path = save_checkpoint(root + "/a", m, zo)
    want = run(m, zo, 2, 2)
    with zo.gathered_params():
        ref = [p.detach().clone() for p in m.parameters()]
    zo.close()
    for kw in ({}, {"secondary_shard": None}):  # with it, and into plain (quantized) stage 3
        m2, z2 = fresh(1, **kw)
        load_checkpoint(path, m2, z2)
        got = run(m2, z2, 2, 2)
        with z2.gathered_params():
            ps = [p.detach().clone() for p in m2.parameters()]
        z2.close()
        if kw:  # plain quantized stage 3 keeps its own chunk exact: close, not equal
            assert all(abs(a - b) <= 1e-2 * abs(b) for a, b in zip(got, want)), (got, want)
            continue
        assert got == want, (got, want)
        assert all(torch.equal(a, b) for a, b in zip(ps, ref))
    dist.barrier()
    if rank == 0:
        shutil.rmtree(root, ignore_errors=True)
    return {"losses": want}


def check_bad_values_and_no_ops(rank, world):
    m = Net3()
    for kw, err, words in (
        (dict(stage=2, secondary_shard=2), ValueError, "secondary_shard= is a stage-3 option"),
        (dict(stage=3, secondary_shard=3), ValueError, "secondary_shard=3: must divide"),
        (dict(stage=3, secondary_shard="rack"), ValueError, "secondary_shard='rack'"),
        (dict(stage=3, secondary_shard=0), ValueError, "secondary_shard=0"),
        (
            dict(stage=3, secondary_shard=2, reshard_after_forward=False),
            ValueError,
            "reshard_after_forward=False",
        ),
    ):
        try:
            zero_opt(copy.deepcopy(m), O.AdamW, lr=1e-2, **kw)
        except err as e:
            assert words in str(e), (kw, str(e))
        else:
            raise AssertionError(f"{kw}: no error")
    # the whole shard group, one node, or single ranks: nothing kept, results as plain
    for ss in (world, "node", 1):
        zo = zero_opt(copy.deepcopy(m), O.AdamW, stage=3, lr=1e-2, secondary_shard=ss)
        assert zo.parts.core.units.secondary is None and zo.secondary_shard == ss
        zo.close()


CHECKS = [
    check_bitwise_plain_stage3,
    check_with_offload,
    check_backward_gathers_stay_in_block,
    check_kept_bytes,
    check_quantized_same_on_every_rank,
    check_resume_equals_uninterrupted,
    check_bad_values_and_no_ops,
]


def worker(rank, world):
    return run_checks(rank, world, CHECKS)
