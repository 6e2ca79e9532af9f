"""Checks run in spawned gloo ranks by tests/test_compiled_autograd.py."""

from __future__ import annotations

import copy

from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from zero_kernels import ZeroOptimizer


def _rel(a, b) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def check_compiled_autograd(rank: int, world: int) -> dict:
    """torch.compile'd model + compiled autograd: stages 1/2 give DDP's result (the gradient
    hooks run eagerly at graph breaks), stage 3 refuses with a clear error."""
    import torch._dynamo
    import torch._dynamo.compiled_autograd as ca
    from torch._dynamo.utils import counters

    enable = getattr(ca, "_enable", None) or ca.enable
    out = {}
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))

    def train(stage: int):
        m1, m2 = copy.deepcopy(base), copy.deepcopy(base)
        zo = ZeroOptimizer(m1, torch.optim.AdamW, stage=stage, lr=1e-2, bucket_size_mb=0.0005)
        ddp = DDP(m2)
        ref = torch.optim.AdamW(m2.parameters(), lr=1e-2)
        c1 = torch.compile(m1, backend="aot_eager")
        try:
            for step in range(3):
                x = torch.randn(8, 16, generator=torch.Generator().manual_seed(step * 10 + rank))
                with enable(torch.compile(backend="aot_eager")):
                    c1(x).pow(2).mean().backward()
                zo.clip_grad_norm_(0.05)
                zo.step()
                zo.zero_grad()
                ddp(x).pow(2).mean().backward()
                torch.nn.utils.clip_grad_norm_(m2.parameters(), 0.05)
                ref.step()
                ref.zero_grad()
            return max(_rel(a, b) for a, b in zip(m1.parameters(), m2.parameters()))
        finally:
            zo.close()

    for stage in (1, 2):
        torch._dynamo.reset()
        counters.clear()
        err = train(stage)
        assert counters["compiled_autograd"], "compiled autograd did not run"
        assert err <= 1e-6, (stage, err)
        out[f"stage {stage}"] = "ok"
    # stage 3: refused at the first forward when the config flag is on; with compiled autograd
    # switched on around backward only, autograd's own error (never a silent wrong result)
    torch._dynamo.reset()
    m = copy.deepcopy(base)
    zo = ZeroOptimizer(m, torch.optim.AdamW, stage=3, lr=1e-2)
    try:
        with torch._dynamo.config.patch(compiled_autograd=True):
            m(torch.randn(8, 16))
        raise AssertionError("stage 3 ran a forward with compiled autograd on")
    except RuntimeError as e:
        assert "compiled autograd" in str(e) and "stage 1 or 2" in str(e), str(e)
    zo.close()
    try:
        train(3)
        raise AssertionError("stage 3 under compiled autograd gave no error")
    except RuntimeError as e:
        out["stage 3"] = "refused" if "stage 1 or 2" in str(e) else "autograd error"
    return out
