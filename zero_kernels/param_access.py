"""`ZeroOptimizer`'s params beyond the step: how they are stored and materialised (stage 3
unit by unit), made whole on request (`gathered_params`, ``model.state_dict()`` at stage 3), and
the all-gathers left in flight after a step (``overlap_param_gather``). A mixin of
`zero_kernels.optimizer.ZeroOptimizer`; also the small weak-reference hook helpers it uses."""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from . import comm
from .buffers import ParamStore, dtype_of
from .materialize import materialize_modules_
from .partition.order import SequenceCheck
from .partition.units import Unit, UnitScheduler, UnitState, unit_members

__all__ = ["ParamAccess"]


class ParamAccess:
    """Param storage, stage-3 materialisation and whole-param access (see the module doc)."""

    def _materialize_and_store(self) -> ParamStore:
        """The param store; meta params materialised (stage 3: unit by unit, keeping only this
        rank's shard, so construction holds the shards plus one unit)."""
        sharded = not self.policy.shard.params
        group, module = self.group, self._module
        if self._meta and not sharded:  # stages 1/2 hold whole params anyway
            materialize_modules_(module.named_modules(), self.device, self._seed, self._init_fn)
        store = ParamStore(self.layout, self._params, self.device, rank=self.rank, sharded=sharded)
        if not sharded:
            if not self._meta:
                for f in store.flats:
                    comm.broadcast(f, 0, group=group)
            return store
        members = unit_members(module, self._unit_modules) if self._meta else None
        by_unit: dict[int, list[tuple[int, int]]] = {}
        for i, buf in enumerate(self.layout.buffers):
            for b in buf.buckets:
                u = self._slot_unit(buf.slots[b.slots[0]].index) if b.slots else 0
                by_unit.setdefault(u, []).append((i, b.index))
        persistent = len(self._unit_modules) + 1  # small params kept whole (persist_below)
        for u in range(persistent + 1):
            if members is not None and u < persistent:
                into: dict[int, torch.Tensor] = {}  # the unit's params: straight into its buckets
                for i, b in by_unit.get(u, []):
                    into.update(store.prepare(i, b, self._params))
                materialize_modules_(
                    members[u], self.device, self._seed, self._init_fn, storage=into
                )
            for i, b in by_unit.get(u, []):
                store.adopt(i, b, self._params)
                if not self._meta:
                    comm.broadcast(store.raw[i][b], 0, group=group)
                store.take_shard(i, b)
                if u != persistent:
                    store.free(i, b)
        if members is not None:  # frozen params and buffers outside any trained unit
            materialize_modules_(module.named_modules(), self.device, self._seed, self._init_fn)
        return store

    # ------------------------------------------------------------------ whole params
    @contextlib.contextmanager
    def gathered_params(self, module_or_params=None, modifier_rank: int | None = None):
        """Make params whole for inspection or editing (collective: every rank enters it).

        ``module_or_params``: a module or params (default: all). At stage 3 their units are
        gathered (those gathered here are freed on exit); at stages 1/2 params are whole anyway.
        ``modifier_rank``: the rank whose edits inside the block are kept: its values are sent
        to every rank and written into the shards (and fp32 masters), for every unit of the
        params asked for, whatever its state at entry (the params kept whole by
        ``persist_below``, a unit an outer ``gathered_params`` or a forward holds). None: edits
        are dropped at stage 3 (and must be the same on every rank at stages 1/2)."""
        self._check_open("gathered_params")
        self.wait_params()
        if modifier_rank is not None and not 0 <= modifier_rank < self.world_size:
            raise ValueError(
                f"modifier_rank must be a rank in [0, {self.world_size}) or None, "
                f"got modifier_rank={modifier_rank!r}"
            )
        if module_or_params is None:
            wanted = set(self._trainable)
        else:
            ps = (
                module_or_params.parameters()
                if isinstance(module_or_params, nn.Module)
                else module_or_params
            )
            ids = {id(p) for p in ps}
            wanted = {i for i, p in self._trainable.items() if id(p) in ids}
        sched = self._scheduler
        covered, mine = [], []  # the units of ``wanted``; those this call gathers (and frees)
        if sched is not None:
            for u in sched.all_units:
                if any(self._slot_unit(i) == u.index for i in wanted):
                    covered.append(u)
                    if u.sharded:
                        mine.append(u)
                    sched.wait(u)
        try:
            yield
        finally:
            if modifier_rank is not None:  # the edits of every unit covered, not only of mine
                self._take_edits(
                    modifier_rank, [b for u in covered for b in u.buckets] if sched else None
                )
            if sched is not None:
                for u in mine:
                    sched.free(u)

    @torch.no_grad()
    def _take_edits(self, src: int, buckets) -> None:
        """Whole params edited on rank ``src`` become every rank's values (shards, masters)."""
        if self._store.sharded:
            for i, b in buckets:
                comm.broadcast(self._store.raw[i][b], src, group=self.group)
                self._store.take_shard(i, b)
        else:
            for f in self._store.flats:
                comm.broadcast(f, src, group=self.group)
        self._runner.load_masters()

    def _state_dict_hook(self, module, state_dict, prefix, local_metadata):
        """Stage 3: ``model.state_dict()`` gets whole tensors, gathered unit by unit."""
        comm.check_arrival(self._side, "model.state_dict() at stage 3", self.timeout)
        sched = self._scheduler
        names = {id(p): n for n, p in module.named_parameters(remove_duplicate=False)}
        for u in sched.all_units:
            was = u.sharded
            sched.wait(u)
            for i, b in u.buckets:
                for p, _, _ in self._store.members.get((i, b), ()):
                    key = prefix + names.get(id(p), "")
                    if key in state_dict:
                        state_dict[key] = p.detach().clone()
            if was:
                sched.free(u)
        # tied params: every name of a param gets its value
        for n, p in module.named_parameters(remove_duplicate=False):
            if prefix + n in state_dict and id(p) in self._ids_trainable:
                key0 = prefix + names[id(p)]
                state_dict[prefix + n] = state_dict[key0]
        return state_dict

    def _load_pre_hook(self, *args, **kwargs):
        if self._scheduler is not None:
            for u in self._scheduler.all_units:
                self._scheduler.wait(u)

    def _load_post_hook(self, module, incompatible_keys):
        sched = self._scheduler
        if sched is None:
            self._runner.load_masters()
            return
        for u in sched.all_units:
            for i, b in u.buckets:
                self._store.take_shard(i, b)
            sched.free(u)
        self._runner.load_masters()

    def _slot_unit(self, index: int) -> int:
        return self._unit_of.get(index, 0)

    def _make_scheduler(self) -> UnitScheduler:
        units = [Unit(0, "<root>", self._module)] + [
            Unit(k, name, m) for k, (name, m) in enumerate(self._unit_modules, start=1)
        ]
        persistent = Unit(len(units), "<persistent>", self._module, persistent=True)
        units.append(persistent)
        for i, buf in enumerate(self.layout.buffers):
            for b in buf.buckets:
                u = self._slot_unit(buf.slots[b.slots[0]].index) if b.slots else 0
                units[u].buckets.append((i, b.index))
        if persistent.buckets:  # gathered at construction, kept whole
            persistent.move(UnitState.GATHERING)  # all-gathered by _materialize_and_store
            persistent.move(UnitState.GATHERED)
        # the root unit's sharded params (frozen ones stay whole)
        in_root = {id(p) for i, p in self._trainable.items() if self._slot_unit(i) == 0}
        root_members = [
            (name, m)
            for name, m in self._module.named_modules()
            if m is not self._module and any(id(p) in in_root for p in m.parameters(False))
        ]
        return UnitScheduler(
            self._module,
            units[1:-1],
            units[0],
            self._store,
            self._runner,
            self.group,
            self.comm_log,
            reshard_after_forward=self.reshard_after_forward,
            prefetch=self.prefetch,
            persistent=persistent if persistent.buckets else None,
            root_members=root_members,
        )

    def _sequence_check(self, mode: str) -> SequenceCheck:
        """Stage 3: the check that every rank launches the same collective (`SequenceCheck`)."""
        names = {}
        for u in self._scheduler.all_units:
            for i, b in u.buckets:
                where = f"unit {u.name!r} (bucket {b} of flat buffer {i})"
                names[("all_gather", i, b)] = f"all-gather of {where}"
                names[("reduce_scatter", i, b)] = f"reduce-scatter of the gradients of {where}"
            names[("order", u.index, 0)] = f"forward of unit {u.name!r}"
            names[("check", u.index, 0)] = f"first-step order check at unit {u.name!r}"
        return SequenceCheck(
            self._side,
            names,
            self._op_timeout,
            mode,
            self._scratch_collective,
            split=self._rs_group is not self.group,
            stop_shm=lambda: comm.shm.poison(self.group, self._rs_group),
        )

    def _scratch_collective(self, key: tuple[str, int, int]):
        """Collective ``key`` of stage 3 (the same sizes, dtype and algorithm) on scratch
        buffers: what a rank that never launched it launches so that the others' waits
        complete once the module-order error is found (`SequenceCheck`)."""
        kind, i, b = key
        n, dev = self.world_size, self.device
        if kind == "check":  # `UnitScheduler._check_same`'s all-reduce
            t = torch.zeros(2, dtype=torch.int64, device=dev)
            return comm.all_reduce_start(t, "max", group=self.group)
        numel = self.layout.buffers[i].buckets[b].numel(n)
        if kind == "all_gather":
            dt = dtype_of(self.layout.buffers[i].dtype)
            out = torch.empty(numel, dtype=dt, device=dev)
            inp = torch.zeros(numel // n, dtype=dt, device=dev)
            return comm.all_gather(out, inp, group=self.group)
        dt = self._grads.reduce_dtypes[i]  # "reduce_scatter"
        out = torch.empty(numel // n, dtype=dt, device=dev)
        inp = torch.zeros(numel, dtype=dt, device=dev)
        return comm.reduce_scatter(out, inp, group=self._rs_group, avg=True)

    def _skip_unit(self, unit) -> None:
        """Stage 3: this rank's backward skipped ``unit`` (see [Note: backward gathers]): the
        reducer stops waiting for its params' grads that will not come."""
        index = {id(p): i for i, p in self._trainable.items()}
        self._reducer.give_up([index[id(p)] for p in unit.module.parameters() if id(p) in index])

    # ------------------------------------------------------------------ overlapped all-gather
    def _gather_wait_hooks(self, me) -> list:
        """overlap_param_gather: a forward pre-hook on every module with params of its own
        waits for the all-gathers of the buckets holding them; state_dict waits for all."""
        bucket_of = {}
        for i, buf in enumerate(self.layout.buffers):
            for s in buf.slots:
                bucket_of[id(self._params[s.index])] = (i, s.bucket)
        handles = []
        for m in self._module.modules():
            mine = {bucket_of[id(p)] for p in m.parameters(recurse=False) if id(p) in bucket_of}
            if mine:
                handles.append(m.register_forward_pre_hook(_wait_hook(me, sorted(mine))))
        handles.append(self._module.register_state_dict_pre_hook(_call_args(me, "wait_params")))
        handles.append(
            self._module._register_load_state_dict_pre_hook(_call_args(me, "wait_params"))
        )
        return handles

    def _wait_gathers(self, keys) -> None:
        for k in keys:
            h = self._pending_gathers.pop(k, None)
            if h is not None:
                h.wait(self._op_timeout, f"{self._where()}: all-gather of bucket {k[1]}")

    def wait_params(self, *args, **kwargs) -> None:
        """overlap_param_gather: finish every all-gather still in flight, so the params hold the
        last step's values. The next forward does it bucket by bucket by itself; call this
        before reading params between ``step()`` and the next forward (EMA, logging, saving
        tensors yourself); model.state_dict() and this optimizer's own methods call it."""
        if self._pending_gathers:
            self._wait_gathers(list(self._pending_gathers))


def _call_args(me, name: str):
    """A hook calling method ``name`` of the object behind weak reference ``me``."""

    def f(*args, **kwargs):
        o = me()
        if o is not None:
            return getattr(o, name)(*args, **kwargs)
        return None

    return f


def _wait_hook(me, keys):
    def hook(module, args):
        o = me()
        if o is not None and o._pending_gathers:
            o._wait_gathers(keys)

    # plain Python under torch.compile, as stage 3's unit hooks ([Note: torch.compile])
    return torch.compiler.disable(hook, recursive=True)


def _call(me, name: str):
    """A callback to method ``name`` of the object behind weak reference ``me``."""

    def f():
        o = me()
        if o is not None:
            getattr(o, name)()

    return f
