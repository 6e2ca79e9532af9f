"""Which partition mode an optimizer class gets: flat shards or whole-parameter ownership.

Flat sharding is only right for optimizers whose update of an element depends on that element
alone (and on per-tensor scalars such as ``step`` that are the same for every element). An
optimizer that reduces over a tensor (Adafactor's row/column factors, Muon's orthogonalisation,
LAMB's trust ratio) computes something else on a slice, silently; so an optimizer is flat only
when it is known or declared element-wise (``zero_elementwise = True`` on the class), and every
other one gets whole parameters.
"""

from __future__ import annotations

import torch

from ..policy import PARTITIONS

__all__ = ["ELEMENTWISE", "PARTITIONS", "choose_mode"]


ELEMENTWISE = tuple(
    getattr(torch.optim, n)
    for n in (
        "SGD",
        "Adam",
        "AdamW",
        "Adamax",
        "NAdam",
        "RAdam",
        "Adagrad",
        "Adadelta",
        "RMSprop",
        "Rprop",
        "ASGD",
    )
    if hasattr(torch.optim, n)
)

# Optimizers whose step needs a closure that re-evaluates the loss: the closure would run the
# model again under ZeRO's hooks several times per step, which this layer does not support.
_CLOSURE_ONLY = tuple(getattr(torch.optim, n) for n in ("LBFGS",) if hasattr(torch.optim, n))


def choose_mode(optimizer_class, partition: str = "auto") -> tuple[str, str]:
    """``(mode, reason)`` for ``optimizer_class``; raises for optimizers this layer cannot run."""
    if isinstance(optimizer_class, torch.optim.Optimizer):
        name = type(optimizer_class).__name__
        raise TypeError(
            f"optimizer_class must be a torch.optim.Optimizer subclass, got an instance of "
            f"{name}: pass the class and its arguments as keywords, e.g. "
            f"ZeroOptimizer(model, {type(optimizer_class).__module__}.{name}, lr=...), and "
            "param groups as the first argument: the ZeroOptimizer builds the optimizer over "
            "each rank's shards"
        )
    if not (
        isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)
    ):
        raise TypeError(
            "optimizer_class must be a torch.optim.Optimizer subclass, got "
            f"optimizer_class={optimizer_class!r}"
        )
    if partition not in PARTITIONS:
        raise ValueError(f"partition must be one of {PARTITIONS}, got partition={partition!r}")
    name = optimizer_class.__name__
    if issubclass(optimizer_class, _CLOSURE_ONLY) or getattr(
        optimizer_class, "zero_closure_only", False
    ):
        raise NotImplementedError(
            f"optimizer_class={name} needs a closure that re-evaluates the model at every step; "
            "ZeroOptimizer cannot shard closure-only optimizers (LBFGS): use DDP for it"
        )
    if getattr(torch.optim, "SparseAdam", None) is not None and issubclass(
        optimizer_class, torch.optim.SparseAdam
    ):
        raise NotImplementedError(f"optimizer_class={name}: sparse gradients are not supported")
    if partition != "auto":
        return partition, f"partition={partition!r} forced"
    declared = getattr(optimizer_class, "zero_elementwise", None)
    if declared is not None:
        mode = "flat" if declared else "whole"
        return mode, f"{name}.zero_elementwise={declared!r}"
    if optimizer_class in ELEMENTWISE:
        return "flat", f"{name} is element-wise"
    return "whole", f"{name} is not known to be element-wise: whole-parameter ownership"
