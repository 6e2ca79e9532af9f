"""Checks run in spawned gloo ranks by tests/stages/test_syncfree_clip.py: torch's own
``torch.nn.utils.clip_grad_norm_`` on `ShardedGrad`s with the sync-free mode switched on for CPU
tensors ([Note: no host sync] in zero_kernels/partition/syncfree.py) reads nothing back to the host
and
gives DDP + torch's clip (the norm it returns and the clipped step)."""

from __future__ import annotations

import contextlib
import copy

import torch
from numerics import rel_err
from syncfree_checks import _model, _step_counters, _x, host_reads
from torch.nn.parallel import DistributedDataParallel as DDP
from zero_opt import zero_opt

# (stage, norm_type, foreach): every norm type with both foreach values at stage 2, the others
# at stages 1 and 3 (each clip of a ShardedGrad goes through the same dispatch at every stage)
CASES = [
    (2, 2.0, False),
    (2, 2.0, True),
    (2, float("inf"), False),
    (2, float("inf"), True),
    (2, 3.0, False),
    (2, 3.0, True),
    (1, 2.0, None),
    (1, float("inf"), True),
    (3, 3.0, None),
    (3, 2.0, True),
]


def check_torch_clip_syncfree(rank: int, world: int) -> dict:
    out = {}
    for stage, norm_type, foreach in CASES:
        key = f"stage {stage} p={norm_type} foreach={foreach}"
        base = _model()
        m1, m2 = copy.deepcopy(base), copy.deepcopy(base)
        kw = {"lr": 1e-2, "weight_decay": 0.1}
        zo = zero_opt(m1, torch.optim.AdamW, stage=stage, bucket_size_mb=0.001, **kw)
        zo.parts.core.sync_free = True
        ddp = DDP(m2)
        to = torch.optim.AdamW(m2.parameters(), **kw)
        reads: list[str] = []
        for step in range(3):
            zo.zero_grad()
            to.zero_grad()
            m1(_x(rank, step)).pow(2).mean().backward()
            ddp(_x(rank, step)).pow(2).mean().backward()
            ctx = host_reads(_step_counters(zo)) if step >= 1 else contextlib.nullcontext([])
            with ctx as seen:
                n1 = torch.nn.utils.clip_grad_norm_(
                    m1.parameters(), 0.02, norm_type, foreach=foreach
                )
                zo.step()
            reads += seen
            n2 = torch.nn.utils.clip_grad_norm_(m2.parameters(), 0.02, norm_type, foreach=foreach)
            to.step()
            assert isinstance(n1, torch.Tensor) and n1.dtype == n2.dtype, (key, n1, n2)
            assert abs(float(n1) - float(n2)) <= 1e-5 * float(n2), (key, n1, n2)
        assert not reads, f"{key}: host reads inside torch's clip_grad_norm_ + step: {reads}"
        if stage == 3:
            zo.wait_params()
            with zo.gathered_params(m1):
                errs = [rel_err(a, b) for a, b in zip(m1.parameters(), m2.parameters())]
        else:
            errs = [rel_err(a, b) for a, b in zip(m1.parameters(), m2.parameters())]
        assert max(errs) <= 1e-6, (key, errs)
        zo.close()
        out[key] = "ok"
    # mul_/div_ by a one-element tensor and a tensor list multiply by that tensor (no read)
    base = _model()
    m1, m2 = copy.deepcopy(base), copy.deepcopy(base)
    zo = zero_opt(m1, torch.optim.SGD, stage=2, bucket_size_mb=0.001, lr=0.1)
    zo.parts.core.sync_free = True
    ddp = DDP(m2)
    to = torch.optim.SGD(m2.parameters(), lr=0.1)
    m1(_x(rank, 0)).pow(2).mean().backward()
    ddp(_x(rank, 0)).pow(2).mean().backward()
    with host_reads(set()) as seen:
        for m in (m1, m2):
            ps = list(m.parameters())
            ps[0].grad.mul_(torch.tensor([0.5]))
            ps[1].grad.div_(torch.tensor(4.0, dtype=torch.float64))
            torch._foreach_mul_([p.grad for p in ps[2:4]], torch.tensor(3.0))
            torch._foreach_div_([p.grad for p in ps[4:]], [torch.tensor(2.0)] * len(ps[4:]))
        zo.step()
    assert not seen, f"host reads scaling by tensors: {seen}"
    to.step()
    errs = [rel_err(a, b) for a, b in zip(m1.parameters(), m2.parameters())]
    assert max(errs) <= 1e-6, errs
    zo.close()
    out["scale by tensors"] = "ok"
    return out
