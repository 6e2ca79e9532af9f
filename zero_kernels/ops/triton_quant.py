"""Blockwise quantization as Triton kernels (GPU; CPU only through TRITON_INTERPRET=1).

Same formulas and bytes as every backend: `zero_kernels.ops.quant` [Note: quantized bytes].
Where Triton's defaults would differ from that definition, the kernels spell it out:

- round half to even is ``(t + 1.5 * 2^23) - 1.5 * 2^23`` (exact for |t| <= 2^22; t is clamped to
  +-127 first), the same in the interpreter and on a GPU;
- divisions are ``tl.div_rn`` (Triton's ``/`` on fp32 is an approximate division on GPUs);
- launches pass ``enable_fp_fusion=False``, so ``y - q * scale`` and ``out + q * scale`` are not
  fused into an fma;
- bf16 output is rounded to nearest even by integer arithmetic (as csrc/zk_convert.h does) and
  stored as int16 bits: the interpreter's own bf16 cast may round a tie the other way.

Quantize runs ROWS blocks per program, each block in chunks of CHUNK slots (a slot is one element
for int8, one byte = two elements for int4): a pass for max |y| (as bits: NaN above inf above
finite), then a pass writing q and the residuals.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_DEQ_BLOCK = 1024
_MAX_CHUNK = 1024


@triton.jit
def _load_y(x_ptr, err_ptr, idx, ok, HAS_ERR: tl.constexpr):
    y = tl.load(x_ptr + idx, mask=ok, other=0.0).to(tl.float32)
    if HAS_ERR:
        y = y + tl.load(err_ptr + idx, mask=ok, other=0.0)
    return y


@triton.jit
def _abs_bits(y, ok):
    return tl.where(ok, y.to(tl.int32, bitcast=True) & 0x7FFFFFFF, 0)


@triton.jit
def _quant(y, inv, scale, finite, has_inf, QMAX: tl.constexpr):
    """q (int32) of y in rows with the given inv/scale; also the new residual."""
    t = tl.where(finite, y * inv, 0.0)
    t = tl.minimum(tl.maximum(t, -QMAX), QMAX)
    r = (t + 12582912.0) - 12582912.0  # round half to even
    qf = r.to(tl.int32)
    sign_inf = tl.where(y == float("inf"), QMAX, tl.where(y == float("-inf"), -QMAX, 0))
    q = tl.where(finite, qf, tl.where(has_inf, sign_inf, 0))
    e = tl.where(finite, y - q.to(tl.float32) * scale, 0.0)
    return q, e


@triton.jit
def _quantize_kernel(
    x_ptr,
    err_ptr,
    q_ptr,
    s_ptr,
    n,
    nblocks,
    block,
    QMAX: tl.constexpr,
    PACK: tl.constexpr,  # elements per slot: 1 (int8) or 2 (int4)
    HAS_ERR: tl.constexpr,
    ROWS: tl.constexpr,
    CHUNK: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    row_ok = rows < nblocks
    start = rows * block
    slots = tl.arange(0, CHUNK)
    m = tl.zeros([ROWS], dtype=tl.int32)
    for c0 in range(0, block, CHUNK * PACK):
        rel = c0 + slots * PACK
        idx = start[:, None] + rel[None, :]
        ok = row_ok[:, None] & (rel[None, :] < block) & (idx < n)
        y0 = _load_y(x_ptr, err_ptr, idx, ok, HAS_ERR)
        m = tl.maximum(m, tl.max(_abs_bits(y0, ok), axis=1))
        if PACK == 2:
            ok1 = ok & (idx + 1 < n)
            y1 = _load_y(x_ptr, err_ptr, idx + 1, ok1, HAS_ERR)
            m = tl.maximum(m, tl.max(_abs_bits(y1, ok1), axis=1))
    finite = m < 0x7F800000
    has_inf = m == 0x7F800000
    absmax = m.to(tl.float32, bitcast=True)
    qm = tl.full([ROWS], QMAX, tl.float32)
    nan = tl.full([ROWS], 0x7FC00000, tl.int32).to(tl.float32, bitcast=True)
    scale = tl.where(m > 0x7F800000, nan, tl.div_rn(absmax, qm))
    inv = tl.minimum(tl.div_rn(qm, absmax), 3.4028234663852886e38)
    tl.store(s_ptr + rows, scale, mask=row_ok)
    inv2 = inv[:, None]
    scale2 = scale[:, None]
    fin2 = finite[:, None]
    inf2 = has_inf[:, None]
    for c0 in range(0, block, CHUNK * PACK):
        rel = c0 + slots * PACK
        idx = start[:, None] + rel[None, :]
        ok = row_ok[:, None] & (rel[None, :] < block) & (idx < n)
        y0 = _load_y(x_ptr, err_ptr, idx, ok, HAS_ERR)
        q0, e0 = _quant(y0, inv2, scale2, fin2, inf2, QMAX)
        if HAS_ERR:
            tl.store(err_ptr + idx, e0, mask=ok)
        if PACK == 1:
            tl.store(q_ptr + idx, (q0 & 0xFF).to(tl.uint8), mask=ok)
        else:
            ok1 = ok & (idx + 1 < n)
            y1 = _load_y(x_ptr, err_ptr, idx + 1, ok1, HAS_ERR)
            q1, e1 = _quant(y1, inv2, scale2, fin2, inf2, QMAX)
            q1 = tl.where(ok1, q1, 0)
            if HAS_ERR:
                tl.store(err_ptr + idx + 1, e1, mask=ok1)
            byte = (q0 & 0xF) | ((q1 & 0xF) << 4)
            tl.store(q_ptr + idx // 2, byte.to(tl.uint8), mask=ok)


@triton.jit
def _dequantize_kernel(
    q_ptr,
    s_ptr,
    out_ptr,
    n,
    block,
    BITS: tl.constexpr,
    OUT: tl.constexpr,  # 0 fp32, 1 bf16 (stored as int16 bits), 2 fp16
    ACC: tl.constexpr,
    BLOCK: tl.constexpr,
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    if BITS == 8:
        b = tl.load(q_ptr + offs, mask=ok, other=0).to(tl.int32)
        q = (b ^ 128) - 128  # sign-extend the byte
    else:
        b = tl.load(q_ptr + offs // 2, mask=ok, other=0).to(tl.int32)
        nib = tl.where((offs & 1) == 0, b & 0xF, (b >> 4) & 0xF)
        q = (nib ^ 8) - 8
    s = tl.load(s_ptr + offs // block, mask=ok, other=0.0)
    v = q.to(tl.float32) * s
    if ACC:
        v = tl.load(out_ptr + offs, mask=ok, other=0.0) + v
    if OUT == 1:
        u = v.to(tl.uint32, bitcast=True)
        r = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
        r = tl.where((u & 0x7FFFFFFF) > 0x7F800000, (u >> 16) | 0x40, r)
        tl.store(out_ptr + offs, r.to(tl.uint16).to(tl.int16, bitcast=True), mask=ok)
    else:
        tl.store(out_ptr + offs, v.to(out_ptr.dtype.element_ty), mask=ok)


def quantize_into(x, q, scales, error, bits: int, block: int) -> None:
    """Arguments checked by `zero_kernels.ops.quant`; x, q, scales, error contiguous."""
    n = x.numel()
    nblocks = scales.numel()
    pack = 1 if bits == 8 else 2
    slots = -(-block // pack)
    chunk = min(triton.next_power_of_2(slots), _MAX_CHUNK)
    rows = max(1, min(16, _MAX_CHUNK // chunk))
    grid = (triton.cdiv(nblocks, rows),)
    _quantize_kernel[grid](
        x,
        error if error is not None else scales,
        q,
        scales,
        n,
        nblocks,
        block,
        QMAX=127 if bits == 8 else 7,
        PACK=pack,
        HAS_ERR=error is not None,
        ROWS=rows,
        CHUNK=chunk,
        enable_fp_fusion=False,  # no fma for y - q * s and out + q * s
    )


def dequantize_into(q, scales, out, bits: int, block: int, accumulate: bool) -> None:
    n = out.numel()
    kind = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}[out.dtype]
    target = out.view(torch.int16) if kind == 1 else out
    grid = (triton.cdiv(n, _DEQ_BLOCK),)
    _dequantize_kernel[grid](
        q,
        scales,
        target,
        n,
        block,
        BITS=bits,
        OUT=kind,
        ACC=accumulate,
        BLOCK=_DEQ_BLOCK,
        enable_fp_fusion=False,  # no fma for y - q * s and out + q * s
    )
