"""Collectives: the only module of zero_kernels that calls ``torch.distributed``.

Every asynchronous collective returns a `Handle` holding the work object *and* the tensors it
reads and writes, so a caller cannot free a buffer that is still being communicated.

[Note: averaging]
Gradients are averaged exactly once. Where the backend's reduce-scatter takes ``ReduceOp.AVG``
(NCCL; gloo in recent torch) that op is used; otherwise the sum is divided by the world size when
the handle is waited for. `avg_supported` probes this once per process group.
"""

from __future__ import annotations

import datetime
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

__all__ = [
    "CommLog",
    "Handle",
    "all_gather",
    "all_reduce",
    "avg_supported",
    "broadcast",
    "broadcast_object",
    "gather_object",
    "is_initialized",
    "rank",
    "reduce_scatter",
    "world_size",
]

# One compatibility point for the tensor collectives' names (new names first).
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass
class CommLog:
    """Counters of the collectives one optimizer issued (bytes are of the full input/output)."""

    reduce_scatter_bytes: int = 0
    all_gather_bytes: int = 0
    reduce_scatter_calls: int = 0
    all_gather_calls: int = 0
    all_reduce_calls: int = 0
    exposed_comm_s: float = 0.0  # time spent waiting on collectives after they were issued
    sizes: list = field(default_factory=list)  # (kind, numel, dtype) of every call, when traced
    trace: bool = False

    def as_dict(self) -> dict:
        return {
            k: getattr(self, k)
            for k in (
                "reduce_scatter_bytes",
                "all_gather_bytes",
                "reduce_scatter_calls",
                "all_gather_calls",
                "all_reduce_calls",
                "exposed_comm_s",
            )
        }

    def reset(self) -> None:
        for k, v in CommLog().as_dict().items():
            setattr(self, k, v)
        self.sizes.clear()

    def _add(self, kind: str, t: torch.Tensor) -> None:
        nbytes = t.numel() * t.element_size()
        setattr(self, f"{kind}_bytes", getattr(self, f"{kind}_bytes") + nbytes)
        setattr(self, f"{kind}_calls", getattr(self, f"{kind}_calls") + 1)
        if self.trace:
            self.sizes.append((kind, t.numel(), t.dtype))


class Handle:
    """An issued collective: ``wait()`` finishes it (and applies a pending division)."""

    __slots__ = ("work", "tensors", "divide", "log", "done")

    def __init__(self, work, tensors: tuple, divide: float = 1.0, log: CommLog | None = None):
        self.work = work
        self.tensors = tensors  # kept alive until waited for; tensors[0] is the output
        self.divide = divide
        self.log = log
        self.done = False

    def wait(self) -> torch.Tensor:
        if not self.done:
            t0 = time.perf_counter()
            if self.work is not None:
                self.work.wait()
            if self.divide != 1.0:
                self.tensors[0].div_(self.divide)
            if self.log is not None:
                self.log.exposed_comm_s += time.perf_counter() - t0
            self.done = True
        return self.tensors[0]


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def world_size(group=None) -> int:
    return dist.get_world_size(group) if is_initialized() else 1


def rank(group=None) -> int:
    return dist.get_rank(group) if is_initialized() else 0


_avg_ok: dict = {}


def avg_supported(group=None) -> bool:
    """Whether reduce-scatter with ``ReduceOp.AVG`` works on ``group`` (probed once, collective)."""
    key = id(group)
    if key not in _avg_ok:
        n = world_size(group)
        ok = True
        try:
            x = torch.ones(n, device=_device(group))
            out = torch.empty(1, device=x.device)
            _reduce_scatter(out, x, op=dist.ReduceOp.AVG, group=group)
            ok = bool(out.item() == 1.0)
        except Exception:
            ok = False
        _avg_ok[key] = ok
    return _avg_ok[key]


def _device(group=None) -> torch.device:
    backend = dist.get_backend(group)
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def reduce_scatter(
    output: torch.Tensor,
    input: torch.Tensor,
    *,
    group=None,
    avg: bool = True,
    log: CommLog | None = None,
) -> Handle:
    """Start ``output = reduce(input)[my shard]`` (averaged when ``avg``); returns its handle."""
    n = world_size(group)
    if log is not None:
        log._add("reduce_scatter", input)
    if n == 1:
        if output.data_ptr() != input.data_ptr():
            output.copy_(input)
        return Handle(None, (output, input), 1.0, log)
    if avg and avg_supported(group):
        work = _reduce_scatter(output, input, op=dist.ReduceOp.AVG, group=group, async_op=True)
        return Handle(work, (output, input), 1.0, log)
    work = _reduce_scatter(output, input, op=dist.ReduceOp.SUM, group=group, async_op=True)
    return Handle(work, (output, input), float(n) if avg else 1.0, log)


def all_gather(
    output: torch.Tensor, input: torch.Tensor, *, group=None, log: CommLog | None = None
) -> Handle:
    """Start ``output = cat(input of every rank)``; returns its handle."""
    if log is not None:
        log._add("all_gather", output)
    if world_size(group) == 1:
        if output.data_ptr() != input.data_ptr():
            output.copy_(input)
        return Handle(None, (output, input), 1.0, log)
    work = _all_gather(output, input, group=group, async_op=True)
    return Handle(work, (output, input), 1.0, log)


def all_reduce(
    t: torch.Tensor, op: str = "sum", *, group=None, log: CommLog | None = None
) -> torch.Tensor:
    """Blocking in-place all-reduce of a small tensor (norms, overflow flags); op sum or max."""
    if log is not None:
        log.all_reduce_calls += 1
    if world_size(group) > 1:
        dist.all_reduce(t, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op], group=group)
    return t


def all_reduce_future(t: torch.Tensor, *, group=None) -> torch.futures.Future:
    """Start an in-place sum all-reduce of ``t``; a future of ``t`` (what DDP comm hooks return)."""
    return dist.all_reduce(t, group=group, async_op=True).get_future().then(lambda f: f.value()[0])


def init(backend: str, rank: int, world_size: int, timeout_s: float) -> None:
    """Join the default process group (env:// rendezvous: MASTER_ADDR, MASTER_PORT) if not yet."""
    if not is_initialized():
        dist.init_process_group(
            backend,
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
        )


def barrier(*, group=None) -> None:
    if world_size(group) > 1:
        dist.barrier(group=group)


def shutdown() -> None:
    """Leave the default process group."""
    if is_initialized():
        dist.destroy_process_group()


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


def side_group(group=None, timeout_s: float = 300.0):
    """A gloo group over the ranks of ``group`` for agreement checks with a timeout of their own
    (`check_arrival`); None at world size 1. Collective."""
    if world_size(group) == 1:
        return None
    ranks = None if group is None else dist.get_process_group_ranks(group)
    return dist.new_group(
        ranks=ranks, backend="gloo", timeout=datetime.timedelta(seconds=timeout_s)
    )


def check_arrival(side, what: str, timeout_s: float) -> None:
    """Every rank of ``side`` reaches this call within ``timeout_s``, or a RuntimeError that says
    ``what`` is collective (instead of a hang in the collective that follows)."""
    if side is None:
        return
    try:
        dist.monitored_barrier(side, timeout=datetime.timedelta(seconds=timeout_s))
    except RuntimeError as e:
        raise RuntimeError(
            f"{what} is collective: every rank must call it, but not every rank arrived within "
            f"{timeout_s:g} s ({e})"
        ) from None
