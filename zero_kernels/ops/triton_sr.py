"""Stochastic rounding to bf16 as a Triton kernel (`zero_kernels.ops.sr` [Note: stochastic
rounding]): the same integer arithmetic as csrc/sr_round.h, the bf16 bits stored as int16."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 1024


@triton.jit
def _hash32(x):
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    return x ^ (x >> 16)


@triton.jit
def _sr_kernel(src_ptr, dst_ptr, n, key, first, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    u = tl.load(src_ptr + offs, mask=ok, other=0.0).to(tl.uint32, bitcast=True)
    idx = (offs + first).to(tl.uint32)
    r = _hash32(_hash32(idx) ^ key.to(tl.uint32)) & 0xFFFF
    b = (u + r) >> 16
    nonfinite = (u & 0x7F800000) == 0x7F800000
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    b = tl.where(nonfinite, tl.where(nan, (u >> 16) | 0x40, u >> 16), b)
    tl.store(dst_ptr + offs, b.to(tl.uint16).to(tl.int16, bitcast=True), mask=ok)


def stochastic_round_bf16_triton(dst: torch.Tensor, src: torch.Tensor, key: int, first: int):
    n = src.numel()
    grid = (triton.cdiv(n, _BLOCK),)
    _sr_kernel[grid](src, dst.view(torch.int16), n, key, first, BLOCK=_BLOCK)
