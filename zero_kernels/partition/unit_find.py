"""Which modules are stage 3's units, and which unit each param and module belongs to (see
[Note: units] in `zero_kernels.partition.units`)."""

from __future__ import annotations

import torch
from torch import nn

from ..layout import is_vector

__all__ = ["find_units", "unit_assignment", "unit_members"]


def find_units(model: nn.Module, units=None) -> list[tuple[str, nn.Module]]:
    """``[(name, module)]`` of the units (the root unit not included); see [Note: units].

    ``units``: None (automatic), a list of module classes (every outermost instance is a unit),
    a predicate ``f(name, module) -> bool`` (outermost matches), or a list of modules."""
    named = list(model.named_modules())
    if units is None:
        best, size = None, 0
        for name, m in named:
            if isinstance(m, nn.ModuleList) and len(m) > 1:
                n = sum(p.numel() for p in m.parameters())
                if n > size:
                    best, size = (name, m), n
        if best is not None:
            return [(f"{best[0]}.{k}" if best[0] else str(k), c) for k, c in enumerate(best[1])]
        total = sum(p.numel() for p in model.parameters())
        return [
            (n, c)
            for n, c in model.named_children()
            if sum(p.numel() for p in c.parameters()) * 8 >= total and total > 0
        ]
    if isinstance(units, (list, tuple)) and all(isinstance(u, nn.Module) for u in units):
        ids = {id(u) for u in units}
        pick = [(n, m) for n, m in named if id(m) in ids and m is not model]
        if len(pick) != len(units):
            raise ValueError(
                "units=: every module listed must be a submodule of the model (not the model)"
            )
        for a, _ in pick:
            for b, _ in pick:
                if a != b and b.startswith(a + "."):
                    raise ValueError(
                        f"units=: modules {a!r} and {b!r} overlap (one holds the other)"
                    )
    elif isinstance(units, (list, tuple)) and all(isinstance(u, type) for u in units):
        classes = tuple(units)
        pick = [(n, m) for n, m in named if isinstance(m, classes) and m is not model]
    elif callable(units):
        pick = [(n, m) for n, m in named if m is not model and units(n, m)]
    else:
        raise TypeError(
            "units must be None, a list of module classes, a list of modules or a predicate "
            f"(name, module) -> bool, got units={units!r}"
        )
    out: list[tuple[str, nn.Module]] = []  # outermost only: a unit inside a unit is not one
    for n, m in pick:
        if not any(n.startswith(o + ".") for o, _ in out):
            out.append((n, m))
    if not out:
        raise ValueError(f"units={units!r} matched no submodule of the model")
    return out


def unit_assignment(
    unit_modules: list[tuple[str, nn.Module]],
    params: dict[int, torch.Tensor],
    persist_below: int = 0,
    whole_vectors: bool = False,
) -> dict[int, int]:
    """Param index -> unit (1.. for ``unit_modules``, 0 for the root unit, ``len + 1`` for the
    params kept whole on every rank: those of fewer than ``persist_below`` elements and, with
    ``whole_vectors``, every param of one dimension or none). A param found in two units (tied
    across them) goes to the root unit, gathered for the whole step."""
    where: dict[int, set[int]] = {}
    for u, (_, m) in enumerate(unit_modules, start=1):
        for p in m.parameters():
            where.setdefault(id(p), set()).add(u)
    out = {}
    for i, p in params.items():
        us = where.get(id(p), set())
        out[i] = next(iter(us)) if len(us) == 1 else 0
        if p.numel() < persist_below or (whole_vectors and is_vector(p.shape)):
            out[i] = len(unit_modules) + 1
    return out


def unit_members(model: nn.Module, unit_modules: list[tuple[str, nn.Module]]):
    """Per unit (0 = root), the ``(name, module)`` pairs whose own params it materialises."""
    out: list[list[tuple[str, nn.Module]]] = [[] for _ in range(len(unit_modules) + 1)]
    prefixes = [(n, u) for u, (n, _) in enumerate(unit_modules, start=1)]
    for name, m in model.named_modules():
        u = 0
        for n, k in prefixes:
            if name == n or name.startswith(n + "."):
                u = k
                break
        out[u].append((name, m))
    return out
