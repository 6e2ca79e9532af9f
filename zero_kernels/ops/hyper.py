"""Hyper-parameters of one Adam/AdamW step, shared by every backend.

[Note: one math routine]
Every backend (C++ for CPU, CUDA, Triton, the pure-torch reference) computes, per element i,
in fp32 whatever the storage dtype:

    g   = grad[i] * grad_scale                  (grad_scale = clip_coef / loss_scale)
    g   = -g                                    if maximize
    p   = p * (1 - lr * wd)                     if adamw (decoupled weight decay)
    g   = g + wd * p                            if adam  (L2 penalty)
    m   = beta1 * m + (1 - beta1) * g
    v   = beta2 * v + (1 - beta2) * g * g
    vm  = max(vm, v)                            if amsgrad (vm is max_exp_avg_sq)
    p   = p - (lr / bc1) * m / (sqrt(vm or v) / sqrt(bc2) + eps)
          with bc1 = 1 - beta1**step, bc2 = 1 - beta2**step
    out_lowp[i] = bf16/fp16(p)                  if an out_lowp buffer is given

With check_finite, a non-finite g anywhere sets found_inf and then nothing at all is written
(params, states and out_lowp stay as they were). A found_inf that is already non-zero on entry
(an overflow seen on another rank) also skips the step. The scan for non-finite grads is a
separate read of the grads (4 bytes/param): the 34 bytes/param of the full shard step are
p, g, m, v read + p, m, v written (28) + g read by the scan (4) + out_lowp written (2).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class AdamHyper:
    """One step's scalars. ``step`` is the 1-based step count after this step's increment."""

    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    step: int
    adamw: bool
    amsgrad: bool = False
    maximize: bool = False
    grad_scale: float = 1.0  # grads are multiplied by this first (clip coefficient / loss scale)

    def __post_init__(self) -> None:
        if not self.step >= 1:
            raise ValueError(f"AdamHyper: step must be >= 1, got step={self.step!r}")
        if not 0.0 <= self.beta1 < 1.0:
            raise ValueError(f"AdamHyper: beta1 must be in [0, 1), got beta1={self.beta1!r}")
        if not 0.0 <= self.beta2 < 1.0:
            raise ValueError(f"AdamHyper: beta2 must be in [0, 1), got beta2={self.beta2!r}")

    @property
    def bias_correction1(self) -> float:
        return 1.0 - self.beta1**self.step

    @property
    def bias_correction2_sqrt(self) -> float:
        return math.sqrt(1.0 - self.beta2**self.step)

    @property
    def step_size(self) -> float:
        return self.lr / self.bias_correction1
