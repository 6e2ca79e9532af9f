"""Flat buffers: parameters re-pointed into one tensor per `FlatBuffer`, gradient storage per stage.

See [Note: layout] in `zero_kernels.layout` for where everything lives.

[Note: gradient storage]
Gradients are held in the reduce dtype (fp32; float64 for float64 parameters, which are never
computed in a lower precision than their own), and nothing is held twice:

- stage 1: one full-size buffer per flat buffer, where local grads accumulate (also across
  ``no_sync`` micro-batches); a bucket is a slice of it. Its reduce-scatter runs in place: the
  output is the rank's own shard of the bucket inside the input, so after it the rank's reduced
  gradient *is* that slice (the local values there are no longer needed) and no separate shard
  exists. `GradStore.shard` returns those views.
- stage 2: the rank's reduced shard of each flat buffer (``numel / world_size``), plus bucket
  buffers that exist only from a bucket's first grad until its reduce-scatter is finished. They
  come from a pool of at most ``max_inflight`` buffers, each sized to the bucket it was made for
  (a released buffer serves the next bucket it is big enough for, the smallest such first; one
  too small is freed and a right-sized one allocated), so the pool never holds more than the
  ``max_inflight`` largest buckets together (``cap_numel``; the reducer waits for the oldest
  reduce-scatter before a new bucket would exceed the count or the cap). The pool is kept
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
        dtype: torch.dtype | None = None,
        *,
        rank: int = 0,
        max_inflight: int = 2,
    ):
        if stage not in (1, 2):
            raise ValueError(f"stage must be 1 or 2, got stage={stage!r}")
        self.layout, self.stage, self.device = layout, stage, device
        self.rank, self.max_inflight = rank, max_inflight
        # the reduce dtype of each buffer: ``dtype`` if given, else fp32 (float64 kept as is)
        self.dtypes = [
            dtype or (torch.float64 if b.dtype == "torch.float64" else torch.float32)
            for b in layout.buffers
        ]
        self.dtype = self.dtypes[0] if self.dtypes else torch.float32
        n = layout.world_size
        if stage == 1:  # full-size local accumulation buffers; the shards are views into them
            self.full = [
                torch.zeros(b.numel, dtype=dt, device=device)
                for b, dt in zip(layout.buffers, self.dtypes)
            ]
            self.shards = None
        else:  # the reduced shard of every flat buffer
            self.full = None
            self.shards = [
                torch.zeros(b.shard_numel(n), dtype=dt, device=device)
                for b, dt in zip(layout.buffers, self.dtypes)
            ]
        sizes = sorted((bk.numel(n) for b in layout.buffers for bk in b.buckets), reverse=True)
        self.bucket_numel = sizes[0]  # the largest bucket
        self.cap_numel = sum(sizes[:max_inflight])  # the pool's bound (stage 2)
        self.live: dict[tuple[int, int], torch.Tensor] = {}  # stage 2: buckets in use
        self._free: list[torch.Tensor] = []  # stage 2: pool buffers not in use
        self._held_numel = 0  # stage 2: elements of all pool buffers (in use or free)
        self._live_numel = 0  # stage 2: elements of the pool buffers in use
        self.peak_live = 0  # most stage-2 bucket buffers in use at once
        self._peak_live_numel = 0

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
            base = self._take(n, self.dtypes[i])
            t = base[:n]
            t.zero_()
            self.live[(i, b)] = t
            self._live_numel += base.numel()
            self.peak_live = max(self.peak_live, len(self.live))
            self._peak_live_numel = max(self._peak_live_numel, self._live_numel)
        return t

    def fits(self, i: int, b: int) -> bool:
        """Stage 2: whether bucket ``b`` of buffer ``i`` can get a buffer now without the pool
        going over ``max_inflight`` buffers or ``cap_numel`` elements."""
        n = self.layout.buffers[i].buckets[b].numel(self.layout.world_size)
        return len(self.live) < self.max_inflight and self._live_numel + n <= self.cap_numel

    def _take(self, n: int, dtype: torch.dtype) -> torch.Tensor:
        """A pool buffer of at least ``n`` elements: the smallest free one that fits, else a new
        one of ``n`` (freeing free buffers, smallest first, to stay within the bounds)."""
        fit = [k for k, t in enumerate(self._free) if t.numel() >= n and t.dtype == dtype]
        if fit:
            return self._free.pop(min(fit, key=lambda k: self._free[k].numel()))
        self._free.sort(key=torch.Tensor.numel)
        while self._free and (
            self._held_numel + n > self.cap_numel
            or len(self.live) + len(self._free) >= self.max_inflight
        ):
            self._held_numel -= self._free.pop(0).numel()
        self._held_numel += n
        return torch.empty(n, dtype=dtype, device=self.device)

    def release(self, i: int, b: int) -> None:
        """Stage 2: the bucket's reduce-scatter is done; return its buffer to the pool."""
        t = self.live.pop((i, b), None)
        if t is not None:
            base = t._base if t._base is not None else t
            self._live_numel -= base.numel()
            self._free.append(base)

    def drop_pool(self) -> None:
        """Free the pool buffers not in use (they are allocated again when needed)."""
        self._held_numel -= sum(t.numel() for t in self._free)
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
        return self._held_numel * self._itemsize()

    def comm_peak_nbytes(self) -> int:
        """Most bytes of stage-2 bucket buffers in use at once."""
        return self._peak_live_numel * self._itemsize()

    def _itemsize(self) -> int:
        return max((torch.finfo(d).bits // 8 for d in self.dtypes), default=4)
