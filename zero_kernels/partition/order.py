"""Stage 3: every rank launches the same collectives in the same order (`SequenceCheck`).

Stage 3 matches its all-gathers and reduce-scatters by their order (see [Note: units]); this
module checks that order across ranks, per pass, and turns a wait that can never complete (a rank
that ran fewer modules) into an error on every rank ([Note: watched waits] in comm/base.py).
"""

from __future__ import annotations

import json
import threading
import time
import uuid
import weakref

import torch

from .. import comm
from .phase import PhaseTracker


class SequenceCheck(comm.Watch):
    """Stage 3 (check_order "pass" or "every"): every rank launches the same all-gathers and
    reduce-scatters in the same order. The collectives are matched by their order; a rank whose
    module order changed after the first step would otherwise abort in gloo where sizes differ,
    or exchange one unit's values for another's where they agree. The comparison runs on the
    optimizer's gloo side group (its own sequence: a mismatch on the main group cannot shift
    it). ``None`` side group (world size 1): nothing to check.

    "pass": each launch, and each unit's forward, is folded into a running hash; at the end of
    every forward (before its output is returned) and of every backward (before the gradients
    are published) one small blocking all-reduce compares the hashes: two per training step,
    whatever the number of units. A difference is a ValueError on every rank naming the first
    entry that differs (found by exchanging the pass's lists, on the error path only). Values
    may have been exchanged between the wrong units by then, but none has reached a returned
    output or the optimizer. The unit forwards count so that ranks that run different modules
    differ at the end of the forward even where their all-gathers agree (a prefetched unit is
    gathered, and freed unused, on the rank that skips it), before a backward whose collectives
    would differ in size, which gloo answers by aborting the process.

    Fewer modules on one rank (it skipped one at the end, or with prefetch off) would leave the
    others waiting for a collective it never launches while it waits at the end of the pass:
    a hang. So the waits of a pass are watched ([Note: watched waits]). Once one has lasted
    ``probe_s``, the waiting rank's monitor thread posts its list, and whether it ended the
    pass, to the process group's key-value store and reads the others'. Two lists that differ
    where both have an entry, or a list longer than that of a rank that ended the pass, cannot
    be waited out: the first rank to see it posts the error; every rank reads it, posts its
    final list, and launches on scratch buffers the collectives that the longest list has beyond
    its own (and the end-of-pass all-reduce, where it did not end the pass), so that every wait
    in progress completes; then every rank raises the same ValueError. Lists that agree (a slow
    rank) are waited for, up to ``timeout``. Nothing is exchanged unless a wait lasts.

    "every": one blocking all-reduce before each launch, so the first launch that differs is a
    ValueError on every rank before anything is sent, at the cost of a rendezvous per launch."""

    _MOD = (1 << 61) - 1  # the running hash: a polynomial in the launch codes, modulo a prime
    probe_s = 2.0

    def __init__(
        self,
        side,
        names: dict[tuple[str, int, int], str],
        timeout: float | None,
        mode: str,
        fill=None,
        split: bool = False,
        stop_shm=None,
    ):
        assert mode in ("pass", "every"), mode
        assert not (split and mode == "every"), "every launch is compared in one sequence"
        self.side, self.names, self.timeout, self.mode = side, names, timeout, mode
        self.fill = fill  # (kind, i, b) -> a handle: that collective on scratch buffers
        self.phase = PhaseTracker()  # the optimizer's ([Note: phase]): which pass waits
        self.stop_shm = stop_shm  # () -> None: every shared-memory wait of the groups raises
        self.codes = {key: k for k, key in enumerate(sorted(names))}
        self.keys = {k: key for key, k in self.codes.items()}
        # the sequences compared apart: one, or (split) the reduce-scatters on a group of
        # their own and the rest (see [Note: backward gathers] in partition/units.py)
        self.streams = 2 if split else 1
        self.stream_of = {
            k: int(split and key[0] == "reduce_scatter") for key, k in self.codes.items()
        }
        self.events = (
            ("all-gathers and unit forwards (in order)", "reduce-scatters (in order)")
            if split
            else ("collectives and unit forwards (in order)",)
        )
        self.describe = lambda: ""
        self.hash = [0] * self.streams
        self.launched: list[list[int]] = [[] for _ in range(self.streams)]  # per sequence:
        # what this pass launched and ran ("pass")
        self.passes = 0  # passes ended
        self.ending: list[list[int]] | None = None  # the lists while at the end of a pass
        self.ending_which = ""
        self.blocked_at: float | None = None  # a main-group wait of a pass in progress since
        self.blocked_which = "forward"
        self.failure: str | None = None  # the error, once found (raised on every rank)
        self.posted = None
        self.responded = False
        self.filled: list = []  # the scratch collectives launched (kept alive)
        self.lock = threading.Lock()  # the monitor and the rank's own thread probe in turn
        self.store, self.prefix = None, ""
        if side is not None and mode == "pass":
            self.store = comm.kv_store()
            token = uuid.uuid4().hex[:16] if comm.rank(side) == 0 else None
            self.prefix = f"zero_kernels/order/{comm.broadcast_object(token, 0, group=side)}/"
        if self.store is not None:
            self.stop = threading.Event()
            threading.Thread(
                target=_monitor, args=(weakref.ref(self), self.stop), daemon=True
            ).start()

    def close(self) -> None:
        if self.store is not None:
            self.stop.set()

    @property
    def watch(self) -> SequenceCheck | None:
        """What the main-group waits of a pass pass as ``watch``: this check, when it can
        diagnose (a store to post to)."""
        return self if self.store is not None else None

    # ---- the waits of a pass (comm.Watch)
    def enter(self) -> None:
        if self.failure is not None:
            self._fail()
        self.blocked_which = "backward" if self.phase.backward else "forward"
        self.blocked_at = time.monotonic()

    def leave(self, error: BaseException | None = None) -> None:
        self.blocked_at = None
        if error is not None and self.failure is None:
            self._probe()  # why: a rank that found the error may have ended its process
        if self.failure is not None:
            self._fail(error)

    def _fail(self, error: BaseException | None = None) -> None:
        """Raise the error found, once this rank has answered it (`_respond`, which the monitor
        may be running: after the raise this thread may block in the store, which the monitor
        needs, or exit, closing the connections the others' scratch collectives use)."""
        self._probe()
        raise ValueError(self.failure) from error

    def __call__(self, kind: str, i: int, b: int) -> None:
        """Before launching collective (kind, bucket i, b)."""
        if self.side is None:
            return
        code = self.codes[(kind, i, b)]
        if self.mode == "pass":
            if self.failure is not None:
                self._fail()
            self._fold(code)
            return
        t = torch.tensor([code, -code], dtype=torch.int64)
        what = f"{self.describe()}: order check"
        comm.all_reduce(t, "max", group=self.side, timeout_s=self.timeout, what=what)
        hi, lo = int(t[0]), -int(t[1])
        if hi != code or lo != code:
            other = self.names[self.keys[hi if hi != code else lo]]
            raise ValueError(
                f"stage 3: this rank is about to launch the {self.names[self.keys[code]]} where "
                f"another rank launches the {other}: {self._WHY}; nothing was sent. {self._FIX}"
            )

    def _fold(self, code: int) -> None:
        s = self.stream_of[code]
        self.hash[s] = (self.hash[s] * 1_000_003 + code + 1) % self._MOD
        self.launched[s].append(code)

    def called(self, k: int) -> None:
        """ "pass": unit ``k``'s forward runs (outside a recomputation): see the class doc."""
        if self.side is not None and self.mode == "pass":
            self._fold(self.codes[("order", k, 0)])

    _WHY = (
        "the ranks' module order (or set) differs in this forward or backward, and collectives "
        "are matched by order"
    )
    _FIX = "Every rank must call the same modules in the same order at stage 3"
    _SPOILED = (
        "Values may have been exchanged between the wrong units, so params, buffers and "
        "gradient shards of this step are not valid, and the process group's collectives may be "
        "out of step: restart the processes from a checkpoint."
    )

    def _name(self, c: int | None) -> str:
        return "nothing" if c is None else f"the {self.names[self.keys[c]]}"

    def end_pass(self, which: str) -> None:
        """ "pass": the end of a forward or backward (``which``): every rank launched the same
        collectives since the last check, or a ValueError on every rank."""
        if self.side is None or self.mode != "pass":
            return
        if self.failure is not None:
            self._fail()
        h, launched = self.hash, self.launched
        self.hash, self.launched = [0] * self.streams, [[] for _ in range(self.streams)]
        t = torch.tensor([x for v in h for x in (v, -v)], dtype=torch.int64)
        what = f"{self.describe()}: order check at the end of {which}"
        self.ending, self.ending_which = launched, which
        try:
            comm.all_reduce(
                t, "max", group=self.side, timeout_s=self.timeout, what=what, watch=self.watch
            )
        finally:
            self.ending = None
            self.passes += 1
        if all(int(t[2 * s]) == v and -int(t[2 * s + 1]) == v for s, v in enumerate(h)):
            return
        every = comm.all_gather_object(launched, group=self.side)
        me = comm.rank(self.side)
        where = (
            "the ranks reached this check from different places (a forward on some, a "
            "backward on others)"
        )
        for s in range(self.streams):  # every rank ended: the first entry that differs
            diff = first_difference({r: (True, x[s]) for r, x in enumerate(every)})
            if diff is not None:
                k = diff[0]
                col = [x[s][k] if k < len(x[s]) else None for x in every]
                other = next(c for c in col if c != col[me])
                where = (
                    f"#{k + 1} of this {which}'s {self.events[s]} was {self._name(col[me])} "
                    f"on rank {me} where another rank ran {self._name(other)}"
                )
                break
        raise ValueError(f"stage 3: {where}: {self._WHY}. {self._SPOILED} {self._FIX}")

    # ---- a wait that lasts (see the class doc)
    def _probe(self) -> None:
        """Post, read, and when the error is found, answer it (`_respond`); never raises (a
        failing store: nothing found)."""
        with self.lock:
            try:
                if self.failure is None:
                    self.failure = self._diagnose()
                if self.failure is not None and not self.responded:
                    self.responded = True
                    self._respond()
            except (RuntimeError, OSError, ValueError):  # the store (its host may have exited)
                pass

    def _mine(self) -> tuple[bool, list[list[int]], str]:
        ended = self.ending is not None
        if ended:
            return True, [list(x) for x in self.ending], self.ending_which
        return False, [list(x) for x in self.launched], self.blocked_which

    def _diagnose(self) -> str | None:
        """The error every rank raises (read from the store when another rank found it first),
        or None."""
        store, found = self.store, f"{self.prefix}found"
        if store.check([found]):
            return store.get(found).decode()
        me, n = comm.rank(self.side), comm.world_size(self.side)
        ended, mine, which = self._mine()
        state = {"pass": self.passes, "ended": ended, "launched": mine, "which": which}
        if state != self.posted:
            store.set(f"{self.prefix}{me}", json.dumps(state))
            self.posted = state
        lists = {me: (ended, mine)}
        for r in range(n):
            key = f"{self.prefix}{r}"
            if r == me or not store.check([key]):
                continue
            other = json.loads(store.get(key))
            if other["pass"] == self.passes:  # an older post is from a pass that ended well
                lists[r] = (other["ended"], other["launched"])
                if other["ended"]:
                    which = other["which"]
        for seq in range(self.streams):
            one = {q: (ended, x[seq]) for q, (ended, x) in lists.items()}
            diff = first_difference(one)
            if diff is not None:
                break
        else:
            return None
        k, r, s = diff
        ran = lambda q: (  # noqa: E731
            f"ran {self._name(one[q][1][k])}"
            if k < len(one[q][1])
            else f"ended the {which} after {k}"
        )
        msg = (
            f"stage 3: #{k + 1} of this {which}'s {self.events[seq]} differs between the ranks: "
            f"rank {r} {ran(r)} where rank {s} {ran(s)}, so a rank waits for a collective that "
            f"another will never launch (found when a wait lasted {self.probe_s:g} s, instead "
            f"of a hang): {self._WHY}. {self._SPOILED} {self._FIX}"
        )
        store.set(found, msg)
        return msg

    def _respond(self) -> None:
        """The error is found: post this rank's final list, read every rank's (up to
        ``max(10, 3 * probe_s)`` s: a rank posts once one of its waits lasts), and launch the
        collectives the longest list has beyond this rank's, on scratch buffers, and, on a rank
        that did not end the pass, the end-of-pass all-reduce (none waited for), so that no rank
        stays blocked in a wait; then every rank raises."""
        me, n = comm.rank(self.side), comm.world_size(self.side)
        _, mine, _ = self._mine()
        self.store.set(f"{self.prefix}final/{me}", json.dumps(mine))
        lists = {me: mine}
        deadline = time.monotonic() + max(10.0, 3 * self.probe_s)
        while len(lists) < n and time.monotonic() < deadline:
            for r in range(n):
                key = f"{self.prefix}final/{r}"
                if r not in lists and self.store.check([key]):
                    lists[r] = json.loads(self.store.get(key))
            if len(lists) < n:
                time.sleep(0.02)
        if self.stop_shm is not None:  # shm waits (a launch's too) end at once, on every rank
            self.stop_shm()
        if self.fill is not None:
            for s in range(self.streams):
                longest = max((x[s] for x in lists.values()), key=len)
                for code in longest[len(mine[s]) :]:
                    key = self.keys[code]
                    if key[0] != "order":  # a unit forward: nothing launched
                        try:
                            self.filled.append(self.fill(key))
                        except (ValueError, RuntimeError):  # an shm launch on a stopped channel
                            pass
        if self.ending is None:  # the end-of-pass all-reduce of the ranks that ended the pass
            t = torch.zeros(2 * self.streams, dtype=torch.int64)  # as `end_pass`'s
            self.filled.append(comm.all_reduce_start(t, "max", group=self.side))


def _monitor(ref, stop: threading.Event) -> None:
    """A `SequenceCheck`'s monitor: probes when a main-group wait of a pass has lasted
    ``probe_s`` (until the check is closed or collected)."""
    while True:
        me = ref()
        if me is None:
            return
        probe = me.probe_s
        del me
        if stop.wait(probe):
            return
        me = ref()
        if me is None:
            return
        t = me.blocked_at
        if t is not None and time.monotonic() - t >= me.probe_s:
            me._probe()
        del me


def first_difference(lists: dict[int, tuple[bool, list]]) -> tuple[int, int, int] | None:
    """The first position k where two ranks' launch lists cannot both be completed, and the two
    ranks (lower first): their entries differ, or one rank ended the pass (``True``) before k
    while the other launched an entry there. A list that is only shorter (a rank behind, still
    in the pass) differs in nothing yet."""
    ranks = sorted(lists)
    longest = max(len(x) for _, x in lists.values())
    for k in range(longest):
        seen: dict = {}  # entry at k (None: ended before k) -> a rank
        for r in ranks:
            ended, x = lists[r]
            if k < len(x):
                entry = x[k]
            elif ended:
                entry = None
            else:
                continue  # not there yet: it may still launch anything
            seen.setdefault(entry, r)
        if len(seen) > 1:
            r, s = sorted(seen.values())[:2]
            return k, r, s
    return None
