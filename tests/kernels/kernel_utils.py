"""Tolerances and comparison helpers for the kernel tests."""

from __future__ import annotations

import torch

# (rtol, atol) per storage dtype, for one kernel step against the fp32 reference. The native and
# reference paths may round differently by an fma or an operation order: a few fp32 ulps before
# storing, so at most one ulp of the storage dtype after.
TOL = {
    torch.float32: (2e-6, 1e-6),  # atol: cancellation in m = b1*m + (1-b1)*g (operands ~1)
    torch.bfloat16: (2**-7, 1e-6),
    torch.float16: (2**-10, 1e-6),
}
# After many steps errors compound (the second moment feeds the denominator). For bf16/fp16 state
# a one-ulp difference in exp_avg moves the param by a fraction of lr each later step, so the
# absolute tolerance is a tenth of the tests' lr (1e-2).
TOL_MULTISTEP = {
    torch.float32: (1e-5, 1e-6),
    torch.bfloat16: (2**-5, 1e-3),
    torch.float16: (2**-8, 1e-3),
}


def assert_close(actual: torch.Tensor, expected: torch.Tensor, what: str, tol=None) -> None:
    """Fail with the first mismatching elements printed (index, actual, expected)."""
    dtype = actual.dtype
    rtol, atol = tol if tol is not None else TOL[dtype]
    a = actual.detach().float().reshape(-1)
    e = expected.detach().float().reshape(-1)
    assert a.shape == e.shape, f"{what}: shape {tuple(a.shape)} != {tuple(e.shape)}"
    bad = ~((a - e).abs() <= atol + rtol * e.abs())
    bad &= ~(a.isnan() & e.isnan())
    if bool(bad.any()):
        idx = bad.nonzero().reshape(-1)[:8].tolist()
        rows = ", ".join(f"[{i}] {a[i].item():.9g} vs {e[i].item():.9g}" for i in idx)
        raise AssertionError(
            f"{what} ({dtype}, rtol={rtol}, atol={atol}): {int(bad.sum())}/{a.numel()} "
            f"mismatches, first: {rows}"
        )
