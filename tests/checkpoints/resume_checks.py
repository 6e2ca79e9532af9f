"""The ordinary resume of bf16 params (the model's state_dict and the optimizer's, as HF Trainer
and Lightning save them) continues from the fp32 masters, not from the params rounded to bf16:
bit for bit the uninterrupted run, at stages 1-3, in either load order, from the rank's shard
or the consolidated dict (issue 21). Run on spawned gloo ranks by
tests/checkpoints/test_resume_masters.py."""

from __future__ import annotations

import copy
import time

import torch
import torch.distributed as dist
from numerics import rel_err
from torch import nn
from zero_opt import zero_opt


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.blocks = nn.ModuleList(nn.Linear(16, 16) for _ in range(2))
        self.out = nn.Linear(16, 4)

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        for b in self.blocks:
            h = h + torch.tanh(b(h))
        return self.out(h)


def _batch(rank, step):
    g = torch.Generator().manual_seed(10 * step + rank)
    return torch.randn(5, 8, generator=g).bfloat16(), torch.randn(5, 4, generator=g).bfloat16()


def _train(m, zo, rank, steps):
    dtype = next(m.parameters()).dtype
    for s in steps:
        x, y = _batch(rank, s)
        zo.zero_grad()
        (m(x.to(dtype)).float() - y.float()).pow(2).mean().backward()
        zo.step()


def _params(zo, m):
    with zo.gathered_params():
        return [p.detach().clone() for p in m.parameters()]


def check_bf16_resume(rank: int, world: int) -> dict:
    out = {}
    kw = dict(lr=3e-3, weight_decay=0.1)
    for stage in (1, 2, 3):
        torch.manual_seed(0)
        base = Net().bfloat16()
        m = copy.deepcopy(base)
        zo = zero_opt(m, torch.optim.AdamW, stage=stage, **kw)
        _train(m, zo, rank, range(3))
        saved_m = {k: v.clone() for k, v in m.state_dict().items()}
        saved_o = copy.deepcopy(zo.state_dict())
        cons = [zo.consolidated_state_dict(to=0)]
        dist.broadcast_object_list(cons, src=0)
        assert all(st["fp32_master"].dtype == torch.float32 for st in cons[0]["state"].values()), (
            "the consolidated dict holds the fp32 masters"
        )
        _train(m, zo, rank, range(3, 6))
        want = _params(zo, m)
        zo.close()
        for how in ("model, then shard", "shard, then model", "model, then consolidated"):
            m2 = copy.deepcopy(base)
            zo2 = zero_opt(m2, torch.optim.AdamW, stage=stage, **kw)
            if how == "shard, then model":
                zo2.load_state_dict(saved_o)
                m2.load_state_dict(saved_m)
            else:
                m2.load_state_dict(saved_m)
                zo2.load_state_dict(saved_o if "shard" in how else cons[0])
            _train(m2, zo2, rank, range(3, 6))
            got = _params(zo2, m2)
            for (n, _), a, b in zip(m2.named_parameters(), got, want):
                assert torch.equal(a, b), (
                    f"stage {stage}, {how}: {n} differs from the uninterrupted run by "
                    f"{rel_err(a, b):.3g}"
                )
            zo2.close()
            out[f"stage {stage}: {how}"] = "ok"
    # a plain torch optimizer loads the consolidated dict (the master entry unused)
    torch.manual_seed(0)
    plain = Net().bfloat16()
    to = torch.optim.AdamW(plain.parameters(), **kw)
    to.load_state_dict(cons[0])
    x, y = _batch(rank, 0)
    (plain(x).float() - y.float()).pow(2).mean().backward()
    to.step()
    out["plain torch loads it"] = "ok"
    return out


def check_shard_mismatch(rank: int, world: int) -> dict:
    """A rank's shard (opt.state_dict()) loaded where it does not fit names what differs: another
    bucket_size_mb (stages 1-2; stage 3 lays out by unit, so it loads there), another rank's
    shard. Before, the message repeated the same world size, rank and mode on both sides."""
    out = {}
    for stage in (1, 2, 3):
        torch.manual_seed(0)
        base = Net()
        m = copy.deepcopy(base)
        zo = zero_opt(m, torch.optim.AdamW, stage=stage, bucket_size_mb=0.001, lr=1e-2)
        _train(m, zo, rank, range(2))
        sd = copy.deepcopy(zo.state_dict())
        zo.close()
        m2 = copy.deepcopy(base)
        zo2 = zero_opt(m2, torch.optim.AdamW, stage=stage, bucket_size_mb=25, lr=1e-2)
        try:
            zo2.load_state_dict(sd)
            assert stage == 3, f"stage {stage}: a shard of other buckets was loaded"
            out[f"stage {stage} other buckets"] = "loaded (units)"
        except ValueError as e:
            msg = str(e)
            assert stage != 3, msg
            assert "buckets of" in msg and "bucket_size_mb" in msg and "save_checkpoint" in msg, msg
            out[f"stage {stage} other buckets"] = "named"
        zo2.close()
        others = [None] * world
        dist.all_gather_object(others, sd)
        m3 = copy.deepcopy(base)
        zo3 = zero_opt(m3, torch.optim.AdamW, stage=stage, bucket_size_mb=0.001, lr=1e-2)
        try:
            zo3.load_state_dict(others[(rank + 1) % world])
            raise AssertionError(f"stage {stage}: another rank's shard was loaded")
        except ValueError as e:
            assert f"it is rank {(rank + 1) % world}'s shard, this is rank {rank}" in str(e), e
            out[f"stage {stage} other rank"] = "named"
        zo3.close()
        # the DDP idiom: rank 0 saves opt.state_dict() once, every rank loads that file. Every
        # rank raises the same error at once (rank 0's load fits; it must not go on into the
        # params' all-gather alone), and the failed load changes nothing
        box = [sd]
        dist.broadcast_object_list(box, src=0)
        m4, twin = copy.deepcopy(base), copy.deepcopy(base)
        zo4 = zero_opt(m4, torch.optim.AdamW, stage=stage, bucket_size_mb=0.001, lr=1e-2)
        zt = zero_opt(twin, torch.optim.AdamW, stage=stage, bucket_size_mb=0.001, lr=1e-2)
        t0 = time.monotonic()
        try:
            zo4.load_state_dict(box[0])
            raise AssertionError(f"stage {stage}: rank 0's shard loaded on rank {rank}")
        except ValueError as e:
            took = time.monotonic() - t0
            msg = str(e)
            assert "rank(s) 1 of 2" in msg and "it is rank 0's shard, this is rank 1" in msg, msg
            assert "consolidated_state_dict" in msg and "save_checkpoint" in msg, msg
            assert took < 10, f"stage {stage}: the error took {took:.1f} s"
        _train(m4, zo4, rank, range(2))
        _train(twin, zt, rank, range(2))
        gap = max(
            rel_err(zo4.full_param(a), zt.full_param(b))
            for a, b in zip(m4.parameters(), twin.parameters())
        )
        assert gap == 0.0, f"stage {stage}: the failed load changed the run ({gap})"
        zo4.close()
        zt.close()
        out[f"stage {stage} rank 0's shard everywhere"] = "named"
    return out
