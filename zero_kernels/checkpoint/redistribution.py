"""Where a param's elements are when a checkpoint is loaded at another tensor-parallel size.

[Note: redistributing across tp sizes]
A checkpoint saved with tensor parallelism holds one *column* per tp rank
(``root/tp<c>-of-<n>/``, [Note: tensor parallelism] in zero_kernels/optimizer/tensor_parallel.py):
each the local tensors of its tp rank, sharded over dp. The *whole* tensor of a param is

- ``Shard(dim=k)``: the columns' local tensors concatenated along k, in column order;
- ``Replicate()``, and a plain (non-DTensor) param: column 0's local tensor;

and a checkpoint saved without tp is one column whose every param is whole. The loading rank at
tp size m, tp rank q needs its own local tensor of each param, cut from the whole one the same
way (``Shard(dim=k)``: rows ``[q G_k / m, (q + 1) G_k / m)`` along k; else the whole), and of it
only the element range of each of its ZeRO pieces. So for one piece ``[lo, lo + n)`` of a local
tensor of shape L::

    rows [lo // L', ceil((lo + n) / L'))  of dim 0 (L' = prod(L[1:]))   the piece's rows
      -> a box of the whole tensor                                       (+ q's start along k)
      -> per saved column that overlaps the box along its own dim: the box in its local
         coordinates, whose dim-0 rows are one flat element range of the saved local tensor
         (read from the pieces of its dp shards that overlap it, `load.read_range`)
      -> concatenated along the saved dim, flattened, the piece's elements taken

Each rank reads only the rows its pieces need, one piece (one param) at a time; the same
mapping serves the values (fp32 masters), every element-wise state entry (Adam's moments; int8
moments decoded) and a plain model (m = 1). Per-tensor state is column 0's where it is a
scalar (``step``), a column's own where the param is cut the same way on both sides, and
refused otherwise (Adafactor's factors of a slice are not those of another slice).

What is refused, with a `CheckpointError` naming the param, the saved placements and tp size,
and the loading ones: placements other than ``Shard``/``Replicate`` (``_StridedShard``,
``Partial``), uneven shards (a dim that the tp size does not divide: torch pads those), and a
whole shape the two sides do not agree on.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re

import torch

from .format import CheckpointError, read_meta, resolve, tp_columns

__all__ = [
    "ParamMap",
    "Split",
    "columns_to_redistribute",
    "param_map",
    "read_piece",
    "saved_split",
    "split_of",
]

_SHARD = re.compile(r"^Shard\(dim=(-?\d+)\)$")
_REPLICATE = "Replicate()"


@dataclasses.dataclass(frozen=True)
class Split:
    """How a whole tensor of ``shape`` is cut over a tp mesh: along ``dim`` (None: every column
    holds it whole) into ``sizes[c]`` elements starting at ``starts[c]``, per column c."""

    shape: tuple[int, ...]  # the whole tensor's
    dim: int | None
    starts: tuple[int, ...] = ()
    sizes: tuple[int, ...] = ()

    def local_shape(self, c: int) -> tuple[int, ...]:
        if self.dim is None:
            return self.shape
        s = list(self.shape)
        s[self.dim] = self.sizes[c]
        return tuple(s)


def _describe(placements, size: int) -> str:
    if placements is None:
        return f"a plain tensor (tp size {size})" if size > 1 else "without tensor parallelism"
    return f"placements {list(placements)} at tp size {size}"


def _dim_of(placements, ndim: int, what: str, where: str) -> int | None:
    """The Shard dim of ``placements`` (repr strings over a 1-D tp mesh), None for a whole
    tensor (Replicate, or a plain param: ``placements`` None)."""
    if placements is None:
        return None
    if len(placements) == 1:
        if placements[0] == _REPLICATE:
            return None
        m = _SHARD.match(placements[0])
        if m:
            k = int(m.group(1))
            k = k + ndim if k < 0 else k
            if 0 <= k < ndim:
                return k
    raise CheckpointError(
        where,
        f"{what}: placements {list(placements)} cannot be redistributed (Shard(dim=k) and "
        "Replicate() over a 1-D tp mesh can); load at the saved tp size and placements",
    )


def saved_split(placements, shapes: list[list[int]], what: str, where: str) -> Split:
    """The `Split` a save wrote: ``shapes[c]``, column c's local shape of the param;
    ``placements`` as meta.json records them (None: a plain param). ``what`` names the param
    (and both sides) in errors."""
    n = len(shapes)
    shapes = [tuple(s) for s in shapes]
    k = _dim_of(placements, len(shapes[0]), what, where)
    if k is None:
        if len(set(shapes)) != 1:
            raise CheckpointError(where, f"{what}: corrupt: the columns' shapes {shapes} differ")
        return Split(shapes[0], None)
    rest = {s[:k] + s[k + 1 :] for s in shapes}
    sizes = tuple(s[k] for s in shapes)
    if len(rest) != 1 or len(set(sizes)) != 1:
        raise CheckpointError(
            where,
            f"{what}: saved in local shapes {shapes}: uneven shards (torch pads them) cannot "
            f"be redistributed; load at tp size {n}",
        )
    whole = list(shapes[0])
    whole[k] = sum(sizes)
    return Split(tuple(whole), k, tuple(sizes[0] * c for c in range(n)), sizes)


def split_of(
    placements, size: int, shape: tuple[int, ...], local: tuple[int, ...], what: str, where: str
) -> Split:
    """The `Split` of a param of the loading model: whole shape ``shape``, this rank's local
    shape ``local``, over a tp mesh of ``size`` (``placements`` None: a plain param)."""
    k = _dim_of(placements, len(shape), what, where)
    if k is None:
        if tuple(local) != tuple(shape):
            raise CheckpointError(
                where, f"{what}: local shape {tuple(local)}, whole {tuple(shape)}"
            )
        return Split(tuple(shape), None)
    if shape[k] % size != 0 or local[k] != shape[k] // size:
        raise CheckpointError(
            where,
            f"{what}: dim {k} of the whole shape {tuple(shape)} (local {tuple(local)}) does "
            f"not split evenly over tp size {size}: torch pads uneven shards, they cannot be "
            "redistributed",
        )
    b = shape[k] // size
    return Split(tuple(shape), k, tuple(b * c for c in range(size)), (b,) * size)


@dataclasses.dataclass(frozen=True)
class ParamMap:
    """One param of the loading model and where its saved elements are: ``saved`` cut over
    the saved columns (``index[c]``: its index in column c's meta.json), ``target`` over the
    loading tp mesh, of which this rank holds column ``rank``'s part."""

    name: str
    saved: Split
    target: Split
    rank: int
    index: tuple[int, ...]
    describe: str  # "saved with <...>, loaded with <...>", for messages

    @property
    def same_cut(self) -> bool:
        """Each column holds what the loading rank of its number holds (per-tensor state of a
        local tensor stays valid)."""
        s, t = self.saved, self.target
        return s.dim == t.dim and s.starts == t.starts and s.sizes == t.sizes


def param_map(
    name: str,
    saved_placements,
    shapes: list[list[int]],
    index: list[int],
    placements,
    size: int,
    rank: int,
    shape: tuple[int, ...],
    local: tuple[int, ...],
    where: str,
) -> ParamMap:
    """`ParamMap` of param ``name``: saved with ``saved_placements`` in column local shapes
    ``shapes``, loaded with ``placements`` over tp ``size`` (this rank ``rank``, whole shape
    ``shape``, local ``local``). Raises a `CheckpointError` naming the param and both sides
    where it cannot be redistributed (see `saved_split`, `split_of`) or the whole shapes
    differ."""
    desc = (
        f"saved with {_describe(saved_placements, len(shapes))}, loaded with "
        f"{_describe(placements, size)}"
    )
    what = f"param {name} ({desc})"
    s = saved_split(saved_placements, shapes, what, where)
    t = split_of(placements, size, shape, local, what, where)
    if s.shape != t.shape:
        raise CheckpointError(
            where,
            f"{what}: the saved columns (local shapes {[tuple(x) for x in shapes]}) make a "
            f"whole tensor of shape {s.shape}, the model's is {t.shape}",
        )
    return ParamMap(name, s, t, rank, tuple(index), desc)


def read_piece(pm: ParamMap, read_flat, lo: int, n: int, out: torch.Tensor) -> None:
    """Elements ``[lo, lo + n)`` of this rank's local tensor of ``pm`` (one key: values or one
    state entry) into 1-D ``out``. ``read_flat(c, a, k)`` returns elements ``[a, a + k)`` of
    saved column c's flattened local tensor. See [Note: redistributing across tp sizes]."""
    if n == 0:
        return
    local = pm.target.local_shape(pm.rank)
    if not local:  # a 0-dim param: its one element, in every column
        out.copy_(read_flat(0, 0, 1).reshape(-1)[lo : lo + n])
        return
    inner = math.prod(local[1:])
    r0, r1 = lo // inner, -(-(lo + n) // inner)
    box = [(r0, r1)] + [(0, x) for x in local[1:]]
    if pm.target.dim is not None:  # the rank's part, in the whole tensor's coordinates
        k, a = pm.target.dim, pm.target.starts[pm.rank]
        box[k] = (box[k][0] + a, box[k][1] + a)
    block = _read_box(pm.saved, read_flat, box)
    out.copy_(block.reshape(-1)[lo - r0 * inner : lo - r0 * inner + n])


def _read_box(s: Split, read_flat, box: list[tuple[int, int]]) -> torch.Tensor:
    """The box ``box`` (a range per dim) of the whole tensor, from the saved columns."""
    if s.dim is None:
        return _read_local(s.local_shape(0), 0, read_flat, box)
    k, parts = s.dim, []
    for c, (a, size) in enumerate(zip(s.starts, s.sizes)):
        lo, hi = max(box[k][0], a), min(box[k][1], a + size)
        if hi <= lo:
            continue
        mine = list(box)
        mine[k] = (lo - a, hi - a)
        parts.append(_read_local(s.local_shape(c), c, read_flat, mine))
    return torch.cat(parts, dim=k)


def _read_local(shape: tuple[int, ...], c: int, read_flat, box) -> torch.Tensor:
    """Box ``box`` of column c's local tensor (of ``shape``): its dim-0 rows read as one flat
    range, the other dims cut after."""
    inner = math.prod(shape[1:])
    (a0, b0), rest = box[0], box[1:]
    rows = read_flat(c, a0 * inner, (b0 - a0) * inner).view(b0 - a0, *shape[1:])
    return rows[(slice(None), *(slice(a, b) for a, b in rest))]


def columns_to_redistribute(path: str, tp: dict | None, placements: dict) -> list[str] | None:
    """The columns' directories a load at tensor parallelism ``tp`` (the adapter's: size,
    rank; None without tp) must redistribute from, or None where the load is the ordinary one
    (the saved tp size and placements are the loading model's, or neither has tp).
    ``placements``: name -> the loading model's placements. A root saved without tp is one
    column (itself)."""
    root = os.path.abspath(os.fspath(path))
    if tp is not None:
        mine = os.path.join(root, f"tp{tp['rank']}-of-{tp['size']}")
        if os.path.isdir(mine):
            meta = read_meta(resolve(mine))
            saved = (meta.get("tensor_parallel") or {}).get("placements", {})
            if saved == placements:
                return None
            return tp_columns(root)
        return tp_columns(root) or [root]
    return tp_columns(root) or None
