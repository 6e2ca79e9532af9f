"""Checks run inside 2 gloo workers for tests/offload/test_offload_params.py: offload_params="nvme"
at
stage 3 against the same run without offload (bitwise: fp32 and bf16 params, clipping, with and
without offload_optimizer, prefetch on and off, resharding on and off, params kept whole), reads
ahead taken, checkpoints both ways with stage 2, whole-param access, memory counts, the file's
lifetime and the refusals."""

from __future__ import annotations

import gc
import os
import tempfile

import torch
from dist_utils import run_checks
from torch import nn
from zero_opt import zero_opt

import zero_kernels

DIR = os.environ.get("ZK_TEST_OFFLOAD_DIR") or tempfile.gettempdir()


class Net(nn.Module):
    """A stem, four blocks (a ModuleList: four units) and a head (the root unit)."""

    def __init__(self, width: int = 48):
        super().__init__()
        self.stem = nn.Linear(24, width)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(width, width), nn.Tanh(), nn.Linear(width, width))
            for _ in range(4)
        )
        self.head = nn.Linear(width, 24)

    def forward(self, x):
        x = self.stem(x)
        for b in self.blocks:
            x = x + b(x)
        return self.head(x)


def model(dtype=torch.float32, width=48):
    torch.manual_seed(0)
    return Net(width).to(dtype)


def build(m, stage=3, params=True, optim=False, bucket_mb=0.004, **kw):
    extra = {}
    if params:
        extra["offload_params"] = "nvme"
    if optim:
        extra.update(offload_optimizer="nvme", offload_staging_mb=0.1)
    if params or optim:
        extra["offload_dir"] = DIR
    return zero_opt(
        m,
        torch.optim.AdamW,
        stage=stage,
        lr=1e-2,
        weight_decay=0.1,
        bucket_size_mb=bucket_mb,
        **extra,
        **kw,
    )


def train(m, opt, steps, rank, start=0):
    for s in range(start, start + steps):
        g = torch.Generator().manual_seed(100 * s + rank)
        x = torch.randn(6, 24, generator=g).to(next(m.parameters()).dtype)
        opt.zero_grad()
        m(x).float().square().mean().backward()
        opt.clip_grad_norm_(0.05)  # clipping on: every step is clipped here
        opt.step()


def snapshot(m, opt):
    w = {k: v.detach().clone() for k, v in m.state_dict().items()}
    st = [opt.full_state(p) for p in m.parameters()]
    full = [opt.full_param(p) for p in m.parameters()]
    return w, st, full


def same(a, b) -> bool:
    (wa, sa, fa), (wb, sb, fb) = a, b
    return (
        wa.keys() == wb.keys()
        and all(torch.equal(wa[k], wb[k]) for k in wa)
        and all(
            x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x) for x, y in zip(sa, sb)
        )
        and all(torch.equal(x, y) for x, y in zip(fa, fb))
    )


def _bitwise(dtype, width=48, **kw):
    """``width=96`` with ``bucket_mb=0.1``: masters of several pages per bucket, evicted and
    read back (smaller buckets share their master pages, kept in RAM)."""

    def check(rank, world):
        runs, info = [], {}
        for params in (False, True):
            m = model(dtype, width)
            opt = build(m, params=params, **kw)
            train(m, opt, 4, rank)
            runs.append(snapshot(m, opt))
            if params:
                tier = opt.parts.core.store.tier
                moved = [k for k, r in tier.records.items() if r.master and not r.pinned]
                info = {"ahead_hits": tier.ahead_hits, "masters_moved": len(moved)}
                assert tier.ahead_hits > 0, "no acquire found its shard read ahead"
                if width > 48 and dtype == torch.bfloat16:
                    assert len(moved) >= 4, tier.records.keys()
            opt.close()
        assert same(*runs), f"{dtype} {kw}: the run with offload_params differs"
        return info

    tags = "".join(f"_{k}_{v}" for k, v in kw.items()) + (f"_w{width}" if width != 48 else "")
    check.__name__ = f"bitwise_{str(dtype)[6:]}{tags}"
    return check


def memory_counts(rank, world):
    """Between steps RAM holds only the reads ahead (at most the largest unit's shards and
    masters), the pinned shards and the master pages two buckets share; every shard and master
    has its place on disk; a step writes every one back once."""
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        reps = []
        for params in (False, True):
            m = model(dtype, width=96)
            opt = build(m, params=params, bucket_mb=0.1)
            train(m, opt, 2, rank)
            reps.append(opt.memory_report())
            if params:
                tier = opt.parts.core.store.tier
                rep = reps[-1]
                assert rep["param_bytes"] == tier.ram_bytes(master=False)
                assert rep["master_bytes"] == tier.ram_bytes(master=True)
                ram = rep["offload_param_ram_bytes"]
                assert ram == rep["param_bytes"] + rep["master_bytes"]
                assert ram - tier.fixed_bytes <= tier.ahead_bytes, (rep, tier.ahead_bytes)
                assert rep["offload_param_disk_bytes"] == tier.nbytes > 0
                before = tier.bytes_written
                train(m, opt, 1, rank, start=2)
                assert tier.bytes_written - before == tier.nbytes  # every record written back
                assert rep["offload_param_ram_peak_bytes"] < tier.nbytes
            opt.close()
        without, with_ = reps
        # between steps: the reads ahead for the next forward (up to ahead_bytes) only
        assert with_["param_bytes"] < without["param_bytes"], (without, with_)
        if dtype == torch.bfloat16:
            assert with_["master_bytes"] < without["master_bytes"] / 2, (without, with_)
        out[str(dtype)[6:]] = {
            k: (without[k], with_[k]) for k in ("param_bytes", "master_bytes", "total_bytes")
        } | {
            "disk": with_["offload_param_disk_bytes"],
            "ram_peak": with_["offload_param_ram_peak_bytes"],
        }
    return out


def checkpoints(rank, world):
    """Saved with offload_params at stage 3, loaded without it at stage 2, and saved at stage 2,
    loaded at stage 3 with it: the next steps equal those of the same runs without offload
    (fp32 and bf16 params, the latter with masters moved to the file; int8 moments, kept in
    RAM beside the offloaded shards: a save reads their codes bucket by bucket with the
    shards)."""
    for dtype, width, mb in ((torch.float32, 48, 0.004), (torch.bfloat16, 96, 0.1)):
        _checkpoints(rank, dtype, width, mb)
    _checkpoints(rank, torch.float32, 48, 0.004, state_dtype="int8", state_block=64)
    return {}


def _checkpoints(rank, dtype, width, mb, **kw):
    d = os.path.join(DIR, f"zk-offp-ckpt-{os.getppid()}")

    def resumed(first, second):
        m = model(dtype, width)
        o = build(m, stage=first[0], params=first[1], bucket_mb=mb, **kw)
        train(m, o, 3, rank)
        path = zero_kernels.save_checkpoint(d, m, o, extra={"step": 3})
        o.close()
        m2 = model(dtype, width)
        with torch.no_grad():
            for p in m2.parameters():
                p.zero_()
        o2 = build(m2, stage=second[0], params=second[1], bucket_mb=mb, **kw)
        zero_kernels.load_checkpoint(path, m2, o2)
        train(m2, o2, 2, rank, start=3)
        got = snapshot(m2, o2)
        o2.close()
        return got

    for first, second in (((3, True), (2, False)), ((2, False), (3, True)), ((3, True), (3, True))):
        want = resumed((first[0], False), (second[0], False))
        assert same(resumed(first, second), want), f"{dtype} saved {first}, loaded {second}"
    torch.distributed.barrier()
    if rank == 0:
        import shutil

        shutil.rmtree(d, ignore_errors=True)


def whole_param_access(rank, world):
    """state_dict round trip, model.load_state_dict, set_full_param and gathered_params edits
    with offloaded shards: the same as without offload."""
    runs = []
    for params in (False, True):
        m = model(torch.bfloat16)
        o = build(m, params=params)
        train(m, o, 2, rank)
        sd, msd = o.state_dict(), {k: v.clone() for k, v in m.state_dict().items()}
        m2 = model(torch.bfloat16)
        o2 = build(m2, params=params)
        m2.load_state_dict(msd)
        o2.load_state_dict(sd)
        o2.set_full_param(m2.head.bias, torch.full_like(m2.head.bias, 0.25, dtype=torch.float32))
        with o2.gathered_params(m2.blocks[1], modifier_rank=0):
            if rank == 0:
                with torch.no_grad():
                    m2.blocks[1][0].weight.mul_(0.5)
        train(m2, o2, 2, rank, start=2)
        runs.append(snapshot(m2, o2))
        o.close()
        o2.close()
    assert same(*runs), "whole-param access with offload_params differs"
    return {}


def add_group(rank, world):
    """add_param_group (the optimizer built again over the offloaded state): the same as
    without offload, and the first build's file gone."""
    runs = []
    for params in (False, True):
        m = model(torch.bfloat16, 96)
        body = [p for n, p in m.named_parameters() if not n.startswith("head.")]
        extra = {"offload_params": "nvme", "offload_dir": DIR} if params else {}
        o = zero_opt(
            [{"params": body}], torch.optim.AdamW, stage=3, module=m, lr=1e-2,
            bucket_size_mb=0.1, **extra,
        )  # fmt: skip
        train(m, o, 2, rank)
        first = o.parts.core.store.tier.path if params else None
        o.add_param_group({"params": m.head.parameters(), "lr": 5e-3})
        train(m, o, 2, rank, start=2)
        runs.append(snapshot(m, o))
        if params:
            assert not os.path.exists(first), "the first build's file outlived it"
        o.close()
    assert same(*runs), "add_param_group with offload_params differs"
    return {}


def file_lifetime(rank, world):
    m = model()
    o = build(m)
    path = o.parts.core.store.tier.path
    assert os.path.exists(path) and os.path.basename(path).startswith("zero_kernels-params-")
    train(m, o, 1, rank)
    o.close()
    assert not os.path.exists(path), path
    assert all(torch.isfinite(p).all() for p in m.parameters()), "close: params not handed back"
    o = build(model(), optim=True)
    paths = [o.parts.core.store.tier.path, o.parts.core.runner.swap.path]
    del o
    gc.collect()
    left = [p for p in paths if os.path.exists(p)]
    assert not left, f"{left} outlived its optimizer"
    return {}


def refusals(rank, world):
    msgs = {}
    cases = [
        ("stage 2", 2, dict(offload_params="nvme", offload_dir=DIR), ValueError, "'nvme'"),
        ("stage 1", 1, dict(offload_params="nvme", offload_dir=DIR), ValueError, "stage-3"),
        ("no dir", 3, dict(offload_params="nvme"), ValueError, "offload_dir="),
        ("missing dir", 3, dict(offload_params="nvme", offload_dir=DIR + "/no"), ValueError, "dir"),
        ("cpu tier alone", 3, dict(offload_params="cpu"), ValueError, "offload_optimizer='cpu'"),
        ("bad value", 3, dict(offload_params="disk"), ValueError, "'disk'"),
    ]
    for what, stage, kw, err, word in cases:
        try:
            zero_opt(model(), torch.optim.AdamW, stage=stage, lr=1e-3, **kw)
            raise AssertionError(f"{what}: accepted")
        except err as e:
            assert "offload" in str(e) and word in str(e), e
            msgs[what] = "raised"
    left = [f for f in os.listdir(DIR) if f.startswith("zero_kernels-params-")]
    assert not left, f"a refused construction left {left}"
    return msgs


CHECKS = [
    _bitwise(torch.float32),
    _bitwise(torch.bfloat16),
    _bitwise(torch.float32, optim=True),
    _bitwise(torch.bfloat16, optim=True),
    _bitwise(torch.float32, prefetch=0, reshard_after_forward=False),
    _bitwise(torch.bfloat16, prefetch=2, persist_below=64),
    _bitwise(torch.bfloat16, width=96, bucket_mb=0.1),
    _bitwise(torch.bfloat16, width=96, bucket_mb=0.1, optim=True),
    memory_counts,
    checkpoints,
    whole_param_access,
    add_group,
    file_lifetime,
    refusals,
]


def worker(rank, world):
    return run_checks(rank, world, CHECKS)
