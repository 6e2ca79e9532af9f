"""Flat buffers: parameters re-pointed into one tensor per `FlatBuffer`, gradient storage per stage.

See [Note: layout] in `zero_kernels.layout` for where everything lives.

Gradient storage (reduce dtype, fp32 by default):

- stage 1: one full-size buffer per flat buffer, where local grads accumulate (also across
  ``no_sync`` micro-batches); a bucket is a slice of it.
- stage 2: bucket buffers exist only from a bucket's first grad until its reduce-scatter is
  finished, drawn from a small pool; nothing full-size is kept.
- both: the rank's reduced gradient shard (``numel / world_size`` per flat buffer), the ``.grad``
  of the fp32 master shard the optimizer steps.
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


def flatten_params(buf: FlatBuffer, params: dict[int, torch.Tensor],
                   device: torch.device) -> torch.Tensor:
    """Copy ``buf``'s parameters into one new flat tensor and make each ``param.data`` its view."""
    flat = torch.zeros(buf.numel, dtype=dtype_of(buf.dtype), device=device)
    for slot in buf.slots:
        p = params[slot.index]
        view = flat[slot.start:slot.end]
        view.copy_(p.detach().reshape(-1))
        p.data = view.view(slot.shape)
    return flat


def shard_view(flat: torch.Tensor, layout: Layout, buf: FlatBuffer, rank: int,
               bucket: int) -> tuple[torch.Tensor, slice]:
    """``rank``'s shard of one bucket inside ``flat`` and its slice inside the rank's shard."""
    b = buf.buckets[bucket]
    lo = b.shard_start(rank)
    off = b.start // layout.world_size
    return flat[lo:lo + b.shard_numel], slice(off, off + b.shard_numel)


class GradStore:
    """Where gradients live between the autograd hooks and the optimizer step."""

    def __init__(self, layout: Layout, stage: int, device: torch.device,
                 dtype: torch.dtype = torch.float32):
        if stage not in (1, 2):
            raise ValueError(f"stage must be 1 or 2, got stage={stage!r}")
        self.layout, self.stage, self.device, self.dtype = layout, stage, device, dtype
        n = layout.world_size
        # The reduced shard of every flat buffer: the master shard's .grad.
        self.shards = [torch.zeros(b.shard_numel(n), dtype=dtype, device=device)
                       for b in layout.buffers]
        # Stage 1: full-size local accumulation buffers.
        self.full = ([torch.zeros(b.numel, dtype=dtype, device=device) for b in layout.buffers]
                     if stage == 1 else None)
        self.live: dict[tuple[int, int], torch.Tensor] = {}  # stage 2: buckets in flight
        self._pool: dict[int, list[torch.Tensor]] = {}
        self.live_bytes = 0
        self.peak_live_bytes = 0

    def bucket(self, i: int, b: int, create: bool = True) -> torch.Tensor | None:
        """Local (unreduced) gradient storage of bucket ``b`` of buffer ``i``."""
        buf = self.layout.buffers[i]
        bk = buf.buckets[b]
        n = bk.numel(self.layout.world_size)
        if self.full is not None:
            return self.full[i][bk.start:bk.start + n]
        t = self.live.get((i, b))
        if t is None and create:
            free = self._pool.get(n)
            t = free.pop() if free else torch.empty(n, dtype=self.dtype, device=self.device)
            t.zero_()
            self.live[(i, b)] = t
            self.live_bytes += n * t.element_size()
            self.peak_live_bytes = max(self.peak_live_bytes, self.live_bytes)
        return t

    def release(self, i: int, b: int) -> None:
        """Stage 2: the bucket's reduce-scatter is done; return its storage to the pool."""
        t = self.live.pop((i, b), None)
        if t is not None:
            self.live_bytes -= t.numel() * t.element_size()
            self._pool.setdefault(t.numel(), []).append(t)

    def drop_pool(self) -> None:
        self._pool.clear()

    def zero(self) -> None:
        if self.full is not None:
            for t in self.full:
                t.zero_()
        for t in self.shards:
            t.zero_()

    def nbytes(self) -> int:
        """Bytes of gradient storage held now (shards, full buffers, live buckets, pool)."""
        tot = sum(t.numel() * t.element_size() for t in self.shards)
        if self.full is not None:
            tot += sum(t.numel() * t.element_size() for t in self.full)
        tot += self.live_bytes
        tot += sum(t.numel() * t.element_size() for ts in self._pool.values() for t in ts)
        return tot
