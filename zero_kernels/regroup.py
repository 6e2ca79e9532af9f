"""`ZeroOptimizer.add_param_group`: the optimizer built again over every group, its state kept.

The params are laid out and sharded at construction, so a new group means a new layout: the
whole optimizer state (fp32 masters included) is gathered on every rank, the params are handed
back whole (`close`), the same constructor runs with one more group, and the state, the step
counter, the loss scaler, the counters of `comm_stats` and the hooks registered on the
optimizer are put back.
"""

from __future__ import annotations

import dataclasses

import torch

from . import comm
from .partition.state import consolidate, local_payload

__all__ = ["add_group"]


def add_group(opt, param_group: dict) -> None:
    """Add ``param_group`` to open ZeroOptimizer ``opt`` (collective; see the module doc)."""
    if not isinstance(param_group, dict) or "params" not in param_group:
        raise TypeError(
            "add_param_group: param_group must be a dict with 'params', got "
            f"{type(param_group).__name__}"
        )
    new = dict(param_group)
    ps = new["params"]
    new["params"] = [ps] if isinstance(ps, torch.Tensor) else list(ps)
    core = opt.parts.core
    held = {id(p) for p in core.params.values()}
    if any(id(p) in held for p in new["params"]):
        raise ValueError(
            "add_param_group: some parameters appear in more than one parameter group "
            "(a param of the new group is held by this optimizer already)"
        )
    comm.check_arrival(core.side, "ZeroOptimizer.add_param_group()", opt.timeout)
    opt.wait_params()
    payload = local_payload(core.layout, core.runner, masters=True)
    got = comm.all_gather_object(payload, group=core.shard_group)
    full = consolidate(core.layout, got, opt.param_groups, core.group_indices)
    groups = [dict(g) for g in opt.param_groups] + [new]
    steps = dataclasses.replace(core.steps)
    skipped, nonfinite = opt.skipped_steps, opt.parts.grads.nonfinite_host
    hooks = {k: v for k, v in vars(opt).items() if k.startswith("_optimizer_") and "hook" in k}
    log, scaler = dict(vars(opt.comm_log)), dict(vars(opt.scaler))
    optimizer_class, kwargs = opt._init_args
    opt.close()
    type(opt).__init__(opt, groups, optimizer_class, **kwargs)
    core = opt.parts.core
    g = {k: v for k, v in opt.param_groups[-1].items() if k != "params"}
    full["param_groups"].append({**g, "params": list(core.group_indices[-1])})
    opt.load_state_dict(full)
    core.steps.n, core.steps.at_reset = steps.n, steps.at_reset
    opt.skipped_steps, opt.parts.grads.nonfinite_host = skipped, nonfinite
    vars(opt).update(hooks)
    vars(opt.comm_log).update(log)
    vars(opt.scaler).update(scaler)
