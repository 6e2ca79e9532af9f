"""The CUDA low-bit-state Adam step (csrc/adam_lowbit_cuda.cu) against the reference. Needs a GPU:
on a CPU machine these are skipped, and `bench/gpu_check.sh` runs them on one. Comparison rules
as in tests/kernels/test_lowbit_triton.py (each step from the reference's state: params within a few
ulps, codes equal but for +-1 on a tiny fraction, scales rtol 1e-5)."""

from __future__ import annotations

import pytest
import torch
from test_lowbit import piece_blocks
from test_lowbit_triton import VARIANTS, clone_state, compare, hyper, make_grad, run_steps

from zero_kernels import native
from zero_kernels.ops import lowbit

pytestmark = [
    pytest.mark.skipif(
        not (torch.cuda.is_available() and native.has_cuda_kernels()),
        reason="needs a GPU and zero_kernels built with CUDA (bench/gpu_check.sh)",
    ),
    pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning"),
]


@pytest.mark.parametrize("state_dtype", ["int8", "bf16"])
@pytest.mark.parametrize("block", [64, 256, 320, 4096])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cuda_matches_reference(state_dtype, block, grad_dtype):
    # 320: not a power of two, more elements than threads; 4096: 16 per thread
    for n in (1, block - 1, 5 * block + 7):
        for i, variant in enumerate(VARIANTS):
            for out_dtype in (None, torch.bfloat16, torch.float16):
                run_steps(
                    "cuda",
                    "cuda",
                    n,
                    block,
                    state_dtype,
                    grad_dtype,
                    out_dtype,
                    variant,
                    steps=2,
                    seed=i,
                )


# a large tensor against the reference (CPU): one step (the reference takes seconds at this
# size); the grid-stride loop is test_cuda_grid_stride_loop_matches_pieces's
@pytest.mark.parametrize(
    "state_dtype,n,steps", [("int8", 65535 * 8 * 64 + 1000, 1), ("bf16", 2**20 + 3, 3)]
)
def test_cuda_large_matches_reference(state_dtype, n, steps):
    run_steps(
        "cuda", "cuda", n, 64, state_dtype, torch.float32, torch.bfloat16, VARIANTS[0], steps=steps
    )


def test_cuda_grid_stride_loop_matches_pieces():
    """More int8 quantization blocks than one grid holds, so the kernel's grid-stride loop over
    blocks runs (block 64: a CTA of 256 threads holds 32 groups of 8 lanes, one block each; the
    grid is capped at 65535 * 8 CTAs; csrc/adam_lowbit_cuda.cu): 1.07e9 elements, two steps, and
    the first and last 4096 blocks (the last one short) stepped again as tensors of their own,
    where the first pass of the grid covers them. Blocks are independent: every byte equal."""
    block, nb_cap = 64, 65535 * 8 * 32
    n = nb_cap * block + 1000
    if torch.cuda.mem_get_info()[0] < 24 * 2**30:
        pytest.skip("needs 24 GiB of free device memory (1.07e9 elements)")
    gen = torch.Generator(device="cuda").manual_seed(0)
    p = torch.randn(n, device="cuda", generator=gen)
    g = torch.randn(n, device="cuda", generator=gen) * 1e-2
    s = lowbit.new_state(n, "int8", block, "cuda")
    kw = dict(state_dtype="int8", block=block, backend="cuda")
    lowbit.adam_step_lowbit(p, g, s, hyper(1, *VARIANTS[0]), **kw)
    nb = lowbit.num_blocks(n, block)
    pieces = []
    for b0, b1 in ((0, 4096), (nb - 4096, nb)):
        lo, hi = b0 * block, min(b1 * block, n)
        st = {k: (t[b0:b1] if k.endswith("_scale") else t[lo:hi]).clone() for k, t in s.items()}
        pieces.append((lo, hi, b0, b1, p[lo:hi].clone(), g[lo:hi].clone(), st))
    h = hyper(2, *VARIANTS[0])
    lowbit.adam_step_lowbit(p, g, s, h, **kw)
    for lo, hi, b0, b1, pp, gg, st in pieces:
        lowbit.adam_step_lowbit(pp, gg, st, h, **kw)
        assert torch.equal(pp.view(torch.int32), p[lo:hi].view(torch.int32)), (lo, hi)
        for k, t in st.items():
            whole = s[k][b0:b1] if k.endswith("_scale") else s[k][lo:hi]
            assert torch.equal(t.view(torch.uint8), whole.view(torch.uint8)), (k, lo, hi)


def test_cuda_matches_triton_and_cpu():
    # the native kernels and the compiled Triton kernel run the same fp32 sequence: codes agree
    n, block = 100003, 256
    p0 = torch.randn(n)
    g = make_grad(n, block, 2, torch.float32, 0)
    h = hyper(2, *VARIANTS[0])
    ref_s = lowbit.new_state(n, "int8", block, "cpu")
    lowbit.adam_step_lowbit(
        p0.clone(), g, ref_s, hyper(1, *VARIANTS[0]), state_dtype="int8", block=block, backend="cpu"
    )
    out = {}
    for backend, dev in (("cpu", "cpu"), ("cuda", "cuda"), ("triton", "cuda")):
        p, s = p0.clone().to(dev), clone_state(ref_s, dev)
        lowbit.adam_step_lowbit(
            p, g.to(dev), s, h, state_dtype="int8", block=block, backend=backend
        )
        out[backend] = (p.cpu(), {k: t.cpu() for k, t in s.items()})
    for backend in ("cuda", "triton"):
        compare(*out[backend], *out["cpu"], "int8", f"{backend} vs cpu")


@pytest.mark.parametrize("state_dtype", ["int8", "bf16"])
def test_cuda_check_finite_and_found_inf_skip(state_dtype):
    n, block = 300001, 256
    p = torch.randn(n, device="cuda")
    s = lowbit.new_state(n, state_dtype, block, "cuda")
    g = torch.randn(n, device="cuda")
    kw = dict(state_dtype=state_dtype, block=block, backend="cuda")
    lowbit.adam_step_lowbit(p, g, s, hyper(1, *VARIANTS[0]), **kw)
    p0, s0 = p.clone(), clone_state(s, "cuda")
    bad = g.clone()
    bad[-1] = float("nan")
    found = lowbit.adam_step_lowbit(p, bad, s, hyper(2, *VARIANTS[0]), check_finite=True, **kw)
    assert found.item() == 1.0
    assert torch.equal(p, p0) and all(torch.equal(s[k], s0[k]) for k in s)
    # a set found_inf skips a finite step too
    found = torch.ones(1, device="cuda")
    lowbit.adam_step_lowbit(p, g, s, hyper(2, *VARIANTS[0]), found_inf=found, **kw)
    assert torch.equal(p, p0) and all(torch.equal(s[k], s0[k]) for k in s)
    # and a clear one with check_finite runs the step
    found = torch.zeros(1, device="cuda")
    lowbit.adam_step_lowbit(
        p, g, s, hyper(2, *VARIANTS[0]), found_inf=found, check_finite=True, **kw
    )
    assert found.item() == 0.0 and not torch.equal(p, p0)


def test_cuda_nan_block_and_side_stream():
    n, block = 4 * 256 + 9, 256
    p = torch.randn(n, device="cuda")
    s = lowbit.new_state(n, "int8", block, "cuda")
    g = torch.randn(n, device="cuda")
    g[block + 3] = float("nan")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # the kernels run on the current stream
        lowbit.adam_step_lowbit(
            p, g, s, hyper(1, *VARIANTS[0]), state_dtype="int8", block=block, backend="cuda"
        )
    side.synchronize()
    for k in ("exp_avg_scale", "exp_avg_sq_scale"):
        assert s[k].isnan().tolist() == [False, True, False, False, False], k
    assert (
        not s["exp_avg"][block : 2 * block].any() and not s["exp_avg_sq"][block : 2 * block].any()
    )
    assert (s["exp_avg_sq"][:block] > 0).all()


def test_cuda_block_starts_match_cpu():
    """Blocks given by a table (a sharded step's pieces; the table stays on the CPU): the CUDA
    kernel's codes and scales equal the CPU kernel's but for rounding-boundary neighbours."""
    sizes, block = [300, 64, 1000, 5], 256
    starts, st = piece_blocks(sizes, block)
    n = sum(sizes)
    gen = torch.Generator().manual_seed(5)
    p = torch.randn(n, generator=gen)
    pc, stc = p.cuda(), {k: t.cuda() for k, t in st.items()}
    for step in range(1, 4):
        g = torch.randn(n, generator=gen) * 1e-2
        kw = dict(state_dtype="int8", block=block, block_starts=starts)
        h = hyper(step, adamw=True, wd=0.01, maximize=False, grad_scale=1.0)
        lowbit.adam_step_lowbit(p, g, st, h, backend="cpu", **kw)
        lowbit.adam_step_lowbit(pc, g.cuda(), stc, h, backend="cuda", **kw)
    torch.cuda.synchronize()
    assert (pc.cpu() - p).abs().max().item() < 1e-5
    for k in st:
        d = (stc[k].cpu().float() - st[k].float()).abs()
        assert d.max().item() <= (1.0 if not k.endswith("_scale") else 1e-5 * st[k].abs().max())
