"""`UnitInfo`: the public view of stage 3's units (``ZeroOptimizer.units()``), what FSDP2's
users find by asking which modules are ``FSDPModule``s: which modules became units, which params
each one gathers (and so which sit in the root unit), how large it is gathered, and its state
now. Debugging a stage-3 run starts here; tests and benchmarks read units through it."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

__all__ = ["UnitInfo", "unit_infos"]


@dataclass(frozen=True)
class UnitInfo:
    """One stage-3 unit, as it is when `ZeroOptimizer.units` is called.

    name: the module's qualified name in the model ("" for the model itself, the root unit).
    kind: "root" (the model's own params and those of modules that are not units; gathered
        around the whole forward and backward), "unit" (a module gathered around its own
        forward and backward), or "kept" (params kept whole between uses: those under
        ``persist_below`` and the vectors ``quantize_weights`` leaves exact).
    module: the module (None for "kept", which gathers params of several modules).
    params: the names of the params it gathers, trainable and frozen (sharded frozen params,
        ``shard_frozen=True``), each once, in the model's order (a tied param by its first name).
    numel: their elements.
    gathered_bytes: the bytes its buckets take when gathered (every rank's shard, with the
        padding that makes shards equal): the memory a gather of it costs.
    buckets: its flat buckets (one all-gather each).
    state: "sharded", "gathering", "gathered" or "secondary" (sharded, with the node-local
        copy ``secondary_shard`` keeps for the backward).
    """

    name: str
    kind: str
    module: nn.Module | None
    params: tuple[str, ...]
    numel: int
    gathered_bytes: int
    buckets: int
    state: str


def unit_infos(sched, module: nn.Module | None) -> list[UnitInfo]:
    """The root unit, then the units in the model's module order, then the kept-whole params'
    unit (where there is one), from a `zero_kernels.partition.units.UnitScheduler`."""
    names: dict[int, str] = {}  # id -> first name, in the model's order
    mod_names: dict[int, str] = {}
    if module is not None:
        for n, p in module.named_parameters(remove_duplicate=False):
            names.setdefault(id(p), n)
        for n, m in module.named_modules(remove_duplicate=False):
            mod_names.setdefault(id(m), n)
    order = {k: j for j, k in enumerate(names)}
    store = sched.store
    out = []
    for u in sched.all_units:
        kind = "kept" if u.persistent else "root" if u is sched.root else "unit"
        members, numel, nbytes = {}, 0, 0
        for i, b in u.buckets:
            full = store.gathered[i][b]
            nbytes += full.numel() * full.element_size()
            for p, _, _ in store.members.get((i, b), ()):
                if id(p) not in members:
                    members[id(p)] = p
                    numel += p.numel()
        ids = sorted(members, key=lambda k: order.get(k, len(order)))
        params = [names.get(k, f"<{tuple(members[k].shape)}>") for k in ids]
        out.append(
            UnitInfo(
                name=mod_names.get(id(u.module), u.name) if kind != "kept" else u.name,
                kind=kind,
                module=None if kind == "kept" else u.module,
                params=tuple(params),
                numel=numel,
                gathered_bytes=nbytes,
                buckets=len(u.buckets),
                state=u.state.value,
            )
        )
    return out
