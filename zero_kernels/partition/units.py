"""Stage 3: units of parameters gathered on demand, around the module's forward and backward.

[Note: units]
A *unit* is a module-aligned set of parameters gathered and freed together: by default each entry
of the model's largest ``nn.ModuleList`` (its repeated blocks), else each direct child holding at
least ``1 / 8`` of the parameters; the parameters left over (embeddings, final norm, head) form the
*root unit*. In the layout (see [Note: layout]) a unit's parameters are contiguous and its buckets
hold nothing else, so gathering a unit is one all-gather per bucket of it.

Per unit the state is explicit (`UnitState`, asserted at each transition):

    SHARDED --gather()--> GATHERING --wait()--> GATHERED --free()--> SHARDED

Timeline of one training step (units U1..U3 inside the root, prefetch=1):

    forward    root: gather R | U1 pre: wait AG U1, start AG U2 | U1 post: free U1 | U2 pre: ...
    backward   U3 pre-bwd: wait AG U3, start AG U2 | grads of U3 -> RS U3, free U3 | U2 ...
    end        free R and anything still gathered; the step updates shards only

- pre-forward: the unit is gathered (waiting for its prefetched all-gather) and the next
  ``prefetch`` units in forward order are started; post-forward: freed when
  ``reshard_after_forward`` (default) or when no backward will follow (``torch.no_grad``).
- pre-backward (a hook on the unit's outputs): the unit is gathered again if it was freed, the
  next units in backward order prefetched; post-backward: when every gradient of a bucket has
  arrived (the reducer's hook) its reduce-scatter starts and its params are freed.
- The root unit is gathered from the model's pre-forward to the end of backward.
- A module called twice re-gathers once per call (at most one extra gather); activation
  checkpointing re-runs a unit's forward inside backward, which gathers it if needed and does not
  free it after (its backward comes next); a parameter shared by two units lives in the first.
- The forward order is recorded in the first step and checked on every rank in that step (a small
  all-reduce per unit): ranks that run different modules get a ValueError naming them, never
  all-gathers that do not match. Later steps prefetch by the recorded order; a unit reached out of
  that order is gathered on demand, and prefetched units left unused are freed at the end.
"""

from __future__ import annotations

import enum
import json
import sys
import threading
import time
import uuid
import weakref

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_flatten

from .. import comm

__all__ = ["UnitState", "Unit", "UnitScheduler", "find_units"]


class UnitState(enum.Enum):
    SHARDED = "sharded"
    GATHERING = "gathering"
    GATHERED = "gathered"


class Unit:
    """One unit: its module, its buckets ``(buffer, bucket)``, its state and pending gathers."""

    def __init__(self, index: int, name: str, module: nn.Module, persistent: bool = False):
        self.index, self.name, self.module = index, name, module
        self.persistent = persistent  # small params kept whole: never freed
        self.buckets: list[tuple[int, int]] = []
        self.state = UnitState.SHARDED
        self.handles: list = []

    def expect(self, *states: UnitState) -> None:
        assert self.state in states, f"unit {self.name}: state {self.state}, expected {states}"

    def __repr__(self) -> str:
        return f"Unit({self.index}, {self.name!r}, {self.state.value}, {len(self.buckets)} bkts)"


def find_units(model: nn.Module, units=None) -> list[tuple[str, nn.Module]]:
    """``[(name, module)]`` of the units (the root unit not included); see [Note: units].

    ``units``: None (automatic), a list of module classes (every outermost instance is a unit),
    a predicate ``f(name, module) -> bool`` (outermost matches), or a list of modules."""
    named = list(model.named_modules())
    if units is None:
        best, size = None, 0
        for name, m in named:
            if isinstance(m, nn.ModuleList) and len(m) > 1:
                n = sum(p.numel() for p in m.parameters())
                if n > size:
                    best, size = (name, m), n
        if best is not None:
            return [(f"{best[0]}.{k}" if best[0] else str(k), c) for k, c in enumerate(best[1])]
        total = sum(p.numel() for p in model.parameters())
        return [
            (n, c)
            for n, c in model.named_children()
            if sum(p.numel() for p in c.parameters()) * 8 >= total and total > 0
        ]
    if isinstance(units, (list, tuple)) and all(isinstance(u, nn.Module) for u in units):
        ids = {id(u) for u in units}
        pick = [(n, m) for n, m in named if id(m) in ids and m is not model]
        if len(pick) != len(units):
            raise ValueError(
                "units=: every module listed must be a submodule of the model (not the model)"
            )
        for a, _ in pick:
            for b, _ in pick:
                if a != b and b.startswith(a + "."):
                    raise ValueError(
                        f"units=: modules {a!r} and {b!r} overlap (one holds the other)"
                    )
    elif isinstance(units, (list, tuple)) and all(isinstance(u, type) for u in units):
        classes = tuple(units)
        pick = [(n, m) for n, m in named if isinstance(m, classes) and m is not model]
    elif callable(units):
        pick = [(n, m) for n, m in named if m is not model and units(n, m)]
    else:
        raise TypeError(
            "units must be None, a list of module classes, a list of modules or a predicate "
            f"(name, module) -> bool, got units={units!r}"
        )
    out: list[tuple[str, nn.Module]] = []  # outermost only: a unit inside a unit is not one
    for n, m in pick:
        if not any(n.startswith(o + ".") for o, _ in out):
            out.append((n, m))
    if not out:
        raise ValueError(f"units={units!r} matched no submodule of the model")
    return out


class UnitScheduler:
    """Module hooks that gather, prefetch and free units (see [Note: units])."""

    def __init__(
        self,
        model,
        units: list[Unit],
        root: Unit,
        store,
        runner,
        group,
        log,
        *,
        reshard_after_forward: bool,
        prefetch: int,
        persistent: Unit | None = None,
    ):
        self.units, self.root, self.store, self.runner = units, root, store, runner
        self.persistent = persistent
        self.all_units = [root, *units] + ([persistent] if persistent is not None else [])
        self.group, self.log = group, log
        self.reshard_after_forward, self.prefetch = reshard_after_forward, prefetch
        self.order: list[int] | None = None  # forward order of unit indices, once recorded
        self.recording: list[int] = []
        self.pos = 0  # position in the recorded order during a forward
        self._done: set[tuple[int, int]] = set()  # buckets whose grads all arrived
        self.timeout: float | None = None  # bound on each wait (the optimizer's ``timeout``)
        self.describe = lambda: ""  # where we are, for a timeout's message
        self.check = None  # SequenceCheck: every launch compared across ranks first
        self.handles = []
        me = weakref.ref(self)
        for u in units:
            self.handles.append(u.module.register_forward_pre_hook(_pre(me, u.index)))
            self.handles.append(u.module.register_forward_hook(_post(me, u.index)))
        self.handles.append(model.register_forward_pre_hook(_root_pre(me)))
        self.handles.append(model.register_forward_hook(_root_post(me)))
        self.by_index = {u.index: u for u in self.all_units}
        self.bucket_unit = {b: u for u in self.all_units for b in u.buckets}

    # ---- gather / free
    def gather(self, u: Unit) -> None:
        """Start the unit's all-gathers (SHARDED -> GATHERING); nothing if already under way."""
        if u.state is not UnitState.SHARDED:
            return
        for i, b in u.buckets:
            if self.check is not None:
                self.check("all_gather", i, b)
            self.store.alloc(i, b)
            u.handles.append(self.runner.gather(i, b, self.log, self.group))
        u.state = UnitState.GATHERING

    def wait(self, u: Unit) -> None:
        self.gather(u)
        if u.state is UnitState.GATHERING:
            watch = self.check.watch if self.check is not None else None
            for h in u.handles:
                h.wait(self.timeout, f"{self.describe()}: all-gather of unit {u.name}", watch)
            u.handles.clear()
            u.state = UnitState.GATHERED
        u.expect(UnitState.GATHERED)

    def free(self, u: Unit) -> None:
        if u.persistent:
            return
        if u.state is UnitState.GATHERING:
            self.wait(u)
        for i, b in u.buckets:
            self.store.free(i, b)
        u.state = UnitState.SHARDED

    def free_all(self) -> None:
        for u in self.all_units:
            self.free(u)

    def refresh_persistent(self) -> list:
        """After a step: all-gather the params kept whole (their shards were updated)."""
        if self.persistent is None:
            return []
        return [self.runner.gather(i, b, self.log, self.group) for i, b in self.persistent.buckets]

    # ---- forward
    def _check_same(self, u: Unit) -> None:
        """First step: every rank reaches the same unit here, or a ValueError on every rank."""
        t = torch.tensor([u.index, -u.index], dtype=torch.int64, device=self.store.device)
        watch = None
        if self.check is not None:  # a rank that ends the forward early is found (stalled)
            self.check("check", u.index, 0)
            watch = self.check.watch
        comm.all_reduce(t, "max", group=self.group, watch=watch)
        if int(t[0]) != u.index or int(t[1]) != -u.index:
            lo, hi = -int(t[1]), int(t[0])
            raise ValueError(
                "stage 3: ranks run different modules in forward (the order of units differs): "
                f"this rank runs {u.name!r}, another runs "
                f"{self.by_index[hi if hi != u.index else lo].name!r}; every rank must call the "
                "same modules in the same order at stage 3"
            )

    def pre_forward(self, k: int) -> None:
        if _compiled_autograd():
            raise RuntimeError(_NO_COMPILED_AUTOGRAD)
        u = self.by_index[k]
        if _in_backward():  # activation checkpointing: recomputation inside backward
            self.wait(u)
            return
        if self.order is None:
            if comm.world_size(self.group) > 1:
                self._check_same(u)
            self.recording.append(k)
            self.wait(u)
            return
        if self.check is not None:
            self.check.called(k)
        if self.pos < len(self.order) and self.order[self.pos] == k:
            self.pos += 1
        else:  # out of the recorded order: find it further on, else gather on demand
            try:
                self.pos = self.order.index(k, self.pos) + 1
            except ValueError:
                pass
        self.wait(u)
        for j in self.order[self.pos : self.pos + self.prefetch]:
            self.gather(self.by_index[j])

    def post_forward(self, k: int, output) -> None:
        u = self.by_index[k]
        if _in_backward():
            return
        if torch.is_grad_enabled():
            ts = [
                t
                for t in tree_flatten(output)[0]
                if isinstance(t, torch.Tensor) and t.requires_grad
            ]
            if ts:
                me = weakref.ref(self)
                torch.autograd.graph.register_multi_grad_hook(ts, _pre_bwd(me, k), mode="any")
            if self.reshard_after_forward:
                self.free(u)
        else:
            self.free(u)

    def root_pre(self) -> None:
        if _in_backward():
            self.wait(self.root)
            return
        self.pos = 0
        self.wait(self.root)
        if self.order is not None:
            for j in self.order[: self.prefetch]:
                self.gather(self.by_index[j])

    def root_post(self) -> None:
        if _in_backward():
            return
        if self.order is None:  # the first forward: recorded, and checked on every rank
            self.order = list(self.recording)
        self.recording = []
        if not torch.is_grad_enabled():
            self.free_all()
        if self.check is not None:  # before the output is returned
            self.check.end_pass("forward")

    # ---- backward
    def pre_backward(self, k: int) -> None:
        u = self.by_index[k]
        self.wait(u)
        order = self.order or []
        if k in order:
            at = len(order) - 1 - order[::-1].index(k)
            for j in order[max(0, at - self.prefetch) : at][::-1]:
                self.gather(self.by_index[j])

    def bucket_done(self, i: int, b: int) -> None:
        """Every gradient of bucket (i, b) arrived: its unit's params are not needed any more
        in this backward once all of the unit's buckets are done."""
        u = self.bucket_unit.get((i, b))
        if u is None or u is self.root or u.persistent:
            return
        self._done.add((i, b))
        if all(bk in self._done for bk in u.buckets):
            self.free(u)

    def end_backward(self) -> None:
        self._done = set()
        self.free_all()

    def remove(self) -> None:
        if self.check is not None:
            self.check.close()
        for h in self.handles:
            h.remove()
        self.handles.clear()


_NO_COMPILED_AUTOGRAD = (
    "ZeroOptimizer stage 3 does not run under compiled autograd (its params change storage "
    "between forward and backward, which the compiled backward's saved tensors do not "
    "follow); set torch._dynamo.config.compiled_autograd = False, or use stage 1 or 2, which "
    "run under it"
)


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
    where both have an entry, or a list
    longer than that of a rank that ended the pass, cannot be waited out: the first rank to see
    it posts the error; every rank reads it, posts its final list, and launches on scratch
    buffers the collectives that the longest list has beyond its own (and the end-of-pass
    all-reduce, where it did not end the pass), so that every wait in progress completes; then
    every rank raises the same ValueError. Lists that agree (a slow
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
    ):
        assert mode in ("pass", "every"), mode
        self.side, self.names, self.timeout, self.mode = side, names, timeout, mode
        self.fill = fill  # (kind, i, b) -> a handle: that collective on scratch buffers
        self.codes = {key: k for k, key in enumerate(sorted(names))}
        self.keys = {k: key for key, k in self.codes.items()}
        self.describe = lambda: ""
        self.hash = 0
        self.launched: list[int] = []  # what this pass launched and ran ("pass")
        self.passes = 0  # passes ended
        self.ending: list[int] | None = None  # the list while at the end of a pass
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
        self.blocked_which = "backward" if _in_backward() else "forward"
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
        self.hash = (self.hash * 1_000_003 + code + 1) % self._MOD
        self.launched.append(code)

    def called(self, k: int) -> None:
        """ "pass": unit ``k``'s forward runs (outside a recomputation): see the class doc."""
        if self.side is not None and self.mode == "pass":
            self._fold(self.codes[("order", k, 0)])

    _WHY = (
        "the ranks' module order (or set) differs in this forward or backward, and collectives "
        "are matched by order"
    )
    _FIX = "Every rank must call the same modules in the same order at stage 3"
    _EVENTS = "collectives and unit forwards (in order)"
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
        self.hash, self.launched = 0, []
        t = torch.tensor([h, -h], dtype=torch.int64)
        what = f"{self.describe()}: order check at the end of {which}"
        self.ending, self.ending_which = launched, which
        try:
            comm.all_reduce(
                t, "max", group=self.side, timeout_s=self.timeout, what=what, watch=self.watch
            )
        finally:
            self.ending = None
            self.passes += 1
        if int(t[0]) == h and -int(t[1]) == h:
            return
        every = comm.all_gather_object(launched, group=self.side)
        me = comm.rank(self.side)
        where = (
            "the ranks reached this check from different places (a forward on some, a "
            "backward on others)"
        )
        for k in range(max(len(x) for x in every)):
            col = [x[k] if k < len(x) else None for x in every]
            if len(set(col)) > 1:
                other = next(c for c in col if c != col[me])
                where = (
                    f"#{k + 1} of this {which}'s {self._EVENTS} was {self._name(col[me])} on "
                    f"rank {me} where another rank ran {self._name(other)}"
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

    def _mine(self) -> tuple[bool, list[int], str]:
        ended = self.ending is not None
        if ended:
            return True, list(self.ending), self.ending_which
        return False, list(self.launched), self.blocked_which

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
        diff = _first_difference(lists)
        if diff is None:
            return None
        k, r, s = diff
        ran = lambda q: (  # noqa: E731
            f"ran {self._name(lists[q][1][k])}"
            if k < len(lists[q][1])
            else f"ended the {which} after {k}"
        )
        msg = (
            f"stage 3: #{k + 1} of this {which}'s {self._EVENTS} differs between the ranks: "
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
        longest = max(lists.values(), key=len)
        if self.fill is not None:
            for code in longest[len(mine) :]:
                key = self.keys[code]
                if key[0] != "order":  # a unit forward: nothing launched
                    self.filled.append(self.fill(key))
        if self.ending is None:  # the end-of-pass all-reduce of the ranks that ended the pass
            t = torch.zeros(2, dtype=torch.int64)
            work = dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.side, async_op=True)
            self.filled.append((work, t))


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


def _first_difference(lists: dict[int, tuple[bool, list]]) -> tuple[int, int, int] | None:
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


def _compiled_autograd() -> bool:
    """Whether compiled autograd is switched on (by its config flag or its context); never
    imports torch._dynamo itself."""
    cfg = sys.modules.get("torch._dynamo.config")
    ca = sys.modules.get("torch._dynamo.compiled_autograd")
    return bool(getattr(cfg, "compiled_autograd", False)) or (
        ca is not None
        and bool(
            getattr(ca, "compiled_autograd_enabled", False)
            or getattr(ca, "in_compiled_autograd_region", False)
        )
    )


def _in_backward() -> bool:
    """Whether autograd's engine is running (a forward now is a recomputation)."""
    return torch._C._current_graph_task_id() != -1


def _pre(me, k):
    def hook(module, args):
        s = me()
        if s is not None:
            s.pre_forward(k)

    return hook


def _post(me, k):
    def hook(module, args, output):
        s = me()
        if s is not None:
            s.post_forward(k, output)

    return hook


def _root_pre(me):
    def hook(module, args):
        s = me()
        if s is not None:
            s.root_pre()

    return hook


def _root_post(me):
    def hook(module, args, output):
        s = me()
        if s is not None:
            s.root_post()

    return hook


def _pre_bwd(me, k):
    def hook(grad):
        s = me()
        if s is not None:
            s.pre_backward(k)

    return hook


def unit_assignment(
    unit_modules: list[tuple[str, nn.Module]],
    params: dict[int, torch.Tensor],
    persist_below: int = 0,
) -> dict[int, int]:
    """Param index -> unit (1.. for ``unit_modules``, 0 for the root unit, ``len + 1`` for the
    params of fewer than ``persist_below`` elements, kept whole on every rank). A param found in
    two units (tied across them) goes to the root unit, gathered for the whole step."""
    where: dict[int, set[int]] = {}
    for u, (_, m) in enumerate(unit_modules, start=1):
        for p in m.parameters():
            where.setdefault(id(p), set()).add(u)
    out = {}
    for i, p in params.items():
        us = where.get(id(p), set())
        out[i] = next(iter(us)) if len(us) == 1 else 0
        if p.numel() < persist_below:
            out[i] = len(unit_modules) + 1
    return out


def unit_members(model: nn.Module, unit_modules: list[tuple[str, nn.Module]]):
    """Per unit (0 = root), the ``(name, module)`` pairs whose own params it materialises."""
    out: list[list[tuple[str, nn.Module]]] = [[] for _ in range(len(unit_modules) + 1)]
    prefixes = [(n, u) for u, (n, _) in enumerate(unit_modules, start=1)]
    for name, m in model.named_modules():
        u = 0
        for n, k in prefixes:
            if name == n or name.startswith(n + "."):
                u = k
                break
        out[u].append((name, m))
    return out
