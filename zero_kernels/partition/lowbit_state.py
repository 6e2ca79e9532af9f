"""The fused step's moments in int8 (``state_dtype="int8"``) on a rank's shard.

[Note: int8 shard state]
Codes and scales follow `zero_kernels.ops.lowbit` [Note: low-bit state]; what is particular to a
shard is where the blocks lie. Each bucket's shard is cut into segments, one per piece (the part
of one param in this shard) and one per gap (padding), and every segment into blocks of at most
``block`` elements from its own start: a block never spans two params, so a piece's codes and
scales are the same as those of the piece stepped alone (`FusedAdamW`'s format for a tensor of
that size), and a run of consecutive pieces (the kernel's unit when pieces disagree in ``step``)
is a whole number of blocks. Per buffer: one int8 tensor of codes for exp_avg, one uint8 for
exp_avg_sq (the shard's size), and one fp32 scale tensor for each (the buffer's blocks, bucket
after bucket); each piece's inner state holds views of them (``exp_avg``, ``exp_avg_sq``,
``exp_avg_scale``, ``exp_avg_sq_scale``) and ``state_block``.

A checkpoint save reads the codes and scales as they are (`ShardRunner.codes_resident`;
offloaded, one bucket at a time: `hold`), never a decode; a checkpoint load of offloaded codes
decodes and encodes back one held bucket at a time (`decode_held`, `encode_held`: the same rule
as `flush`). Everything else that reads or writes state from outside the step (state dicts,
``full_state``, loads of codes kept in RAM) runs inside `ShardRunner.resident`, which here
*decodes* every bucket into fp32 tensors for its duration (the pieces' state becoming fp32 views
in torch's format) and, leaving it, encodes back each bucket whose values changed (`flush`: a
bucket left as it was keeps its codes and scales bit for bit). Checkpoints save the codes and
scales (`flush` first, inside `resident`): a piece's blocks are its own, so each saved piece is
self-contained, a load on the same layout
takes them as saved (`take_piece`, its decoded values set to their decode: the bucket is then
unchanged and keeps them; the resume is bitwise), any other decodes the saved blocks it
overlaps ([Note: checkpoint format]). The decoded copy of the rank's shard (8 bytes per element)
is the RAM that costs for the duration; whether a bucket changed is found by decoding its codes
again, a bucket at a time.
"""

from __future__ import annotations

import torch

from ..layout import Layout, Piece
from ..ops import lowbit

__all__ = ["Int8ShardState", "INT8_KEYS"]

INT8_KEYS = ("exp_avg", "exp_avg_sq", "exp_avg_scale", "exp_avg_sq_scale")
_DTYPES = {
    "exp_avg": torch.int8,
    "exp_avg_sq": torch.uint8,
    "exp_avg_scale": torch.float32,
    "exp_avg_sq_scale": torch.float32,
}


class Int8ShardState:
    """The block tables, codes and scales of one rank's fused buffers (see the Note)."""

    def __init__(self, layout: Layout, rank: int, pcs, fused: list[bool], block: int, device):
        self.layout, self.rank, self.block, self.device = layout, rank, block, device
        self.starts: dict[tuple[int, int], torch.Tensor] = {}  # bucket-shard relative, nb + 1
        self.first_block: dict[tuple[int, int], int] = {}  # the bucket's first block in buffer
        self.nblocks: dict[int, int] = {}
        self.piece_blocks: dict[tuple[int, int], tuple[int, int]] = {}  # (buffer, k) -> range
        self._runs: dict[tuple, tuple] = {}
        for i, buf in enumerate(layout.buffers):
            if not fused[i]:
                continue
            total = 0
            for b in buf.buckets:
                lo0 = b.shard_start(rank)
                segs = sorted(
                    (pc.start - lo0, pc.numel, k)
                    for k, pc in enumerate(pcs[i])
                    if pc.bucket == b.index and pc.numel > 0
                )
                starts, at = [0], 0
                for lo, num, k in segs + [(b.shard_numel, 0, None)]:
                    if lo > at:  # padding (or a gap) before this piece: its own segment
                        starts += _cut(at, lo, block)
                    if k is not None:
                        kb0 = len(starts) - 1
                        starts += _cut(lo, lo + num, block)
                        self.piece_blocks[(i, k)] = (total + kb0, total + len(starts) - 1)
                    at = max(at, lo + num)
                self.starts[(i, b.index)] = torch.tensor(starts, dtype=torch.int64)
                self.first_block[(i, b.index)] = total
                total += len(starts) - 1
            self.nblocks[i] = total
        self.whole: dict[tuple[int, str], torch.Tensor] = {}  # codes and scales, per buffer
        self.decoded: dict[tuple[int, str], torch.Tensor] = {}  # fp32, while resident
        # a streamed checkpoint's buckets (offloaded codes read one at a time): (i, b) -> the
        # bucket's own codes and scales, which `view` and `piece_views` give instead of `whole`
        self.held: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
        # and, for a streamed load, their decode (what `decoded_view` gives for those buckets)
        self.held_decoded: dict[tuple[int, int], dict[str, torch.Tensor]] = {}

    # ---- codes and scales
    def _whole(self, i: int, name: str) -> torch.Tensor:
        t = self.whole.get((i, name))
        if t is None:
            n = self.nblocks[i] if name.endswith("_scale") else self._shard_numel(i)
            t = torch.zeros(n, dtype=_DTYPES[name], device=self.device)
            self.whole[(i, name)] = t
        return t

    def _shard_numel(self, i: int) -> int:
        return self.layout.buffers[i].shard_numel(self.layout.world_size)

    def _elems(self, i: int, b: int) -> slice:
        bk = self.layout.buffers[i].buckets[b]
        off = bk.start // self.layout.world_size
        return slice(off, off + bk.shard_numel)

    def _blocks(self, i: int, b: int) -> slice:
        f = self.first_block[(i, b)]
        return slice(f, f + self.starts[(i, b)].numel() - 1)

    def view(self, i: int, b: int, name: str) -> torch.Tensor:
        """Bucket ``b``'s part of buffer ``i``'s ``name`` (codes: elements; scales: blocks)."""
        held = self.held.get((i, b))
        if held is not None:
            return held[name]
        sl = self._blocks(i, b) if name.endswith("_scale") else self._elems(i, b)
        return self._whole(i, name)[sl]

    def hold(self, i: int, b: int) -> dict[str, torch.Tensor]:
        """New zero codes and scales of bucket ``b`` alone, given by `view` and `piece_views`
        until `release` (a streamed save or load reads one offloaded bucket into them)."""
        nb = self.starts[(i, b)].numel() - 1
        n = self.layout.buffers[i].buckets[b].shard_numel
        t = {
            k: torch.zeros(nb if k.endswith("_scale") else n, dtype=dt, device=self.device)
            for k, dt in _DTYPES.items()
        }
        self.held[(i, b)] = t
        return t

    def decode_held(self, i: int, b: int) -> None:
        """The held bucket ``b`` decoded to fp32 (a streamed load writes into the decode)."""
        m, v = self._decode_bucket(i, b)
        self.held_decoded[(i, b)] = {"exp_avg": m, "exp_avg_sq": v}

    def encode_held(self, i: int, b: int) -> None:
        """A held bucket's decode encoded back into its codes where it changed (`flush` for
        one bucket: unchanged, its codes and scales stay bit for bit)."""
        d = self.held_decoded[(i, b)]
        m0, v0 = self._decode_bucket(i, b)
        if torch.equal(d["exp_avg"], m0) and torch.equal(d["exp_avg_sq"], v0):
            return
        out = {k: self.view(i, b, k) for k in INT8_KEYS}
        lowbit.encode_state(
            d["exp_avg"], d["exp_avg_sq"], "int8", self.block, out, self.starts[(i, b)]
        )

    def release(self) -> None:
        self.held.clear()
        self.held_decoded.clear()

    def piece_views(self, i: int, k: int, pc: Piece, lo: int) -> dict:
        """Piece ``k``'s state entries (1-D views; ``lo``: its first element in the bucket)."""
        kb0, kb1 = self.piece_blocks.get((i, k), (0, 0))
        f = self.first_block[(i, pc.bucket)]  # the bucket's blocks: kb0 - f on, in `view`
        out = {}
        for name in INT8_KEYS:
            if name.endswith("_scale"):
                out[name] = self.view(i, pc.bucket, name)[kb0 - f : kb1 - f]
            else:
                out[name] = self.view(i, pc.bucket, name)[lo : lo + pc.numel]
        out["state_block"] = self.block
        return out

    def block_of(self, i: int, b: int, at: int) -> int:
        """The bucket-relative block that starts at element ``at`` of bucket ``b``'s shard."""
        st = self.starts[(i, b)]
        k = int(torch.searchsorted(st, at))
        assert int(st[k]) == at, (at, "not on a block bound")
        return k

    def step(self, i, b, lo, hi, master, grad, hyper, out_lowp, backend, staged=None) -> None:
        """The kernel on elements ``[lo, hi)`` of bucket ``b``'s shard (whole blocks), on the
        buffer's codes and scales, or on ``staged``: ``(views, clo)``, a staging chunk's
        (offload: [Note: offload]) starting at element ``clo`` (a block bound)."""
        key = (i, b, lo, hi)
        run = self._runs.get(key)
        if run is None:  # made once per run of blocks (a new layout makes a new object)
            kb0, kb1 = self.block_of(i, b, lo), self.block_of(i, b, hi)
            starts = (self.starts[(i, b)][kb0 : kb1 + 1] - lo).contiguous()
            if torch.device(self.device).type == "cuda":
                # the kernel's binding takes the table on the host and copies it to the device
                # (non-blocking) on every call: from pinned memory that copy is a DMA queued on
                # the stream, from pageable memory a staged copy the host waits for
                starts = starts.pin_memory()
            run = (kb0, kb1, starts)
            self._runs[key] = run
        kb0, kb1, starts = run
        if staged is None:
            f = self.first_block[(i, b)]
            state = {
                "exp_avg": self.view(i, b, "exp_avg")[lo:hi],
                "exp_avg_sq": self.view(i, b, "exp_avg_sq")[lo:hi],
                "exp_avg_scale": self._whole(i, "exp_avg_scale")[f + kb0 : f + kb1],
                "exp_avg_sq_scale": self._whole(i, "exp_avg_sq_scale")[f + kb0 : f + kb1],
            }
        else:
            views, clo = staged
            c0 = self._runs.get((i, b, clo))  # the chunk's first block (cached with the runs)
            if c0 is None:
                c0 = self._runs[(i, b, clo)] = self.block_of(i, b, clo)
            state = {
                "exp_avg": views["exp_avg"][lo - clo : hi - clo],
                "exp_avg_sq": views["exp_avg_sq"][lo - clo : hi - clo],
                "exp_avg_scale": views["exp_avg_scale"][kb0 - c0 : kb1 - c0],
                "exp_avg_sq_scale": views["exp_avg_sq_scale"][kb0 - c0 : kb1 - c0],
            }
        lowbit.adam_step_lowbit(
            master,
            grad,
            state,
            hyper,
            state_dtype="int8",
            block=self.block,
            block_starts=starts,
            out_lowp=out_lowp,
            backend=backend,
        )

    # ---- resident: decoded to fp32 for the state's readers and writers
    def decoded_view(self, i: int, b: int, name: str) -> torch.Tensor:
        """While resident: bucket ``b``'s fp32 ``name`` (exp_avg or exp_avg_sq), decoded from
        the buffer's codes at first use (zeros where it has none yet); a held bucket's own
        decode where `decode_held` made one."""
        held = self.held_decoded.get((i, b))
        if held is not None:
            return held[name]
        t = self.decoded.get((i, name))
        if t is None:
            if (i, "exp_avg") in self.whole:
                m = torch.empty(self._shard_numel(i), device=self.device)
                v = torch.empty_like(m)
                for bk in self.layout.buffers[i].buckets:
                    el = self._elems(i, bk.index)
                    m[el], v[el] = self._decode_bucket(i, bk.index)
                self.decoded[(i, "exp_avg")], self.decoded[(i, "exp_avg_sq")] = m, v
            else:
                for nm in ("exp_avg", "exp_avg_sq"):
                    self.decoded[(i, nm)] = torch.zeros(self._shard_numel(i), device=self.device)
            t = self.decoded[(i, name)]
        return t[self._elems(i, b)]

    def _decode_bucket(self, i: int, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        st = {k: self.view(i, b, k) for k in INT8_KEYS}
        return lowbit.decode_state(st, "int8", self.block, self.starts[(i, b)])

    def flush(self) -> None:
        """Encode back every bucket whose decoded values differ from its codes' (decoded again,
        bucket by bucket), the decoded copy kept: after it, the codes are what a reader of the
        state sees (a checkpoint saves them)."""
        for i in {i for i, _ in self.decoded}:
            m, v = self.decoded[(i, "exp_avg")], self.decoded[(i, "exp_avg_sq")]
            had = (i, "exp_avg") in self.whole
            for b in self.layout.buffers[i].buckets:
                el = self._elems(i, b.index)
                if had:
                    m0, v0 = self._decode_bucket(i, b.index)
                    if torch.equal(m[el], m0) and torch.equal(v[el], v0):
                        continue  # unchanged: its codes and scales stay as they are
                out = {k: self.view(i, b.index, k) for k in INT8_KEYS}
                lowbit.encode_state(
                    m[el], v[el], "int8", self.block, out, self.starts[(i, b.index)]
                )

    def leave_resident(self) -> None:
        """`flush`, then the decoded copy dropped (the whole shard is decoded once at a time,
        8 bytes per element)."""
        try:
            self.flush()
        finally:
            self.decoded.clear()

    def take_piece(self, i: int, k: int, pc: Piece, lo: int, codes: dict) -> None:
        """Piece ``k``'s codes and scales set to ``codes`` (a checkpoint's, on the same blocks:
        the piece's own); its decoded values must be set to their decode too, so that leaving
        `resident` finds the bucket unchanged and keeps these codes."""
        for name, t in self.piece_views(i, k, pc, lo).items():
            if name in INT8_KEYS:
                t.copy_(codes[name])


def _cut(lo: int, hi: int, block: int) -> list[int]:
    """The ends of the blocks of segment ``[lo, hi)`` (each at most ``block`` long)."""
    return list(range(lo + block, hi, block)) + [hi]
