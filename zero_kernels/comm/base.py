"""What every collective of `zero_kernels.comm` stands on: handles, counters, timeouts and the
CUDA comm stream (the groups themselves: `zero_kernels.comm.groups`).

[Note: CUDA streams]
On CUDA a collective is launched on a comm stream of its own (one per device) after that stream
waits for the current (compute) stream, so it starts once its input is produced; the handle's
division (sum-then-divide averaging) runs on the comm stream too, and an event recorded there
marks the end. ``Handle.wait()`` makes the current stream wait for that event: the host is never
blocked, and the compute stream runs on until the data is needed. The tensors a collective
touches are marked as used by the comm stream (``record_stream``), so the caching allocator never
hands their memory to another tensor while the collective may still read or write it. The
exposed communication (how long the compute stream stalled at each wait) is timed with events
recorded around the wait and folded into the totals as they complete ([Note: held timing
events]); reading `CommLog.as_dict` or the ledger is the only place that synchronises.

[Note: held timing events]
Each timed CUDA wait holds two events until the GPU has passed them. Every new wait first
queries the oldest held pairs (``query()``: never blocks) and folds the completed ones into
the totals and into their step's ledger entry, so a run holds about as many pairs as the host
is waits ahead of the GPU. At most `TIMING_EVENTS_HELD` pairs are held: a wait that finds the
bound reached is not timed (its stream still waits) and counts in ``untimed_waits``, so
``exposed_comm_s`` is then a lower bound and says so. Synchronising on the oldest pair instead
would keep the total exact but make the host wait for the GPU inside the step ([Note: no host
sync] in zero_kernels/partition/syncfree.py), precisely when the host runs far ahead, the case the
bound
exists for. Before, every pair stayed until `as_dict` was read and the ledger held the pairs of
its 1,000 steps: host memory grew for the whole run and a late read synchronised millions.
"""

from __future__ import annotations

import collections
import threading
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .groups import (  # noqa: F401 - the names comm's modules and tests read here too
    backend_for,
    backends_of,
    choose_device,
    collective_device,
    group_key,
    is_initialized,
    parse_backends,
    rank,
    world_size,
)
from .links import split

# One compatibility point for the tensor collectives' names (new names first).
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass
class CommLog:
    """Counters of the collectives one optimizer issued (bytes are of the full input/output,
    but ``inside_node_bytes``/``cross_node_bytes``: what this rank sent, [Note: bytes by link]).

    [Note: the step ledger]
    `mark_step`, called by every ``step()`` (also one skipped for non-finite gradients, or one
    that raised), closes an entry: the step's number, its outcome and what every counter grew by
    since the entry before, so an entry holds the bytes and calls of that step's backward (all
    its micro-batches) and of the step itself, by link, and the time its waits were exposed.
    The newest `LEDGER_STEPS` entries are kept (a bounded deque: a long run keeps a constant
    few hundred KB). Marking reads only host counters: on CUDA the entry's exposed time grows
    as its waits' timing events complete ([Note: held timing events]) and `read_ledger`
    resolves those still held (synchronising, as reading `as_dict` does), so the step itself
    never waits for the GPU. ``reset()`` empties it.
    """

    reduce_scatter_bytes: int = 0
    all_gather_bytes: int = 0
    reduce_scatter_calls: int = 0
    all_gather_calls: int = 0
    all_reduce_calls: int = 0
    # hierarchical sharding: the gradient shards all-reduced across replica groups (the bytes
    # that cross nodes: [Note: hierarchy] in zero_kernels.comm.hier)
    replica_all_reduce_bytes: int = 0
    replica_all_reduce_calls: int = 0
    # stage 3's secondary shard: the backward's all-gathers inside a node's block of ranks (not
    # in all_gather_*: [Note: secondary shard] in zero_kernels.partition.secondary)
    secondary_all_gather_bytes: int = 0
    secondary_all_gather_calls: int = 0
    # the quantized gradients' two-hop form: the exact hop inside each node (its fp32 input;
    # the quantized hop across is in reduce_scatter_*: [Note: two-hop quantized
    # reduce-scatter] in zero_kernels.comm.hier_quant)
    node_reduce_scatter_bytes: int = 0
    node_reduce_scatter_calls: int = 0
    # the model's buffers broadcast before a forward, as DDP's broadcast_buffers ([Note:
    # replicated module state] in zero_kernels.optimizer.replicas)
    broadcast_bytes: int = 0
    broadcast_calls: int = 0
    # what this rank sent, by link: to ranks of its own host and of others ([Note: bytes by
    # link] in zero_kernels.comm.links)
    inside_node_bytes: int = 0
    cross_node_bytes: int = 0
    exposed_comm_s: float = 0.0  # time spent waiting on collectives after they were issued
    # CUDA waits left untimed: `TIMING_EVENTS_HELD` pairs were held ([Note: held timing events])
    untimed_waits: int = 0
    sizes: list = field(default_factory=list)  # (kind, numel, dtype) of every call, when traced
    # what was chosen for this optimizer's collectives and why (what -> (choice, why)): not a
    # counter, kept across `reset`; `as_dict` shows it under "choices"
    choices: dict = field(default_factory=dict)
    trace: bool = False
    # CUDA: (start, end, its step's seconds) for the stream waits whose events the GPU may not
    # have passed yet, oldest first ([Note: held timing events])
    _timings: collections.deque = field(default_factory=collections.deque, repr=False)
    # [Note: the step ledger]: one entry per step (the newest LEDGER_STEPS), each the counters'
    # growth since the one before
    ledger: collections.deque = field(
        default_factory=lambda: collections.deque(maxlen=LEDGER_STEPS), repr=False
    )
    _at_mark: dict = field(default_factory=dict, repr=False)
    # the CUDA waits' seconds since the mark (one element, shared with the held pairs)
    _step_cuda_s: list = field(default_factory=lambda: [0.0], repr=False)
    _host_waited_s: float = field(default=0.0, repr=False)  # host waits (exposed_comm_s' part)

    def as_dict(self) -> dict:
        self._fold(sync=True)
        return {**self._counters(), "choices": dict(self.choices)}

    @property
    def held_timing_events(self) -> int:
        """How many CUDA timing events are held, not yet folded into the totals (a debug view:
        [Note: held timing events])."""
        return 2 * len(self._timings)

    def _counters(self) -> dict:
        return {k: getattr(self, k) for k in COUNTERS}

    def reset(self) -> None:
        for k, v in CommLog()._counters().items():
            setattr(self, k, v)
        self.sizes.clear()
        self._timings.clear()
        self.ledger.clear()
        self._at_mark = {}
        self._step_cuda_s = [0.0]
        self._host_waited_s = 0.0

    def _fold(self, sync: bool = False) -> None:
        """Fold the held timing events the GPU has passed into the totals, oldest first; with
        ``sync``, all of them, waiting for each ([Note: held timing events])."""
        held = self._timings
        while held:
            e0, e1, step_s = held[0]
            if sync:
                e1.synchronize()
            elif not e1.query():
                return
            s = e0.elapsed_time(e1) / 1e3
            self.exposed_comm_s += s
            step_s[0] += s
            held.popleft()

    def _waited(self, seconds: float) -> None:
        self.exposed_comm_s += seconds
        self._host_waited_s += seconds

    def _timed_wait(self, stream, event) -> None:
        """``stream`` waits for ``event``, the stall timed by events around it while fewer
        than `TIMING_EVENTS_HELD` pairs are held ([Note: held timing events])."""
        self._fold()
        if len(self._timings) >= TIMING_EVENTS_HELD:
            stream.wait_event(event)
            self.untimed_waits += 1
            return
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record(stream)
        stream.wait_event(event)
        e1.record(stream)
        self._timings.append((e0, e1, self._step_cuda_s))

    def _sent(self, kind: str, nbytes: int, group) -> None:
        """Count what this rank sends in a collective of send pattern ``kind`` over a full
        buffer of ``nbytes`` on ``group``, by link ([Note: bytes by link])."""
        inside, cross = split(kind, nbytes, group)
        self.inside_node_bytes += inside
        self.cross_node_bytes += cross

    def mark_step(self, step: int, outcome: str = "stepped") -> None:
        """Close the ledger's entry of step ``step`` (``outcome``: "stepped", "skipped" for
        non-finite gradients, "raised"): what the counters grew by since the last mark
        ([Note: the step ledger])."""
        self._fold()
        now = self._counters()
        now["exposed_comm_s"] = self._host_waited_s  # the CUDA waits: the entry's own seconds
        last = self._at_mark
        entry = {"step": step, "outcome": outcome}
        for k, v in now.items():
            entry[k] = v - last.get(k, 0)
        entry["_cuda_s"], self._step_cuda_s = self._step_cuda_s, [0.0]
        self._at_mark = now
        self.ledger.append(entry)

    def read_ledger(self) -> list[dict]:
        """The ledger's entries, oldest first (CUDA: reading waits for the timing events
        still held, as `as_dict` does)."""
        self._fold(sync=True)
        out = []
        for e in self.ledger:
            d = {k: v for k, v in e.items() if k != "_cuda_s"}
            d["exposed_comm_s"] += e["_cuda_s"][0]
            out.append(d)
        return out

    def count_broadcast(self, nbytes: int, src: int, group) -> None:
        """A broadcast of ``nbytes`` from group rank ``src`` on ``group``: by link, the source
        sends them to every other rank ([Note: bytes by link])."""
        self._add_bytes("broadcast", nbytes)
        if rank(group) == src:
            self._sent("broadcast", nbytes, group)

    def _add(self, kind: str, t: torch.Tensor) -> None:
        self._add_bytes(kind, t.numel() * t.element_size())
        if self.trace:
            self.sizes.append((kind, t.numel(), t.dtype))

    def _add_bytes(self, kind: str, nbytes: int) -> None:
        setattr(self, f"{kind}_bytes", getattr(self, f"{kind}_bytes") + nbytes)
        setattr(self, f"{kind}_calls", getattr(self, f"{kind}_calls") + 1)


# `CommLog.as_dict`'s counters, in order
COUNTERS = (
    "reduce_scatter_bytes",
    "all_gather_bytes",
    "reduce_scatter_calls",
    "all_gather_calls",
    "all_reduce_calls",
    "replica_all_reduce_bytes",
    "replica_all_reduce_calls",
    "secondary_all_gather_bytes",
    "secondary_all_gather_calls",
    "node_reduce_scatter_bytes",
    "node_reduce_scatter_calls",
    "broadcast_bytes",
    "broadcast_calls",
    "inside_node_bytes",
    "cross_node_bytes",
    "exposed_comm_s",
    "untimed_waits",
)
LEDGER_STEPS = 1000
TIMING_EVENTS_HELD = 4096  # most CUDA wait timings held unresolved ([Note: held timing events])


class Handle:
    """An issued collective: ``wait()`` finishes it (and applies a pending division).

    On CUDA the collective runs on the comm stream and ``event`` marks its end there (the division
    included); ``wait()`` makes the current stream wait for it and returns at once
    ([Note: CUDA streams])."""

    __slots__ = ("work", "tensors", "divide", "log", "done", "event")

    def __init__(
        self, work, tensors: tuple, divide: float = 1.0, log: CommLog | None = None, event=None
    ):
        self.work = work
        self.tensors = tensors  # kept alive until waited for; tensors[0] is the output
        self.divide = divide
        self.log = log
        self.done = False
        self.event = event

    def is_completed(self) -> bool:
        """Whether ``wait()`` would not have to wait (never blocks, never synchronises)."""
        if self.done or (self.work is None and self.event is None):
            return True
        return self.event.query() if self.event is not None else self.work.is_completed()

    def wait(
        self, timeout_s: float | None = None, what: str = "", watch: Watch | None = None
    ) -> torch.Tensor:
        """Finish the collective; with ``timeout_s``, a `CollectiveTimeout` naming ``what``
        when not every rank took part in time (a rank stalled, died or took another path).
        With ``watch``, the host wait is watched ([Note: watched waits]).
        On CUDA the bound is the process group's own timeout (NCCL's watchdog): a wait there
        never blocks the host."""
        if self.done:
            return self.tensors[0]
        if self.event is not None:
            cur = torch.cuda.current_stream(self.tensors[0].device)
            if self.log is None:
                cur.wait_event(self.event)
            else:  # the current stream's stall, timed by events around it
                self.log._timed_wait(cur, self.event)
            self.done = True
            return self.tensors[0]
        t0 = time.perf_counter()
        if self.work is not None:
            if watch is None:
                _wait(self.work, timeout_s, what)
            else:
                watch.enter()
                try:
                    _wait(self.work, timeout_s, what)
                except Exception as e:
                    watch.leave(e)
                    raise
                watch.leave()
        if self.divide != 1.0:
            self.tensors[0].div_(self.divide)
        if self.log is not None:
            self.log._waited(time.perf_counter() - t0)
        self.done = True
        return self.tensors[0]


class CollectiveTimeout(RuntimeError):
    """A collective that not every rank completed within the optimizer's ``timeout``."""


def _wait(work, timeout_s: float | None, what: str) -> None:
    """``work.wait()``, bounded by ``timeout_s`` (see `Handle.wait`).

    [Note: timeouts]
    Two bounds, both from the optimizer's ``timeout=``. (1) The collectives of backward and step
    (reduce-scatters, all-gathers, the small all-reduces of the step) are bounded only when the
    user passes ``timeout``: each wait then raises `CollectiveTimeout` naming the step, the phase
    and the bucket or unit, instead of waiting for the process group's own timeout (30 minutes
    on gloo). Unbounded by default because a bounded wait on gloo runs in a helper thread (its
    reduce-scatter work ignores ``wait(timeout)``), a cost on every wait. (2) Calls that are
    collective though they look local (``consolidated_state_dict``, ``full_param``, stage 3's
    ``model.state_dict()`` and ``close()``) first check that every rank arrived, with
    ``monitored_barrier`` on the optimizer's side group, within ``timeout`` or 300 s
    (`zero_kernels.comm.check_arrival`): a call made on one rank is a RuntimeError there, never
    a hang. A gloo wait that expires closes the group's pairs, so the group cannot be used after
    a `CollectiveTimeout`; stage 3's `SequenceCheck` avoids expiring waits for that reason
    ([Note: watched waits])."""
    if timeout_s is None:
        work.wait()
        return
    try:
        if getattr(work, "takes_seconds", False):  # the p2p algorithms' own works
            work.wait(timeout_s)
        else:  # not every backend's work honours wait(timeout) (gloo's reduce-scatter does
            # not): wait in a thread, bounded here
            _bounded(work.wait, timeout_s)
    except CollectiveTimeout as e:  # the p2p and shm algorithms' own: say what it was
        if what and not str(e).startswith(what):
            raise CollectiveTimeout(f"{what}: {e}") from e
        raise
    except RuntimeError as e:
        raise CollectiveTimeout(
            f"{what or 'a collective'}: not every rank completed it within {timeout_s:g} s "
            f"(a rank stalled, died or ran a different collective): {str(e)[:300]}"
        ) from e


class Watch:
    """A watcher of host waits on collectives: ``enter()`` before the wait, ``leave()`` after it
    (``leave(error)`` when it failed), each may raise what the watcher found.

    [Note: watched waits]
    A wait on gloo cannot be given up and resumed: a ``wait(timeout)`` that expires closes the
    pairs of the process group ("Application timeout caused pair closure"), and ``abort()`` does
    not wake a wait in progress. Stage 3's `SequenceCheck` must yet turn a wait for a collective
    that some rank will never launch into an error. So the wait is the plain one, marked by
    ``enter``/``leave`` (two attribute writes); a monitor thread of the watcher sees a wait that
    lasts and diagnoses it, and once the error is known the ranks make every wait in progress
    complete (each launches, on scratch buffers, what it never launched), so that ``leave`` can
    raise it. Handing every wait to a waiter thread instead, bounded from this one, was tried:
    about 0.3 ms per wait on a loaded 2-core machine, stage 3 at 1.08-1.27x its step time."""

    def enter(self) -> None:
        pass

    def leave(self, error: BaseException | None = None) -> None:
        pass


def _bounded(fn, timeout_s: float) -> None:
    """``fn()`` in a daemon thread; its exception re-raised here; RuntimeError after
    ``timeout_s`` (the thread is left blocked: the caller is about to fail anyway)."""
    box: list = []

    def run():
        try:
            fn()
        except BaseException as e:  # re-raised in the caller
            box.append(e)

    t = threading.Thread(target=run, name="zero_kernels-wait", daemon=True)
    t.start()
    t.join(timeout_s)
    if t.is_alive():
        raise RuntimeError(f"timed out after {timeout_s:g} s")
    if box:
        raise box[0]


_avg_ok: dict = {}  # (group key, device type) -> whether ReduceOp.AVG works


def avg_supported(group=None, device: torch.device | str | None = None) -> bool:
    """Whether reduce-scatter with ``ReduceOp.AVG`` works on ``group`` for tensors on
    ``device`` (default: `collective_device`'s), probed once per device type, collective."""
    dev = collective_device(group) if device is None else torch.device(device)
    key = (group_key(group), dev.type)
    if key not in _avg_ok:
        n = world_size(group)
        ok = True
        try:
            x = torch.ones(n, device=dev)
            out = torch.empty(1, device=x.device)
            _reduce_scatter(out, x, op=dist.ReduceOp.AVG, group=group)
            ok = bool(out.item() == 1.0)
        except Exception:
            ok = False
        _avg_ok[key] = ok
    return _avg_ok[key]


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


_streams: dict = {}  # CUDA device index -> its comm stream


def comm_stream(device: torch.device):
    """The CUDA stream collectives on ``device`` run on (created once per device)."""
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _streams:
        _streams[idx] = torch.cuda.Stream(device=idx)
    return _streams[idx]


def launch_native(launch, tensors: tuple, divide: float, log) -> Handle:
    """Issue one backend collective (``launch()`` returns its work) and return its handle; on
    CUDA on the comm stream after the current stream's work, ``tensors[0]`` divided there and
    the handle carrying the end event ([Note: CUDA streams])."""
    out = tensors[0]
    if not out.is_cuda:
        return Handle(launch(), tensors, divide, log)
    cur = torch.cuda.current_stream(out.device)
    s = comm_stream(out.device)
    s.wait_stream(cur)
    with torch.cuda.stream(s):
        work = launch()
        if work is not None:
            work.wait()  # NCCL: the comm stream (not the host) waits for the collective
        if divide != 1.0:
            out.div_(divide)
        for t in tensors:
            t.record_stream(s)
        event = torch.cuda.Event()
        event.record(s)
    return Handle(None, tensors, 1.0, log, event=event)
