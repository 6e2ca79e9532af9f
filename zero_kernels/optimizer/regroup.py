"""`ZeroOptimizer.add_param_group`: the optimizer built again over every group, its state kept.

The params are laid out and sharded at construction, so a new group means a new layout: the
whole optimizer state (fp32 masters included) is gathered on every rank, the params are handed
back whole (`close`), the same constructor runs with one more group, and the state, the step
counter, the loss scaler, the counters of `comm_stats` and the hooks registered on the
optimizer are put back. `take` checks the group and keeps what goes back, `put_back` restores
it; the rebuild in between is `ZeroOptimizer.add_param_group`'s own (it holds its construction
arguments and torch's hook registries, which no other module reads).
"""

from __future__ import annotations

import dataclasses

import torch

from .. import comm
from ..partition.state import consolidate, local_payload

__all__ = ["Kept", "put_back", "take"]


@dataclasses.dataclass
class Kept:
    """What `take` kept of an optimizer for `put_back` after it is built again."""

    full: dict  # the whole optimizer state, torch's format, the new group's entry added
    groups: list[dict]  # every param group, the new one last
    steps: object  # core.StepCounter
    skipped: int
    nonfinite: object
    log: dict
    scaler: dict
    growth_interval: int


def take(opt, param_group: dict) -> Kept:
    """Check ``param_group`` against open ZeroOptimizer ``opt`` and keep what its rebuild with
    one more group must put back (collective; see the module doc)."""
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
    return Kept(
        full=full,
        groups=[dict(g) for g in opt.param_groups] + [new],
        steps=dataclasses.replace(core.steps),
        skipped=opt.skipped_steps,
        nonfinite=opt.parts.grads.nonfinite_host,
        log={f.name: getattr(opt.comm_log, f.name) for f in dataclasses.fields(opt.comm_log)},
        scaler=opt.scaler.state_dict(),
        growth_interval=opt.scaler.growth_interval,
    )


def put_back(opt, kept: Kept) -> None:
    """``opt`` built again over ``kept.groups``: the state, counters and scaler it had."""
    core = opt.parts.core
    g = {k: v for k, v in opt.param_groups[-1].items() if k != "params"}
    kept.full["param_groups"].append({**g, "params": list(core.group_indices[-1])})
    opt.load_state_dict(kept.full)
    core.steps.n, core.steps.at_reset = kept.steps.n, kept.steps.at_reset
    opt.skipped_steps, opt.parts.grads.nonfinite_host = kept.skipped, kept.nonfinite
    for k, v in kept.log.items():
        setattr(opt.comm_log, k, v)
    opt.scaler.load_state_dict(kept.scaler)
    opt.scaler.growth_interval = kept.growth_interval
