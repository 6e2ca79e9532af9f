"""What one `ZeroOptimizer` is made of: the built `Core` and the parts over it.

[Note: parts]
`ZeroOptimizer` is a facade. Its constructor resolves the options into a policy and runs the
named steps of `zero_kernels.optimizer.build` (check, lay out, store, communication, runner,
units); what they build is one `Core`: the references every part reads (layout, param store,
gradient store, reducer, runner, stage 3's units, groups, timeouts, the comm log) and nothing
that changes during training except the step counter (`StepCounter`, advanced by the step
alone). Over the core sit parts that each own their state and are called by the facade (modules
of `zero_kernels.optimizer`):

    ZeroOptimizer (zero_optimizer: torch.optim.Optimizer + Joinable, lifecycle, telemetry)
      |-- Stepper        stepper        step(): checks, inner step, all-gathers
      |-- GradContract   grad_access    p.grad as ShardedGrad, scaling factor, non-finite
      |                                 checks, clip_grad_norm_
      |-- ParamAccess    param_access   whole params: gathered_params, stage 3's
      |                                 model.state_dict(), overlapped all-gathers
      |-- FullState      state_access   full_param/grad/state and their setters,
      |                                 consolidated_state_dict
      |-- JoinState      join           uneven inputs (torch's Join)
      |-- LossScaler     loss_scale
      `-- ShardedState   sharded_state  (made on request) state_dict(), load_state_dict(),
                                        checkpoints
    each reads the Core:  layout, store, grads, reducer, runner, units, kept, comm_log, groups

A part calls another only through the methods it was handed at construction; hooks registered on
params and modules hold weak references to the optimizer, never to a part, so a collected
optimizer leaves nothing reachable from the model. The layers below (`partition`, `buffers`,
`comm`) know nothing of the parts.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch
from torch import nn

from .. import comm
from ..partition.phase import PhaseTracker

if TYPE_CHECKING:  # the types of the fields; the modules import at run time where they are built
    from torch.distributed import ProcessGroup

    from ..buffers import GradStore, ParamStore
    from ..comm.base import CommLog
    from ..comm.hier import Mesh
    from ..layout import Layout
    from ..partition.kept import KeptWhole
    from ..partition.reducer import Reducer
    from ..partition.runner import ShardRunner
    from ..partition.units import UnitScheduler
    from ..policy import ZeroPolicy
    from .tensor_parallel import TensorParallel

__all__ = ["Core", "StepCounter"]


@dataclasses.dataclass(eq=False)
class StepCounter:
    """Steps taken (names checkpoint folders, restored on resume) and its value at the last
    ``reset_comm_stats()`` (``comm_stats["steps"]`` counts from there)."""

    n: int = 0
    at_reset: int = 0


@dataclasses.dataclass(eq=False)
class Core:
    """The references every part of one optimizer reads (see [Note: parts])."""

    policy: ZeroPolicy
    mode: str  # "flat" or "whole" (partition.choose_mode)
    group: ProcessGroup | None  # the data-parallel process group (None: the world)
    mesh: Mesh  # shard and replica groups ([Note: hierarchy])
    shard_group: ProcessGroup | None  # the ranks the state is sharded over (``group`` unless
    # hierarchical)
    rs_group: ProcessGroup | None  # the reduce-scatters' group (stage 3 on gloo: a twin)
    side: ProcessGroup | None  # the side group of small checks over ``group`` (arrival, masks)
    rank: int  # in the shard group: the layout's rank
    world_size: int  # of the shard group: the layout's world size
    dp_rank: int  # in the data-parallel group
    dp_size: int
    device: torch.device
    timeout: float  # collective-only calls (state dicts, full_param, close)
    op_timeout: float | None  # backward's and step's collectives (None: the group's own)
    layout: Layout
    params: dict[int, torch.Tensor]  # index -> param
    trainable: dict[int, torch.Tensor]  # index -> param with requires_grad
    group_indices: list[list[int]]  # per user param group: the param indices
    module: nn.Module | None
    unit_of: dict[int, int]  # stage 3: param index -> unit index (0: the root unit)
    unit_modules: list[tuple[str, nn.Module]]  # stage 3: (name, module) of each unit after the
    # root
    # shard_frozen: index -> frozen param sharded with its unit ([Note: frozen shards]); the
    # store's layout is ``layout`` with their buffers after the trained ones
    frozen: dict[int, torch.Tensor] = dataclasses.field(default_factory=dict)
    store_layout: Layout | None = None
    store: ParamStore | None = None
    grads: GradStore | None = None
    reducer: Reducer | None = None
    runner: ShardRunner | None = None
    units: UnitScheduler | None = None  # where params are resharded (stage 3), else None
    kept: KeptWhole | None = None  # the units never resharded ([Note: kept whole])
    comm_log: CommLog | None = None
    steps: StepCounter = dataclasses.field(default_factory=StepCounter)
    sync_free: bool = False  # off the CPU: step() reads nothing back ([Note: no host sync])
    phase: PhaseTracker = dataclasses.field(default_factory=PhaseTracker)  # [Note: phase]
    # DTensor params of tensor parallelism, laid out by their local tensors ([Note: tensor
    # parallelism] in zero_kernels/optimizer/tensor_parallel.py); None without
    tp: TensorParallel | None = None

    def where(self) -> str:
        return f"ZeroOptimizer step {self.steps.n} (rank {self.dp_rank})"

    def __post_init__(self):
        if self.store_layout is None:
            self.store_layout = self.layout

    def unit_index(self, index: int) -> int:
        """Stage 3: the unit of param ``index`` (0, the root unit, elsewhere)."""
        return self.unit_of.get(index, 0)

    def all_reduce(self, t: torch.Tensor, op: str, what: str, group=None) -> torch.Tensor:
        """A small blocking all-reduce (on ``group``, default the data-parallel group), bounded
        by ``op_timeout`` when given."""
        return comm.all_reduce(
            t,
            op,
            group=self.group if group is None else group,
            log=self.comm_log,
            timeout_s=self.op_timeout,
            what=f"{self.where()}, {what}",
        )

    def param_name(self, index: int) -> str:
        """Param ``index`` as errors name it: its name in the model, else its index and shape."""
        for b in self.layout.buffers:
            for s in b.slots:
                if s.index == index:
                    return s.name or f"#{index} {s.shape}"
        p = self.params[index] if index in self.params else self.frozen[index]
        if self.module is not None:  # a frozen param has no slot: its name in the module
            for n, q in self.module.named_parameters(remove_duplicate=False):
                if q is p:
                    return f"{n!r} {tuple(p.shape)}"
        return f"#{index} {tuple(p.shape)}"

    def index_of(self, param: torch.Tensor, what: str) -> int:
        """The index of trainable ``param`` (a tensor-parallel DTensor: that of its local
        tensor); a ValueError naming ``what`` otherwise."""
        if self.tp is not None:
            param = self.tp.local_of(param)
        for i, p in self.params.items():
            if p is param:
                if i not in self.trainable:
                    raise ValueError(f"{what}: param {self.param_name(i)} is frozen")
                return i
        raise ValueError(
            f"{what}: the tensor of shape {tuple(param.shape)} is not a param of this optimizer"
        )
