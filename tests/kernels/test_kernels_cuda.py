"""CUDA and compiled-Triton kernels against the reference. They need a GPU: on a CPU machine they
are skipped, and `bench/gpu_check.sh` runs them on one."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from kernel_utils import TOL_MULTISTEP, assert_close
from test_kernels import VARIANTS, compare, hyper_for, make_state, run

from zero_kernels import FusedAdamW, native, ops

pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() and native.has_cuda_kernels()),
    reason="needs a GPU and zero_kernels built with CUDA (bench/gpu_check.sh)",
)


def to_cuda(state):
    return tuple(t.cuda() if t is not None else None for t in state)


@pytest.mark.parametrize("n", [1, 7, 1023, 2**20 + 3])
@pytest.mark.parametrize("backend", ["cuda", "triton"])
def test_cuda_matches_reference(n, backend):
    for adamw, amsgrad, maximize, wd in VARIANTS:
        h = hyper_for(adamw, amsgrad, maximize, wd)
        state = to_cuda(make_state(n, torch.float32, torch.float32, seed=n, amsgrad=amsgrad))
        for out_dtype in (None, torch.bfloat16, torch.float16):
            compare(
                run(backend, h, state, out_dtype),
                run("reference", h, state, out_dtype),
                f"{backend} n={n} {adamw, amsgrad, maximize, wd} out={out_dtype}",
            )


@pytest.mark.parametrize(
    "dtype,grad_dtype",
    [
        (torch.bfloat16, torch.bfloat16),
        (torch.bfloat16, torch.float32),
        (torch.float16, torch.float16),
    ],
)
def test_cuda_low_precision_and_unaligned(dtype, grad_dtype):
    h = hyper_for(True, True, False, 0.1)
    state = to_cuda(make_state(70001, dtype, grad_dtype, seed=5, amsgrad=True))
    compare(
        run("cuda", h, state, torch.bfloat16),
        run("reference", h, state, torch.bfloat16),
        f"cuda {dtype}",
    )
    # fp32 views starting one element in: not 16-byte aligned, the scalar kernel runs
    full = to_cuda(make_state(4097, torch.float32, torch.float32, seed=6))
    shifted = tuple(t[1:] if t is not None else None for t in full)
    h = dataclasses.replace(h, amsgrad=False)
    compare(run("cuda", h, shifted), run("reference", h, shifted), "cuda unaligned")


def test_cuda_multi_tensor_many_and_large():
    # more tensors than one launch holds, and tensors spanning more chunks than one launch holds
    sizes = [1, 3, 65536, 65537] + [257] * 20 + [330 * 65536 + 5]
    gen = torch.Generator().manual_seed(0)
    ps = [torch.randn(n, generator=gen).cuda() for n in sizes]
    gs = [torch.randn(n, generator=gen).cuda() for n in sizes]
    ms = [torch.zeros(n).cuda() for n in sizes]
    vs = [torch.zeros(n).cuda() for n in sizes]
    want = [(p.clone(), m.clone(), v.clone()) for p, m, v in zip(ps, ms, vs)]
    h = hyper_for(True, False, False, 0.1)
    ops.adam_step_multi(ps, gs, ms, vs, h, backend="cuda")
    for (p, m, v), g, got_p in zip(want, gs, ps):
        ops.adam_step(p, g, m, v, h, backend="reference")
        assert_close(got_p, p, "multi-tensor param")


def test_cuda_non_finite_leaves_everything_untouched():
    for backend in ("cuda", "triton"):
        p, g, m, v, vm = to_cuda(make_state(300000, torch.float32, torch.float32, amsgrad=True))
        g[299999] = float("nan")
        got = run(
            backend,
            hyper_for(True, True, False, 0.1),
            (p, g, m, v, vm),
            torch.bfloat16,
            check_finite=True,
        )
        assert got[5].item() == 1.0
        assert torch.equal(got[0], p) and torch.equal(got[1], m) and torch.equal(got[3], vm)


def test_fused_adamw_cuda_matches_torch_fused():
    gen = torch.Generator().manual_seed(0)
    shapes = [(7,), (1023,), (64, 129)]
    pa = [torch.nn.Parameter(torch.randn(s, generator=gen).cuda()) for s in shapes]
    pb = [torch.nn.Parameter(p.detach().clone()) for p in pa]
    oa = FusedAdamW(pa, lr=1e-2, weight_decay=0.1, backend="cuda")
    ob = torch.optim.AdamW(pb, lr=1e-2, weight_decay=0.1, fused=True)
    for _ in range(20):
        for x, y in zip(pa, pb):
            g = torch.randn(x.shape, generator=gen).cuda()
            x.grad, y.grad = g, g.clone()
        oa.step()
        ob.step()
    for x, y in zip(pa, pb):
        assert_close(x, y, "cuda FusedAdamW", TOL_MULTISTEP[torch.float32])


def test_cuda_flat_copy_round_trip():
    mod = native.load()
    ts = [torch.randn(n).cuda() for n in (1, 7, 70001)]
    flat = torch.zeros(70009, dtype=torch.bfloat16).cuda()
    mod.flat_copy(ts, flat, [0, 1, 8], True)
    assert torch.equal(flat[8:], ts[2].to(torch.bfloat16))
