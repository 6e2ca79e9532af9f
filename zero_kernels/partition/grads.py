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
all-reduce for all the gradients of an optimizer, kept until they change, [Note: one collective
per clip]), in-place scaling by a number or 0-dim tensor (``mul_``, ``div_`` and their
``_foreach`` forms), ``zero_``/``fill_``, ``copy_``/``add_`` of a whole tensor (each rank takes its
piece), ``detach``, element-wise clamps by numbers (``clamp_``, ``clamp_min_``, ``clamp_max_``
and their ``_foreach`` forms), and GradScaler's ``_amp_foreach_non_finite_check_and_unscale_``
(found_inf all-reduced, so every rank skips alike). So ``torch.nn.utils.clip_grad_norm_``,
``clip_grad_value_``, ``model.zero_grad()`` (either ``set_to_none``) and ``torch.amp.GradScaler``
give DDP's result.
Norms read nothing back to the host: each tensor's partial result is a float64 device tensor
(`zero_kernels.partition.syncfree.pow_sum`: no float64 copy of a piece, [Note: accurate norms]),
all-reduced on the device, and the norms come back as device tensors (the cache of [Note: one
collective per clip] is a device tensor too). Where the optimizer's
step is sync-free (off the CPU: [Note: no host sync] in `zero_kernels.partition.syncfree`),
``mul_``/
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

[Note: one collective per clip]
torch's ``clip_grad_norm_`` asks one norm per gradient (``torch.linalg.vector_norm(g)``; it
takes ``torch._foreach_norm`` only for the tensor types of its ``_foreach_supported_types`` or
with ``foreach=True``), then the norm of their stack. Each norm of a ShardedGrad needs every
rank's pieces, and an all-reduce per norm made torch's clip one collective per param: 52 for a
52-param model (22.8 ms per clip at 2 gloo ranks against 0.8 for ``opt.clip_grad_norm_``), ~290
NCCL launches per step for a 7B model. FSDP2 issues one: each DTensor norm is a Partial value,
reduced once when the stacked norms are combined. Two ways to one here:

(a) A lazy partial norm: each norm returns a 0-dim subclass holding this rank's pow-sum (max for
    the inf-norm); ``.to`` and ``torch.stack`` keep it partial, the norm of the stack does the
    one all-reduce, any other use resolves it with an all-reduce of its own. Not taken: the
    collective would happen where a value is *used*, not where the norm is asked, and ordinary
    scripts use values on some ranks only: ``n = p.grad.norm()`` on every rank, then
    ``if rank == 0: log(n.item())``, would all-reduce on rank 0 alone (a hang, or a pairing
    with the others' next collective: a wrong value, silently). The partial would also have to
    survive whatever torch does between the norms and their stack (``.to``, dtype promotion
    across torch's dtype groups) in every torch version.
(b) A batched norm cache (taken): the first norm of an order asked of any ShardedGrad of an
    optimizer computes this rank's partials of every gradient it has (``GradViews.active``) and
    all-reduces them at once (a float64 vector, one entry per gradient); the global norms are
    kept per order (`GradViews.norms`), and every later norm of that order is read from them
    without a collective until the gradients change. Every norm returned is the global value,
    and the collective happens where the norm is asked, on every rank alike, as before. torch's
    clip costs one collective per optimizer whatever ``foreach`` is (one more per other
    optimizer whose params are in the call, one more for a ShardedGrad kept by the user after
    its param lost its gradient); norms of another order are another collective. The price: the
    first norm reads every piece of this rank's gradients (one pass over 1/N of them, which
    torch's clip makes anyway), however few norms follow.

A stale norm would be a silent wrong result, so the cache is forgotten (`GradViews.changed`) at
every event that can change a gradient's value or which params have one:
- every ShardedGrad operation but the reads (norms, ``detach``, ``alias``): ``__torch_dispatch__``
  forgets before it runs one (an operation added later is covered by default);
- in `zero_kernels.optimizer.grad_access.GradContract`: the start of a backward (the store
accumulates),
  the end of a reduction (``publish``: new values, a new set of params with a gradient), the
  user's assignments to ``.grad`` taken in (``sync_user_changes``), ``zero_grad`` (``reset``)
  and ``opt.clip_grad_norm_`` (its factor, or its in-place scaling in sync-free mode);
- a step that stepped (`zero_kernels.optimizer.stepper.Stepper`): torch's optimizers leave their
  gradients alone, an inner optimizer of another kind may write them.
A hit needs nothing more where the params asked have their views in place: no reduction is pending
and the pending factor is applied (every event that leaves either forgot the norms); else, and on a
miss, the store is made right first (``normalize``: it takes in reductions and assignments, which
forget), applying the factor changing the store, not the true gradients. An operation on one param's
ShardedGrad takes in only its own assignment where its view is in place (the others' wait for the
next full call), so torch's clip is not O(params**2) on the host (it was: every norm and ``mul_``
checked every param's ``.grad``, 42 ms per clip of a 290-param model on the fake group, 8 ms now).
Hit or miss must be the same on every rank (a miss is a collective), so only events every rank goes
through alike forget (the script's calls, decisions already agreed), never local state: not the
version counters of the pieces, for instance, which count writes to this rank's pieces only (a rank
without a piece of a param sees no write where the others do).
tests/stages/clip_norm_checks.py changes the gradients between norms in each of these ways and
compares with DDP; tests/stages/test_clip_norm.py counts the collectives of torch's clip at world
size 8.
"""

from __future__ import annotations

import math
import weakref

import torch

from .. import comm
from .syncfree import any_nonfinite, pow_sum

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
        if func not in _READS:  # it may change gradients: [Note: one collective per clip]
            _forget_norms(args)
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
    `zero_kernels.partition.syncfree`): norms stay device tensors, scaling by a tensor reads
    nothing."""
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


def _forget_norms(args) -> None:
    """Before an operation that may change the gradients in ``args`` (tensors or lists of
    them): their optimizers forget their cached norms ([Note: one collective per clip])."""
    for a in args:
        for t in a if isinstance(a, (list, tuple)) else (a,):
            if isinstance(t, ShardedGrad):
                views = t._views()
                if views is not None:
                    views.changed()


def _norm_parts(ts: list[ShardedGrad], ord) -> list[torch.Tensor]:
    """Global norms of ``ts``, each a new tensor of its dtype on its device: read from each
    optimizer's norms of that order, one all-reduce for all its gradients where they are not
    known ([Note: one collective per clip]); optimizers in the order of their first gradient in
    ``ts`` (the same on every rank). Nothing is read back to the host, on a GPU or not."""
    o = float(ord)
    if math.isnan(o):
        raise ValueError(f"norm order must not be nan, got ord={ord!r}")
    by_owner: dict[int, tuple[GradViews, list[int]]] = {}
    for k, t in enumerate(ts):
        views = _sg(t)._owner()
        by_owner.setdefault(id(views), (views, []))[1].append(k)
    out: list[torch.Tensor] = [None] * len(ts)  # type: ignore[list-item]
    for views, ks in by_owner.values():
        for k, n in zip(ks, views.norms([ts[k]._index for k in ks], o)):
            # a copy: the caller may change it in place, the cache stays
            out[k] = n.to(dtype=ts[k].dtype, device=ts[k].device, copy=True)
    return out


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
    t._owner().normalize(t._index)
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
    t._owner().normalize(t._index)
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
        t._owner().normalize(t._index)
        for (v, _), s in zip(_pieces(t), src_pieces):
            v.add_(s, alpha=alpha)
        return t
    src = torch.as_tensor(src)
    if src.numel() != t.numel():
        src = src.expand(t.shape)
    flat = src.reshape(-1)
    t._owner().normalize(t._index)
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
    t._owner().normalize(t._index)
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
    # on the device, no host read ([Note: no host sync] in `zero_kernels.partition.syncfree`): the
    # pieces' flags and found_inf combined, agreed by one all-reduce; GradScaler's step reads it
    inv = inv_scale.reshape(()).float()
    vs = [v for t in ts for v, _ in _pieces(t) if v.numel()]
    flag = torch.maximum(any_nonfinite(vs, owner.device), found_inf.reshape(()).float())
    for v in vs:
        v.mul_(inv)
    flag = flag.reshape(1)
    comm.all_reduce(flag, "max", group=owner.group, log=owner.log)
    found_inf.copy_(flag.reshape(found_inf.shape))


# the operations that change no gradient (the others forget the cached norms)
_READS = frozenset(
    {
        aten.linalg_vector_norm.default,
        aten.norm.Scalar,
        aten.norm.ScalarOpt_dim,
        aten._foreach_norm.Scalar,
        aten.detach.default,
        aten.detach_.default,
        aten.alias.default,
    }
)

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
        # the optimizer's gradient part (`zero_kernels.optimizer.grad_access.GradContract`): it
        # applies
        # the pending factor, says whether host reads are avoided and whether a rank joined
        self._owner = weakref.ref(owner)
        self.device = device
        self.group = group
        self.log = log
        self._closed = False
        self.on_close = None  # the owner's callback when the optimizer closes (or None)
        self.views: dict[int, ShardedGrad] = {}
        self.active: set[int] = set()
        # pieces per param index: (inner param's grad view, offset in the param)
        self.by_index: dict[int, list[tuple[torch.Tensor, int]]] = {}
        # norm order -> (param index -> position, float64 global norms on the device) of the
        # params that had a gradient when computed ([Note: one collective per clip])
        self._norms: dict[float, tuple[dict[int, int], torch.Tensor]] = {}
        self._params: dict[int, torch.Tensor] = {}  # the params, index -> param (`install`)

    @property
    def closed(self) -> bool:
        return self._closed

    @closed.setter
    def closed(self, value: bool) -> None:
        """Set by the optimizer's close(); the owner's ``on_close`` runs then (tensor
        parallelism: the DTensor params' ``.grad`` wrappers dropped)."""
        self._closed = bool(value)
        if self._closed and self.on_close is not None:
            self.on_close()

    # ---- the optimizer's side
    def owner(self):
        o = self._owner()
        if o is None:
            raise ShardedGradError("the ZeroOptimizer of this gradient was collected")
        return o

    def pieces_of(self, index: int) -> list[tuple[torch.Tensor, int]]:
        return self.by_index.get(index, [])

    def normalize(self, of: int | None = None) -> None:
        """Make the store hold true gradients (apply the pending factor). ``of``: for an
        operation on param ``of``'s gradient alone (the others' assignments to ``.grad`` may
        wait: `zero_kernels.optimizer.grad_access.GradContract.sync_user_changes`)."""
        self.owner().apply_factor(of)

    def in_place(self, index: int) -> bool:
        """Whether param ``index`` has a gradient and ``.grad`` is its view (the user did not
        replace or clear it since the views were installed)."""
        p = self._params.get(index)
        return p is not None and index in self.active and p.grad is self.views.get(index)

    def changed(self) -> None:
        """The gradients' values, or which params have one, may have changed: forget the norms
        ([Note: one collective per clip]). Only for events every rank goes through alike."""
        self._norms.clear()

    def norms(self, indices: list[int], o: float) -> list[torch.Tensor]:
        """Global norms of order ``o`` of the gradients of params ``indices``, float64 0-dim
        device tensors (views of the cache): from the cached norms, else one all-reduce for
        every param with a gradient ([Note: one collective per clip]); a param without one now
        (its ShardedGrad kept by the user) costs one more for those."""
        self.owner().check_not_joined("a norm of a sharded .grad (clip_grad_norm_)")
        cached = self._norms.get(o)
        # a hit whose params' views are in place needs nothing more: no reduction is pending
        # and the factor is applied (every event that would leave them forgot the norms);
        # else the store is made right first, which may forget them
        if cached is None or not all(i in cached[0] and self.in_place(i) for i in indices):
            self.normalize()
            cached = self._norms.get(o)
        if cached is None:
            idx = sorted(self.active)
            cached = ({k: j for j, k in enumerate(idx)}, self._reduce_norms(idx, o))
            self._norms[o] = cached
        pos, vals = cached
        rest = [i for i in dict.fromkeys(indices) if i not in pos]
        more = dict(zip(rest, self._reduce_norms(rest, o))) if rest else {}
        return [vals[pos[i]] if i in pos else more[i] for i in indices]

    def _reduce_norms(self, indices: list[int], o: float) -> torch.Tensor:
        """The global norms of order ``o`` of params ``indices``: this rank's partial results,
        one all-reduce of them all (none for no index), on the device."""
        if not indices:
            return torch.zeros(0, dtype=torch.float64, device=self.device)
        part = torch.stack(
            [
                _local_part([v for v, _ in self.pieces_of(i) if v.numel()], o, self.device)
                for i in indices
            ]
        )
        if not math.isinf(o):
            comm.all_reduce(part, "sum", group=self.group, log=self.log)
            return part ** (1.0 / o) if o != 0 else part
        # a max all-reduce may drop a NaN (gloo's keeps the first operand's: a NaN of rank 1 is
        # lost where rank 0's value is finite), so NaNs go as flags beside the maxes, one call
        nan = part.isnan()
        both = torch.cat([part.masked_fill(nan, -math.inf), nan.double()])
        comm.all_reduce(both, "max", group=self.group, log=self.log)
        part = both[: len(indices)].masked_fill(both[len(indices) :] > 0, math.nan)
        return -part if o < 0 else part

    def view_for(self, index: int) -> ShardedGrad | None:
        return self.views.get(index)

    def install(self, params: dict[int, torch.Tensor]) -> None:
        """``p.grad = view`` for the active params, ``None`` for the others."""
        self._params = params
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
