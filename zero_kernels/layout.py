"""Layout of the flat buffers: which parameter lives where, which rank owns which range. Pure data.

[Note: layout]
Parameters that train (``requires_grad``, deduplicated: a tied parameter is one parameter) are
grouped by (param group, dtype); each such set becomes one *flat buffer*. Inside a buffer the
parameters are laid out in reverse registration order, the order autograd usually produces their
gradients, each start aligned to ``align`` elements. The buffer is cut into *buckets* of about
``bucket_numel`` elements; a bucket's end is padded so that its length is a multiple of
``world_size * align``: it splits into ``world_size`` equal contiguous *shards*, and rank r's
shard of bucket b is ``[b.start + r * b.shard_numel, b.start + (r + 1) * b.shard_numel)``.
A rank's whole shard of a buffer is its shard of every bucket, concatenated in bucket order, so
the shard of bucket b starts at ``b.start // world_size`` inside it.

Two partition modes share this one layout type:

- ``flat``: parameters are contiguous and may straddle shard boundaries; element-wise
  optimizers run on the flat shard.
- ``whole``: inside each bucket the parameters are assigned to ranks (largest first to the least
  loaded rank, counting the whole model so far), each rank's parameters are packed into its
  shard and the shard length is the largest rank's: every parameter lies wholly inside one
  rank's shard, so an optimizer that needs whole tensors sees them whole on their owner.

Both modes reduce-scatter and all-gather the same way, one collective per bucket.

    buffer (flat mode, world 2):   |p3 p3 p3 p2 p2|p1 p1 p1 p0 . |  ('.' = padding)
                                   |---- bucket 0 -|-- bucket 1 -|
                                   | r0  | r1     | r0  | r1    |
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

MODES = ("flat", "whole")


@dataclass(frozen=True)
class ParamSpec:
    """What the layout needs to know about one parameter (no tensor)."""

    index: int  # position among the optimizer's parameters, counting across groups in order
    group: int  # param group index
    dtype: str  # e.g. "torch.float32"
    shape: tuple[int, ...]
    name: str = ""
    requires_grad: bool = True
    unit: int = -1  # stage 3: the unit (see [Note: units]); -1: none

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


def is_vector(shape) -> bool:
    """A param of one dimension or none (a norm's gain, a bias): kept exact by quantized
    communication ([Note: quantized all-gather] in `zero_kernels.comm.quant`)."""
    return len(shape) <= 1


@dataclass(frozen=True)
class Slot:
    """One parameter's range ``[start, start + numel)`` inside its flat buffer."""

    index: int  # ParamSpec.index
    name: str
    shape: tuple[int, ...]
    start: int
    numel: int
    bucket: int  # index of the bucket holding the whole range
    owner: int = -1  # whole mode: the rank whose shard holds the whole range; flat mode: -1

    @property
    def end(self) -> int:
        return self.start + self.numel


@dataclass(frozen=True)
class Bucket:
    """``[start, start + world_size * shard_numel)`` of a flat buffer, reduced as one collective."""

    index: int
    start: int
    shard_numel: int  # length of each rank's equal contiguous shard
    slots: tuple[int, ...]  # positions in FlatBuffer.slots of the parameters inside

    def numel(self, world_size: int) -> int:
        return self.shard_numel * world_size

    def shard_start(self, rank: int) -> int:
        """Start of ``rank``'s shard inside the flat buffer."""
        return self.start + rank * self.shard_numel


@dataclass(frozen=True)
class FlatBuffer:
    """One flat buffer: the trainable parameters of one (param group, dtype)."""

    group: int
    dtype: str
    numel: int  # padded total, a multiple of world_size
    slots: tuple[Slot, ...]
    buckets: tuple[Bucket, ...]

    def shard_numel(self, world_size: int) -> int:
        """Length of one rank's shard of the whole buffer."""
        return self.numel // world_size

    def owners(self, slot: Slot, world_size: int) -> list[tuple[int, int, int]]:
        """``(rank, offset in slot, length)`` for each rank's share of ``slot``."""
        b = self.buckets[slot.bucket]
        out = []
        for r in range(world_size):
            lo = max(slot.start, b.shard_start(r))
            hi = min(slot.end, b.shard_start(r) + b.shard_numel)
            if hi > lo:
                out.append((r, lo - slot.start, hi - lo))
        return out


@dataclass(frozen=True)
class Layout:
    """Every flat buffer of one optimizer at one world size."""

    world_size: int
    mode: str
    align: int
    buffers: tuple[FlatBuffer, ...]
    frozen: tuple[int, ...] = field(default=())  # indices of params that do not train

    def to_dict(self) -> dict:
        return asdict(self)

    @staticmethod
    def from_dict(d: dict) -> Layout:
        bufs = []
        for b in d["buffers"]:
            slots = tuple(Slot(**{**s, "shape": tuple(s["shape"])}) for s in b["slots"])
            buckets = tuple(Bucket(**{**k, "slots": tuple(k["slots"])}) for k in b["buckets"])
            bufs.append(FlatBuffer(b["group"], b["dtype"], b["numel"], slots, buckets))
        return Layout(d["world_size"], d["mode"], d["align"], tuple(bufs), tuple(d["frozen"]))


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def build_layout(
    specs: Sequence[ParamSpec],
    world_size: int,
    *,
    bucket_numel: int,
    mode: str = "flat",
    align: int = 16,
    by_unit: bool = False,
    vectors_apart: bool = False,
) -> Layout:
    """Lay out ``specs`` (in registration order) for ``world_size`` ranks; see [Note: layout].
    ``by_unit``: buckets follow units instead of sizes (stage 3: a bucket holds one unit's
    params only, and a unit's params in one buffer are one bucket). ``vectors_apart`` (buckets
    by size): the params of one dimension or none in buckets of their own, after the others'
    (quantized gradients leave those buckets exact: [Note: quantized reduce-scatter])."""
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got world_size={world_size!r}")
    if bucket_numel < 1:
        raise ValueError(f"bucket_numel must be >= 1, got bucket_numel={bucket_numel!r}")
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got mode={mode!r}")
    if align < 1:
        raise ValueError(f"align must be >= 1, got align={align!r}")
    keys: list[tuple[int, str]] = []
    members: dict[tuple[int, str], list[ParamSpec]] = {}
    for s in specs:
        if not s.requires_grad:
            continue
        k = (s.group, s.dtype)
        if k not in members:
            keys.append(k)
            members[k] = []
        members[k].append(s)
    load = [0] * world_size  # whole mode: elements owned per rank so far, across buffers
    buffers = []
    for k in sorted(keys, key=lambda k: (k[0], keys.index(k))):
        ordered = list(reversed(members[k]))
        if by_unit:  # each unit's params together, units in reverse order of first param
            first: dict[int, int] = {}
            for pos, s in enumerate(ordered):
                first.setdefault(s.unit, pos)
            ordered.sort(key=lambda s: first[s.unit])
            groups = _cut_units(ordered)
        elif vectors_apart:
            big = [s for s in ordered if not is_vector(s.shape)]
            small = [s for s in ordered if is_vector(s.shape)]
            groups = _cut(big, bucket_numel, align) + _cut(small, bucket_numel, align)
        else:
            groups = _cut(ordered, bucket_numel, align)
        if mode == "flat":
            buffers.append(_flat_buffer(k, groups, world_size, align))
        else:
            buffers.append(_whole_buffer(k, groups, world_size, align, load))
    frozen = tuple(s.index for s in specs if not s.requires_grad)
    return Layout(world_size, mode, align, tuple(buffers), frozen)


def _cut(ordered: list[ParamSpec], bucket_numel: int, align: int) -> list[list[ParamSpec]]:
    """Split params (in arrival order) into consecutive groups of about ``bucket_numel``."""
    out: list[list[ParamSpec]] = []
    cur: list[ParamSpec] = []
    size = 0
    for s in ordered:
        cur.append(s)
        size += _round_up(s.numel, align)
        if size >= bucket_numel:
            out.append(cur)
            cur, size = [], 0
    if cur:
        out.append(cur)
    return out


def _cut_units(ordered: list[ParamSpec]) -> list[list[ParamSpec]]:
    """One group per unit (``ordered`` has each unit's params together)."""
    out: list[list[ParamSpec]] = []
    for s in ordered:
        if out and out[-1][0].unit == s.unit:
            out[-1].append(s)
        else:
            out.append([s])
    return out


def _flat_buffer(key, groups, world_size: int, align: int) -> FlatBuffer:
    slots: list[Slot] = []
    buckets: list[Bucket] = []
    pos = 0
    for bi, members in enumerate(groups):
        start = pos
        idx = []
        for s in members:
            idx.append(len(slots))
            slots.append(Slot(s.index, s.name, tuple(s.shape), pos, s.numel, bi))
            pos += _round_up(s.numel, align)
        length = _round_up(max(pos - start, 1), world_size * align)
        buckets.append(Bucket(bi, start, length // world_size, tuple(idx)))
        pos = start + length
    return FlatBuffer(key[0], key[1], pos, tuple(slots), tuple(buckets))


def _whole_buffer(key, groups, world_size: int, align: int, load: list[int]) -> FlatBuffer:
    slots: list[Slot] = []
    buckets: list[Bucket] = []
    pos = 0
    for bi, members in enumerate(groups):
        per_rank: list[list[ParamSpec]] = [[] for _ in range(world_size)]
        fill = [0] * world_size
        # Largest first to the rank owning the least so far (model-wide), ties to the lower rank.
        for s in sorted(members, key=lambda s: -s.numel):
            r = min(range(world_size), key=lambda r: (load[r], fill[r], r))
            per_rank[r].append(s)
            fill[r] += _round_up(s.numel, align)
            load[r] += s.numel
        shard = _round_up(max(max(fill), 1), align)
        start = pos
        idx = []
        for r in range(world_size):
            p = start + r * shard
            for s in sorted(per_rank[r], key=lambda s: -s.index):  # keep arrival order inside
                idx.append(len(slots))
                slots.append(Slot(s.index, s.name, tuple(s.shape), p, s.numel, bi, r))
                p += _round_up(s.numel, align)
        buckets.append(Bucket(bi, start, shard, tuple(idx)))
        pos = start + shard * world_size
    return FlatBuffer(key[0], key[1], pos, tuple(slots), tuple(buckets))


@dataclass(frozen=True)
class Piece:
    """The part of one parameter inside one rank's shard: what that rank's optimizer steps.

    Flat mode: the intersection of the parameter's range with the rank's shard of its bucket
    (at most one per parameter and rank); whole mode: the whole parameter on its owner. A
    zero-size parameter has one empty piece, on rank 0 (flat) or its owner (whole), so that its
    optimizer state exists exactly as in the unsharded optimizer.
    """

    buffer: int  # index in Layout.buffers
    bucket: int  # index in FlatBuffer.buckets
    slot: int  # position in FlatBuffer.slots
    index: int  # ParamSpec.index of the parameter
    start: int  # first element inside the flat buffer
    numel: int
    offset: int  # first element inside the parameter (flattened)
    whole: bool  # the piece is the whole parameter (then it is viewed with its shape)


def pieces(layout: Layout, rank: int) -> tuple[tuple[Piece, ...], ...]:
    """Per buffer, ``rank``'s pieces in flat-buffer order (see `Piece`)."""
    out = []
    for bi, buf in enumerate(layout.buffers):
        mine = []
        for pos, s in enumerate(buf.slots):
            b = buf.buckets[s.bucket]
            lo_r, hi_r = b.shard_start(rank), b.shard_start(rank) + b.shard_numel
            if s.numel == 0:
                owner = s.owner if s.owner >= 0 else 0
                if owner == rank:
                    mine.append(Piece(bi, s.bucket, pos, s.index, lo_r, 0, 0, True))
                continue
            lo, hi = max(s.start, lo_r), min(s.end, hi_r)
            if hi > lo:
                whole = lo == s.start and hi == s.end
                mine.append(Piece(bi, s.bucket, pos, s.index, lo, hi - lo, lo - s.start, whole))
        out.append(tuple(mine))
    return tuple(out)


def shard_bytes(layout: Layout, rank: int, itemsize: int) -> int:
    """Bytes of ``rank``'s shard over every buffer at ``itemsize`` bytes per element."""
    del rank  # shards are equal by construction
    return sum(b.shard_numel(layout.world_size) for b in layout.buffers) * itemsize


def bucket_gaps(buf: FlatBuffer, bucket: Bucket, world_size: int) -> list[tuple[int, int]]:
    """The ranges of ``bucket`` that hold no parameter (alignment and shard padding), as
    [lo, hi) offsets from the bucket's start, in order."""
    gaps, pos = [], 0
    for s in sorted((buf.slots[k] for k in bucket.slots), key=lambda s: s.start):
        if s.start - bucket.start > pos:
            gaps.append((pos, s.start - bucket.start))
        pos = max(pos, s.end - bucket.start)
    n = bucket.numel(world_size)
    if n > pos:
        gaps.append((pos, n))
    return gaps


__all__ = [
    "MODES",
    "Bucket",
    "FlatBuffer",
    "Layout",
    "ParamSpec",
    "Piece",
    "Slot",
    "bucket_gaps",
    "build_layout",
    "pieces",
    "shard_bytes",
]
