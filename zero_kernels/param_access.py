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
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from . import comm
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
        try:
            yield
        finally:
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

    def state_dict_hook(self, module, state_dict, prefix, local_metadata):
        """Stage 3: ``model.state_dict()`` gets whole tensors, gathered unit by unit."""
        comm.check_arrival(self.core.side, "model.state_dict() at stage 3", self.core.timeout)
        sched = self.core.units
        names = {id(p): n for n, p in module.named_parameters(remove_duplicate=False)}
        for u in sched.all_units:
            was = u.sharded
            with self.core.runner.exact():  # a state dict holds no quantization
                sched.wait(u)
            for i, b in u.buckets:
                for p, _, _ in self.core.store.members.get((i, b), ()):
                    key = prefix + names.get(id(p), "")
                    if key in state_dict:
                        state_dict[key] = p.detach().clone()
            if was:
                sched.free(u)
        # tied params: every name of a param gets its value
        sharded = {id(q) for q in [*self.core.trainable.values(), *self.core.frozen.values()]}
        for n, p in module.named_parameters(remove_duplicate=False):
            if prefix + n in state_dict and id(p) in sharded:
                key0 = prefix + names[id(p)]
                state_dict[prefix + n] = state_dict[key0]
        return state_dict

    def state_dict_copies_hook(self, module, state_dict, prefix, local_metadata):
        """Stages 1/2: ``model.state_dict()`` gets a copy of each trained param, as stage 3's
        gathered tensors are, not a view into the flat buffer ([Note: state dict copies])."""
        trainable = {id(q) for q in self.core.trainable.values()}
        copies: dict[int, torch.Tensor] = {}  # a tied param: one copy under each of its names
        for n, p in module.named_parameters(remove_duplicate=False):
            key = prefix + n
            if id(p) in trainable and key in state_dict:
                if id(p) not in copies:
                    copies[id(p)] = state_dict[key].clone()
                state_dict[key] = copies[id(p)]
        return state_dict

    def load_pre_hook(self, *args, **kwargs):
        if self.core.units is not None:
            with self.core.runner.exact():  # the shards take these values back after
                for u in self.core.units.all_units:
                    self.core.units.wait(u)

    def load_post_hook(self, module, incompatible_keys):
        sched = self.core.units
        if sched is None:
            self.core.runner.load_masters()
            return
        with self.core.runner.resident():  # offloaded shards: read in, written back
            for u in sched.all_units:
                for i, b in u.buckets:
                    self.core.store.take_shard(i, b)
                sched.free(u)
            self.core.runner.load_masters()

    def skip_unit(self, unit) -> None:
        """Stage 3: this rank's backward skipped ``unit`` (see [Note: backward gathers]): the
        reducer stops waiting for its params' grads that will not come."""
        index = {id(p): i for i, p in self.core.trainable.items()}
        self.core.reducer.give_up(
            [index[id(p)] for p in unit.module.parameters() if id(p) in index]
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
            self.core.module.register_state_dict_pre_hook(_call_args(me, "parts.params.wait"))
        )
        handles.append(
            self.core.module._register_load_state_dict_pre_hook(_call_args(me, "parts.params.wait"))
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


def _resolve(o, path: str):
    for name in path.split("."):
        o = getattr(o, name)
    return o


def _call_args(me, path: str):
    """A hook calling method ``path`` (dotted: "parts.params.wait") of the object behind weak
    reference ``me``; nothing once it is collected."""

    def f(*args, **kwargs):
        o = me()
        if o is not None:
            return _resolve(o, path)(*args, **kwargs)
        return None

    return f


def _wait_hook(me, units):
    def hook(module, args):
        o = me()
        if o is not None and o.parts.params.in_flight:
            o.parts.params.wait_units(units)

    # plain Python under torch.compile, as stage 3's unit hooks ([Note: torch.compile])
    return torch.compiler.disable(hook, recursive=True)


def _call(me, path: str):
    """A callback to method ``path`` (dotted) of the object behind weak reference ``me``."""

    def f():
        o = me()
        if o is not None:
            _resolve(o, path)()

    return f
