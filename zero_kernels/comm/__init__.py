"""Collectives: the only module of zero_kernels that calls ``torch.distributed``.

Every asynchronous collective returns a `Handle` holding the work object *and* the tensors it
reads and writes, so a caller cannot free a buffer that is still being communicated.

[Note: averaging]
Gradients are averaged exactly once. Where the backend's reduce-scatter takes ``ReduceOp.AVG``
(NCCL; gloo in recent torch) the native algorithm uses that op; otherwise, and always for the
point-to-point algorithms, the sum is divided by the world size when the handle is waited for.
`avg_supported` probes this once per process group.

The package: `base` (handles, counters, timeouts, the CUDA comm stream: [Note: CUDA streams]),
`p2p` (the point-to-point algorithms: [Note: algorithms]), `shm` (ranks of one host exchanging
through shared files: [Note: shared-memory collectives]), `hosts` (which ranks share a host,
proven: [Note: hosts are proven]), `choose` (which algorithm, and the
probe: [Note: choosing the algorithm]); the functions callers use are here.
"""

from __future__ import annotations

import datetime
from typing import NoReturn

import torch
import torch.distributed as dist

from . import hier, quant  # noqa: F401 - hierarchical sharding, quantized all-gather
from .base import (
    CollectiveTimeout,
    CommLog,
    Handle,
    Watch,
    _nbytes,
    _wait,
    avg_supported,
    backend_for,
    backends_of,
    choose_device,
    collective_device,
    comm_stream,
    is_initialized,
    parse_backends,
    rank,
    world_size,
)
from .choose import (
    ALGORITHMS,
    ENV_ALGO,
    _all_gather_with,
    _class_label,
    _reduce_scatter_with,
    _reset_choices,
    _size_class,
    choose_algorithm,
    probe_ahead,
    probe_results,
    register_twin,
    set_algorithm,
)
from .hosts import host_groups
from .links import learn as learn_hosts
from .p2p import free_scratch, scratch_bytes

__all__ = [
    "ALGORITHMS",
    "CollectiveTimeout",
    "CommLog",
    "ENV_ALGO",
    "Handle",
    "Watch",
    "all_gather",
    "all_reduce",
    "all_reduce_start",
    "avg_supported",
    "backend_for",
    "backends_of",
    "broadcast",
    "broadcast_object",
    "choose_algorithm",
    "choose_device",
    "collective_device",
    "probe_ahead",
    "comm_stream",
    "free_scratch",
    "gather_object",
    "host_groups",
    "is_initialized",
    "kv_store",
    "learn_hosts",
    "parse_backends",
    "probe_results",
    "rank",
    "reduce_scatter",
    "scratch_bytes",
    "set_algorithm",
    "world_size",
]
__all__ += ["_class_label", "_size_class"]  # tests read the size classes


def reduce_scatter(
    output: torch.Tensor,
    input: torch.Tensor,
    *,
    group=None,
    avg: bool = True,
    log: CommLog | None = None,
    timeout_s: float | None = None,
    what: str = "",
    watch: Watch | None = None,
    kind: str | None = "reduce_scatter",
) -> Handle:
    """Start ``output = reduce(input)[my chunk]`` (averaged when ``avg``); returns its handle.

    ``output`` may be this rank's own chunk of ``input`` (in place). The algorithm is chosen per
    group and size ([Note: choosing the algorithm]); ``log`` counts one collective whichever it is,
    under ``kind`` (None: only its bytes by link, [Note: bytes by link], for a part of another).
    ``timeout_s``, ``what`` and ``watch`` bound, name and watch what the launch itself may wait
    for, as `Handle.wait` does (only the shm algorithm waits at launch: a slot still in use).
    """
    n = world_size(group)
    _check_numel("reduce_scatter", output, input, n)
    if log is not None and kind is not None:
        log._add(kind, input)
    if n == 1:
        if output.data_ptr() != input.data_ptr():
            output.copy_(input)
        return Handle(None, (output, input), 1.0, log)
    algo = choose_algorithm("reduce_scatter", _nbytes(input), group=group, device=input.device)
    bound = (timeout_s, what, watch)
    return _reduce_scatter_with(algo, output, input, group, avg, log, bound)


def all_gather(
    output: torch.Tensor,
    input: torch.Tensor,
    *,
    group=None,
    log: CommLog | None = None,
    timeout_s: float | None = None,
    what: str = "",
    watch: Watch | None = None,
    kind: str | None = "all_gather",
) -> Handle:
    """Start ``output = cat(input of every rank)``; returns its handle.

    ``input`` may be this rank's own chunk of ``output`` (in place). The algorithm is chosen, and
    ``timeout_s``, ``what``, ``watch`` and ``kind`` apply, as for `reduce_scatter`.
    """
    n = world_size(group)
    _check_numel("all_gather", input, output, n)
    if log is not None and kind is not None:
        log._add(kind, output)
    if n == 1:
        if output.data_ptr() != input.data_ptr():
            output.copy_(input)
        return Handle(None, (output, input), 1.0, log)
    algo = choose_algorithm("all_gather", _nbytes(output), group=group, device=output.device)
    return _all_gather_with(algo, output, input, group, log, (timeout_s, what, watch))


def _check_numel(op: str, shard: torch.Tensor, full: torch.Tensor, n: int) -> None:
    if shard.numel() * n != full.numel():
        s, f = ("output", "input") if op == "reduce_scatter" else ("input", "output")
        raise ValueError(
            f"{op}: {s}.numel() * world_size must equal {f}.numel(); got {s}.shape="
            f"{tuple(shard.shape)}, {f}.shape={tuple(full.shape)}, world_size={n}"
        )


def all_reduce(
    t: torch.Tensor,
    op: str = "sum",
    *,
    group=None,
    log: CommLog | None = None,
    timeout_s: float | None = None,
    what: str = "",
    watch: Watch | None = None,
) -> torch.Tensor:
    """Blocking in-place all-reduce of a small tensor (norms, overflow flags); op sum or max;
    bounded by ``timeout_s`` and watched by ``watch`` as `Handle.wait`."""
    if log is not None:
        log.all_reduce_calls += 1
    if world_size(group) > 1:
        rop = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op]
        if watch is not None:
            work = dist.all_reduce(t, op=rop, group=group, async_op=True)
            Handle(work, (t,)).wait(timeout_s, what, watch)
        elif timeout_s is None:
            dist.all_reduce(t, op=rop, group=group)
        else:
            _wait(dist.all_reduce(t, op=rop, group=group, async_op=True), timeout_s, what)
    return t


def all_reduce_start(t: torch.Tensor, op: str = "sum", *, group=None) -> Handle:
    """Start an in-place all-reduce of ``t`` (op sum or max); the handle keeps ``t`` alive until
    it is waited for (or dropped once the collective completed)."""
    rop = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op]
    return Handle(dist.all_reduce(t, op=rop, group=group, async_op=True), (t,))


def all_reduce_future(t: torch.Tensor, *, group=None) -> torch.futures.Future:
    """Start an in-place sum all-reduce of ``t``; a future of ``t`` (what DDP comm hooks return)."""
    return dist.all_reduce(t, group=group, async_op=True).get_future().then(lambda f: f.value()[0])


_JOINED_HERE = False  # init() joined the default group in this process (the command's ranks)


def init(backend: str, rank: int, world_size: int, timeout_s: float) -> None:
    """Join the default process group (env:// rendezvous: MASTER_ADDR, MASTER_PORT) if not yet."""
    global _JOINED_HERE
    if not is_initialized():
        dist.init_process_group(
            backend,
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
        _JOINED_HERE = True


def joined_here() -> bool:
    """Whether `init` joined a process group in this process (a rank of the command)."""
    return _JOINED_HERE


def barrier(*, group=None) -> None:
    if world_size(group) > 1:
        dist.barrier(group=group)


def shutdown() -> None:
    """Leave the default process group."""
    if is_initialized():
        _reset_choices()
        dist.destroy_process_group()


def exit_process(code: int) -> NoReturn:
    """End this rank's process with ``code`` now: run the exit handlers (they unlink our
    shared-memory files and offload files, and join multiprocessing's queue feeders), flush
    stdout and stderr, and leave without the interpreter's finalization. For the command's rank
    processes only (the demo, tune), never called by the library.

    [Note: leaving a rank]
    gloo's worker threads drop a finished collective's work object a moment after the caller's
    wait returned; a barrier's work holds the works that were in flight when it was queued. A
    work that held a tensor made in Python gives the tensor's last reference back through the
    Python object, which needs the GIL. If the main thread has meanwhile reached the
    interpreter's finalization, the worker thread is ended while taking the GIL and the process
    aborts: "terminate called without an active exception" (core dump of a demo rank: thread
    ProcessGroupGloo::runLoop in ~AsyncBarrierWork -> ~AsyncGatherWork (gather_object's tensors)
    -> TensorImpl::decref_pyobject -> take_gil -> pthread_exit during Py_FinalizeEx; 1 exit in 33
    of a 2-rank demo, after destroy_process_group). torch PR 179291 describes the same abort.
    Leaving with os._exit once every result is written skips the finalization it races with.
    """
    import atexit
    import os
    import sys

    try:
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                if stream is not None:
                    stream.flush()
            except (OSError, ValueError):  # closed or gone: nothing left to write
                pass
        os._exit(code)


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
    # torch's fake group (tests at world size 8 in one process) has no gloo: a fake twin
    backend = None if is_fake(group) else "gloo"
    return dist.new_group(
        ranks=ranks, backend=backend, timeout=datetime.timedelta(seconds=timeout_s)
    )


def is_fake(group=None) -> bool:
    """Whether ``group`` is torch's fake process group (one process standing for every rank,
    as in tests; its collectives do nothing)."""
    return "fake" in backends_of(group).values()  # "fake", and "cpu:fake" alike


def twin_group(group=None, device: torch.device | str | None = None):
    """A second gloo group over the ranks of ``group``, with its timeout, where ``group`` runs
    the collectives of tensors on ``device`` (default: `collective_device`'s) on gloo:
    collectives on it form a sequence of their own (stage 3's reduce-scatters, see [Note:
    backward gathers] in `zero_kernels.partition.units`). ``group`` itself where that backend
    is not gloo (NCCL orders communicators together, so a twin would not separate the
    sequences; a gloo twin of "cuda:nccl,cpu:gloo" would get CUDA tensors: [Note: the
    collectives' device]) or it has one rank. Collective."""
    if world_size(group) == 1:
        return group
    dev = collective_device(group) if device is None else torch.device(device)
    if backend_for(group, dev) != "gloo":
        return group
    pg = group if group is not None else dist.group.WORLD
    try:
        timeout = pg._get_backend(torch.device("cpu")).options._timeout
    except (AttributeError, RuntimeError):  # older or other builds: the default
        timeout = None
    ranks = None if group is None else dist.get_process_group_ranks(group)
    twin = dist.new_group(ranks=ranks, backend="gloo", timeout=timeout)
    register_twin(twin, group)
    return twin


def check_arrival(side, what: str, timeout_s: float) -> None:
    """Every rank of ``side`` reaches this call within ``timeout_s``, or a RuntimeError that says
    ``what`` is collective (instead of a hang in the collective that follows)."""
    if side is None or is_fake(side):
        return
    try:
        dist.monitored_barrier(side, timeout=datetime.timedelta(seconds=timeout_s))
    except RuntimeError as e:
        raise RuntimeError(
            f"{what} is collective: every rank must call it, but not every rank arrived within "
            f"{timeout_s:g} s ({e})"
        ) from None


def kv_store():
    """The default process group's key-value store (TCPStore, FileStore...), or None."""
    try:
        return dist.distributed_c10d._get_default_store()
    except (AttributeError, RuntimeError, ValueError):
        return None


def group_or_world(group=None):
    """``group``, or the default (world) process group for ``None``."""
    return group if group is not None else dist.group.WORLD


def join_notify(joinable) -> int | None:
    """Inside ``torch.distributed.algorithms.Join``: tell the context this rank has not joined
    (the all-reduce Join's joined ranks match) and return how many ranks have not; else None."""
    from torch.distributed.algorithms.join import Join

    work = Join.notify_join_context(joinable)
    if work is None:
        return None
    work.wait()
    res = work.result()
    return int(res[0].item()) if res else None
