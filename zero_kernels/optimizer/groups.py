"""The params a `ZeroOptimizer` is given, normalised: param-group dicts (tied params once) and
the names to use in errors and layouts."""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["param_groups"]


def param_groups(params) -> tuple[list[dict], dict[int, str]]:
    """Normalise ``params`` to a list of group dicts (tied params once) and names by id."""
    names: dict[int, str] = {}
    if isinstance(params, nn.Module):
        for n, p in params.named_parameters():  # deduplicates tied parameters
            names.setdefault(id(p), n)
        params = list(params.parameters())
    if isinstance(params, torch.Tensor):
        raise TypeError(
            "params must be an iterable of tensors or dicts, or an nn.Module, got a single Tensor"
        )
    try:
        params = list(params)
    except TypeError:
        raise TypeError(
            "params must be an nn.Module or an iterable of tensors or dicts (param groups), "
            f"got {type(params).__name__}"
        ) from None
    if not params:
        raise ValueError("ZeroOptimizer got an empty parameter list")
    groups = [dict(g) for g in params] if isinstance(params[0], dict) else [{"params": params}]
    seen: dict[int, int] = {}
    for gi, g in enumerate(groups):
        ps = g["params"]
        ps = [ps] if isinstance(ps, torch.Tensor) else list(ps)
        uniq = []
        for p in ps:
            if isinstance(p, tuple) and len(p) == 2:  # (name, param) pairs
                names.setdefault(id(p[1]), p[0])
                p = p[1]
            if not isinstance(p, torch.Tensor):
                raise TypeError(f"param group {gi}: params must be tensors, got {type(p).__name__}")
            if id(p) in seen:
                if seen[id(p)] != gi:
                    raise ValueError(
                        f"param {names.get(id(p), tuple(p.shape))} appears in "
                        f"param groups {seen[id(p)]} and {gi}"
                    )
                continue  # tied: counted once
            seen[id(p)] = gi
            uniq.append(p)
        g["params"] = uniq
    return groups, names
