"""Gradient norms accurate whatever a shard's length ([Note: accurate norms] in
zero_kernels/syncfree.py): `pow_sum` against float64 on long heavy-tailed tensors (fp32, bf16,
fp64; p = 1, 2, 3; lengths around its row size), and ``ZeroOptimizer.clip_grad_norm_`` against the
float64 norm of DDP's gradients at stages 1-3 (tests/clip_norm_checks.py)."""

import clip_norm_checks
import pytest
import torch
from dist_utils import run_workers

from zero_kernels import syncfree
from zero_kernels.syncfree import NORM_ROW, pow_sum


def _heavy_tailed(n: int) -> torch.Tensor:
    """Gaussian blocks of 1000 whose scales span four decades (gradients of a real model)."""
    g = torch.Generator().manual_seed(0)
    scale = 10 ** (torch.rand(n // 1000 + 1, generator=g) * 4 - 4)
    return torch.randn(n, generator=g) * scale.repeat_interleave(1000)[:n]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_pow_sum_accurate_on_long_tensors(dtype):
    x = _heavy_tailed(4_000_037).to(dtype)
    for p in (1.0, 2.0, 3.0):
        exact = float(x.double().abs().pow(p).sum())
        ours = pow_sum(x, p)
        assert ours.dtype == torch.float64 and ours.dim() == 0
        err = abs(float(ours) - exact) / exact
        bound = 1e-12 if dtype == torch.float64 else 3e-7 * p
        # torch's own reduction of the whole fp32 tensor: ~4e-4 (p=2) to 3e-3 (p=1) here
        assert err <= bound, (dtype, p, err)


def test_pow_sum_lengths_around_a_row():
    assert float(pow_sum(torch.zeros(0), 2.0)) == 0.0
    for n in (1, NORM_ROW - 1, NORM_ROW, NORM_ROW + 1, 3 * NORM_ROW + 17):
        x = _heavy_tailed(n) + 1e-3
        for p in (1.0, 2.0):
            exact = float(x.double().abs().pow(p).sum())
            assert abs(float(pow_sum(x, p)) - exact) <= 1e-6 * exact, (n, p)
    # a view's own elements only (a shard is a view into a flat buffer)
    buf = torch.ones(3 * NORM_ROW)
    part = float(pow_sum(buf[NORM_ROW + 5 : 2 * NORM_ROW], 2.0))
    assert abs(part - (NORM_ROW - 5)) <= 1e-7 * NORM_ROW, part


def test_pow_sum_in_passes(monkeypatch):
    """bf16/fp16 rows come NORM_PASS elements per call: several passes sum to one's result."""
    x = _heavy_tailed(50_003)
    for dtype in (torch.bfloat16, torch.float16):
        y = x.to(dtype)
        whole = float(pow_sum(y, 2.0))
        monkeypatch.setattr(syncfree, "NORM_PASS", 4 * NORM_ROW)
        parts = float(pow_sum(y, 2.0))
        monkeypatch.undo()
        exact = float(y.double().pow(2).sum())
        assert abs(parts - exact) <= 1e-7 * exact and abs(whole - exact) <= 1e-7 * exact, dtype


@pytest.mark.distributed
def test_clip_grad_norm_matches_float64():
    rep = run_workers(clip_norm_checks.check_clip_norms, 2, timeout=400)
    assert len(rep[0]) == len(clip_norm_checks.CASES), rep[0]
    assert all(v <= clip_norm_checks.NORM_TOL for v in rep[0].values()), rep[0]


@pytest.mark.distributed
def test_sharded_grad_norm_takes_no_copy():
    rep = run_workers(clip_norm_checks.check_sharded_grad_norm_memory, 1, timeout=200)
    assert rep[0]["peak_bytes"] <= rep[0]["grad_bytes"] // 4, rep[0]
