"""`StateSwapper`: the fused Adam step's moments on disk, streamed bucket by bucket.

[Note: offload]
``offload_optimizer="nvme"`` keeps what the fused Adam step reads and writes besides the params
and gradients, its moments (``exp_avg``, ``exp_avg_sq``, ``max_exp_avg_sq`` with amsgrad: 8-12
bytes per param, half or more of a rank's model states at stage 3), in one file per rank under
``offload_dir`` instead of RAM:

- the file holds one *record* per bucket of each fused buffer: the moments of this rank's shard
  of that bucket, each padded to `aio.ALIGN` bytes, so that one bucket is one contiguous
  O_DIRECT read and one write (the page cache never holds it: RAM the run would use without
  counting it). A new file is sparse, so never-stepped state reads as zeros, as torch creates it;
- the step streams the buckets through ``offload_staging`` staging buffers, each the size of the
  largest record (the only RAM the moments take): the read of bucket j+1 is in flight while the
  fused kernel steps bucket j, and bucket j's write goes behind while later buckets step; a
  staging buffer is read into again only after its write is done. A bucket none of whose params
  stepped is read and not written;
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

import os
import secrets
import socket
import weakref
from collections import deque

import torch

from . import aio

__all__ = ["StateSwapper"]


def _pad(numel: int) -> int:
    """fp32 elements of ``numel`` rounded up to whole `aio.ALIGN` blocks."""
    per = aio.ALIGN // 4
    return -(-numel // per) * per


class StateSwapper:
    """The moments ``names[i]`` of every fused buffer ``i`` of a runner, one record per bucket in
    one file (see [Note: offload])."""

    def __init__(
        self, layout, rank: int, names: dict[int, tuple[str, ...]], directory: str, staging: int = 3
    ):
        if not os.path.isdir(directory):
            raise ValueError(
                f"offload_dir={directory!r} is not a directory (create it on the disk to use)"
            )
        self.layout, self.rank, self.names = layout, rank, names
        self.records: dict[
            tuple[int, int], tuple[int, int, int]
        ] = {}  # (i, b) -> (offset, numel, stride)
        off = 0
        biggest = 0
        for i, nm in sorted(names.items()):
            for bk in layout.buffers[i].buckets:
                numel = bk.shard_numel
                stride = _pad(numel)
                self.records[(i, bk.index)] = (off, numel, stride)
                off += stride * len(nm) * 4
                biggest = max(biggest, stride * len(nm))
        self.nbytes = off
        tag = f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}"
        self.path = os.path.join(directory, f"zero_kernels-optstate-r{rank}-{tag}.bin")
        self.file = aio.AioFile(self.path, max(off, aio.ALIGN), direct=True)
        self.slots = [aio.aligned_empty(max(biggest, 1)) for _ in range(staging)]
        self.staging_bytes = sum(s.numel() * 4 for s in self.slots)
        self._writes: list = [None] * staging  # per slot: its write in flight
        self._finalizer = weakref.finalize(self, _close_file, self.file)

    # ---- one bucket's views in a staging buffer
    def _views(self, slot: int, i: int, b: int) -> dict[str, torch.Tensor]:
        _, numel, stride = self.records[(i, b)]
        buf = self.slots[slot]
        return {n: buf[k * stride : k * stride + numel] for k, n in enumerate(self.names[i])}

    def _span(self, slot: int, i: int, b: int) -> tuple[torch.Tensor, int]:
        off, _, stride = self.records[(i, b)]
        return self.slots[slot][: stride * len(self.names[i])], off

    def _read(self, slot: int, i: int, b: int):
        w = self._writes[slot]
        if w is not None:  # the slot's last bucket must be on disk before it is read over
            w.wait()
            self._writes[slot] = None
        t, off = self._span(slot, i, b)
        return self.file.read_async(t, off)

    def stream(self, order: list[tuple[int, int]]):
        """Yield ``((i, b), views, done)`` for each bucket of ``order`` in turn, its moments read
        ahead; the caller steps the views in place and calls ``done(dirty)`` before the next one
        (``dirty``: write it back). Every write is finished when the generator ends.

        Staging buffer ``pos % n`` holds bucket ``pos``: while it steps, the next ``n - 2``
        buckets (at least 1) are being read and the previous ones written, so a read waits only
        for the write issued a step or more earlier into the same buffer."""
        n = len(self.slots)
        ahead = max(1, n - 2)
        pending: deque = deque()  # (position, read handle)
        nxt = 0

        def issue(upto: int) -> None:
            nonlocal nxt
            while nxt < len(order) and nxt <= upto:
                pending.append((nxt, self._read(nxt % n, *order[nxt])))
                nxt += 1

        try:
            for pos, (i, b) in enumerate(order):
                issue(pos + ahead)  # into buffers whose writes went a step or more ago
                p, h = pending.popleft()
                assert p == pos, (p, pos)
                h.wait()
                marks: list = []
                yield (i, b), self._views(pos % n, i, b), marks.append
                if marks and marks[-1]:
                    t, off = self._span(pos % n, i, b)
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
        """Bucket ``b`` of buffer ``i``'s moments into ``out`` (name -> tensor)."""
        self.flush()
        t, off = self._span(0, i, b)
        self.file.read(t, off)
        for n, v in self._views(0, i, b).items():
            out[n].copy_(v)

    def write_from(self, i: int, b: int, src: dict[str, torch.Tensor]) -> None:
        self.flush()
        for n, v in self._views(0, i, b).items():
            v.copy_(src[n])
        t, off = self._span(0, i, b)
        self.file.write(t, off)

    @property
    def bytes_read(self) -> int:
        return self.file.bytes_read

    @property
    def bytes_written(self) -> int:
        return self.file.bytes_written

    def close(self) -> None:
        self._finalizer()


def _close_file(f) -> None:
    try:
        f.close(remove=True)
    except OSError:
        pass
