"""Stage 3's secondary shard (ZeRO++'s hpZ): a unit's backward gathers stay inside the node.

[Note: secondary shard]
With ``secondary_shard="node" | K`` the shard group of N ranks (the whole data-parallel group
unless ``shard_group`` says otherwise) is cut into blocks of K consecutive ranks, the ranks of one
node by default (`zero_kernels.comm.hier.secondary_groups`). A unit's forward gathers its params
from all N ranks as usual; when the unit is freed after its forward (``reshard_after_forward``)
and a backward will follow (a hook is on its outputs), each rank first copies slice ``j`` of the
K equal slices of every gathered bucket (``j``: its place in its block) and keeps it (the unit's
state ``SECONDARY``). The unit's backward, and a recomputation inside it (activation
checkpointing), then all-gathers the bucket from those K slices over the block's group: the
bytes of the backward's gathers never leave the node. The slices hold exactly what the forward
gathered, so the backward computes with the forward's values, and the result is what plain
stage 3 gives, bit for bit (tests/topology/test_secondary.py).

With ``quantize_weights`` a forward's gathered bucket holds the other ranks' chunks dequantized
and its own chunk exact; a slice kept by rank ``j`` would carry rank ``j``'s mix, so with a
secondary shard every rank dequantizes its own chunk too (``own_exact=False`` in
`zero_kernels.comm.quant.all_gather_quantized`): every rank gathers the same values, in the
forward and again in the backward. Plain quantized stage 3 gives each rank a slightly different
model (its own chunk exact); here all agree. Gathers that hand params out (state dicts,
``gathered_params``, ``close()``) drop the secondary copy and gather exact from the shards.

``comm_stats["secondary_all_gather_bytes"]`` counts the gathers from the secondary shard (inside
the node), apart from ``all_gather_bytes`` (over the shard group).

Cost: 1/K of each unit's gathered params per rank, from the unit's forward until its backward
frees it (``memory_report()["secondary_shard_bytes"]``, and its peak). A copy is dropped when
the unit's backward has gathered it, at the end of the backward, at the next forward's start
(a forward whose backward never ran), after each step and at ``close()``: the shards are the
truth, a secondary copy never outlives the values it was taken from. The root unit (gathered from
the forward's start to the backward's end) and units kept whole (``persist_below``) have none.
"""

from __future__ import annotations

import torch

from .. import comm

__all__ = ["SecondaryShard"]


class SecondaryShard:
    """The kept slices of every unit between its forward and its backward, and their gathers."""

    def __init__(self, sec: comm.hier.Secondary, store):
        self.group, self.size, self.index = sec.group, sec.size, sec.index
        self.store = store
        self.kept: dict[tuple[int, int], torch.Tensor] = {}
        self.nbytes = 0
        self.peak = 0

    def _slice(self, full: torch.Tensor) -> torch.Tensor:
        c = full.numel() // self.size
        return full[self.index * c : (self.index + 1) * c]

    def keep(self, buckets) -> None:
        """Copy this rank's slice of each gathered bucket (before it is freed)."""
        for key in buckets:
            t = self._slice(self.store.full(*key)).clone()
            old = self.kept.get(key)
            if old is not None:
                self.nbytes -= old.numel() * old.element_size()
            self.kept[key] = t
            self.nbytes += t.numel() * t.element_size()
        self.peak = max(self.peak, self.nbytes)

    def gather(self, key: tuple[int, int], log, **bound) -> comm.Handle:
        """Start the all-gather of bucket ``key`` (allocated) from the block's slices (counted
        apart in ``log``: ``secondary_all_gather_*``, the bytes that stay inside the node)."""
        full = self.store.full(*key)
        return comm.all_gather(
            full, self.kept[key], group=self.group, log=log, kind="secondary_all_gather", **bound
        )

    def drop(self, buckets) -> None:
        for key in buckets:
            t = self.kept.pop(key, None)
            if t is not None:
                self.nbytes -= t.numel() * t.element_size()
