"""Flat buffers: parameters re-pointed into one tensor per `FlatBuffer`, gradient storage per stage.

See [Note: layout] in `zero_kernels.layout` for where everything lives.

[Note: gradient storage]
Gradients are held in the reduce dtype (fp32 by default), and nothing is held twice:

- stage 1: one full-size buffer per flat buffer, where local grads accumulate (also across
  ``no_sync`` micro-batches); a bucket is a slice of it. Its reduce-scatter runs in place: the
  output is the rank's own shard of the bucket inside the input, so after it the rank's reduced
  gradient *is* that slice (the local values there are no longer needed) and no separate shard
  exists. `GradStore.shard` returns those views.
- stage 2: the rank's reduced shard of each flat buffer (``numel / world_size``), plus bucket
  buffers that exist only from a bucket's first grad until its reduce-scatter is finished. They
  come from a pool of at most ``max_inflight`` buffers of the largest bucket's size (the reducer
  waits for the oldest reduce-scatter before a new bucket would exceed it); the pool is kept
  between steps and counted as communication buffers, not as gradients.

The optimizer steps the reduced shard of every bucket: views, never copies.
"""

from __future__ import annotations

import torch

from .layout import FlatBuffer, Layout

__all__ = ["GradStore", "dtype_of", "flatten_params", "shard_view"]


def dtype_of(name: str) -> torch.dtype:
    """``"torch.float32"`` -> ``torch.float32``."""
    dt = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"not a torch dtype: {name!r}")
    return dt


def flatten_params(
    buf: FlatBuffer, params: dict[int, torch.Tensor], device: torch.device
) -> torch.Tensor:
    """Copy ``buf``'s parameters into one new flat tensor and make each ``param.data`` its view."""
    flat = torch.zeros(buf.numel, dtype=dtype_of(buf.dtype), device=device)
    for slot in buf.slots:
        p = params[slot.index]
        view = flat[slot.start : slot.end]
        view.copy_(p.detach().reshape(-1))
        p.data = view.view(slot.shape)
    return flat


def shard_view(
    flat: torch.Tensor, layout: Layout, buf: FlatBuffer, rank: int, bucket: int
) -> tuple[torch.Tensor, slice]:
    """``rank``'s shard of one bucket inside ``flat`` and its slice inside the rank's shard."""
    b = buf.buckets[bucket]
    lo = b.shard_start(rank)
    off = b.start // layout.world_size
    return flat[lo : lo + b.shard_numel], slice(off, off + b.shard_numel)


class GradStore:
    """Where gradients live between the autograd hooks and the optimizer step.

    See [Note: gradient storage]. ``max_inflight`` bounds the stage-2 bucket buffers.
    """

    def __init__(
        self,
        layout: Layout,
        stage: int,
        device: torch.device,
        dtype: torch.dtype = torch.float32,
        *,
        rank: int = 0,
        max_inflight: int = 2,
    ):
        if stage not in (1, 2):
            raise ValueError(f"stage must be 1 or 2, got stage={stage!r}")
        self.layout, self.stage, self.device, self.dtype = layout, stage, device, dtype
        self.rank, self.max_inflight = rank, max_inflight
        n = layout.world_size
        if stage == 1:  # full-size local accumulation buffers; the shards are views into them
            self.full = [torch.zeros(b.numel, dtype=dtype, device=device) for b in layout.buffers]
            self.shards = None
        else:  # the reduced shard of every flat buffer
            self.full = None
            self.shards = [
                torch.zeros(b.shard_numel(n), dtype=dtype, device=device) for b in layout.buffers
            ]
        self.bucket_numel = max(bk.numel(n) for b in layout.buffers for bk in b.buckets)
        self.live: dict[tuple[int, int], torch.Tensor] = {}  # stage 2: buckets in use
        self._free: list[torch.Tensor] = []  # stage 2: pool buffers not in use
        self._pool_count = 0
        self.peak_live = 0  # most stage-2 bucket buffers in use at once

    def shard(self, i: int, b: int) -> torch.Tensor:
        """This rank's reduced gradient of bucket ``b`` of buffer ``i`` (a view)."""
        buf = self.layout.buffers[i]
        bk = buf.buckets[b]
        if self.full is not None:
            lo = bk.shard_start(self.rank)
            return self.full[i][lo : lo + bk.shard_numel]
        off = bk.start // self.layout.world_size
        return self.shards[i][off : off + bk.shard_numel]

    def shard_tensors(self) -> list[torch.Tensor]:
        """Every reduced gradient tensor of this rank (norms, overflow checks)."""
        if self.shards is not None:
            return list(self.shards)
        return [
            self.shard(i, bk.index)
            for i, buf in enumerate(self.layout.buffers)
            for bk in buf.buckets
        ]

    def bucket(self, i: int, b: int, create: bool = True) -> torch.Tensor | None:
        """Local (unreduced) gradient storage of bucket ``b`` of buffer ``i``."""
        bk = self.layout.buffers[i].buckets[b]
        n = bk.numel(self.layout.world_size)
        if self.full is not None:
            return self.full[i][bk.start : bk.start + n]
        t = self.live.get((i, b))
        if t is None and create:
            if self._free:
                base = self._free.pop()
            else:
                base = torch.empty(self.bucket_numel, dtype=self.dtype, device=self.device)
                self._pool_count += 1
            t = base[:n]
            t.zero_()
            self.live[(i, b)] = t
            self.peak_live = max(self.peak_live, len(self.live))
        return t

    def release(self, i: int, b: int) -> None:
        """Stage 2: the bucket's reduce-scatter is done; return its buffer to the pool."""
        t = self.live.pop((i, b), None)
        if t is not None:
            self._free.append(t._base if t._base is not None else t)

    def drop_pool(self) -> None:
        """Free the pool buffers not in use (they are allocated again when needed)."""
        self._pool_count -= len(self._free)
        self._free.clear()

    def zero(self) -> None:
        """Stage 2: zero the shards. Stage 1's full buffers are overwritten by the first grads
        instead (see [Note: overlap] in `zero_kernels.partition.reducer`)."""
        if self.shards is not None:
            for t in self.shards:
                t.zero_()

    def nbytes(self) -> int:
        """Bytes of gradient storage held now: full buffers (stage 1) or shards (stage 2)."""
        return sum(t.numel() * t.element_size() for t in (self.full or self.shards))

    def comm_nbytes(self) -> int:
        """Bytes of the stage-2 bucket pool held now (in use or free)."""
        return self._pool_count * self.bucket_numel * torch.finfo(self.dtype).bits // 8

    def comm_peak_nbytes(self) -> int:
        """Bytes of the most stage-2 bucket buffers in use at once."""
        return self.peak_live * self.bucket_numel * torch.finfo(self.dtype).bits // 8
