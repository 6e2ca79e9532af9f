"""`ZeroOptimizer`'s construction as named steps, each building one part of the `Core`.

    core = lay_out(...)          # params named and checked, units found, the layout (pure data)
    core.store = store(core)     # params become views of the store (stage 3: unit by unit)
    communication(core)          # gradient store, reducer, the reduce-scatters' group
    core.runner = runner(core)   # the inner optimizer over this rank's pieces
    core.units = units(core)     # stage 3's unit scheduler and its order check
    core.kept = kept(core)       # the units kept whole: stages 1/2's buckets, stage 3's small

Every step reads the policy ([Note: policies]) and what the steps before it built; none reads an
integer stage. `lay_out` changes nothing outside itself (its errors leave the params as they
were); from `store` on, the optimizer undoes a failed construction with ``close()``.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import warnings
import zlib

import torch

from .. import comm
from ..buffers import GradStore, ParamStore, dtype_of, grad_dtypes
from ..layout import ParamSpec, build_layout, is_vector
from ..ops.backends import resolve_backend
from ..partition import FUSED_ADAM_CLASSES, Reducer, ShardRunner, choose_mode
from ..partition.kept import KeptWhole
from ..partition.order import SequenceCheck
from ..partition.secondary import SecondaryShard
from ..partition.units import (
    Unit,
    UnitScheduler,
    UnitState,
    find_units,
    unit_assignment,
    unit_members,
)
from . import replicas, tensor_parallel, validate, wrappers
from .core import Core
from .groups import param_groups
from .materialize import materialize_modules_
from .tp_grads import PartialSums

__all__ = ["communication", "lay_out", "runner", "store", "units"]

log = logging.getLogger("zero_kernels")

_UNFUSABLE = ("differentiable", "capturable")


def lay_out(
    policy,
    params,
    optimizer_class,
    *,
    module,
    units,
    process_group,
    defaults,
    own_options,
) -> tuple[Core, list[dict], bool]:
    """Name, check and lay out the params: the `Core` without its stores, the user's param
    groups, and whether any param is on the meta device. Identical on every rank or an error on
    every rank (`validate.check_agree`). ``own_options``: ZeroOptimizer's keyword options, for
    the error naming a keyword nobody takes."""
    shard, gather, cp = policy.shard, policy.gather, policy.comm
    process_group = tensor_parallel.dp_group_of(process_group)  # a mesh: its dp dim
    validate.check_stage3(shard, module, units)
    mode, why = choose_mode(optimizer_class, policy.execution.partition)
    validate.check_kwargs(optimizer_class, defaults, own_options)
    user_groups, names = param_groups(params)
    if module is not None:
        for n, p in module.named_parameters():
            names.setdefault(id(p), n)
    every = {id(p): p for g in user_groups for p in g["params"]}
    # DTensor params of tensor parallelism: laid out by their local tensors
    # ([Note: tensor parallelism] in zero_kernels/optimizer/tensor_parallel.py)
    tp = tensor_parallel.find(every, names, module, process_group)
    validate.check_params(every, names, module, tp_ids=tp.leaf_ids() if tp else frozenset())
    wrappers.check_not_wrapped(every.values(), names, module)
    leaf_of: dict[int, torch.Tensor] = {}  # id(local) -> its DTensor param
    if tp is not None:
        tensor_parallel.check_policy(policy)
        for g in user_groups:
            g["params"] = [tp.local_of(p) for p in g["params"]]
        for t in tp.by_id.values():
            leaf_of[id(t.local)] = t.param
            if id(t.param) in names:
                names[id(t.local)] = names[id(t.param)]
        every = {id(p): p for g in user_groups for p in g["params"]}
    for p in every.values():
        owner = wrappers.owner_of(p)
        if owner is not None:
            raise ValueError(
                f"param {names.get(id(p)) or tuple(p.shape)} is held by another live "
                f"ZeroOptimizer ({owner!r}): close() it first (or use one optimizer)"
            )
    specs, index_of, group_indices = [], {}, []
    for gi, g in enumerate(user_groups):
        idx = []
        for p in g["params"]:
            index_of[id(p)] = len(specs)
            idx.append(len(specs))
            specs.append(
                ParamSpec(
                    len(specs), gi, str(p.dtype), tuple(p.shape), names.get(id(p), ""),
                    leaf_of.get(id(p), p).requires_grad,
                )
            )  # fmt: skip
        group_indices.append(idx)
    by_index = {index_of[id(p)]: p for g in user_groups for p in g["params"]}
    leaves = {i: leaf_of.get(id(p), p) for i, p in by_index.items()}  # the module's params
    unit_modules: list = []  # stage 3: which unit each param belongs to ([Note: units])
    unit_of: dict[int, int] = {}
    if not shard.params:
        unit_modules = find_units(module, units)
        # quantized weights or gradients: norms' gains and biases kept whole and exact
        # ([Note: quantized all-gather] in zero_kernels.comm.quant)
        vectors = cp.quantize_weights is not None or cp.quantize_grads is not None
        unit_of = unit_assignment(unit_modules, leaves, gather.persist_below, vectors)
        specs = [dataclasses.replace(s, unit=unit_of[s.index]) for s in specs]
    if not any(s.requires_grad for s in specs):
        raise ValueError("ZeroOptimizer: no parameter has requires_grad=True")
    frozen, fspecs = {}, []  # shard_frozen: the frozen params sharded ([Note: frozen shards])
    if gather.shard_frozen:
        frozen, fspecs = _frozen_shards(
            module, specs, by_index, unit_modules, unit_of, gather.persist_below, vectors
        )
        if fspecs and policy.offload.offload_params == "nvme":
            raise NotImplementedError(
                "shard_frozen=True with offload_params='nvme': the param file holds the "
                "trained params' shards only; use offload_params='cpu' or shard_frozen=False"
            )
    stored = [*by_index.values(), *frozen.values()]
    devices = {p.device for p in stored if not p.is_meta}
    if len(devices) > 1:
        raise ValueError(
            f"ZeroOptimizer: all params must be on one device, got {devices}"
            + (" (with shard_frozen=True the frozen params too)" if frozen else "")
        )
    meta = any(p.is_meta for p in stored)
    # the params' device checked against the group's backends; meta-built: from the backends
    # ([Note: the collectives' device] in zero_kernels/comm/base.py)
    device = comm.collective_device(process_group, devices.pop() if devices else None)
    check_offload_device(policy.offload.offload_optimizer, policy.offload.offload_params, device)
    if gather.overlap_param_gather and module is None:
        raise ValueError(
            "overlap_param_gather=True needs the model (its forward hooks wait for each "
            f"bucket); got module={type(module).__name__}"
        )
    validate.check_agree(
        {
            "stage": policy.stage,
            **policy.must_agree(),  # every field of every policy, by its name
            "partition mode": mode,
            "optimizer_class": f"{optimizer_class.__module__}.{optimizer_class.__qualname__}",
            "units": [n for n, _ in unit_modules],
            "hyper-parameters": repr(sorted(defaults.items())),
            "param groups": repr(
                [sorted((k, v) for k, v in g.items() if k != "params") for g in user_groups]
            ),
            "params (group, dtype, shape, requires_grad) crc32": zlib.crc32(
                repr([(s.group, s.dtype, s.shape, s.requires_grad) for s in specs]).encode()
            ),
            "number of params": len(specs),
            "frozen params sharded (unit, dtype, shape) crc32": zlib.crc32(
                repr([(s.unit, s.dtype, s.shape) for s in fspecs]).encode()
            ),
        },
        process_group,
        device,
    )
    # the shard groups ([Note: hierarchy]): made once the ranks agree on every choice
    shard_ranks, device_mesh = comm.hier.resolve_shard_group(cp.shard_group, process_group)
    mesh = comm.hier.split(process_group, shard_ranks, device_mesh)
    world_size, rank = comm.world_size(mesh.shard), comm.rank(mesh.shard)
    layout = build_layout(
        specs,
        world_size,
        bucket_numel=max(1, int(cp.bucket_size_mb * 2**20) // 4),
        mode=mode,
        by_unit=not shard.params,
        vectors_apart=cp.quantize_grads is not None,  # their buckets reduced exact
    )
    if not shard.params and not gather.shard_frozen and world_size > 1:
        _warn_frozen_whole(module, leaves, specs)
    store_layout = layout  # the param store's: the trained buffers, then the frozen ones
    if fspecs:
        fl = build_layout(
            fspecs,
            world_size,
            bucket_numel=max(1, int(cp.bucket_size_mb * 2**20) // 4),
            by_unit=True,
        )
        store_layout = dataclasses.replace(layout, buffers=layout.buffers + fl.buffers)
    log.info(
        "ZeroOptimizer: stage %d, %s mode (%s), %d flat buffer(s), %d bucket(s), sharded over "
        "%d rank(s) x %d replica(s)",
        policy.stage,
        mode,
        why,
        len(layout.buffers),
        sum(len(b.buckets) for b in layout.buffers),
        world_size,
        mesh.n_replicas,
    )
    core = Core(
        policy=policy,
        mode=mode,
        group=process_group,
        mesh=mesh,
        shard_group=mesh.shard,
        rs_group=mesh.shard,
        side=None,
        rank=rank,
        world_size=world_size,
        dp_rank=comm.rank(process_group),
        dp_size=comm.world_size(process_group),
        device=device,
        timeout=float(cp.timeout or 300.0),
        # collectives of backward and step are bounded only when the user asks (the process
        # group's own timeout otherwise): see [Note: timeouts] in zero_kernels.comm
        op_timeout=float(cp.timeout) if cp.timeout is not None else None,
        layout=layout,
        params=by_index,
        trainable={s.index: by_index[s.index] for s in specs if s.requires_grad},
        frozen=frozen,
        store_layout=store_layout,
        group_indices=group_indices,
        module=module,
        unit_of=unit_of,
        unit_modules=unit_modules,
        # [Note: no host sync] in zero_kernels/partition/syncfree.py: off the CPU, step() reads
        # nothing
        sync_free=device.type != "cpu",
        tp=tp,
    )
    if tp is not None:
        tp.bind(index_of)
    return core, user_groups, meta


def _warn_frozen_whole(module, by_index, specs) -> None:
    """Stage 3 without shard_frozen: a warning where the frozen params kept whole on every rank
    outweigh the trained ones (a frozen base under adapters), naming the option."""
    trained = {id(by_index[s.index]) for s in specs if s.requires_grad}
    seen, frozen, mine = set(), 0, 0
    for p in module.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        n = p.numel() * p.element_size()
        if id(p) in trained:
            mine += n
        else:
            frozen += n
    if frozen > mine:
        warnings.warn(
            f"ZeroOptimizer stage 3: the model's frozen params ({frozen / 1e6:.1f} MB) are kept "
            f"whole on every rank, more than the trained ones it shards ({mine / 1e6:.1f} MB); "
            "shard_frozen=True shards them too, as FSDP and DeepSpeed's ZeRO-3 do",
            stacklevel=4,
        )


def _frozen_shards(module, specs, by_index, unit_modules, unit_of, persist_below, vectors):
    """shard_frozen ([Note: frozen shards]): index -> param of the model's params that do not
    train and are sharded with their unit (not those kept whole: ``persist_below``, vectors
    under quantized communication), and their specs (``requires_grad=True`` only so that
    `build_layout` lays them out). A frozen param given to the optimizer keeps its index; the
    others are numbered after the optimizer's. Adds their units to ``unit_of``."""
    trained = {id(by_index[s.index]) for s in specs if s.requires_grad}
    given = {id(p): i for i, p in by_index.items()}
    candidates, names, seen = {}, {}, set()
    nxt = len(specs)
    for n, p in module.named_parameters():
        if id(p) in trained or id(p) in seen:
            continue
        seen.add(id(p))
        i = given.get(id(p))
        if i is None:
            i, nxt = nxt, nxt + 1
        candidates[i], names[i] = p, n
    units = unit_assignment(unit_modules, candidates, persist_below, vectors)
    whole = len(unit_modules) + 1
    frozen, fspecs = {}, []
    for i, p in candidates.items():
        if units[i] == whole:
            continue
        frozen[i] = p
        unit_of[i] = units[i]
        fspecs.append(ParamSpec(i, 0, str(p.dtype), tuple(p.shape), names[i], True, units[i]))
    return frozen, fspecs


def comm_sizes(core: Core) -> list[tuple[str, int]]:
    """``(op, bytes)`` of every bucket's reduce-scatter and all-gather."""
    out = []
    _, rdts = grad_dtypes(core.layout, reduce_dtype=core.policy.precision.reduce_dtype)
    for buf, rdt in zip(core.layout.buffers, rdts):
        pdt = dtype_of(buf.dtype)
        for b in buf.buckets:
            n = b.shard_numel * core.layout.world_size
            out += [("reduce_scatter", n * rdt.itemsize), ("all_gather", n * pdt.itemsize)]
    for buf in core.store_layout.buffers[len(core.layout.buffers) :]:  # frozen: gathered only
        for b in buf.buckets:
            n = b.shard_numel * core.layout.world_size
            out.append(("all_gather", n * dtype_of(buf.dtype).itemsize))
    return out


def assemble(core: Core, user_groups, meta: bool, optimizer_class, defaults: dict) -> Core:
    """The laid-out ``core`` built whole: the param store (materialized where built on the
    meta device), the gradient store and reducer, the replicated state in sync, the runner of
    the sharded step, quantized collectives, stage 3's units and the params kept whole. Every
    field of the `Core` is set when it returns."""
    ex = core.policy.execution
    core.store = store(core, meta=meta, init_fn=ex.init_fn, seed=ex.seed)
    communication(core)
    replicas.sync_at_start(core)  # frozen params and buffers: rank 0's where they differ
    core.runner = runner(
        core, optimizer_class, user_groups, defaults, ex.fused_adam, ex.kernel_backend
    )
    quantization(core)
    core.units = units(core)
    core.kept = kept(core)
    return core


def store(core: Core, *, meta: bool, init_fn, seed: int) -> ParamStore:
    """The param store; params become its views, rank 0's values winning (as DDP does) except
    for a model built on the meta device, initialised identically on every rank (stage 3 unit
    by unit, keeping only this rank's shard, so construction holds the shards plus one unit).
    The collectives' algorithm probes run first (`comm.probe_ahead`: their buffers then do not
    add to the first step's peak)."""
    comm.probe_ahead(comm_sizes(core), group=core.shard_group, device=core.device)
    sharded = not core.policy.shard.params
    group, module, layout = core.group, core.module, core.store_layout
    params = {**core.params, **core.frozen}  # the store's params: the frozen sharded ones too
    if meta and not sharded:  # whole params anyway
        materialize_modules_(module.named_modules(), core.device, seed, init_fn)
    by_unit: dict[int, list[tuple[int, int]]] = {}
    for i, buf in enumerate(layout.buffers):
        for b in buf.buckets:
            u = core.unit_index(buf.slots[b.slots[0]].index) if b.slots and sharded else 0
            by_unit.setdefault(u, []).append((i, b.index))
    persistent = len(core.unit_modules) + 1  # small params kept whole (persist_below)
    tier = _param_swapper(core, by_unit, persistent) if sharded else None
    on_host = sharded and core.policy.offload.offload_params == "cpu"  # [Note: host tier]
    st = ParamStore(
        layout,
        params,
        core.device,
        rank=core.rank,
        sharded=sharded,
        tier=tier,
        shard_device=torch.device("cpu") if on_host else None,
    )
    if not sharded:
        if not meta:
            for f in st.flats:
                comm.broadcast(f, 0, group=group)
        return st
    members = unit_members(module, core.unit_modules) if meta else None
    for u in range(persistent + 1):
        if members is not None and u < persistent:
            into: dict[int, torch.Tensor] = {}  # the unit's params: straight into its buckets
            for i, b in by_unit.get(u, []):
                into.update(st.prepare(i, b, params))
            materialize_modules_(members[u], core.device, seed, init_fn, storage=into)
        for i, b in by_unit.get(u, []):
            st.adopt(i, b, params)
            if not meta:
                comm.broadcast(st.raw[i][b], 0, group=group)
            with st.using(i, b, dirty=True, fresh=True):  # offloaded: written, then evicted
                st.take_shard(i, b)
            if u != persistent:
                st.free(i, b)
    if members is not None:  # frozen params and buffers outside any trained unit
        materialize_modules_(module.named_modules(), core.device, seed, init_fn)
    return st


def check_offload_device(
    offload_optimizer: str | None, offload_params: str | None, device: torch.device
) -> None:
    """The nvme tiers with params off the CPU: refused at construction, naming what works
    there (pure: the option's values and the params' device). Both read and write the file
    through host memory and hand what they read to the step on the params' device: with CUDA
    params the CUDA kernel would get host moments beside device masters and gradients (it
    failed at the first step); a pinned staging path to the device is not built yet."""
    device = torch.device(device)
    if device.type == "cpu":
        return
    if offload_optimizer == "nvme":
        raise NotImplementedError(
            f"offload_optimizer='nvme' with params on {device}: the moments are read from the "
            "file into host memory, and the step on the device needs them there (staging them "
            "to the device is not built yet); use offload_optimizer='cpu' (the host tier: "
            "masters and moments in host memory, the step on the CPU), or keep the state on "
            "the device (offload_optimizer=None)"
        )
    if offload_params == "nvme":
        raise NotImplementedError(
            f"offload_params='nvme' with params on {device}: the tier reads shards into host "
            "memory mappings; GPU params (a pinned staging pool) are not built yet: use "
            "offload_params='cpu' (with offload_optimizer='cpu')"
        )


def _param_swapper(core: Core, by_unit: dict, persistent: int):
    """offload_params="nvme" (stage 3): the param shards in a file between uses, those of
    the params kept whole pinned in RAM ([Note: param offload]); else None."""
    off = core.policy.offload
    if off.offload_params != "nvme":
        return None
    from ..offload.params import ParamSwapper

    pinned = set(by_unit.get(persistent, []))
    units = [ks for u, ks in sorted(by_unit.items()) if u != persistent]
    masters = {  # the buffers with fp32 masters (see [Note: modes] in partition.runner)
        i
        for i, buf in enumerate(core.layout.buffers)
        if dtype_of(buf.dtype) not in (torch.float32, torch.float64)
        and not (core.policy.precision.bf16_stochastic_round and buf.dtype == "torch.bfloat16")
    }
    return ParamSwapper(core.layout, core.rank, units, pinned, off.offload_dir, masters)


def communication(core: Core) -> None:
    """The side group, the comm log, the gradient store and the reducer (its hooks on the
    params). Stage 3 on gloo: the reduce-scatters form a sequence of their own, apart from the
    all-gathers ([Note: backward gathers] in zero_kernels/partition/units.py); check_order=
    "every" compares every launch in one sequence, so it keeps one group."""
    p = core.policy
    core.side = comm.side_group(core.group, timeout_s=core.timeout)
    if core.side is not None:  # which ranks share a host, for the bytes by link ([Note: bytes
        # by link]): proven over the gloo side group, so an NCCL run exchanges no objects on it
        comm.learn_hosts(core.side)
    core.comm_log = comm.CommLog()
    core.grads = GradStore(
        core.layout,
        p.shard,
        core.device,
        rank=core.rank,
        max_inflight=p.comm.max_inflight_buckets,
        reduce_dtype=p.precision.reduce_dtype,
    )
    if not p.shard.params and p.gather.check_order != "every":
        core.rs_group = comm.hier.twin_of_shard(core.mesh, core.device)
    tp = core.tp
    core.reducer = Reducer(
        core.layout, core.params, core.grads, core.rank, core.rs_group, core.comm_log, core.mesh,
        leaves=tp.leaves(core.params) if tp is not None else None,
        local_grad=tp.local_grad if tp is not None else None,
        partial_sums=PartialSums(tp) if tp is not None else None,
    )  # fmt: skip
    core.reducer.overlap = bool(p.comm.overlap_comm)
    core.reducer.phase = core.phase
    core.reducer.timeout = core.op_timeout


def runner(core: Core, optimizer_class, user_groups, defaults, fused_adam, kernel_backend):
    """The inner ``optimizer_class`` over this rank's pieces (fused Adam where it can)."""
    group_opts = [{k: v for k, v in g.items() if k != "params"} for g in user_groups]
    fusable = (
        optimizer_class in FUSED_ADAM_CLASSES
        and fused_adam
        and not any(g.get(k) or defaults.get(k) for g in group_opts for k in _UNFUSABLE)
    )
    off = core.policy.offload
    on_host = off.offload_optimizer == "cpu"
    if on_host and kernel_backend not in ("auto", "cpu", "reference"):
        raise ValueError(
            "offload_optimizer='cpu' steps in host memory, on the CPU kernel: kernel_backend "
            f"must be 'auto', 'cpu' or 'reference', got kernel_backend={kernel_backend!r}"
        )
    r = ShardRunner(
        core.layout,
        core.store,
        core.grads,
        core.rank,
        optimizer_class,
        group_opts,
        defaults,
        fused=fusable,
        backend=kernel_backend,
        state_dtype=core.policy.precision.state_dtype,
        state_block=core.policy.precision.state_block,
        stochastic_round=core.policy.precision.bf16_stochastic_round,
        state_device=torch.device("cpu") if on_host else None,
    )
    _check_state_dtype(
        core, r, optimizer_class, group_opts, defaults, kernel_backend, on_host=on_host
    )
    if off.offload_optimizer == "nvme":
        r.swap = _swapper(core, r, optimizer_class, group_opts, defaults, off)
    elif on_host:
        r.host = _host_tier(core, r, optimizer_class)
    return r


def _host_tier(core: Core, r, optimizer_class):
    """offload_optimizer="cpu": masters and moments in host memory, the step on the CPU
    ([Note: host tier])."""
    from ..offload.host import HostTier

    if not all(r.fused):
        raise NotImplementedError(
            f"offload_optimizer='cpu' steps the fused Adam kernel on the host; "
            f"{optimizer_class.__name__} here is not stepped by it everywhere (fused_adam=False, "
            "an option the kernel does not take, whole mode, or float64 params): not built yet "
            "for other steps"
        )
    if core.policy.offload.offload_params == "cpu" and core.policy.comm.quantize_weights:
        raise NotImplementedError(
            "offload_params='cpu' with quantize_weights="
            f"{core.policy.comm.quantize_weights!r}: the quantized all-gather would quantize "
            "the shard in host memory; not built yet (use one of them)"
        )
    advice = host_thread_advice(
        core.device.type,
        torch.get_num_threads(),
        os.cpu_count() or 1,
        int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
    )
    if advice:
        log.warning(advice)
    return HostTier(r, core.device)


def host_thread_advice(device: str, threads: int, cpus: int, local_ranks: int) -> str | None:
    """The host tier steps on torch's intra-op threads; torchrun starts each rank with
    OMP_NUM_THREADS=1, which leaves a GPU rank's CPU step on one core. A warning when a GPU run
    has one thread and cores to spare (None otherwise)."""
    spare = max(cpus // max(local_ranks, 1), 1)
    if device == "cpu" or threads > 1 or spare == 1:
        return None
    return (
        f"offload_optimizer='cpu': the step runs on the host with torch's {threads} thread "
        f"(torchrun sets OMP_NUM_THREADS=1), while {cpus} cores serve {local_ranks} rank(s) "
        f"here: call torch.set_num_threads({spare}) (or set OMP_NUM_THREADS={spare}) before "
        "training"
    )


def _check_state_dtype(
    core: Core, r, optimizer_class, group_opts, defaults, backend, on_host: bool = False
) -> None:
    """state_dtype other than fp32: only the fused step has that format; refuse what would
    keep fp32 state unsaid."""
    sd = core.policy.precision.state_dtype
    if core.policy.precision.bf16_stochastic_round:
        bf16 = [i for i, b in enumerate(core.layout.buffers) if b.dtype == "torch.bfloat16"]
        if not bf16:
            raise ValueError(
                "bf16_stochastic_round=True but no param is bfloat16: it replaces the fp32 "
                "masters of bf16 params (model.to(torch.bfloat16)); drop it or cast the model"
            )
        if not all(r.fused[i] for i in bf16):
            raise ValueError(
                f"bf16_stochastic_round=True rounds the fused Adam step's result; "
                f"{optimizer_class.__name__} here is not stepped by it (fused_adam=False, an "
                "option the kernel does not take, or whole mode): use torch Adam/AdamW, or "
                "drop bf16_stochastic_round"
            )
    if sd == "fp32":
        return
    where = torch.device("cpu") if on_host else core.device  # the host tier steps on the CPU
    if sd == "int8" and resolve_backend(backend, where) == "triton":
        raise NotImplementedError(
            "state_dtype='int8' on the Triton backend: its kernel takes no block table (the "
            "sharded step's blocks follow its pieces); use kernel_backend='cuda' or 'reference', "
            "or state_dtype='bf16'"
        )
    if not all(r.fused):
        raise ValueError(
            f"state_dtype={sd!r} is the fused Adam step's format; {optimizer_class.__name__} "
            "here is not stepped by it everywhere (fused_adam=False, an option the kernel does "
            "not take, whole mode, or float64 params): use state_dtype='fp32'"
        )
    if any(g.get("amsgrad", defaults.get("amsgrad", False)) for g in group_opts):
        raise ValueError(
            f"state_dtype={sd!r} with amsgrad=True: max_exp_avg_sq has no low-bit format; use "
            "state_dtype='fp32' with amsgrad"
        )


def _swapper(core: Core, r, optimizer_class, group_opts, defaults, off):
    """offload_optimizer="nvme": the fused step's moments in a file ([Note: offload])."""
    from ..offload.swap import StateSwapper
    from ..partition.lowbit_state import INT8_KEYS

    if not any(r.fused):
        raise NotImplementedError(
            f"offload_optimizer='nvme' offloads the fused Adam step's moments; "
            f"{optimizer_class.__name__} here is not stepped by it (fused_adam=False, an "
            "option the kernel does not take, or whole mode): not built yet for other steps"
        )
    if not all(r.fused):
        raise NotImplementedError(
            "offload_optimizer='nvme': some flat buffers (dtype) are not stepped by the fused "
            "kernel; their state would stay in RAM unsaid. Not built yet"
        )
    names = {}
    for i, buf in enumerate(core.layout.buffers):
        ams = group_opts[buf.group].get("amsgrad", defaults.get("amsgrad", False))
        names[i] = ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if ams else ())
        if r.int8 is not None:  # codes and their blocks' scales ([Note: int8 shard state])
            names[i] = INT8_KEYS
    bf16 = core.policy.precision.state_dtype == "bf16"
    return StateSwapper(
        core.layout,
        core.rank,
        names,
        off.offload_dir,
        staging_mb=off.offload_staging_mb,
        dtype=torch.bfloat16 if bf16 else torch.float32,
        int8=r.int8,
    )


def quantization(core: Core) -> None:
    """quantize_weights: stage 3's per-use all-gathers send quantized chunks
    ([Note: quantized all-gather]); the gathers that hand params out stay exact.
    quantize_grads: every bucket's reduce-scatter ([Note: quantized reduce-scatter])."""
    from ..ops.quant import DEFAULT_BLOCK

    cp = core.policy.comm
    if cp.quantize_weights is not None:
        core.runner.quantize = (comm.quant.QUANTIZED[cp.quantize_weights], DEFAULT_BLOCK)
    if cp.quantize_grads is not None:  # with shard_group: the hop across the nodes only
        bits = comm.quant.QUANTIZED[cp.quantize_grads]
        core.reducer.quantize = (bits, comm.quant.GRAD_BLOCK[bits])
        core.reducer.error_feedback = cp.grad_error_feedback
        _grad_hops(core)
        # reduced exact: the buckets of params of one dimension (laid out apart at stages 1/2)
        # and, at stage 3, those of the unit kept whole (the vectors and any params below
        # persist_below: a small matrix there must not pull the vectors into the quantizer)
        kept_unit = len(core.unit_modules) + 1

        def exact(s) -> bool:
            return is_vector(s.shape) or core.unit_of.get(s.index) == kept_unit

        core.reducer.exact_buckets = {
            (i, b.index)
            for i, buf in enumerate(core.layout.buffers)
            for b in buf.buckets
            if b.slots and all(exact(buf.slots[k]) for k in b.slots)
        }


def _grad_hops(core: Core) -> None:
    """quantize_grads: one hop, or two where a flat group spans hosts of several ranks each
    ([Note: two-hop quantized reduce-scatter] in `zero_kernels.comm.hier_quant`); the choice
    and why in ``comm_stats["choices"]``. Collective (the two hops' groups)."""
    if core.reducer.mesh is not None:
        why = "hierarchical shard_group: exact inside the shard group, quantized across replicas"
        core.comm_log.choices["quantize_grads"] = ("two hops (shard_group)", why)
        return
    hosts = comm.host_groups(core.side) if core.side is not None else [[0]]
    hops, why = comm.hier_quant.plan(hosts)
    core.comm_log.choices["quantize_grads"] = ("two hops" if hops == 2 else "one hop", why)
    if hops == 2:
        core.reducer.two_hop = comm.hier_quant.node_split(core.mesh.shard, hosts, hops)


def units(core: Core) -> UnitScheduler | None:
    """Where params are resharded (stage 3): the unit scheduler over the root unit, the units
    found and the params kept whole, with its order check ([Note: units]); else None."""
    if core.policy.shard.params:
        return None
    module, gather = core.module, core.policy.gather
    found = [Unit(0, "<root>", module)] + [
        Unit(k, name, m) for k, (name, m) in enumerate(core.unit_modules, start=1)
    ]
    persistent = Unit(len(found), "<persistent>", module, persistent=True)
    found.append(persistent)
    trained = len(core.layout.buffers)
    for i, buf in enumerate(core.store_layout.buffers):
        for b in buf.buckets:
            u = core.unit_index(buf.slots[b.slots[0]].index) if b.slots else 0
            found[u].buckets.append((i, b.index))
            if i >= trained:  # shard_frozen: gathered with the unit, never reduced
                found[u].frozen.add((i, b.index))
    if persistent.buckets:  # gathered at construction, kept whole
        persistent.move(UnitState.GATHERING)  # all-gathered by `store`
        persistent.move(UnitState.GATHERED)
    # the root unit's sharded params (frozen ones too with shard_frozen)
    sharded = {**core.trainable, **core.frozen}
    leaves = core.tp.leaves(sharded) if core.tp is not None else sharded  # the module's
    in_root = {id(leaves[i]) for i in sharded if core.unit_index(i) == 0}
    root_members = [
        (name, m)
        for name, m in module.named_modules()
        if m is not module and any(id(p) in in_root for p in m.parameters(False))
    ]
    sched = UnitScheduler(
        module,
        found[1:-1],
        found[0],
        core.store,
        core.runner,
        core.shard_group,
        core.comm_log,
        reshard_after_forward=gather.reshard_after_forward,
        prefetch=gather.prefetch,
        persistent=persistent if persistent.buckets else None,
        root_members=root_members,
    )
    sched.timeout = core.op_timeout
    sched.phase = core.phase
    core.phase.task_ended = sched.task_ended  # [Note: frozen shards]
    if gather.secondary_shard is not None:  # [Note: secondary shard]
        sec = comm.hier.secondary_groups(core.mesh, gather.secondary_shard)
        if sec is not None:
            sizes = [s for s in comm_sizes(core) if s[0] == "all_gather"]
            comm.probe_ahead(sizes, group=sec.group, device=core.device)
            sched.secondary = SecondaryShard(sec, core.store)
            core.runner.own_exact = False  # every rank gathers the same values
        log.info(
            "ZeroOptimizer: secondary_shard=%r: %s",
            gather.secondary_shard,
            f"blocks of {sec.size} ranks"
            if sec is not None
            else "the whole shard group or "
            "single ranks: nothing to keep (the backward gathers as without it)",
        )
    if gather.check_order != "first":
        sched.check = core.reducer.check = _sequence_check(core, sched, gather.check_order)
    core.reducer.on_bucket_ready = sched.bucket_done
    return sched


def kept(core: Core) -> KeptWhole:
    """The units never resharded ([Note: kept whole]): at stages 1/2 one per bucket of the
    layout, whole from the start; at stage 3 the scheduler's persistent unit, if any."""
    if core.units is not None:
        p = core.units.persistent
        return KeptWhole([p] if p is not None else [], "unit", core.op_timeout, core.where)
    found = []
    many = len(core.layout.buffers) > 1
    for i, buf in enumerate(core.layout.buffers):
        for b in buf.buckets:
            u = Unit(len(found), f"{b.index}" + (f" of buffer {i}" if many else ""), None, True)
            u.buckets.append((i, b.index))
            u.move(UnitState.GATHERING)  # the store made the params whole
            u.move(UnitState.GATHERED)
            found.append(u)
    return KeptWhole(found, "bucket", core.op_timeout, core.where)


def _sequence_check(core: Core, sched: UnitScheduler, mode: str) -> SequenceCheck:
    """Stage 3: the check that every rank launches the same collective (`SequenceCheck`)."""
    names = {}
    for u in sched.all_units:
        for i, b in u.buckets:
            where = f"unit {u.name!r} (bucket {b} of flat buffer {i})"
            names[("all_gather", i, b)] = f"all-gather of {where}"
            names[("reduce_scatter", i, b)] = f"reduce-scatter of the gradients of {where}"
        names[("order", u.index, 0)] = f"forward of unit {u.name!r}"
        names[("check", u.index, 0)] = f"first-step order check at unit {u.name!r}"
    group, rs_group = core.shard_group, core.rs_group
    check = SequenceCheck(
        core.side,
        names,
        core.op_timeout,
        mode,
        lambda key: scratch_collective(core, key),
        split=rs_group is not group,
        stop_shm=lambda: comm.shm.poison(group, rs_group),
    )
    check.describe = lambda *a, **k: core.where()
    check.phase = core.phase
    return check


def scratch_collective(core: Core, key: tuple[str, int, int]):
    """Collective ``key`` of stage 3 (the same sizes, dtype and algorithm) on scratch buffers:
    what a rank that never launched it launches so that the others' waits complete once the
    module-order error is found (`SequenceCheck`)."""
    kind, i, b = key
    n, dev, group = core.world_size, core.device, core.shard_group
    if kind == "check":  # `UnitScheduler._check_same`'s all-reduce
        t = torch.zeros(2, dtype=torch.int64, device=dev)
        return comm.all_reduce_start(t, "max", group=group)
    numel = core.layout.buffers[i].buckets[b].numel(n)
    if kind == "all_gather":
        dt = dtype_of(core.layout.buffers[i].dtype)
        out = torch.empty(numel, dtype=dt, device=dev)
        inp = torch.zeros(numel // n, dtype=dt, device=dev)
        return comm.all_gather(out, inp, group=group)
    dt = core.grads.reduce_dtypes[i]  # "reduce_scatter"
    out = torch.empty(numel // n, dtype=dt, device=dev)
    inp = torch.zeros(numel, dtype=dt, device=dev)
    return comm.reduce_scatter(out, inp, group=core.rs_group, avg=True)
