"""Object and broadcast collectives (small picklable values, a tensor from one rank): plain
``torch.distributed`` calls over a group's ranks, below everything else in comm that needs them
(`hosts` proves hosts with them)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from .groups import rank, world_size

__all__ = ["all_gather_object", "broadcast", "broadcast_object", "gather_object"]


def gather_object(obj, dst: int, *, group=None) -> list | None:
    """Every rank's ``obj`` on ``dst`` (a group rank), None elsewhere."""
    n = world_size(group)
    if n == 1:
        return [obj]
    out = [None] * n if rank(group) == dst else None
    gdst = dist.get_global_rank(group, dst) if group is not None else dst
    dist.gather_object(obj, out, dst=gdst, group=group)
    return out


def broadcast_object(obj, src: int, *, group=None):
    """``obj`` of ``src`` (a group rank) on every rank."""
    if world_size(group) == 1:
        return obj
    box = [obj]
    gsrc = dist.get_global_rank(group, src) if group is not None else src
    dist.broadcast_object_list(box, src=gsrc, group=group)
    return box[0]


def broadcast(t: torch.Tensor, src: int = 0, *, group=None) -> torch.Tensor:
    """Blocking in-place broadcast of ``t`` from ``src`` (a group rank)."""
    if world_size(group) > 1:
        gsrc = dist.get_global_rank(group, src) if group is not None else src
        dist.broadcast(t, src=gsrc, group=group)
    return t


def all_gather_object(obj, *, group=None) -> list:
    """Every rank's ``obj`` (small, picklable), on every rank."""
    n = world_size(group)
    if n == 1:
        return [obj]
    out = [None] * n
    dist.all_gather_object(out, obj, group=group)
    return out
