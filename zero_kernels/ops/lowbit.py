"""Adam/AdamW with low-bit optimizer state: the format, the pure-torch reference, the dispatch.

[Note: low-bit state]
``state_dtype`` names how ``exp_avg`` (m) and ``exp_avg_sq`` (v) are stored; params stay fp32
masters and the math is fp32 in every backend (`zero_kernels.ops.hyper` [Note: one math routine]).

- ``"fp32"``: torch's format (the plain kernel, `zero_kernels.ops.adam_step`).
- ``"bf16"``: m and v in bfloat16, rounded to nearest even after each step. 20 bytes per param
  per step (p read+write 8, g 4, m 4, v 4) instead of 28.
- ``"int8"``: blockwise, ``block`` elements per block (the last one may be shorter), one fp32
  scale per block for each of m and v. 16 bytes per param per step (p 8, g 4, m 2, v 2, scales
  8/block). Stored tensors: ``exp_avg`` int8, ``exp_avg_sq`` uint8, ``exp_avg_scale`` and
  ``exp_avg_sq_scale`` fp32 of ``ceil(n / block)``.

  m (signed) uses a square-law map, which spends its 255 codes where small moments are:
      decode  m = q * |q| * s                       q in [-127, 127]
      encode  A = max |m| over the block,  s = A / 127^2,  inv = min(127^2 / A, FLT_MAX)
              q = sign(m) * rne(min(sqrt(|m| * inv), 127))
  v (non-negative) stores u = sqrt(v), which the step computes anyway, with the same map:
      decode  u = q^2 * s,  v = u * u             q in [0, 255]
      encode  U = max u over the block,  s = U / 255^2,  inv = min(255^2 / U, FLT_MAX)
              q = rne(min(sqrt(u * inv), 255)), and q = max(q, 1) where u > 0
  The smallest code of v is never 0 for a non-zero v (the "zero-point problem" of Li et al.,
  "Memory Efficient Optimizers with 4-bit States", NeurIPS 2023: a v that rounds to 0 makes the
  update m / eps). Rounding a tiny v up only shrinks that element's step. A block whose new m or
  v holds a NaN or an inf stores scale NaN and q 0, so the state stays non-finite as fp32 state
  would (with ``check_finite`` such a step is skipped before anything is written); both
  moments' scales of such a block are NaN, whichever of them overflowed.

Each step decodes the stored state, updates p from the fp32 m and v of this step (as torch
would from fp32 state), then encodes the new m and v: the quantization error enters the next
step's moments only. Blocks are counted from the tensor's first element, so the kernels split
work on block boundaries and a block never spans two tensors. Tensors below
``MIN_LOWBIT_NUMEL`` elements keep fp32 state (bitsandbytes' ``min_8bit_size`` rule): their
bytes are negligible and biases and norms are where quantized moments would hurt most.
"""

from __future__ import annotations

import weakref

import torch

from .. import native
from . import reference
from .backends import resolve_backend
from .hyper import AdamHyper

__all__ = [
    "DEFAULT_STATE_BLOCK",
    "MIN_LOWBIT_NUMEL",
    "STATE_DTYPES",
    "adam_step_lowbit",
    "check_state_dtype",
    "decode_state",
    "encode_state",
    "new_state",
    "state_bytes_per_param",
]

STATE_DTYPES = ("fp32", "bf16", "int8")
DEFAULT_STATE_BLOCK = 256
MIN_LOWBIT_NUMEL = 4096
MAX_STATE_BLOCK = 4096  # the CPU kernel keeps one block's new m and u on its stack
_M_CODES, _V_CODES = 127.0, 255.0
_FLT_MAX = torch.finfo(torch.float32).max
# the state keys of each format, besides "step"
STATE_KEYS = {
    "fp32": ("exp_avg", "exp_avg_sq"),
    "bf16": ("exp_avg", "exp_avg_sq"),
    "int8": ("exp_avg", "exp_avg_sq", "exp_avg_scale", "exp_avg_sq_scale"),
}


def check_state_dtype(state_dtype: str, block: int = DEFAULT_STATE_BLOCK, who: str = "") -> None:
    """Raise, naming the argument, unless ``state_dtype`` and ``block`` are a valid pair."""
    where = f"{who}: " if who else ""
    if state_dtype not in STATE_DTYPES:
        raise ValueError(f"{where}state_dtype must be one of {STATE_DTYPES}, got {state_dtype!r}")
    if not isinstance(block, int) or isinstance(block, bool):
        raise TypeError(f"{where}state_block must be an int, got {block!r}")
    if not (64 <= block <= MAX_STATE_BLOCK and block % 64 == 0):
        raise ValueError(
            f"{where}state_block must be a multiple of 64 in [64, {MAX_STATE_BLOCK}], got {block}"
        )


def num_blocks(n: int, block: int) -> int:
    return (n + block - 1) // block


def state_bytes_per_param(state_dtype: str, block: int = DEFAULT_STATE_BLOCK) -> float:
    """Bytes of m and v per element (the fp32 master not counted)."""
    return {"fp32": 8.0, "bf16": 4.0, "int8": 2.0 + 8.0 / block}[state_dtype]


def new_state(n: int, state_dtype: str, block: int, device) -> dict[str, torch.Tensor]:
    """Zero moments of ``n`` elements in ``state_dtype`` (flat tensors)."""
    if state_dtype == "int8":
        nb = num_blocks(n, block)
        return {
            "exp_avg": torch.zeros(n, dtype=torch.int8, device=device),
            "exp_avg_sq": torch.zeros(n, dtype=torch.uint8, device=device),
            "exp_avg_scale": torch.zeros(nb, dtype=torch.float32, device=device),
            "exp_avg_sq_scale": torch.zeros(nb, dtype=torch.float32, device=device),
        }
    dtype = torch.bfloat16 if state_dtype == "bf16" else torch.float32
    return {
        "exp_avg": torch.zeros(n, dtype=dtype, device=device),
        "exp_avg_sq": torch.zeros(n, dtype=dtype, device=device),
    }


# each state tensor's dtype, per format (what `new_state` makes)
_STATE_TENSOR_DTYPES = {
    "int8": {
        "exp_avg": torch.int8,
        "exp_avg_sq": torch.uint8,
        "exp_avg_scale": torch.float32,
        "exp_avg_sq_scale": torch.float32,
    },
    "bf16": {"exp_avg": torch.bfloat16, "exp_avg_sq": torch.bfloat16},
}


def block_index(n: int, block: int, starts: torch.Tensor | None = None) -> torch.Tensor:
    """The block of each of ``n`` elements: ``i // block``, or by ``starts`` (int64, nb + 1)."""
    if starts is None:
        return torch.arange(n) // block
    starts = starts.cpu()
    return torch.repeat_interleave(torch.arange(starts.numel() - 1), starts.diff())


def decode_state(
    state: dict, state_dtype: str, block: int, starts: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 (m, v) of flat stored state (new tensors)."""
    if state_dtype != "int8":
        return state["exp_avg"].float(), state["exp_avg_sq"].float()
    qm = state["exp_avg"].float()
    qv = state["exp_avg_sq"].float()
    idx = block_index(qm.numel(), block, starts).to(qm.device)
    m = (qm * qm.abs()) * state["exp_avg_scale"][idx]
    u = (qv * qv) * state["exp_avg_sq_scale"][idx]
    return m, u * u


def _encode(x: torch.Tensor, idx: torch.Tensor, finite: torch.Tensor, codes: float, signed: bool):
    """(codes as fp32, scales) of flat fp32 ``x`` (``x`` >= 0 unless ``signed``), element i in
    block ``idx[i]``; ``finite``: per block, whether its m and u are all finite."""
    nb = finite.numel()
    ok = torch.isfinite(x).float()
    amax = torch.zeros(nb, device=x.device).scatter_reduce(
        0, idx, torch.where(ok > 0, x.abs(), torch.zeros_like(x)), "amax"
    )
    c2 = codes * codes
    scale = torch.where(finite, amax / c2, torch.full_like(amax, float("nan")))
    inv = torch.clamp(torch.full_like(amax, c2) / amax, max=_FLT_MAX)
    inv = torch.where(finite, inv, torch.zeros_like(inv))
    t = torch.sqrt(x.abs() * inv[idx]).clamp(max=codes)
    q = torch.round(t)  # half to even
    if signed:
        q = torch.where(x < 0, -q, q)
    else:
        q = torch.where((x > 0) & (q == 0), torch.ones_like(q), q)
    q = torch.where(finite[idx], q, torch.zeros_like(q))
    return q, scale


def encode_state(
    m: torch.Tensor,
    v: torch.Tensor,
    state_dtype: str,
    block: int,
    out: dict,
    starts: torch.Tensor | None = None,
) -> None:
    """Write fp32 (m, v) into the stored state ``out`` (its tensors, in place)."""
    if state_dtype != "int8":
        out["exp_avg"].copy_(m.view_as(out["exp_avg"]))
        out["exp_avg_sq"].copy_(v.view_as(out["exp_avg_sq"]))
        return
    m = m.reshape(-1).float()
    idx = block_index(m.numel(), block, starts).to(m.device)
    nb = out["exp_avg_scale"].numel()
    u = torch.sqrt(v.reshape(-1).float())
    ok = (torch.isfinite(m) & torch.isfinite(u)).float()  # a block is finite in both or neither
    finite = torch.ones(nb, device=m.device).scatter_reduce(0, idx, ok, "amin") > 0
    qm, sm = _encode(m, idx, finite, _M_CODES, signed=True)
    qv, sv = _encode(u, idx, finite, _V_CODES, signed=False)
    out["exp_avg"].copy_(qm.to(torch.int8))
    out["exp_avg_sq"].copy_(qv.to(torch.uint8))
    out["exp_avg_scale"].copy_(sm)
    out["exp_avg_sq_scale"].copy_(sv)


def _reference_step(p, g, state, hyper: AdamHyper, state_dtype, block, out_lowp, starts=None):
    """Decode, the fp32 reference step (`zero_kernels.ops.reference`), encode."""
    m, v = decode_state(state, state_dtype, block, starts)
    out = None if out_lowp is None else out_lowp.view(-1)
    reference.adam_step(p.view(-1), g.reshape(-1), m, v, hyper, out_lowp=out)
    encode_state(m, v, state_dtype, block, state, starts)


# block tables checked already: id -> (a weak reference to the table, (its version, n, block)
# when checked); a step's tables are made once and passed every step
# (`zero_kernels.partition.lowbit_state`), so the host checks each once, not at every step (a
# table written since has a new version); an entry goes with its table
_checked_starts: dict[int, tuple[weakref.ref, tuple]] = {}


def _check_starts(starts: torch.Tensor, n: int, block: int) -> int:
    """The number of blocks of table ``starts`` for ``n`` elements, after checking it."""
    key = (starts._version, n, block)
    seen = _checked_starts.get(id(starts))
    if seen is not None and seen[0]() is starts and seen[1] == key:
        return starts.numel() - 1
    d = starts.diff() if starts.dim() == 1 else None
    if not (
        starts.device.type == "cpu"
        and starts.dtype == torch.int64
        and starts.dim() == 1
        and starts.numel() >= 2
        and int(starts[0]) == 0
        and int(starts[-1]) == n
        and bool(((d >= 1) & (d <= block)).all())
    ):
        raise ValueError(
            f"adam_step_lowbit: block_starts must be int64 from 0 to {n} with steps in "
            f"[1, block={block}], got {starts.tolist()[:8]}..."
        )
    k = id(starts)
    _checked_starts[k] = (weakref.ref(starts, lambda _, k=k: _checked_starts.pop(k, None)), key)
    return starts.numel() - 1


def _check(p, g, state, state_dtype, block, out_lowp, hyper, starts) -> None:
    if hyper.amsgrad:
        raise ValueError(
            "adam_step_lowbit: amsgrad needs max_exp_avg_sq, kept in fp32 only; "
            "use state_dtype='fp32' with amsgrad=True"
        )
    if p.dtype != torch.float32 or not p.is_contiguous():
        raise TypeError(
            f"adam_step_lowbit: param must be contiguous fp32 (the master), got {p.dtype}"
        )
    if g.numel() != p.numel() or g.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(
            f"adam_step_lowbit: grad must have param's {p.numel()} elements and a float dtype, "
            f"got {g.numel()} of {g.dtype}"
        )
    n = p.numel()
    nb = num_blocks(n, block)
    if starts is not None:
        if state_dtype != "int8":
            raise ValueError("adam_step_lowbit: block_starts is for state_dtype='int8'")
        nb = _check_starts(starts, n, block)
    want = _STATE_TENSOR_DTYPES[state_dtype]
    for k in STATE_KEYS[state_dtype]:
        t = state.get(k)
        size = nb if k.endswith("_scale") else n
        if t is None or t.dtype != want[k] or t.numel() != size or not t.is_contiguous():
            got = None if t is None else (t.dtype, t.numel())
            raise ValueError(
                f"adam_step_lowbit: state[{k!r}] must be {size} contiguous {want[k]} "
                f"for state_dtype={state_dtype!r}, block={block}, got {got}"
            )
        if t.device != p.device:
            raise ValueError(
                f"adam_step_lowbit: state[{k!r}] is on {t.device}, param on {p.device}"
            )
    if out_lowp is not None and (
        out_lowp.dtype not in (torch.bfloat16, torch.float16) or out_lowp.numel() != n
    ):
        raise ValueError("adam_step_lowbit: out_lowp must be bf16/fp16 with param's numel")


def adam_step_lowbit(
    param: torch.Tensor,
    grad: torch.Tensor,
    state: dict,
    hyper: AdamHyper,
    *,
    state_dtype: str,
    block: int = DEFAULT_STATE_BLOCK,
    block_starts: torch.Tensor | None = None,
    out_lowp: torch.Tensor | None = None,
    found_inf: torch.Tensor | None = None,
    check_finite: bool = False,
    backend: str = "auto",
) -> torch.Tensor | None:
    """One Adam/AdamW step with m, v stored as ``state_dtype`` ("bf16" or "int8"), in place.

    ``state`` holds the tensors of `new_state` (flat, ``param.numel()`` elements).
    ``block_starts`` (int8, optional; a CPU tensor whatever the device, which the CUDA binding
    copies to the device at each call: pass one made once, pinned, as the sharded step does;
    it is checked once per version): int64 ``[0, ..., n]``,
    block k covering ``[block_starts[k], block_starts[k + 1])``, each at most ``block`` long; the
    scales then
    have ``len(block_starts) - 1`` entries (a sharded step's blocks follow its pieces).
    ``found_inf`` and ``check_finite`` as in `zero_kernels.ops.adam_step`: a non-zero
    ``found_inf`` skips the step; with ``check_finite`` a non-finite grad sets it and nothing
    is written.
    """
    check_state_dtype(state_dtype, block, "adam_step_lowbit")
    if state_dtype == "fp32":
        raise ValueError("adam_step_lowbit: state_dtype='fp32' runs zero_kernels.ops.adam_step")
    _check(param, grad, state, state_dtype, block, out_lowp, hyper, block_starts)
    if check_finite and found_inf is None:
        found_inf = torch.zeros(1, dtype=torch.float32, device=param.device)
    if param.numel() == 0:
        return found_inf
    name = resolve_backend(backend, param.device)
    if name in ("cpu", "cuda"):
        keys = STATE_KEYS[state_dtype]
        m_scale = state[keys[2]] if state_dtype == "int8" else None
        v_scale = state[keys[3]] if state_dtype == "int8" else None
        native.load().adam_step_lowbit(
            param,
            grad,
            state["exp_avg"],
            state["exp_avg_sq"],
            m_scale,
            v_scale,
            out_lowp,
            found_inf,
            check_finite,
            block,
            block_starts,
            hyper.lr,
            hyper.beta1,
            hyper.beta2,
            hyper.eps,
            hyper.weight_decay,
            hyper.step_size,
            hyper.bias_correction2_sqrt,
            hyper.grad_scale,
            hyper.adamw,
            hyper.maximize,
        )
        return found_inf
    if found_inf is not None:
        if check_finite and not bool(torch.isfinite(grad.float() * hyper.grad_scale).all()):
            found_inf.fill_(1.0)
        if bool(found_inf.item() != 0):
            return found_inf
    if name == "triton":
        from . import triton_lowbit

        if block_starts is not None:
            raise NotImplementedError("adam_step_lowbit: block_starts on the Triton backend")
        triton_lowbit.adam_step_lowbit(param, grad, state, hyper, state_dtype, block, out_lowp)
    else:
        _reference_step(param, grad, state, hyper, state_dtype, block, out_lowp, block_starts)
    return found_inf
