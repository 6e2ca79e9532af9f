"""Pure-torch reference of blockwise quantization: the fallback and the test oracle.

It performs the fp32 operations of `zero_kernels.ops.quant` [Note: quantized bytes] one by one,
so its bytes equal the native and Triton kernels'. Two torch shortcuts are avoided on purpose:
``c / t`` with a Python number ``c`` is ``t.reciprocal() * c`` (two roundings) and a division by a
CPU scalar may become a multiplication by its reciprocal, so both divisions divide two tensors.
"""

from __future__ import annotations

import torch

_FLT_MAX = torch.finfo(torch.float32).max
_INF_BITS = 0x7F800000
_ABS_MASK = 0x7FFFFFFF


def qmax_of(bits: int) -> int:
    return 127 if bits == 8 else 7


def quantize_into(
    x: torch.Tensor,
    q: torch.Tensor,
    scales: torch.Tensor,
    error: torch.Tensor | None,
    bits: int,
    block: int,
) -> None:
    """Write q (uint8) and scales (fp32) of flat ``x``; update ``error`` in place if given."""
    n = x.numel()
    if n == 0:
        return
    qmax = qmax_of(bits)
    nb = -(-n // block)
    y = x.reshape(-1).float()
    if error is not None:
        y = y + error.reshape(-1)
    yb = torch.nn.functional.pad(y, (0, nb * block - n)).view(nb, block)  # pads with +0
    absbits = (yb.view(torch.int32) & _ABS_MASK).amax(dim=1)  # NaN above inf above finite
    finite = absbits < _INF_BITS
    has_inf = absbits == _INF_BITS
    absmax = absbits.view(torch.float32)
    qm = torch.full_like(absmax, float(qmax))
    scale = torch.where(absbits > _INF_BITS, float("nan"), absmax / qm)  # one quiet NaN
    inv = torch.clamp(qm / absmax, max=_FLT_MAX)
    t = torch.where(finite[:, None], yb * inv[:, None], 0.0).clamp(-qmax, qmax)
    qf = torch.round(t)  # ties to even
    signed_inf = torch.where(yb == float("inf"), qmax, torch.where(yb == float("-inf"), -qmax, 0))
    qi = torch.where(
        finite[:, None], qf.to(torch.int32), torch.where(has_inf[:, None], signed_inf, 0)
    ).to(torch.int32)
    if error is not None:
        deq = qi.float() * scale[:, None]
        e = torch.where(finite[:, None], yb - deq, 0.0)
        error.reshape(-1).copy_(e.reshape(-1)[:n])
    flat = qi.reshape(-1)[:n]
    if bits == 8:
        q.copy_(flat.to(torch.int8).view(torch.uint8))
    else:
        nib = flat & 0xF
        if n % 2:
            nib = torch.nn.functional.pad(nib, (0, 1))
        q.copy_((nib[0::2] | (nib[1::2] << 4)).to(torch.uint8))
    scales.copy_(scale)


def unpack(q: torch.Tensor, bits: int, numel: int) -> torch.Tensor:
    """The signed integers of ``q`` (int32, ``numel`` of them)."""
    if bits == 8:
        return q.view(torch.int8)[:numel].to(torch.int32)
    b = q.to(torch.int32)
    lo = ((b & 0xF) ^ 8) - 8  # sign-extend the nibbles
    hi = ((b >> 4) ^ 8) - 8
    return torch.stack([lo, hi], dim=1).reshape(-1)[:numel]


def dequantize_into(
    q: torch.Tensor,
    scales: torch.Tensor,
    out: torch.Tensor,
    bits: int,
    block: int,
    accumulate: bool,
) -> None:
    """``out = q * scale`` (converted to out's dtype) or ``out += q * scale`` (fp32 out)."""
    n = out.numel()
    if n == 0:
        return
    s = scales.repeat_interleave(block)[:n]
    v = unpack(q, bits, n).float() * s
    flat = out.view(-1)
    if accumulate:
        flat.add_(v)
    else:
        flat.copy_(v)
