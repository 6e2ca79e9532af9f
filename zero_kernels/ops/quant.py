"""Blockwise symmetric int8/int4 quantization for communication (ZeRO++'s qwZ and qgZ).

`quantize_blockwise` turns a flat tensor into bytes plus one fp32 scale per block (optionally with
error feedback); `dequantize_blockwise` turns them back, or adds them into an fp32 sum (the
two-hop gradient reduce sums several ranks' pieces at each hop). Every backend (native cpu and
cuda, triton, reference; chosen by `zero_kernels.ops.backends`) gives the same bytes. Both are
custom ops (``zero_kernels::quantize_blockwise_``, ``zero_kernels::dequantize_blockwise_``) that
torch.compile keeps whole; in eager mode they run directly ([Note: eager fast path] in
`zero_kernels.ops.library`).

[Note: quantized bytes]
n elements in nb = ceil(n / block) blocks; block b covers x[b*block : min((b+1)*block, n)], so
only the last block may be short.

- scales: float32[nb], scales[b] for block b.
- bits=8: q is uint8[n]; byte i is element i as a two's-complement int8 (``q.view(torch.int8)``
  gives the values), in [-127, 127] (-128 never occurs).
- bits=4: q is uint8[ceil(n / 2)]; byte k holds element 2k in bits 0-3 and element 2k+1 in bits
  4-7, each a two's-complement nibble in [-7, 7] (0b1000 never occurs); for odd n the last byte's
  high nibble is 0. block must be even, so every block starts on a byte: block b's bytes are
  q[b*block/2 : (b+1)*block/2], and slicing whole blocks slices q and scales alike.

Formulas, in fp32, every operation rounded once (never an fma), qmax = 127 or 7:

    y      = x + error            (error feedback; else y = x, bf16/fp16 widened exactly)
    absmax = max |y| over the block
    scale  = absmax / qmax
    inv    = min(qmax / absmax, FLT_MAX)            (absmax = 0: FLT_MAX, so q = 0)
    q      = round_half_even(clamp(y * inv, -qmax, qmax))
    error <- y - q * scale                           (fp32 residual, updated in place)
    deq    = q * scale;   accumulate: out = out + q * scale

Accuracy: |y - deq| <= scale * (1/2 + 2^-14) for every element (half a quantization step, plus
the fp32 roundings of inv, y * inv and q * scale) in blocks whose absmax >= qmax * 2^-126 (scale
a normal float); blocks below that (every |y| < 1.5e-36) come back within 2 * absmax.
Values within 2^-22 of FLT_MAX may come back as +-inf (q * scale rounds past FLT_MAX).

Zeros: a block of zeros has scale 0 and q 0 and comes back as exact +0.0 (-0.0 too).

Non-finite values are never hidden by a scale (gradient-overflow detection must still see them
after the round trip and in every sum they enter):

- a block with a NaN in y: scales[b] = NaN (always 0x7fc00000), q = 0, and every element of
  the block dequantizes to NaN;
- a block with +-inf and no NaN: scales[b] = +inf, q = +-qmax where y = +-inf and 0 elsewhere,
  so those elements dequantize to +-inf and the block's finite elements to NaN (0 * inf);
- with error feedback, a non-finite block's residuals are reset to 0: a NaN residual would make
  every later step overflow, and the step that saw the overflow is skipped by the loss scaler.
"""

from __future__ import annotations

import torch

from .. import native
from . import quant_reference
from .backends import _say_once, resolve_backend
from .library import _bump, _direct

__all__ = [
    "DEFAULT_BLOCK",
    "DEQUANTIZE_SCHEMA",
    "QUANTIZE_SCHEMA",
    "QUANT_BITS",
    "dequantize_blockwise",
    "quantize_blockwise",
    "quantized_sizes",
]

QUANT_BITS = (4, 8)
# Elements per block: docs/benchmarks.md "Blockwise quantization" (error and bytes vs block size).
DEFAULT_BLOCK = 256
_INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

QUANTIZE_SCHEMA = (
    "(Tensor x, Tensor(a!) q, Tensor(b!) scales, Tensor(c!)? error=None, *, int bits, "
    'int block, str backend="auto") -> ()'
)
DEQUANTIZE_SCHEMA = (
    "(Tensor q, Tensor scales, Tensor(a!) out, *, int bits, int block, bool accumulate=False, "
    'str backend="auto") -> ()'
)


def quantized_sizes(numel: int, bits: int, block: int) -> tuple[int, int]:
    """(bytes of q, number of scales) for ``numel`` elements: [Note: quantized bytes]."""
    _check_layout("quantized_sizes", bits, block)
    _check_numel("quantized_sizes", numel)
    return _sizes(numel, bits, block)


def _sizes(numel, bits: int, block: int):
    # numel may be a SymInt (fake tensors under torch.compile)
    return (numel if bits == 8 else (numel + 1) // 2), -(-numel // block)


# ---- argument checks: shared by the public functions, the implementations and the fakes ----


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check_layout(fn: str, bits, block) -> None:
    if not _is_int(bits) or bits not in QUANT_BITS:
        raise ValueError(f"{fn}: bits must be 4 or 8, got bits={bits!r}")
    if not _is_int(block) or block <= 0:
        raise ValueError(f"{fn}: block must be a positive int, got block={block!r}")
    if bits == 4 and block % 2 != 0:
        raise ValueError(
            f"{fn}: bits=4 packs two values per byte and every block starts on a byte, so block "
            f"must be even, got block={block}"
        )


def _check_numel(fn: str, numel) -> None:
    if isinstance(numel, torch.SymInt):  # traced by torch.compile: checked when it runs
        return
    if not _is_int(numel) or numel < 0:
        raise ValueError(f"{fn}: numel must be an int >= 0, got numel={numel!r}")


def _check_tensor(fn, name, t, dtypes, device, numel, device_of="x") -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{fn}: {name} must be a Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        want = dtypes[0] if len(dtypes) == 1 else tuple(dtypes)
        raise TypeError(f"{fn}: {name}.dtype must be {want}, got {name}.dtype={t.dtype}")
    if t.device != device:
        raise ValueError(f"{fn}: {name} is on {t.device}, {device_of} is on {device}")
    if t.numel() != numel:
        raise ValueError(f"{fn}: {name}.numel()={t.numel()}, expected {numel}")
    if not t.is_contiguous():
        raise ValueError(f"{fn}: {name} must be contiguous, got {name}.stride()={t.stride()}")


def _check_quantize(x, q, scales, error, bits, block) -> None:
    fn = "quantize_blockwise"
    _check_layout(fn, bits, block)
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{fn}: x must be a Tensor, got {type(x).__name__}")
    n = x.numel()
    _check_tensor(fn, "x", x, _INPUT_DTYPES, x.device, n)
    nq, ns = _sizes(n, bits, block)
    _check_tensor(fn, "q", q, (torch.uint8,), x.device, nq)
    _check_tensor(fn, "scales", scales, (torch.float32,), x.device, ns)
    if error is not None:
        _check_tensor(fn, "error", error, (torch.float32,), x.device, n)


def _check_dequantize(q, scales, out, bits, block, accumulate) -> None:
    fn = "dequantize_blockwise"
    _check_layout(fn, bits, block)
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"{fn}: out must be a Tensor, got {type(out).__name__}")
    if accumulate and out.dtype != torch.float32:
        raise TypeError(
            f"{fn}: accumulate=True sums in fp32: out.dtype must be torch.float32, "
            f"got out.dtype={out.dtype}"
        )
    n = out.numel()
    if not isinstance(q, torch.Tensor):
        raise TypeError(f"{fn}: q must be a Tensor, got {type(q).__name__}")
    nq, ns = _sizes(n, bits, block)
    _check_tensor(fn, "q", q, (torch.uint8,), q.device, nq)
    _check_tensor(fn, "scales", scales, (torch.float32,), q.device, ns, device_of="q")
    _check_tensor(fn, "out", out, _INPUT_DTYPES, q.device, n, device_of="q")


# ---- backends ----

_STALE = (
    "zero_kernels._C was built before the quantization kernels existed; rebuild it "
    "(pip install --no-build-isolation . or python setup.py build_ext --inplace)"
)


def _backend(backend: str, device: torch.device) -> str:
    name = resolve_backend(backend, device)
    if name in ("cpu", "cuda") and not hasattr(native.load(), "quantize_blockwise"):
        if backend != "auto":
            raise RuntimeError(f"backend={backend!r} cannot run: {_STALE}")
        _say_once(f"zero_kernels: {_STALE}; using the pure-torch reference quantization")
        return "reference"
    return name


def _quantize(x, q, scales, error, bits, block, backend) -> None:
    _check_quantize(x, q, scales, error, bits, block)
    if x.numel() == 0:
        return
    name = _backend(backend, x.device)
    if name in ("cpu", "cuda"):
        native.load().quantize_blockwise(x, error, q, scales, bits, block)
    elif name == "triton":
        from . import triton_quant

        triton_quant.quantize_into(x, q, scales, error, bits, block)
    else:
        quant_reference.quantize_into(x, q, scales, error, bits, block)


def _dequantize(q, scales, out, bits, block, accumulate, backend) -> None:
    _check_dequantize(q, scales, out, bits, block, accumulate)
    if out.numel() == 0:
        return
    name = _backend(backend, out.device)
    if name in ("cpu", "cuda"):
        native.load().dequantize_blockwise(q, scales, out, bits, block, accumulate)
    elif name == "triton":
        from . import triton_quant

        triton_quant.dequantize_into(q, scales, out, bits, block, accumulate)
    else:
        quant_reference.dequantize_into(q, scales, out, bits, block, accumulate)


# ---- the ops ----


def _quantize_impl(
    x: torch.Tensor,
    q: torch.Tensor,
    scales: torch.Tensor,
    error: torch.Tensor | None = None,
    *,
    bits: int,
    block: int,
    backend: str = "auto",
) -> None:
    _quantize(x, q, scales, error, bits, block, backend)


def _dequantize_impl(
    q: torch.Tensor,
    scales: torch.Tensor,
    out: torch.Tensor,
    *,
    bits: int,
    block: int,
    accumulate: bool = False,
    backend: str = "auto",
) -> None:
    _dequantize(q, scales, out, bits, block, accumulate, backend)


quantize_blockwise_ = torch.library.custom_op(
    "zero_kernels::quantize_blockwise_",
    mutates_args=("q", "scales", "error"),
    schema=QUANTIZE_SCHEMA,
)(_quantize_impl)

dequantize_blockwise_ = torch.library.custom_op(
    "zero_kernels::dequantize_blockwise_",
    mutates_args=("out",),
    schema=DEQUANTIZE_SCHEMA,
)(_dequantize_impl)


@quantize_blockwise_.register_fake
def _quantize_fake(x, q, scales, error=None, *, bits, block, backend="auto") -> None:
    _check_quantize(x, q, scales, error, bits, block)


@dequantize_blockwise_.register_fake
def _dequantize_fake(q, scales, out, *, bits, block, accumulate=False, backend="auto") -> None:
    _check_dequantize(q, scales, out, bits, block, accumulate)


# ---- public functions ----


def quantize_blockwise(
    x: torch.Tensor,
    bits: int = 8,
    block: int = DEFAULT_BLOCK,
    *,
    error: torch.Tensor | None = None,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize contiguous ``x`` (fp32/bf16/fp16, any shape, read flat) to ``(q, scales)``.

    ``q`` is uint8 (int8 values, or two int4 per byte), ``scales`` fp32, one per ``block``
    elements: [Note: quantized bytes]. ``error`` (fp32, ``x.numel()`` elements) turns on error
    feedback: ``x + error`` is quantized and ``error`` becomes what the bytes miss of it.
    ``out=(q, scales)`` writes into given tensors (e.g. views of a send buffer).
    """
    _check_layout("quantize_blockwise", bits, block)
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"quantize_blockwise: x must be a Tensor, got {type(x).__name__}")
    if out is None:
        nq, ns = _sizes(x.numel(), bits, block)
        q = torch.empty(nq, dtype=torch.uint8, device=x.device)
        scales = torch.empty(ns, dtype=torch.float32, device=x.device)
    else:
        if not isinstance(out, (tuple, list)) or len(out) != 2:
            raise TypeError(
                f"quantize_blockwise: out must be a (q, scales) pair, got {type(out).__name__}"
            )
        q, scales = out
    if _direct((x, q, scales, error)):
        _quantize(x, q, scales, error, bits, block, backend)
        _bump((q, scales, error))
    else:
        quantize_blockwise_(x, q, scales, error, bits=bits, block=block, backend=backend)
    return q, scales


def dequantize_blockwise(
    q: torch.Tensor,
    scales: torch.Tensor,
    bits: int,
    block: int,
    numel: int,
    *,
    out: torch.Tensor | None = None,
    dtype: torch.dtype | None = None,
    accumulate: bool = False,
    backend: str = "auto",
) -> torch.Tensor:
    """The ``numel`` values of ``(q, scales)``: ``q * scale`` per block, as a 1-D tensor.

    Written into ``out`` when given (``numel`` elements, contiguous), else into a new tensor of
    ``dtype`` (default fp32; when both are given they must agree). ``accumulate=True`` adds in
    fp32 into ``out`` (``out = out + q * scale``), as each hop of a quantized reduce sums the
    pieces it receives.
    """
    fn = "dequantize_blockwise"
    _check_layout(fn, bits, block)
    _check_numel(fn, numel)
    if dtype is not None and dtype not in _INPUT_DTYPES:
        raise TypeError(f"{fn}: dtype must be one of {_INPUT_DTYPES}, got dtype={dtype}")
    if out is None:
        if accumulate:
            raise ValueError(f"{fn}: accumulate=True adds into out: pass an fp32 out, got None")
        if not isinstance(q, torch.Tensor):
            raise TypeError(f"{fn}: q must be a Tensor, got {type(q).__name__}")
        out = torch.empty(numel, dtype=dtype or torch.float32, device=q.device)
    else:
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"{fn}: out must be a Tensor, got {type(out).__name__}")
        if dtype is not None and dtype != out.dtype:
            raise ValueError(f"{fn}: dtype={dtype} differs from out.dtype={out.dtype}")
        if out.numel() != numel:
            raise ValueError(f"{fn}: out.numel()={out.numel()}, expected numel={numel}")
    if _direct((q, scales, out)):
        _dequantize(q, scales, out, bits, block, accumulate, backend)
        _bump((out,))
    else:
        dequantize_blockwise_(
            q, scales, out, bits=bits, block=block, accumulate=accumulate, backend=backend
        )
    return out.view(-1)
