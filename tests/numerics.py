"""The comparison the distributed checks share: norm-wise relative error, in float64."""

from __future__ import annotations

import torch


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """``||a - b|| / ||b||`` in float64, ``b`` the reference. Two empty tensors: 0. ``||b||`` is
    clamped at 1e-30, so a zero reference gives 0 only for ``a == 0`` (any other ``a`` is a huge
    error, never a NaN that a ``<=`` would let pass). Different element counts fail here (no
    broadcasting into a small number)."""
    a, b = a.detach().double().reshape(-1), b.detach().double().reshape(-1)
    assert a.numel() == b.numel(), f"rel_err: {a.numel()} elements vs {b.numel()}"
    if b.numel() == 0:
        return 0.0
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def assert_params_close(m1, m2, tol: float, what: str) -> float:
    """Every named param of ``m1`` within ``tol`` (`rel_err`) of ``m2``'s; the worst error."""
    worst = 0.0
    for (n, a), (_, b) in zip(m1.named_parameters(), m2.named_parameters(), strict=True):
        e = rel_err(a, b)
        worst = max(worst, e)
        if not e <= tol:
            raise AssertionError(f"{what}: param {n} rel err {e:.3g} > {tol:g}")
    return worst
