"""Stage 3 under ``torch.autocast``: the casts of a unit's fp32 params that autograd saves are
kept as recipes and made again in the unit's backward (`Recasts`, one per unit scheduler).

[Note: autocast]
Under ``torch.autocast`` a unit's fp32 weights are cast for each matmul, and autograd saves the
cast copy for the backward (the matmul's input gradient needs it). Freeing the gathered fp32
params after the forward does not free those copies: at the end of the forward every rank would
hold a low-precision copy of the whole model, 2 bytes per parameter, as much as the whole sharded
Adam state at 8 ranks (FSDP2 does under autocast; its answer is a bf16 param dtype). So from a
unit's pre-forward to its post-forward, under autocast with grad on, stage 3 pushes saved-tensor
hooks (`Recast`): a saved tensor that is a cast of one of the unit's fp32 params (or a view of
one: linear saves ``weight.t()``; found by its ``ToCopyBackward0`` node over the param's
``AccumulateGrad``) is saved as a recipe (`Cast`: the param, the dtype, the view's size, stride
and offset) and made again when the backward unpacks it. That is when the unit runs its
backward, so it is gathered, as it must be for the fp32 params autograd saves without autocast;
the same values round to the same bits. Not pushed where other saved-tensor hooks are on top
(non-reentrant checkpointing, ``save_on_cpu``): those decide what is saved. A forward that raised
leaves its hooks pushed; the next forward (or the model's post-forward, or ``close``) pops them.

Autocast's cache (on by default) also holds every cast until the autocast region exits, so the
copies still peak at the forward's end unless ``cache_enabled=False`` is passed; stage 3 warns
once. Clearing the cache after each unit's forward would free them too, but a weight cast again
after a clear (a module called twice) gets two cast nodes whose bf16 gradients are summed in
fp32 instead of one node summing them in bf16: 1.5e-3 away from DDP's gradient under the same
autocast. So the cache is the user's: with it off, DDP is off too, and the results agree.
torch without ``_top_saved_tensors_default_hooks`` keeps the copies, with a warning once.

[Note: frozen casts]
A param that does not train (a LoRA run's frozen base) has no gradient accumulator, so its cast has
no ``ToCopyBackward0`` node to be recognised by: autograd saves a plain low-precision tensor with no
history. Saved as it is, every frozen fp32 weight's cast stays from the unit's forward to its
backward, 2 bytes per frozen param of the whole model at the forward's end, which is more than the
frozen shards themselves hold past 2 ranks (``shard_frozen=True``: 4/N bytes) and a third of the
frozen params' bytes when they are kept whole. So a saved bf16/fp16 tensor without history and
without grad, contiguous, of the shape of one of the unit's frozen fp32 params, is compared with
that param cast again, bit for bit (`is_cast_of`); equal, it is saved as the same recipe as a
trained param's cast. The comparison makes this exact whatever the tensor is: a recipe is kept only
where making it again gives the saved bits. Its cost is one more cast of each frozen weight per
forward (and the compare), where autocast casts it once per use anyway. The candidates are the
unit's frozen params held whole and those of its own buckets (gathered in its backward, as [Note:
frozen shards] keeps them until the unit's input gradients are computed); a nested unit's sharded
params are left out: this unit's backward does not gather them. CPU params only: on a GPU the
compare's answer is needed at once, a host sync per frozen weight in every forward (the GPU drained,
its queue lost); that cost is not measured yet, so there the casts stay saved as before
(bench/gpu_check.sh is where to measure it). The same hooks are pushed, autocast or not, for every
unit holding frozen buckets (``shard_frozen=True``): a frozen param of its own buckets that autograd
saves as it is (`_Held`), and every frozen cast's recipe, is checked at unpack: its unit must be
gathered (a unit no backward was expected for, freed after its forward, raises, naming the param:
[Note: frozen shards]'s uncovered path), and the param unchanged in place since the forward (torch's
own check of a saved tensor, which the hooks take the place of). The root unit pushes them too, for
its own params only (a frozen ``lm_head``'s cast: the largest frozen matrix of a language model; the
root unit is gathered from the model's forward to the end of its backward). Measured
(bench/bench_frozen_shards.py --autocast, a 24-layer LoRA Llama, 81M frozen params, 2 ranks): peak
RSS -162 / -169 MB with the base whole / sharded (954 / 841 MB; FSDP2 990), step +14-18% at 2 x 64
tokens (1-2 ns per frozen param per step on one Zen 4 core).

Measured (bench/stage3_autocast.py, ``MALLOC_MMAP_THRESHOLD_=65536`` against glibc's heap noise;
2 ranks, 33.5M params in 16 units; peak RSS of the third step): fp32 726.4 MB; bf16 autocast
787.7 MB with its cache (+61), 739.5 MB with ``cache_enabled=False`` (+13: one unit's copies and
the bf16 activations); bf16 params 762.5 MB. Before the recipes, autocast was +67 MB either way.
Tested against DDP under the same autocast, cache on and off (tests/stage3/stage3_checks.py:
resharding on and off, a reused module, checkpointing; compiled units), and in-process
(tests/stage3/test_stage3.py: recipes made again, values, the warning, a raising unit).
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

__all__ = ["Recasts"]


class Recasts:
    """The saved-tensor hooks pushed by units' forwards under autocast ([Note: autocast])."""

    def __init__(self) -> None:
        self._recasts: list[tuple[int, Recast]] = []  # (unit, hooks), innermost last
        self._fp32_ids: dict[int, set[int]] = {}  # per unit: its fp32 params
        self._warned = False

    def push(
        self,
        k: int,
        module: nn.Module,
        device_type: str,
        frozen=(),
        *,
        held=frozenset(),
        check=None,
        ids: set[int] | None = None,
    ) -> None:
        """After unit ``k``'s pre-forward (``module``: the unit's), in a forward with grad on:
        under autocast, autograd saves the casts of its fp32 params as recipes, made again in
        its backward (see [Note: autocast]). ``frozen``: the fp32 params that do not train
        whose casts may be recipes here (held whole, or in the unit's own buckets). ``held``:
        the ids of the unit's sharded frozen params, whose saved uses are checked (``check(p,
        version)`` raises where the backward would read one freed or changed: [Note: frozen
        casts]), autocast or not. ``ids``: the params whose casts are recipes (default: the
        module's fp32 params)."""
        cast = _autocast_enabled(device_type)
        if not cast and not held:
            return
        if cast and ids is None:
            ids = self._fp32_ids.get(k)
            if ids is None:
                ids = self._fp32_ids[k] = {
                    id(p) for p in module.parameters() if p.dtype == torch.float32
                }
        by_shape: dict[tuple, list] = {}
        if cast and device_type == "cpu":  # elsewhere the compare waits for the device
            for p in frozen:
                if not p.requires_grad and p.dtype == torch.float32:
                    by_shape.setdefault(tuple(p.shape), []).append(p)
        ids = ids if cast else set()
        if not ids and not by_shape and not held:
            return
        top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
        if top is None:  # an older torch: the copies stay (warned once)
            if ids or by_shape:
                self._warn()
            return
        if (ids or by_shape) and torch.is_autocast_cache_enabled():  # it keeps them all
            self._warn(cache=True)
        on_top = top(False)
        if on_top is not None and not isinstance(getattr(on_top[0], "__self__", None), Recast):
            return  # another's hooks (checkpointing, save_on_cpu) decide what is saved
        rec = Recast(ids, by_shape, held, check)
        torch._C._autograd._push_saved_tensors_default_hooks(rec.pack, rec.unpack)
        self._recasts.append((k, rec))

    def pop(self, k: int | None = None) -> None:
        """Before unit ``k``'s post-forward (None: every one left, after an exception): the
        hooks off. Autocast's cache is left alone (see [Note: autocast])."""
        while self._recasts and (k is None or self._recasts[-1][0] == k):
            _, rec = self._recasts.pop()
            _unstack(rec)
            if k is not None:
                return

    def _warn(self, cache: bool = False) -> None:
        if self._warned:
            return
        self._warned = True
        if cache:
            msg = (
                "ZeroOptimizer stage 3 under torch.autocast with fp32 params and autocast's "
                "cache on: the cache keeps the low-precision copy of every unit's weights until "
                "the autocast region ends (about 2 bytes per parameter of the whole model on "
                "every rank at the end of the forward). Pass cache_enabled=False to "
                "torch.autocast: stage 3 then holds one unit's copies and makes them again in "
                "the backward (same values)"
            )
        else:
            msg = (
                f"ZeroOptimizer stage 3 under torch.autocast with fp32 params on torch "
                f"{torch.__version__}: autograd keeps autocast's low-precision copy of each "
                "unit's weights from the unit's forward to its backward (about 2 bytes per "
                "parameter of the whole model on every rank at the end of the forward); a "
                "newer torch has what stage 3 needs to make them again in the backward. Or "
                "make the params bf16 (model.to(torch.bfloat16); fp32 master shards are kept)"
            )
        warnings.warn(msg, stacklevel=2)


def _unstack(rec: Recast) -> None:
    """``rec``'s hooks off autograd's stack of saved-tensor hooks, wherever they are in it: a
    user's hooks pushed after them and still on (activation offloading entered in a forward
    pre-hook of the model, left in its forward hook, both registered after ours) are taken off
    and put back in their order. Left there, ours stayed on, one more per forward, and every
    later ``torch.func`` transform refused to run under saved-tensor hooks."""
    top = torch._C._autograd._top_saved_tensors_default_hooks
    above = []
    while (hooks := top(False)) is not None and hooks[0] != rec.pack:
        above.append(hooks)
        torch._C._autograd._pop_saved_tensors_default_hooks()
    if hooks is not None:  # ours (not found: popped by someone, nothing to do)
        torch._C._autograd._pop_saved_tensors_default_hooks()
    for pack, unpack in reversed(above):
        torch._C._autograd._push_saved_tensors_default_hooks(pack, unpack)


def _autocast_enabled(device_type: str) -> bool:
    try:
        return torch.is_autocast_enabled(device_type)
    except TypeError:  # torch < 2.4 took no device type
        if device_type == "cpu":
            return torch.is_autocast_cpu_enabled()
        return torch.is_autocast_enabled()


_LOW = (torch.bfloat16, torch.float16)  # what autocast casts to


CHUNK = 1 << 18  # elements compared at a time (512 KiB of bf16): no whole-size temporary


def _bits(x: torch.Tensor) -> torch.Tensor:
    """``x`` (2-byte elements, 1-D, contiguous) as integers to compare bit for bit: 4 to an
    int64 where the length and offset allow (torch.equal is 3x faster so), else as int16."""
    if x.numel() % 4 == 0 and x.storage_offset() % 4 == 0:
        return x.view(torch.int64)
    return x.view(torch.int16)


def is_cast_of(base: torch.Tensor, p: torch.Tensor) -> bool:
    """Whether ``base`` holds exactly ``p`` cast to its dtype ([Note: frozen casts]): a
    contiguous tensor of p's shape and device, equal bit for bit to the cast made again
    (compared as bits: -0.0 is not 0.0 here, a NaN is itself). A few spread elements first, so
    that another tensor of the shape costs almost nothing; then the whole, a chunk at a time
    through one reused buffer (a whole-size cast would cost its allocation, most of the time)."""
    if base.shape != p.shape or base.device != p.device:
        return False
    if not (base.is_contiguous() and p.is_contiguous()):
        return False
    b, w = base.detach().view(-1), p.detach().view(-1)
    n = b.numel()
    with torch.no_grad():
        few = torch.arange(0, n, max(1, n // 61), device=b.device)
        if not torch.equal(w[few].to(b.dtype).view(torch.int16), b[few].view(torch.int16)):
            return False
        tmp = torch.empty(min(n, CHUNK), dtype=b.dtype, device=b.device)
        for i in range(0, n, CHUNK):
            j = min(n, i + CHUNK)
            t = tmp[: j - i]
            t.copy_(w[i:j])
            if not torch.equal(_bits(t), _bits(b[i:j])):
                return False
    return True


class Cast:
    """A saved tensor autocast made from a unit's param: the recipe to make it again (a frozen
    param's with ``check``: see `_Held`)."""

    __slots__ = ("param", "dtype", "size", "stride", "offset", "version", "check")

    def __init__(self, param, dtype, size, stride, offset, check=None):
        self.param, self.dtype = param, dtype
        self.size, self.stride, self.offset = size, stride, offset
        self.version, self.check = param._version, check


class _Held:
    """A frozen param of the unit's own buckets (or a view of one: linear saves ``weight.t()``)
    that autograd saves as it is: handed back by the unpack only once ``check(param, version)``
    passed (the unit gathered, the param not changed in place since: what autograd's own check
    of a saved tensor would say). ``view``: None for the param itself, else its size, stride
    and offset."""

    __slots__ = ("param", "version", "check", "view")

    def __init__(self, param, check, view=None):
        self.param, self.version, self.check, self.view = param, param._version, check, view


class Recast:
    """Saved-tensor hooks of one unit's forward ([Note: autocast], [Note: frozen casts])."""

    def __init__(self, ids: set[int], frozen=None, held=frozenset(), check=None):
        self.ids = ids  # the unit's fp32 params whose casts are recipes
        self.frozen = frozen or {}  # its fp32 params that do not train, by shape
        self.held, self.check = held, check  # its sharded frozen params (ids), their check

    def pack(self, t: torch.Tensor):
        base = t._base if t._is_view() else t
        if id(base) in self.held:
            if base is t:
                return _Held(t, self.check)
            return _Held(base, self.check, (t.size(), t.stride(), t.storage_offset()))
        fn = base.grad_fn
        if fn is not None:
            if fn.name() == "ToCopyBackward0":
                p = getattr(fn.next_functions[0][0], "variable", None)
                if p is not None and id(p) in self.ids and base.dtype != p.dtype:
                    return Cast(p, base.dtype, t.size(), t.stride(), t.storage_offset())
        elif self.frozen and base.dtype in _LOW and not base.requires_grad:
            for p in self.frozen.get(tuple(base.shape), ()):
                if is_cast_of(base, p):
                    return Cast(p, base.dtype, t.size(), t.stride(), t.storage_offset(), self.check)
        return t

    @staticmethod
    def unpack(x):
        if type(x) is Cast:  # the unit is gathered: its backward is running
            if x.check is not None:
                x.check(x.param, x.version)
            return x.param.to(x.dtype).as_strided(x.size, x.stride, x.offset)
        if type(x) is _Held:
            x.check(x.param, x.version)
            return x.param if x.view is None else x.param.as_strided(*x.view)
        return x
