"""Models built on the meta device, materialised piece by piece with values that do not depend
on the world size.

[Note: deterministic init]
Every module with parameters of its own is initialised by its ``reset_parameters()`` (or the
user's ``init_fn(module)``) under a seed of its own, ``seed`` mixed with the CRC32 of its
qualified name, in a forked RNG. So a parameter's initial value depends only on ``seed``, the
module's name and its init code: not on the rank, the world size, the stage, the order in which
units are materialised or what was initialised before. `init_module_` applies the same rule to a
model built normally, which is how to get the same values without the meta device (tests compare
the two).
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable

import torch
from torch import nn

__all__ = ["init_module_", "materialize_modules_"]


def _seed_for(seed: int, name: str) -> int:
    return (int(seed) * 1_000_003 + zlib.crc32(name.encode())) % (2**63 - 1)


def _init_one(name: str, m: nn.Module, seed: int, init_fn) -> None:
    own = list(m.parameters(recurse=False))
    if not own:
        return
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(_seed_for(seed, name))
        with torch.no_grad():
            if init_fn is not None:
                init_fn(m)
            elif hasattr(m, "reset_parameters"):
                m.reset_parameters()
            else:
                raise ValueError(
                    f"module {name or type(m).__name__} ({type(m).__name__}) has parameters of "
                    "its own but no reset_parameters(): pass init_fn=f(module) to initialise it"
                )


def init_module_(model: nn.Module, seed: int = 0, init_fn=None) -> nn.Module:
    """(Re)initialise every module of ``model`` by the rule of [Note: deterministic init]."""
    for name, m in model.named_modules():
        _init_one(name, m, seed, init_fn)
    return model


def materialize_modules_(
    named: Iterable[tuple[str, nn.Module]], device, seed: int = 0, init_fn=None
) -> None:
    """Give the meta params of these modules (their own, not their children's) real storage on
    ``device`` and initialise them (same Parameter objects: ``param.data`` is replaced)."""
    for name, m in named:
        own = list(m.parameters(recurse=False))
        if not any(p.is_meta for p in own):
            continue
        for p in own:
            if p.is_meta:
                p.data = torch.empty(p.shape, dtype=p.dtype, device=device)
        for b_name, b in list(m.named_buffers(recurse=False)):
            if b.is_meta:
                setattr(m, b_name, torch.zeros(b.shape, dtype=b.dtype, device=device))
        _init_one(name, m, seed, init_fn)
