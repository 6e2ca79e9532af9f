"""The optimizers the demo offers by name, with defaults that train the small GPT in a few steps.

`MuonAdamW` is one `torch.optim.Optimizer` that steps matrices with Muon (momentum, then
Newton-Schulz orthogonalisation) and every other parameter with AdamW, so it can be handed to
`ZeroOptimizer` like any torch optimizer; it needs whole matrices, which ZeroOptimizer gives to
optimizers that are not elementwise.
"""

from __future__ import annotations

import math

import torch

__all__ = ["OPTIMIZER_CHOICES", "MuonAdamW", "optimizer_spec"]

OPTIMIZER_CHOICES = ("adamw", "adam", "fused-adamw", "sgd", "adafactor", "muon")


def optimizer_spec(name: str, lr: float | None = None) -> tuple[type, dict]:
    """(optimizer class, constructor keyword arguments) for a demo optimizer name."""
    if name == "adamw":
        return torch.optim.AdamW, {"lr": lr or 1e-3, "weight_decay": 0.01}
    if name == "adam":
        return torch.optim.Adam, {"lr": lr or 1e-3}
    if name == "fused-adamw":
        from ..fused_adam import FusedAdamW

        return FusedAdamW, {"lr": lr or 1e-3, "weight_decay": 0.01}
    if name == "sgd":
        return torch.optim.SGD, {"lr": lr or 0.3, "momentum": 0.9}
    if name == "adafactor":
        return torch.optim.Adafactor, {"lr": lr or 1e-2}
    if name == "muon":
        return MuonAdamW, {"lr": lr or 0.02, "adamw_lr": 3e-3}
    raise ValueError(f"--optimizer must be one of {', '.join(OPTIMIZER_CHOICES)}; got {name!r}")


def _orthogonalize(g: torch.Tensor, steps: int = 5, eps: float = 1e-7) -> torch.Tensor:
    """Newton-Schulz iteration towards U V^T of g = U S V^T (Muon's quintic coefficients)."""
    a, b, c = 3.4445, -4.7750, 2.0315
    x = g.float()
    transposed = x.size(0) > x.size(1)
    if transposed:
        x = x.T
    x = x / (x.norm() + eps)
    for _ in range(steps):
        s = x @ x.T
        x = a * x + (b * s + c * s @ s) @ x
    return x.T if transposed else x


class MuonAdamW(torch.optim.Optimizer):
    """Muon for 2-D parameters, AdamW (with ``adamw_lr``) for the rest; weight decay on both."""

    def __init__(
        self,
        params,
        lr: float = 0.02,
        momentum: float = 0.95,
        adamw_lr: float = 3e-3,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
    ) -> None:
        defaults = dict(
            lr=lr,
            momentum=momentum,
            adamw_lr=adamw_lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
        )
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad
                state = self.state[p]
                if p.ndim == 2:
                    buf = state.setdefault("momentum_buffer", torch.zeros_like(p))
                    buf.lerp_(g, 1 - group["momentum"])
                    update = _orthogonalize(g.lerp(buf, group["momentum"]))
                    lr = group["lr"] * 0.2 * math.sqrt(max(p.shape))  # AdamW-matched RMS
                    p.mul_(1 - group["lr"] * group["weight_decay"])
                    p.add_(update.to(p.dtype), alpha=-lr)
                else:
                    b1, b2 = group["betas"]
                    if not state:
                        state["step"] = 0
                        state["exp_avg"] = torch.zeros_like(p)
                        state["exp_avg_sq"] = torch.zeros_like(p)
                    state["step"] += 1
                    m, v, t = state["exp_avg"], state["exp_avg_sq"], state["step"]
                    m.lerp_(g, 1 - b1)
                    v.mul_(b2).addcmul_(g, g, value=1 - b2)
                    denom = (v / (1 - b2**t)).sqrt_().add_(group["eps"])
                    p.mul_(1 - group["adamw_lr"] * group["weight_decay"])
                    p.addcdiv_(m, denom, value=-group["adamw_lr"] / (1 - b1**t))
        return loss
