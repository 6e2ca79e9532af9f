"""`ZeroOptimizer`: ZeRO stages 1, 2 and 3 over any torch optimizer. What users touch.

    opt = ZeroOptimizer(model, torch.optim.AdamW, stage=2, lr=1e-3)   # was: AdamW(model..., lr=)
    for x, y in data:
        opt.zero_grad()
        loss_fn(model(x), y).backward()        # buckets reduce-scatter during backward
        opt.clip_grad_norm_(1.0)               # optional; global norm over all shards
        opt.step()                             # shard step, then all-gather of the new params

The options resolve once into a `zero_kernels.policy.ZeroPolicy` ([Note: policies]), which the
parts below read. Layers below: `layout` (where params live), `buffers` (flat tensors),
`partition` (hooks, reduce, sharded step, state conversion, stage 3's units), `comm` (every
collective). See [Note: overlap] in `zero_kernels.partition.reducer` for the timeline and
[Note: layout] for the bucket/shard ranges. The model is not wrapped, and a DDP over its params
is an error ([Note: wrappers]). Parameters become views into flat buffers (``param.data`` is
replaced, the Parameter objects stay the same); after backward ``param.grad`` is a
`ShardedGrad`, this rank's piece of the averaged gradient ([Note: gradients]).

A trainable parameter that gets no gradient on any rank in a backward pass is left out of the
step, as torch does (its bucket still fires with zeros for it, so ranks never hang); one that
got a gradient on some rank only steps with the average, zeros counted for the others.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import logging
import warnings
import weakref
import zlib

import torch
from torch import nn
from torch.distributed.algorithms.join import Joinable

from . import comm, hostmem, regroup, syncfree, validate, wrappers
from .buffers import GradStore, dtype_of, grad_dtypes, release_free_heap, storage_id
from .grad_access import GradAccess
from .groups import param_groups
from .layout import Layout, ParamSpec, build_layout
from .loss_scale import LossScaler
from .param_access import ParamAccess, _call, _call_args
from .partition import (
    FUSED_ADAM_CLASSES,
    Reducer,
    ShardRunner,
    choose_mode,
)
from .partition.grads import GradViews, ShardedGrad
from .partition.units import (
    find_units,
    unit_assignment,
)
from .policy import ZeroPolicy, resolve_given
from .state_access import ShardStateAccess
from .syncfree import GradChecks

__all__ = ["ZeroOptimizer"]

log = logging.getLogger("zero_kernels")

_UNFUSABLE = ("differentiable", "capturable")

wrappers.install()  # a DDP built over a live ZeroOptimizer's params raises ([Note: wrappers])


class ZeroOptimizer(
    ParamAccess, GradAccess, ShardStateAccess, GradChecks, torch.optim.Optimizer, Joinable
):
    """Shards ``optimizer_class``'s state (stage 1), the gradients too (stage 2) and the params
    too (stage 3).

    Args:
        params: an ``nn.Module`` (names then appear in errors and layouts), or what torch
            optimizers take: an iterable of tensors or of param-group dicts.
        optimizer_class: a ``torch.optim.Optimizer`` subclass (not LBFGS).
        stage: 1, 2 or 3 (the shorthand of a `zero_kernels.policy.ShardPolicy`).
        policy: a `zero_kernels.policy.ZeroPolicy` holding every choice below that a policy
            has (instead of those keywords, which may then not be given: [Note: policies]).
        process_group: the data-parallel group (default: the world).
        bucket_size_mb: target size of a gradient bucket in MiB (at 4 bytes per element).
        overlap_comm: reduce buckets during backward (True) or all at the end (False).
        partition: "auto" (element-wise optimizers get flat shards, the rest whole params),
            "flat" or "whole" to force.
        fused_adam: use `zero_kernels.ops.adam_step` for torch Adam/AdamW (flat mode).
        kernel_backend: the ``backend`` of `zero_kernels.ops.adam_step` ("auto", "reference"...).
        loss_scale: None, a float (static) or "dynamic"; default "dynamic" with fp16 params.
        reduce_dtype: stages 2 and 3: the dtype gradients are accumulated in during backward and
            reduce-scattered in (default fp32); ``torch.bfloat16`` halves the bytes, the result
            is added into the fp32 gradient shard (the accuracy cost is in bench/README.md).
        max_inflight_buckets: stages 2/3: most bucket buffers held at once (being filled or
            reduce-scattered); when a bucket needs one beyond it, the oldest reduce-scatter is
            waited for and its buffer reused. Bounds the communication buffers to this many
            buckets of ``bucket_size_mb``; 1 disables overlap. Stage 1: most reduce-scatters in
            flight (each may hold N-1 shard-sized receive buffers on gloo). Default 2.
        overlap_param_gather: stages 1/2 with the model: ``step()`` returns with the
            all-gathers of the new params in flight, and each module's forward pre-hook waits
            for the buckets holding its params (as Megatron does), so they overlap the next
            forward. Params read between ``step()`` and the next forward are incomplete until
            ``opt.wait_params()`` (model.state_dict() and this optimizer's methods call it).
            Default False.
        nonfinite: what a step does with inf/NaN gradients: "step" (torch's behaviour: step
            anyway; the count is in ``comm_stats["nonfinite_steps"]`` and the first one is
            logged on the rank that saw it), "skip" (every rank skips the step) or "raise".
            With a loss scale the step is always skipped (and the scale lowered).
        timeout: seconds. When given, every collective of backward and step is bounded by it:
            a rank that stalls, dies or raises mid-step makes the others raise
            `zero_kernels.comm.CollectiveTimeout` naming the step, the phase and the bucket or
            unit, instead of waiting for the process group's own timeout (30 min on gloo).
            Collective-only calls (``consolidated_state_dict``, ``full_param``, stage 3's
            ``model.state_dict()``) check that every rank arrived within it (default 300).
        check_order: stage 3 (None: "pass"). Every mode checks in the first forward that
            every rank runs the same units in the same order. "pass" also compares, at the end
            of every forward and every backward, a hash of the all-gathers, reduce-scatters
            and unit forwards of each rank in it (`SequenceCheck`: one small all-reduce on a
            side group per pass): a later change of modules on some rank is a ValueError on
            every rank before an output or gradient of that pass is used, instead of values
            exchanged between the wrong units; a rank that runs fewer modules is found once a
            wait has lasted 2 s (a ValueError on every rank, not a hang). "every" compares
            before each launch (blocking), so
            nothing is sent (1.06-1.30x step time measured). "first": the first forward only;
            a later change goes unseen.
        host_cache: with params on the CPU, make the host block cache torch's CPU allocator
            for blocks of 1 MiB and more (process-wide; see [Note: host block cache] in
            `zero_kernels.hostmem`): freed gradient-sized blocks are reused by size instead of
            piling up in glibc's heap. None (default): on unless ``ZERO_KERNELS_HOST_CACHE=0`` or
            ``zero_kernels.hostmem.disable()`` was called; False: not installed by this
            optimizer (one installed before stays). Limits set by ``hostmem.install()`` are
            kept. ``opt.host_cache``: whether the cache is in use.
        **defaults: passed to ``optimizer_class``.

    Gradients: after backward, ``param.grad`` is a `ShardedGrad` (this rank's piece of the
    averaged gradient) that ``torch.nn.utils.clip_grad_norm_``, ``model.zero_grad()`` and
    ``torch.amp.GradScaler`` work with; see [Note: gradients] in `zero_kernels.partition.grads`.
    A trainable param with no gradient on any rank is left out of the step, as torch does.

    Lifecycle: ``close()`` (or ``with ZeroOptimizer(...) as opt``) removes every hook and gives
    the params back as plain tensors; a param held by a live ZeroOptimizer cannot be given to
    another; a collected optimizer leaves no hooks.

    Memory: with fp32 params there is no master copy: the optimizer steps the rank's shard of
    the param buffer in place. Stage 1 holds one full-size gradient buffer (the reduced shard
    is a view of it), stage 2 the reduced shard plus at most ``max_inflight_buckets`` bucket
    buffers (see [Note: gradient storage] in `zero_kernels.buffers`).

    Telemetry:
        ``memory_report() -> dict(param_bytes=, grad_bytes=, master_bytes=, optim_state_bytes=,
        model_state_bytes=, comm_buffer_bytes=, comm_buffer_peak_bytes=, grad_peak_bytes=,
        total_bytes=)``: this rank's bytes counted from its tensors. Model states (what the
        ZeRO formula counts) are params + grads + master + optimizer state
        (``optim_state_bytes`` excludes the fp32 master shard); ``comm_buffer_bytes`` are the
        stage-2 bucket buffers held now (kept between steps), ``comm_buffer_peak_bytes`` the
        most of them in use at once, ``grad_peak_bytes`` = grads + that peak;
        ``total_bytes`` = model states + comm buffers.
        ``comm_stats -> dict(reduce_scatter_bytes=, all_gather_bytes=, reduce_scatter_calls=,
        all_gather_calls=, all_reduce_calls=, exposed_comm_s=, steps=, nonfinite_steps=)``:
        cumulative since construction or ``reset_comm_stats()``; bytes are full bucket sizes
        per collective, ``exposed_comm_s`` is time spent waiting on collectives.
    """

    def __init__(
        self,
        params,
        optimizer_class,
        *,
        stage: int = 2,
        policy: ZeroPolicy | None = None,
        process_group=None,
        bucket_size_mb: float = 25.0,
        overlap_comm: bool = True,
        partition: str = "auto",
        fused_adam: bool = True,
        loss_scale: float | str | None = "auto",
        kernel_backend: str = "auto",
        max_inflight_buckets: int = 2,
        nonfinite: str = "step",
        timeout: float | None = None,
        module: nn.Module | None = None,
        units=None,
        reshard_after_forward: bool = True,
        prefetch: int = 1,
        persist_below: int = 0,
        check_order: str | None = None,
        reduce_dtype: torch.dtype | None = None,
        overlap_param_gather: bool = False,
        init_fn=None,
        seed: int = 0,
        host_cache: bool | None = None,
        **defaults,
    ):
        # how this optimizer was built: add_param_group builds it again with one more group
        self._init_args = (
            optimizer_class,
            {
                k: v
                for k, v in locals().items()
                if k not in ("self", "params", "optimizer_class", "defaults", "__class__")
            }
            | {"module": params if isinstance(params, nn.Module) else module}
            | defaults,
        )
        self._closed = True  # until construction succeeds (close() then does nothing)
        self._hook_handles: list = []
        Joinable.__init__(self)
        self._join_active: int | None = None  # ranks still training, inside a Join context
        self._join_input = None  # stage 3 under Join: the last forward's inputs (shadowing)
        self._shadowing = False  # stage 3: a joined rank's shadow forward and backward runs
        # ---- every choice resolved once, checked before anything else ([Note: policies])
        policy = resolve_given(
            stage,
            policy,
            {k: v.default for k, v in inspect.signature(ZeroOptimizer.__init__).parameters.items()},
            bucket_size_mb=bucket_size_mb,
            overlap_comm=overlap_comm,
            max_inflight_buckets=max_inflight_buckets,
            timeout=timeout,
            reshard_after_forward=reshard_after_forward,
            prefetch=prefetch,
            persist_below=persist_below,
            check_order=check_order,
            reduce_dtype=reduce_dtype,
            overlap_param_gather=overlap_param_gather,
            loss_scale=loss_scale,
        )
        self.policy = policy
        shard, gather, cp = policy.shard, policy.gather, policy.comm
        validate.check_args(kernel_backend, nonfinite)
        validate.check_launch()
        if isinstance(params, nn.Module):
            if module is not None and module is not params:
                raise ValueError("module= differs from the module passed as params")
            module = params
        validate.check_stage3(shard, module, units)
        self.check_order = gather.check_order
        self.mode, why = choose_mode(optimizer_class, partition)
        validate.check_kwargs(optimizer_class, defaults)
        self.stage = policy.stage  # for reports and checkpoints: the parts read the policy
        self.group, self.overlap_comm = process_group, cp.overlap_comm
        self.optimizer_class = optimizer_class
        self.nonfinite = nonfinite
        self.timeout = float(cp.timeout or 300.0)
        # collectives of backward and step are bounded only when the user asks (the process
        # group's own timeout otherwise): see [Note: timeouts] in zero_kernels.comm
        self._op_timeout = float(cp.timeout) if cp.timeout is not None else None
        self.world_size = comm.world_size(process_group)
        self.rank = comm.rank(process_group)
        user_groups, names = param_groups(params)
        if module is not None:
            for n, p in module.named_parameters():
                names.setdefault(id(p), n)
        all_params = {id(p): p for g in user_groups for p in g["params"]}
        validate.check_params(all_params, names, module)
        wrappers.check_not_wrapped(all_params.values(), names, module)
        for p in all_params.values():
            owner = wrappers.owner_of(p)
            if owner is not None:
                raise ValueError(
                    f"param {names.get(id(p)) or tuple(p.shape)} is held by another live "
                    f"ZeroOptimizer ({owner!r}): close() it first (or use one optimizer)"
                )
        # ---- layout (pure data), identical on every rank or an error on every rank
        specs, index_of, self._group_indices = [], {}, []
        for gi, g in enumerate(user_groups):
            idx = []
            for p in g["params"]:
                index_of[id(p)] = len(specs)
                idx.append(len(specs))
                specs.append(
                    ParamSpec(
                        len(specs),
                        gi,
                        str(p.dtype),
                        tuple(p.shape),
                        names.get(id(p), ""),
                        p.requires_grad,
                    )
                )
            self._group_indices.append(idx)
        self._params = {index_of[id(p)]: p for g in user_groups for p in g["params"]}
        # stage 3: which unit each param belongs to (see [Note: units])
        self._unit_modules: list[tuple[str, nn.Module]] = []
        self._unit_of: dict[int, int] = {}
        if not shard.params:
            self._unit_modules = find_units(module, units)
            self._unit_of = unit_assignment(self._unit_modules, self._params, gather.persist_below)
            specs = [dataclasses.replace(s, unit=self._unit_of[s.index]) for s in specs]
        if not any(s.requires_grad for s in specs):
            raise ValueError("ZeroOptimizer: no parameter has requires_grad=True")
        devices = {p.device for p in self._params.values() if not p.is_meta}
        if len(devices) > 1:
            raise ValueError(f"ZeroOptimizer: all params must be on one device, got {devices}")
        self._meta = any(p.is_meta for p in self._params.values())
        self.device = devices.pop() if devices else comm.default_device(process_group)
        self._init_fn, self._seed = init_fn, seed
        self.reduce_dtype = policy.precision.reduce_dtype
        if gather.overlap_param_gather and module is None:
            raise ValueError(
                "overlap_param_gather=True needs the model (its forward hooks wait for each "
                f"bucket); got module={type(module).__name__}"
            )
        self.overlap_param_gather = gather.overlap_param_gather
        self._pending_gathers: dict = {}  # (buffer, bucket) -> all-gather handle in flight
        self.reshard_after_forward, self.prefetch = gather.reshard_after_forward, gather.prefetch
        self.layout: Layout = build_layout(
            specs,
            self.world_size,
            bucket_numel=max(1, int(cp.bucket_size_mb * 2**20) // 4),
            mode=self.mode,
            by_unit=not shard.params,
        )
        validate.check_agree(
            {
                "stage": policy.stage,
                **policy.describe(),  # every field of every policy, by its name
                "partition mode": self.mode,
                "optimizer_class": f"{optimizer_class.__module__}.{optimizer_class.__qualname__}",
                "nonfinite": nonfinite,
                "units": [n for n, _ in self._unit_modules],
                "hyper-parameters": repr(sorted(defaults.items())),
                "param groups": repr(
                    [sorted((k, v) for k, v in g.items() if k != "params") for g in user_groups]
                ),
                "params (group, dtype, shape, requires_grad) crc32": zlib.crc32(
                    repr([(s.group, s.dtype, s.shape, s.requires_grad) for s in specs]).encode()
                ),
                "number of params": len(specs),
            },
            process_group,
            self.device,
        )
        self._trainable = {s.index: self._params[s.index] for s in specs if s.requires_grad}
        self._expected = {}  # index -> (data_ptr, dtype) each trainable param's data must keep
        self._module = module
        self._module_params = [id(p) for p in module.parameters()] if module is not None else None
        log.info(
            "ZeroOptimizer: stage %d, %s mode (%s), %d flat buffer(s), %d bucket(s), world size %d",
            stage,
            self.mode,
            why,
            len(self.layout.buffers),
            sum(len(b.buckets) for b in self.layout.buffers),
            self.world_size,
        )
        # large CPU blocks by size from here on, construction's included ([Note: host block cache])
        self.host_cache = self.device.type == "cpu" and hostmem.ensure(host_cache)
        if host_cache is True and self.device.type == "cpu" and not self.host_cache:
            warnings.warn(
                "host_cache=True: the host block cache is not in use ("
                + (hostmem.available() or "another CPU allocator of higher priority is in place")
                + "); glibc serves every CPU block",
                stacklevel=2,
            )
        # ---- from here on the params are changed: undo everything if anything fails
        try:
            self._build(user_groups, defaults, fused_adam, kernel_backend)
        except BaseException:
            self._closed = False
            try:  # collective where every rank failed alike, bounded where one did alone
                self.close()
            except RuntimeError:
                pass  # the construction's own error is the one to see
            raise

    def _comm_sizes(self) -> list[tuple[str, int]]:
        """``(op, bytes)`` of every bucket's reduce-scatter and all-gather."""
        out = []
        _, rdts = grad_dtypes(self.layout, reduce_dtype=self.reduce_dtype)
        for buf, rdt in zip(self.layout.buffers, rdts):
            pdt = dtype_of(buf.dtype)
            for b in buf.buckets:
                n = b.shard_numel * self.layout.world_size
                out += [("reduce_scatter", n * rdt.itemsize), ("all_gather", n * pdt.itemsize)]
        return out

    def _build(self, user_groups, defaults, fused_adam, kernel_backend) -> None:
        group = self.group
        # the collectives' algorithm probes, before this optimizer allocates anything
        # (`comm.probe_ahead`: their buffers then do not add to the first step's peak)
        comm.probe_ahead(self._comm_sizes(), group=group, device=self.device)
        # params become views of the store; rank 0's values win (as DDP does), except for a
        # model built on the meta device, initialised identically on every rank
        self._store = self._materialize_and_store()
        self._flats = self._store.flats
        self._expected = {i: (storage_id(p), p.dtype) for i, p in self._trainable.items()}
        self._side = comm.side_group(group, timeout_s=self.timeout)
        self.comm_log = comm.CommLog()
        self._steps = 0
        self._steps_at_reset = 0  # comm_stats["steps"] counts from the last reset_comm_stats()
        # [Note: no host sync] in zero_kernels/syncfree.py: off the CPU, step() reads nothing
        self._sync_free = self.device.type != "cpu"
        self._nonfinite_host = 0
        self._nonfinite_dev: torch.Tensor | None = None  # device counter (sync-free mode)
        self._deferred = syncfree.Deferred()  # per-step non-finite flags, read when ready
        self._grads = GradStore(
            self.layout,
            self.policy.shard,
            self.device,
            rank=self.rank,
            max_inflight=self.policy.comm.max_inflight_buckets,
            reduce_dtype=self.reduce_dtype,
        )
        # stage 3 on gloo: the reduce-scatters form a sequence of their own, apart from the
        # all-gathers (see [Note: backward gathers] in zero_kernels/partition/units.py);
        # check_order="every" compares every launch in one sequence, so it keeps one group
        self._rs_group = group
        if not self.policy.shard.params and self.check_order != "every":
            self._rs_group = comm.twin_group(group)
        self._reducer = Reducer(
            self.layout, self._params, self._grads, self.rank, self._rs_group, self.comm_log
        )
        self._hook_handles = self._reducer.handles_to_remove()
        if self._module is not None:  # a DDP built before zero_kernels was imported
            ids = frozenset(id(p) for p in self._params.values())
            self._hook_handles.append(
                self._module.register_forward_pre_hook(lambda m, a: wrappers.check_forward(ids))
            )
        self._reducer.overlap = bool(self.overlap_comm)
        me = weakref.ref(self)
        self._reducer.on_backward_start = _call(me, "_on_backward_start")
        self._reducer.on_reduced = _call(me, "_publish")
        self._reducer.timeout = self._op_timeout
        self._reducer.describe = _call_args(me, "_where")
        # the inner optimizer over this rank's pieces
        group_opts = [{k: v for k, v in g.items() if k != "params"} for g in user_groups]
        fusable = (
            self.optimizer_class in FUSED_ADAM_CLASSES
            and fused_adam
            and not any(g.get(k) or defaults.get(k) for g in group_opts for k in _UNFUSABLE)
        )
        self._runner = ShardRunner(
            self.layout,
            self._store,
            self._grads,
            self.rank,
            self.optimizer_class,
            group_opts,
            defaults,
            fused=fusable,
            backend=kernel_backend,
        )
        self._scheduler = None
        self._ids_trainable = {id(p) for p in self._trainable.values()}
        if not self.policy.shard.params:
            self._scheduler = self._make_scheduler()
            self._scheduler.timeout = self._op_timeout
            self._scheduler.describe = _call_args(me, "_where")
            if self.check_order != "first":
                check = self._sequence_check(self.check_order)
                check.describe = _call_args(me, "_where")
                self._scheduler.check = self._reducer.check = check
            self._reducer.on_bucket_ready = self._scheduler.bucket_done
            self._scheduler.on_skip = _call_args(me, "_skip_unit")
            self._scheduler.on_forward_start = _call_args(me, "_forward_start")
            m = self._module
            self._scheduler.handles += [
                m._register_state_dict_hook(_call_args(me, "_state_dict_hook")),
                m._register_load_state_dict_pre_hook(_call_args(me, "_load_pre_hook")),
                m.register_load_state_dict_post_hook(_call_args(me, "_load_post_hook")),
            ]
        elif self._module is not None:  # a loaded model's values reach the fp32 masters
            self._hook_handles.append(
                self._module.register_load_state_dict_post_hook(_call_args(me, "_load_post_hook"))
            )
            if self.overlap_param_gather:
                self._hook_handles += self._gather_wait_hooks(me)
        self._views = GradViews(self)
        for _i, _, pc, _, g in self._runner.all_pieces():
            self._views.by_index.setdefault(pc.index, []).append((g.reshape(-1), pc.offset))
        self._building = True
        super().__init__(user_groups, dict(self._runner.inner.defaults))
        self._building = False
        # loss scaling
        has_fp16 = any(p.dtype == torch.float16 and p.requires_grad for p in self._params.values())
        self.scaler = LossScaler(self.policy.precision.loss_scale, has_fp16)
        self._grad_factor = 1.0 / self.loss_scale  # the store times this = the true gradient
        self._overflow: bool | None = None
        self._local_nonfinite = False  # this rank's grads had inf/NaN (nonfinite="step")
        self.skipped_steps = 0
        self._said_nonfinite = False
        for p in self._params.values():
            p._zero_kernels_owner = me
        self._closed = False
        every = list(self._hook_handles) + (self._scheduler.handles if self._scheduler else [])
        weakref.finalize(self, _remove_hooks, every, dict(self._params))
        release_free_heap()  # what construction copied and freed, back to the system

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        """Remove every hook and give the params back as plain tensors with their current
        values (no longer views of the flat buffers); the optimizer cannot be used after.

        Stage 3 gathers every unit once to hand the params back whole, so there it is
        collective: every rank calls it within ``timeout`` seconds (default 300), else the
        ranks that did raise a RuntimeError saying so, the optimizer closed all the same and
        its params left as NaN placeholders. Leaving ``with ZeroOptimizer(...)`` through an
        exception closes without any collective (the other ranks may never come): the params
        of stage 3 stay placeholders there, those of stages 1/2 keep their values."""
        self._close(collective=True)

    def _close(self, collective: bool) -> None:
        if getattr(self, "_closed", True):
            return
        sched = getattr(self, "_scheduler", None)
        err = None
        if collective:
            try:
                if getattr(self, "_pending_gathers", None):
                    self.wait_params()
                if hasattr(self, "_reducer"):
                    self._reducer.flush_pending_waits()
                if sched is not None:
                    comm.check_arrival(self._side, "ZeroOptimizer.close() at stage 3", self.timeout)
            except RuntimeError as e:
                err, collective = e, False
        self._closed = True
        _remove_hooks(self._hook_handles, getattr(self, "_params", {}))
        if sched is not None:
            sched.remove()
        if sched is not None and collective:  # every unit gathered once: whole params back
            for u in sched.all_units:
                sched.wait(u)
                whole = [
                    (q, q.data.clone())
                    for i, b in u.buckets
                    for q, _, _ in self._store.members.get((i, b), ())
                ]
                sched.free(u)
                for q, t in whole:
                    q.data = t
        views = getattr(self, "_views", None)
        if views is not None:
            views.closed = True
        for p in getattr(self, "_params", {}).values():
            if getattr(p, "_zero_kernels_owner", None) is not None:
                p._zero_kernels_owner = None
            if isinstance(p.grad, ShardedGrad):
                p.grad = None
            if sched is None and not p.is_meta and p.data.data_ptr() != 0:
                with torch.no_grad():
                    p.data = p.data.clone()
        if err is not None:
            raise err

    def __enter__(self) -> ZeroOptimizer:
        return self

    def __exit__(self, exc_type, *exc) -> bool:
        self._close(collective=exc_type is None)
        return False

    def _check_open(self, what: str) -> None:
        if self._closed:
            raise RuntimeError(f"ZeroOptimizer.{what}: the optimizer was closed")

    def add_param_group(self, param_group: dict) -> None:
        """Add a group of params not held yet (progressive unfreezing), as torch's optimizers
        do; collective: every rank adds the same group.

        The params are laid out and sharded at construction, so the optimizer is built again
        over every group: the whole optimizer state (fp32 masters included) is gathered on
        every rank, the params are handed back whole (`close`), the same constructor runs with
        one more group, and the state, the step counter, the loss scaler, the counters of
        `comm_stats` and the hooks registered on this optimizer are put back. The old params
        keep their state exactly; the new ones start without state, as in torch. It costs the
        whole optimizer state on every rank for a moment and the constructor's collectives,
        once per call."""
        if getattr(self, "_building", False):
            return super().add_param_group(param_group)
        self._check_open("add_param_group")
        regroup.add_group(self, param_group)

    def _check_params_intact(self) -> None:
        validate.check_intact(self)

    def _all_reduce(self, t: torch.Tensor, op: str, what: str, group=None) -> torch.Tensor:
        """A small blocking all-reduce of this optimizer (on ``group``, default its process
        group), bounded by ``timeout`` when given."""
        return comm.all_reduce(
            t,
            op,
            group=self.group if group is None else group,
            log=self.comm_log,
            timeout_s=self._op_timeout,
            what=f"{self._where()}, {what}",
        )

    def _where(self) -> str:
        return f"ZeroOptimizer step {self._steps} (rank {self.rank})"

    def layout_name(self, index: int) -> str:
        for b in self.layout.buffers:
            for s in b.slots:
                if s.index == index:
                    return s.name or f"#{index} {s.shape}"
        p = self._params[index]
        if self._module is not None:  # a frozen param has no slot: its name in the module
            for n, q in self._module.named_parameters(remove_duplicate=False):
                if q is p:
                    return f"{n!r} {tuple(p.shape)}"
        return f"#{index} {tuple(p.shape)}"

    # ------------------------------------------------------------------ training loop API
    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients over micro-batches without reducing them (stage 1); stage 2
        still reduces every micro-batch to keep gradient memory sharded (same result)."""
        old = self._reducer.sync
        self._reducer.sync = False
        try:
            yield
        finally:
            self._reducer.sync = old

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss * loss_scale`` (fp16 dynamic loss scaling: call backward on this)."""
        return loss * self.loss_scale if self.loss_scale != 1.0 else loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients, torch's rule: ``set_to_none=True`` leaves every param out of the
        next step until a backward gives it a gradient; ``False`` keeps the gradients of the
        params that have one, at zero, so the next step still updates them (momentum, weight
        decay) where a backward gives them none, as ``model.zero_grad(set_to_none=False)`` and
        DDP with torch's optimizer do."""
        self._check_open("zero_grad")
        self._reset_grads(keep=not set_to_none)

    @torch.no_grad()
    def step(self, closure=None, **kwargs):
        """One optimizer step on this rank's shard, then the all-gather of the new params.

        ``closure`` is run first (with grad enabled) and its loss returned, as torch does.
        ``kwargs`` go to the inner optimizer's ``step`` (as torch's ZeroRedundancyOptimizer
        forwards them); a keyword it does not take, or any keyword where the fused Adam
        kernel steps, is a TypeError naming it, raised before anything runs. Keys the inner
        step adds to its param groups (or sets anew) appear in ``opt.param_groups`` after it.
        """
        self._check_open("step")
        self._runner.check_step_kwargs(kwargs)
        self.wait_params()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._check_params_intact()
        self._finish_reduction()
        if self._overflow:
            self.skipped_steps += 1
            if not self.scaler.active and self.nonfinite == "raise":
                self._overflow = None
                raise FloatingPointError(
                    f"ZeroOptimizer.step {self._steps}: non-finite gradients on at least one "
                    "rank (nonfinite='raise'); nothing was updated"
                )
            self.scaler.overflow()
            self._nonfinite_host += 1
            log.info(
                "ZeroOptimizer: non-finite gradients, step skipped on every rank; "
                "loss scale now %g",
                self.loss_scale,
            )
        else:
            if self._local_nonfinite:
                self._nonfinite_host += 1
                if not self._said_nonfinite:
                    self._log_nonfinite(self._steps)
            for step, bad in self._deferred.ready():  # flags of earlier steps, now known
                if bad and not self._said_nonfinite:
                    self._log_nonfinite(step)
            hyper = self._runner.sync_hyper(self.param_groups)
            if not self._runner.scales_in_kernel:
                self._apply_grad_factor()
            handles = self._runner.step(
                self._views.active, self._grad_factor, self.comm_log, self.group, kwargs
            )
            self._runner.take_group_keys(self.param_groups, hyper)
            if self._scheduler is not None:  # stage 3: params kept whole are gathered now
                handles += [
                    ((-1, k), h) for k, h in enumerate(self._scheduler.refresh_persistent())
                ]
            if self.overlap_param_gather:  # waited for by the next forward (see wait_params)
                self._pending_gathers.update(handles)
            else:
                for (_, b), h in handles:
                    h.wait(self._op_timeout, f"{self._where()}, step: all-gather of bucket {b}")
            self.scaler.finite_step()
        self._steps += 1
        self._overflow = None
        self._local_nonfinite = False
        return loss

    # ------------------------------------------------------------------ telemetry
    def memory_report(self) -> dict:
        """This rank's bytes of params, grads, master, optimizer state and comm buffers."""
        seen, pb = set(), 0
        pb += self._store.nbytes()
        for i in self.layout.frozen:
            p = self._params[i]
            if id(p) not in seen:
                seen.add(id(p))
                pb += p.numel() * p.element_size()
        g = self._grads
        grad = g.nbytes()
        state = self._runner.state_bytes()
        master = self._runner.master_bytes()
        model = pb + grad + master + state
        comm_now = g.comm_nbytes()
        return dict(
            param_bytes=pb,
            grad_bytes=grad,
            master_bytes=master,
            optim_state_bytes=state,
            model_state_bytes=model,
            comm_buffer_bytes=comm_now,
            comm_buffer_peak_bytes=g.comm_peak_nbytes(),
            grad_peak_bytes=grad + g.comm_peak_nbytes(),
            total_bytes=model + comm_now,
            gathered_param_bytes=self._store.gathered_nbytes() if self._store.sharded else 0,
            gathered_param_peak_bytes=self._store.peak_gathered if self._store.sharded else 0,
        )

    @property
    def comm_stats(self) -> dict:
        return {
            **self.comm_log.as_dict(),
            "steps": self._steps - self._steps_at_reset,
            "nonfinite_steps": self.nonfinite_steps,
        }

    def reset_comm_stats(self) -> None:
        """Counters of `comm_stats` from zero; the step counter itself (which names checkpoint
        folders and is restored on resume) goes on."""
        self.comm_log.reset()
        self._steps_at_reset = self._steps
        self.nonfinite_steps = 0

    @property
    def sharded_state(self):
        """The public interface to this rank's sharded state that checkpoints read and write
        (`zero_kernels.sharded_state.ShardedState`)."""
        from .sharded_state import ShardedState

        return ShardedState(self)

    # the loss scale, as before the scaler was its own object (checkpoints, scripts, tests)
    loss_scale = property(
        lambda self: self.scaler.scale, lambda self, v: setattr(self.scaler, "scale", float(v))
    )
    growth_interval = property(
        lambda self: self.scaler.growth_interval,
        lambda self, v: setattr(self.scaler, "growth_interval", int(v)),
    )
    _growth_tracker = property(
        lambda self: self.scaler.growth_tracker,
        lambda self, v: setattr(self.scaler, "growth_tracker", int(v)),
    )
    _dynamic = property(lambda self: self.scaler.dynamic)

    def __repr__(self) -> str:
        return (
            f"ZeroOptimizer(stage={self.stage}, mode={self.mode!r}, "
            f"optimizer_class={self.optimizer_class.__name__}, "
            f"world_size={self.world_size}, rank={self.rank})"
        )


def _remove_hooks(handles: list, params: dict) -> None:
    for h in handles:
        h.remove()
    handles.clear()
    for p in params.values():
        if isinstance(p.grad, ShardedGrad):
            p.grad = None
