"""Pure-torch reference of the fused Adam/AdamW step: the fallback and the test oracle.

It follows the formula in `zero_kernels.ops.hyper` [Note: one math routine] op by op, in fp32.
"""

from __future__ import annotations

import torch

from .hyper import AdamHyper


def adam_step(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    hyper: AdamHyper,
    *,
    max_exp_avg_sq: torch.Tensor | None = None,
    out_lowp: torch.Tensor | None = None,
    found_inf: torch.Tensor | None = None,
    check_finite: bool = False,
) -> None:
    """Update ``param``, ``exp_avg``, ``exp_avg_sq`` (and ``max_exp_avg_sq``) in place."""
    g = grad.float() * hyper.grad_scale
    if check_finite and found_inf is not None and not bool(torch.isfinite(g).all()):
        found_inf.fill_(1.0)
    if found_inf is not None and bool(found_inf.item() != 0):
        return
    if hyper.maximize:
        g = -g
    p = param.float().clone()
    m = exp_avg.float()
    v = exp_avg_sq.float()
    if hyper.weight_decay != 0.0:
        if hyper.adamw:
            p.mul_(1.0 - hyper.lr * hyper.weight_decay)
        else:
            g = g + hyper.weight_decay * p
    m = hyper.beta1 * m + (1.0 - hyper.beta1) * g
    v = hyper.beta2 * v + (1.0 - hyper.beta2) * (g * g)
    src = v
    if hyper.amsgrad:
        if max_exp_avg_sq is None:
            raise ValueError("adam_step: amsgrad=True needs max_exp_avg_sq, got None")
        src = torch.maximum(max_exp_avg_sq.float(), v)
        max_exp_avg_sq.copy_(src)
    denom = src.sqrt() / hyper.bias_correction2_sqrt + hyper.eps
    p = p - hyper.step_size * (m / denom)
    param.copy_(p)
    exp_avg.copy_(m)
    exp_avg_sq.copy_(v)
    if out_lowp is not None:
        out_lowp.copy_(p)
