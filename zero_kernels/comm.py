"""Collectives: the only module of zero_kernels that calls ``torch.distributed``.

Every asynchronous collective returns a `Handle` holding the work object *and* the tensors it
reads and writes, so a caller cannot free a buffer that is still being communicated.

[Note: averaging]
Gradients are averaged exactly once. Where the backend's reduce-scatter takes ``ReduceOp.AVG``
(NCCL; gloo in recent torch) the native algorithm uses that op; otherwise, and always for the
point-to-point algorithms, the sum is divided by the world size when the handle is waited for.
`avg_supported` probes this once per process group.

[Note: algorithms]
Reduce-scatter and all-gather each have three algorithms. Chunk c of the full buffer (the
reduce-scatter input, the all-gather output) is elements [c*s, (c+1)*s), s the shard numel; rank r
owns chunk r.

- ``native``: the backend's collective (``reduce_scatter_single``, ``all_gather_single``).
- ``pairwise``: each rank sends every other rank that rank's chunk, all at once, in the rotated
  order r+1, r+2, ... (no rank is everyone's first target), as one ``batch_isend_irecv``. The
  launch posts every send and receive; ``wait()`` waits them and, for reduce-scatter, sums.
  Reduce-scatter memory: N-1 receive buffers of one shard (N-2 when ``output`` is not part of
  ``input``: one peer's chunk lands in it). All-gather receives into ``output``.
- ``ring``: N-1 steps; at step k rank r sends to r+1 what it received from r-1 at step k-1 (for
  reduce-scatter plus its own contribution). Steps depend on each other, so a ring runs in a
  daemon thread started at launch and ``wait()`` joins it. Reduce-scatter memory: 2 shard buffers
  (1 at N = 2). All-gather receives into ``output``.

Receive buffers come from a cache (`scratch_bytes`, `free_scratch`) bounded by the most in use at
once, because a fresh one costs as much in page faults as the exchange takes.

Summation order, the same for both p2p algorithms (switching between them never changes a bit):
chunk c is ``((x[c+1] + x[c+2]) + ...) + x[c]``, x[k] rank k's contribution, indices mod N, one
addition at a time in the input dtype: the order a ring produces. Pairwise sums the received
chunks in that fixed order whatever order they arrive in, so results are deterministic. The own
chunk is added last, by the elementwise operation that writes ``output``, after every send has
completed: ``output`` may be the rank's own chunk of ``input`` (stage 1 reduces in place), and an
all-gather's ``input`` its own chunk of ``output``. gloo's reduce-scatter sums in another order
(not even one order for every element), so at N >= 3 the results differ from native by rounding
(at most 2(N-1) eps sum|x| apart); at N = 2 a sum is one addition and they are bitwise equal.

Every p2p collective takes the next tag of its group (all ranks launch collectives in the same
order, so the tags agree): messages of different collectives never match each other, so handles
may be waited in any order, a different one on each rank, and rings in flight overlap.

[Note: choosing the algorithm]
NCCL, any tensor off the CPU and any backend but gloo always use native; world size 1 copies. On
gloo the choice is made per (group, operation, size class of the full buffer): < 64 KiB, then
powers of 4 from 64 KiB ([64K, 256K), [256K, 1M), [1M, 4M), [4M, 16M)), and >= 16 MiB.
Precedence: `set_algorithm` (for the group, then for every group), then
``ZERO_KERNELS_COMM_ALGO=native|pairwise|ring`` (``auto`` or unset: probe), then the probe.

The probe runs lazily, inside the first collective of a class, which every rank calls in the same
order. On one fp32 buffer of the class's probe size (32 KiB, 128 KiB, 512 KiB, 2 MiB, 8 MiB, 32
MiB) it runs native, pairwise and (N > 2; a ring of 2 is the pairwise exchange) ring 5 to 1 times
each (fewer for larger sizes; buffers touched beforehand), interleaved, each run after a barrier.
It takes each rank's fastest run (warm-up and preemption only add time) and all-reduces them with
MAX, so every rank sees the same numbers and picks the same algorithm (ranks that chose differently
would hang). A p2p algorithm must be at least 10% faster than native to be chosen. Each choice is
logged once (logger ``zero_kernels``, INFO); `probe_results` returns what was measured. The top
class is probed at 32 MiB because gloo's own collectives slow down per byte above ~32 MB (likely
fresh, page-faulting temporaries: 32 MiB is glibc's largest mmap threshold): its all-gather ties
with pairwise at 4 MiB, is ~1.4x slower at 16 MiB and 2.6x slower at 76 MB, so a smaller probe
chooses wrong for large buckets; there one run each decides (3-5x apart). Probing every class of
both operations costs ~0.5 s per group (2 ranks, this 2-core machine); a run probes only the
classes it uses (25 MB buckets: the top one, ~0.25 s, and perhaps one for the last bucket).
"""

from __future__ import annotations

import bisect
import datetime
import logging
import os
import threading
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

__all__ = [
    "ALGORITHMS",
    "CommLog",
    "ENV_ALGO",
    "Handle",
    "all_gather",
    "all_reduce",
    "avg_supported",
    "broadcast",
    "broadcast_object",
    "choose_algorithm",
    "free_scratch",
    "gather_object",
    "is_initialized",
    "probe_results",
    "rank",
    "reduce_scatter",
    "scratch_bytes",
    "set_algorithm",
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

    def wait(self, timeout_s: float | None = None, what: str = "") -> torch.Tensor:
        """Finish the collective; with ``timeout_s``, a `CollectiveTimeout` naming ``what``
        when not every rank took part in time (a rank stalled, died or took another path)."""
        if not self.done:
            t0 = time.perf_counter()
            if self.work is not None:
                _wait(self.work, timeout_s, what)
            if self.divide != 1.0:
                self.tensors[0].div_(self.divide)
            if self.log is not None:
                self.log.exposed_comm_s += time.perf_counter() - t0
            self.done = True
        return self.tensors[0]


class CollectiveTimeout(RuntimeError):
    """A collective that not every rank completed within the optimizer's ``timeout``."""


def _wait(work, timeout_s: float | None, what: str) -> None:
    """``work.wait()``, bounded by ``timeout_s`` (see `Handle.wait`)."""
    if timeout_s is None:
        work.wait()
        return
    try:
        if isinstance(work, (_Exchange, _Ring)):
            work.wait(timeout_s)
        else:  # not every backend's work honours wait(timeout) (gloo's reduce-scatter does
            # not): wait in a thread, bounded here
            _bounded(work.wait, timeout_s)
    except CollectiveTimeout:
        raise
    except RuntimeError as e:
        raise CollectiveTimeout(
            f"{what or 'a collective'}: not every rank completed it within {timeout_s:g} s "
            f"(a rank stalled, died or ran a different collective): {str(e)[:300]}"
        ) from e


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


ALGORITHMS = ("native", "pairwise", "ring")
ENV_ALGO = "ZERO_KERNELS_COMM_ALGO"
_OPS = ("reduce_scatter", "all_gather")
_logger = logging.getLogger("zero_kernels")


def reduce_scatter(
    output: torch.Tensor,
    input: torch.Tensor,
    *,
    group=None,
    avg: bool = True,
    log: CommLog | None = None,
) -> Handle:
    """Start ``output = reduce(input)[my chunk]`` (averaged when ``avg``); returns its handle.

    ``output`` may be this rank's own chunk of ``input`` (in place). The algorithm is chosen per
    group and size ([Note: choosing the algorithm]); ``log`` counts one collective whichever it is.
    """
    n = world_size(group)
    _check_numel("reduce_scatter", output, input, n)
    if log is not None:
        log._add("reduce_scatter", input)
    if n == 1:
        if output.data_ptr() != input.data_ptr():
            output.copy_(input)
        return Handle(None, (output, input), 1.0, log)
    algo = choose_algorithm("reduce_scatter", _nbytes(input), group=group, device=input.device)
    return _reduce_scatter_with(algo, output, input, group, avg, log)


def all_gather(
    output: torch.Tensor, input: torch.Tensor, *, group=None, log: CommLog | None = None
) -> Handle:
    """Start ``output = cat(input of every rank)``; returns its handle.

    ``input`` may be this rank's own chunk of ``output`` (in place). The algorithm is chosen as
    for `reduce_scatter`.
    """
    n = world_size(group)
    _check_numel("all_gather", input, output, n)
    if log is not None:
        log._add("all_gather", output)
    if n == 1:
        if output.data_ptr() != input.data_ptr():
            output.copy_(input)
        return Handle(None, (output, input), 1.0, log)
    algo = choose_algorithm("all_gather", _nbytes(output), group=group, device=output.device)
    return _all_gather_with(algo, output, input, group, log)


def _check_numel(op: str, shard: torch.Tensor, full: torch.Tensor, n: int) -> None:
    if shard.numel() * n != full.numel():
        s, f = ("output", "input") if op == "reduce_scatter" else ("input", "output")
        raise ValueError(
            f"{op}: {s}.numel() * world_size must equal {f}.numel(); got {s}.shape="
            f"{tuple(shard.shape)}, {f}.shape={tuple(full.shape)}, world_size={n}"
        )


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _reduce_scatter_with(algo: str, output, input, group, avg: bool, log) -> Handle:
    n = world_size(group)
    if algo == "native":
        if avg and avg_supported(group):
            work = _reduce_scatter(output, input, op=dist.ReduceOp.AVG, group=group, async_op=True)
            return Handle(work, (output, input), 1.0, log)
        work = _reduce_scatter(output, input, op=dist.ReduceOp.SUM, group=group, async_op=True)
        return Handle(work, (output, input), float(n) if avg else 1.0, log)
    _check_p2p("reduce_scatter", output, input, group)
    tag = _next_tag(group)
    if output.numel() == 0:
        return Handle(None, (output, input), 1.0, log)
    launch = _rs_pairwise if algo == "pairwise" else _rs_ring
    work = launch(output.view(-1), input.view(-1), group, tag)
    return Handle(work, (output, input), float(n) if avg else 1.0, log)  # sum, then divide once


def _all_gather_with(algo: str, output, input, group, log) -> Handle:
    if algo == "native":
        work = _all_gather(output, input, group=group, async_op=True)
        return Handle(work, (output, input), 1.0, log)
    _check_p2p("all_gather", output, input, group)
    tag = _next_tag(group)
    if input.numel() == 0:
        return Handle(None, (output, input), 1.0, log)
    launch = _ag_pairwise if algo == "pairwise" else _ag_ring
    return Handle(launch(output.view(-1), input.view(-1), group, tag), (output, input), 1.0, log)


def _check_p2p(op: str, output: torch.Tensor, input: torch.Tensor, group) -> None:
    """The p2p algorithms' preconditions: contiguous, and in place only as the own chunk."""
    if not (output.is_contiguous() and input.is_contiguous()):
        raise ValueError(
            f"{op}: output and input must be contiguous; got {output.is_contiguous()=}, "
            f"{input.is_contiguous()=}"
        )
    shard, full = (output, input) if op == "reduce_scatter" else (input, output)
    own = full.data_ptr() + rank(group) * _nbytes(shard)
    if _overlaps(shard, full) and shard.data_ptr() != own:
        s = "output" if op == "reduce_scatter" else "input"
        raise ValueError(f"{op}: {s} overlaps the full buffer but is not this rank's chunk of it")


# --- point-to-point algorithms ([Note: algorithms]) --------------------------------------------

_TAG_BASE = 1 << 20  # clear of the small tags user code picks
_TAG_SPAN = 1 << 30
_tags: dict = {}  # group key -> next tag offset


def _group_key(group) -> tuple:
    pg = dist.group.WORLD if group is None else group
    return (id(pg), world_size(group))


def _next_tag(group) -> int:
    key = _group_key(group)
    t = _tags.get(key, 0)
    _tags[key] = (t + 1) % _TAG_SPAN
    return _TAG_BASE + t


def _p2p(op, t: torch.Tensor, peer: int, group, tag: int) -> dist.P2POp:
    return dist.P2POp(op, t, group=group, tag=tag, group_peer=peer)


def _swap(send: torch.Tensor, dst: int, recv: torch.Tensor, src: int, group, tag: int) -> None:
    """One ring step: send to ``dst`` and receive from ``src`` at once, and wait for both."""
    ops = [_p2p(dist.isend, send, dst, group, tag), _p2p(dist.irecv, recv, src, group, tag)]
    for w in dist.batch_isend_irecv(ops):
        w.wait()


class _Exchange:
    """Work of a pairwise exchange: the posted sends and receives, then ``finish`` (the sums)."""

    __slots__ = ("works", "finish")

    def __init__(self, works: list, finish=None):
        self.works = works
        self.finish = finish

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self.works)

    def wait(self, timeout_s: float | None = None) -> None:
        for w in self.works:
            if timeout_s is None:
                w.wait()
            else:
                w.wait(datetime.timedelta(seconds=timeout_s))
        if self.finish is not None:
            finish, self.finish = self.finish, None
            finish()


class _Ring:
    """Work of a ring: its dependent steps run in a daemon thread started at launch."""

    __slots__ = ("thread", "error")

    def __init__(self, steps):
        self.error: BaseException | None = None
        self.thread = threading.Thread(
            target=self._run, args=(steps,), name="zero_kernels-ring", daemon=True
        )
        self.thread.start()

    def _run(self, steps) -> None:
        try:
            steps()
        except BaseException as e:  # re-raised by wait()
            self.error = e

    def is_completed(self) -> bool:
        return not self.thread.is_alive()

    def wait(self, timeout_s: float | None = None) -> None:
        self.thread.join(timeout_s)
        if self.thread.is_alive():
            raise CollectiveTimeout(f"ring collective still running after {timeout_s:g} s")
        if self.error is not None:
            raise RuntimeError("zero_kernels ring collective failed") from self.error


class _Scratch:
    """Receive buffers of the p2p reduce-scatters, reused from call to call: a fresh buffer costs
    its page faults (here 40 ms for 38 MB, as long as exchanging it). A request that no free buffer
    fits drops the smaller free ones, so what is cached never exceeds the most ever in use at once
    (about the largest reduce-scatters in flight times their receive buffers)."""

    def __init__(self):
        self.free: dict = {}  # (dtype, device) -> free 1-D buffers
        self.in_use = 0  # bytes
        self.lock = threading.Lock()  # rings give buffers back from their threads

    def take(self, numel: int, like: torch.Tensor) -> torch.Tensor:
        with self.lock:
            free = self.free.setdefault((like.dtype, like.device), [])
            fits = [i for i, b in enumerate(free) if b.numel() >= numel]
            if fits:
                buf = free.pop(min(fits, key=lambda i: free[i].numel()))
            else:
                free.clear()
                buf = torch.empty(numel, dtype=like.dtype, device=like.device)
            self.in_use += _nbytes(buf)
        return buf

    def give(self, bufs: list) -> None:
        with self.lock:
            for b in bufs:
                self.free.setdefault((b.dtype, b.device), []).append(b)
                self.in_use -= _nbytes(b)

    def bytes(self) -> dict:
        with self.lock:
            cached = sum(_nbytes(b) for bs in self.free.values() for b in bs)
            return {"in_use": self.in_use, "cached": cached}


_scratch = _Scratch()


def scratch_bytes() -> dict:
    """Bytes of the p2p reduce-scatters' receive buffers: ``in_use`` (by collectives not yet
    waited for) and ``cached`` (free, kept for the next call); `free_scratch` drops the cache."""
    return _scratch.bytes()


def free_scratch() -> None:
    """Drop the cached free receive buffers."""
    with _scratch.lock:
        _scratch.free.clear()


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether contiguous ``a`` and ``b`` share memory."""
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + _nbytes(b) and b0 < a0 + _nbytes(a)


def _rs_pairwise(out: torch.Tensor, x: torch.Tensor, group, tag: int) -> _Exchange:
    """Pairwise reduce-scatter. Memory: N-1 receive buffers of one shard (N-2 when ``out`` is not
    part of ``x``: rank r+1's chunk is received straight into it), taken from `_scratch`."""
    n, r, s = world_size(group), rank(group), out.numel()
    direct = not _overlaps(out, x)
    bases = [_scratch.take(s, out) for _ in range(n - 2 if direct else n - 1)]
    recv = ([out] if direct else []) + [b[:s] for b in bases]  # [j-1]: rank r+j's contribution
    ops = []
    for k in range(1, n):  # rotated: rank r sends first to r+1, rank r+1 to r+2, ...
        dst, src = (r + k) % n, (r - k) % n
        ops.append(_p2p(dist.isend, x[dst * s : (dst + 1) * s], dst, group, tag))
        ops.append(_p2p(dist.irecv, recv[n - k - 1], src, group, tag))
    works = dist.batch_isend_irecv(ops)

    def finish() -> None:  # ((x[r+1] + x[r+2]) + ...) + x[r], whatever the arrival order
        acc = recv[0]
        for b in recv[1:]:
            acc.add_(b)
        torch.add(acc, x[r * s : (r + 1) * s], out=out)  # own chunk read as output is written
        _scratch.give(bases)

    return _Exchange(works, finish)


def _rs_ring(out: torch.Tensor, x: torch.Tensor, group, tag: int) -> _Ring:
    """Ring reduce-scatter. Memory: 2 shard buffers (1 at N = 2), taken from `_scratch`."""
    n, r, s = world_size(group), rank(group), out.numel()
    bases = [_scratch.take(s, out) for _ in range(min(2, n - 1))]
    bufs = [b[:s] for b in bases]

    def chunk(c: int) -> torch.Tensor:
        return x[c * s : (c + 1) * s]

    def steps() -> None:
        send = chunk((r - 1) % n)  # chunk c starts at rank c+1 and ends, summed, at rank c
        for k in range(n - 1):
            got = bufs[k % 2]  # the other buffer is being sent
            _swap(send, (r + 1) % n, got, (r - 1) % n, group, tag)
            if k < n - 2:
                send = got.add_(chunk((r - k - 2) % n))
            else:
                torch.add(got, chunk(r), out=out)
        _scratch.give(bases)

    return _Ring(steps)


def _ag_pairwise(out: torch.Tensor, x: torch.Tensor, group, tag: int) -> _Exchange:
    """Pairwise all-gather, received straight into ``out``."""
    n, r, s = world_size(group), rank(group), x.numel()
    mine = out[r * s : (r + 1) * s]
    if mine.data_ptr() != x.data_ptr():
        mine.copy_(x)
    ops = []
    for k in range(1, n):
        dst, src = (r + k) % n, (r - k) % n
        ops.append(_p2p(dist.isend, mine, dst, group, tag))
        ops.append(_p2p(dist.irecv, out[src * s : (src + 1) * s], src, group, tag))
    return _Exchange(dist.batch_isend_irecv(ops))


def _ag_ring(out: torch.Tensor, x: torch.Tensor, group, tag: int) -> _Ring:
    """Ring all-gather, received straight into ``out``: at step k pass on chunk r-k."""
    n, r, s = world_size(group), rank(group), x.numel()
    mine = out[r * s : (r + 1) * s]
    if mine.data_ptr() != x.data_ptr():
        mine.copy_(x)

    def steps() -> None:
        for k in range(n - 1):
            a, b = (r - k) % n, (r - k - 1) % n
            _swap(
                out[a * s : (a + 1) * s],
                (r + 1) % n,
                out[b * s : (b + 1) * s],
                (r - 1) % n,
                group,
                tag,
            )

    return _Ring(steps)


# --- choosing the algorithm ([Note: choosing the algorithm]) ------------------------------------

_CLASS_BOUNDS = (64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20)  # class k: [b[k-1], b[k])
_PROBE_BYTES = (32 << 10, 128 << 10, 512 << 10, 2 << 20, 8 << 20, 32 << 20)  # one per class
_PROBE_REPEATS = (5, 4, 4, 3, 3, 1)  # runs per class, more where cheap (the first warms up)
_P2P_MARGIN = 0.9  # a p2p algorithm must take at most this fraction of native's time
_overrides: dict = {}  # (group key or None for every group, op) -> algorithm
_choices: dict = {}  # (group key, op, size class) -> the probe's result
_logged: set = set()


def _size_class(nbytes: int) -> int:
    return bisect.bisect_right(_CLASS_BOUNDS, nbytes)


def _class_label(c: int) -> str:
    def kib(b: int) -> str:
        return f"{b >> 20} MiB" if b >= 1 << 20 else f"{b >> 10} KiB"

    if c == 0:
        return f"< {kib(_CLASS_BOUNDS[0])}"
    if c == len(_CLASS_BOUNDS):
        return f">= {kib(_CLASS_BOUNDS[-1])}"
    return f"[{kib(_CLASS_BOUNDS[c - 1])}, {kib(_CLASS_BOUNDS[c])})"


def _env_algorithm() -> str | None:
    v = os.environ.get(ENV_ALGO, "").strip().lower()
    if v in ("", "auto"):
        return None
    if v not in ALGORITHMS:
        raise ValueError(f"{ENV_ALGO} must be one of {ALGORITHMS} or 'auto'; got {v!r}")
    return v


def _p2p_capable(group, device: torch.device) -> bool:
    return device.type == "cpu" and "gloo" in str(dist.get_backend(group))


def set_algorithm(op: str, algo: str | None, group=None) -> None:
    """Use ``algo`` ("native", "pairwise", "ring"; None: back to env/probe) for ``op``.

    ``op`` is "reduce_scatter", "all_gather" or "all"; ``group=None`` sets it for every group (a
    group's own setting wins). Overrides ``ZERO_KERNELS_COMM_ALGO`` and the probe on gloo; NCCL
    always uses native. Every rank must make the same call: ranks on different algorithms hang.
    """
    if op != "all" and op not in _OPS:
        raise ValueError(f"op must be one of {_OPS} or 'all'; got {op=!r}")
    if algo is not None and algo not in ALGORITHMS:
        raise ValueError(f"algo must be one of {ALGORITHMS} or None; got {algo=!r}")
    key = None if group is None else _group_key(group)
    for o in _OPS if op == "all" else (op,):
        if algo is None:
            _overrides.pop((key, o), None)
        else:
            _overrides[(key, o)] = algo


def choose_algorithm(op: str, nbytes: int, *, group=None, device="cpu") -> str:
    """The algorithm ``op`` uses on ``group`` for a full buffer of ``nbytes`` bytes.

    "copy" at world size 1, else one of `ALGORITHMS`. Collective when the size class has not been
    probed on ``group`` yet: call it on every rank alike, like the collective itself.
    """
    if op not in _OPS:
        raise ValueError(f"op must be one of {_OPS}; got {op=!r}")
    if world_size(group) == 1:
        return "copy"
    if not _p2p_capable(group, torch.device(device)):
        return "native"
    key, c = _group_key(group), _size_class(nbytes)
    algo = _overrides.get((key, op)) or _overrides.get((None, op))
    why = "set_algorithm"
    if algo is None:
        algo, why = _env_algorithm(), ENV_ALGO
    if algo is None:
        if (key, op, c) not in _choices:
            _choices[(key, op, c)] = _probe(op, group, c)
        res = _choices[(key, op, c)]
        algo = res["algorithm"]
        why = "probe, ms (max over ranks of the fastest run): " + ", ".join(
            f"{a} {t:.3g}" for a, t in res["times_ms"].items()
        )
    if (key, op, c, algo, why[:5]) not in _logged:
        _logged.add((key, op, c, algo, why[:5]))
        _logger.info(
            "comm: %s on %d gloo ranks, buffers %s: %s (%s)",
            op,
            world_size(group),
            _class_label(c),
            algo,
            why,
        )
    return algo


def probe_results(group=None) -> dict:
    """What the probe measured on ``group``: {(op, size class label): result}."""
    key = _group_key(group)
    return {(op, _class_label(c)): dict(v) for (k, op, c), v in _choices.items() if k == key}


def _probe(op: str, group, c: int) -> dict:
    """Time every candidate on one fp32 buffer of class ``c``; the same answer on every rank."""
    t_start = time.perf_counter()
    n = world_size(group)
    numel = max(n, _PROBE_BYTES[c] // 4 // n * n)
    full, shard = torch.ones(numel), torch.zeros(numel // n)  # touched: no first-use faults
    warm = [_scratch.take(numel // n, shard) for _ in range(n - 1)]  # the p2p receive buffers
    for b in warm:
        b.zero_()
    _scratch.give(warm)
    cands = ["native", "pairwise"] + (["ring"] if n > 2 else [])  # a ring of 2 is pairwise

    def once(algo: str) -> None:
        if op == "reduce_scatter":
            _reduce_scatter_with(algo, shard, full, group, False, None).wait()
        else:
            _all_gather_with(algo, full, shard, group, None).wait()

    reps = _PROBE_REPEATS[c]
    times = torch.zeros(len(cands), reps, dtype=torch.float64)
    for i in range(reps):
        for j, a in enumerate(cands):  # interleaved: drift hits every candidate alike
            dist.barrier(group=group)  # all start together: no rank times another's lateness
            t0 = time.perf_counter()
            once(a)
            times[j, i] = time.perf_counter() - t0
    best_t = times.min(dim=1).values  # warm-up and preemption only ever add time
    dist.all_reduce(best_t, op=dist.ReduceOp.MAX, group=group)  # agreed: all ranks pick the same
    sec = best_t.tolist()
    free_scratch()  # the probe's receive buffers are not the caller's
    best = min(range(1, len(cands)), key=lambda j: sec[j])
    algo = cands[best] if sec[best] < _P2P_MARGIN * sec[0] else "native"
    return {
        "algorithm": algo,
        "times_ms": {a: round(t * 1e3, 3) for a, t in zip(cands, sec)},
        "probe_bytes": numel * 4,
        "seconds": round(time.perf_counter() - t_start, 4),  # this rank's wall time
    }


def _reset_choices() -> None:
    """Forget per-group state (the group objects die with the process group)."""
    for d in (_choices, _tags, _avg_ok):
        d.clear()
    free_scratch()
    _logged.clear()
    for k in [k for k in _overrides if k[0] is not None]:
        del _overrides[k]


def all_reduce(
    t: torch.Tensor,
    op: str = "sum",
    *,
    group=None,
    log: CommLog | None = None,
    timeout_s: float | None = None,
    what: str = "",
) -> torch.Tensor:
    """Blocking in-place all-reduce of a small tensor (norms, overflow flags); op sum or max;
    bounded by ``timeout_s`` as `Handle.wait`."""
    if log is not None:
        log.all_reduce_calls += 1
    if world_size(group) > 1:
        rop = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op]
        if timeout_s is None:
            dist.all_reduce(t, op=rop, group=group)
        else:
            _wait(dist.all_reduce(t, op=rop, group=group, async_op=True), timeout_s, what)
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
        _reset_choices()
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


def default_device(group=None) -> torch.device:
    """The device collectives of ``group`` work on (CPU without a process group)."""
    return _device(group) if is_initialized() else torch.device("cpu")
