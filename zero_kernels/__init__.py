"""zero_kernels: ZeRO (Zero Redundancy Optimizer) for PyTorch, with its own fused kernels.

- `FusedAdam` / `FusedAdamW`: drop-in `torch.optim` optimizers running the one-pass fused step.
- `ZeroOptimizer`: shards optimizer state (stage 1), gradients (stage 2) and parameters (stage 3)
  of any torch optimizer across the data-parallel ranks; `init_module_`: the deterministic
  initialisation stage 3 uses for models built on the meta device.
- The policies (`zero_kernels.policy`): every option of a ZeroOptimizer as a documented field of
  `GatherPolicy`, `PrecisionPolicy`, `CommPolicy`, `OffloadPolicy`, `ExecutionPolicy`, or all
  of them in one `ZeroPolicy`.
- `save_checkpoint` / `load_checkpoint` / `CheckpointError`: checkpoints that load at any world
  size and stage (`zero_kernels.checkpoint`).
"""

from __future__ import annotations

from ._version import __version__
from .fused_adam import FusedAdam, FusedAdamW
from .policy import (
    CommPolicy,
    ExecutionPolicy,
    GatherPolicy,
    OffloadPolicy,
    PrecisionPolicy,
    ShardPolicy,
    ZeroPolicy,
)

__all__ = [
    "CheckpointError",
    "CommPolicy",
    "ExecutionPolicy",
    "FusedAdam",
    "FusedAdamW",
    "GatherPolicy",
    "OffloadPolicy",
    "PrecisionPolicy",
    "ShardPolicy",
    "ZeroOptimizer",
    "ZeroPolicy",
    "__version__",
    "init_module_",
    "load_checkpoint",
    "save_checkpoint",
]
_CHECKPOINT = ("CheckpointError", "load_checkpoint", "save_checkpoint")


def __getattr__(name: str):
    # The partitioning layer pulls in torch.distributed; load it only when asked for.
    if name == "ZeroOptimizer":
        from .optimizer import ZeroOptimizer

        return ZeroOptimizer
    if name == "init_module_":
        from .optimizer.materialize import init_module_

        return init_module_
    if name in _CHECKPOINT:
        from . import checkpoint

        return getattr(checkpoint, name)
    raise AttributeError(f"module 'zero_kernels' has no attribute {name!r}")
