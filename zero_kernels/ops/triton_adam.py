"""The fused Adam/AdamW step as a Triton kernel (GPU; CPU only through TRITON_INTERPRET=1).

Same formula as every backend: `zero_kernels.ops.hyper` [Note: one math routine]. The non-finite
scan is a separate kernel writing the ``found_inf`` flag that the update kernel reads, so there is
no host synchronisation.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .hyper import AdamHyper

BLOCK = 1024


@triton.jit
def _finite_scan_kernel(g_ptr, found_ptr, n, scale, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32) * scale
    bad = tl.sum(((g - g) != 0.0).to(tl.int32), axis=0)
    flag = tl.full((1,), 1.0, tl.float32)
    tl.store(found_ptr + tl.arange(0, 1), flag, mask=tl.full((1,), bad, tl.int32) > 0)


@triton.jit
def _adam_kernel(
    p_ptr,
    g_ptr,
    m_ptr,
    v_ptr,
    vmax_ptr,
    out_ptr,
    found_ptr,
    n,
    beta1,
    beta2,
    one_minus_beta1,
    one_minus_beta2,
    decay,
    eps,
    weight_decay,
    step_size,
    inv_bc2_sqrt,
    grad_scale,
    ADAMW: tl.constexpr,
    AMSGRAD: tl.constexpr,
    MAXIMIZE: tl.constexpr,
    HAS_OUT: tl.constexpr,
    HAS_FLAG: tl.constexpr,
    BLOCK: tl.constexpr,
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    if HAS_FLAG:
        skip = tl.load(found_ptr + offs * 0)  # the flag, broadcast to the block
        mask = mask & (skip == 0.0)
    p = tl.load(p_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32) * grad_scale
    m = tl.load(m_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if MAXIMIZE:
        g = -g
    if ADAMW:
        p = p * decay
    else:
        g = p * weight_decay + g
    m = m * beta1 + g * one_minus_beta1
    v = v * beta2 + (g * g) * one_minus_beta2
    src = v
    if AMSGRAD:
        vm = tl.load(vmax_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        vm = tl.maximum(vm, v)
        tl.store(vmax_ptr + offs, vm.to(vmax_ptr.dtype.element_ty), mask=mask)
        src = vm
    denom = tl.sqrt(src) * inv_bc2_sqrt + eps
    p = p - step_size * (m / denom)
    tl.store(p_ptr + offs, p.to(p_ptr.dtype.element_ty), mask=mask)
    tl.store(m_ptr + offs, m.to(m_ptr.dtype.element_ty), mask=mask)
    tl.store(v_ptr + offs, v.to(v_ptr.dtype.element_ty), mask=mask)
    if HAS_OUT:
        tl.store(out_ptr + offs, p.to(out_ptr.dtype.element_ty), mask=mask)


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
    """In-place step; arguments already checked by `zero_kernels.ops.adam_step`."""
    n = param.numel()
    grid = (triton.cdiv(n, BLOCK),)
    if check_finite:
        _finite_scan_kernel[grid](grad, found_inf, n, hyper.grad_scale, BLOCK=BLOCK)
    _adam_kernel[grid](
        param,
        grad,
        exp_avg,
        exp_avg_sq,
        max_exp_avg_sq if max_exp_avg_sq is not None else param,
        out_lowp if out_lowp is not None else param,
        found_inf if found_inf is not None else param,
        n,
        hyper.beta1,
        hyper.beta2,
        1.0 - hyper.beta1,  # formed in double, rounded once (kernel args are fp32)
        1.0 - hyper.beta2,
        1.0 - hyper.lr * hyper.weight_decay,
        hyper.eps,
        hyper.weight_decay,
        hyper.step_size,
        1.0 / hyper.bias_correction2_sqrt,
        hyper.grad_scale,
        ADAMW=hyper.adamw,
        AMSGRAD=hyper.amsgrad,
        MAXIMIZE=hyper.maximize,
        HAS_OUT=out_lowp is not None,
        HAS_FLAG=found_inf is not None,
        BLOCK=BLOCK,
    )
