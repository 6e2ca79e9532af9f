"""Stage 3 under ``torch.autocast``: the casts of a unit's fp32 params that autograd saves are
kept as recipes and made again in the unit's backward (`Recasts`, one per unit scheduler).

[Note: autocast]
Under ``torch.autocast`` a unit's fp32 weights are cast for each matmul, and autograd saves the
cast copy for the backward (the matmul's input gradient needs it). Freeing the gathered fp32
params after the forward does not free those copies: at the end of the forward every rank would
hold a low-precision copy of the whole model, 2 bytes per parameter, as much as the whole sharded
Adam state at 8 ranks (FSDP2 does under autocast; its answer is a bf16 param dtype). So from a
unit's pre-forward to its post-forward, under autocast with grad on, stage 3 pushes saved-tensor
hooks (`_Recast`): a saved tensor that is a cast of one of the unit's fp32 params (or a view of
one: linear saves ``weight.t()``; found by its ``ToCopyBackward0`` node over the param's
``AccumulateGrad``) is saved as a recipe (`_Cast`: the param, the dtype, the view's size, stride
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

Measured (bench/stage3_autocast.py, ``MALLOC_MMAP_THRESHOLD_=65536`` against glibc's heap noise;
2 ranks, 33.5M params in 16 units; peak RSS of the third step): fp32 726.4 MB; bf16 autocast
787.7 MB with its cache (+61), 739.5 MB with ``cache_enabled=False`` (+13: one unit's copies and
the bf16 activations); bf16 params 762.5 MB. Before the recipes, autocast was +67 MB either way.
Tested against DDP under the same autocast, cache on and off (tests/stage3_checks.py: resharding
on and off, a reused module, checkpointing; compiled units), and in-process
(tests/test_zero_stage3.py: recipes made again, values, the warning, a raising unit).
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

__all__ = ["Recasts"]


class Recasts:
    """The saved-tensor hooks pushed by units' forwards under autocast ([Note: autocast])."""

    def __init__(self) -> None:
        self._recasts: list[tuple[int, _Recast]] = []  # (unit, hooks), innermost last
        self._fp32_ids: dict[int, set[int]] = {}  # per unit: its fp32 params
        self._warned = False

    def push(self, k: int, module: nn.Module, device_type: str) -> None:
        """After unit ``k``'s pre-forward (``module``: the unit's), in a forward with grad on:
        under autocast, autograd saves the casts of its fp32 params as recipes, made again in
        its backward (see [Note: autocast])."""
        if not _autocast_enabled(device_type):
            return
        ids = self._fp32_ids.get(k)
        if ids is None:
            ids = self._fp32_ids[k] = {
                id(p) for p in module.parameters() if p.dtype == torch.float32
            }
        if not ids:
            return
        top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
        if top is None:  # an older torch: the copies stay (warned once)
            self._warn()
            return
        if torch.is_autocast_cache_enabled():  # it keeps them, whoever saves what
            self._warn(cache=True)
        if top(False) is not None:  # another's hooks (checkpointing) decide what is saved
            return
        rec = _Recast(ids)
        torch._C._autograd._push_saved_tensors_default_hooks(rec.pack, rec.unpack)
        self._recasts.append((k, rec))

    def pop(self, k: int | None = None) -> None:
        """Before unit ``k``'s post-forward (None: every one left, after an exception): the
        hooks off. Autocast's cache is left alone (see [Note: autocast])."""
        while self._recasts and (k is None or self._recasts[-1][0] == k):
            _, rec = self._recasts.pop()
            top = torch._C._autograd._top_saved_tensors_default_hooks(False)
            if top is not None and top[0] == rec.pack:
                torch._C._autograd._pop_saved_tensors_default_hooks()
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


def _autocast_enabled(device_type: str) -> bool:
    try:
        return torch.is_autocast_enabled(device_type)
    except TypeError:  # torch < 2.4 took no device type
        if device_type == "cpu":
            return torch.is_autocast_cpu_enabled()
        return torch.is_autocast_enabled()


class _Cast:
    """A saved tensor autocast made from a unit's param: the recipe to make it again."""

    __slots__ = ("param", "dtype", "size", "stride", "offset")

    def __init__(self, param, dtype, size, stride, offset):
        self.param, self.dtype = param, dtype
        self.size, self.stride, self.offset = size, stride, offset


class _Recast:
    """Saved-tensor hooks of one unit's forward under autocast ([Note: autocast])."""

    def __init__(self, ids: set[int]):
        self.ids = ids  # the unit's fp32 params

    def pack(self, t: torch.Tensor):
        base = t._base if t._is_view() else t
        fn = base.grad_fn
        if fn is not None and fn.name() == "ToCopyBackward0":
            p = getattr(fn.next_functions[0][0], "variable", None)
            if p is not None and id(p) in self.ids and base.dtype != p.dtype:
                return _Cast(p, base.dtype, t.size(), t.stride(), t.storage_offset())
        return t

    @staticmethod
    def unpack(x):
        if type(x) is _Cast:  # the unit is gathered: its backward is running
            return x.param.to(x.dtype).as_strided(x.size, x.stride, x.offset)
        return x
