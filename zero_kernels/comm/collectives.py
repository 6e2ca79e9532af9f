"""The collectives callers use (re-exported by `zero_kernels.comm`): reduce-scatter, all-gather
and all-reduce with their algorithm chosen per group and size, the process group's life
(init, barrier, shutdown, leaving a rank), the twin and side groups, arrival checks and Join.
See [Note: averaging] in `zero_kernels.comm`."""

from __future__ import annotations

import datetime
from typing import NoReturn

import torch
import torch.distributed as dist

from .base import (
    CommLog,
    Handle,
    Watch,
    _nbytes,
    _wait,
    backend_for,
    collective_device,
    is_initialized,
    world_size,
)
from .choose import (
    _all_gather_with,
    _reduce_scatter_with,
    _reset_choices,
    choose_with_reason,
    class_label,
    register_twin,
    size_class,
)
from .groups import is_fake


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
    algo = _choose("reduce_scatter", _nbytes(input), group, input.device, log)
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
    algo = _choose("all_gather", _nbytes(output), group, output.device, log)
    return _all_gather_with(algo, output, input, group, log, (timeout_s, what, watch))


def _choose(op: str, nbytes: int, group, device, log: CommLog | None) -> str:
    """The algorithm ([Note: choosing the algorithm]); ``log`` keeps it and why in its
    ``choices``, by operation, size class and group size."""
    algo, why = choose_with_reason(op, nbytes, group=group, device=device)
    if log is not None:
        label = f"{op} {class_label(size_class(nbytes))} on {world_size(group)} ranks"
        if log.choices.get(label, (None,))[0] != algo:
            log.choices[label] = (algo, why)
    return algo


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


def side_group(group=None, timeout_s: float = 300.0):
    """A gloo group over the ranks of ``group`` for agreement checks with a timeout of their own
    (`check_arrival`); None at world size 1. Collective."""
    if world_size(group) == 1:
        return None
    ranks = None if group is None else dist.get_process_group_ranks(group)
    # torch's fake group (tests at world size 8 in one process) has no gloo: a fake twin
    backend = None if is_fake(group) else "gloo"
    return _subgroup(ranks, backend=backend, timeout=datetime.timedelta(seconds=timeout_s))


def _subgroup(ranks, **kw):
    """``dist.new_group(ranks, **kw)`` where every rank of the world makes a group over the
    ranks of its own ``group`` at this call, e.g. each dp group of a 2-D mesh (dp x tp). torch
    names a group by a counter every rank advances, so groups over other ranks made at one
    call would share a name and meet in one rendezvous (a hang, measured with dp 2 x tp 2):
    here the ranks' lists are gathered over the world and every rank makes every group, in
    one order, keeping its own (what DeviceMesh does for its dims). Collective over the world
    where ``ranks`` is a proper subset of it."""
    if ranks is None or len(ranks) == dist.get_world_size():
        return dist.new_group(ranks=ranks, **kw)
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, sorted(ranks))
    mine = None
    me = dist.get_rank()
    for rs in sorted({tuple(r) for r in every}):
        g = dist.new_group(ranks=list(rs), **kw)
        if me in rs:
            mine = g
    return mine


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
    twin = _subgroup(ranks, backend="gloo", timeout=timeout)
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
