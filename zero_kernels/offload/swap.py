"""`StateSwapper`: the fused Adam step's moments on disk, streamed bucket by bucket.

[Note: offload]
``offload_optimizer="nvme"`` keeps what the fused Adam step reads and writes besides the params
and gradients, its moments (``exp_avg``, ``exp_avg_sq``, ``max_exp_avg_sq`` with amsgrad: 8-12
bytes per param, half or more of a rank's model states at stage 3; 4 with
``state_dtype="bf16"``), in one file per rank under ``offload_dir`` instead of RAM:

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
- everything else that reads or writes the moments (``state_dict``, checkpoints, ``full_state``,
  ``consolidated_state_dict``, ``add_param_group``, a load) runs inside `ShardRunner.resident`,
  which reads the whole state into RAM for the duration and writes it back after: correct, but
  for that moment the moments are in RAM (streaming them into checkpoints bucket by bucket is
  left to do);
- the file's name carries the host, the pid and a random token, so no later run can mistake it
  for its own; it is removed at ``close()``, when the optimizer is collected and at exit. A run
  killed with SIGKILL leaves it behind, never read again (its name is not one a run looks for).

Results are bitwise those of the same run without offload: the same kernel runs on the same
values, only where they live between steps changes.
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


class StateSwapper(aio.RunFile):
    """The moments ``names[i]`` of every fused buffer ``i`` of a runner, in one file, chunk by
    chunk (see [Note: offload]); ``staging_mb``: the RAM of the three staging buffers;
    ``dtype``: the moments' (fp32, or bf16 with ``state_dtype="bf16"``: half the file and I/O)."""

    SLOTS = 3  # stepping, reading ahead, writing behind

    def __init__(
        self,
        layout,
        rank: int,
        names: dict[int, tuple[str, ...]],
        directory: str,
        staging_mb: float = 48.0,
        dtype: torch.dtype = torch.float32,
    ):
        self.layout, self.rank, self.names = layout, rank, names
        self.dtype = dtype
        self.itemsize = isz = torch.empty((), dtype=dtype).element_size()
        most = max(len(n) for n in names.values())
        per = aio.ALIGN // isz
        slot_elems = int(staging_mb * 2**20 / self.SLOTS / isz)
        self.chunk = max(per, slot_elems // most // per * per)  # elements of one moment per chunk
        # (i, b) -> [(offset in the file, lo, hi in the bucket's shard, stride)]
        self.records: dict[tuple[int, int], list[tuple[int, int, int, int]]] = {}
        off = 0
        for i, nm in sorted(names.items()):
            for bk in layout.buffers[i].buckets:
                chunks = []
                for lo in range(0, max(bk.shard_numel, 1), self.chunk):
                    hi = min(lo + self.chunk, bk.shard_numel)
                    stride = _pad(hi - lo, isz)
                    chunks.append((off, lo, hi, stride))
                    off += stride * len(nm) * isz
                self.records[(i, bk.index)] = chunks
        self.nbytes = off
        self._open_run_file(directory, "optstate", rank, off)
        self.slots = [aio.aligned_empty(self.chunk * most, dtype) for _ in range(self.SLOTS)]
        self.staging_bytes = sum(s.numel() * isz for s in self.slots)
        self._writes: list = [None] * self.SLOTS  # per slot: its write in flight

    def chunks(self, i: int, b: int) -> list[tuple[int, int]]:
        """``(lo, hi)`` of each chunk of bucket ``b`` of buffer ``i``, in the order streamed."""
        return [(lo, hi) for _, lo, hi, _ in self.records[(i, b)]]

    # ---- one chunk's views in a staging buffer
    def _views(self, slot: int, i: int, rec) -> dict[str, torch.Tensor]:
        _, lo, hi, stride = rec
        buf = self.slots[slot]
        return {n: buf[k * stride : k * stride + hi - lo] for k, n in enumerate(self.names[i])}

    def _span(self, slot: int, i: int, rec) -> tuple[torch.Tensor, int]:
        off, _, _, stride = rec
        return self.slots[slot][: stride * len(self.names[i])], off

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
            lo, hi = rec[1:3]
            for n, v in self._views(0, i, rec).items():
                out[n][lo:hi].copy_(v)

    def write_from(self, i: int, b: int, src: dict[str, torch.Tensor]) -> None:
        self.flush()
        for rec in self.records[(i, b)]:
            lo, hi = rec[1:3]
            for n, v in self._views(0, i, rec).items():
                v.copy_(src[n][lo:hi])
            t, off = self._span(0, i, rec)
            self.file.write(t, off)

    def record_bytes(self) -> int:
        """Bytes one step reads (and writes) when every chunk is stepped."""
        return sum(
            st * len(self.names[i]) * self.itemsize
            for (i, _), rs in self.records.items()
            for _, _, _, st in rs
        )

    def moment_bytes(self) -> int:
        """Bytes of the moments themselves (without the padding)."""
        return sum(
            (hi - lo) * len(self.names[i]) * self.itemsize
            for (i, _), rs in self.records.items()
            for _, lo, hi, _ in rs
        )
