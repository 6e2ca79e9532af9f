"""Spawn N gloo workers running one function; their exceptions come back with tracebacks."""

from __future__ import annotations

import os
import queue as _queue
import socket
import traceback
from datetime import timedelta

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(fn, rank: int, world: int, port: int, args: tuple, q) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=60),
        )
        out = fn(rank, world, *args)
        q.put((rank, "ok", out))
    except BaseException:  # report everything to the parent
        q.put((rank, "err", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_workers(fn, world: int, *args, timeout: float = 300.0) -> list:
    """Run ``fn(rank, world, *args)`` on ``world`` spawned gloo ranks; return their results."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_entry, args=(fn, r, world, port, args, q), daemon=True)
        for r in range(world)
    ]
    for p in procs:
        p.start()
    results: dict[int, object] = {}
    errors: list[str] = []
    import time

    deadline = time.monotonic() + timeout
    while len(results) + len(errors) < world:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        try:
            rank, status, payload = q.get(timeout=min(left, 5.0))
        except _queue.Empty:
            if any(p.exitcode not in (None, 0) for p in procs):
                # a rank died without reporting (what it sent is read first): the others
                # get a moment, not the whole timeout
                deadline = min(deadline, time.monotonic() + 10)
            continue
        if status == "ok":
            results[rank] = payload
        else:
            errors.append(f"--- rank {rank} ---\n{payload}")
            deadline = min(deadline, time.monotonic() + 70)  # others may hit the pg timeout
    for p in procs:
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
            p.join(timeout=5)
    if errors:
        raise AssertionError(f"{len(errors)} rank(s) failed:\n" + "\n".join(errors))
    if len(results) < world:
        missing = sorted(set(range(world)) - set(results))
        raise AssertionError(
            f"ranks {missing} did not finish within {timeout}s "
            f"(exit codes {[p.exitcode for p in procs]})"
        )
    return [results[r] for r in range(world)]
