"""Stochastic rounding of fp32 values into bf16 params: ``bf16_stochastic_round``.

[Note: stochastic rounding]
With ``bf16_stochastic_round=True`` (`zero_kernels.FusedAdamW`, `zero_kernels.ZeroOptimizer`)
bf16 params are stepped without an fp32 master: each step reads the bf16 param into fp32 (a
transient of one tensor or one bucket's shard), runs the fused Adam/AdamW step on it, and writes
it back rounded stochastically. Round to nearest would drop every update smaller than half a
bf16 ulp (2^-9 of the value): with lr 1e-3 most of Adam's steps; stochastic rounding keeps them
in expectation, E[round(x)] = x, so the params follow the fp32 trajectory on average (Zamirai et
al., "Revisiting BFloat16 Training", 2020, and torch-ao's ``bf16_stochastic_round``). It saves
the master's 4 bytes per param (of 16 with fp32 moments, of 10 with int8 moments) at a measured
cost in loss (docs/benchmarks.md, "bf16 params without a master").

The rounding of fp32 x with bits u: inf and NaN as round to nearest; otherwise
``bf16 bits = (u + r) >> 16`` with r the low 16 bits of ``h(key ^ h(index))`` (h: a 32-bit integer
hash, csrc/sr_round.h), i.e. x rounds away from zero with probability equal to the dropped
fraction. ``index`` is the element's position inside its parameter, ``key = sr_key(step,
param index, seed)``, param index counted across the param groups in order: so the bits depend
only on (seed, step, parameter, element), not on the rank, the world size, the bucket or the
backend, and a resumed run draws what the uninterrupted one did. Backends: the native CPU kernel,
Triton (GPU, or the CPU interpreter), and this module's torch reference; all bitwise equal.
"""

from __future__ import annotations

import torch

from .. import native
from .backends import resolve_backend

__all__ = ["sr_key", "stochastic_round_bf16_"]

_M = 0xFFFFFFFF
_CHUNK = 1 << 20  # reference: int64 temporaries of at most this many elements


def _hash32(x: int) -> int:
    x &= _M
    x ^= x >> 16
    x = (x * 0x7FEB352D) & _M
    x ^= x >> 15
    x = (x * 0x846CA68B) & _M
    return x ^ (x >> 16)


def sr_key(step: int, index: int, seed: int = 0) -> int:
    """The 32-bit key of parameter ``index``'s rounding at ``step`` (see the Note)."""
    return _hash32(_hash32(_hash32(seed) ^ (step & _M)) ^ (index & _M))


def _hash32_t(x: torch.Tensor) -> torch.Tensor:
    """`_hash32` on int64 tensors holding uint32 values (products wrap; the low 32 bits kept)."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _M
    return x ^ (x >> 16)


def _reference(dst: torch.Tensor, src: torch.Tensor, key: int, first: int) -> None:
    out = dst.view(torch.int16)
    for lo in range(0, src.numel(), _CHUNK):
        u = src[lo : lo + _CHUNK].view(torch.int32).to(torch.int64) & _M
        idx = (torch.arange(u.numel(), device=u.device, dtype=torch.int64) + first + lo) & _M
        r = _hash32_t(_hash32_t(idx) ^ key) & 0xFFFF
        b = (u + r) >> 16
        nonfinite = (u & 0x7F800000) == 0x7F800000
        nan = (u & 0x7FFFFFFF) > 0x7F800000
        b = torch.where(nonfinite, torch.where(nan, (u >> 16) | 0x40, u >> 16), b)
        out[lo : lo + _CHUNK].copy_(torch.where(b >= 0x8000, b - 0x10000, b))


def stochastic_round_bf16_(
    dst: torch.Tensor, src: torch.Tensor, key: int, first: int = 0, backend: str = "auto"
) -> torch.Tensor:
    """``dst`` (bf16) = ``src`` (fp32) rounded stochastically, element j with index ``first + j``
    (see the Note); both contiguous, one numel and device. Returns ``dst``."""
    if src.dtype != torch.float32 or dst.dtype != torch.bfloat16:
        raise TypeError(
            "stochastic_round_bf16_: src must be float32 and dst bfloat16, got "
            f"src.dtype={src.dtype}, dst.dtype={dst.dtype}"
        )
    if src.numel() != dst.numel() or src.device != dst.device:
        raise ValueError(
            "stochastic_round_bf16_: src and dst must have one numel and device, got "
            f"{src.numel()} on {src.device} and {dst.numel()} on {dst.device}"
        )
    if not (src.is_contiguous() and dst.is_contiguous()):
        raise ValueError("stochastic_round_bf16_: src and dst must be contiguous")
    key, first = int(key) & _M, int(first) & _M
    if src.numel() == 0:
        return dst
    be = resolve_backend(backend, src.device)
    if be == "cuda":  # no native CUDA kernel for this cast: Triton where it loads
        be = "triton" if _triton_ok() else "reference"
    if be == "cpu":
        native.load().sr_round_bf16(src.view(-1), dst.view(-1), key, first)
    elif be == "triton":
        from .triton_sr import stochastic_round_bf16_triton

        stochastic_round_bf16_triton(dst.view(-1), src.view(-1), key, first)
    else:
        _reference(dst.view(-1), src.view(-1), key, first)
    return dst


def _triton_ok() -> bool:
    try:
        from . import triton_sr  # noqa: F401
    except Exception:
        return False
    return True
