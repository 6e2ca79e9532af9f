"""`Replicas`, a part of `ZeroOptimizer` ([Note: parts]): the model's tensors that are not
sharded (buffers, frozen params) kept equal on every rank, as DDP keeps them.

[Note: replicated module state]
The optimizer shards what it trains; the rest of the model stays whole on every rank, and DDP
keeps it equal there in two ways, which a model moved from DDP relies on:

- At construction DDP broadcasts rank 0's params *and buffers* (its ``_sync_module_states``),
  frozen params included. Without it, a model built without a common seed trains a different
  network on each rank: the trained params are rank 0's (`build.store` broadcasts them), but a
  frozen layer or a random buffer is each rank's own, so the averaged gradient is not DDP's
  (measured before this, 2 ranks, a frozen layer and a random buffer: rank 1's loss 40% from
  DDP's at the first step). Here each rank takes two 62-bit digests of every frozen param and
  buffer (the bytes as 64-bit words: their sum, and their sum weighted by 2i + 1, both modulo
  2^64: integer sums, so exact in any order and on any device), one all-reduce (max of the
  digests and of their negations) finds the tensors that differ on some rank, and only those
  are broadcast from rank 0. Tensors equal everywhere (a pretrained frozen base loaded on every
  rank, the usual case) cost a read and 32 bytes each, not a broadcast of the base (DDP
  broadcasts all of it, at every link's rate). A warning names what differed.
- Before a forward that follows a training forward (gradients enabled, outside ``no_sync()``;
  also before the first), DDP (``broadcast_buffers=True``, its default) broadcasts rank 0's
  buffers, so BatchNorm's running statistics are rank 0's on every rank, updated by each
  rank's own batch in that forward, and an evaluation forward after a training step sees rank
  0's. ``broadcast_buffers=True`` (the default here too) does the same: one broadcast of
  all the module's buffers, each device's packed into one byte buffer (any dtype). A rank
  writes the values back without moving the buffers' version counters, as DDP's broadcast
  does: two forwards before one backward (a siamese loss) must pass autograd's check on what
  the first forward saved, and BatchNorm saves its running statistics (a copy that moved them
  failed that check, measured). On the CPU only the buffers whose bytes changed are written;
  on a GPU every one is, as by DDP (comparing would wait for the device at each forward).
  ``broadcast_buffers=False`` leaves each rank its own buffers (DDP's
  ``broadcast_buffers=False``): for models whose buffers are constant (rotary tables, masks)
  and large, the broadcast is then spared.
- Under ``torch.distributed.algorithms.Join`` the broadcast comes before each training
  forward (the iteration a joined rank shadows; one forward per backward, as under DDP's
  Join), and its source is, as DDP's, the highest rank still training (one more all-reduce of
  the ranks per forward, inside Join only). A joined rank shadows the broadcast, its own
  buffers left as they are; when the context ends every rank takes the last joiner's, as
  DDP's final sync gives them. At stages 1/2 the Join context is told in that forward (before
  the broadcast), not at the start of backward.

Only a module gives this: ``ZeroOptimizer(model, ...)`` or ``module=``; over a list of params
there are no buffers to know of. The bytes go to ``comm_stats["broadcast_bytes"]`` and
``["broadcast_calls"]`` (the buffers' broadcasts, not the construction's), by link counted as
sent by the source to every other rank.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

from .. import comm
from .core import Core

__all__ = ["Replicas", "digests", "sync_at_start"]

_CHUNK = 1 << 22  # 64-bit words per pass of a digest (32 MiB, and as much again for its product)
_MASK = (1 << 62) - 1  # digests kept non-negative, so that -d never overflows


def _plain(t) -> bool:
    return (
        isinstance(t, torch.Tensor)
        and type(t) in (torch.Tensor, nn.Parameter)
        and t.device.type != "meta"
    )


def unsharded(module: nn.Module, trained: set[int]) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) of ``module``'s frozen params (not in ``trained``: ids) and buffers, each
    tensor once (torch's iterators leave out a shared one's other names)."""
    named = [*module.named_parameters(), *module.named_buffers()]
    return [(n, t) for n, t in named if _plain(t) and id(t) not in trained]


def _words(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The bytes of ``t``: whole 64-bit words (a view where ``t`` is contiguous) and the tail."""
    b = t.detach().contiguous().reshape(-1).view(torch.uint8)
    whole = b.numel() // 8 * 8
    return b[:whole].view(torch.int64), b[whole:].to(torch.int64)


@torch.no_grad()
def digests(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Two 62-bit digests of each tensor's bytes, on the CPU: int64 of shape (len, 2)."""
    out = torch.zeros(len(tensors), 2, dtype=torch.int64)
    for k, t in enumerate(tensors):
        words, tail = _words(t)
        s1 = torch.zeros((), dtype=torch.int64, device=t.device)
        s2 = torch.zeros((), dtype=torch.int64, device=t.device)
        for a in range(0, words.numel(), _CHUNK):
            w = words[a : a + _CHUNK]
            i = torch.arange(2 * a + 1, 2 * (a + w.numel()) + 1, 2, device=t.device)
            s1 += w.sum()
            s2 += (w * i).sum()
        if tail.numel():
            n = words.numel()
            i = torch.arange(2 * n + 1, 2 * (n + tail.numel()) + 1, 2, device=t.device)
            s1 += tail.sum() * 131  # a tail's bytes are not words: kept apart from them
            s2 += (tail * i).sum()
        out[k, 0], out[k, 1] = s1.item() & _MASK, s2.item() & _MASK
    return out


def _group_for(core: Core, t: torch.Tensor):
    """The group a broadcast of ``t`` goes over: the data-parallel group for tensors on the
    optimizer's device, the gloo side group for CPU tensors of a GPU run."""
    if t.device.type == "cpu" and core.device.type != "cpu":
        return core.side
    return core.group


@torch.no_grad()
def sync_at_start(core: Core) -> list[str]:
    """Construction: the module's frozen params and buffers that differ on some rank take rank
    0's values ([Note: replicated module state]); returns their names (collective)."""
    if core.module is None or core.dp_size == 1:
        return []
    # shard_frozen's frozen params are sharded (rank 0's values, broadcast by the store)
    trained = {id(p) for p in [*core.trainable.values(), *core.frozen.values()]}
    if core.tp is not None:  # the DTensor params, trained through their local tensors
        trained |= core.tp.leaf_ids()
    named = unsharded(core.module, trained)
    count = torch.tensor([len(named), -len(named)], dtype=torch.int64)
    comm.all_reduce(count, "max", group=core.side)
    if int(count[0]) != -int(count[1]):
        raise ValueError(
            f"ZeroOptimizer: the model has {len(named)} frozen params and buffers on rank "
            f"{core.dp_rank}, but between {-int(count[1])} and {int(count[0])} across the ranks: "
            "every rank must build the same model"
        )
    if not named:
        return []
    sizes = torch.tensor([[t.numel() * t.element_size()] for _, t in named], dtype=torch.int64)
    d = torch.cat([sizes, digests([t for _, t in named])], dim=1)
    both = torch.cat([d, -d], dim=1)
    comm.all_reduce(both, "max", group=core.side)
    for k in range(len(named)):
        if both[k, 0] != -both[k, 3]:
            raise ValueError(
                f"ZeroOptimizer: {named[k][0]!r} has {int(sizes[k, 0])} bytes on rank "
                f"{core.dp_rank}, but between {-int(both[k, 3])} and {int(both[k, 0])} across "
                "the ranks: every rank must build the same model"
            )
    differ = [k for k in range(len(named)) if bool((both[k, 1:3] != -both[k, 4:]).any())]
    for k in differ:
        t = named[k][1].data
        flat = t if t.is_contiguous() else t.contiguous()
        comm.broadcast(flat, 0, group=_group_for(core, t))
        if flat is not t:
            t.copy_(flat)
    names = [named[k][0] for k in differ]
    if names:
        shown = ", ".join(repr(n) for n in names[:5]) + (" ..." if len(names) > 5 else "")
        warnings.warn(
            f"ZeroOptimizer: {len(names)} frozen param(s)/buffer(s) of the model differed "
            f"across ranks ({shown}): every rank now has rank 0's values, as DDP would give "
            "(build the model from one seed, or load the same weights, on every rank)",
            stacklevel=5,  # the user's ZeroOptimizer(...) (no_grad's wrapper is a frame)
        )
    return names


class Replicas:
    """DDP's ``broadcast_buffers`` over the `Core`'s module (see the module doc). ``join``: the
    `JoinState` part, told of a forward inside a Join context at stages 1/2."""

    def __init__(self, core: Core, join):
        self.core, self.join = core, join
        # a model without buffers has nothing to broadcast: no hook (one would also stop a
        # torch.compile(fullgraph=True) of it, the hook being a graph break)
        self.on = (
            bool(core.policy.comm.broadcast_buffers)
            and core.module is not None
            and any(_plain(b) for b in core.module.buffers())
        )
        # DDP's require_forward_param_sync: the last forward had gradients, outside no_sync()
        self.pending = True
        self.compare_on = {"cpu": True}  # device types whose buffers are compared before a copy

    def _buffers(self) -> list[torch.Tensor]:
        return [b for b in self.core.module.buffers() if _plain(b)]  # each once

    def _source(self, mine: int, what: str) -> int:
        """The largest of the ranks' ``mine`` (-1: not a candidate): the broadcast's source."""
        t = torch.tensor([mine], dtype=torch.int64)
        self.core.all_reduce(t, "max", what, group=self.core.side)
        return int(t.item())

    def before_forward(self) -> None:
        """A forward of the module begins (its pre-hook): rank 0's buffers (under Join, the
        highest training rank's) on every rank, where DDP would broadcast them. Also a joined
        rank's part of that broadcast at stages 1/2 (`JoinState` sets ``shadowing`` around
        the call)."""
        core = self.core
        if not self.on or core.dp_size == 1:
            return
        shadow, joining = self.join.shadowing, self.join.in_context()
        if not shadow:
            training = torch.is_grad_enabled() and core.reducer.sync
            # as DDP: when the forward before this one trained (DDP decides in its post-forward
            # hook; the forward's grad mode is the same there); inside Join: when this one
            # trains, the iteration a joined rank shadows
            due = training if joining else self.pending
            self.pending = training
            if not due:
                return
        bufs = self._buffers()
        if not bufs:
            return
        src = 0
        if joining:
            if core.units is None and not shadow:  # stages 1/2: told here, not in backward
                self.join.notify_forward()
            src = self._source(-1 if shadow else core.dp_rank, "the buffers' source under Join")
        self.broadcast(bufs, src, keep=shadow)

    def after_join(self, is_last_joiner: bool) -> None:
        """A Join context ends (collective): every rank takes the buffers of the last rank to
        join, as DDP's ``_sync_final_model`` gives them (a joined rank's own were left as they
        were while it shadowed the others' broadcasts)."""
        if not self.on or self.core.dp_size == 1:
            return
        bufs = self._buffers()
        if not bufs:
            return
        mine = self.core.dp_rank if is_last_joiner else -1
        self.broadcast(bufs, self._source(mine, "the last joiner's buffers"))

    def before_forward_hook(self, module, args) -> None:
        self.before_forward()

    @torch.no_grad()
    def broadcast(self, bufs: list[torch.Tensor], src: int, keep: bool = False) -> None:
        """``bufs`` from group rank ``src``, one packed broadcast per device; ``keep``: this
        rank's buffers are left as they are (a joined rank's shadow)."""
        core, log = self.core, self.core.comm_log
        by_dev: dict[torch.device, list[torch.Tensor]] = {}
        for b in bufs:
            by_dev.setdefault(b.device, []).append(b)
        for group_bufs in by_dev.values():
            # through .data: the copies back do not move a buffer's version counter (as DDP's
            # broadcast does not), so a buffer autograd saved in an earlier forward whose
            # backward is still to come (BatchNorm saves its running statistics) passes
            # autograd's check
            views = [b.data.reshape(-1).view(torch.uint8) for b in group_bufs]
            flat = torch.cat(views)
            group = _group_for(core, group_bufs[0])
            comm.broadcast(flat, src, group=group)
            if log is not None:
                log.count_broadcast(flat.numel(), src, group)
            if keep or core.dp_rank == src:
                continue
            # on the CPU only the buffers whose bytes changed are written; on a GPU each
            # comparison would wait for the device, so every buffer is written, as DDP does
            compare = self.compare_on.get(flat.device.type, False)
            at = 0
            for b, v in zip(group_bufs, views):
                got = flat[at : at + v.numel()]
                at += v.numel()
                if compare and torch.equal(v, got):
                    continue
                if b.is_contiguous():  # v is b's bytes
                    v.copy_(got)
                else:  # v was a copy
                    b.data.copy_(got.clone().view(b.dtype).view(b.shape))
