"""Checks run in spawned gloo ranks by tests/stages/test_step_api.py: ``opt.step(**kwargs)``
reaches the
inner optimizer's step (as torch's ZeroRedundancyOptimizer forwards them), keys the inner
optimizer adds to its param groups during a step appear in ``opt.param_groups``, and a keyword
no step takes is a TypeError naming it (the fused Adam path included)."""

from __future__ import annotations

import copy

import torch
from numerics import rel_err
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from zero_opt import zero_opt


class ScaledMomentum(torch.optim.Optimizer):
    """Element-wise: momentum SGD whose step takes ``scale`` (multiplies the lr) and records it
    (and a count of its steps) in every param group."""

    zero_elementwise = True

    def __init__(self, params, lr=0.1, momentum=0.9):
        super().__init__(params, dict(lr=lr, momentum=momentum))

    @torch.no_grad()
    def step(self, closure=None, *, scale=1.0):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for g in self.param_groups:
            g["last_scale"] = scale
            g["calls"] = g.get("calls", 0) + 1
            for p in g["params"]:
                if p.grad is None:
                    continue
                buf = self.state[p].setdefault("m", torch.zeros_like(p))
                buf.mul_(g["momentum"]).add_(p.grad)
                p.add_(buf, alpha=-g["lr"] * scale)
        return loss


class ScaledNormalized(ScaledMomentum):
    """Needs whole tensors: each param's update is its gradient over the gradient's norm."""

    zero_elementwise = False

    @torch.no_grad()
    def step(self, closure=None, *, scale=1.0):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for g in self.param_groups:
            g["last_scale"] = scale
            g["calls"] = g.get("calls", 0) + 1
            for p in g["params"]:
                if p.grad is not None:
                    p.add_(p.grad / p.grad.norm().clamp_min(1e-12), alpha=-g["lr"] * scale)
        return loss


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 10), nn.Tanh(), nn.Linear(10, 2)
    )


def _x(rank: int, step: int) -> torch.Tensor:
    return torch.randn(5, 6, generator=torch.Generator().manual_seed(100 * step + rank))


def _backward(f, x) -> torch.Tensor:
    loss = f(x).pow(2).mean()
    loss.backward()
    return loss.detach()


def _groups(groups) -> list[dict]:
    return [{k: v for k, v in g.items() if k != "params"} for g in groups]


def _params_of(zo, m) -> list[torch.Tensor]:
    if zo.stage == 3:
        zo.wait_params()
        with zo.gathered_params(m):
            return [p.detach().clone() for p in m.parameters()]
    return [p.detach().clone() for p in m.parameters()]


def check_step_kwargs(rank: int, world: int) -> dict:
    out = {}
    for cls, stage in (
        (ScaledMomentum, 2),
        (ScaledMomentum, 3),
        (ScaledNormalized, 1),
        (ScaledNormalized, 3),
    ):
        key = f"{cls.__name__} stage {stage}"
        base = _model()
        m1, m2 = copy.deepcopy(base), copy.deepcopy(base)
        groups1 = [
            {"params": list(m1[0].parameters()), "lr": 0.05},
            {"params": list(m1[2].parameters()) + list(m1[4].parameters())},
        ]
        groups2 = [
            {"params": list(m2[0].parameters()), "lr": 0.05},
            {"params": list(m2[2].parameters()) + list(m2[4].parameters())},
        ]
        zo = zero_opt(groups1, cls, stage=stage, module=m1, bucket_size_mb=0.0002, lr=0.1)
        assert zo.mode == ("flat" if cls.zero_elementwise else "whole"), (key, zo.mode)
        ddp = DDP(m2)
        to = cls(groups2, lr=0.1)
        for step in range(4):
            scale = 0.5 + step
            zo.zero_grad()
            to.zero_grad()
            if step == 3:  # a closure and a keyword together: the closure's loss comes back
                x = _x(rank, step)
                l1 = zo.step(lambda f=m1, x=x: _backward(f, x), scale=scale)
                l2 = to.step(lambda f=ddp, x=x: _backward(f, x), scale=scale)
                assert torch.equal(l1, l2), (l1, l2)
            else:
                m1(_x(rank, step)).pow(2).mean().backward()
                ddp(_x(rank, step)).pow(2).mean().backward()
                zo.step(scale=scale)
                to.step(scale=scale)
            assert _groups(zo.param_groups) == _groups(to.param_groups), (
                key,
                step,
                _groups(zo.param_groups),
                _groups(to.param_groups),
            )
        assert zo.param_groups[0]["last_scale"] == 3.5 and zo.param_groups[1]["calls"] == 4
        errs = [rel_err(a, b) for a, b in zip(_params_of(zo, m1), m2.parameters())]
        assert max(errs) <= 1e-6, (key, errs)
        # a keyword the inner step does not take: a TypeError naming it, nothing stepped
        before = _params_of(zo, m1)
        try:
            zo.step(scale=1.0, sclae=2.0)
            raise AssertionError(f"{key}: an unknown step keyword was accepted")
        except TypeError as e:
            assert "sclae" in str(e) and cls.__name__ in str(e), e
        after = _params_of(zo, m1)
        assert all(torch.equal(a, b) for a, b in zip(before, after)), key
        zo.close()
        out[key] = "ok"
    # torch's Adam/AdamW take no keyword: refused by the fused kernel's path and by the unfused
    for fused in (True, False):
        m = _model()
        zo = zero_opt(m, torch.optim.AdamW, stage=2, fused_adam=fused, lr=1e-2)
        assert all(zo.parts.core.runner.fused) == fused
        m(_x(rank, 0)).pow(2).mean().backward()
        before = _params_of(zo, m)
        try:
            zo.step(scale=2.0)
            raise AssertionError(f"fused={fused}: step(scale=2.0) was accepted by AdamW")
        except TypeError as e:
            assert "'scale'" in str(e) and "AdamW" in str(e), e
        assert all(torch.equal(a, b) for a, b in zip(before, _params_of(zo, m)))
        assert zo.parts.core.steps.n == 0
        zo.step()  # the refused call left nothing half-done: the step runs as usual
        assert not all(torch.equal(a, b) for a, b in zip(before, _params_of(zo, m)))
        zo.close()
        out[f"AdamW fused={fused}"] = "ok"
    return out
