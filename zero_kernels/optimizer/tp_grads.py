"""The tp sum of ``Partial`` gradients, deferred to their bucket's reduction (stages 2 and 3).

[Note: deferred tp sums]
Under sequence parallelism a ``Replicate`` param (a SequenceParallel norm's weight and bias)
gets a gradient ``Partial`` over tp: each tp rank holds the part of its own sequence shard.
Redistributing it to ``Replicate`` as it arrives (what `TensorParallel.local_grad` does, and
FSDP2 in its post-backward) is one blocking all-reduce over tp per such param: 4 per block of
`zero_kernels.tools.tp_models.TPGPT`, each a point where the two tp ranks wait for each other
in the middle of the backward (40-48 ms of a 350 ms step of bench/bench_tp.py's model on 2
cores). A sum is linear, so the parts can be added into the bucket as they are and summed over
tp once, for every such param of the bucket together, before the bucket's dp
reduce-scatter: one all-reduce over tp per bucket that holds one, of a copy of the concatenated
ranges, started when the bucket is complete and waited for at the reducer's next call (the next
gradient, or the end of backward: a point every rank reaches alike, where the reduce-scatter is
launched), so it runs while autograd computes the next gradients:

    autograd   | grads of bucket k | next grad | ...
    tp         |          AR(parts of k) |
    dp                                   | RS k ...

It is the same sum in the same order, tp first and then dp, rounded to the gradients' own dtype
where the bucket is wider (bf16 gradients in an fp32 bucket: what redistributing each bf16
gradient gives), so stages 2/3 give stage 1's and FSDP2's results (bitwise in the fp32 bench;
tests/stages/tp_bf16_checks.py for bf16 params).

The ranges of a bucket that hold parts (`GradBucket.partial`) are learnt from the gradients'
placements, the same on the tp ranks of a dp rank (they run the same graph), so the ranges and
the order of the all-reduces match. A whole (Replicate) gradient that meets parts in the same
range (a param used twice, once each way) enters as a part: on tp rank 0 only. Stage 1
accumulates into its whole buffer across ``no_sync`` micro-batches and rebases it after a
reduction, so it keeps the per-param redistribution.
"""

from __future__ import annotations

import torch

from .. import comm
from .tensor_parallel import TensorParallel, is_dtensor

__all__ = ["PartialSums", "PendingSum"]


class PartialSums:
    """What the reducer needs to defer the tp sum of ``Partial`` gradients (see the Note)."""

    def __init__(self, tp: TensorParallel):
        from torch.distributed.tensor import Partial, Replicate

        self.tp = tp
        self.rank = tp.rank
        self.group = tp.group
        self._partial = (Partial("sum"),)
        # the params whose grads may come as parts: Replicate over the (1-D) tp mesh
        self._replicated = {i for i, t in tp.by_index.items() if t.placements == (Replicate(),)}

    def split(self, index: int, g: torch.Tensor) -> tuple[torch.Tensor, bool]:
        """The local tensor of gradient ``g`` of param ``index`` and whether it is a part (a
        ``Partial`` sum over tp, of a ``Replicate`` param, left unsummed); any other gradient
        as `TensorParallel.local_grad` gives it, whole."""
        if not is_dtensor(g):
            return g, False
        if index in self._replicated and tuple(g.placements) == self._partial:
            return g._local_tensor, True
        return self.tp.local_grad(index, g), False

    def start(self, parts: list[torch.Tensor], dtypes: list[torch.dtype]) -> PendingSum:
        """Start the sum over tp of ``parts`` (views of a bucket, of gradients of ``dtypes``)
        in one all-reduce of a copy; `PendingSum.finish` writes it back."""
        flat = torch.cat(parts) if len(parts) > 1 else parts[0].clone()
        handle = comm.all_reduce_start(flat, "sum", group=self.group) if self.tp.size > 1 else None
        return PendingSum(handle, flat, parts, dtypes)


class PendingSum:
    """A tp sum in flight: the copy being reduced and the views it goes back into."""

    def __init__(self, handle, flat: torch.Tensor, parts: list, dtypes: list):
        self.handle, self.flat, self.parts, self.dtypes = handle, flat, parts, dtypes

    def finish(self, timeout_s: float | None, what: str) -> None:
        """Wait for the sum and write it into the bucket, rounded to each gradient's own dtype
        where the bucket is wider (what redistributing that gradient gives)."""
        if self.handle is not None:
            self.handle.wait(timeout_s, what)
        off = 0
        for t, dt in zip(self.parts, self.dtypes, strict=True):
            v = self.flat[off : off + t.numel()]
            off += t.numel()
            t.copy_(v.to(dt) if dt != t.dtype else v)
        self.handle = self.flat = self.parts = None
