"""Adam/AdamW with low-bit moments as Triton kernels (GPU; CPU only through TRITON_INTERPRET=1).

Format and formulas: `zero_kernels.ops.lowbit` [Note: low-bit state]; the math is the sequence of
csrc/adam_math.h (adam_math, which returns u = sqrt(v)), spelled out so that Triton's defaults
cannot change it:

- ``tl.fma`` where the native kernels fuse (m, v, the L2 term, the denominator), launches with
  ``enable_fp_fusion=False`` everywhere else; ``tl.div_rn`` and ``tl.sqrt_rn`` (Triton's ``/``
  and ``tl.sqrt`` on fp32 are approximate on GPUs);
- round half to even is ``(t + 1.5 * 2^23) - 1.5 * 2^23`` (0 <= t <= 255 after the clamp);
- bf16 tensors (grad, moments, out_lowp) are read and written as int16 bits, rounded to nearest
  even by integer arithmetic (as csrc/zk_convert.h does): the interpreter's own bf16 cast may round
  a tie the other way.

int8: one program per quantization block. It decodes, updates (p and out_lowp written), reduces
max |m|, max u = sqrt(v) and finiteness over the block with ``tl.max`` / ``tl.sum``, then encodes
the new m and u it still holds: memory sees each byte once. A block whose new m or u holds a NaN or
an inf stores scale NaN and codes 0, as the CPU kernel does. bf16: element-wise. ``found_inf`` and
``check_finite`` are handled by the caller (`zero_kernels.ops.lowbit.adam_step_lowbit`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .hyper import AdamHyper

_BF16_BLOCK = 1024
_FLT_MAX = tl.constexpr(3.4028234663852886e38)
_M_C2 = tl.constexpr(16129.0)  # 127^2
_V_C2 = tl.constexpr(65025.0)  # 255^2


@triton.jit
def _bf16_to_f32(bits):
    """fp32 of bf16 bits held as int16."""
    return ((bits.to(tl.int32) & 0xFFFF) << 16).to(tl.float32, bitcast=True)


@triton.jit
def _f32_to_bf16(x):
    """bf16 bits (as int16) of fp32 x, rounded to nearest even; NaN stays a quiet NaN."""
    u = x.to(tl.uint32, bitcast=True)
    r = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    r = tl.where((u & 0x7FFFFFFF) > 0x7F800000, (u >> 16) | 0x40, r)
    return r.to(tl.uint16).to(tl.int16, bitcast=True)


@triton.jit
def _load_grad(g_ptr, offs, mask, G_BF16: tl.constexpr):
    if G_BF16:
        return _bf16_to_f32(tl.load(g_ptr + offs, mask=mask, other=0))
    return tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _store_out(out_ptr, offs, p, mask, OUT: tl.constexpr):
    if OUT == 1:  # bf16, as int16 bits
        tl.store(out_ptr + offs, _f32_to_bf16(p), mask=mask)
    elif OUT == 2:  # fp16
        tl.store(out_ptr + offs, p.to(tl.float16), mask=mask)


@triton.jit
def _update(
    p,
    g,
    m,
    v,
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
    MAXIMIZE: tl.constexpr,
    HAS_WD: tl.constexpr,
):
    """adam_math of csrc/adam_math.h: new (p, m, v, u = sqrt(v))."""
    g = g * grad_scale
    if MAXIMIZE:
        g = 0.0 - g
    if HAS_WD:
        if ADAMW:
            p = p * decay
        else:
            g = tl.fma(p, weight_decay, g)
    m = tl.fma(m, beta1, g * one_minus_beta1)
    v = tl.fma(v, beta2, (g * g) * one_minus_beta2)
    u = tl.sqrt_rn(v)
    denom = tl.fma(u, inv_bc2_sqrt, eps)
    p = p - step_size * tl.div_rn(m, denom)
    return p, m, v, u


@triton.jit
def _codes(x, inv, QMAX: tl.constexpr):
    """rne(min(sqrt(|x| * inv), QMAX)) as int32 (x >= 0 or its sign applied by the caller)."""
    t = tl.minimum(tl.sqrt_rn(tl.abs(x) * inv), QMAX)
    return ((t + 12582912.0) - 12582912.0).to(tl.int32)


@triton.jit
def _lowbit_i8_kernel(
    p_ptr,
    g_ptr,
    qm_ptr,
    qv_ptr,
    sm_ptr,
    sv_ptr,
    out_ptr,
    n,
    block,
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
    G_BF16: tl.constexpr,
    OUT: tl.constexpr,  # 0 none, 1 bf16 (int16 bits), 2 fp16
    ADAMW: tl.constexpr,
    MAXIMIZE: tl.constexpr,
    HAS_WD: tl.constexpr,
    BLOCK: tl.constexpr,  # next power of two >= block
):
    blk = tl.program_id(0).to(tl.int64)
    rel = tl.arange(0, BLOCK)
    offs = blk * block + rel
    mask = (rel < block) & (offs < n)
    sm = tl.load(sm_ptr + blk)
    sv = tl.load(sv_ptr + blk)
    qm = tl.load(qm_ptr + offs, mask=mask, other=0).to(tl.float32)
    qv = tl.load(qv_ptr + offs, mask=mask, other=0).to(tl.float32)
    m = (qm * tl.abs(qm)) * sm
    u = (qv * qv) * sv
    v = u * u
    p = tl.load(p_ptr + offs, mask=mask, other=0.0)
    g = _load_grad(g_ptr, offs, mask, G_BF16)
    p, m, v, u = _update(
        p,
        g,
        m,
        v,
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
        ADAMW,
        MAXIMIZE,
        HAS_WD,
    )
    tl.store(p_ptr + offs, p, mask=mask)
    _store_out(out_ptr, offs, p, mask, OUT)
    m = tl.where(mask, m, 0.0)
    u = tl.where(mask, u, 0.0)
    # x - x is 0 for finite x, NaN for inf and NaN
    bad = tl.sum((((m - m) != 0.0) | ((u - u) != 0.0)).to(tl.int32), axis=0)
    finite = bad == 0
    amax_m = tl.max(tl.abs(m), axis=0)
    amax_u = tl.max(u, axis=0)
    nan = tl.full((), 0x7FC00000, tl.int32).to(tl.float32, bitcast=True)
    c2_m = tl.full((), _M_C2, tl.float32)
    c2_u = tl.full((), _V_C2, tl.float32)
    scale_m = tl.where(finite, tl.div_rn(amax_m, c2_m), nan)
    scale_u = tl.where(finite, tl.div_rn(amax_u, c2_u), nan)
    # an all-zero block: c2 / 0 = inf, clamped (every code is 0 then)
    inv_m = tl.where(finite, tl.minimum(tl.div_rn(c2_m, amax_m), _FLT_MAX), 0.0)
    inv_u = tl.where(finite, tl.minimum(tl.div_rn(c2_u, amax_u), _FLT_MAX), 0.0)
    tl.store(sm_ptr + blk, scale_m)
    tl.store(sv_ptr + blk, scale_u)
    cm = _codes(m, inv_m, 127.0)
    cm = tl.where(m < 0.0, -cm, cm)
    cu = _codes(u, inv_u, 255.0)
    cu = tl.where((cu == 0) & (u > 0.0), 1, cu)
    # codes 0 under a NaN scale: the state stays non-finite, as fp32 state would
    cm = tl.where(finite, cm, 0)
    cu = tl.where(finite, cu, 0)
    tl.store(qm_ptr + offs, cm.to(tl.int8), mask=mask)
    tl.store(qv_ptr + offs, (cu & 0xFF).to(tl.uint8), mask=mask)


@triton.jit
def _lowbit_bf16_kernel(
    p_ptr,
    g_ptr,
    m_ptr,
    v_ptr,
    out_ptr,
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
    G_BF16: tl.constexpr,
    OUT: tl.constexpr,
    ADAMW: tl.constexpr,
    MAXIMIZE: tl.constexpr,
    HAS_WD: tl.constexpr,
    BLOCK: tl.constexpr,
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    p = tl.load(p_ptr + offs, mask=mask, other=0.0)
    g = _load_grad(g_ptr, offs, mask, G_BF16)
    m = _bf16_to_f32(tl.load(m_ptr + offs, mask=mask, other=0))
    v = _bf16_to_f32(tl.load(v_ptr + offs, mask=mask, other=0))
    p, m, v, u = _update(
        p,
        g,
        m,
        v,
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
        ADAMW,
        MAXIMIZE,
        HAS_WD,
    )
    tl.store(p_ptr + offs, p, mask=mask)
    tl.store(m_ptr + offs, _f32_to_bf16(m), mask=mask)
    tl.store(v_ptr + offs, _f32_to_bf16(v), mask=mask)
    _store_out(out_ptr, offs, p, mask, OUT)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """bf16 tensors as their int16 bits (see the module note); others unchanged."""
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t


def adam_step_lowbit(
    param: torch.Tensor,
    grad: torch.Tensor,
    state: dict,
    hyper: AdamHyper,
    state_dtype: str,
    block: int,
    out_lowp: torch.Tensor | None,
) -> None:
    """In-place step; arguments already checked, found_inf handled, by `lowbit.adam_step_lowbit`."""
    n = param.numel()
    p = param.view(-1)
    g = _bits(grad.reshape(-1))
    out = _bits(out_lowp.view(-1)) if out_lowp is not None else p
    kind = {None: 0, torch.bfloat16: 1, torch.float16: 2}[
        None if out_lowp is None else out_lowp.dtype
    ]
    # the native kernels test the fp32 weight decay (a double below fp32's range rounds to 0)
    has_wd = float(torch.tensor(hyper.weight_decay, dtype=torch.float32)) != 0.0
    scalars = (
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
    )
    flags = dict(
        G_BF16=grad.dtype == torch.bfloat16,
        OUT=kind,
        ADAMW=hyper.adamw,
        MAXIMIZE=hyper.maximize,
        HAS_WD=has_wd,
        enable_fp_fusion=False,  # fma only where tl.fma says so, as in the native kernels
    )
    if state_dtype == "int8":
        width = triton.next_power_of_2(block)
        _lowbit_i8_kernel[(triton.cdiv(n, block),)](
            p,
            g,
            state["exp_avg"],
            state["exp_avg_sq"],
            state["exp_avg_scale"],
            state["exp_avg_sq_scale"],
            out,
            n,
            block,
            *scalars,
            BLOCK=width,
            num_warps=2 if width <= 256 else 4 if width <= 1024 else 8,
            **flags,
        )
    else:
        _lowbit_bf16_kernel[(triton.cdiv(n, _BF16_BLOCK),)](
            p,
            g,
            _bits(state["exp_avg"]),
            _bits(state["exp_avg_sq"]),
            out,
            n,
            *scalars,
            BLOCK=_BF16_BLOCK,
            **flags,
        )
