"""Reduce-scatter and all-gather through shared memory, for gloo ranks on one host (CPU tensors).

[Note: shared-memory collectives]
gloo moves every byte between ranks of one host through loopback TCP: a copy into the kernel, a
copy out, and threads that compete with the compute for the cores. The ``shm`` algorithm lets the
ranks of a group exchange through files in ``/dev/shm`` that all of them map instead.

- A *channel* per process group (a twin group has one of its own): a small control file of 32-bit
  words, and ``SLOTS`` data slots used in turn (piece t of the group's sequence in slot
  t mod SLOTS). Each slot is a file sized for the largest piece it held; a larger one replaces
  it (a new generation, the same decision on every rank because every rank launches the same
  collectives in the same order). A file is unlinked as soon as every rank has mapped it (an
  atomic count in the control file) and at exit, so it does not outlive the processes however
  they end, unless a rank is killed between creating and mapping it.
- Pieces: a collective goes through the slots in pieces of at most `SLOT_BYTES` / N of one
  rank's data (all-gather: a stretch of the shard; reduce-scatter: the same stretch of every
  chunk), so a slot holds at most `SLOT_BYTES` (4 MiB) and what a rank maps stays bounded (2 x
  4 MiB per group) whatever the number of ranks and the bucket or unit size.
- Launch: for each piece the rank copies its part into the slot (all-gather: its piece at its
  row; reduce-scatter: its rows in a region of its own) and *posts* the piece's number in its
  word of the slot, with the kind and size alongside (one release). Wait: for every other rank,
  wait for its post (a futex, the GIL released), then read (all-gather: the other rows into
  ``output``; reduce-scatter: this rank's row of every region, summed in the p2p order of
  [Note: algorithms], so the algorithms agree bit for bit at N = 2), then post that it has
  *consumed* the slot.
- A slot is reused (piece t + SLOTS) only after every rank consumed it. A rank that launches
  t + SLOTS before waiting for t finishes t itself first (its posts were all made: every rank
  launches t before t + SLOTS), so launching any number of collectives before waiting any is
  safe, and every wait a launch makes depends only on what the other ranks do at or before the
  same launch. A collective of more pieces than slots is therefore a rendezvous at its launch;
  those waits are bounded, named and watched like a handle's ([Note: watched waits]).
- Which groups: only one whose ranks all share a host, proven by a file one rank writes and the
  others read (`host_groups`, [Note: hosts are proven] in hosts.py); for a group whose ranks span
  hosts `capable` returns why not, naming them, so the probe never times shm there and an
  explicit request (`set_algorithm`, ``ZERO_KERNELS_COMM_ALGO=shm``) raises that reason. The
  control file holds a random token of rank 0's, which every rank checks once it has mapped the
  file (opened without creating it).
- Every wait is bounded by the caller's timeout, else the group's (a `CollectiveTimeout`). A
  rank that finds another rank posted a different collective (kind or size) under the same
  number poisons the channel, so every rank waiting on it raises a ValueError at once instead of
  reading another collective's data; stage 3's order check poisons its groups' channels once it
  has found the ranks' collectives differ (`poison`).
- Memory: each rank maps the slots; an all-gather slot holds N pieces, a reduce-scatter slot N
  regions of N pieces' rows (each rank touches its region and its row of the others'). The pages
  are shared: a rank's RSS counts those it touched (`mapped_bytes` bounds them).

Measured (docs/benchmarks.md, "Shared-memory collectives"): at 2 ranks and 4-76 MB, 0.55-0.76x the
pairwise exchange's time (0.48-0.66x at 4 ranks); a stage-3 step 0.84-0.87x (communication-heavy)
and 0.92-0.96x (compute-heavy) of the same code without it. The probe ([Note: choosing the
algorithm]) picks it per size class where it is faster on the machine at hand.
"""

from __future__ import annotations

import atexit
import os
import secrets
import threading

import torch
import torch._dynamo
import torch.distributed as dist

from . import hosts as _hosts
from .base import CollectiveTimeout, rank, world_size
from .hosts import host_groups

SLOTS = 2
SLOT_BYTES = 4 << 20  # the most one slot holds: N pieces of SLOT_BYTES / N of each rank's data
_WORDS_PER_RANK = 16  # 64 bytes: a rank's words of a slot share no cache line with another's
_POISON = 0  # word index: nonzero once a rank found the ranks launched different collectives
_TOKEN = 4  # word index: 16 random bytes rank 0 wrote, which every rank checks once mapped
_OPENED = 16  # word index + slot: how many times the slot's files were mapped, over all ranks
_RANK_BASE = 64
# per (slot, rank): 0 posted number, 1 kind, 2 numel low, 3 numel high, 4 consumed number
_POSTED, _KIND, _CONSUMED = 0, 1, 4
_KINDS = {"all_gather": 1, "reduce_scatter": 2}
_ALIGN = 1 << 21  # slot files are sized in 2 MiB steps


def _lib():
    from .. import native

    return native.load()


def available() -> str | None:
    """None when this process can run shared-memory collectives, else why not."""
    lib = _lib()
    if lib is None or not hasattr(lib, "shm_post_with"):
        return "the native extension zero_kernels._C is not built (or predates shm)"
    if not lib.shm_supported():
        return "the native extension has no futex support here (Linux only)"
    if not os.path.isdir(_hosts.SHM_DIR):
        return f"{_hosts.SHM_DIR} does not exist"
    return None


class _Channel:
    """The shared files of one process group and this rank's view of them."""

    def __init__(self, group, base: str, ctrl: torch.Tensor, fd: int, timeout_s: float):
        self.group = group
        self.fd = fd  # the control file, this rank's lock on byte r held through it
        self.n, self.r = world_size(group), rank(group)
        self.base = base
        self.ctrl = ctrl  # int32 words
        self.addr0 = ctrl.data_ptr()
        self.timeout_s = timeout_s
        self.seq = 0
        self.lock = threading.Lock()  # launches (the stage-3 monitor may launch from a thread)
        self.data: list[torch.Tensor | None] = [None] * SLOTS
        self.gen = [0] * SLOTS
        self.occupant: list = [None] * SLOTS  # the last work launched in each slot
        self.paths: set = set()  # mapped files this rank may still have to unlink
        self.pid = os.getpid()  # a forked child (a DataLoader worker) leaves the files alone

    # -- words
    def word(self, i: int) -> int:
        return self.addr0 + 4 * i

    def rank_word(self, k: int, q: int, j: int) -> int:
        return self.word(_RANK_BASE + (k * self.n + q) * _WORDS_PER_RANK + j)

    def wait_word(
        self, addr: int, target: int, timeout_s: float | None, what: str, peer: int
    ) -> None:
        t = self.timeout_s if timeout_s is None else timeout_s
        res = _lib().shm_wait_ge(addr, target, self.word(_POISON), t, self.fd, peer)
        if res == 1:
            raise CollectiveTimeout(
                f"{what}: not every rank took part within {t:g} s (a rank stalled, died or ran "
                "a different collective)"
            )
        if res == 3:
            raise RuntimeError(
                f"{what}: rank {peer} of the group ended (its process is gone) while this rank "
                "waited for it"
            )
        if res == 2:
            raise ValueError(
                f"{what}: the ranks launched different collectives on this group (another rank "
                "found it and stopped the shared-memory channel; its error says which)"
            )

    def poison(self) -> None:
        lib = _lib()
        lib.shm_post(self.word(_POISON), 1)
        for k in range(SLOTS):  # wake every waiter: they see the poison
            for q in range(self.n):
                for j in (_POSTED, _CONSUMED):
                    lib.shm_wake(self.rank_word(k, q, j))

    # -- slots
    def slot(self, k: int, nbytes: int) -> torch.Tensor:
        """Slot ``k``'s mapping, at least ``nbytes`` long (the same decision on every rank)."""
        d = self.data[k]
        if d is not None and d.numel() >= nbytes:
            return d
        size = -(-nbytes // _ALIGN) * _ALIGN
        self.gen[k] += 1
        path = f"{self.base}-s{k}-g{self.gen[k]}"
        self.data[k] = None
        fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
        try:
            self.paths.add(path)
            os.ftruncate(fd, size)
            os.posix_fallocate(fd, 0, size)  # no SIGBUS later: space is taken now or never
        except OSError as e:
            self.poison()
            raise RuntimeError(
                "shared-memory collectives: cannot allocate "
                f"{size} bytes in {_hosts.SHM_DIR} ({e}); "
                "free space there or set ZERO_KERNELS_COMM_ALGO=native"
            ) from e
        finally:
            os.close(fd)
        self.data[k] = torch.from_file(path, shared=True, size=size, dtype=torch.uint8)
        before = _lib().shm_fetch_add(self.word(_OPENED + k), 1)
        if (before + 1) % self.n == 0:  # the last rank to map this generation
            _unlink(path)
        return self.data[k]

    def close(self) -> None:
        if os.getpid() == self.pid:
            for p in list(self.paths):
                _unlink(p)
            if self.fd >= 0:
                os.close(self.fd)  # releases this rank's lock: the others see it gone
                self.fd = -1
        self.paths.clear()
        self.data = [None] * SLOTS
        self.occupant = [None] * SLOTS


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _typed(buf: torch.Tensor, offset: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    return buf[offset : offset + numel * dtype.itemsize].view(dtype)


class _ShmWork:
    """One piece of a shared-memory collective: posted at launch, read (and marked consumed) by
    `wait`. All-gather: ``x`` (p,) this rank's piece, ``out`` (N, p) rows of the output.
    Reduce-scatter: ``x`` (N, p) this rank's input rows, ``out`` (p,) of the output."""

    takes_seconds = True  # wait(timeout_s) bounds itself (see base._wait)

    def __init__(self, ch: _Channel, k: int, t: int, kind: str, out, x, p: int):
        self.ch, self.k, self.t, self.kind = ch, k, t, kind
        self.out, self.x, self.p = out, x, p
        self.dtype, self.es = x.dtype, x.element_size()
        self.numel = ch.n * p  # of the piece's full buffer: what the ranks compare
        self.done = False
        self.lock = threading.Lock()

    def is_completed(self) -> bool:
        if self.done:
            return True
        lib, ch = _lib(), self.ch
        return all(
            ((lib.shm_load(ch.rank_word(self.k, q, _POSTED)) - self.t) & 0xFFFFFFFF) < (1 << 31)
            for q in range(ch.n)
            if q != ch.r
        )

    def wait(self, timeout_s: float | None = None) -> None:
        with self.lock:
            if not self.done:
                self._finish(timeout_s)
                self.done = True

    def _finish(self, timeout_s: float | None) -> None:
        ch, k, t, lib = self.ch, self.k, self.t, _lib()
        n, r, p = ch.n, ch.r, self.p
        what = f"shared-memory {self.kind} number {t} of this group"
        for q in range(n):
            if q == r:
                continue
            ch.wait_word(ch.rank_word(k, q, _POSTED), t, timeout_s, what, q)
            got = (
                lib.shm_load(ch.rank_word(k, q, _POSTED)) & 0xFFFFFFFF,
                lib.shm_load(ch.rank_word(k, q, _KIND)),
                _numel_at(ch, k, q),
            )
            mine = (t & 0xFFFFFFFF, _KINDS[self.kind], self.numel)
            if got != mine:
                ch.poison()
                raise ValueError(
                    f"{what}: rank {q} of the group launched another collective under this "
                    f"number (kind {got[1]}, {got[2]} elements; this rank: {self.kind}, "
                    f"{self.numel} elements): the ranks launched different collectives"
                )
        buf = ch.data[k]
        if self.kind == "all_gather":  # rank q's piece at q * p
            for q in range(n):
                if q != r:
                    self.out[q].copy_(_typed(buf, q * p * self.es, p, self.dtype))
        else:  # rank q's rows at q * n * p; ((x[r+1] + x[r+2]) + ...) + x[r] ([Note: algorithms])

            def part(q: int) -> torch.Tensor:
                return _typed(buf, (q * n + r) * p * self.es, p, self.dtype)

            out = self.out
            if n == 2:
                torch.add(part((r + 1) % n), part(r), out=out)
            else:
                torch.add(part((r + 1) % n), part((r + 2) % n), out=out)
                for j in range(3, n + 1):
                    out.add_(part((r + j) % n))
        lib.shm_post(ch.rank_word(k, r, _CONSUMED), t)
        self.out = self.x = None  # the Handle keeps the tensors alive until it is waited


class _Pieces:
    """A collective larger than a piece: its pieces, launched one after the other."""

    takes_seconds = True

    def __init__(self, works: list):
        self.works = works

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self.works)

    def wait(self, timeout_s: float | None = None) -> None:
        for w in self.works:
            w.wait(timeout_s)


def _numel_at(ch: _Channel, k: int, q: int) -> int:
    lib = _lib()
    lo = lib.shm_load(ch.rank_word(k, q, _KIND + 1)) & 0xFFFFFFFF
    hi = lib.shm_load(ch.rank_word(k, q, _KIND + 2)) & 0xFFFFFFFF
    return lo | (hi << 32)


def launch(
    kind: str,
    out: torch.Tensor,
    x: torch.Tensor,
    group,
    timeout_s: float | None = None,
    what: str = "",
    watch=None,
):
    """Post this rank's part of ``kind`` (output ``out``, input ``x``, both 1-D contiguous), in
    pieces of at most `SLOT_BYTES` / N of this rank's data each; the work to wait for.

    A launch waits where a slot is still in use (more pieces in flight than `SLOTS`): those waits
    are bounded by ``timeout_s`` (default the group's timeout), named by ``what`` and marked on
    ``watch`` like a handle's ([Note: watched waits]); the watch is left outside the channel's
    lock, so that its monitor can launch on the channel meanwhile."""
    ch = channel(group)
    if watch is not None:
        watch.enter()
    try:
        work = _launch(ch, kind, out, x, timeout_s, what)
    except BaseException as e:
        if watch is not None:
            watch.leave(e)
        raise
    if watch is not None:
        watch.leave()
    return work


def _launch(ch: _Channel, kind: str, out, x, timeout_s: float | None, what: str):
    n = ch.n
    es = x.element_size()
    if kind == "all_gather":
        s = x.numel()
        rows = out.view(n, s)
        step = max(1, SLOT_BYTES // n // es)
        pieces = [(rows[:, a : a + step], x[a : a + step]) for a in range(0, s, step)]
    else:
        s = out.numel()
        rows = x.view(n, s)
        step = max(1, SLOT_BYTES // n // (n * es))
        pieces = [(out[a : a + step], rows[:, a : a + step]) for a in range(0, s, step)]
    with ch.lock:  # a collective's pieces are consecutive numbers, whichever thread launches
        works = [_launch_piece(ch, kind, o, i, timeout_s, what) for o, i in pieces]
    return works[0] if len(works) == 1 else _Pieces(works)


def _launch_piece(
    ch: _Channel, kind: str, out: torch.Tensor, x: torch.Tensor, timeout_s, what: str
) -> _ShmWork:
    lib = _lib()
    n, r = ch.n, ch.r
    ch.seq += 1
    t, k = ch.seq, ch.seq % SLOTS
    prev = ch.occupant[k]
    if prev is not None:  # reuse: every rank has consumed the slot's last piece
        prev.wait(timeout_s)  # this rank's part, if not yet waited: its posts were all made
        for q in range(n):
            if q != r:
                ch.wait_word(
                    ch.rank_word(k, q, _CONSUMED),
                    prev.t,
                    timeout_s,
                    f"{what + ': ' if what else ''}launch of shared-memory {kind} number {t} "
                    f"(its slot still holds number {prev.t})",
                    q,
                )
    es = x.element_size()
    if kind == "all_gather":
        p = x.numel()
        buf = ch.slot(k, n * p * es)
        _typed(buf, r * p * es, p, x.dtype).copy_(x)
        if out[r].data_ptr() != x.data_ptr():  # not in place
            out[r].copy_(x)
    else:
        p = out.numel()
        buf = ch.slot(k, n * n * p * es)
        _typed(buf, r * n * p * es, n * p, x.dtype).view(n, p).copy_(x)
    meta = [_KINDS[kind], (n * p) & 0xFFFFFFFF, (n * p) >> 32]  # words 1-3
    lib.shm_post_with(ch.rank_word(k, r, _POSTED), meta, t)  # one release publishes the lot
    work = _ShmWork(ch, k, t, kind, out, x, p)
    ch.occupant[k] = work
    return work


CHANNELS: dict = {}  # group key -> _Channel
_capable: dict = {}  # group key -> None (capable) or why not


def _pg(group):
    return dist.group.WORLD if group is None else group


def channel_key(group) -> tuple:
    # by id, the group object held in `_capable` and compared by identity there: a reused id
    # is found stale and its channel closed (the other caches: [Note: group keys] in base.py)
    return (id(_pg(group)), world_size(group))


def _timeout_s(group) -> float:
    pg = dist.group.WORLD if group is None else group
    try:
        td = pg._get_backend(torch.device("cpu")).options._timeout
        return td.total_seconds()
    except (AttributeError, RuntimeError):
        return 1800.0  # torch's default for gloo


def capable(group) -> str | None:
    """None when every rank of ``group`` shares /dev/shm with the others, proven by a file one
    rank wrote and every other read (`hosts.host_groups`, [Note: hosts are proven]), and the
    group's channel is set up; else why not (a group whose ranks span hosts names them). The
    same answer on every rank. Collective on first call."""
    key, pg = channel_key(group), _pg(group)
    known = _capable.get(key)
    if known is None or known[0] is not pg:  # new, or another group object with a reused id
        stale = CHANNELS.pop(key, None)
        if stale is not None:
            stale.close()
        _capable[key] = known = (pg, _check(group))  # holds pg: its id is not reused meanwhile
    return known[1]


def _check(group) -> str | None:
    hosts = host_groups(group)  # collective, on every rank alike, whatever this rank has
    if len(hosts) > 1:
        return (
            f"its ranks are on {len(hosts)} hosts (no /dev/shm file one rank writes is seen by "
            f"every other); the group ranks that share one: {hosts}"
        )
    return _open(group)


def mapped_bytes() -> int:
    """Bytes of the shared slot files this process maps (every channel): memory the ranks of a
    host share, each rank's RSS counting the pages it touched."""
    return sum(d.numel() for ch in CHANNELS.values() for d in ch.data if d is not None)


def channel(group) -> _Channel:
    why = capable(group)
    if why is not None:
        raise ValueError(f"the shm collective algorithm cannot run on this group: {why}")
    return CHANNELS[channel_key(group)]


def _open(group) -> str | None:
    """Set up ``group``'s channel (collective): rank 0 creates the control file with a random
    token in it, every rank opens it without creating it, maps it and checks the token, and all
    agree whether that worked."""
    n, r = world_size(group), rank(group)
    token = secrets.token_bytes(16) if r == 0 else None
    why = available()
    base = None
    if why is None:  # room for the slots at their largest, with a margin for other users
        st = os.statvfs(_hosts.SHM_DIR)
        free, slots = st.f_bavail * st.f_frsize, SLOTS * SLOT_BYTES
        if free < 4 * slots:
            why = (
                f"{_hosts.SHM_DIR} has {free >> 20} MiB free; the slots take up to "
                f"{slots >> 20} MiB "
                "and 4 times that is asked for"
            )
    if r == 0 and why is None:
        base = os.path.join(_hosts.SHM_DIR, f"zero_kernels-{os.getpid()}-{secrets.token_hex(6)}")
        try:
            fd = os.open(base + "-ctrl", os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            try:
                os.ftruncate(fd, _ctrl_bytes(n))
                os.posix_fallocate(fd, 0, _ctrl_bytes(n))
                os.pwrite(fd, token, 4 * _TOKEN)
            finally:
                os.close(fd)
        except OSError as e:
            why, base = f"cannot create a file in {_hosts.SHM_DIR}: {e}", None
    made = base
    try:
        box = [(base, token)]
        gsrc = dist.get_global_rank(group, 0) if group is not None else 0
        dist.broadcast_object_list(box, src=gsrc, group=group)
        base, token = box[0]
        ctrl, fd = None, -1
        if base is not None and why is None:
            try:
                # opened without O_CREAT first: from_file(shared=True) would create an empty
                # file where this rank's /dev/shm has none ([Note: hosts are proven])
                fd = os.open(base + "-ctrl", os.O_RDWR)
                raw = torch.from_file(
                    base + "-ctrl", shared=True, size=_ctrl_bytes(n), dtype=torch.uint8
                )
                ctrl = raw.view(torch.int32)
                seen = bytes(raw[4 * _TOKEN : 4 * _TOKEN + 16].tolist())
                if seen != token:
                    why = f"{base}-ctrl holds another token: not the file rank 0 wrote"
                # after the mapping (which opened and closed the file: closing any descriptor
                # of a file drops the process's locks on it), a lock on byte r through the
                # descriptor kept open: the others tell from it whether this process lives
                elif not _lib().shm_hold(fd, r):
                    why = f"cannot lock byte {r} of {base}-ctrl"
            except (RuntimeError, OSError) as e:
                why = f"cannot open and map {base}-ctrl (made by rank 0 of the group): {e}"
        elif why is None:
            why = "rank 0 of the group could not set up the channel"
        whys = [None] * n
        dist.all_gather_object(whys, why, group=group)
    finally:
        if made is not None:
            _unlink(made + "-ctrl")  # every rank has mapped it, given up or failed
    bad = [(q, w) for q, w in enumerate(whys) if w is not None]
    if bad:
        if fd >= 0:
            os.close(fd)
        return f"rank {bad[0][0]} of the group: {bad[0][1]}"
    ch = _Channel(group, base, ctrl, fd, _timeout_s(group))
    CHANNELS[channel_key(group)] = ch
    return None


def _ctrl_bytes(n: int) -> int:
    return 4 * (_RANK_BASE + SLOTS * n * _WORDS_PER_RANK)


def poison(*groups) -> None:
    """Stop the shared-memory channels of ``groups`` (those set up): every wait on them, on every
    rank, raises at once. Stage 3's order check does it once it knows the ranks' collectives
    differ, so that no rank stays blocked in one (`zero_kernels.partition.order`)."""
    for g in groups:
        ch = CHANNELS.get(channel_key(g))
        if ch is not None and _capable.get(channel_key(g), (None,))[0] is _pg(g):
            ch.poison()


def close_all() -> None:
    """Unmap every channel and unlink what is left of its files (process groups are gone)."""
    for ch in CHANNELS.values():
        ch.close()
    CHANNELS.clear()
    _capable.clear()
    _hosts.forget()


atexit.register(close_all)

# Compiled autograd traces the gradient hooks that launch collectives: these run as they are
# (dynamo cannot trace object collectives, file mappings or futex waits).
_open = torch._dynamo.disable(_open)
launch = torch._dynamo.disable(launch)
_ShmWork.wait = torch._dynamo.disable(_ShmWork.wait)
_Pieces.wait = torch._dynamo.disable(_Pieces.wait)

__all__ = ["SLOTS", "available", "capable", "close_all", "launch", "mapped_bytes", "poison"]
