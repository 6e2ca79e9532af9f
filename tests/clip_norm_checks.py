"""Checks run in spawned gloo ranks by tests/test_clip_norm.py: ``ZeroOptimizer.clip_grad_norm_``
returns the float64 norm of DDP's full gradients to ~1e-8 relative, host and sync-free paths,
stages 1-3, p = 2, 1 and 3, on a model whose shards hold a million elements each, where torch's
reduction of one long fp32 tensor is off by ~1e-5 ([Note: accurate norms] in
zero_kernels/syncfree.py); and the clipped step equals DDP's clipped by that exact norm."""

from __future__ import annotations

import copy

import torch
from numerics import rel_err
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from zero_kernels import ZeroOptimizer

CASES = [  # (stage, norm_type, sync_free)
    (1, 2.0, False),
    (2, 2.0, False),
    (3, 2.0, False),
    (2, 2.0, True),
    (3, 2.0, True),
    (2, 1.0, False),
    (3, 3.0, True),
]
NORM_TOL = 1.5e-7  # ours (an fp32 number) against float64: 6e-8 is fp32's own rounding


def _model() -> nn.Module:
    torch.manual_seed(0)
    # 2.1M params: at 2 ranks each shard holds about a million elements
    return nn.Sequential(nn.Linear(64, 2048), nn.Tanh(), nn.Linear(2048, 1024), nn.Linear(1024, 8))


def _x(rank: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * step + rank)
    # rows of very different scales: gradients whose magnitudes span decades
    return torch.randn(16, 64, generator=g) * torch.logspace(-3, 1, 16).unsqueeze(1)


def _exact_norm(ps, p: float) -> float:
    return float(sum(q.grad.double().abs().pow(p).sum() for q in ps)) ** (1.0 / p)


def check_clip_norms(rank: int, world: int) -> dict:
    out = {}
    for stage, p, sync_free in CASES:
        key = f"stage {stage} p={p} sync_free={sync_free}"
        base = _model()
        m1, m2 = copy.deepcopy(base), copy.deepcopy(base)
        kw = {"lr": 1e-3, "weight_decay": 0.01}
        zo = ZeroOptimizer(m1, torch.optim.AdamW, stage=stage, **kw)
        zo.parts.core.sync_free = sync_free
        ddp = DDP(m2)
        to = torch.optim.AdamW(m2.parameters(), **kw)
        worst = 0.0
        for step in range(2):
            zo.zero_grad()
            to.zero_grad()
            m1(_x(rank, step)).pow(2).mean().backward()
            ddp(_x(rank, step)).pow(2).mean().backward()
            exact = _exact_norm(list(m2.parameters()), p)
            # ours against the float64 norm of its own full gradients (after the first step the
            # two models' gradients differ by the last bits of their params)
            own = float(sum(zo.full_grad(q).double().abs().pow(p).sum() for q in m1.parameters()))
            own **= 1.0 / p
            n1 = zo.clip_grad_norm_(0.05, p)
            err = abs(float(n1) - own) / own
            worst = max(worst, err)
            assert err <= NORM_TOL, (key, step, float(n1), own, err)
            assert abs(own - exact) <= 1e-6 * exact, (key, step, own, exact)
            # DDP's gradients clipped by the exact norm (torch's own clip would use its
            # per-param fp32 norms, themselves ~1e-5 off on a 2M-element weight)
            coef = min(1.0, 0.05 / (exact + 1e-6))
            for q in m2.parameters():
                q.grad.mul_(coef)
            zo.step()
            to.step()
        if stage == 3:
            with zo.gathered_params(m1):
                errs = [rel_err(a, b) for a, b in zip(m1.parameters(), m2.parameters())]
        else:
            errs = [rel_err(a, b) for a, b in zip(m1.parameters(), m2.parameters())]
        assert max(errs) <= 1e-6, (key, errs)
        zo.close()
        out[key] = worst
    return out


def _hwm() -> int:
    with open("/proc/self/status") as f:
        return next(int(ln.split()[1]) * 1024 for ln in f if ln.startswith("VmHWM"))


def check_sharded_grad_norm_memory(rank: int, world: int) -> dict:
    """torch's own clip_grad_norm_ on the ShardedGrads of a 16.8M-element weight: the norm takes
    no copy of the gradient (it took 5x its bytes through float64 copies: 1345 MB over a 268 MB
    gradient), and is float64-accurate."""
    torch.manual_seed(0)
    m = nn.Linear(4096, 4096)
    opt = ZeroOptimizer(m, torch.optim.SGD, stage=2, lr=0.1)
    m(torch.randn(4, 4096)).pow(2).mean().backward()
    exact = float(sum(opt.full_grad(q).double().pow(2).sum() for q in m.parameters())) ** 0.5
    grad_bytes = m.weight.numel() * 4
    with open("/proc/self/clear_refs", "w") as f:  # reset VmHWM to the current RSS
        f.write("5")
    base = _hwm()
    n = torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
    peak = _hwm() - base
    opt.close()
    assert abs(float(n) - exact) <= NORM_TOL * exact, (float(n), exact)
    assert peak <= grad_bytes // 4, f"norm of ShardedGrads: peak +{peak} B over {grad_bytes} B"
    return {"peak_bytes": peak, "grad_bytes": grad_bytes}
