"""Spawn N gloo workers running one function; their exceptions come back with tracebacks.

Several concerns per spawned group (spawning ranks is slow), one result per concern: a worker
runs its checks through `run_checks` (an assertion failing in one check is that check's result,
and the next check runs), and the tests read them through `SharedRun` (one spawned group per
world size, each concern its own pytest test).

Ranks fork from one server process that imported torch, dynamo and the package once (Python's
forkserver): a rank starts in ~0.2 s, where a fresh interpreter spends 3-10 s importing them on
these 2 cores, and the suite has a few hundred ranks. What a spawned rank had, a forked one has
too: the parent's environment as it is at the call (applied before the test's function and its
arguments are unpickled, so a checks module reading a variable at import sees it), its
sys.path, one intra-op thread. What it cannot have is what a process reads only at its start
(glibc's ``MALLOC_*``, ``LD_PRELOAD``): a test that needs one passes ``start_method="spawn"``.
``ZK_TEST_START_METHOD=spawn`` runs every group the old way."""

from __future__ import annotations

import os
import pickle
import queue as _queue
import socket
import sys
import traceback
from datetime import timedelta

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# what the server imports once; each rank then imports only its checks module
PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "zero_kernels", "zero_kernels.optimizer"]


def stop_forkserver() -> None:
    """Stop Python's forkserver if it runs (the next forkserver start begins a fresh one). It is
    one per process: a test whose own code starts one with its own environment or preload
    (`zero-kernels tune`) calls this before and after, so neither runs on the other's server.
    Uses the stdlib's ``ForkServer._stop``, there for its own tests."""
    from multiprocessing import forkserver

    forkserver._forkserver._stop()


def _entry(env, rank: int, world: int, port: int, payload: bytes, q) -> None:
    os.environ.clear()
    os.environ.update(env)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        fn, args = pickle.loads(payload)  # imports the checks module, with the env above
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


def run_workers(
    fn, world: int, *args, timeout: float = 300.0, start_method: str | None = None
) -> list:
    """Run ``fn(rank, world, *args)`` on ``world`` gloo ranks; return their results.
    ``start_method``: "forkserver" (the default, see the module's docstring) or "spawn"."""
    method = start_method or os.environ.get("ZK_TEST_START_METHOD") or "forkserver"
    if method not in ("forkserver", "spawn"):
        raise ValueError(f"start_method={method!r}: use 'forkserver' or 'spawn'")
    ctx = mp.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(PRELOAD)  # read when the server starts, once
    q = ctx.Queue()
    port = free_port()
    payload = pickle.dumps((fn, args))
    env = dict(os.environ)
    procs = [
        ctx.Process(target=_entry, args=(env, r, world, port, payload, q), daemon=True)
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


FAILED = "FAILED: "


def run_checks(rank: int, world: int, checks) -> dict:
    """In a worker: ``{check.__name__: check(rank, world)}`` for each check in turn (a dict of
    details, {} when it has none). An AssertionError in a check is its result (``"FAILED: ..."``,
    printed to stderr at once) and the next check runs: most checks assert on values every rank
    agrees on, so the ranks leave the check at the same point and their collectives stay
    matched. A failure on some ranks only (an assertion on the rank a state dict was gathered
    to) can leave the others in a collective of the failed check: the group then fails as a
    whole (the process group's timeout), the stderr line still naming the check. Any other
    exception is the group's failure: it propagates."""
    out = {}
    for check in checks:
        try:
            out[check.__name__] = check(rank, world) or {}
        except AssertionError as e:
            frames = traceback.extract_tb(e.__traceback__)
            mine = [f for f in frames if f.filename == check.__code__.co_filename]
            where = (mine or frames)[-1]  # the line in the check's own module
            out[check.__name__] = f"{FAILED}{e} ({os.path.basename(where.filename)}:{where.lineno})"
            tb = traceback.format_exc(limit=-3)
            print(f"rank {rank}: {check.__name__} {FAILED}\n{tb}", file=sys.stderr, flush=True)
    return out


class SharedRun:
    """``fn`` (a `run_checks` worker) run once per world size on spawned ranks, its results
    shared by the tests of each concern; a failed group fails every test that reads it."""

    def __init__(self, fn, timeout: float):
        self.fn, self.timeout, self.runs = fn, timeout, {}

    def reports(self, world: int) -> list[dict]:
        if world not in self.runs:
            try:
                self.runs[world] = run_workers(self.fn, world, timeout=self.timeout)
            except AssertionError as e:
                self.runs[world] = e
        got = self.runs[world]
        if isinstance(got, AssertionError):
            raise AssertionError(f"the spawned group of {self.fn.__name__} failed:\n{got}")
        return got

    def check(self, world: int, name: str) -> list[dict]:
        """Every rank's details of check ``name``, after asserting it passed on every rank."""
        reps = self.reports(world)
        missing = [r for r, rep in enumerate(reps) if name not in rep]
        assert not missing, f"{name} (world={world}) did not run on ranks {missing}"
        bad = [f"rank {r}: {rep[name]}" for r, rep in enumerate(reps) if isinstance(rep[name], str)]
        assert not bad, f"{name} (world={world}):\n" + "\n".join(bad)
        return [rep[name] for rep in reps]
