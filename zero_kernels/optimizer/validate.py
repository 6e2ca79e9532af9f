"""Checks at `ZeroOptimizer`'s boundary: arguments, parameters, and ranks that must agree.

Every error names the argument and the value it got. Checks that need no other rank run first,
so a bad argument fails on its own rank before any collective; the agreement check is the first
collective of a constructor, so ranks that disagree get a `ValueError` on every rank, naming what
differs and on which rank, instead of meeting in mismatched collectives.
"""

from __future__ import annotations

import inspect
import os

import torch
from torch import nn

from .. import comm
from ..buffers import storage_id
from ..policy import flat_option_error, option_owner

__all__ = [
    "check_kwargs",
    "check_params",
    "check_launch",
    "check_agree",
    "check_stage3",
    "check_intact",
]


def check_stage3(shard, module, units) -> None:
    """Stage 3's own arguments: the model (units are found in it) and ``units=``."""
    if not shard.params and not isinstance(module, nn.Module):
        raise ValueError(
            "stage=3 needs the model: pass it as the first argument, or the param groups first "
            f"and module=model (got module={type(module).__name__})"
        )
    if shard.params and units is not None:
        raise ValueError(f"units= is a stage-3 option, got stage={shard.stage!r}")


def check_kwargs(optimizer_class, defaults: dict, own: tuple[str, ...]) -> None:
    """Keyword arguments that neither ZeroOptimizer (its keywords ``own``) nor
    ``optimizer_class`` takes; a policy's field given flat names its policy."""
    flat = [k for k in defaults if option_owner(k) is not None]
    if flat:
        raise flat_option_error("ZeroOptimizer", flat)
    try:
        sig = inspect.signature(optimizer_class.__init__)
    except (TypeError, ValueError):
        return
    ps = sig.parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in ps):
        return
    names = {p.name for p in ps} - {"self", "params"}
    bad = sorted(k for k in defaults if k not in names)
    if bad:
        raise TypeError(
            f"ZeroOptimizer got unexpected keyword argument(s) {bad}: not an option of "
            f"ZeroOptimizer ({', '.join(own)}) nor an argument of "
            f"{optimizer_class.__name__} ({', '.join(sorted(names))})"
        )


def _dtensor_message(what: str, t: torch.Tensor) -> str:
    mesh = getattr(t, "device_mesh", None)
    shape = tuple(mesh.shape) if mesh is not None else "?"
    return (
        f"{what} is a DTensor (placements {tuple(getattr(t, 'placements', ()))} on a device mesh "
        f"of shape {shape}), made by tensor parallelism (parallelize_module) or FSDP2's "
        "fully_shard: ZeroOptimizer shards plain tensors over its own process group and does "
        "not combine with either (it would copy the DTensor's local shard as if it were the "
        "whole tensor). Build the ZeroOptimizer over the model without them, or use FSDP2 "
        "alone for a DTensor model"
    )


def _is_dtensor(t) -> bool:
    return any(c.__name__ == "DTensor" for c in type(t).__mro__)


def _is_flat_param(t) -> bool:
    """FSDP1's FlatParameter (its class reads as Parameter: a metaclass checks this flag)."""
    return bool(getattr(t, "_is_flat_param", False))


_FSDP1 = (
    "is FSDP's flat parameter (FullyShardedDataParallel): FSDP reduces and shards the gradients "
    "and the params itself and swaps the flat parameter's data in each forward (a ZeroOptimizer "
    "over it failed at the first step with a size mismatch). Use one of the two: a "
    "ZeroOptimizer over the model without FSDP replaces it"
)


def check_params(
    params: dict[int, torch.Tensor], names: dict[int, str], module, tp_ids=frozenset()
) -> None:
    """Parameters ZeroOptimizer can shard: leaves, floating point, materialised, dense grads,
    plain tensors or the tensor-parallel DTensors ``tp_ids`` (ids: checked by
    `zero_kernels.optimizer.tensor_parallel.find`), no FSDP flat parameter; with the module: no
    FSDP wrapper in it, no other DTensor among its params and buffers either."""
    if isinstance(module, nn.Module):
        for mname, m in module.named_modules():
            if type(m).__name__ == "FullyShardedDataParallel":
                what = f"module {mname}" if mname else "the model"
                raise TypeError(
                    f"{what} is a FullyShardedDataParallel: a "
                    "ZeroOptimizer shards the model itself and does not combine with FSDP; "
                    "build it over the model without FSDP"
                )
            if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse:
                if m.weight.requires_grad:
                    raise NotImplementedError(
                        f"module {mname or type(m).__name__} has sparse=True: ZeroOptimizer "
                        "reduce-scatters dense gradients; build it with sparse=False"
                    )
        for kind, items in (
            ("param", module.named_parameters()),
            ("buffer", module.named_buffers()),
        ):
            for n, t in items:
                if _is_dtensor(t) and id(t) not in tp_ids:
                    if tp_ids and kind == "param":
                        raise NotImplementedError(
                            f"param {n} is a tensor-parallel DTensor that this ZeroOptimizer "
                            "was not given (frozen, or left out of its param groups): "
                            "frozen DTensor params are not supported yet"
                        )
                    raise TypeError(_dtensor_message(f"{kind} {n}", t))
    for p in params.values():
        name = names.get(id(p)) or f"of shape {tuple(p.shape)}"
        if id(p) in tp_ids:
            if not p.requires_grad:
                raise NotImplementedError(
                    f"param {name} is a frozen tensor-parallel DTensor (requires_grad=False): "
                    "not supported yet; leave it out of the optimizer and the model's frozen set"
                )
            continue
        if _is_dtensor(p):
            raise TypeError(_dtensor_message(f"param {name}", p))
        if _is_flat_param(p):
            raise TypeError(f"param {name} {_FSDP1}")
        if not p.is_leaf:
            raise ValueError(
                f"param {name} is not a leaf tensor (it was computed from others, "
                f"grad_fn={p.grad_fn}): optimizers take leaves (nn.Parameter)"
            )
        if p.is_meta and not isinstance(module, nn.Module):
            raise ValueError(
                f"param {name} is on the meta device: to materialise it ZeroOptimizer needs the "
                "model (pass it as the first argument or module=model)"
            )
        if not (p.is_floating_point() or p.is_complex()) or p.is_complex():
            raise TypeError(f"param {name} has dtype {p.dtype}: ZeroOptimizer takes float params")
        if p.layout != torch.strided:
            raise TypeError(f"param {name} has layout {p.layout}: ZeroOptimizer takes dense params")


def check_launch() -> None:
    """A launcher that asked for several ranks but no process group: never train at size 1."""
    ws = os.environ.get("WORLD_SIZE")
    if ws is not None and ws.isdigit() and int(ws) > 1 and not comm.is_initialized():
        raise RuntimeError(
            f"WORLD_SIZE={ws} is set (a launcher such as torchrun started {ws} ranks) but "
            "torch.distributed is not initialised: call torch.distributed.init_process_group() "
            "before ZeroOptimizer, or each rank would train alone at world size 1"
        )


def check_agree(config: dict, group, device) -> None:
    """Every rank's ``config`` (small, picklable) equal, or a ValueError on every rank."""
    if comm.world_size(group) == 1:
        return
    every = comm.all_gather_object(config, group=group)
    diffs = []
    for r, other in enumerate(every):
        for k in sorted(set(other) | set(every[0])):
            if other.get(k) != every[0].get(k):
                diffs.append(f"{k}: rank 0 has {every[0].get(k)!r}, rank {r} has {other.get(k)!r}")
    if diffs:
        raise ValueError(
            "ZeroOptimizer: ranks were built with different settings, which would meet in "
            "mismatched collectives: " + "; ".join(diffs[:6]) + ("; ..." if len(diffs) > 6 else "")
        )


def agree_or_raise(problem: str | None, group, where: str) -> None:
    """Every rank's verdict on a call that goes on into collectives: ``problem`` (a message, or
    None where this rank can go on). Where any rank has one, every rank raises the same
    ValueError naming each failing rank's problem, instead of the failing rank raising alone
    while the others wait in the next collective for its timeout. A collective itself: call it
    on every rank, before the first collective the checks guard."""
    every = (
        [problem] if comm.world_size(group) == 1 else comm.all_gather_object(problem, group=group)
    )
    bad = [(r, p) for r, p in enumerate(every) if p is not None]
    if not bad:
        return
    if len({p for _, p in bad}) == 1:
        ranks = ", ".join(str(r) for r, _ in bad)
        raise ValueError(f"{where} failed on rank(s) {ranks} of {len(every)}: {bad[0][1]}")
    raise ValueError(
        f"{where} failed on {len(bad)} of {len(every)} ranks: "
        + "; ".join(f"rank {r}: {p}" for r, p in bad)
    )


def check_intact(core, expected: dict, module_params: list | None) -> None:
    """Params whose data was replaced after construction (``p.data = ...``,
    ``model.to(dtype)``, ``load_state_dict(assign=True)``) would silently stop training.
    ``expected``: index -> (storage id, dtype) at construction; ``module_params``: the ids of the
    module's params then (None without a module)."""
    for i, p in core.trainable.items():
        ptr, dt = expected[i]
        if storage_id(p) != ptr or p.dtype != dt:
            name = core.param_name(i)
            raise RuntimeError(
                f"param {name}: its data was replaced after ZeroOptimizer was built "
                f"(now dtype={p.dtype}, a new storage), e.g. by `p.data = ...`, "
                "model.to(dtype) or load_state_dict(assign=True); the optimizer would no "
                "longer train it. Load values in place (model.load_state_dict(sd), "
                "opt.set_full_param) or build the ZeroOptimizer after changing the model"
            )
    if core.module is not None:
        now = [id(p) for p in core.module.parameters()]
        if now != module_params:
            fsdp = any(_is_dtensor(p) or _is_flat_param(p) for p in core.module.parameters())
            raise RuntimeError(
                "the module's parameters were replaced after ZeroOptimizer was built (e.g. "
                "load_state_dict(assign=True) or a new nn.Parameter): the optimizer holds "
                "the old ones; load values in place or build the ZeroOptimizer again"
                + (
                    ". They are FSDP's now (fully_shard or FullyShardedDataParallel): "
                    "ZeroOptimizer shards the model itself, do not also wrap it in FSDP"
                    if fsdp
                    else ""
                )
            )
    frozen = {i: core.params[i] for i in core.layout.frozen} | core.frozen
    for i, p in frozen.items():
        if p.grad is not None and p.requires_grad:
            raise RuntimeError(
                f"param {core.param_name(i)} was frozen (requires_grad=False) when "
                "ZeroOptimizer was built, so its gradient is not reduced, but it now has a "
                "gradient; build the ZeroOptimizer after unfreezing it"
            )


def check_step_kwargs(runner, kwargs: dict) -> None:
    """A TypeError naming each keyword of ``opt.step(**kwargs)`` the step cannot take
    (``runner``: the core's `zero_kernels.partition.runner.ShardRunner`):
    any keyword where the fused Adam kernel steps (it takes none), else one the inner
    optimizer's ``step`` does not accept (checked before anything is stepped)."""
    if not kwargs:
        return
    name = runner.optimizer_class.__name__
    if any(runner.fused):
        raise TypeError(
            f"ZeroOptimizer.step: {name} runs as the fused Adam kernel here, whose step takes "
            f"no keyword arguments; got {', '.join(map(repr, kwargs))} (kwargs={kwargs!r}); "
            "fused_adam=False runs torch's own step"
        )
    try:
        params = inspect.signature(runner.inner.step).parameters
    except (TypeError, ValueError):
        return  # no signature to read: the inner step itself decides
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    takes = {
        n
        for n, p in params.items()
        if n != "closure"
        and p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    }
    bad = [k for k in kwargs if k not in takes]
    if bad:
        raise TypeError(
            f"ZeroOptimizer.step: {name}.step() takes no keyword argument "
            f"{', '.join(map(repr, bad))} (kwargs={kwargs!r}; it takes "
            f"{', '.join(sorted(takes)) or 'only closure'}); nothing was stepped"
        )
