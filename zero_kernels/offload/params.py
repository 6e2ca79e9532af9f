"""`ParamSwapper`: stage 3's param shards on disk between uses (``offload_params="nvme"``).

[Note: param offload]
At stage 3 a rank's param shard of a bucket is needed at three moments only: as the input of the
bucket's all-gathers (before the unit's forward and again before its backward), when the step
updates it (fp32 params: the shard *is* what the optimizer steps; bf16/fp16: the fp32 master
steps and is cast into it), and when whole-state readers look at it (state dicts, checkpoints,
``full_param``, a load). Between those moments it lives in one file per rank under
``offload_dir``:

- every offloaded bucket's shard has a *record* in the file (its bytes padded to `aio.ALIGN`, at
  an aligned offset) and, in RAM, an anonymous memory mapping of the same padded size of its
  own; `ParamStore.shard` returns the mapping's tensor. The mapping is the shard's storage for
  the optimizer's life, so every view of it stays valid: the inner optimizer's params (pieces of
  the fp32 shards, see [Note: modes] in `zero_kernels.partition.runner`) keep pointing at the
  same storage whether or not its values are in RAM; only its *pages* come and go. Evicting a
  shard is ``madvise(MADV_DONTNEED)`` on its mapping (its resident memory drops at once, as the
  gathered buckets' do, [Note: gathered memory] in `zero_kernels.buffers`); fetching it is one
  ``O_DIRECT`` read into the mapping (page-aligned: no staging copy, no page cache). A pool of
  staging buffers with copies in and out would also work, but would need every view of the
  shard (the pieces, the grads' partners) re-pointed on each use; the mappings need nothing;
- a shard is in RAM while it is *acquired* (a reference count: the all-gathers of its unit, a
  bucket's step, a `resident` context) and while a read-ahead or a write-behind of it is in
  flight. Releasing the last reference with ``dirty`` (the step changed it) starts its write and
  evicts it once the write is done (at most ``WRITES`` writes in flight; the oldest is waited
  for before another starts); a clean release evicts at once. So RAM holds the shards of the
  buckets being gathered or stepped, the reads ahead and the writes behind, a bounded pool
  whatever the model's size;
- reads ahead: every training step acquires the shards in the same order (the forward's units,
  the backward's in reverse, the step's buckets), so the swapper records each step's acquires
  (`end_step` closes the record) and, at each acquire, finds it in the last step's record
  (where this step has got to, else anywhere) and starts reading the shards that followed it
  there, up to ``ahead_bytes`` (the largest unit's shards: one unit ahead of the one whose
  all-gathers start, which with the scheduler's prefetch is two units ahead of the one
  computing). The reads overlap the compute before their use without the scheduler saying
  anything. A step that goes elsewhere (an eval forward, a skipped branch) only misses: a read
  ahead that no acquire takes is dropped, oldest first, when the reads ahead would exceed
  ``ahead_bytes``. (A successor per shard is not enough: the backward runs the units the
  other way, so each shard has two successors a step);
- a timeline (units U1..U3, the scheduler's prefetch=1; the step in reverse bucket order):

      forward  U1 pre: AG U1 waited, U1's shards evicted | AG U2 started, read of U3 ahead
               U1 compute ................................ | U3's read in flight
               U2 pre: AG U2 waited, U2 evicted | AG U3 started (its shards already in RAM)
      step     bucket b stepped (shard + master in RAM) | b+1 read ahead | b-1 written behind

- an all-gather's input must stay in place until the all-gather is waited for, so
  `ShardRunner.gather` acquires the shard and `release_after` wraps its handle: the shard is
  released when the handle is waited for, not when the unit is freed;
- the fp32 masters of bf16/fp16 params (4 bytes per param of the shard, twice the shard's
  own) go to the file too: the runner's master shard of a flat buffer stays one tensor (its
  state dicts' format, its pieces' views), backed by one mapping, and each bucket's record is
  the pages wholly inside the bucket's range, read with the shard in the step (and in
  `load_masters`/`write_params`), evicted after. The pages two neighbouring buckets share (at
  most two per bucket) stay in RAM (``fixed_bytes``);
- the shards of the params kept whole between uses (``persist_below``, the persistent unit) are
  *pinned*: in RAM always, never written (they are small by definition);
- checkpoints acquire one bucket's shard and master pages at a time (`ShardRunner.window`,
  [Note: streamed checkpoints] in `zero_kernels.checkpoint.save`), outside the read-ahead
  record (``learn=False``);
- every other reader or writer (``state_dict``, ``full_param``/``set_full_param``,
  ``load_masters`` after ``model.load_state_dict``, ``gathered_params`` edits, the refresh after
  a load) runs inside `ShardRunner.resident`, which acquires every shard for the duration and
  writes them all back after (as the offloaded moments are read in: [Note: offload] in
  `zero_kernels.offload.swap`);
- the file's name carries the host, the pid and a random token; it is removed at ``close()``,
  when the optimizer is collected and at exit, as the moments' file is.

Results are bitwise those of the run without offload: the same values go through the same
all-gathers and the same kernel; only where the shard's bytes wait between uses changes
(tests/offload/test_offload_params.py). Left to do: GPU params (a pinned host staging pool) raise
NotImplementedError.
"""

from __future__ import annotations

import contextlib
import mmap
import os
from collections import deque

import torch

from . import aio

__all__ = ["ParamSwapper"]


_PAGE = max(aio.ALIGN, mmap.PAGESIZE)  # what O_DIRECT and madvise both take


def _mapping(nbytes: int) -> tuple[mmap.mmap, torch.Tensor]:
    """An anonymous private mapping of ``nbytes`` rounded up to pages, and its bytes."""
    m = mmap.mmap(-1, max(_PAGE, -(-nbytes // _PAGE) * _PAGE), flags=mmap.MAP_PRIVATE)
    return m, torch.frombuffer(m, dtype=torch.uint8)


class _Record:
    """One bucket's shard (or the pages of its fp32 master): its place in the file, the range
    of a mapping it is read into and evicted from, and where its bytes are now."""

    __slots__ = (
        "offset", "nbytes", "map", "start", "raw", "tensor", "count", "resident", "read",
        "write", "dirty", "pinned", "master",
    )  # fmt: skip

    def __init__(self, offset, mapping, start, nbytes, tensor, pinned, master=False):
        self.offset = offset
        self.map, self.start, self.nbytes = mapping, start, nbytes  # page-aligned range
        self.raw = torch.frombuffer(mapping, dtype=torch.uint8)[start : start + nbytes]
        self.tensor = tensor  # the values (a view of the mapping)
        self.count = 0  # references held (acquire/release)
        self.resident = pinned  # its pages hold its values (a new file reads as zeros)
        self.read = None  # aio.Handle of a read into it in flight
        self.write = None  # aio.Handle of its write in flight
        self.dirty = False  # changed since it was last written
        self.pinned = pinned  # kept whole between uses (or no whole page): never evicted
        self.master = master

    def evict(self) -> None:
        self.map.madvise(mmap.MADV_DONTNEED, self.start, self.nbytes)
        self.resident = False


class ParamSwapper(aio.RunFile):
    """The param shards of stage 3's buckets in one file (see [Note: param offload]): ``units``,
    per unit the ``(buffer, bucket)`` of its buckets; ``pinned``: the buckets kept in RAM (params
    kept whole); ``masters``: the buffers whose fp32 masters go to the file too (bf16/fp16
    params), whole per buffer in `masters` (``masters[i]``, the runner's master shard), each
    bucket's whole pages a record keyed ``(i, b, "master")``."""

    WRITES = 2  # writes in flight at most (write behind)

    def __init__(self, layout, rank: int, units, pinned, directory: str, masters=()):
        if not os.path.isdir(directory):  # before the mappings are made
            raise ValueError(
                f"offload_dir={directory!r} is not a directory (create it on the disk to use)"
            )
        from ..buffers import dtype_of

        self.layout, self.rank = layout, rank
        self.records: dict[tuple, _Record] = {}
        off = 0
        for i, b in [k for ks in units for k in ks] + sorted(pinned):
            buf = layout.buffers[i]
            dt = dtype_of(buf.dtype)
            n = buf.buckets[b].shard_numel * dt.itemsize
            m, raw = _mapping(n)
            rec = _Record(off, m, 0, len(m), raw[:n].view(dt), (i, b) in pinned)
            self.records[(i, b)] = rec
            off += 0 if rec.pinned else rec.nbytes
        # fp32 masters: one mapping per buffer (the runner's whole master shard, its state
        # dicts' format); a bucket's record is the pages wholly inside its range, the pages
        # it shares with a neighbour stay in RAM (at most two per bucket)
        self.masters: dict[int, torch.Tensor] = {}
        self.fixed_bytes = 0  # bytes of master pages never evicted
        for i in sorted(masters):
            buf = layout.buffers[i]
            numel = buf.shard_numel(layout.world_size)
            m, raw = _mapping(numel * 4)
            whole = raw[: numel * 4].view(torch.float32)
            self.masters[i] = whole
            self.fixed_bytes += len(m)
            for bk in buf.buckets:
                lo = bk.start // layout.world_size * 4
                hi = lo + bk.shard_numel * 4
                a, z = -(-lo // _PAGE) * _PAGE, hi // _PAGE * _PAGE
                pin = (i, bk.index) in pinned or z <= a
                t = whole[lo // 4 : hi // 4]
                rec = _Record(off, m, a, max(0, z - a), t, pin, master=True)
                self.records[(i, bk.index, "master")] = rec
                if not pin:
                    off += rec.nbytes
                    self.fixed_bytes -= rec.nbytes
        self.nbytes = off  # on disk
        self._open_run_file(directory, "params", rank, off)
        self._writing: deque = deque()  # keys whose write is in flight, oldest first
        self._ahead: dict[tuple, None] = {}  # read ahead, not acquired: oldest first
        # read ahead at most the largest unit's shards (and masters)
        self.ahead_bytes = max(
            (
                sum(self.records[k].nbytes for b in ks for k in (b, (*b, "master")) if k in self)
                for ks in units
            ),
            default=0,
        )
        self._seq: list[tuple] = []  # this step's acquires, in order
        self._prev: list[tuple] = []  # the last step's
        self._pos = 0  # where this step is in ``_prev``
        self._soon: set[tuple] = set()  # the keys the last acquire predicted (read ahead)
        self._learn = True  # off inside `resident` (its order is not a pass's)
        self.ahead_hits = 0  # acquires that found their shard read ahead
        self.peak_ram = self.ram_bytes()

    # ---------------------------------------------------------------- one shard
    def tensor(self, key: tuple) -> torch.Tensor:
        """The shard's tensor (its values valid only while acquired)."""
        return self.records[key].tensor

    def __contains__(self, key) -> bool:
        return key in self.records

    def prefetch(self, key: tuple) -> None:
        """Start reading the shard into RAM unless it is there or on its way (a read ahead);
        the oldest reads ahead not taken are dropped to stay within ``ahead_bytes``."""
        r = self.records.get(key)
        if r is None or r.pinned or r.resident or r.read is not None:
            return
        self._make_room(r.nbytes)
        r.read = self.file.read_async(r.raw, r.offset)
        self._ahead[key] = None
        self._peak()

    def _keep_ahead(self, key) -> None:
        """A released shard kept in RAM as if read ahead (it is predicted again soon)."""
        self._make_room(self.records[key].nbytes)
        self._ahead[key] = None

    def _make_room(self, nbytes: int) -> None:
        """Drop the oldest reads ahead until ``nbytes`` more fit in ``ahead_bytes``."""
        held = sum(self.records[k].nbytes for k in self._ahead)
        while self._ahead and held + nbytes > self.ahead_bytes:
            old = next(iter(self._ahead))
            held -= self.records[old].nbytes
            self._drop(old)

    def _drop(self, key) -> None:
        """A read ahead (or a shard kept) no acquire took: finished and evicted."""
        del self._ahead[key]
        r = self.records[key]
        if r.read is not None:
            r.read.wait()
            r.read = None
        r.resident = True
        if r.count == 0:
            self._evict(key)

    def acquire(self, key: tuple, fresh: bool = False, learn: bool = True) -> None:
        """The shard's values in RAM until the matching `release`; ``fresh``: the caller
        overwrites all of it (nothing is read); ``learn=False``: an acquire outside the
        training steps (a checkpoint's), neither recorded nor read ahead of."""
        r = self.records[key]
        if r.pinned:
            return
        kept = self._ahead.pop(key, 0) is None
        if r.read is not None:
            r.read.wait()
            r.read, r.resident = None, True
            self.ahead_hits += 1
        elif kept:  # released while predicted again soon: kept, nothing to read
            self.ahead_hits += 1
        elif not r.resident:
            if not fresh:
                self.file.read(r.raw, r.offset)
            r.resident = True
        r.count += 1
        if learn and self._learn and not fresh:
            self._seq.append(key)
            self._read_ahead(key)
        self._peak()

    def _read_ahead(self, key) -> None:
        """Find ``key`` in the last step's acquires (from where this step is, else anywhere)
        and read the ones that followed it there, up to ``ahead_bytes``."""
        prev, at = self._prev, None
        if self._pos < len(prev) and prev[self._pos] == key:
            at = self._pos
        else:
            for lo, hi in ((self._pos, len(prev)), (0, self._pos)):
                try:
                    at = prev.index(key, lo, hi)
                    break
                except ValueError:
                    pass
        if at is None:
            return
        self._pos = at + 1
        total, soon = 0, set()
        for k in prev[at + 1 :] + prev:  # past the end: the next step starts as this one did
            if total >= self.ahead_bytes:
                break
            if k not in soon:
                soon.add(k)
                total += self.records[k].nbytes
                self.prefetch(k)
        self._soon = soon

    def end_step(self) -> None:
        """The optimizer step is over: its writes finished, and the acquires of the step
        that ends here are the order the next one reads ahead by."""
        self.flush()
        if self._seq:
            self._prev, self._seq, self._pos = self._seq, [], 0

    def release_after(self, key: tuple, handle):
        """``handle`` (a collective reading the shard), releasing the shard once waited for."""
        return _Releasing(handle, self, key)

    def release(self, key: tuple, dirty: bool = False) -> None:
        """Drop one reference; at the last, write the shard back if it changed (behind, at most
        `WRITES` in flight) and evict it."""
        r = self.records[key]
        if r.pinned:
            return
        assert r.count > 0, f"shard {key} released more often than acquired"
        r.count -= 1
        r.dirty |= dirty
        if r.count:
            return
        if not r.dirty and key in self._soon and r.write is None:
            self._keep_ahead(key)  # wanted again soon (the backward of the forward's last unit)
            return
        if not r.dirty:
            self._evict(key)
            return
        if r.write is not None:  # an older write of it: done before the new one
            r.write.wait()
            r.write = None
            self._writing.remove(key)
        while len(self._writing) >= self.WRITES:
            self._finish_write(self._writing.popleft())
        r.write = self.file.write_async(r.raw, r.offset)
        r.dirty = False
        self._writing.append(key)

    def _finish_write(self, key) -> None:
        r = self.records[key]
        r.write.wait()
        r.write = None
        if r.count == 0:
            self._evict(key)

    def _evict(self, key) -> None:
        r = self.records[key]
        if r.write is not None:
            self._finish_write(key)
            self._writing.remove(key)
            return
        r.evict()

    def flush(self) -> None:
        """Every write in flight finished (and its shard evicted unless acquired again)."""
        while self._writing:
            self._finish_write(self._writing.popleft())

    @contextlib.contextmanager
    def using(self, key: tuple, dirty: bool = False, fresh: bool = False):
        """The shard acquired for the block (``dirty``: written back after)."""
        self.acquire(key, fresh=fresh)
        try:
            yield self.records[key].tensor
        finally:
            self.release(key, dirty)

    @contextlib.contextmanager
    def resident(self):
        """Every shard in RAM for the block, all written back after (whole-state readers and
        writers: see [Note: param offload]). Reentrant."""
        keys = [k for k, r in self.records.items() if not r.pinned]
        done, learn = [], self._learn
        self._learn = False
        try:
            for k in keys:
                self.acquire(k)
                done.append(k)
            yield
        finally:
            self._learn = learn
            for k in done:
                self.release(k, dirty=True)
            self.flush()

    # ---------------------------------------------------------------- accounting
    def ram_bytes(self, master: bool | None = None) -> int:
        """Bytes in RAM now (acquired, read ahead, being written, pinned) of the param shards
        (``master=False``), the fp32 masters (True) or both (None)."""
        held = sum(
            r.nbytes
            for r in self.records.values()
            if (master is None or r.master == master)
            and not (r.pinned and r.master)  # inside the masters' fixed pages
            and (r.pinned or r.resident or r.read is not None or r.count)
        )
        return held + (self.fixed_bytes if master is not False else 0)

    def _peak(self) -> None:
        self.peak_ram = max(self.peak_ram, self.ram_bytes())


class _Releasing:
    """A collective's handle whose first ``wait`` releases the shard it read from."""

    def __init__(self, handle, swapper: ParamSwapper, key):
        self._handle, self._swapper, self._key = handle, swapper, key

    def wait(self, *args, **kwargs):
        out = self._handle.wait(*args, **kwargs)
        if self._swapper is not None:
            sw, self._swapper = self._swapper, None
            sw.release(self._key)
        return out

    def __getattr__(self, name):
        return getattr(self._handle, name)
