"""CUDA and compiled-Triton blockwise quantization against the reference, byte for byte. They need
a GPU: on a CPU machine they are skipped, and `bench/gpu_check.sh` runs them on one."""

from __future__ import annotations

import pytest
import torch
from test_quant_kernels import BOUND, DTYPES, assert_same, round_trip, sample, sizes

from zero_kernels import native, ops

pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() and native.has_cuda_kernels()),
    reason="needs a GPU and zero_kernels built with CUDA (bench/gpu_check.sh)",
)


def compare_on_gpu(backend, x, bits, block, error=None, tag=""):
    """The GPU backend on x.cuda() against the reference on the CPU."""
    got = round_trip(backend, x.cuda(), bits, block, None if error is None else error.cuda())
    want = round_trip("reference", x, bits, block, error)
    tag = f"{backend} bits={bits} block={block} n={x.numel()} {x.dtype} {tag}"
    assert_same(got[0].cpu(), want[0], f"{tag} q")
    assert_same(got[1].cpu(), want[1], f"{tag} scales")
    if error is not None:
        assert_same(got[2].cpu(), want[2], f"{tag} error")
    for dt in DTYPES:
        assert_same(got[3][dt].cpu(), want[3][dt], f"{tag} deq {dt}")
    assert_same(got[4].cpu(), want[4], f"{tag} accumulate")


@pytest.mark.parametrize("backend", ["cuda", "triton"])
@pytest.mark.parametrize("bits", [8, 4])
def test_gpu_matches_reference(backend, bits):
    for block in (2, 32, 256, 4096):
        for n in sizes(block) + [2**20 + 3]:
            for dtype in DTYPES:
                x = sample(n, dtype, seed=n + block, heavy=bool(n % 2))
                compare_on_gpu(backend, x, bits, block)
                compare_on_gpu(backend, x, bits, block, sample(n, seed=n) * 0.01, "with error")


@pytest.mark.parametrize("backend", ["cuda", "triton"])
@pytest.mark.parametrize("bits", [8, 4])
def test_gpu_non_finite_and_zero_blocks(backend, bits):
    block = 64
    x = sample(6 * block + 5, seed=2)
    x[:block] = 0.0
    x[block + 3] = float("nan")
    x[2 * block + 9] = float("inf")
    x[3 * block] = float("-inf")
    x[6 * block + 4] = float("inf")
    compare_on_gpu(backend, x, bits, block, torch.full_like(x, 0.01), "non-finite")
    q, s = ops.quantize_blockwise(x.cuda(), bits, block, backend=backend)
    d = ops.dequantize_blockwise(q, s, bits, block, x.numel(), backend=backend).cpu()
    assert d[:block].view(torch.int32).eq(0).all()
    assert d[block : 2 * block].isnan().all() and d[2 * block + 9].item() == float("inf")


@pytest.mark.parametrize("backend", ["cuda", "triton"])
def test_gpu_error_bound_large(backend):
    n = 50_000_003
    x = sample(n, torch.bfloat16, seed=1, heavy=True).cuda()
    for bits in (8, 4):
        q, s = ops.quantize_blockwise(x, bits, ops.DEFAULT_BLOCK, backend=backend)
        d = ops.dequantize_blockwise(q, s, bits, ops.DEFAULT_BLOCK, n, backend=backend)
        step = s.repeat_interleave(ops.DEFAULT_BLOCK)[:n].double()
        assert bool(((x.double() - d.double()).abs() <= step * BOUND).all())
