"""Models built on the meta device, materialised piece by piece with values that do not depend
on the world size.

[Note: deterministic init]
Every module with parameters or buffers of its own (`_owns_state`, the one predicate of both
paths) is initialised by its ``reset_parameters()`` (or the user's ``init_fn(module)``) under a
seed of its own, ``seed`` mixed with the CRC32 of its qualified name, in a forked RNG. So a
parameter's or buffer's initial value depends only on ``seed``, the module's name and its init
code: not on the rank, the world size, the stage, the order in which units are materialised or
what was initialised before. `init_module_` applies the same rule to a model built normally,
which is how to get the same values without the meta device (tests compare the two, params and
buffers). A module with buffers and no params (a random table drawn in ``reset_parameters()``)
counts: `init_module_` once skipped it and kept its constructor's draws, which the meta build
does not reproduce. Only what cannot be made differs: on the meta device a module without
``reset_parameters()`` (and no ``init_fn``) raises, while `init_module_` keeps the buffers of
such a module with no params (rotary frequencies computed in ``__init__``) and raises for one
with params.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable

import torch
from torch import nn

__all__ = ["init_module_", "materialize_modules_"]


def _seed_for(seed: int, name: str) -> int:
    return (int(seed) * 1_000_003 + zlib.crc32(name.encode())) % (2**63 - 1)


def _owns_state(m: nn.Module) -> bool:
    """Whether [Note: deterministic init] initialises ``m``: it has params or buffers of its
    own."""
    return any(True for _ in m.parameters(recurse=False)) or any(
        True for _ in m.buffers(recurse=False)
    )


def _init_one(name: str, m: nn.Module, seed: int, init_fn, meta: bool) -> None:
    """Initialise ``m`` by the rule (``meta``: its state was just materialised from meta)."""
    if init_fn is None and not hasattr(m, "reset_parameters"):
        if not meta and not any(True for _ in m.parameters(recurse=False)):
            return  # buffers only, built normally: the constructor's (see the Note)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(_seed_for(seed, name))
        with torch.no_grad():
            if init_fn is not None:
                init_fn(m)
            elif hasattr(m, "reset_parameters"):
                m.reset_parameters()
            else:
                where = " on the meta device" if meta else ""
                raise ValueError(
                    f"module {name or type(m).__name__} ({type(m).__name__}) has parameters or "
                    f"buffers of its own{where} but no reset_parameters(): pass "
                    "init_fn=f(module) to initialise it"
                )


def init_module_(model: nn.Module, seed: int = 0, init_fn=None) -> nn.Module:
    """(Re)initialise every module of ``model`` by the rule of [Note: deterministic init]."""
    for name, m in model.named_modules():
        if _owns_state(m):
            _init_one(name, m, seed, init_fn, meta=False)
    return model


def materialize_modules_(
    named: Iterable[tuple[str, nn.Module]],
    device,
    seed: int = 0,
    init_fn=None,
    storage: dict[int, torch.Tensor] | None = None,
) -> None:
    """Give the meta params of these modules (their own, not their children's) real storage on
    ``device`` and initialise them (same Parameter objects: ``param.data`` is replaced).
    ``storage``: ``{id(param): tensor}``, memory of the param's shape and dtype to materialise
    it into (stage 3: its view of the unit's gathered bucket); the others get new tensors."""
    storage = storage or {}
    named = list(named)
    fresh: set[int] = set()  # params materialised here: their modules (all of them) init
    fresh_buffers: set[int] = set()  # modules whose meta buffers were materialised
    # a module initialised here owns state (`_owns_state`) that was on meta: in a meta build,
    # every module `init_module_` initialises
    for _, m in named:
        for p in m.parameters(recurse=False):
            if p.is_meta:  # the same Python object, now with real storage (set_data cannot
                # change a meta tensor's device)
                real = storage.get(id(p))
                if real is None:
                    real = torch.empty(p.shape, dtype=p.dtype, device=device)
                else:
                    assert real.shape == p.shape and real.dtype == p.dtype, (real.shape, p.shape)
                torch.utils.swap_tensors(p, nn.Parameter(real, requires_grad=p.requires_grad))
                fresh.add(id(p))
        for b_name, b in list(m.named_buffers(recurse=False)):
            if b.is_meta:
                setattr(m, b_name, torch.zeros(b.shape, dtype=b.dtype, device=device))
                fresh_buffers.add(id(m))
    for name, m in named:  # registration order, as `init_module_` (a tied param: the last)
        if any(id(p) in fresh for p in m.parameters(recurse=False)) or id(m) in fresh_buffers:
            _init_one(name, m, seed, init_fn, meta=True)
