"""What the integrations share: the ``zero=`` argument, a plain torch optimizer turned into a
`ZeroOptimizer` over the same param groups, and the checks that keep a model out of the
frameworks' own data-parallel wrappers.

[Note: from a torch optimizer]
Trainer (``create_optimizer``), Lightning (``configure_optimizers``) and a user's accelerate
script all build a plain ``torch.optim`` optimizer over the model's params, with param groups
(decay / no decay) and hyper-parameters. `from_torch_optimizer` builds a `ZeroOptimizer` of the
same class over the same groups: each group's constructor arguments are kept (keys the class's
``__init__`` takes, so torch 2.13's derived ``decoupled_weight_decay`` is left for AdamW to set
again; other keys, a group's "name", ride along) and the class's defaults become the
ZeroOptimizer's ``**defaults``. An optimizer that has
already stepped (non-empty ``state``) is refused: its state would be dropped without a word. A
`ZeroOptimizer` given as the optimizer is kept as it is, if it holds the model's params. The
torch optimizer's ``param_groups`` become the ZeroOptimizer's (the same list of dicts), so an LR
scheduler built over it drives the ZeroOptimizer, wherever the scheduler is kept.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Mapping

import torch
from torch import nn

from ..policy import CommPolicy

__all__ = [
    "check_not_wrapped",
    "from_torch_optimizer",
    "is_zero",
    "with_broadcast_buffers",
    "zero_kwargs",
]


def is_zero(optimizer) -> bool:
    from ..optimizer import ZeroOptimizer

    return isinstance(optimizer, ZeroOptimizer)


def zero_kwargs(zero, where: str, *, stage: int | None = None) -> dict:
    """``zero=`` as keyword arguments of `ZeroOptimizer`: a dict of them, a `ZeroPolicy` (as
    ``policy=``), or None (stage 2 unless ``stage``). Names checked here, values by
    `ZeroOptimizer`."""
    from ..optimizer.zero_optimizer import KEYWORDS
    from ..policy import ZeroPolicy, flat_option_error, option_owner

    if zero is None:
        out = {}
    elif isinstance(zero, ZeroPolicy):
        out = {"policy": zero}
    elif isinstance(zero, Mapping):
        out = dict(zero)
        bad = [k for k in out if not isinstance(k, str)]
        if bad:
            raise TypeError(f"{where}: zero= keys must be str, got {bad!r}")
    else:
        raise TypeError(
            f"{where}: zero= must be a dict of ZeroOptimizer keyword arguments, a ZeroPolicy or "
            f"None, got {type(zero).__name__}: {zero!r}"
        )
    known = set(KEYWORDS) - {"module"}
    flat = [k for k in out if option_owner(k) is not None]
    if flat:
        raise flat_option_error(f"{where}: zero=", flat)
    for k in ("params", "optimizer_class", "module"):
        if k in out:
            raise ValueError(
                f"{where}: zero={{{k!r}: ...}} is set by the integration (the model and the "
                "optimizer come from the trainer); leave it out"
            )
    unknown = sorted(k for k in out if k not in known)
    if unknown:
        raise TypeError(
            f"{where}: zero= has unknown key(s) {unknown}: not ZeroOptimizer options "
            f"({', '.join(sorted(known))}); hyper-parameters come from the trainer's optimizer"
        )
    if stage is not None:
        if "stage" in out and out["stage"] != stage:
            raise ValueError(
                f"{where}: stage={stage} and zero={{'stage': {out['stage']!r}}} differ"
            )
        if "policy" not in out:
            out["stage"] = stage
    return out


def with_broadcast_buffers(kwargs: dict, value, source: str, where: str) -> dict:
    """``kwargs`` (`zero_kwargs`'s) with DDP's ``broadcast_buffers`` as the framework's own
    arguments set it (``value``, None where they leave DDP's default; ``source`` names that
    argument): the same choice a DDP run of that framework makes ([Note: replicated module
    state]). Given in ``zero=`` too with another value: a ValueError naming both."""
    if value is None:
        return kwargs
    value = bool(value)
    pol = kwargs.get("policy")
    comm = pol.comm if pol is not None else kwargs.get("comm")
    mine = comm.broadcast_buffers if comm is not None else None
    if mine is not None and mine != value:  # a CommPolicy given in zero= is the user's choice
        raise ValueError(
            f"{where}: {source}={value} and the ZeroOptimizer's broadcast_buffers={mine} "
            "differ; set one of them"
        )
    if pol is not None:
        return {**kwargs, "policy": pol.replace(broadcast_buffers=value)}
    return {**kwargs, "comm": dataclasses.replace(comm or CommPolicy(), broadcast_buffers=value)}


def check_not_wrapped(model: nn.Module, where: str) -> None:
    """A model already inside DDP or FSDP cannot be handed to a ZeroOptimizer."""
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(model, DistributedDataParallel):
        raise TypeError(
            f"{where}: the model is a DistributedDataParallel; ZeroOptimizer reduces the "
            "gradients itself. Pass the model before it is wrapped (model.module here)"
        )
    fsdp = any(type(m).__name__.startswith("FSDP") for m in model.modules())  # fully_shard's
    for p in model.parameters():
        cls = type(p).__name__
        if cls == "DTensor" and not fsdp and getattr(p, "device_mesh", None) is not None:
            if p.device_mesh.ndim == 1 and all(
                type(x).__name__ in ("Shard", "Replicate") for x in p.placements
            ):
                raise NotImplementedError(
                    f"{where}: the model is tensor-parallel (DTensor params, placements "
                    f"{tuple(p.placements)}): the integrations do not take such a model yet; "
                    "build ZeroOptimizer(model, ..., process_group=mesh['dp'].get_group()) "
                    "and train it in your own loop (docs/tensor_parallel.md)"
                )
        if cls in ("DTensor", "FlatParameter") or hasattr(p, "_is_flat_param"):
            raise TypeError(
                f"{where}: the model's params are FSDP's ({cls}); ZeroOptimizer shards the "
                "model itself: pass the model before fully_shard/FullyShardedDataParallel"
            )


def _group_args(cls: type) -> set[str]:
    params = inspect.signature(cls.__init__).parameters
    return {k for k in params if k not in ("self", "params")}


def from_torch_optimizer(model: nn.Module, optimizer, zero: dict, where: str):
    """A `ZeroOptimizer` of ``optimizer``'s class over its param groups, with their
    hyper-parameters (see [Note: from a torch optimizer]); ``zero``: `zero_kwargs`'s dict."""
    from ..optimizer import ZeroOptimizer

    check_not_wrapped(model, where)
    if isinstance(optimizer, ZeroOptimizer):
        mine = {id(p) for p in model.parameters()}
        held = [p for g in optimizer.param_groups for p in g["params"]]
        if any(id(p) not in mine for p in held):
            raise ValueError(
                f"{where}: the ZeroOptimizer given holds params that are not the model's"
            )
        return optimizer
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"{where}: expected a torch.optim.Optimizer, got {type(optimizer).__name__}"
        )
    if any(len(s) for s in optimizer.state.values()):
        raise ValueError(
            f"{where}: the {type(optimizer).__name__} given has already stepped; its state "
            "would be dropped. Build the optimizer fresh (or load the state into the "
            "ZeroOptimizer after, through load_checkpoint)"
        )
    cls = type(optimizer)
    args = _group_args(cls)
    defaults = {k: v for k, v in optimizer.defaults.items() if k in args}
    # keys a class derives in __init__ (not arguments) are left for it to set again; any other
    # key of a group (a "name", say) rides along, as torch.optim keeps it
    derived = {k for k in optimizer.defaults if k not in args}
    groups = [{k: v for k, v in g.items() if k not in derived} for g in optimizer.param_groups]
    z = ZeroOptimizer(groups, cls, module=model, **{**defaults, **zero})
    # an LR scheduler built over the torch optimizer (Trainer(optimizers=(opt, sched)), a
    # user's own) keeps writing its groups: they become the ZeroOptimizer's, so its lr is the
    # one the ZeroOptimizer steps with, not a dead copy's
    optimizer.param_groups = z.param_groups
    optimizer._opt_called = True  # the scheduler's "step before optimizer.step" check
    return z


def shard_of(kwargs: dict):
    """The `ShardPolicy` a ZeroOptimizer built from ``kwargs`` (`zero_kwargs`'s dict) will have:
    its policy's, else its stage's (default 2)."""
    from ..policy import ShardPolicy

    if "policy" in kwargs:
        return kwargs["policy"].shard
    return ShardPolicy.of_stage(kwargs.get("stage") or 2)
