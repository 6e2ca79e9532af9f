"""Stage 3: units of parameters gathered on demand, around the module's forward and backward.

[Note: units]
A *unit* is a module-aligned set of parameters gathered and freed together: by default each entry
of the model's largest ``nn.ModuleList`` (its repeated blocks), else each direct child holding at
least ``1 / 8`` of the parameters; the parameters left over (embeddings, final norm, head) form the
*root unit*. In the layout (see [Note: layout]) a unit's parameters are contiguous and its buckets
hold nothing else, so gathering a unit is one all-gather per bucket of it.

Per unit the state is explicit (`UnitState`, asserted at each transition):

    SHARDED --gather()--> GATHERING --wait()--> GATHERED --free()--> SHARDED
    (secondary_shard: GATHERED --free() after forward--> SECONDARY --gather()--> GATHERING,
     or --dropped--> SHARDED; [Note: secondary shard] in `zero_kernels.partition.secondary`)

Timeline of one training step (units U1..U3 inside the root, prefetch=1):

    forward    root: gather R | U1 pre: wait AG U1, start AG U2 | U1 post: free U1 | U2 pre: ...
    backward   U3 pre-bwd: wait AG U3, start AG U2 | grads of U3 -> RS U3, free U3 | U2 ...
    end        free R and anything still gathered; the step updates shards only

- pre-forward: the unit is gathered (waiting for its prefetched all-gather) and the next
  ``prefetch`` units in forward order are started; post-forward: freed when
  ``reshard_after_forward`` (default) or when no backward will follow (``torch.no_grad``).
- pre-backward (a hook on the unit's outputs): the unit is gathered again if it was freed, the
  next units in backward order prefetched (see [Note: backward gathers]); post-backward: when
  every gradient of a bucket has arrived (the reducer's hook) its reduce-scatter starts and its
  params are freed.
- The root unit is gathered from the model's pre-forward to the end of backward.
- A module called twice re-gathers once per call (at most one extra gather); activation
  checkpointing re-runs a unit's forward inside backward, which gathers it if needed and does not
  free it after (its backward comes next); a parameter shared by two units (tied) lives in the
  root unit, one shared by a unit and a module of the root in that unit (`unit_assignment`; the
  read guard gathers it where the root's module reads it, [Note: external params]).
- The forward order is recorded in the first step and checked on every rank in that step (a small
  all-reduce per unit): ranks that run different modules get a ValueError naming them, never
  all-gathers that do not match. Later steps prefetch by the recorded order; a unit reached out of
  that order is gathered on demand, and prefetched units left unused are freed at the end.

[Note: backward gathers]
A rank's backward can skip units that every rank ran forward: an output that takes part in the
loss on some ranks only (an auxiliary head, a task head chosen by the batch). Gathers launched
as hooks fire would then differ between ranks, and the collectives are matched by their order.
So the backward's all-gathers follow one list, the same on every rank: the units of the last
forward whose outputs need a gradient (a hook is registered on them), in reverse forward order,
which is the order autograd runs them in (it runs ready nodes latest-created first). A unit's
pre-backward hook gathers every unit of the list before it that this rank has not reached
(*passed over*: gathered as the others do, then freed unless the list needs it again) and then
itself, and prefetches the next ``prefetch`` of the list; the end of backward passes over what
is left. The reduce-scatters are launched in the reducer's fixed bucket order; the params of a
passed-over unit whose grads will not come in this backward (autograd's engine will not run
their accumulation; a weight tied into a unit that runs still gets one) count as arrived
(`Reducer.give_up`), so their buckets are launched at their turn with zeros for them, instead
of holding the later buckets until the end of backward, which could deadlock: a rank bounded
in bucket buffers waits for a reduce-scatter the skipping rank holds back while the skipping
rank waits for an all-gather the first has not reached. Gathers and
reduce-scatters interleave differently on a rank that skips (its grads do not come where the
others' do), so on gloo the reduce-scatters run on a twin process group, a sequence of their
own (`zero_kernels.comm.twin_group`): each sequence is the same on every rank, and each is
hashed and compared apart (`SequenceCheck`). NCCL orders communicators together, so there (and
with ``check_order="every"``, which compares every launch in one sequence) they stay on the main
group, and a skipping rank is found by the comparison instead. The result is every rank's
gradient averaged with zeros where a rank's loss did not use a param: what stages 1 and 2 give.
A rank whose backward runs units in a different order (not only fewer) is not covered: the
comparison finds it, or gloo aborts where the sizes differ first.

[Note: torch.compile]
The forward hooks (a unit's pre/post, the root's) are `torch.compiler.disable`d: where dynamo
traces a compiled model (``torch.compile(model)``, or ``unit.compile()`` per unit) it calls them
as plain Python and breaks the graph there, so each unit's forward between its hooks is one
graph, traced once. Traced instead, they took a graph break at every collective, wait and
``.item()`` and a recompilation per step (the timeout messages name the step): 19-20 graphs for
a 4-block model and the recompile limit hit by the second step. A model whose forward loops over
its units runs that loop eagerly (dynamo does not resume a graph broken inside a loop); the units
are the compiled part, as with FSDP2's per-block ``fully_shard`` + compile. Compiled autograd
(which traces the backward hooks too) is refused, see `_NO_COMPILED_AUTOGRAD`. Tested against
DDP: tests/stages/compiled_checks.py, ``check_compiled_forward_hooks``.

[Note: autocast]: in `zero_kernels.partition.recast`.

[Note: frozen shards]: in `zero_kernels.partition.frozen`.
"""

from __future__ import annotations

import enum
import sys
import weakref

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from .. import comm
from .external import ReadGuard, container_members, is_container, returns_own_params, under_dynamo
from .frozen import InputWatch
from .phase import PhaseTracker
from .recast import Recasts
from .unit_find import find_units, unit_assignment, unit_members
from .unit_hooks import (
    _grad_hook,
    _post,
    _pre,
    _root_bwd,
    _root_finally,
    _root_member,
    _root_post,
    _root_pre,
)

__all__ = ["UnitState", "Unit", "UnitScheduler", "find_units", "unit_assignment", "unit_members"]


class UnitState(enum.Enum):
    SHARDED = "sharded"
    GATHERING = "gathering"
    GATHERED = "gathered"
    SECONDARY = "secondary"  # sharded, a slice kept for the backward ([Note: secondary shard])


# a unit's transitions (asserted at each, as `zero_kernels.partition.reducer`'s buckets are)
_UNIT_MOVES = {
    UnitState.SHARDED: (UnitState.GATHERING,),
    UnitState.GATHERING: (UnitState.GATHERED,),
    UnitState.GATHERED: (UnitState.SHARDED, UnitState.SECONDARY),
    UnitState.SECONDARY: (UnitState.GATHERING, UnitState.SHARDED),
}
# a unit kept whole ([Note: kept whole] in `zero_kernels.partition.kept`): never resharded; a
# step that updated its shards all-gathers it again in place (GATHERED -> GATHERING)
_KEPT_MOVES = {
    UnitState.SHARDED: (UnitState.GATHERING,),
    UnitState.GATHERING: (UnitState.GATHERED,),
    UnitState.GATHERED: (UnitState.GATHERING,),
}


class Unit:
    """One unit: its module, its buckets ``(buffer, bucket)``, its state and pending gathers.
    ``persistent``: kept whole, never freed (stage 3's small params, every bucket of stages 1
    and 2; [Note: kept whole])."""

    def __init__(self, index: int, name: str, module: nn.Module, persistent: bool = False):
        self.index, self.name, self.module = index, name, module
        self.persistent = persistent
        self.buckets: list[tuple[int, int]] = []
        self.frozen: set[tuple[int, int]] = set()  # [Note: frozen shards]: its frozen buckets
        self.state = UnitState.SHARDED
        self.handles: list = []

    def expect(self, *states: UnitState) -> None:
        assert self.state in states, f"unit {self.name}: state {self.state}, expected {states}"

    def move(self, to: UnitState) -> None:
        moves = _KEPT_MOVES if self.persistent else _UNIT_MOVES
        assert to in moves[self.state], f"unit {self.name}: {self.state} -> {to}"
        self.state = to

    def finish(self, timeout_s: float | None, what: str, watch=None) -> None:
        """GATHERING -> GATHERED: wait for every all-gather of the unit (bounded by
        ``timeout_s``, named ``what`` when it expires)."""
        for h in self.handles:
            h.wait(timeout_s, what, watch)
        self.handles.clear()
        self.move(UnitState.GATHERED)

    @property
    def sharded(self) -> bool:
        """Not gathered (a kept secondary shard included)."""
        return self.state in (UnitState.SHARDED, UnitState.SECONDARY)

    def __repr__(self) -> str:
        return f"Unit({self.index}, {self.name!r}, {self.state.value}, {len(self.buckets)} bkts)"


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
        root_members: list[tuple[str, nn.Module]] = (),
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
        # [Note: backward gathers]: the units of this forward whose backward is expected (a
        # hook on their outputs), in forward order, and how far the backward got through them
        # (from the end); ``on_skip(u)``: a unit this rank's backward passed over (its buckets
        # are reduced at their turn without waiting for grads that will not come)
        self.bwd_units: list[int] = []
        self.bwd_next = 0
        self.on_skip = None
        self.on_forward_start = None  # (args, kwargs) of a forward outside backward
        self.timeout: float | None = None  # bound on each wait (the optimizer's ``timeout``)
        self.describe = lambda: ""  # where we are, for a timeout's message
        self.check = None  # SequenceCheck: every launch compared across ranks first
        self.secondary = None  # SecondaryShard with secondary_shard ([Note: secondary shard])
        self.phase = PhaseTracker()  # the optimizer's ([Note: phase]), set by the builder
        self.recasts = Recasts()  # [Note: autocast]: the hooks units' forwards push
        # [Note: external params]: each param's unit, each unit's params, the units kept
        # gathered past their forward in this pass, the container units entered in this forward
        self._param_unit = {
            id(p): u
            for u in self.all_units
            for key in u.buckets
            for p, _, _ in store.members.get(key, ())
        }
        self._own_ids = {
            u.index: {id(p) for key in u.buckets for p, _, _ in store.members.get(key, ())}
            for u in self.all_units
        }
        self._kept: set[int] = set()
        self._entered: set[int] = set()
        self.handed_out = 0  # gathered_params() blocks open (`release_for_step`)
        self._frozen_fp32: dict[int, list] = {}  # per unit: see `_frozen_casts`
        self._held: dict[int, frozenset] = {}  # per unit: see `_held_ids`
        self._root_ids: set[int] | None = None  # see `_root_fp32`
        # [Note: frozen shards]: the input hooks of units with frozen buckets; the units whose
        # backward (or recomputation) began in this backward
        self.inputs = InputWatch()
        self._rearm = False  # a backward ended since the hooks were armed
        self._reached: set[int] = set()
        self._containers = [u for u in units if is_container(u.module)]
        self._guard = ReadGuard(self._guard_read)
        self._all_modules = list(model.modules())  # any compiled: no guard (it stops dynamo)
        self.handles = []
        me = weakref.ref(self)
        for u in units:
            if is_container(u.module):  # entered by its members (see [Note: external params])
                for c in container_members(u.module):
                    self.handles.append(
                        c.register_forward_pre_hook(
                            _pre(me, u.index, True), with_kwargs=bool(u.frozen)
                        )
                    )
                    self.handles.append(c.register_forward_hook(_post(me, u.index, True)))
                continue
            self.handles.append(
                u.module.register_forward_pre_hook(_pre(me, u.index), with_kwargs=bool(u.frozen))
            )
            self.handles.append(u.module.register_forward_hook(_post(me, u.index)))
        self.handles.append(model.register_forward_pre_hook(_root_pre(me), with_kwargs=True))
        self.handles.append(model.register_forward_hook(_root_post(me)))
        self.handles.append(model.register_forward_hook(_root_finally(me), always_call=True))
        for name, m in root_members:  # called outside the model's forward: an error, not NaN
            self.handles.append(m.register_forward_pre_hook(_root_member(me, name)))
        self.by_index = {u.index: u for u in self.all_units}
        self.bucket_unit = {b: u for u in self.all_units for b in u.buckets}
        # CUDA: gathered buckets are allocated on the stream their all-gathers write on, and
        # reused in its order ([Note: gathered memory on CUDA] in `zero_kernels.buffers`)
        dev = torch.device(store.device)
        if dev.type == "cuda":
            store.gather_stream = comm.comm_stream(dev)
        # most units beside the root and the kept-whole one gathered (or gathering) at once:
        # `memory_report`'s gathered_units_peak
        self.peak_units = 0

    # ---- gather / free
    def gather(self, u: Unit) -> None:
        """Start the unit's all-gathers (SHARDED or SECONDARY -> GATHERING); nothing if already
        under way. From a kept secondary shard inside its block, unless the gather hands params
        out (exact: the copy is dropped, [Note: secondary shard])."""
        if u.state is UnitState.SECONDARY and self.runner.exact_now:
            self._drop(u)
        if u.state not in (UnitState.SHARDED, UnitState.SECONDARY):
            return
        watch = self.check.watch if self.check is not None else None
        what = f"{self.describe()}: all-gather of unit {u.name}"
        bound = dict(timeout_s=self.timeout, what=what, watch=watch)
        for i, b in u.buckets:
            if self.check is not None:
                self.check("all_gather", i, b)
            self.store.alloc(i, b)
            if u.state is UnitState.SECONDARY:
                h = self.secondary.gather((i, b), self.log, **bound)
            else:
                h = self.runner.gather(i, b, self.log, self.group, **bound)
            u.handles.append(h)
        u.move(UnitState.GATHERING)
        held = sum(not v.sharded for v in self.units if not v.persistent)
        self.peak_units = max(self.peak_units, held)

    def wait(self, u: Unit) -> None:
        self.gather(u)
        if u.state is UnitState.GATHERING:
            watch = self.check.watch if self.check is not None else None
            u.finish(self.timeout, f"{self.describe()}: all-gather of unit {u.name}", watch)
            if self.secondary is not None:  # gathered from it: not needed again
                self.secondary.drop(u.buckets)
        u.expect(UnitState.GATHERED)

    def free(self, u: Unit, keep: bool = False) -> None:
        """Release the unit's gathered params; ``keep``: after its forward, with a backward to
        come: its secondary shard kept first (where one is configured)."""
        if u.persistent or u.state in (UnitState.SHARDED, UnitState.SECONDARY):
            return
        if u.state is UnitState.GATHERING:
            self.wait(u)
        to = UnitState.SHARDED
        if keep and self.secondary is not None and u is not self.root:
            self.secondary.keep(u.buckets)
            to = UnitState.SECONDARY
        for i, b in u.buckets:
            self.store.free(i, b)
        u.move(to)

    def _drop(self, u: Unit) -> None:
        if u.state is UnitState.SECONDARY:
            self.secondary.drop(u.buckets)
            u.move(UnitState.SHARDED)

    def drop_secondary(self) -> None:
        """Every kept secondary shard dropped (their values may be stale from here on)."""
        if self.secondary is not None:
            for u in self.all_units:
                self._drop(u)

    def release_for_step(self) -> None:
        """Before a step: a unit still gathered (outside the persistent one) was gathered by a
        forward with gradients on whose backward has not run (an evaluation outside no_grad
        between backward and step, say), or by ``gathered_params()``. The first kind is
        freed: the next forward gathers the stepped values, as DDP's next forward reads them
        (a backward through that forward's graph raises torch's in-place error: the step bumps
        the stepped params' versions, `zero_kernels.optimizer.stepper.Stepper.step`). Inside
        ``gathered_params()`` the step raises: the block's params would keep the values from
        before it."""
        held = self._gathered_units()
        if not held:
            return
        if self.handed_out:
            raise RuntimeError(
                "stage 3: step() inside gathered_params(): the params it made whole "
                f"(units {', '.join(u.name for u in held)}) would keep the values from before "
                "the step; step outside the block"
            )
        self._release(held)

    def release_after_load(self) -> None:
        """After ``model.load_state_dict`` took the loaded values into the shards: units a
        forward left gathered (its backward not run, or ``reshard_after_forward=False``) are
        freed, so nothing stays gathered after a load (FSDP2's state after a load); a backward
        through that forward's graph raises torch's in-place error, as the load changed the
        params in place. Inside ``gathered_params()`` the block frees what it gathered."""
        if not self.handed_out:
            self._release(self._gathered_units())

    def _gathered_units(self) -> list:
        """The units gathered now outside the persistent one."""
        return [
            u
            for u in self.all_units
            if not u.persistent and u.state in (UnitState.GATHERED, UnitState.GATHERING)
        ]

    def _release(self, held: list) -> None:
        for u in held:
            self.free(u)
        self._kept.clear()

    def free_all(self) -> None:
        for u in self.all_units:
            self.free(u)
        self.drop_secondary()

    def refresh_persistent(self) -> list:
        """After a step: the all-gathers of the params kept whole (their shards were updated),
        ``[((buffer, bucket), handle)]`` for `KeptWhole.launched`."""
        self.drop_secondary()
        if self.persistent is None:
            return []
        return [
            ((i, b), self.runner.gather(i, b, self.log, self.group))
            for i, b in self.persistent.buckets
        ]

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

    def push_recast(self, k: int) -> None:
        """After unit ``k``'s pre-forward: the autocast recipes on ([Note: autocast])."""
        if torch.is_grad_enabled() and not self.phase.backward:
            u = self.by_index[k]
            self.recasts.push(
                k, u.module, self.store.device.type, self._frozen_casts(u),
                held=self._held_ids(u), check=self._check_saved,
            )  # fmt: skip

    def _held_ids(self, u: Unit) -> frozenset:
        """The ids of unit ``u``'s frozen params in its own buckets ([Note: frozen casts])."""
        got = self._held.get(u.index)
        if got is None:
            got = self._held[u.index] = frozenset(
                id(p) for key in u.frozen for p, _, _ in self.store.members.get(key, ())
            )
        return got

    def _check_saved(self, p: torch.Tensor, version: int) -> None:
        """The backward reads frozen param ``p`` that its unit's forward saved (or a cast of it,
        [Note: frozen casts]): its unit must be gathered, and ``p`` unchanged since."""
        u = self._param_unit.get(id(p))
        if u is not None and not u.persistent and u.state is not UnitState.GATHERED:
            name = next((n for n, q in u.module.named_parameters() if q is p), "?")
            raise RuntimeError(
                f"stage 3 (shard_frozen=True): the backward reads frozen param "
                f"{(u.name + '.' if u.name else '') + name!r} ({tuple(p.shape)}) after its unit "
                f"{u.name!r} was freed: none of the unit's outputs needed a gradient, so no "
                "backward of it was expected, but a tensor made in its forward from one that "
                "reached it another way than its arguments (an attribute, a closure, a global) "
                "needs it. Pass that tensor as an argument of the unit's forward, or use "
                "shard_frozen=False"
            )
        if p._version != version:
            raise RuntimeError(
                f"a frozen param of shape {tuple(p.shape)} saved by the forward for the backward "
                f"was modified in place since (version {version} -> {p._version}); change it "
                "after the backward (torch raises the same for a tensor autograd saved)"
            )

    def _frozen_casts(self, u: Unit) -> list:
        """The fp32 params of unit ``u``'s module that may not train whose autocast casts can
        be recipes in its forward ([Note: autocast]): those held whole (no unit's bucket, or a
        kept unit's) and those of its own buckets, gathered in its backward. Not a nested
        unit's sharded params: the unit's backward does not gather them."""
        got = self._frozen_fp32.get(u.index)
        if got is None:
            got = self._frozen_fp32[u.index] = [
                p
                for p in u.module.parameters()
                if p.dtype == torch.float32
                and (self._param_unit.get(id(p)) in (None, u) or self._param_unit[id(p)].persistent)
            ]
        return got

    def pop_recast(self, k: int | None = None) -> None:
        """Before unit ``k``'s post-forward (None: every one left, after an exception)."""
        self.recasts.pop(k)

    def pre_forward(self, k: int) -> None:
        if _compiled_autograd():
            raise RuntimeError(_NO_COMPILED_AUTOGRAD)
        u = self.by_index[k]
        if self.phase.backward:  # activation checkpointing: recomputation inside backward
            self.wait(u)
            self._reached.add(k)
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

    def post_forward(self, k: int, output, free: bool = True) -> None:
        """After unit ``k``'s forward (``free``: False for a container's member, whose unit is
        resharded at the model's post-forward; see [Note: external params])."""
        u = self.by_index[k]
        if self.phase.backward:
            return
        flat = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor)]
        if returns_own_params(flat, self._own_ids[k]):  # kept gathered for the caller
            self._kept.add(k)
        free = free and k not in self._kept
        if torch.is_grad_enabled():
            ts = [t for t in flat if t.requires_grad]
            if ts:
                me = weakref.ref(self)
                torch.autograd.graph.register_multi_grad_hook(
                    ts, _grad_hook(me, "pre_backward", k), mode="any"
                )
                self.bwd_units.append(k)
            if self.reshard_after_forward and free:
                self.free(u, keep=bool(ts))
        elif free:
            self.free(u)

    def member_pre(self, k: int) -> None:
        """A member of container unit ``k`` is called: the first in a forward enters the unit."""
        if k in self._entered and not self.phase.backward:
            self.wait(self.by_index[k])
        else:
            if not self.phase.backward:
                self._entered.add(k)
            self.pre_forward(k)

    def _guard_read(self, t: torch.Tensor) -> None:
        """`ReadGuard`: ``t`` is passed to a torch function in the model's forward; a param (or
        a view of one) whose unit is not gathered is gathered now and kept."""
        u = self._param_unit.get(id(t))
        if u is None and t._is_view():
            u = self._param_unit.get(id(t._base))
        if u is not None and u.state is not UnitState.GATHERED:
            self.wait(u)
            self._kept.add(u.index)

    def root_pre(self, args: tuple = (), kwargs: dict | None = None) -> None:
        if self.phase.enter_forward():  # a recomputation ([Note: phase])
            self.wait(self.root)
            return
        if self.on_forward_start is not None:  # before any collective of the forward (Join)
            self.on_forward_start(args, kwargs or {})
        self.pos = 0
        self.bwd_units, self.bwd_next = [], 0  # the last forward's backward is the next one
        if self._rearm:  # the first forward after a backward: its own hooks from here
            self.inputs.disarm()
            self._rearm = False
        self._entered.clear()
        self.drop_secondary()  # of a forward whose backward did not run
        self.pop_recast()  # left by a forward that raised
        self._guard.pop()
        self.wait(self.root)
        if self.order is not None:
            for j in self.order[: self.prefetch]:
                self.gather(self.by_index[j])
        if not (under_dynamo() or any(_compiled(m) for m in self._all_modules)):
            self._guard.push()  # params read outside their unit ([Note: external params])
        if torch.is_grad_enabled():  # the root unit's casts (a frozen lm_head's) as recipes
            r = self.root
            self.recasts.push(
                r.index, r.module, self.store.device.type, self._frozen_casts(r),
                held=self._held_ids(r), check=self._check_saved,
                ids=self._root_fp32(),
            )  # fmt: skip

    def _root_fp32(self) -> set[int]:
        """The ids of the root unit's own fp32 params: only they are gathered through the whole
        forward and backward (a unit's, read at the root's level, may be freed by then)."""
        got = self._root_ids
        if got is None:
            own = self._own_ids[self.root.index]
            got = self._root_ids = {
                id(p) for p in self.root.module.parameters()
                if id(p) in own and p.dtype == torch.float32
            }  # fmt: skip
        return got

    def root_member(self, name: str) -> None:
        """A module whose own params are in the root unit is called: they are whole only from
        the model's pre-forward to the end of its backward, or in ``gathered_params()``."""
        r = self.root
        if r.state is UnitState.GATHERING:
            self.wait(r)
        elif r.state is not UnitState.GATHERED:
            raise RuntimeError(
                f"stage 3: module {name!r} was called outside the model's forward; its params "
                "are in the root unit, which is sharded between forwards (its params read as "
                "NaN there). Call it inside the model's forward, inside "
                "ZeroOptimizer.gathered_params(), or make it a unit of its own (units=)"
            )

    def root_post(self, output=None) -> None:
        if self.phase.backward:
            return
        self._guard.pop()
        self.pop_recast()  # a unit whose forward raised, caught inside the model's forward
        if self.order is None:  # the first forward: recorded, and checked on every rank
            self.order = list(self.recording)
        self.recording = []
        if not torch.is_grad_enabled():
            self._kept.clear()
            self.free_all()
        else:
            if self.reshard_after_forward:  # container units: after all their members ran
                for u in self._containers:
                    if u.index in self._entered and u.index not in self._kept:
                        self.free(u)
            # a backward that starts here after an earlier backward ended (a loss head
            # called alone with a backward per call) finds the root unit gathered again
            ts = [
                t
                for t in tree_flatten(output)[0]
                if isinstance(t, torch.Tensor) and t.requires_grad
            ]
            if ts:
                me = weakref.ref(self)
                torch.autograd.graph.register_multi_grad_hook(ts, _root_bwd(me), mode="any")
        self._entered.clear()
        self.phase.end_forward()
        if self.check is not None:  # before the output is returned
            self.check.end_pass("forward")

    # ---- backward
    def pre_backward(self, k: int) -> None:
        self.phase.enter_backward()
        u = self.by_index[k]
        fwd = self.bwd_units  # forward order: backward position p is fwd[len - 1 - p]
        top = len(fwd) - 1 - self.bwd_next  # the unit the backward should reach next
        at = next((j for j in range(top, -1, -1) if fwd[j] == k), None)
        if at is None:  # not expected here (a second call's hook, or out of order)
            self.wait(u)
            self._reached.add(k)
            return
        self._pass_over(fwd[at + 1 : top + 1][::-1], fwd[:at])
        self.bwd_next = len(fwd) - at
        self.wait(u)
        self._reached.add(k)
        for j in fwd[max(0, at - self.prefetch) : at][::-1]:
            self.gather(self.by_index[j])

    def _pass_over(self, skipped: list[int], later: list[int], reduce: bool = True) -> None:
        """Units whose backward this rank skipped (see [Note: backward gathers]): gathered as
        every rank does at that point, freed at once unless needed again later in this
        backward, and (``reduce``) their gradient buckets handed to the reducer as complete."""
        for j in skipped:
            v = self.by_index[j]
            self.gather(v)
            if j not in later:
                self.free(v)
            if reduce and self.on_skip is not None:
                self.on_skip(v)

    def finish_backward(self) -> None:
        """The end of a backward, before its collectives are compared: units of the forward
        whose backward this rank did not reach are passed over (gathered and freed; the reducer
        has launched every bucket by now), so that every rank launched the same all-gathers."""
        fwd = self.bwd_units
        if self.bwd_next < len(fwd):
            self._pass_over(fwd[: len(fwd) - self.bwd_next][::-1], [], reduce=False)
        self.bwd_next = len(fwd)

    def bucket_done(self, i: int, b: int) -> None:
        """Every gradient of bucket (i, b) arrived: its unit's params are not needed any more
        in this backward once all of the unit's buckets are done (and, with frozen params, its
        inputs' gradients computed: [Note: frozen shards])."""
        u = self.bucket_unit.get((i, b))
        if u is None or u is self.root or u.persistent:
            return
        self._done.add((i, b))
        self._free_if_done(u)

    def _free_if_done(self, u: Unit) -> None:
        if u.frozen and u.index in self._kept:  # read outside its forward: to the end
            return
        if self.inputs.holds(u):  # [Note: frozen shards]
            return
        if all(bk in self._done for bk in u.buckets if bk not in u.frozen):
            self.free(u)

    # ---- frozen shards ([Note: frozen shards] in `zero_kernels.partition.frozen`)
    def watch_inputs(self, k: int, args, kwargs) -> None:
        """Unit ``k`` (with frozen buckets) starts a forward that a backward will follow: a
        hook on its inputs that need a gradient tells when its backward has used them all."""
        u = self.by_index[k]
        if not u.frozen or not torch.is_grad_enabled():
            return
        if self.phase.backward and self.inputs.armed.get(k, 0):
            return  # a recomputation (non-reentrant checkpoint): the forward's hook stands
        ts = [
            t
            for t in tree_flatten((args, kwargs or {}))[0]
            if isinstance(t, torch.Tensor) and t.requires_grad
        ]
        if ts:
            self.inputs.arm(k, ts, _grad_hook(weakref.ref(self), "inputs_done", k))

    def inputs_done(self, k: int) -> None:
        """The gradients of one forward's inputs of unit ``k`` are computed (counted in this
        optimizer's backward only: `InputWatch.fire`)."""
        if not self.inputs.fire(k, self.phase.backward):
            return
        u = self.by_index[k]
        if u is not self.root and not u.persistent and k in self._reached:
            self._free_if_done(u)

    def task_ended(self, task: int, built: bool) -> None:
        """The phase's end of a graph task through the model (after the reducer's end, if
        any): one that reduced nothing leaves no count behind (`InputWatch.task_ended`)."""
        if self.inputs.task_ended(task, built):
            self._reached.clear()

    def end_backward(self) -> None:
        self.inputs.backward_ended()
        self._done = set()
        self._reached.clear()
        self._rearm = True
        self.bwd_units, self.bwd_next = [], 0
        self._kept.clear()
        self.free_all()

    def remove(self) -> None:
        self.inputs.disarm()
        self.drop_secondary()
        self.pop_recast()
        self._guard.pop()
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


def _compiled(m: nn.Module) -> bool:
    """``m.compile()`` was called (its calls run through dynamo)."""
    return getattr(m, "_compiled_call_impl", None) is not None
