"""A (model, optimizer) pair seen as pieces: what one rank saves, and where loaded values go.

[Note: two kinds of optimizer, one view]
A checkpoint is written and read in *pieces* (see [Note: checkpoint format]): for each trainable
parameter, the element range a rank holds, with the values the optimizer steps and its
element-wise state. `ZeroAdapter` reads them from a `ZeroOptimizer`'s shard: its layout's pieces,
the inner optimizer's params (fp32 masters where the params are bf16/fp16) and their state.
`PlainAdapter` serves a plain ``torch.optim`` optimizer over a replicated model (stage 0: plain
or DDP): every rank holds everything, so a flat layout is built for it and rank r saves its
pieces of that layout (1/N of the model) from its full copy; at load every rank reads whole
parameters and the optimizer takes torch's own ``load_state_dict``.

Parameters are identified by their name in the model (``named_parameters()``, the first name of
a tied parameter), so a checkpoint loads into a model rebuilt in another process, into a DDP
wrapper of it (``module.`` is not part of the name), into an optimizer whose param order or
world size differs.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
from torch import nn

from .. import comm
from ..layout import Layout, ParamSpec, build_layout, pieces
from ..partition.state import elementwise

__all__ = ["Adapter", "PieceData", "Target", "adapter_for", "module_state", "unwrap"]

_PLAIN_BUCKET_NUMEL = 1 << 22  # elements per bucket of the layout built for a plain optimizer


def unwrap(model: nn.Module) -> nn.Module:
    """The user's module inside DDP / torch.compile wrappers (their names carry no prefix)."""
    while True:
        if isinstance(model, nn.parallel.DistributedDataParallel):
            model = model.module
        elif hasattr(model, "_orig_mod") and isinstance(model._orig_mod, nn.Module):
            model = model._orig_mod
        else:
            return model


def module_state(model: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, nn.Module]]:
    """The entries of ``model.state_dict()`` without calling it (a stage-3 model's state_dict
    hook gathers every param: a collective): name -> param or persistent buffer, and
    ``<prefix>_extra_state`` -> the module whose ``get_extra_state`` gives its value."""
    tensors: dict[str, torch.Tensor] = {}
    extra: dict[str, nn.Module] = {}
    for prefix, m in model.named_modules(remove_duplicate=False):
        pre = f"{prefix}." if prefix else ""
        for n, p in m._parameters.items():
            if p is not None:
                tensors[pre + n] = p
        for n, b in m._buffers.items():
            if b is not None and n not in m._non_persistent_buffers_set:
                tensors[pre + n] = b
        if type(m).get_extra_state is not nn.Module.get_extra_state:
            extra[pre + "_extra_state"] = m
    return tensors, extra


@dataclass
class PieceData:
    """One piece this rank saves: values (1-D), element-wise state (1-D each), the rest."""

    index: int
    offset: int
    numel: int
    values: torch.Tensor
    elem: dict[str, torch.Tensor] = field(default_factory=dict)
    other: dict = field(default_factory=dict)
    # low-bit moments ([Note: low-bit state]): elem holds the codes, scales the piece's blocks'
    # scales (``<key>_scale``), lowbit the format: {"dtype", "block", "origin"} (see load.py)
    scales: dict[str, torch.Tensor] = field(default_factory=dict)
    lowbit: dict | None = None


@dataclass
class Target:
    """One piece this rank loads: elements [offset, offset + numel) of param ``index``;
    ``values`` is the 1-D tensor they are written into, ``dtype`` the state's dtype."""

    index: int
    offset: int
    numel: int
    values: torch.Tensor
    shape: tuple[int, ...]  # what the state of the piece is shaped like


class Adapter:
    """Common part; see [Note: two kinds of optimizer, one view]."""

    def resident(self):
        """A context in which the optimizer's state is in RAM (offloaded state read in and
        written back after); a plain optimizer's always is."""
        return contextlib.nullcontext()

    def windows(self, read: bool = True, write: bool = True) -> list[tuple[list | None, object]]:
        """This rank's pieces in groups ``(which, context)`` whose state is in RAM inside
        ``context()`` (see `ShardedState.windows`); ``which`` goes to `my_pieces`. A plain
        optimizer's: one group of all (None), always in RAM."""
        return [(None, contextlib.nullcontext)]

    stage: int
    mode: str
    group = None
    layout: Layout
    rank: int  # in the layout: names this rank's file
    world_size: int  # of the layout
    # hierarchical sharding: the data-parallel group the save or load coordinates over, and
    # whether this rank writes (the ranks of the first shard group: the others hold copies)
    dp_rank: int
    dp_size: int
    writer: bool = True

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer):
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}"
            )
        self.model = unwrap(model)
        self.optimizer = optimizer
        self.names: dict[int, str] = {}
        for n, p in self.model.named_parameters():
            self.names.setdefault(id(p), n)

    # ---- described by the subclasses
    def params(self) -> dict[int, torch.Tensor]:
        """index -> param, every param of the optimizer."""
        raise NotImplementedError

    def trainable(self) -> list[int]:
        raise NotImplementedError

    def leaves(self) -> dict[int, torch.Tensor]:
        """index -> the model's param (a tensor-parallel DTensor where `params` holds its local
        tensor)."""
        return self.params()

    tp: dict | None = None  # tensor parallelism: size, rank, placements (`ShardedState`)

    def model_entries(self) -> dict[str, torch.Tensor]:
        """The model's state tensors that are not trainable params of the optimizer (those are
        in the rank files): buffers, frozen params, params outside the optimizer."""
        skip = {id(self.params()[i]) for i in self.trainable()}
        skip |= {id(self.leaves()[i]) for i in self.trainable()}  # tp: the DTensors
        tensors, _ = module_state(self.model)
        return {n: t for n, t in tensors.items() if id(t) not in skip}

    def frozen_whole(self, write: bool = False):
        """A context in which the model's frozen params are whole (`ShardedState.frozen_whole`
        for a ZeroOptimizer that shards them; collective there)."""
        return contextlib.nullcontext()

    def model_values(self) -> dict[str, nn.Module]:
        """``<prefix>_extra_state`` -> module, for modules with non-tensor extra state."""
        return module_state(self.model)[1]

    def name_of(self, index: int) -> str:
        p = self.params()[index]
        n = self.names.get(id(p))
        if n is None:
            raise ValueError(
                f"optimizer param #{index} of shape {tuple(p.shape)} is not a parameter of "
                "the model given: a checkpoint names params by their name in the model"
            )
        return n

    table: list[dict]  # param_table(), made once by adapter_for

    def param_table(self) -> list[dict]:
        """Every trainable param: index (in the layout), name, shape, dtype, group."""
        out = []
        group_of = {i: g for g, idx in enumerate(self.group_params()) for i in idx}
        for i in self.trainable():
            p = self.params()[i]
            out.append(
                {
                    "index": i,
                    "name": self.name_of(i),
                    "shape": list(p.shape),
                    "dtype": str(p.dtype).removeprefix("torch."),
                    "group": group_of[i],
                }
            )
        return out

    def param_groups(self) -> list[dict]:
        return [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]

    def group_params(self) -> list[list[int]]:
        raise NotImplementedError

    def optimizer_class(self) -> type:
        raise NotImplementedError

    def my_pieces(self, which=None):
        """`PieceData` of every piece of this rank (or of group ``which`` of `windows`)."""
        raise NotImplementedError

    def targets(self) -> list[Target]:
        """Where this rank's loaded pieces go."""
        raise NotImplementedError

    def lowbit_target(self, j: int) -> dict | None:
        """The format target ``j`` keeps low-bit moments in (as `PieceData.lowbit`), or None:
        a checkpoint in the same format on the same blocks is taken as saved, else decoded."""
        return None

    def float_state_dtype(self, j: int, values_dtype: torch.dtype) -> torch.dtype:
        """The dtype target ``j`` keeps floating state in: its params' (torch's rule), except
        bf16 params stepped without a master (``bf16_stochastic_round``): fp32."""
        return values_dtype

    def state_buffer(self, j: int, key: str, dtype: torch.dtype) -> torch.Tensor:
        """A 1-D tensor to read element-wise state ``key`` of target ``j`` into: the tensor the
        optimizer will hold (its existing state, or fused Adam's flat storage), so a load
        allocates no second copy of the state; else a new one."""
        raise NotImplementedError

    def install(self, states: list[dict | None], groups: list[dict], meta: dict) -> None:
        """Take the loaded state of each target (``{"elem": {key: 1-D}, "other": {...}}``, or
        None: the param has no state), hyper-params and scaler; make every rank's params whole
        again. Collective for ZeRO."""
        raise NotImplementedError

    def install_pieces(self, which, states: list[dict | None]) -> None:
        """A streamed load: the loaded state of the targets of group ``which`` of `windows`,
        inside its context; `finish_install` follows the last. Here (one group): kept."""
        self._loaded = states

    def finish_install(self, groups: list[dict], meta: dict) -> None:
        self.install(self._loaded, groups, meta)

    def steps(self) -> int:
        raise NotImplementedError

    def scaler(self) -> dict:
        return {}


class ZeroAdapter(Adapter):
    """A `ZeroOptimizer`, through its public sharded-state interface (`opt.sharded_state`,
    `zero_kernels.optimizer.sharded_state.ShardedState`) only."""

    def __init__(self, model, optimizer):
        super().__init__(model, optimizer)
        self.state = st = optimizer.sharded_state
        self.stage, self.mode, self.group = st.stage, st.mode, st.group
        self.layout, self.rank, self.world_size = st.layout, st.rank, st.world_size
        self.dp_rank, self.dp_size = comm.rank(st.group), comm.world_size(st.group)
        self.writer = st.replica_index == 0
        self.tp = st.tensor_parallel
        if self.tp is not None:  # the local tensors named as their DTensors
            params = st.params()
            for i, leaf in st.leaves().items():
                if id(leaf) in self.names:
                    self.names[id(params[i])] = self.names[id(leaf)]

    def resident(self):
        return self.state.resident()

    def frozen_whole(self, write: bool = False):
        return self.state.frozen_whole(write)

    def windows(self, read: bool = True, write: bool = True):
        return self.state.windows(read, write)

    def params(self):
        return self.state.params()

    def trainable(self):
        return self.state.trainable()

    def leaves(self):
        return self.state.leaves()

    def group_params(self):
        return self.state.group_indices()

    def optimizer_class(self):
        return self.state.optimizer_class

    def my_pieces(self, which=None):
        codes = self.state.piece_codes()  # int8 moments: saved as codes and scales
        js = range(len(codes)) if which is None else which
        for j, pc in zip(js, self.state.pieces(js)):
            st = pc.state
            elem = {k: v.detach().reshape(-1) for k, v in st.items() if elementwise(k, v, pc.shape)}
            other = {k: v for k, v in st.items() if k not in elem}
            pd = PieceData(pc.index, pc.offset, pc.numel, pc.values, elem, other)
            if codes[j] is not None:
                for k in _LOWBIT_KEYS:
                    elem[k] = codes[j][k]
                    pd.scales[f"{k}_scale"] = codes[j][f"{k}_scale"]
                    other.pop(k, None)  # outside the decode: the code views (flat)
                    other.pop(f"{k}_scale", None)
                other.pop("state_block", None)
                pd.lowbit = self.state.lowbit_format(j)
            yield pd

    def lowbit_target(self, j):
        return self.state.lowbit_format(j)

    def targets(self):
        return [
            Target(pc.index, pc.offset, pc.numel, pc.values, pc.shape) for pc in self.state.pieces()
        ]

    def state_buffer(self, j, key, dtype):
        return self.state.state_target(j, key, dtype)

    def float_state_dtype(self, j, values_dtype):
        return torch.float32 if self.state.stochastic_round(j) else values_dtype

    def install(self, states, groups, meta):
        st = self.state
        self.state.install(
            states, groups, int(meta.get("steps", st.steps)), meta.get("scaler") or {}
        )

    def install_pieces(self, which, states):
        self.state.install_pieces(which, states)

    def finish_install(self, groups, meta):
        st = self.state
        st.finish_install(groups, int(meta.get("steps", st.steps)), meta.get("scaler") or {})

    def steps(self):
        return self.state.steps

    def scaler(self):
        return self.state.scaler_state()


class PlainAdapter(Adapter):
    stage = 0
    mode = "flat"

    def __init__(self, model, optimizer, group=None):
        super().__init__(model, optimizer)
        self.group = group
        self.rank, self.world_size = comm.rank(group), comm.world_size(group)
        self.dp_rank, self.dp_size = self.rank, self.world_size
        self._params: dict[int, torch.Tensor] = {}
        self._groups: list[list[int]] = []
        specs = []
        for gi, g in enumerate(optimizer.param_groups):
            idx = []
            for p in g["params"]:
                i = len(self._params)
                self._params[i] = p
                idx.append(i)
                specs.append(
                    ParamSpec(
                        i,
                        gi,
                        str(p.dtype),
                        tuple(p.shape),
                        self.names.get(id(p), ""),
                        p.requires_grad,
                    )
                )
            self._groups.append(idx)
        self.layout = build_layout(
            specs, self.world_size, bucket_numel=_PLAIN_BUCKET_NUMEL, mode="flat"
        )
        self._trainable = [s.index for s in specs if s.requires_grad]
        self._targets: list[Target] | None = None

    def params(self):
        return self._params

    def trainable(self):
        return self._trainable

    def group_params(self):
        return [list(x) for x in self._groups]

    def optimizer_class(self):
        return type(self.optimizer)

    def my_pieces(self, which=None):
        assert which is None, "a plain optimizer's pieces come in one group"
        for buf in pieces(self.layout, self.rank):
            for pc in buf:
                p = self._params[pc.index]
                lo, hi = pc.offset, pc.offset + pc.numel
                st = self.optimizer.state.get(p) or {}
                elem = {
                    k: v.detach().reshape(-1)[lo:hi]
                    for k, v in st.items()
                    if elementwise(k, v, p.shape) or _flat_moment(k, v, p)
                }
                other = {k: v for k, v in st.items() if k not in elem}
                pd = PieceData(pc.index, lo, pc.numel, p.detach().reshape(-1)[lo:hi], elem, other)
                if "exp_avg_scale" in st:  # FusedAdamW int8: blocks from the param's start
                    b = int(other.pop("state_block"))
                    for k in _LOWBIT_KEYS:
                        sc = other.pop(f"{k}_scale")
                        pd.scales[f"{k}_scale"] = sc[lo // b : (hi - 1) // b + 1]
                    pd.lowbit = {"dtype": "int8", "block": b, "origin": "param"}
                yield pd

    def float_state_dtype(self, j, values_dtype):
        sr = getattr(self.optimizer, "_sr", None)  # FusedAdam/FusedAdamW: which params round
        p = self._params[self.targets()[j].index]
        return torch.float32 if sr is not None and sr(p) else values_dtype

    def lowbit_target(self, j):
        p = self._params[self.targets()[j].index]
        o = self.optimizer
        low = getattr(o, "_lowbit", None)  # FusedAdam/FusedAdamW: which params are low-bit
        if getattr(o, "state_dtype", "fp32") != "int8" or low is None or not low(p):
            return None
        return {"dtype": "int8", "block": o.state_block, "origin": "param"}

    def targets(self):
        if self._targets is None:
            self._targets = []
            for i in self._trainable:
                p = self._params[i].detach()
                # values are read into the param itself (a copy when it is not contiguous)
                v = p.view(-1) if p.is_contiguous() else torch.empty(p.numel(), dtype=p.dtype)
                self._targets.append(Target(i, 0, p.numel(), v, tuple(p.shape)))
        return self._targets

    def state_buffer(self, j, key, dtype):
        t = self.targets()[j]
        st = self.optimizer.state.get(self._params[t.index]) or {}
        v = st.get(key)
        if _reusable(v, dtype, t.numel):
            return v.detach().view(-1)
        return torch.empty(t.numel, dtype=dtype)

    @torch.no_grad()
    def install(self, states, groups, meta):
        o = self.optimizer
        state = {}
        for t, st in zip(self.targets(), states):
            if st is not None:
                state[t.index] = {
                    **{k: v.view(t.shape) for k, v in st["elem"].items()},
                    **st["other"],
                }
                if "codes" in st:  # FusedAdamW int8 on the saved blocks: its own format
                    state[t.index].update(st["codes"])
                    state[t.index]["state_block"] = st["block"]
        pg = []
        for g, idx in zip(groups, self._groups):
            pg.append({**g, "params": list(idx)})
        o.load_state_dict({"state": state, "param_groups": pg})
        for t in self.targets():  # values were read into the params' own storage
            p = self._params[t.index]
            if not p.is_contiguous():
                p.copy_(t.values.view(p.shape))

    def steps(self):
        best = 0
        for st in self.optimizer.state.values():
            s = st.get("step") if isinstance(st, dict) else None
            if s is not None:
                best = max(best, int(float(s)))
        return best


_LOWBIT_KEYS = ("exp_avg", "exp_avg_sq")


def _flat_moment(key: str, v, p: torch.Tensor) -> bool:
    """FusedAdamW's low-bit moments (bf16 values, int8 codes): flat, one entry per element of
    ``p``, element-wise state."""
    return (
        key in _LOWBIT_KEYS
        and isinstance(v, torch.Tensor)
        and v.dim() == 1
        and v.numel() == p.numel()
        and v.dtype in (torch.bfloat16, torch.int8, torch.uint8)
    )


def _reusable(v, dtype: torch.dtype, numel: int) -> bool:
    return (
        isinstance(v, torch.Tensor)
        and v.dtype == dtype
        and v.numel() == numel
        and v.is_contiguous()
        and v.device.type == "cpu"
    )


def adapter_for(model: nn.Module, optimizer) -> Adapter:
    """The adapter of ``optimizer``; a param that is not the model's fails here, on every rank,
    before any collective."""
    from ..optimizer import ZeroOptimizer

    if isinstance(optimizer, ZeroOptimizer):
        ad: Adapter = ZeroAdapter(model, optimizer)
    else:
        group = getattr(model, "process_group", None)
        if not isinstance(model, nn.parallel.DistributedDataParallel):
            group = None
        ad = PlainAdapter(model, optimizer, group)
    ad.table = ad.param_table()
    return ad
