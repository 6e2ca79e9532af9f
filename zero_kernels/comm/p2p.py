"""Reduce-scatter and all-gather built on point-to-point operations, for backends whose own
collectives are slow (gloo).

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
"""

from __future__ import annotations

import datetime
import threading

import torch
import torch.distributed as dist

from .base import CollectiveTimeout, _nbytes, group_key, rank, world_size


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


TAG_BASE = 1 << 20  # clear of the small tags user code picks
_TAG_SPAN = 1 << 30
_tags: dict = {}  # group key -> next tag offset


def _group_key(group) -> tuple:
    return group_key(group)  # a token per group object, never its id ([Note: group keys])


def next_tag(group) -> int:
    key = _group_key(group)
    t = _tags.get(key, 0)
    _tags[key] = (t + 1) % _TAG_SPAN
    return TAG_BASE + t


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
    takes_seconds = True  # wait(timeout_s) bounds itself (see base._wait)

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
    takes_seconds = True

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
