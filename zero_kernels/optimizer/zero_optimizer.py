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
import logging
import warnings
import weakref

import torch
from torch import nn
from torch.distributed.algorithms.join import Joinable, JoinHook

from .. import comm, hostmem
from ..buffers import release_free_heap, storage_id
from ..partition.grads import ShardedGrad
from ..partition.phase import backward_marker
from ..partition.unit_view import UnitInfo, unit_infos
from ..policy import (
    CommPolicy,
    ExecutionPolicy,
    GatherPolicy,
    OffloadPolicy,
    PrecisionPolicy,
    ZeroPolicy,
)
from . import build, regroup, replicas, validate, wrappers
from .core import Core
from .grad_access import GradContract
from .join import JoinState
from .loss_scale import LossScaler
from .memory import memory_report
from .param_access import ParamAccess, _call, _call_args
from .sharded_state import ShardedState
from .state_access import FullState
from .stepper import Stepper

__all__ = ["ZeroOptimizer"]

log = logging.getLogger("zero_kernels")

# the constructor's keywords (errors list them; integrations check ``zero=`` against them)
KEYWORDS = (
    "stage",
    "gather",
    "precision",
    "comm",
    "offload",
    "execution",
    "policy",
    "process_group",
    "module",
    "units",
)

wrappers.install()  # a DDP built over a live ZeroOptimizer's params raises ([Note: wrappers])


class ZeroOptimizer(torch.optim.Optimizer, Joinable):
    """Shards ``optimizer_class``'s state (stage 1), the gradients too (stage 2) and the params
    too (stage 3). Every option is a field of a policy (`zero_kernels.policy`, each documented
    there once); this constructor takes the policies.

    Args:
        params: an ``nn.Module`` (names then appear in errors and layouts), or what torch
            optimizers take: an iterable of tensors or of param-group dicts.
        optimizer_class: a ``torch.optim.Optimizer`` subclass (not LBFGS).
        stage: 1, 2 or 3 (default 2): the shorthand of `ShardPolicy` (docs/stages.md).
        gather: a `GatherPolicy`: stage 3's gathering (resharding, prefetch, params kept whole,
            the order check, hpZ, frozen shards), stages 1/2's overlapped param all-gather.
        precision: a `PrecisionPolicy`: reduction dtype, loss scale, optimizer state dtype.
        comm: a `CommPolicy`: buckets, overlap, timeout, shard group, quantized collectives.
        offload: an `OffloadPolicy`: optimizer state and stage 3's params on NVMe or host.
        execution: an `ExecutionPolicy`: state layout, fused kernel, non-finite steps, host
            cache, meta-device materialization.
        policy: a `ZeroPolicy` holding all of the above (a saved or shared configuration,
            `ZeroPolicy.resolve`'s flat names); then none of them may be given.
        process_group: the data-parallel group (default: the world).
        module: the model, when ``params`` are param groups (stage 3 needs it).
        units: stage 3: the modules gathered as one (default: found in the model,
            docs/stage3.md).
        **defaults: passed to ``optimizer_class`` (``lr=``, ``weight_decay=``, ...).

    After backward ``param.grad`` is a `ShardedGrad`, this rank's piece of the averaged
    gradient, which ``torch.nn.utils.clip_grad_norm_``, ``model.zero_grad()`` and
    ``torch.amp.GradScaler`` work with ([Note: gradients] in `zero_kernels.partition.grads`). A
    trainable param with no gradient on any rank is left out of the step, as torch does.
    ``close()`` (or ``with ZeroOptimizer(...) as opt``) removes every hook and hands the params
    back whole. ``memory_report()``, ``comm_stats`` and ``comm_ledger`` report this rank's bytes
    and traffic (docs/design.md).
    """

    def __init__(
        self,
        params,
        optimizer_class,
        *,
        stage: int | None = None,
        gather: GatherPolicy | None = None,
        precision: PrecisionPolicy | None = None,
        comm: CommPolicy | None = None,
        offload: OffloadPolicy | None = None,
        execution: ExecutionPolicy | None = None,
        policy: ZeroPolicy | None = None,
        process_group=None,
        module: nn.Module | None = None,
        units=None,
        **defaults,
    ):
        self._closed = True  # until construction succeeds (close() then does nothing)
        self._hook_handles: list = []
        self.parts: Parts | None = None
        Joinable.__init__(self)
        # ---- every choice resolved once, checked before anything else ([Note: policies])
        parts = dict(gather=gather, precision=precision, comm=comm, offload=offload)
        parts["execution"] = execution
        if policy is None:
            policy = ZeroPolicy.of(stage, **parts)
        elif not isinstance(policy, ZeroPolicy):
            raise TypeError(
                f"policy must be a zero_kernels.policy.ZeroPolicy, got {type(policy).__name__}"
            )
        else:
            both = [k for k, v in {"stage": stage, **parts}.items() if v is not None]
            if both:
                raise ValueError(
                    f"policy= and {', '.join(f'{k}=' for k in both)} given together: set "
                    f"{'them' if len(both) > 1 else 'it'} in the policy (each choice in one "
                    "place)"
                )
        if isinstance(params, nn.Module):
            if module is not None and module is not params:
                raise ValueError("module= differs from the module passed as params")
            module = params
        # what add_param_group builds again with one more group: the resolved policy
        self._rebuild = (
            optimizer_class,
            dict(policy=policy, process_group=process_group, module=module, units=units),
            dict(defaults),
        )
        self.policy = policy
        validate.check_launch()
        ex = policy.execution
        self.optimizer_class, self.nonfinite = optimizer_class, ex.nonfinite
        # ---- the layout (pure data): nothing is changed yet
        core, user_groups, meta = build.lay_out(
            policy,
            params,
            optimizer_class,
            module=module,
            units=units,
            process_group=process_group,
            defaults=defaults,
            own_options=KEYWORDS,
        )
        self._core = core
        # large CPU blocks by size from here on, construction's included ([Note: host block cache])
        self.host_cache = core.device.type == "cpu" and hostmem.ensure(ex.host_cache)
        if ex.host_cache is True and core.device.type == "cpu" and not self.host_cache:
            warnings.warn(
                "host_cache=True: the host block cache is not in use ("
                + (hostmem.available() or "another CPU allocator of higher priority is in place")
                + "); glibc serves every CPU block",
                stacklevel=2,
            )
        # ---- from here on the params are changed: undo everything if anything fails
        try:
            self._build(core, user_groups, meta, defaults)
        except BaseException:
            self._closed = False
            try:  # collective where every rank failed alike, bounded where one did alone
                self.close()
            except RuntimeError:
                pass  # the construction's own error is the one to see
            raise

    def _build(self, core: Core, user_groups, meta: bool, defaults: dict) -> None:
        """The built core (`build.assemble`: store, communication, runner, units), then the
        parts over it."""
        build.assemble(core, user_groups, meta, self.optimizer_class, defaults)
        # each trainable param's data must keep its storage and dtype (`validate.check_intact`)
        self._expected = {i: (storage_id(p), p.dtype) for i, p in core.trainable.items()}
        self._module_params = (
            [id(p) for p in core.module.parameters()] if core.module is not None else None
        )
        self._hook_handles = core.reducer.handles_to_remove()
        # ---- the parts ([Note: parts]); hooks reach them through a weak reference to self
        me = weakref.ref(self)
        has_fp16 = any(p.dtype == torch.float16 and p.requires_grad for p in core.params.values())
        self.scaler = LossScaler(self.policy.precision.loss_scale, has_fp16)
        join = JoinState(core, self)
        grads = GradContract(core, self.scaler, join, self.nonfinite)
        params = ParamAccess(core)
        full = FullState(core, grads, params, lambda: me().param_groups)
        stepper = Stepper(core, grads, params, self.scaler, self.nonfinite)
        copies = replicas.Replicas(core, join)
        self.parts = Parts(core, grads, params, full, join, stepper, copies)
        r, m = core.reducer, core.module
        r.on_backward_start = _call(me, lambda o: o.parts.grads.on_backward_start)
        r.on_reduced = _call(me, lambda o: o.parts.grads.publish)
        r.describe = core.where
        if m is not None:  # a DDP built before zero_kernels was imported
            ids = frozenset(id(p) for p in core.params.values())
            self._hook_handles.append(
                m.register_forward_pre_hook(lambda mod, a: wrappers.check_forward(ids))
            )
        if copies.on:  # DDP's broadcast_buffers ([Note: replicated module state])
            join.shadow_forward = _call(me, lambda o: o.parts.replicas.before_forward)
            join.final_sync = _call_args(me, lambda o: o.parts.replicas.after_join)
            hook = _call_args(me, lambda o: o.parts.replicas.before_forward_hook)
            # run as Python where torch.compile traces the model ([Note: torch.compile])
            hook = torch.compiler.disable(hook, recursive=True)
            self._hook_handles.append(m.register_forward_pre_hook(hook))
        sched = core.units
        if sched is not None:
            sched.describe = core.where
            sched.on_skip = _call_args(me, lambda o: o.parts.params.skip_unit)
            sched.on_forward_start = _call_args(me, lambda o: o.parts.join.forward_start)
            sched.handles += params.module_hooks(me)  # [Note: module state dicts]
        elif m is not None:
            # the backward's first hook in its own graph task ([Note: nested backwards])
            mark = backward_marker(lambda: _phase_of(me))
            self._hook_handles.append(m.register_forward_hook(mark))
            # a loaded model's values reach the fp32 masters; state dicts hold copies ([Note:
            # state dict copies]); on every module ([Note: module state dicts])
            self._hook_handles += params.module_hooks(me)
            if self.policy.gather.overlap_param_gather:
                self._hook_handles += params.gather_wait_hooks(me)
        self._building = True
        super().__init__(user_groups, dict(core.runner.inner.defaults))
        self._building = False
        for p in core.params.values():
            p._zero_kernels_owner = me
        self._closed = False
        every = list(self._hook_handles) + (sched.handles if sched else [])
        weakref.finalize(self, _remove_hooks, every, dict(core.params))
        release_free_heap()  # what construction copied and freed, back to the system

    # ------------------------------------------------------------------ what the parts hold
    @property
    def stage(self) -> int:
        """The policy's stage shorthand (reports, checkpoints): the parts read the policy."""
        return self.policy.stage

    mode = property(lambda self: self._core.mode)  # "flat" or "whole"
    group = property(lambda self: self._core.group)  # the data-parallel process group
    rank = property(lambda self: self._core.dp_rank)  # in the data-parallel group
    world_size = property(lambda self: self._core.dp_size)
    shard_size = property(lambda self: self._core.world_size)  # ranks the state is sharded over
    device = property(lambda self: self._core.device)
    layout = property(lambda self: self._core.layout)
    timeout = property(lambda self: self._core.timeout)
    comm_log = property(lambda self: self._core.comm_log)
    check_order = property(lambda self: self.policy.gather.check_order)
    secondary_shard = property(lambda self: self.policy.gather.secondary_shard)
    reduce_dtype = property(lambda self: self.policy.precision.reduce_dtype)
    overlap_comm = property(lambda self: self.policy.comm.overlap_comm)
    overlap_param_gather = property(lambda self: self.policy.gather.overlap_param_gather)
    reshard_after_forward = property(lambda self: self.policy.gather.reshard_after_forward)
    prefetch = property(lambda self: self.policy.gather.prefetch)
    skipped_steps = property(
        lambda self: self.parts.stepper.skipped_steps,
        lambda self, v: setattr(self.parts.stepper, "skipped_steps", int(v)),
    )
    nonfinite_steps = property(
        lambda self: self.parts.grads.nonfinite_steps,
        lambda self, v: setattr(self.parts.grads, "nonfinite_steps", v),
        doc="Steps with inf/NaN gradients (on this rank, with nonfinite='step'); reading it off "
        "the CPU waits for the device (telemetry, never read by the step).",
    )

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
        core, parts = getattr(self, "_core", None), getattr(self, "parts", None)
        sched = core.units if core is not None else None
        params = core.params if core is not None else {}
        err = None
        if collective:
            try:
                if parts is not None:
                    parts.params.wait()
                if core is not None and core.reducer is not None:
                    core.reducer.flush_pending_waits()
                if sched is not None:
                    comm.check_arrival(core.side, "ZeroOptimizer.close() at stage 3", core.timeout)
            except RuntimeError as e:
                err, collective = e, False
        self._closed = True
        _remove_hooks(self._hook_handles, params)
        swap = getattr(core.runner, "swap", None) if core is not None else None
        if swap is not None:
            swap.close()  # the offload file goes with the optimizer
        host = getattr(core.runner, "host", None) if core is not None else None
        if host is not None:
            host.close()  # the copies back to the device finished
        if sched is not None:
            sched.remove()
        if sched is not None and collective:  # every unit gathered once: whole params back
            for u in sched.all_units:
                with core.runner.exact():
                    sched.wait(u)
                whole = [
                    (q, q.data.clone())
                    for i, b in u.buckets
                    for q, _, _ in core.store.members.get((i, b), ())
                ]
                sched.free(u)
                for q, t in whole:
                    q.data = t
        tier = core.store.tier if core is not None and core.store is not None else None
        if tier is not None:
            tier.close()  # the params' offload file too, once they are handed back
        if parts is not None:
            parts.grads.views.closed = True
        for p in params.values():
            if getattr(p, "_zero_kernels_owner", None) is not None:
                p._zero_kernels_owner = None
            if isinstance(p.grad, ShardedGrad):
                p.grad = None
            if sched is None and not p.is_meta and p.data.data_ptr() != 0:
                with torch.no_grad():
                    p.data = p.data.clone()
        if err is not None:
            raise err

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def phase(self) -> str:
        """Where the training loop is: "idle", "forward", "backward" or "step" ([Note: phase])."""
        return self._core.phase.now.value

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
        kept = regroup.take(self, param_group)  # checked, the whole state gathered
        optimizer_class, kwargs, defaults = self._rebuild
        # torch.optim.Optimizer's hooks registered on this optimizer survive the rebuild
        hooks = {k: v for k, v in vars(self).items() if k.startswith("_optimizer_") and "hook" in k}
        self.close()
        type(self).__init__(self, kept.groups, optimizer_class, **kwargs, **defaults)
        vars(self).update(hooks)
        regroup.put_back(self, kept)

    def layout_name(self, index: int) -> str:
        return self._core.param_name(index)

    # ------------------------------------------------------------------ training loop API
    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients over micro-batches without reducing them (stage 1); stage 2
        still reduces every micro-batch to keep gradient memory sharded (same result)."""
        r = self._core.reducer
        old = r.sync
        r.sync = False
        try:
            yield
        finally:
            r.sync = old

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
        self.parts.grads.reset(keep=not set_to_none)

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
        validate.check_step_kwargs(self._core.runner, kwargs)
        self.parts.params.wait()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        phase = self._core.phase
        phase.enter_step()  # raises inside a backward, before anything reads a param
        try:
            if self._core.units is not None:
                self._core.units.release_for_step()  # stage 3: units a forward left gathered
            validate.check_intact(self._core, self._expected, self._module_params)
            self.parts.stepper.step(self.param_groups, kwargs)
        finally:
            phase.end_step()
        return loss

    def clip_grad_norm_(
        self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False
    ) -> torch.Tensor:
        """Clip the (reduced, unscaled) gradients to ``max_norm``; returns the global norm,
        exactly as ``torch.nn.utils.clip_grad_norm_`` on the unsharded model."""
        self._check_open("clip_grad_norm_")
        return self.parts.grads.clip_grad_norm_(max_norm, norm_type, error_if_nonfinite)

    # ------------------------------------------------------------------ whole params and state
    def gathered_params(self, module_or_params=None, modifier_rank: int | None = None):
        """Make params whole for inspection or editing (collective: every rank enters it).

        ``module_or_params``: a module or params (default: all). At stage 3 their units are
        gathered (those gathered here are freed on exit); at stages 1/2 params are whole anyway.
        ``modifier_rank``: the rank whose edits inside the block are kept: its values are sent
        to every rank and written into the shards (and fp32 masters), for every unit of the
        params asked for, whatever its state at entry (the params kept whole by
        ``persist_below``, a unit an outer ``gathered_params`` or a forward holds). None: edits
        are dropped at stage 3 (and must be the same on every rank at stages 1/2)."""
        self._check_open("gathered_params")
        return self.parts.params.gathered(module_or_params, modifier_rank)

    def wait_params(self, *args, **kwargs) -> None:
        """overlap_param_gather: finish every all-gather still in flight, so the params hold the
        last step's values. The next forward does it bucket by bucket by itself; call this
        before reading params between ``step()`` and the next forward (EMA, logging, saving
        tensors yourself); model.state_dict() and this optimizer's own methods call it."""
        if self.parts is not None:
            self.parts.params.wait()

    def state_dict(self) -> dict:
        """This rank's shard: the inner optimizer's state plus the layout needed to check it."""
        return self.sharded_state.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a `state_dict` of this rank (same layout), or a full torch-format one
        (``consolidated_state_dict``, or a plain torch optimizer's) at any world size."""
        self.sharded_state.load_state_dict(state_dict)

    def consolidated_state_dict(self, to: int = 0) -> dict | None:
        """On rank ``to``: the state dict of the unsharded ``optimizer_class`` (torch's format,
        loadable by it; tensors on the host); None on the other ranks. Collective: call it on
        every rank. With tensor parallelism (DTensor params): on every rank whose dp rank is
        ``to`` (one per tp rank, all alike), a DTensor param's entries are whole tensors of its
        global shape, gathered over dp and then over tp (as `full_state` gives them), and
        ``load_state_dict`` takes such a dict at any dp and tp size."""
        if not 0 <= to < self.world_size:
            raise ValueError(f"to must be a rank in [0, {self.world_size}), got to={to!r}")
        self._check_open("consolidated_state_dict")
        return self.parts.full.consolidated_state_dict(to)

    def full_param(self, param: torch.Tensor) -> torch.Tensor:
        """The whole parameter at full precision: the fp32 master (bf16/fp16 params) or the
        param itself; a new tensor on every rank. Collective: call it on every rank."""
        self._check_open("full_param")
        return self.parts.full.full_param(param)

    def set_full_param(self, param: torch.Tensor, value: torch.Tensor) -> None:
        """Set the whole parameter (and its master) to ``value`` (the same on every rank)."""
        self._check_open("set_full_param")
        self.parts.full.set_full_param(param, value)

    def full_grad(self, param: torch.Tensor) -> torch.Tensor | None:
        """The whole averaged gradient (true units: loss scale removed, clipping applied), or
        None if the param has no gradient (on any rank). Collective: call it on every rank."""
        self._check_open("full_grad")
        return self.parts.full.full_grad(param)

    def set_full_grad(self, param: torch.Tensor, value: torch.Tensor | None) -> None:
        """Replace the param's gradient by ``value`` (the same on every rank), or drop it."""
        self._check_open("set_full_grad")
        self.parts.full.set_full_grad(param, value)

    def full_state(self, param: torch.Tensor) -> dict:
        """The param's optimizer state in the unsharded torch optimizer's format (element-wise
        entries whole, per-tensor ones as they are); {} before its first step. Collective."""
        self._check_open("full_state")
        return self.parts.full.full_state(param)

    def set_full_state(self, param: torch.Tensor, key: str, value) -> None:
        """Set one entry of the param's optimizer state (after its first step); ``value`` is
        whole for element-wise entries (each rank keeps its piece), else set as is."""
        self._check_open("set_full_state")
        self.parts.full.set_full_state(param, key, value)

    # ------------------------------------------------------------------ uneven inputs (Join)
    def join_hook(self, **kwargs) -> JoinHook:
        """For ``torch.distributed.algorithms.Join([opt])`` (as ZeroRedundancyOptimizer): a rank
        out of inputs shadows the others' iterations, each one synchronising backward and one
        ``step``; gradient averages count it as zeros (DDP's default under Join)."""
        return self.parts.join.hook()

    @property
    def join_device(self) -> torch.device:
        return self.device

    @property
    def join_process_group(self):
        return comm.group_or_world(self.group)

    # ------------------------------------------------------------------ telemetry
    def units(self) -> list[UnitInfo]:
        """Stage 3's units as they are now (`zero_kernels.partition.unit_view.UnitInfo`: name,
        kind root/unit/kept, module, param names, size, state); [] at stages 1 and 2, where
        every param stays whole. Not collective."""
        sched = self._core.units
        return [] if sched is None else unit_infos(sched, self._core.module)

    def memory_report(self) -> dict:
        """This rank's bytes of params, grads, master, optimizer state and comm buffers; with
        offload, the staging buffers (RAM) and the offload file (disk)
        (`zero_kernels.optimizer.memory.memory_report`)."""
        return memory_report(self._core)

    @property
    def comm_stats(self) -> dict:
        steps = self._core.steps
        return {
            **self.comm_log.as_dict(),
            "steps": steps.n - steps.at_reset,
            "nonfinite_steps": self.nonfinite_steps,
        }

    @property
    def comm_ledger(self) -> list[dict]:
        """Per step, what `comm_stats` grew by ([Note: the step ledger], comm/base.py)."""
        return self.comm_log.read_ledger()

    def reset_comm_stats(self) -> None:
        """Counters of `comm_stats` from zero; the step counter itself (which names checkpoint
        folders and is restored on resume) goes on."""
        self.comm_log.reset()
        self._core.steps.at_reset = self._core.steps.n
        self.nonfinite_steps = 0

    @property
    def sharded_state(self):
        """The public interface to this rank's sharded state that checkpoints read and write
        (`zero_kernels.optimizer.sharded_state.ShardedState`)."""
        self._check_open("sharded_state")
        return ShardedState(self)

    # the loss scale, as before the scaler was its own object (checkpoints, scripts, tests)
    loss_scale = property(
        lambda self: self.scaler.scale, lambda self, v: setattr(self.scaler, "scale", float(v))
    )
    growth_interval = property(
        lambda self: self.scaler.growth_interval,
        lambda self, v: setattr(self.scaler, "growth_interval", int(v)),
    )

    def __repr__(self) -> str:
        return (
            f"ZeroOptimizer(stage={self.stage}, mode={self.mode!r}, "
            f"optimizer_class={self.optimizer_class.__name__}, "
            f"world_size={self.world_size}, rank={self.rank})"
        )

    @classmethod
    def from_deepspeed_config(cls, model, config, **kwargs):
        """``model``'s ZeroOptimizer, LR scheduler and clipping norm as DeepSpeed config
        ``config`` (a ds_config.json path or a dict) says: a
        `zero_kernels.integrations.ds_config.DeepSpeedRun` (optimizer, lr_scheduler,
        clip_grad_norm, mapping). A key it cannot take raises, with all the others, in one
        NotImplementedError ([Note: DeepSpeed config] there; ``kwargs``: its options)."""
        from ..integrations.ds_config import build_from_deepspeed_config

        return build_from_deepspeed_config(cls, model, config, **kwargs)


@dataclasses.dataclass(eq=False)
class Parts:
    """The debug view of one `ZeroOptimizer`, ``opt.parts``: its built core and the parts over
    it ([Note: parts] in `zero_kernels.optimizer.core`). The layers above the optimizer
    (checkpoints, the command) and the tests read the optimizer's inner state here, never through
    private attributes; a training script needs only the optimizer's methods, and what is here
    may change between releases."""

    core: Core
    grads: GradContract
    params: ParamAccess
    full: FullState
    join: JoinState
    stepper: Stepper
    replicas: replicas.Replicas


def _remove_hooks(handles: list, params: dict) -> None:
    for h in handles:
        h.remove()
    handles.clear()
    for p in params.values():
        if isinstance(p.grad, ShardedGrad):
            p.grad = None


def _phase_of(me):
    o = me()
    return None if o is None or o._closed else o._core.phase
