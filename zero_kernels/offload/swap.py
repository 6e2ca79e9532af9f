"""`StateSwapper`: the fused Adam step's moments on disk, streamed bucket by bucket.

[Note: offload]
``offload_optimizer="nvme"`` keeps what the fused Adam step reads and writes besides the params
and gradients, its moments (``exp_avg``, ``exp_avg_sq``, ``max_exp_avg_sq`` with amsgrad: 8-12
bytes per param, half or more of a rank's model states at stage 3; 4 with
``state_dtype="bf16"``, 2 + 8/block with ``"int8"``: codes and scales, each chunk a whole number
of blocks), in one file per rank under ``offload_dir`` instead of RAM:

- the file holds, for each bucket of each fused buffer, this rank's shard of it cut into
  *chunks*; a chunk's record is its range of every moment, each padded to `aio.ALIGN` bytes, so
  that one chunk is one contiguous O_DIRECT read and one write (the page cache never holds it:
  RAM the run would use without counting it). A new file is sparse, so never-stepped state
  reads as zeros, as torch creates it;
- the step streams the chunks through three staging buffers of ``offload_staging_mb / 3`` each
  (the only RAM the moments take, whatever the bucket size): while the fused kernel steps one
  chunk (the pieces' runs of the bucket cut at the chunk's bounds), the next is being read and
  the previous written; a staging buffer is read into again only after its write is done. A
  chunk none of whose params stepped is read and not written;
- checkpoints (`save_checkpoint`, `load_checkpoint`) stream the moments bucket by bucket
  through `ShardRunner.window` ([Note: streamed checkpoints] in
  `zero_kernels.checkpoint.save`): one bucket's moments in RAM at a time. Everything else
  that reads or writes them (``state_dict``, ``full_state``, ``consolidated_state_dict``,
  ``add_param_group``) returns or takes the whole state, so it runs inside
  `ShardRunner.resident`, which reads the whole state into RAM for the duration and writes it
  back after;
- the file's name carries the host, the pid and a random token, so no later run can mistake it
  for its own; it is removed at ``close()``, when the optimizer is collected and at exit. A run
  killed with SIGKILL leaves it behind, never read again (its name is not one a run looks for).

Results are bitwise those of the same run without offload: the same kernel runs on the same
values, only where they live between steps changes.

Why a bucket's step does not start during backward (the issue's alternative to speculation):
what the step does is not known until ``step()`` is called. Between ``backward()`` and
``step()`` a training loop may clip (``clip_grad_norm_``, torch's or ours: a factor on every
gradient, known only once all are reduced), change the learning rate or any hyper-parameter
(a scheduler, a manual edit), pass ``step(**kwargs)``, or skip the step (non-finite gradients
on some rank, the loss scaler). A bucket stepped early would be stepped on a guess; undoing a
wrong guess needs the moments it overwrote, i.e. a second copy of the offloaded state on disk
(twice the file) and a second pass of the whole step's I/O whenever the guess fails (every
step that clips). And the overlap pays only where the disk is idle during backward: with
``offload_params`` too the backward already reads and writes the param shards (~395 MB a step
in the measurement below). Measured (bench/bench_offload.py --layers 24 --steps 5 --rounds 1
--configs ram,opt,both, 25.2M params, stage 3, 2 ranks, 2-core Xeon VM, 2026-12-03): in RAM a
step takes 211 ms; with ``offload_optimizer="nvme"`` 466 ms of which ``opt.step()`` is 239 ms
(at 0.94x the disk's bound), so a perfect overlap with the ~190 ms backward could save at most
~0.4x of the step; with both offloads 569 ms of which 319 ms is the step. Not built: the
speculation and the doubled state it needs.
"""

from __future__ import annotations

from collections import deque

import torch

from . import aio

__all__ = ["StateSwapper"]


def _pad(numel: int, itemsize: int = 4) -> int:
    """Elements of ``numel`` (``itemsize`` bytes each) rounded up to whole `aio.ALIGN` blocks."""
    per = aio.ALIGN // itemsize
    return -(-numel // per) * per


def _size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


class StateSwapper(aio.RunFile):
    """The moments ``names[i]`` of every fused buffer ``i`` of a runner, in one file, chunk by
    chunk (see [Note: offload]); ``staging_mb``: the RAM of the three staging buffers;
    ``dtype``: the moments' (fp32, or bf16 with ``state_dtype="bf16"``: half the file and I/O).
    ``int8`` (an `Int8ShardState`, ``state_dtype="int8"``): the chunks end on its blocks' bounds
    and each record holds the chunk's codes and its blocks' scales (a quarter of fp32's bytes).

    A record is the chunk's segments one after the other, each padded to `aio.ALIGN` bytes:
    ``(name, byte offset in the record, dtype, count, first, end)`` with ``[first, end)`` the
    range of the bucket's tensor ``name`` it holds (elements; blocks for int8 scales)."""

    SLOTS = 3  # stepping, reading ahead, writing behind

    def __init__(
        self,
        layout,
        rank: int,
        names: dict[int, tuple[str, ...]],
        directory: str,
        staging_mb: float = 48.0,
        dtype: torch.dtype = torch.float32,
        int8=None,
    ):
        self.layout, self.rank, self.names = layout, rank, names
        self.dtype, self.int8 = dtype, int8
        self.itemsize = isz = torch.empty((), dtype=dtype).element_size()
        most = max(len(n) for n in names.values())
        slot_bytes = int(staging_mb * 2**20 / self.SLOTS)
        if int8 is not None:  # codes 2 bytes per element, 8 per block of scales, the padding
            per_elem = 2 + 8 / int8.block
            self.chunk = max(int8.block, int((slot_bytes - 4 * aio.ALIGN) / per_elem))
        else:
            per = aio.ALIGN // isz
            self.chunk = max(per, slot_bytes // isz // most // per * per)  # one moment's
        # (i, b) -> [(offset in the file, lo, hi in the bucket's shard, record bytes, segments)]
        self.records: dict[tuple[int, int], list[tuple]] = {}
        off = biggest = 0
        for i, nm in sorted(names.items()):
            for bk in layout.buffers[i].buckets:
                chunks = []
                for lo, hi, segs in self._cut(i, bk, nm):
                    nbytes = segs[-1][1] + _pad(segs[-1][3] * _size(segs[-1][2]), 1)
                    chunks.append((off, lo, hi, nbytes, segs))
                    off += nbytes
                    biggest = max(biggest, nbytes)
                self.records[(i, bk.index)] = chunks
        self.nbytes = off
        self._open_run_file(directory, "optstate", rank, off)
        if int8 is None:  # a whole chunk of every moment, as the staging size was divided
            biggest = max(biggest, self.chunk * most * isz)
        self.slots = [aio.aligned_empty(biggest, torch.uint8) for _ in range(self.SLOTS)]
        self.staging_bytes = sum(s.numel() for s in self.slots)
        self._writes: list = [None] * self.SLOTS  # per slot: its write in flight

    def _cut(self, i: int, bk, nm):
        """``(lo, hi, segments)`` of each chunk of bucket ``bk`` of buffer ``i``."""
        if self.int8 is None or i not in self.int8.nblocks:
            for lo in range(0, max(bk.shard_numel, 1), self.chunk):
                hi = min(lo + self.chunk, bk.shard_numel)
                stride = _pad(hi - lo, self.itemsize) * self.itemsize
                yield (
                    lo,
                    hi,
                    tuple((n, k * stride, self.dtype, hi - lo, lo, hi) for k, n in enumerate(nm)),
                )
            return
        starts = self.int8.starts[(i, bk.index)].tolist()
        kb = 0
        while kb < len(starts) - 1:
            ke = kb + 1  # whole blocks up to `chunk` elements (at least one)
            while ke < len(starts) - 1 and starts[ke + 1] - starts[kb] <= self.chunk:
                ke += 1
            lo, hi = starts[kb], starts[ke]
            segs, at = [], 0
            for n in nm:
                scale = n.endswith("_scale")
                dt = torch.float32 if scale else (torch.int8 if n == "exp_avg" else torch.uint8)
                count, first, end = (ke - kb, kb, ke) if scale else (hi - lo, lo, hi)
                segs.append((n, at, dt, count, first, end))
                at += _pad(count * _size(dt), 1)
            yield lo, hi, tuple(segs)
            kb = ke

    def chunks(self, i: int, b: int) -> list[tuple[int, int]]:
        """``(lo, hi)`` of each chunk of bucket ``b`` of buffer ``i``, in the order streamed."""
        return [(lo, hi) for _, lo, hi, _, _ in self.records[(i, b)]]

    # ---- one chunk's views in a staging buffer
    def _views(self, slot: int, i: int, rec) -> dict[str, torch.Tensor]:
        buf = self.slots[slot]
        return {n: buf[at : at + count * _size(dt)].view(dt) for n, at, dt, count, _, _ in rec[4]}

    def _span(self, slot: int, i: int, rec) -> tuple[torch.Tensor, int]:
        return self.slots[slot][: rec[3]], rec[0]

    def _read(self, slot: int, i: int, rec):
        w = self._writes[slot]
        if w is not None:  # the slot's last chunk must be on disk before it is read over
            w.wait()
            self._writes[slot] = None
        t, off = self._span(slot, i, rec)
        return self.file.read_async(t, off)

    def stream(self, order: list[tuple[int, int]]):
        """Yield ``((i, b), (lo, hi), views, done)`` for each chunk of the buckets of ``order``
        in turn, its moments read ahead; the caller steps the views in place and calls
        ``done(dirty)`` before the next one (``dirty``: write it back). Every write is finished
        when the generator ends. Staging buffer ``pos % 3`` holds chunk ``pos``: while it
        steps, chunk ``pos + 1`` is being read (into the buffer whose write went a step
        earlier) and chunk ``pos - 1`` written."""
        flat = [(i, b, rec) for i, b in order for rec in self.records[(i, b)]]
        n = self.SLOTS
        pending: deque = deque()  # (position, read handle)
        nxt = 0
        try:
            for pos, (i, b, rec) in enumerate(flat):
                while nxt < len(flat) and nxt <= pos + 1:
                    pending.append((nxt, self._read(nxt % n, flat[nxt][0], flat[nxt][2])))
                    nxt += 1
                p, h = pending.popleft()
                assert p == pos, (p, pos)
                h.wait()
                marks: list = []
                yield (i, b), rec[1:3], self._views(pos % n, i, rec), marks.append
                if marks and marks[-1]:
                    t, off = self._span(pos % n, i, rec)
                    self._writes[pos % n] = self.file.write_async(t, off)
        finally:
            for _, h in pending:
                h.wait()
            self.flush()

    def flush(self) -> None:
        for k, w in enumerate(self._writes):
            if w is not None:
                w.wait()
                self._writes[k] = None

    # ---- whole-state access (resident mode)
    def read_into(self, i: int, b: int, out: dict[str, torch.Tensor]) -> None:
        """Bucket ``b`` of buffer ``i``'s moments into ``out`` (name -> the bucket's tensor)."""
        self.flush()
        for rec in self.records[(i, b)]:
            t, off = self._span(0, i, rec)
            self.file.read(t, off)
            views = self._views(0, i, rec)
            for n, _, _, _, first, end in rec[4]:
                out[n][first:end].copy_(views[n])

    def write_from(self, i: int, b: int, src: dict[str, torch.Tensor]) -> None:
        self.flush()
        for rec in self.records[(i, b)]:
            views = self._views(0, i, rec)
            for n, _, _, _, first, end in rec[4]:
                views[n].copy_(src[n][first:end])
            t, off = self._span(0, i, rec)
            self.file.write(t, off)

    def record_bytes(self) -> int:
        """Bytes one step reads (and writes) when every chunk is stepped."""
        return sum(rec[3] for rs in self.records.values() for rec in rs)

    def moment_bytes(self) -> int:
        """Bytes of the moments themselves (without the padding)."""
        return sum(
            count * _size(dt)
            for rs in self.records.values()
            for rec in rs
            for _, _, dt, count, _, _ in rec[4]
        )
