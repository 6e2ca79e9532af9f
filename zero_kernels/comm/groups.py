"""The process groups as comm sees them: size and rank, the key of a group's state in comm's
caches, its backend per device type and the device its collectives run on. The lowest layer of
`zero_kernels.comm`: it imports nothing of comm.

[Note: the collectives' device]
Which device a group's collectives run on is decided in one place, `collective_device`, from
the params and the group's backend per device type (``get_backend_config``: "cpu:gloo,cuda:nccl"),
never from the backend's name: ``init_process_group()`` without a backend is named "undefined"
(torch picks one per device), and "cuda:nccl,cpu:gloo" names both. The params' device wins,
checked against the group (CUDA params with a group that has no CUDA backend: a ValueError
naming both); params on the meta device (a stage-3 model built there) go to CUDA
(``torch.cuda.current_device()``) where the group has a CUDA backend and CUDA is available, else
to the CPU. What depends on the backend (the algorithm choice, the AVG probe, the twin group of
stage 3's reduce-scatters, the byte counts by link) asks `backend_for` the backend of the
tensors' device: on "cpu:gloo,cuda:nccl" gloo's point-to-point algorithms and twin groups serve
CPU tensors, never CUDA ones (a gloo twin handed CUDA tensors fails).

[Note: group keys]
State kept per process group (the AVG check, the probe's results and `set_algorithm`'s choices,
a twin's link to its parent, the point-to-point tag counters) is keyed by `group_key`: a token
drawn once per group object, never drawn again in this process, and the group's size. Not by
``id(group)``: once a group is destroyed and its object freed, CPython gives the address to the
next object, possibly the next group, on one rank and not on another, and a new group would find
the old one's entries on that rank only: a probe run there and skipped elsewhere, collectives
that meet others (seen: a construction hung; gloo aborts on the sizes). The tokens live in a
`weakref.WeakKeyDictionary` (an entry goes with its group object); where a group type takes no
weak reference, the entry holds the group, so its id cannot be reused while it is there (as the
shm channel holds its group). The entries of a destroyed group stay (a few small values).
"""

from __future__ import annotations

import itertools
import threading
import weakref

import torch
import torch.distributed as dist

__all__ = [
    "backend_for",
    "backends_of",
    "choose_device",
    "collective_device",
    "group_key",
    "group_or_world",
    "group_ranks",
    "is_fake",
    "is_initialized",
    "parse_backends",
    "rank",
    "world_size",
]


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def world_size(group=None) -> int:
    return dist.get_world_size(group) if is_initialized() else 1


def rank(group=None) -> int:
    return dist.get_rank(group) if is_initialized() else 0


def group_ranks(group=None) -> list[int]:
    """The global ranks of ``group`` (None: the world), in group-rank order."""
    if not is_initialized():
        return [0]
    if group is None:
        return list(range(dist.get_world_size()))
    return list(dist.get_process_group_ranks(group))


_tokens: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # group -> its token
_held: dict = {}  # id(group) -> (group, token), for groups that take no weak reference
_token_count = itertools.count(1)
_token_lock = threading.Lock()


def group_key(group=None) -> tuple:
    """The key of ``group``'s state in comm's caches (``None``: the default group): its token
    and size; a group made after another was destroyed never gets the other's key, whatever
    its id (see [Note: group keys])."""
    pg = dist.group.WORLD if group is None and is_initialized() else group
    if pg is None:  # no process group
        return (0, 1)
    with _token_lock:
        try:
            tok = _tokens.get(pg)
            if tok is None:
                tok = _tokens[pg] = next(_token_count)
        except TypeError:  # no weak references to this group type: held, compared by identity
            held = _held.get(id(pg))
            if held is None or held[0] is not pg:
                held = _held[id(pg)] = (pg, next(_token_count))
            tok = held[1]
    return (tok, world_size(group))


def backends_of(group=None) -> dict[str, str]:
    """``group``'s backend for each device type it serves, e.g. ``{"cpu": "gloo", "cuda":
    "nccl"}`` ([Note: the collectives' device]); empty without a process group."""
    if not is_initialized():
        return {}
    try:
        config = dist.get_backend_config(group)
    except (AttributeError, RuntimeError, ValueError):  # older torch: the name alone
        config = str(dist.get_backend(group))
    return parse_backends(config)


def parse_backends(config: str) -> dict[str, str]:
    """``"cpu:gloo,cuda:nccl"`` -> ``{"cpu": "gloo", "cuda": "nccl"}``; a bare name (``"nccl"``)
    serves the device types torch lists for it (``Backend.backend_capability``)."""
    caps = getattr(dist.Backend, "backend_capability", {})
    out: dict[str, str] = {}
    for part in str(config).split(","):
        part = part.strip().lower()
        if ":" in part:
            dev, name = part.split(":", 1)
            out[dev.strip()] = name.strip()
        elif part and part != "undefined":
            for dev in caps.get(part, ("cpu", "cuda") if part == "gloo" else ("cuda",)):
                out.setdefault(dev, part)
    return out


def choose_device(
    backends: dict[str, str],
    params_device: torch.device | str | None,
    *,
    cuda_available: bool,
    current_cuda: int = 0,
) -> torch.device:
    """The device the collectives of params on ``params_device`` run on, for a group with
    ``backends`` (`backends_of`): that device, where the group has a backend for it, else a
    ValueError naming both; for ``None`` (params built on the meta device) CUDA device
    ``current_cuda`` where the group has a CUDA backend and ``cuda_available``, else the CPU.
    Pure ([Note: the collectives' device])."""
    if not backends:  # no process group: wherever the params are
        return torch.device("cpu") if params_device is None else torch.device(params_device)
    shown = ",".join(f"{d}:{b}" for d, b in backends.items())
    if params_device is not None:
        dev = torch.device(params_device)
        if dev.type not in backends:
            hint = dist.Backend.default_device_backend_map.get(dev.type, "gloo")
            raise ValueError(
                f"params on {dev} but the process group has no backend for {dev.type} tensors "
                f"(its backends: {shown!r}): init_process_group with one for {dev.type} "
                f"(e.g. backend={hint!r} or '{dev.type}:{hint},...'), or move the params"
            )
        return dev
    if "cuda" in backends and cuda_available:
        return torch.device("cuda", current_cuda)
    if "cpu" in backends:
        return torch.device("cpu")
    raise ValueError(
        f"params on the meta device and the process group's backends ({shown!r}) serve no "
        f"device here (CUDA available: {cuda_available}): build the model on a device, or use "
        "a group with a backend for the CPU or (on a GPU node) for CUDA"
    )


def collective_device(group=None, params_device: torch.device | str | None = None) -> torch.device:
    """`choose_device` for ``group`` in this process: the one place that decides the device of
    collectives, their probes and meta-built models ([Note: the collectives' device])."""
    backends = backends_of(group)
    cuda = params_device is None and "cuda" in backends and torch.cuda.is_available()
    return choose_device(
        backends,
        params_device,
        cuda_available=cuda,
        current_cuda=torch.cuda.current_device() if cuda else 0,
    )


def backend_for(group, device: torch.device | str) -> str | None:
    """The name of ``group``'s backend for tensors on ``device`` ("gloo", "nccl"...); None where
    it has none, or without a process group."""
    return backends_of(group).get(torch.device(device).type)


def is_fake(group=None) -> bool:
    """Whether ``group`` is torch's fake process group (one process standing for every rank,
    as in tests; its collectives do nothing)."""
    return "fake" in backends_of(group).values()  # "fake", and "cpu:fake" alike


def group_or_world(group=None):
    """``group``, or the default (world) process group for ``None``."""
    return group if group is not None else dist.group.WORLD
