"""DeepSpeed's full-state helpers (``deepspeed.utils.safe_get_full_fp32_param`` and its family),
with DeepSpeed's signatures, over `ZeroOptimizer`'s ``full_param`` / ``full_grad`` /
``full_state`` and their setters: a script written for DeepSpeed's ZeRO finds them where it
looks. Each finds the live ZeroOptimizer holding ``param``; each is collective (every rank calls
it with the same param), as DeepSpeed's are at stage 3.

What the getters return where DeepSpeed's return None, so a loop over every named param of a
model ported from DeepSpeed runs unchanged: a frozen param (``requires_grad=False``, held or
not: the optimizer keeps no master, gradient or state of it) gives None from all three; a param
without a gradient yet gives None from ``safe_get_full_grad``; one without optimizer state yet
(before its first step), or without that key, None from ``safe_get_full_optimizer_state``. A
trainable tensor that no live ZeroOptimizer holds is an error (DeepSpeed returns None there: a
closed optimizer or a param left out of it would read as "no value" silently). The setters
raise on a frozen param (DeepSpeed's do nothing there: a write that is lost silently).

    from zero_kernels.utils import safe_get_full_fp32_param, safe_get_full_grad
    w = safe_get_full_fp32_param(model.head.weight)      # the whole fp32 value (the master)
    g = safe_get_full_grad(model.head.weight)            # the whole averaged gradient, or None
    m = safe_get_full_optimizer_state(model.head.weight, "exp_avg")
"""

from __future__ import annotations

import torch

from .optimizer.wrappers import owner_of

__all__ = [
    "safe_get_full_fp32_param",
    "safe_get_full_grad",
    "safe_get_full_optimizer_state",
    "safe_set_full_fp32_param",
    "safe_set_full_optimizer_state",
]


def _owner(param: torch.Tensor, what: str):
    opt = owner_of(param)
    if opt is None:
        raise ValueError(
            f"{what}: the tensor of shape {tuple(param.shape)} is not held by a live "
            "ZeroOptimizer (pass a param of the model the optimizer was built over)"
        )
    return opt


def safe_get_full_fp32_param(param: torch.Tensor) -> torch.Tensor | None:
    """The whole param at full precision (the fp32 master of a bf16/fp16 param); None for a
    frozen param, as DeepSpeed's."""
    if not param.requires_grad:
        return None
    return _owner(param, "safe_get_full_fp32_param").full_param(param)


def safe_set_full_fp32_param(param: torch.Tensor, value: torch.Tensor) -> None:
    """Set the whole param (and its fp32 master) to ``value``, the same on every rank."""
    _owner(param, "safe_set_full_fp32_param").set_full_param(param, value)


def safe_get_full_grad(param: torch.Tensor) -> torch.Tensor | None:
    """The whole gradient averaged over the ranks (fp32), or None if it has none (frozen, or
    no backward reached it yet)."""
    if not param.requires_grad:
        return None
    return _owner(param, "safe_get_full_grad").full_grad(param)


def safe_get_full_optimizer_state(param: torch.Tensor, optim_state_key: str):
    """One whole entry of the param's optimizer state ("exp_avg", "exp_avg_sq", "step"...), or
    None before its first step, for a key it does not have, or for a frozen param (as
    DeepSpeed)."""
    if not param.requires_grad:
        return None
    return _owner(param, "safe_get_full_optimizer_state").full_state(param).get(optim_state_key)


def safe_set_full_optimizer_state(param: torch.Tensor, value, optim_state_key: str) -> None:
    """Set one whole entry of the param's optimizer state (DeepSpeed's argument order)."""
    _owner(param, "safe_set_full_optimizer_state").set_full_state(param, optim_state_key, value)
