"""Gradients that torch's tools can see: ``param.grad`` as a `ShardedGrad` after each reduction.

[Note: gradients]
After a synchronising backward the averaged gradient of a parameter lives in pieces, one per rank
that owns part of it (see `zero_kernels.layout.Piece`), inside the gradient store; no rank holds
it whole (stage 2 never does; stage 1 holds a full-size buffer whose other ranks' ranges are
stale). How the peers show it:

- FSDP2 makes ``param.grad`` a sharded DTensor: every torch op works, collectives where needed.
  Our pieces cut parameters at arbitrary elements, which DTensor's placements (dim-wise shards)
  cannot describe, and DTensor's general op coverage is not needed for a gradient.
- FSDP1 ``use_orig_params`` makes ``param.grad`` a view of the *local* flat shard, with the other
  elements missing (None or zero): ``clip_grad_norm_`` on it computes a local norm, off by √N, the
  bug this project exists to avoid.
- Megatron keeps ``param.main_grad`` and leaves ``.grad`` None: torch's tools see nothing
  (``clip_grad_norm_`` returns 0, ``zero_grad`` does nothing, GradScaler finds no inf checks).

We take FSDP2's idea at a gradient's size: ``param.grad`` is a `ShardedGrad`, a tensor subclass
with the parameter's shape, dtype and device whose data is this rank's piece of the reduced
gradient (a view of the store, never a copy). The operations torch's tools apply to gradients are
implemented exactly, over all ranks (every rank must make the call, as every rank of a DDP script
does): norms (``torch.linalg.vector_norm``, ``Tensor.norm``, ``torch._foreach_norm``: one
all-reduce), in-place scaling by a number or 0-dim tensor (``mul_``, ``div_`` and their
``_foreach`` forms), ``zero_``/``fill_``, ``copy_``/``add_`` of a whole tensor (each rank takes its
piece), ``detach``, element-wise clamps by numbers (``clamp_``, ``clamp_min_``, ``clamp_max_``
and their ``_foreach`` forms), and GradScaler's ``_amp_foreach_non_finite_check_and_unscale_``
(found_inf all-reduced, so every rank skips alike). So ``torch.nn.utils.clip_grad_norm_``,
``clip_grad_value_``, ``model.zero_grad()`` (either ``set_to_none``) and ``torch.amp.GradScaler``
give DDP's result.
Norms read nothing back to the host: each tensor's partial result is a float64 device tensor
(`zero_kernels.syncfree.pow_sum`: no float64 copy of a piece, [Note: accurate norms]),
all-reduced on the device, and the norms come back as device tensors. Where the optimizer's
step is sync-free (off the CPU: [Note: no host sync] in `zero_kernels.syncfree`), ``mul_``/
``div_`` by a one-element tensor multiply the pieces by that tensor. So torch's
``clip_grad_norm_`` (foreach or not) is as sync-free there as ``opt.clip_grad_norm_``.
Any other operation raises `ShardedGradError`, naming ``opt.full_grad(p)`` (the whole gradient,
collective) and ``opt.clip_grad_norm_``. Values are true gradients: loss scaling removed and
``opt.clip_grad_norm_`` applied (lazily kept as one factor; see `GradViews.normalize`).

Assignments are seen at the next backward, ``clip_grad_norm_``, ``step`` or ``full_grad``:
``p.grad = None`` (``zero_grad``) leaves the parameter out (its reduced gradient is dropped; with
no new gradient it is not stepped, as torch skips it); ``p.grad = tensor`` replaces the gradient
by that tensor (each rank keeps its piece: give every rank the same tensor, as DDP's grads are).
A parameter that got no gradient on any rank since ``zero_grad`` keeps ``grad = None`` (DDP's rule:
one all-reduce of a byte per parameter at the end of each synchronising backward decides it);
used on some ranks only, it gets the average with zeros from the others. ``zero_grad(set_to_none=
False)`` (the optimizer's or the model's) zeroes the gradients of the parameters that have one and
keeps them: such a parameter stays in the next step with a zero gradient where no backward gives
it one (Adam's momentum and weight decay still move it), as with torch's optimizer and DDP.

``step()`` does not consume gradients: they stay until ``zero_grad`` (torch's rule), and a second
backward without ``zero_grad`` adds to them.

Inside an accumulation window (``no_sync()``) a DDP rank's ``.grad`` is its own partial sum. Here
stage 1 leaves ``.grad`` None until the window ends (its reduction waits for the last
micro-batch), and stages 2-3 show the average over the ranks of the micro-batches so far (they
reduce each one into the shard). Both reach DDP's values when the window ends; what a script
reads or clips before that differs from DDP's (measured by probes of Lightning's
``on_after_backward``: norms 0.410 on both ranks against DDP's 0.230 / 0.684). accelerate's
``clip_grad_norm_``/``clip_grad_value_`` inside a window raise for that reason
(`zero_kernels.integrations.accelerate`).
"""

from __future__ import annotations

import math
import weakref

import torch

from .. import comm
from ..syncfree import any_nonfinite, pow_sum

__all__ = ["GradViews", "ShardedGrad", "ShardedGradError"]

aten = torch.ops.aten


class ShardedGradError(RuntimeError):
    """An operation on a sharded ``param.grad`` that cannot give the unsharded result."""


def _advice(name: str) -> str:
    return (
        f"{name} is not supported on the .grad of a parameter managed by ZeroOptimizer: the "
        "gradient is sharded across ranks (each holds its piece). Use opt.full_grad(param) for "
        "the whole gradient (collective), opt.clip_grad_norm_(max_norm) or "
        "torch.nn.utils.clip_grad_norm_ for clipping; norms, mul_/div_ by a number, zero_ and "
        "copy_ of a whole tensor work on it directly"
    )


class ShardedGrad(torch.Tensor):
    """``param.grad`` of a parameter managed by `ZeroOptimizer`; see [Note: gradients]."""

    @staticmethod
    def __new__(cls, param: torch.Tensor, views: GradViews, index: int):
        return torch.Tensor._make_wrapper_subclass(
            cls, param.shape, dtype=param.dtype, device=param.device, requires_grad=False
        )

    def __init__(self, param: torch.Tensor, views: GradViews, index: int):
        self._views = weakref.ref(views)
        self._index = index

    def __repr__(self, *, tensor_contents=None) -> str:
        return (
            f"ShardedGrad(shape={tuple(self.shape)}, dtype={self.dtype}, param index "
            f"{self._index}: sharded across ranks; opt.full_grad(param) gathers it)"
        )

    def _owner(self) -> GradViews:
        v = self._views()
        if v is None or v.closed:
            raise ShardedGradError(
                "this .grad belongs to a ZeroOptimizer that was closed or collected"
            )
        return v

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        impl = _IMPLS.get(func)
        if impl is None:
            raise ShardedGradError(_advice(f"torch operation {func}"))
        return impl(*args, **kwargs)


# ---------------------------------------------------------------------- implementations


def _sg(t) -> ShardedGrad:
    if not isinstance(t, ShardedGrad):
        raise ShardedGradError(_advice("mixing sharded and plain gradients in one call"))
    return t


def _pieces(t: ShardedGrad):
    """``[(piece view (true units after normalize), offset in the param)]`` of this rank."""
    return t._owner().pieces_of(t._index)


def _scalar(x) -> float:
    if isinstance(x, torch.Tensor):
        if x.numel() != 1 or isinstance(x, ShardedGrad):
            raise ShardedGradError(_advice("scaling by a tensor of more than one element"))
        return float(x.item())
    return float(x)


def _sync_free(t: ShardedGrad) -> bool:
    """Whether ``t``'s optimizer keeps its bookkeeping on the device ([Note: no host sync] in
    `zero_kernels.syncfree`): norms stay device tensors, scaling by a tensor reads nothing."""
    return bool(t._owner().owner().sync_free)


def _factor(t: ShardedGrad, x):
    """What the pieces of ``t`` are multiplied by: a number, or in sync-free mode a one-element
    tensor as it is, 0-dim (no host read; a CPU one multiplies device tensors as a number)."""
    if isinstance(x, torch.Tensor) and _sync_free(t):
        if x.numel() != 1 or isinstance(x, ShardedGrad):
            raise ShardedGradError(_advice("scaling by a tensor of more than one element"))
        c = x.detach().reshape(())
        return c if c.device.type == "cpu" else c.to(t.device)
    return _scalar(x)


def _inverse(c):
    return torch.reciprocal(c) if isinstance(c, torch.Tensor) else 1.0 / c


def _local_part(vals: list[torch.Tensor], o: float, device) -> torch.Tensor:
    """This rank's part of one tensor's norm of order ``o`` as a float64 0-dim tensor on
    ``device`` (no host read)."""
    if not vals:
        empty = 0.0 if not (math.isinf(o) and o < 0) else -math.inf
        return torch.full((), empty, dtype=torch.float64, device=device)
    if math.isinf(o) and o > 0:
        return torch.stack([v.abs().max().double() for v in vals]).max()
    if math.isinf(o):
        return -torch.stack([v.abs().min().double() for v in vals]).min()
    if o == 0:
        return torch.stack([(v != 0).sum().double() for v in vals]).sum()
    return torch.stack([pow_sum(v, o) for v in vals]).sum()


def _norm_parts(ts: list[ShardedGrad], ord) -> list[torch.Tensor]:
    """Global norms of ``ts``: local partial results, one all-reduce for the whole list; the
    partial results, the all-reduce and the norms stay on the device (no host read, on a GPU
    or not)."""
    owner = ts[0]._owner()
    owner.owner().check_not_joined("a norm of a sharded .grad (clip_grad_norm_)")
    owner.normalize()
    o = float(ord)
    if math.isnan(o):
        raise ValueError(f"norm order must not be nan, got ord={ord!r}")
    op = "max" if math.isinf(o) else "sum"
    part = torch.stack(
        [_local_part([v for v, _ in _pieces(_sg(t)) if v.numel()], o, owner.device) for t in ts]
    )
    comm.all_reduce(part, op, group=owner.group, log=owner.log)
    if math.isinf(o) and o < 0:
        part = -part
    elif not math.isinf(o) and o != 0:
        part = part ** (1.0 / o)
    return [part[k].to(dtype=t.dtype, device=t.device) for k, t in enumerate(ts)]


def _vector_norm(t, ord=2, dim=None, keepdim=False, *, dtype=None):
    if dim not in (None, [], ()) or keepdim:
        raise ShardedGradError(_advice("a norm over some dimensions"))
    r = _norm_parts([t], ord)[0]
    return r.to(dtype) if dtype is not None else r


def _norm(t, p=2, *a, **k):
    if a or k.get("dim") not in (None, [], ()):
        raise ShardedGradError(_advice("a norm over some dimensions"))
    return _norm_parts([t], 2 if p is None else p)[0]


def _foreach_norm(ts, ord=2, dtype=None):
    out = _norm_parts([_sg(t) for t in ts], ord)
    return [r.to(dtype) for r in out] if dtype is not None else out


def _scale(t, c):
    t = _sg(t)
    t._owner().normalize()
    for v, _ in _pieces(t):
        v.mul_(c)
    return t


def _mul_(t, other):
    return _scale(t, _factor(_sg(t), other))


def _div_(t, other, *, rounding_mode=None):
    if rounding_mode is not None:
        raise ShardedGradError(_advice(f"div_ with rounding_mode={rounding_mode!r}"))
    return _scale(t, _inverse(_factor(_sg(t), other)))


def _foreach_mul_(ts, other):
    ts = [_sg(t) for t in ts]
    if isinstance(other, (list, tuple)):
        for t, c in zip(ts, other):
            _scale(t, _factor(t, c))
    elif ts:
        c = _factor(ts[0], other)
        for t in ts:
            _scale(t, c)


def _foreach_div_(ts, other):
    ts = [_sg(t) for t in ts]
    if isinstance(other, (list, tuple)):
        for t, c in zip(ts, other):
            _scale(t, _inverse(_factor(t, c)))
    elif ts:
        c = _inverse(_factor(ts[0], other))
        for t in ts:
            _scale(t, c)


def _fill_(t, value):
    t = _sg(t)
    t._owner().normalize()
    v = _scalar(value)
    for piece, _ in _pieces(t):
        piece.fill_(v)
    return t


def _zero_(t):
    return _fill_(t, 0.0)


def _foreach_zero_(ts):
    for t in ts:
        _zero_(t)


def _take_from(t: ShardedGrad, src: torch.Tensor, alpha: float, add: bool) -> ShardedGrad:
    t = _sg(t)
    if isinstance(src, ShardedGrad):
        if src._index != t._index or src._views() is not t._views():
            raise ShardedGradError(_advice("copying one parameter's sharded grad into another's"))
        if not add:
            return t
        src_pieces = [v for v, _ in _pieces(src)]
        t._owner().normalize()
        for (v, _), s in zip(_pieces(t), src_pieces):
            v.add_(s, alpha=alpha)
        return t
    src = torch.as_tensor(src)
    if src.numel() != t.numel():
        src = src.expand(t.shape)
    flat = src.reshape(-1)
    t._owner().normalize()
    for v, off in _pieces(t):
        part = flat[off : off + v.numel()].to(v.dtype).view(v.shape)
        if add:
            v.add_(part, alpha=alpha)
        else:
            v.copy_(part)
    return t


def _copy_(t, src, non_blocking=False):
    return _take_from(t, src, 1.0, add=False)


def _add_(t, other, *, alpha=1):
    if not isinstance(other, torch.Tensor):
        raise ShardedGradError(_advice("adding a number to every element (add_ of a scalar)"))
    return _take_from(t, other, float(alpha), add=True)


def _detach(t):
    t = _sg(t)
    view = t._owner().view_for(t._index)  # (never `or`: a tensor's truth value is ambiguous)
    return view if view is not None else t


def _bound(x, what: str):
    if x is None:
        return None
    if isinstance(x, torch.Tensor):
        raise ShardedGradError(_advice(f"{what} with a tensor bound"))
    return float(x)


def _clamp_(t, min=None, max=None):
    """Element-wise, so each rank's pieces of the averaged gradient clamp to DDP's values
    (``torch.nn.utils.clip_grad_value_``)."""
    t = _sg(t)
    lo, hi = _bound(min, "clamp_"), _bound(max, "clamp_")
    t._owner().normalize()
    for piece, _ in _pieces(t):
        piece.clamp_(min=lo, max=hi)
    return t


def _clamp_min_(t, min):
    return _clamp_(t, min=min)


def _clamp_max_(t, max):
    return _clamp_(t, max=max)


def _foreach_clamp_min_(ts, scalar):
    for t in ts:
        _clamp_(t, min=scalar)


def _foreach_clamp_max_(ts, scalar):
    for t in ts:
        _clamp_(t, max=scalar)


def _identity(t, *a, **k):
    return t


def _unscale(grads, found_inf, inv_scale):
    """GradScaler's check-and-unscale over the pieces; found_inf agreed by every rank."""
    ts = [_sg(g) for g in grads]
    if not ts:
        return
    owner = ts[0]._owner()
    owner.normalize()
    if not isinstance(inv_scale, torch.Tensor) or inv_scale.numel() != 1:
        inv_scale = torch.tensor(_scalar(inv_scale))
    # on the device, no host read ([Note: no host sync] in `zero_kernels.syncfree`): the
    # pieces' flags and found_inf combined, agreed by one all-reduce; GradScaler's step reads it
    inv = inv_scale.reshape(()).float()
    vs = [v for t in ts for v, _ in _pieces(t) if v.numel()]
    flag = torch.maximum(any_nonfinite(vs, owner.device), found_inf.reshape(()).float())
    for v in vs:
        v.mul_(inv)
    flag = flag.reshape(1)
    comm.all_reduce(flag, "max", group=owner.group, log=owner.log)
    found_inf.copy_(flag.reshape(found_inf.shape))


_IMPLS = {
    aten.linalg_vector_norm.default: _vector_norm,
    aten.norm.Scalar: _norm,
    aten.norm.ScalarOpt_dim: _norm,
    aten._foreach_norm.Scalar: _foreach_norm,
    aten.mul_.Tensor: _mul_,
    aten.mul_.Scalar: _mul_,
    aten.div_.Tensor: _div_,
    aten.div_.Scalar: _div_,
    aten.div_.Tensor_mode: _div_,
    aten._foreach_mul_.Scalar: _foreach_mul_,
    aten._foreach_mul_.Tensor: _foreach_mul_,
    aten._foreach_mul_.List: _foreach_mul_,
    aten._foreach_mul_.ScalarList: _foreach_mul_,
    aten._foreach_div_.Scalar: _foreach_div_,
    aten._foreach_div_.Tensor: _foreach_div_,
    aten._foreach_div_.List: _foreach_div_,
    aten._foreach_div_.ScalarList: _foreach_div_,
    aten.zero_.default: _zero_,
    aten.fill_.Scalar: _fill_,
    aten._foreach_zero_.default: _foreach_zero_,
    aten.copy_.default: _copy_,
    aten.add_.Tensor: _add_,
    aten.detach.default: _detach,
    aten.detach_.default: _identity,
    aten.clamp_.default: _clamp_,
    aten.clamp_min_.default: _clamp_min_,
    aten.clamp_max_.default: _clamp_max_,
    aten._foreach_clamp_min_.Scalar: _foreach_clamp_min_,
    aten._foreach_clamp_max_.Scalar: _foreach_clamp_max_,
    aten.alias.default: _detach,
    aten._amp_foreach_non_finite_check_and_unscale_.default: _unscale,
}


class GradViews:
    """The `ShardedGrad` objects of one optimizer and the bookkeeping behind them.

    ``active``: parameters (indices) that have a reduced gradient since the last ``zero_grad``
    (decided on every rank alike; ``zero_grad(set_to_none=False)`` keeps them, zeroed);
    ``factor``: the store times ``factor`` is the true gradient.
    """

    def __init__(self, owner, device, group, log):
        # the optimizer's gradient part (`zero_kernels.grad_access.GradContract`): it applies
        # the pending factor, says whether host reads are avoided and whether a rank joined
        self._owner = weakref.ref(owner)
        self.device = device
        self.group = group
        self.log = log
        self.closed = False
        self.views: dict[int, ShardedGrad] = {}
        self.active: set[int] = set()
        # pieces per param index: (inner param's grad view, offset in the param)
        self.by_index: dict[int, list[tuple[torch.Tensor, int]]] = {}

    # ---- the optimizer's side
    def owner(self):
        o = self._owner()
        if o is None:
            raise ShardedGradError("the ZeroOptimizer of this gradient was collected")
        return o

    def pieces_of(self, index: int) -> list[tuple[torch.Tensor, int]]:
        return self.by_index.get(index, [])

    def normalize(self) -> None:
        """Make the store hold true gradients (apply the pending factor)."""
        self.owner().apply_factor()

    def view_for(self, index: int) -> ShardedGrad | None:
        return self.views.get(index)

    def install(self, params: dict[int, torch.Tensor]) -> None:
        """``p.grad = view`` for the active params, ``None`` for the others."""
        for idx, p in params.items():
            if idx in self.active:
                v = self.views.get(idx)
                if v is None:
                    v = self.views[idx] = ShardedGrad(p, self, idx)
                p.grad = v
            elif isinstance(p.grad, ShardedGrad):
                p.grad = None

    def detach_all(self, params: dict[int, torch.Tensor]) -> None:
        """Take every view off its param (``p.grad = None``)."""
        for _idx, p in params.items():
            if isinstance(p.grad, ShardedGrad):
                p.grad = None

    def user_changes(self, params: dict[int, torch.Tensor]):
        """``(cleared, replaced)``: active params whose view the user removed, and params whose
        ``.grad`` the user set to a tensor of their own (index -> tensor)."""
        cleared, replaced = set(), {}
        for idx, p in params.items():
            g = p.grad
            v = self.views.get(idx) if idx in self.active else None
            if g is v:
                continue
            if g is None:
                cleared.add(idx)
            elif isinstance(g, ShardedGrad) and g._views() is self and g._index == idx:
                p.grad = v  # a detached alias of our own view
            else:
                if isinstance(g, ShardedGrad):
                    raise ShardedGradError(
                        f"param {idx} was given the sharded .grad of another parameter or "
                        "optimizer; assign a plain tensor or None"
                    )
                replaced[idx] = g
        return cleared, replaced
