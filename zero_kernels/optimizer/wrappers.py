"""Data-parallel wrappers over a `ZeroOptimizer`'s params: found and refused, whichever is built
first.

[Note: wrappers]
``ZeroOptimizer`` reduces the gradients itself (reduce-scatter per bucket from the params'
post-accumulate-grad hooks). A ``DistributedDataParallel`` over the same params adds a second
reducer: with ``find_unused_parameters=False`` (Lightning's ``strategy="ddp"``, accelerate's
``prepare``, HF Trainer with gradient checkpointing) the two fight over ``param.grad`` and the
step ran on zero gradients, silently (per-rank loss off by 1.7-3.7%, weights 100% off after 10
steps); with ``find_unused_parameters=True`` the numbers were right but DDP all-reduced the whole
model every backward on top of ZeRO's traffic. So a DDP over a live ZeroOptimizer's params is an
error on every rank, found three ways:

- DDP built after the optimizer: `install` (run when `zero_kernels.optimizer` is imported) wraps
  ``DistributedDataParallel.__init__`` with a check that runs before DDP's first collective, so
  every rank constructing it raises there, together;
- DDP built before: the same wrapper marks each param it covers (a weak reference to the DDP),
  and the optimizer's constructor refuses marked params whose DDP is alive, before its own first
  collective;
- a DDP built before `zero_kernels.optimizer` was imported is not marked: the optimizer's
  forward pre-hook on the model (when it has the model) sees DDP's forward running
  (``DistributedDataParallel._active_ddp_module``) over its params and raises.

FSDP (``fully_shard``, ``FullyShardedDataParallel``) applied after the optimizer replaces the
params or their data, which the optimizer refuses at the next step
(`zero_kernels.optimizer.validate.check_intact`, whose message names FSDP when the new params are
DTensors
or flat parameters); applied before, its flat parameters, its wrapper module or its DTensor
params are refused by the constructor (`zero_kernels.optimizer.validate.check_params`), as are
tensor
parallelism's DTensor params and buffers.
"""

from __future__ import annotations

import functools
import weakref

import torch

__all__ = [
    "MARK",
    "check_forward",
    "check_not_wrapped",
    "install",
    "owner_of",
    "wrapped_message",
]

# the attribute a DDP built while zero_kernels is imported leaves on each of its params
MARK = "_zero_kernels_ddp"

_installed = False


def wrapped_message(name: str, where: str) -> str:
    return (
        f"{where}: param {name} is held by a ZeroOptimizer, which reduces the gradients itself; "
        "a DistributedDataParallel over it reduces them a second time, and with "
        "find_unused_parameters=False the ZeroOptimizer steps on zero gradients. Do not wrap "
        "the model in DDP (or FSDP): train the model itself, ZeroOptimizer(model, ...) replaces "
        "the DDP wrapper and the optimizer. With HF Trainer, Accelerate or Lightning, keep the "
        "model out of their DDP (see [Note: wrappers] in zero_kernels/optimizer/wrappers.py)"
    )


def owner_of(p: torch.Tensor):
    """The live, open ZeroOptimizer holding ``p``, or None."""
    ref = getattr(p, "_zero_kernels_owner", None)
    o = ref() if ref is not None else None
    return o if o is not None and not getattr(o, "closed", True) else None


def _ddp_class():
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel


def install() -> None:
    """Wrap ``DistributedDataParallel.__init__`` once (see [Note: wrappers])."""
    global _installed
    if _installed:
        return
    ddp = _ddp_class()
    orig = ddp.__init__
    if getattr(orig, "_zero_kernels_guard", False):
        _installed = True
        return

    @functools.wraps(orig)
    def __init__(self, module, *args, **kwargs):
        if isinstance(module, torch.nn.Module):
            for n, p in module.named_parameters():
                if owner_of(p) is not None:
                    raise RuntimeError(wrapped_message(repr(n), "DistributedDataParallel(module)"))
        orig(self, module, *args, **kwargs)
        me = weakref.ref(self)
        for p in module.parameters():
            setattr(p, MARK, me)

    __init__._zero_kernels_guard = True
    ddp.__init__ = __init__
    _installed = True


def check_not_wrapped(params, names: dict[int, str], module) -> None:
    """At construction: refuse params under a live DDP (built first) or a DDP given as the
    model."""
    ddp = _ddp_class()
    if module is not None:
        for n, m in module.named_modules():
            if isinstance(m, ddp):
                raise RuntimeError(
                    wrapped_message(
                        f"{n or '<the model>'!r} (a DistributedDataParallel)",
                        "ZeroOptimizer(model)",
                    )
                )
    for p in params:
        ref = getattr(p, MARK, None)
        if ref is not None and ref() is not None:
            raise RuntimeError(
                wrapped_message(repr(names.get(id(p)) or tuple(p.shape)), "ZeroOptimizer(...)")
            )


def check_forward(ids: set[int]) -> None:
    """In a forward pre-hook of the optimizer's model: DDP's forward is running over it."""
    if torch.compiler.is_compiling():
        return
    active = getattr(_ddp_class(), "_active_ddp_module", None)
    if active is None:
        return
    for n, p in active.module.named_parameters():
        if id(p) in ids:
            raise RuntimeError(wrapped_message(repr(n), "DistributedDataParallel.forward"))
