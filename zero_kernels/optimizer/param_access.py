"""`ParamAccess`, a part of `ZeroOptimizer` ([Note: parts]): its params beyond the step, made
whole on request (`gathered`, ``model.state_dict()`` where params are resharded), the values a
loaded model brings (the fp32 masters), and the all-gathers left in flight after a step
(``overlap_param_gather``). Also the small weak-reference hook helpers the optimizer uses.

[Note: state dict copies]
At stages 1/2 every trained param is a view into one flat buffer per (param group, dtype), so
the tensors ``model.state_dict()`` returned (torch's ``param.detach()``) shared one storage.
Serializers that drop tensors sharing a storage, as if they were tied weights, then lost the
model: accelerate's ``save_model`` and ``save(state_dict, safe_serialization=True)`` (its
``clean_state_dict_for_safetensors``) wrote one tensor of a 3-layer MLP's 6 and one of a small
GPT-2's 28, with only a log line; safetensors' ``save_model`` and huggingface_hub refused
("None is covering the entire storage"). So at stages 1/2 the module's state_dict hook replaces
each trained param's entry with a copy (one copy per param: tied names share it, as they share
the param under DDP). Stage 3 already returns copies (gathered). The price: the params' bytes
once more while the dict is held (DDP's dict aliases the params), the same as DeepSpeed's
stage 1/2 through accelerate (its ``clone_tensors_for_torch_save``). Buffers and frozen params
are the module's own tensors, returned as torch returns them.

[Note: module state dicts]
``state_dict()`` and ``load_state_dict()`` are also called on modules inside the model (a
block saved or loaded alone, a pretrained head). The hooks were on the model only, so such a
call saw the params as they sit between steps: at stage 3 a module's ``state_dict()`` held the
NaN placeholders of its sharded params (silently) and its ``load_state_dict()`` failed in
torch's copy into a placeholder; at stages 1/2 a module's load did not reach the fp32 masters of
bf16 params, so the next step put the old values back (silently). Now every module holding
params of the optimizer has the hooks, and the outermost call does the work once for its whole
subtree (torch calls a module's hooks at every level of its recursion; the module the call was
made on runs its pre-hook first and its state-dict hook last): stage 3 gathers the units
holding the module's params (collective: every rank calls it, as for the model), copies whole
values under every name of each param, and frees them; a load gathers them first and, after,
takes the shards back and reloads the masters. A call is nested only while its owner's call
is on the stack (a call that raised midway leaves an owner behind, which the next call
replaces: taken for nested, it read NaN and lost its load). ``keep_vars=True`` gives the
Parameters at stages 1/2, as torch does, and copies at stage 3 (its Parameters read NaN between
steps); ``load_state_dict(assign=True)`` is refused (it would replace the Parameters the
optimizer holds). Tested at stages 1-3, fp32 and bf16, frozen shards
(tests/stage3/module_sd_checks.py:
a block, a layer inside a unit, several units, the head; after a call that raised).
"""

from __future__ import annotations

import contextlib
import sys

import torch
from torch import nn

from .. import comm
from .core import Core

__all__ = ["ParamAccess"]


class ParamAccess:
    """Whole-param access over the `Core` (see the module doc); the all-gathers still in flight
    after a step are the kept units' (``core.kept``, [Note: kept whole])."""

    def __init__(self, core: Core):
        self.core = core

    # ------------------------------------------------------------------ whole params
    @contextlib.contextmanager
    def gathered(self, module_or_params=None, modifier_rank: int | None = None):
        """`ZeroOptimizer.gathered_params` (its docstring says what it does); collective."""
        self.wait()
        if modifier_rank is not None and not 0 <= modifier_rank < self.core.dp_size:
            raise ValueError(
                f"modifier_rank must be a rank in [0, {self.core.dp_size}) or None, "
                f"got modifier_rank={modifier_rank!r}"
            )
        sharded = {**self.core.trainable, **self.core.frozen}  # frozen: shard_frozen's
        if module_or_params is None:
            wanted = set(sharded)
        else:
            ps = (
                module_or_params.parameters()
                if isinstance(module_or_params, nn.Module)
                else module_or_params
            )
            ids = {id(p) for p in ps}
            wanted = {i for i, p in sharded.items() if id(p) in ids}
        sched = self.core.units
        covered, mine = [], []  # the units of ``wanted``; those this call gathers (and frees)
        if sched is not None:
            for u in sched.all_units:
                if any(self.core.unit_index(i) == u.index for i in wanted):
                    covered.append(u)
                    if u.sharded:
                        mine.append(u)
                    with self.core.runner.exact():  # handed out: never quantized
                        sched.wait(u)
        if sched is not None:
            sched.handed_out += 1  # a step inside the block raises (`release_for_step`)
        try:
            yield
        finally:
            if sched is not None:
                sched.handed_out -= 1
            if modifier_rank is not None:  # the edits of every unit covered, not only of mine
                self.take_edits(
                    modifier_rank, [b for u in covered for b in u.buckets] if sched else None
                )
            if sched is not None:
                for u in mine:
                    sched.free(u)

    @torch.no_grad()
    def take_edits(self, src: int, buckets) -> None:
        """Whole params edited on rank ``src`` become every rank's values (shards, masters)."""
        with self.core.runner.resident():  # offloaded shards: read in, written back
            if self.core.store.sharded:
                for i, b in buckets:
                    comm.broadcast(self.core.store.raw[i][b], src, group=self.core.group)
                    self.core.store.take_shard(i, b)
            else:
                for f in self.core.store.flats:
                    comm.broadcast(f, src, group=self.core.group)
            self.core.runner.load_masters()

    # ------------------------------------------------------------------ module state dicts
    def module_hooks(self, me) -> list:
        """``state_dict()`` / ``load_state_dict()`` hooks on the model and on every module of it
        holding params of this optimizer ([Note: module state dicts])."""
        model = self.core.module
        mine = {id(p) for p in [*self.core.trainable.values(), *self.core.frozen.values()]}
        if self.core.tp is not None:  # the DTensor params, held through their local tensors
            mine |= self.core.tp.leaf_ids()
        self._parents: dict[int, list[nn.Module]] = {}
        for m in model.modules():
            for c in m.children():
                self._parents.setdefault(id(c), []).append(m)
        self._owner: dict[str, nn.Module | None] = {"save": None, "load": None}
        self._keep_vars = False
        self._loading: list = []
        handles = []
        for m in model.modules():
            if not any(id(p) in mine for p in m.parameters()):
                continue
            handles += [
                m.register_state_dict_pre_hook(_call_args(me, lambda o: o.parts.params.save_pre)),
                m._register_state_dict_hook(_call_args(me, lambda o: o.parts.params.save_post)),
                m._register_load_state_dict_pre_hook(
                    _call_args(me, lambda o: o.parts.params.load_pre), with_module=True
                ),
                m.register_load_state_dict_post_hook(
                    _call_args(me, lambda o: o.parts.params.load_post)
                ),
            ]
        return handles

    def _outermost(self, kind: str, module: nn.Module) -> bool:
        """A pre-hook of ``kind`` on ``module``: whether this call is the outermost one (the
        module ``state_dict``/``load_state_dict`` was called on), which then owns the work. A
        call inside the owner's (one of its submodules, reached by torch's recursion while the
        owner's call is on the stack) is not; an owner left by a call that raised is replaced
        by the next call, and the model's own call always owns."""
        owner = self._owner[kind]
        nested = (
            owner is not None
            and module is not self.core.module
            and self._encloses(owner, module)
            and _on_stack(owner, _CALLS[kind])
        )
        if not nested:
            self._owner[kind] = module
        return not nested

    def _encloses(self, owner: nn.Module, module: nn.Module) -> bool:
        todo, seen = [module], set()
        while todo:
            m = todo.pop()
            if m is owner:
                return True
            if id(m) not in seen:
                seen.add(id(m))
                todo += self._parents.get(id(m), [])
        return False

    def _key(self, p: torch.Tensor) -> int:
        """The id the store knows ``p`` by: a tensor-parallel DTensor's local tensor's."""
        return id(p) if self.core.tp is None else id(self.core.tp.local_of(p))

    def _entry(self, local: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """A state-dict entry of the param whose local tensor is ``local``: ``value``, as a
        DTensor of the param's placements for a tensor-parallel param."""
        return value if self.core.tp is None else self.core.tp.wrap_local(local, value)

    def _units_of(self, module: nn.Module) -> list:
        """Stage 3: the units holding params of ``module`` (in the scheduler's order: the same
        on every rank)."""
        ids = {self._key(p) for p in module.parameters()}
        store, sched = self.core.store, self.core.units
        return [
            u
            for u in sched.all_units
            if any(id(p) in ids for key in u.buckets for p, _, _ in store.members.get(key, ()))
        ]

    def save_pre(self, module, prefix, keep_vars):
        if self._outermost("save", module):
            self._keep_vars = keep_vars
            self.wait()  # overlap_param_gather: the last step's values first

    def save_post(self, module, state_dict, prefix, local_metadata):
        """The outermost call's module: its trained params' entries become copies of their
        whole values (stage 3: gathered unit by unit; stages 1/2: [Note: state dict copies])."""
        if self._owner["save"] is not module:
            return state_dict
        try:
            names: dict[int, list[str]] = {}
            for n, p in module.named_parameters(remove_duplicate=False):
                names.setdefault(self._key(p), []).append(prefix + n)
            if self.core.units is None:
                if not self._keep_vars:  # keep_vars: the Parameters themselves, as torch's
                    self._copies(names, state_dict)
            else:  # keep_vars too: between steps the Parameters read NaN
                self._gathered(module, names, state_dict)
        finally:
            self._owner["save"] = None
        return state_dict

    def _copies(self, names: dict, state_dict: dict) -> None:
        """Stages 1/2: a copy of each trained param, not a view into its flat buffer (one copy
        per param: tied names share it, as they share the param under DDP)."""
        for q in self.core.trainable.values():
            keys = [k for k in names.get(id(q), ()) if k in state_dict]
            if keys:
                c = state_dict[keys[0]].clone()  # a DTensor's clone: a DTensor of a copy
                for k in keys:
                    state_dict[k] = c

    def _gathered(self, module: nn.Module, names: dict, state_dict: dict) -> None:
        """Stage 3: whole tensors, gathered unit by unit (collective)."""
        comm.check_arrival(self.core.side, "state_dict() at stage 3", self.core.timeout)
        sched, store = self.core.units, self.core.store
        for u in self._units_of(module):
            was = u.sharded
            with self.core.runner.exact():  # a state dict holds no quantization
                sched.wait(u)
            for key in u.buckets:
                for p, _, _ in store.members.get(key, ()):
                    keys = [k for k in names.get(id(p), ()) if k in state_dict]
                    if keys:
                        c = self._entry(p, p.detach().clone())
                        for k in keys:  # tied: every name of a param gets its value
                            state_dict[k] = c
            if was:
                sched.free(u)

    def load_pre(self, module, state_dict, prefix, local_metadata, *args):
        """Stage 3: the outermost call gathers the units of its module's params (exact), so the
        load writes whole params; the shards take the values back after (`load_post`)."""
        if local_metadata.get("assign_to_params_buffers"):
            raise RuntimeError(
                "load_state_dict(assign=True) on a model under ZeroOptimizer: it would replace "
                "the Parameters the optimizer holds (their values live in its buffers); load "
                "in place (assign=False), or build the ZeroOptimizer after loading"
            )
        if not self._outermost("load", module):
            return
        self.wait()
        self._loading = []
        sched = self.core.units
        if sched is None:
            return
        comm.check_arrival(self.core.side, "load_state_dict() at stage 3", self.core.timeout)
        with self.core.runner.exact():
            for u in self._units_of(module):
                self._loading.append((u, u.sharded))
                sched.wait(u)

    def load_post(self, module, incompatible_keys):
        """The outermost call's module: the loaded values reach the shards (stage 3) and the
        fp32 masters, whichever module was loaded."""
        if self._owner["load"] is not module:
            return
        try:
            sched = self.core.units
            if sched is None:
                self.core.runner.load_masters()
                return
            with self.core.runner.resident():  # offloaded shards: read in, written back
                for u, _ in self._loading:
                    for i, b in u.buckets:
                        self.core.store.take_shard(i, b)
                for u, was in self._loading:
                    if was:
                        sched.free(u)
                self.core.runner.load_masters()
            sched.release_after_load()
        finally:
            self._owner["load"] = None
            self._loading = []

    def skip_unit(self, unit) -> None:
        """Stage 3: this rank's backward skipped ``unit`` (see [Note: backward gathers]): the
        reducer stops waiting for its params' grads that will not come."""
        index = {id(p): i for i, p in self.core.trainable.items()}
        self.core.reducer.give_up(
            [index[self._key(p)] for p in unit.module.parameters() if self._key(p) in index]
        )

    # ------------------------------------------------------------------ overlapped all-gather
    def gather_wait_hooks(self, me) -> list:
        """overlap_param_gather: a forward pre-hook on every module with params of its own
        waits for the kept units holding them; state_dict waits for all."""
        unit_of = {}
        kept = self.core.kept
        for i, buf in enumerate(self.core.layout.buffers):
            for s in buf.slots:
                unit_of[id(self.core.params[s.index])] = kept.of_bucket[(i, s.bucket)].index
        handles = []
        for m in self.core.module.modules():
            mine = {unit_of[id(p)] for p in m.parameters(recurse=False) if id(p) in unit_of}
            if mine:
                handles.append(m.register_forward_pre_hook(_wait_hook(me, sorted(mine))))
        handles.append(
            self.core.module.register_state_dict_pre_hook(
                _call_args(me, lambda o: o.parts.params.wait)
            )
        )
        handles.append(
            self.core.module._register_load_state_dict_pre_hook(
                _call_args(me, lambda o: o.parts.params.wait)
            )
        )
        return handles

    @property
    def in_flight(self) -> int:
        """Kept units whose all-gathers are still in flight (``overlap_param_gather``)."""
        return self.core.kept.in_flight

    def wait_units(self, indices) -> None:
        self.core.kept.wait(indices)

    def wait(self, *args, **kwargs) -> None:
        """overlap_param_gather: finish every all-gather still in flight, so the params hold the
        last step's values. The next forward does it bucket by bucket by itself; call this
        before reading params between ``step()`` and the next forward (EMA, logging, saving
        tensors yourself); model.state_dict() and this optimizer's own methods call it."""
        self.core.kept.wait_all()


_CALLS = {"save": "state_dict", "load": "load_state_dict"}


def _on_stack(module: nn.Module, name: str) -> bool:
    """Whether ``module.<name>(...)`` (torch's ``state_dict``/``load_state_dict``) is running
    on this thread, further up the stack."""
    f = sys._getframe(1)
    while f is not None:
        if f.f_code.co_name == name and f.f_locals.get("self") is module:
            return True
        f = f.f_back
    return False


def _call_args(me, method):
    """A hook calling ``method(o)`` (a function naming the method: ``lambda o:
    o.parts.params.wait``, looked up at each call, so a part rebuilt later is the one called)
    of the object behind weak reference ``me``, with the hook's arguments; nothing once it is
    collected."""

    def f(*args, **kwargs):
        o = me()
        if o is not None:
            return method(o)(*args, **kwargs)
        return None

    return f


def _wait_hook(me, units):
    def hook(module, args):
        o = me()
        if o is not None and o.parts.params.in_flight:
            o.parts.params.wait_units(units)

    # plain Python under torch.compile, as stage 3's unit hooks ([Note: torch.compile])
    return torch.compiler.disable(hook, recursive=True)


def _call(me, method):
    """A callback without arguments to ``method(o)`` (see `_call_args`) of the object behind
    weak reference ``me``."""

    def f():
        o = me()
        if o is not None:
            method(o)()

    return f
