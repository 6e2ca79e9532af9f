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

[Note: gathered memory]
Stage 3 gathers a bucket, uses it and frees it again on every forward and backward, and the
tensor's storage must stay the same object throughout (autograd's saved views of params keep it,
see `ParamStore`). Through the allocator (``storage.resize_``) each use is a malloc and a free:
glibc serves buckets under its mmap threshold (which it raises up to 32 MiB as blocks are freed)
from its heap and keeps the freed ones there, counted in the process's memory: at 1 GiB per
rank that cost stage 3 ~10 of 67 layers of capacity (docs/benchmarks.md, "Stage 3"); buckets above
it are fresh mappings each time, whose page faults cost 8x the copy that fills them (32 MiB:
60 ms against 7.5 ms on this machine). So on the CPU each bucket gets an anonymous memory
mapping of its own for the optimizer's life: `free` returns its pages at once
(``madvise(MADV_DONTNEED)``: resident memory drops, the address range stays) and the all-gather
that refills it faults them back in, as 2 MiB transparent huge pages where the kernel allows
(``MADV_HUGEPAGE``: 19 ms for the same 32 MiB). `free` gives back the whole mapping, slack
included: the huge page holding a bucket's last bytes extends past them, and giving back only
the bucket's own range split that page and left its tail resident. Between uses the mapping
costs address space only. ``ZERO_KERNELS_GATHERED=allocator`` goes back to the allocator; on
GPUs the caching allocator already keeps freed blocks for reuse, so there the storage is
resized ([Note: gathered memory on CUDA]).

[Note: gathered memory on CUDA]
A bucket's pages are written on the comm stream S (its all-gather) and read on the compute stream
C (forward, backward). Allocated on C and marked ``record_stream(S)``, a freed block could not be
reused before the caching allocator saw S's work on it finished, and nothing bounded how far the
host ran ahead: every gather issued meanwhile took a fresh block, and reserved memory could
climb toward the whole model (FSDP1 needed ``limit_all_gathers`` for this). So, as FSDP2 does,
the block belongs to the stream that writes it and its reuse is ordered by streams, not by the
host: `alloc` resizes the storage while S (``ParamStore.gather_stream``) is current (the block
comes from, and returns to, S's pool; ``record_stream(S)`` on it is then a no-op), and `free`
makes S wait for C's work so far (the bucket's last reads) before the storage is resized to 0.
The block is free at once, host-side, but only an allocation on S can take it, and anything S
runs from then on is queued after C's last use:

    host   alloc U1 | AG U1 | alloc U2 | AG U2 | free U1 | alloc U3 (takes U1's block) | AG U3
    C            ....... fwd U1 .......|.... fwd U2 ....
    S      [AG U1]      [AG U2]  wait(C at free U1) --> [AG U3 into U1's pages]

The host never waits (no event is synchronised), yet the memory gathered at any moment is what
the scheduler holds gathered at that moment: the root unit, the unit in use, ``prefetch``
prefetched units and, in backward, the unit whose gradients are still arriving
(``gathered_units_peak`` in ``memory_report()``: at most ``prefetch + 2`` units beside the root
with ``reshard_after_forward``), whatever the lag of the GPU behind the host. A bucket allocated
without a stream (construction, CPU) is freed as before.
"""

from __future__ import annotations

import contextlib
import mmap
import os

import torch

from .layout import FlatBuffer, Layout

__all__ = ["GradStore", "ParamStore", "dtype_of", "flatten_params", "shard_view"]


def dtype_of(name: str) -> torch.dtype:
    """``"torch.float32"`` -> ``torch.float32``."""
    dt = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"not a torch dtype: {name!r}")
    return dt


def flatten_params(
    buf: FlatBuffer, params: dict[int, torch.Tensor], device: torch.device
) -> torch.Tensor:
    """Copy ``buf``'s parameters into one new flat tensor and make each ``param.data`` its view.

    The flat tensor is allocated uninitialised (its pages are touched only as params are copied
    in, each param's old storage freed as soon as it is a view) and only the padding is zeroed,
    so construction does not hold the params twice."""
    flat = torch.empty(buf.numel, dtype=dtype_of(buf.dtype), device=device)
    pos = 0
    for slot in sorted(buf.slots, key=lambda s: s.start):
        flat[pos : slot.start].zero_()  # padding before this param
        p = params[slot.index]
        view = flat[slot.start : slot.end]
        if not p.is_meta:
            view.copy_(p.detach().reshape(-1))
        p.data = view.view(slot.shape)
        pos = slot.end
    flat[pos:].zero_()
    return flat


def shard_view(
    flat: torch.Tensor, layout: Layout, buf: FlatBuffer, rank: int, bucket: int
) -> tuple[torch.Tensor, slice]:
    """``rank``'s shard of one bucket inside ``flat`` and its slice inside the rank's shard."""
    b = buf.buckets[bucket]
    lo = b.shard_start(rank)
    off = b.start // layout.world_size
    return flat[lo : lo + b.shard_numel], slice(off, off + b.shard_numel)


def grad_dtypes(
    layout: Layout, dtype: torch.dtype | None = None, reduce_dtype: torch.dtype | None = None
) -> tuple[list[torch.dtype], list[torch.dtype]]:
    """Per flat buffer: the dtype its gradient shard keeps (``dtype`` if given, else fp32;
    float64 kept as is) and the dtype it is accumulated and reduced in (``reduce_dtype`` if
    given, else the same)."""
    keep = [
        dtype or (torch.float64 if b.dtype == "torch.float64" else torch.float32)
        for b in layout.buffers
    ]
    return keep, [reduce_dtype or dt for dt in keep]


class GradStore:
    """Where gradients live between the autograd hooks and the optimizer step.

    See [Note: gradient storage]. ``max_inflight`` bounds the stage-2 bucket buffers.
    """

    def __init__(
        self,
        layout: Layout,
        shard,
        device: torch.device,
        dtype: torch.dtype | None = None,
        *,
        rank: int = 0,
        max_inflight: int = 2,
        reduce_dtype: torch.dtype | None = None,
    ):
        """``shard``: the `zero_kernels.policy.ShardPolicy` (or its stage number): whole
        gradients (a full-size buffer, stage 1) or reduced shards (stages 2 and 3)."""
        from .policy import ShardPolicy

        if not isinstance(shard, ShardPolicy):
            shard = ShardPolicy.of_stage(shard)
        self.whole = shard.grads  # a full-size local buffer per flat buffer (stage 1)
        self.layout, self.device = layout, device
        self.rank, self.max_inflight = rank, max_inflight
        # the reduce dtype of each buffer: ``dtype`` if given, else fp32 (float64 kept as is)
        self.dtypes, self.reduce_dtypes = grad_dtypes(layout, dtype, reduce_dtype)
        self.dtype = self.dtypes[0] if self.dtypes else torch.float32
        # stage 2/3: the dtype gradients are accumulated in and reduced in (bucket buffers); the
        # reduced result is added into the shards, which keep ``dtypes``
        if reduce_dtype is not None and self.whole:
            raise NotImplementedError(
                f"reduce_dtype={reduce_dtype} at stage 1: stage 1 reduces in place in its full "
                "gradient buffer, which is also the optimizer's gradient; use stage 2 or 3"
            )
        n = layout.world_size
        if self.whole:  # full-size local accumulation buffers; the shards are views into them
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
            base = self._take(n, self.reduce_dtypes[i])
            t = base[:n]  # not zeroed: the reducer zeroes what no grad was written into
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

    def pooled_buffers(self) -> int:
        """Stage 2: bucket buffers kept for reuse, not in use now."""
        return len(self._free)

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
        return max((torch.finfo(d).bits // 8 for d in self.reduce_dtypes), default=4)


class Mapped:
    """A gathered bucket's memory on the CPU: an anonymous memory mapping of its own, whose
    pages `release` returns to the system at once (``madvise(MADV_DONTNEED)``) while the mapping,
    and so the tensor's storage, stay ([Note: gathered memory])."""

    _HUGE = 2 << 20  # transparent huge page size on x86-64 and most arm64 kernels

    def __init__(self, numel: int, dtype: torch.dtype):
        nbytes = max(1, numel) * torch.empty((), dtype=dtype).element_size()
        # private: released pages are freed (a shared mapping would keep them in shmem)
        self.map = mmap.mmap(-1, nbytes + self._HUGE, flags=mmap.MAP_PRIVATE)
        if hasattr(mmap, "MADV_HUGEPAGE"):  # 2 MiB pages: 512x fewer faults when refilled
            self.map.madvise(mmap.MADV_HUGEPAGE)
        raw = torch.frombuffer(self.map, dtype=torch.uint8)
        self.start = (-raw.data_ptr()) % self._HUGE
        self.nbytes = nbytes
        self.tensor = raw[self.start : self.start + nbytes].view(dtype)[:numel]

    def release(self) -> None:
        # the whole mapping, not only the tensor's bytes: the huge page that holds the tensor's
        # last bytes reaches into the slack after them, and releasing just the tensor's range
        # splits that page and leaves its tail resident (up to 2 MiB per bucket, measured:
        # ~1.6 MB per unit of a 30-block GPT)
        self.map.madvise(mmap.MADV_DONTNEED, 0, len(self.map))


class ParamStore:
    """Where the parameters live, by stage (see [Note: layout] for the ranges).

    - Whole params (stages 1 and 2): one flat tensor per `FlatBuffer`; every param is a view of
      it and is whole on every rank at all times; the rank's shard of a bucket is a slice.
    - Sharded params (stage 3): the rank's shard of every bucket in one persistent tensor per
      `FlatBuffer` (bucket b's shard at ``b.start // world_size``, as the optimizer's shards),
      and per bucket a *gathered* tensor whose memory exists only while the bucket is in use
      (`alloc`, then an all-gather fills it; `free` releases it, see [Note: gathered memory]).
      The storage
      object must stay the same across uses (a pool of tensors cannot replace it): autograd
      saves views of params (``weight.T`` of a tied head) that keep pointing at the storage they
      were made from, so the re-gathered values must land in that same storage (tested: a
      pool of tensors broke the tied-embedding parity). While its bucket
      is gathered a param's ``.data`` is its view of the gathered tensor; while sharded it is a
      placeholder of the param's shape, dtype and device that reads as NaN everywhere and takes
      one element of memory (an expanded scalar): values read between uses are loudly wrong,
      never plausible (read them with ``opt.gathered_params()`` or ``opt.full_param``), and an
      in-place write to it is an error. The Parameter objects stay the same throughout. Writes
      into a gathered tensor go through `raw` (its ``.data``), so autograd's version counters of
      the params (saved for backward) do not move.
    """

    def __init__(
        self,
        layout: Layout,
        params: dict[int, torch.Tensor],
        device,
        *,
        rank: int,
        sharded: bool,
        tier=None,
        shard_device=None,
    ):
        self.layout, self.device, self.sharded, self._rank = layout, device, sharded, rank
        # sharded, offload_params="nvme": `zero_kernels.offload.params.ParamSwapper` holds the
        # shards (their values in RAM only while acquired, [Note: param offload])
        self.tier = tier
        # sharded, offload_params="cpu": the persistent shards in host memory (pinned for params
        # on a GPU), copied into the gathered bucket as each all-gather's input ([Note: host
        # tier] in zero_kernels.offload.host)
        sdev = torch.device(device) if shard_device is None else torch.device(shard_device)
        self.shard_device = sdev
        self.host_shards = sharded and shard_device is not None
        self.bytes_to_device = 0  # host_shards: bytes copied in as all-gather inputs
        self._copies: list = []  # host_shards on a GPU: events of copies that may be in flight
        pin = sdev.type == "cpu" and torch.device(device).type == "cuda"
        n = layout.world_size
        self.flats: list[torch.Tensor] = []  # whole params: the flat buffers
        self.shards: list[torch.Tensor] = []  # sharded params: the persistent shards
        self.gathered: list[list[torch.Tensor]] = []  # sharded: per bucket, storage 0 when freed
        self.raw: list[list[torch.Tensor]] = []
        self.maps: list[list[Mapped | None]] = []  # sharded, CPU: each bucket's mapping
        self.live: set[tuple[int, int]] = set()  # sharded: buckets allocated now
        # sharded, CUDA: the stream the all-gathers write on, which gathered buckets are
        # allocated on (set by stage 3's scheduler), and the stream each live bucket was
        # allocated on where not the current one ([Note: gathered memory on CUDA])
        self.gather_stream = None
        self._alloc_streams: dict[tuple[int, int], object] = {}
        self.peak_gathered = 0  # sharded: most bytes gathered at once (the live window)
        for buf in layout.buffers:
            dt = dtype_of(buf.dtype)
            if not sharded:
                self.flats.append(flatten_params(buf, params, device))
                continue
            k = 0 if tier is not None else buf.shard_numel(n)  # offloaded: the tier's mappings
            self.shards.append(torch.zeros(k, dtype=dt, device=sdev, pin_memory=pin))
            full, raw, maps = [], [], []
            for bk in buf.buckets:
                if _maps_memory(device):
                    m = Mapped(bk.numel(n), dt)
                    t = m.tensor
                else:
                    m, t = None, torch.empty(bk.numel(n), dtype=dt, device=device)
                    t.untyped_storage().resize_(0)
                full.append(t)
                raw.append(t.data)
                maps.append(m)
            self.maps.append(maps)
            self.gathered.append(full)
            self.raw.append(raw)
        # sharded: per bucket, (param, its view of the gathered tensor, its placeholder)
        self.members: dict[tuple[int, int], list] = {}

    def prepare(self, i: int, b: int, params: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        """Sharded, at construction: allocate bucket ``b`` of buffer ``i`` (zeros) and return
        ``{id(param): its view of the bucket}``, the storage a meta param is materialised into,
        so that its values are initialised in place and never exist elsewhere (a unit's whole
        params allocated apart and freed after the copy left glibc's heap with holes the next
        units did not fit into: 345 MiB per rank on a 68-block GPT). `adopt` follows."""
        self.alloc(i, b)
        self.raw[i][b].zero_()
        return {id(params[s.index]): view for s, _, view in self._slot_views(i, b)}

    def _slot_views(self, i: int, b: int):
        """``(slot, offset in the bucket, its view of the gathered tensor)`` per slot of bucket
        ``b`` of buffer ``i``."""
        buf = self.layout.buffers[i]
        bk = buf.buckets[b]
        full = self.gathered[i][b]
        for pos in bk.slots:
            s = buf.slots[pos]
            lo = s.start - bk.start
            yield s, lo, full[lo : lo + s.numel].view(s.shape)

    def adopt(self, i: int, b: int, params: dict[int, torch.Tensor]) -> None:
        """Sharded: allocate bucket ``b`` of buffer ``i`` (unless `prepare` did), copy its params'
        values in (those not already in it) and make them views of it (call once per bucket at
        construction; `take_shard` and `free` follow)."""
        if (i, b) not in self.live:
            self.prepare(i, b, params)
        full = self.gathered[i][b]
        members = []
        for s, lo, view in self._slot_views(i, b):
            p = params[s.index]
            if not p.is_meta and p.data_ptr() != view.data_ptr():
                self.raw[i][b][lo : lo + s.numel].copy_(p.detach().reshape(-1))
            nan = torch.full((1,) * len(s.shape) or (), float("nan"), dtype=full.dtype)
            members.append((p, view, nan.to(self.device).expand(s.shape)))
            p.data = view
        self.members[(i, b)] = members

    def take_shard(self, i: int, b: int) -> None:
        """Sharded: copy this rank's shard out of gathered bucket ``b`` of buffer ``i``."""
        bk = self.layout.buffers[i].buckets[b]
        lo = bk.shard_start(self._rank) - bk.start
        self.shard(i, b).copy_(self.raw[i][b][lo : lo + bk.shard_numel])

    def shard(self, i: int, b: int) -> torch.Tensor:
        """This rank's shard of bucket ``b`` of buffer ``i``, in the params' dtype."""
        buf = self.layout.buffers[i]
        if not self.sharded:
            return shard_view(self.flats[i], self.layout, buf, self._rank, b)[0]
        if self.tier is not None:
            return self.tier.tensor((i, b))
        bk = buf.buckets[b]
        off = bk.start // self.layout.world_size
        return self.shards[i][off : off + bk.shard_numel]

    # ---- offloaded shards ([Note: param offload]); each a no-op without a tier
    def using(self, i: int, b: int, dirty: bool = False, fresh: bool = False):
        """A context in which bucket ``b``'s shard holds its values (``dirty``: written back
        after; ``fresh``: all of it is overwritten, nothing read)."""
        if self.tier is None:
            self.settle()
            return contextlib.nullcontext()
        return self.tier.using((i, b), dirty=dirty, fresh=fresh)

    def resident(self):
        """A context in which every shard holds its values, all written back after."""
        self.settle()
        return contextlib.nullcontext() if self.tier is None else self.tier.resident()

    def acquire_shard(self, i: int, b: int) -> None:
        """Before an all-gather of bucket ``b``: its shard read in (`release_after` follows)."""
        if self.tier is not None:
            self.tier.acquire((i, b))

    def gather_input(self, i: int, b: int) -> torch.Tensor:
        """The all-gather input of bucket ``b``: the shard, or, with the shards in host memory
        (offload_params="cpu"), the bucket's own chunk of the gathered tensor with the shard
        copied in (from pinned memory, queued on the current stream: the collective's stream
        waits for it; on CPU params the same copy, host to host)."""
        shard = self.shard(i, b)
        if not self.host_shards:
            return shard
        full = self.full(i, b)
        bk = self.layout.buffers[i].buckets[b]
        lo = bk.shard_start(self._rank) - bk.start
        own = full[lo : lo + bk.shard_numel]
        own.copy_(shard, non_blocking=True)
        self.bytes_to_device += own.numel() * own.element_size()
        if own.is_cuda:  # the host must not write the shard while the copy reads it
            self._copies = [e for e in self._copies if not e.query()]
            ev = torch.cuda.Event()
            ev.record()
            self._copies.append(ev)
        return own

    def settle(self) -> None:
        """Wait for the copies `gather_input` queued from the host shards (before the host
        writes them: the step, loads, edits; `using` and `resident` call it)."""
        for e in self._copies:
            e.synchronize()
        self._copies.clear()

    def release_after(self, i: int, b: int, handle):
        """``handle`` of the all-gather from bucket ``b``'s shard, made to release the shard
        once waited for (offloaded; else ``handle`` itself)."""
        return handle if self.tier is None else self.tier.release_after((i, b), handle)

    def full(self, i: int, b: int) -> torch.Tensor:
        """The bucket's whole range (to write into: `raw` at stage 3)."""
        bk = self.layout.buffers[i].buckets[b]
        if not self.sharded:
            return self.flats[i][bk.start : bk.start + bk.numel(self.layout.world_size)]
        assert (i, b) in self.live, f"bucket {(i, b)} is not gathered"
        return self.raw[i][b]

    def alloc(self, i: int, b: int) -> None:
        """Sharded: give bucket ``b`` of buffer ``i`` its memory; on a GPU on `gather_stream`
        where set ([Note: gathered memory on CUDA])."""
        if (i, b) in self.live:
            return
        t = self.gathered[i][b]
        if self.maps[i][b] is None:
            nbytes = t.numel() * t.element_size()
            stream = self.gather_stream
            if stream is None or not t.is_cuda:
                t.untyped_storage().resize_(nbytes)
            else:
                with torch.cuda.stream(stream):
                    t.untyped_storage().resize_(nbytes)
                self._alloc_streams[(i, b)] = stream
        self.live.add((i, b))
        self.peak_gathered = max(self.peak_gathered, self.gathered_nbytes())
        for p, view, _ in self.members.get((i, b), ()):
            p.data = view

    def free(self, i: int, b: int) -> None:
        if (i, b) not in self.live:
            return
        for p, _, placeholder in self.members.get((i, b), ()):
            p.data = placeholder
        if self.maps[i][b] is not None:
            self.maps[i][b].release()
        else:
            stream = self._alloc_streams.pop((i, b), None)
            if stream is not None:  # its pool's next user runs after the reads queued so far
                stream.wait_stream(torch.cuda.current_stream(stream.device))
            self.gathered[i][b].untyped_storage().resize_(0)
        self.live.discard((i, b))

    def nbytes(self) -> int:
        """Bytes held between uses: the flat buffers, or the persistent shards."""
        if self.tier is not None:
            return self.tier.ram_bytes(master=False)  # in RAM now; the rest is on disk
        ts = self.flats if not self.sharded else self.shards
        return sum(t.numel() * t.element_size() for t in ts)

    def gathered_nbytes(self) -> int:
        """Sharded: bytes of the buckets gathered now."""
        return sum(
            self.gathered[i][b].numel() * self.gathered[i][b].element_size() for i, b in self.live
        )


def release_free_heap() -> None:
    """Return the C heap's free pages to the system (glibc ``malloc_trim``; elsewhere nothing).

    Construction frees what it copied (whole params copied into flat buffers, units copied into
    shards); glibc keeps freed chunks below its mmap threshold in its heap, where they count in
    the process's resident memory until reused. Called once at the end of construction."""
    import ctypes
    import sys

    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc (musl has no malloc_trim)
        pass


def _maps_memory(device) -> bool:
    """Whether stage 3's gathered buckets on ``device`` get memory mappings of their own
    ([Note: gathered memory]): on the CPU where ``madvise`` exists, unless
    ``ZERO_KERNELS_GATHERED=allocator``."""
    return (
        torch.device(device).type == "cpu"
        and hasattr(mmap.mmap, "madvise")
        and hasattr(mmap, "MADV_DONTNEED")
        and os.environ.get("ZERO_KERNELS_GATHERED", "") != "allocator"
    )


def storage_id(t: torch.Tensor) -> int:
    """Identity of ``t``'s storage (stable while a stage-3 bucket is freed and gathered)."""
    return t.untyped_storage()._cdata
