"""Hugging Face Accelerate with a `ZeroOptimizer`: `prepare` in place of ``accelerator.prepare``,
and checkpoints through `zero_kernels.save_checkpoint` in place of accelerate's own.

A DDP script changes in two lines (the import and the ``prepare`` call)::

    model, opt, dl, sched = accelerator.prepare(model, opt, dl, sched)  # DDP
    model, opt, dl, sched = zka.prepare(accelerator, model, opt, dl, sched, zero={"stage": 3})

A script that ran with accelerate's DeepSpeed plugin keeps its config file (and its
``DummyOptim``/``DummyScheduler``); the Accelerator is built without the plugin::

    model, opt, dl, sched = zka.prepare(accelerator, model, opt, dl, sched, zero="ds_config.json")

([Note: accelerate and a DeepSpeed config] in `zero_kernels.integrations.accelerate_ds`.)

``accelerator.backward``, ``accelerator.accumulate(model)``, ``accelerator.clip_grad_norm_``,
``opt.step()``/``opt.zero_grad()``, ``sched.step()``, ``accelerator.save_state(dir)`` and
``accelerator.load_state(dir)`` then do what they do with DDP, on the sharded optimizer.

[Note: accelerate without DDP]
``accelerator.prepare(model, ...)`` puts the model inside DDP: DDP would reduce the gradients a
second time (a ZeroOptimizer reduces them itself, during backward), so it is refused
(zero_kernels/optimizer/wrappers.py). Its ``prepare_model`` also calls
``model.to(accelerator.device)``,
which with ``cpu=True`` at several ranks is ``cpu:<rank>``, a different device from ``cpu`` for
``Tensor.to``: every param is copied and a ZeroOptimizer built before holds stale data. So
`prepare` never hands the model to accelerate:

- the model is moved (``Module.to``: the same Parameter objects) only when its params are on
  another device type or CUDA index, before the ZeroOptimizer is built over them; a ZeroOptimizer
  given ready-made must already be on the device;
- a plain torch optimizer becomes a ZeroOptimizer over the same groups
  (`zero_kernels.integrations.common.from_torch_optimizer`); schedulers built over the torch
  optimizer are rebound to it (``scheduler.optimizer``, the groups' ``initial_lr`` ride along);
- the ZeroOptimizer is wrapped in an ``AcceleratedOptimizer`` subclass (no device placement:
  that would round-trip its per-rank state dict) and registered in ``accelerator._optimizers``,
  so ``step``/``zero_grad`` act only when ``accelerator.sync_gradients`` is true (accumulation),
  accelerate's schedulers find it, and attributes it lacks (``no_sync``, ``full_param``,
  ``clip_grad_norm_``, ``comm_stats``...) are the ZeroOptimizer's;
- the model gets a ``no_sync`` attribute that enters the ZeroOptimizer's ``no_sync()``:
  ``accelerator.accumulate(model)`` and ``accelerator.no_sync(model)`` look for exactly that
  attribute (DDP's), so micro-batches are not reduced at stage 1 (stages 2 and 3 still reduce
  each one, to keep the gradients sharded; the result is the same);
- ``mixed_precision="bf16"`` wraps the model's forward in autocast as accelerate does (its own
  helpers); at stage 3 the autocast cache must be off (``AutocastKwargs(cache_enabled=False)``),
  as the weight copies it caches would outlive their unit's gather;
- data loaders and schedulers go through ``accelerator.prepare`` unchanged, so sharding of the
  data, scheduler stepping (``num_processes`` times per step unless ``split_batches``) and
  ``skip_first_batches`` are accelerate's own, the same as with DDP.

One model and one optimizer per Accelerator at a time: a second `prepare` is refused while the
first is registered; after ``accelerator.free_memory()`` (which drops accelerate's references)
it closes the earlier ZeroOptimizer (collective: its hooks leave that model, whose params are
whole again) and prepares the new one.

``accelerator.clip_grad_norm_`` and ``clip_grad_value_`` need nothing: without fp16 they are
torch's ``clip_grad_norm_``/``clip_grad_value_``, which work on the ShardedGrads (the norm is
reduced over the shards; the clamp is element-wise). Called on a micro-batch that does not end
an accumulation window they raise (`_clip_at_sync`): DDP clips each rank's partial gradient
there, which a ZeroOptimizer does not hold.

[Note: accelerate checkpoints]
``accelerator.save_state`` saves ``model.state_dict()`` on rank 0 only (collective at stage 3: it
hangs) and ``optimizer.state_dict()`` of rank 0 only (one shard of many). `prepare` replaces the
accelerator's ``save_state``/``load_state`` (on that instance) with `save_state`/`load_state`
here: `zero_kernels.save_checkpoint`/`load_checkpoint` (collective, resharding at any world size
and stage, every rank's RNG states, the scheduler) plus what accelerate keeps itself:
``accelerator.step`` (the accumulation counter), the other schedulers and the objects given to
``accelerator.register_for_checkpointing`` (their ``state_dict()`` must be JSON values, tuples or
small tensors). The data position is the script's, as with accelerate (``skip_first_batches``).

Refused, with the setting named: DeepSpeed, FSDP, Megatron-LM and XLA (their own sharding),
tensor/context parallelism (``parallelism_config``, ``torch_tp_plugin``), ``mixed_precision="fp16"``
(accelerate's GradScaler steps rank by rank on what each rank sees; use bf16, or fp16 params with
the ZeroOptimizer's own ``loss_scale`` outside accelerate), fp8, a dynamo backend (call
``torch.compile`` on the model yourself) and stateful data loaders (their state is not saved).
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import warnings
import weakref

import torch
from torch import nn

try:
    from accelerate import Accelerator
    from accelerate.optimizer import AcceleratedOptimizer
    from accelerate.scheduler import AcceleratedScheduler
    from accelerate.utils import (
        DistributedType,
        convert_outputs_to_fp32,
        get_mixed_precision_context_manager,
    )
    from accelerate.utils.deepspeed import DummyOptim, DummyScheduler  # without DeepSpeed too
except ImportError as e:  # pragma: no cover - exercised without accelerate installed
    raise ImportError(
        "zero_kernels.integrations.accelerate needs accelerate (pip install accelerate)"
    ) from e

from .accelerate_ds import plan_from_deepspeed_config
from .common import (
    check_not_wrapped,
    from_torch_optimizer,
    is_zero,
    shard_of,
    with_broadcast_buffers,
    zero_kwargs,
)
from .ds_config import is_deepspeed_config

__all__ = ["ZeroAcceleratedOptimizer", "load_state", "prepare", "save_state"]

_WHERE = "zero_kernels.integrations.accelerate.prepare"
_KEY = "_accelerate"  # where this module's state goes in the checkpoint's extra
_REFUSED = {
    DistributedType.DEEPSPEED: "a DeepSpeed plugin",
    DistributedType.FSDP: "an FSDP plugin",
    DistributedType.MEGATRON_LM: "a Megatron-LM plugin",
    DistributedType.XLA: "XLA",
}


class ZeroAcceleratedOptimizer(AcceleratedOptimizer):
    """accelerate's optimizer wrapper over a `ZeroOptimizer` (``.optimizer``): ``step`` and
    ``zero_grad`` only when ``accelerator.sync_gradients``; any attribute the wrapper lacks is
    the ZeroOptimizer's (``opt.no_sync()``, ``opt.full_param(p)``, ``opt.comm_stats``).
    ``max_grad_norm``: the DeepSpeed config's ``gradient_clipping`` when ``zero=`` was one (to
    pass to ``accelerator.clip_grad_norm_``; None where it is 0: no clipping), else None."""

    def __init__(self, optimizer, max_grad_norm: float | None = None, ds_config: bool = False):
        # device_placement=False: accelerate's placement is state_dict -> .to -> load_state_dict,
        # a per-rank shard round trip for nothing (the state lives with the params already)
        super().__init__(optimizer, device_placement=False, scaler=None)
        self.max_grad_norm = max_grad_norm
        self.ds_config = ds_config  # prepared from a DeepSpeed config
        self.clip_due = max_grad_norm is not None  # set by each step, cleared by each clip
        self._warned = False

    def step(self, closure=None):
        if self.clip_due and self.gradient_state.sync_gradients:
            # DeepSpeed's engine clipped inside its step: a script written for it never calls
            # accelerator.clip_grad_norm_, and would otherwise train unclipped
            self.optimizer.clip_grad_norm_(self.max_grad_norm)
            if not self._warned:
                self._warned = True
                warnings.warn(
                    "zero_kernels.integrations.accelerate: optimizer.step() with no "
                    "accelerator.clip_grad_norm_ before it: clipped at the DeepSpeed config's "
                    f"gradient_clipping={self.max_grad_norm} inside the step, as DeepSpeed's "
                    "engine did. Call accelerator.clip_grad_norm_(model.parameters(), "
                    "optimizer.max_grad_norm) when accelerator.sync_gradients to clip (and see "
                    "the norm) in the script",
                    stacklevel=2,
                )
        out = super().step(closure)
        if self.max_grad_norm is not None and self.gradient_state.sync_gradients:
            self.clip_due = True
        return out

    def __getattr__(self, name):
        inner = self.__dict__.get("optimizer")
        if inner is None or name.startswith("__"):
            raise AttributeError(name)
        return getattr(inner, name)


class _NoSync:
    """``model.no_sync``, as DDP's: accelerate calls it for micro-batches. A weak reference, so
    that a copy of the model does not copy the optimizer and a closed one is not kept alive."""

    def __init__(self, optimizer):
        self._opt = weakref.ref(optimizer) if optimizer is not None else _dead

    def __call__(self):
        opt = self._opt()
        if opt is None or getattr(opt, "closed", False):
            return contextlib.nullcontext()
        return opt.no_sync()

    def __deepcopy__(self, memo):
        return self

    def __reduce__(self):  # a pickled model (torch.save(model)) gets one bound to nothing
        return (_NoSync, (None,))


def _dead():
    return None


class _Registered:
    """What `prepare` gave the accelerator, for `save_state`/`load_state`."""

    def __init__(self, model, optimizer, schedulers):
        self.model, self.optimizer, self.schedulers = model, optimizer, schedulers


def _check_accelerator(accelerator) -> None:
    """Refuse, naming the setting, what a ZeroOptimizer cannot sit under."""
    if not isinstance(accelerator, Accelerator):
        raise TypeError(f"{_WHERE}: expected an accelerate.Accelerator, got {accelerator!r}")
    dt = accelerator.distributed_type
    if dt in _REFUSED:
        raise ValueError(
            f"{_WHERE}: the Accelerator has {_REFUSED[dt]} (distributed_type={dt.value!r}); it "
            "shards the model itself and cannot run with a ZeroOptimizer. Build the "
            "Accelerator without it"
        )
    if getattr(accelerator, "parallelism_config", None) is not None:
        raise ValueError(
            f"{_WHERE}: parallelism_config={accelerator.parallelism_config!r} is set; tensor and "
            "context parallelism do not combine with a ZeroOptimizer here"
        )
    if getattr(accelerator.state, "torch_tp_plugin", None) is not None:
        raise ValueError(f"{_WHERE}: torch_tp_plugin is set; tensor parallelism is not supported")
    mp = str(accelerator.mixed_precision)
    if mp not in ("no", "bf16"):
        why = (
            "accelerate's GradScaler unscales and skips steps rank by rank on the gradients each "
            "rank holds; use mixed_precision='bf16', or fp16 params with the ZeroOptimizer's own "
            "loss_scale outside accelerate"
            if mp == "fp16"
            else "only 'no' and 'bf16' are supported"
        )
        raise ValueError(f"{_WHERE}: mixed_precision={mp!r} is not supported: {why}")
    dyn = getattr(accelerator.state, "dynamo_plugin", None)
    if dyn is not None and str(getattr(dyn, "backend", "NO")).split(".")[-1].upper() != "NO":
        raise ValueError(
            f"{_WHERE}: dynamo_backend={str(dyn.backend)!r} is set; build the Accelerator "
            "without it and call torch.compile(model) yourself (it works at every stage)"
        )
    if getattr(accelerator, "use_stateful_dataloader", False) or getattr(
        getattr(accelerator, "dataloader_config", None), "use_stateful_dataloader", False
    ):
        raise ValueError(
            f"{_WHERE}: use_stateful_dataloader=True: the data loaders' state is not saved by "
            "save_state here; skip batches with accelerator.skip_first_batches"
        )


def _same_device(a: torch.device, b: torch.device) -> bool:
    """Whether ``Tensor.to(b)`` would leave a tensor on ``a`` alone in effect: ``cpu:1`` is the
    CPU for every rank (accelerate's device at rank 1 with ``cpu=True``)."""
    if a.type != b.type:
        return False
    if a.type == "cpu" or a.index is None or b.index is None:
        return True
    return a.index == b.index


def _place(accelerator, model: nn.Module, optimizer) -> None:
    """The model on the accelerator's device, moved only where it is elsewhere (see
    [Note: accelerate without DDP])."""
    if not accelerator.device_placement:
        return
    dev = torch.device(accelerator.device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    elsewhere = [
        n
        for n, t in [*model.named_parameters(), *model.named_buffers()]
        if t.device.type != "meta" and not _same_device(t.device, dev)
    ]
    if not elsewhere:
        return
    if is_zero(optimizer):
        raise ValueError(
            f"{_WHERE}: the ZeroOptimizer given was built over params on another device than the "
            f"accelerator's {dev} ({elsewhere[0]!r}); move the model to accelerator.device before "
            "building it, or pass a plain torch optimizer"
        )
    # Module.to keeps the Parameter objects (their .data is swapped), so the torch optimizer's
    # groups still name them
    model.to(dev)


def _check_autocast(accelerator, resharded: bool) -> None:
    """bf16 autocast where params are resharded between uses (stage 3) needs its weight cache
    off (checked before anything is built)."""
    handler = accelerator.autocast_handler
    if getattr(accelerator, "native_amp", False) and resharded:
        if handler is None or handler.cache_enabled:
            raise ValueError(
                f"{_WHERE}: mixed_precision='bf16' at stage 3 needs the autocast cache off: "
                "build the Accelerator with kwargs_handlers=[AutocastKwargs(cache_enabled="
                "False)] (the bf16 weight copies it caches would outlive each unit's gather)"
            )


def _wrap_forward(accelerator, model: nn.Module) -> None:
    """autocast around the model's forward for ``mixed_precision="bf16"``, as ``prepare_model``
    does, through accelerate's own helpers."""
    if not getattr(accelerator, "native_amp", False):
        return
    ctx = get_mixed_precision_context_manager(accelerator.native_amp, accelerator.autocast_handler)
    forward = model.forward
    model._original_forward = forward
    model.forward = convert_outputs_to_fp32(ctx(forward))


def _rebind(scheduler, old, new) -> None:
    """A scheduler built over the torch optimizer ``old`` now drives ``new`` (its groups are
    ``old``'s, copied, ``initial_lr`` with them); chained/sequential schedulers' children too."""
    for child in getattr(scheduler, "_schedulers", ()) or ():
        _rebind(child, old, new)
    if getattr(scheduler, "optimizer", None) is old:
        scheduler.optimizer = new
        _mark_step(new)


def _mark_step(opt) -> None:
    """What ``LRScheduler.__init__`` does to its optimizer's ``step``: it records that the
    optimizer stepped, so the scheduler's first ``step`` does not warn about the order."""
    if hasattr(opt.step, "_wrapped_by_lr_sched"):
        return
    ref = weakref.ref(opt)  # as torch does: no reference cycle through the bound method
    func = opt.step.__func__

    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        o = ref()
        o._opt_called = True
        return func.__get__(o, type(o))(*args, **kwargs)

    wrapper._wrapped_by_lr_sched = True
    opt.step = wrapper


def prepare(accelerator, model: nn.Module, optimizer, *objects, zero=None):
    """``accelerator.prepare(model, optimizer, *objects)`` with a ZeroOptimizer and the model
    kept out of DDP; returns ``(model, optimizer, *objects)`` prepared, in that order.

    ``model``: a plain module (not DDP/FSDP); returned as it is (moved to the accelerator's
    device only if it is elsewhere). ``optimizer``: a plain torch optimizer over the model's
    params (not stepped yet), turned into a ZeroOptimizer with ``zero`` (a dict of ZeroOptimizer
    keyword arguments, e.g. ``{"stage": 3}``, or a ZeroPolicy; default stage 2), or a
    ZeroOptimizer over the model. ``objects``: data loaders and LR schedulers (built over
    ``optimizer``), prepared by accelerate. The accelerator's ``save_state``/``load_state`` become
    this module's. See [Note: accelerate without DDP].

    ``zero`` may also be the DeepSpeed config an accelerate run gave its DeepSpeed plugin (a
    path, a ``Path`` or its dict), read as accelerate reads it: with an ``optimizer`` block the
    optimizer is ``accelerate.utils.DummyOptim(params)``, with a ``scheduler`` block the objects
    hold an ``accelerate.utils.DummyScheduler`` (the block's scheduler is returned in its
    place); a torch optimizer or scheduler beside the block is a ValueError naming it. "auto"
    values come from what accelerate knows (the data loaders' batch size, the Accelerator's
    accumulation and precision, the model's ``config.hidden_size``, the DummyOptim and
    DummyScheduler); others raise naming the key. Clipping stays the script's call: the
    config's ``gradient_clipping`` is the returned optimizer's ``max_grad_norm``, to pass to
    ``accelerator.clip_grad_norm_(model.parameters(), optimizer.max_grad_norm)`` (another
    ``max_norm`` raises; a step with no clip before it clips at ``gradient_clipping``
    itself, as DeepSpeed's engine did, and warns once). See [Note: accelerate and a
    DeepSpeed config] in `zero_kernels.integrations.accelerate_ds`."""
    _check_accelerator(accelerator)
    if not isinstance(model, nn.Module):
        raise TypeError(f"{_WHERE}: model must be an nn.Module, got {type(model).__name__}")
    check_not_wrapped(model, _WHERE)
    old = getattr(accelerator, "_zero_kernels", None)
    if old is not None:
        if any(getattr(o, "optimizer", None) is old.optimizer for o in accelerator._optimizers):
            raise ValueError(
                f"{_WHERE}: this Accelerator already has a ZeroOptimizer from an earlier "
                "prepare; one model and one optimizer at a time: to train another, call "
                "accelerator.free_memory() first (it releases the earlier one)"
            )
        # accelerator.free_memory() let go of it: its hooks leave the earlier model, its
        # params are whole again (collective, as this prepare is)
        old.optimizer.close()
        accelerator._zero_kernels = None
    for i, obj in enumerate(objects):
        if isinstance(obj, (nn.Module, torch.optim.Optimizer)):
            raise TypeError(
                f"{_WHERE}: objects[{i}] is a {type(obj).__name__}; one model and one optimizer "
                "(the first two arguments), then only data loaders and schedulers"
            )
    if isinstance(optimizer, AcceleratedOptimizer):
        raise TypeError(
            f"{_WHERE}: the optimizer was prepared by accelerate already "
            f"({type(optimizer).__name__}); pass the plain torch optimizer (or a ZeroOptimizer)"
        )
    if is_zero(optimizer) and zero is not None:
        raise ValueError(
            f"{_WHERE}: zero={zero!r} given with a ready ZeroOptimizer; its options are set. "
            "Pass zero only with a plain torch optimizer"
        )
    plan = None
    if is_deepspeed_config(zero):  # [Note: accelerate and a DeepSpeed config]
        plan = plan_from_deepspeed_config(zero, accelerator, model, optimizer, objects, _WHERE)
        kwargs = {"policy": plan.policy}
    else:
        dummies = [type(o).__name__ for o in (optimizer, *objects) if _is_dummy(o)]
        if dummies:
            raise TypeError(
                f"{_WHERE}: {', '.join(dummies)} given with zero={zero!r}: accelerate's "
                "DeepSpeed placeholders need zero= a DeepSpeed config (its path or dict) with "
                "the 'optimizer'/'scheduler' blocks they stand for"
            )
        kwargs = zero_kwargs(zero, _WHERE)
    # DDP's broadcast_buffers as the accelerator would pass it to DDP
    # (DistributedDataParallelKwargs; its to_kwargs() holds only the values set)
    handler = getattr(accelerator, "ddp_handler", None)
    ddp_kw = handler.to_kwargs() if handler is not None else {}
    value, source = (
        ddp_kw.get("broadcast_buffers"),
        "DistributedDataParallelKwargs(broadcast_buffers)",
    )
    if is_zero(optimizer):  # a ready one: its choice must agree
        with_broadcast_buffers({"policy": optimizer.policy}, value, source, _WHERE)
    else:
        kwargs = with_broadcast_buffers(kwargs, value, source, _WHERE)
    shard = optimizer.policy.shard if is_zero(optimizer) else shard_of(kwargs)
    _check_autocast(accelerator, resharded=not shard.params)
    if not shard.params and not accelerator.even_batches:
        raise ValueError(
            f"{_WHERE}: Accelerator(even_batches=False) with stage 3: its data loaders give the "
            "ranks different numbers of batches, and stage 3 all-gathers the params in every "
            "forward (evaluation included), so a rank with fewer batches leaves the others "
            "waiting until the timeout. Keep even_batches=True (the default) at stage 3, or "
            "use stage 1 or 2"
        )
    if plan is not None and plan.dtype is not None:
        model.to(plan.dtype)  # as DeepSpeed's engine casts it (fp32 masters are kept)
    _place(accelerator, model, optimizer)
    if plan is not None:
        zopt = plan.build_optimizer(model, optimizer, kwargs, _WHERE)
    else:
        zopt = from_torch_optimizer(model, optimizer, kwargs, _WHERE)
    if not is_zero(optimizer) and not _is_dummy(optimizer):
        for obj in objects:
            _rebind(obj, optimizer, zopt)
    _wrap_forward(accelerator, model)
    model.no_sync = _NoSync(zopt)
    if plan is not None:
        wrapped = ZeroAcceleratedOptimizer(zopt, plan.max_grad_norm, ds_config=True)
    else:
        wrapped = ZeroAcceleratedOptimizer(zopt)
    wrapped._is_accelerate_prepared = True
    accelerator._optimizers.append(wrapped)
    if model not in accelerator._models:
        accelerator._models.append(model)
    at = plan.scheduler_at if plan is not None else None
    rest = [o for i, o in enumerate(objects) if i != at]
    prepared = accelerator.prepare(*rest) if rest else ()
    prepared = [prepared] if len(rest) == 1 else list(prepared)  # one object: not a tuple
    if at is not None:
        # the config's (or the DummyScheduler's callable's) scheduler, stepped once per
        # optimizer step as DeepSpeed's engine steps it (split_batches=True: not once per rank)
        sched = AcceleratedScheduler(
            plan.make_scheduler(zopt), wrapped, step_with_optimizer=True, split_batches=True
        )
        sched._is_accelerate_prepared = True
        accelerator._schedulers.append(sched)
        prepared.insert(at, sched)
    schedulers = [o for o in prepared if hasattr(o, "scheduler") and hasattr(o, "optimizers")]
    accelerator._zero_kernels = _Registered(model, zopt, schedulers)
    accelerator.save_state = functools.partial(save_state, accelerator)
    accelerator.load_state = functools.partial(load_state, accelerator)
    for name in ("clip_grad_norm_", "clip_grad_value_"):
        setattr(accelerator, name, _clip_at_sync(accelerator, getattr(accelerator, name), name))
    return (model, wrapped, *prepared)


def _is_dummy(obj) -> bool:
    return isinstance(obj, (DummyOptim, DummyScheduler))


def _clip_at_sync(accelerator, clip, name: str):
    """``accelerator.clip_grad_norm_``/``clip_grad_value_`` on a micro-batch that does not end an
    accumulation window (``accelerator.sync_gradients`` False) is an error: there DDP clips each
    rank's own partial gradient, which a ZeroOptimizer does not hold (stage 1 keeps no ``.grad``
    until the window ends, so torch's clip saw nothing and returned 0; stages 2-3 hold the
    average over the ranks so far). Measured before this check, clipping every micro-batch of a
    window of 2: weights 13.9% (stage 1) and 0.58% (stages 2-3) from DDP's, with no error."""

    @functools.wraps(clip)
    def guarded(*args, **kwargs):
        if not accelerator.sync_gradients:
            raise RuntimeError(
                f"accelerator.{name} on a micro-batch that does not end an accumulation window "
                "(accelerator.sync_gradients is False): a ZeroOptimizer holds no per-rank "
                "partial gradient to clip there, as DDP's would. Clip once per optimizer step: "
                f"`if accelerator.sync_gradients: accelerator.{name}(...)`"
            )
        reg = getattr(accelerator, "_zero_kernels", None)
        opt = None
        if reg is not None:
            opt = next((o for o in accelerator._optimizers if o.optimizer is reg.optimizer), None)
        if name == "clip_grad_norm_" and opt is not None and opt.ds_config:
            max_norm = kwargs.get("max_norm", args[1] if len(args) > 1 else None)
            want = opt.max_grad_norm
            ok = max_norm is not None and (
                float(max_norm) == want if want is not None else math.isinf(float(max_norm))
            )
            if not ok:
                config = f"{want}" if want is not None else "0 (no clipping)"
                alone = "" if want is not None else "; max_norm=float('inf') gives the norm alone"
                raise ValueError(
                    f"accelerator.clip_grad_norm_(max_norm={max_norm!r}) and the DeepSpeed "
                    f"config's gradient_clipping={config} differ (DeepSpeed clipped at the "
                    "config's value and ignored max_norm): pass optimizer.max_grad_norm, or "
                    f"change gradient_clipping{alone}"
                )
            opt.clip_due = False
        return clip(*args, **kwargs)

    return guarded


def _registered(accelerator, where: str) -> _Registered:
    reg = getattr(accelerator, "_zero_kernels", None)
    if reg is None:
        raise ValueError(
            f"{where}: this Accelerator was not given a ZeroOptimizer through "
            "zero_kernels.integrations.accelerate.prepare"
        )
    return reg


def _directory(accelerator, path, name: str, where: str) -> str:
    if path is not None:
        return os.fspath(path)
    if accelerator.project_dir:
        return os.path.join(accelerator.project_dir, "checkpoints")
    raise ValueError(f"{where}: {name}=None and the Accelerator has no project_dir; pass {name}")


def _check_kwargs(kwargs: dict, where: str) -> None:
    kwargs = {k: v for k, v in kwargs.items() if not (k == "safe_serialization" and v)}
    if kwargs:
        raise TypeError(
            f"{where}: {', '.join(f'{k}={v!r}' for k, v in kwargs.items())} not supported: the "
            "checkpoint is zero_kernels' (safetensors, one file per rank)"
        )


def save_state(accelerator, output_dir=None, *, extra: dict | None = None, keep_last=None, **kw):
    """``accelerator.save_state`` for a ZeroOptimizer: a new checkpoint under ``output_dir``
    (default ``project_dir/checkpoints``) through `zero_kernels.save_checkpoint`, with
    accelerate's step counter, extra schedulers and registered objects, and ``extra`` (JSON
    values; ``extra["step"]`` names the checkpoint). Collective: every rank calls it. Returns the
    checkpoint's directory. See [Note: accelerate checkpoints]."""
    from ..checkpoint import save_checkpoint

    where = "zero_kernels.integrations.accelerate.save_state"
    _check_kwargs(kw, where)
    reg = _registered(accelerator, where)
    extra = dict(extra or {})
    if _KEY in extra:
        raise ValueError(f"{where}: extra={{{_KEY!r}: ...}} is this module's own key")
    if keep_last is None:
        keep_last = getattr(accelerator.project_configuration, "total_limit", None)
    scheds = [s.scheduler for s in reg.schedulers]
    extra[_KEY] = {
        "step": int(accelerator.step),
        "schedulers": [s.state_dict() for s in scheds[1:]],
        "custom": [o.state_dict() for o in accelerator._custom_objects],
    }
    path = _directory(accelerator, output_dir, "output_dir", where)
    return save_checkpoint(
        path,
        reg.model,
        reg.optimizer,
        scheduler=scheds[0] if scheds else None,
        extra=extra,
        keep_last=keep_last,
    )


def load_state(accelerator, input_dir=None, **kw) -> dict:
    """``accelerator.load_state`` for a ZeroOptimizer: the latest complete checkpoint under
    ``input_dir`` (or the one it names) through `zero_kernels.load_checkpoint`, at any world size
    and stage, and accelerate's step counter, schedulers and registered objects. Collective.
    Returns the ``extra`` given to `save_state`."""
    from ..checkpoint import load_checkpoint

    where = "zero_kernels.integrations.accelerate.load_state"
    kw.pop("load_kwargs", None)
    _check_kwargs({k: v for k, v in kw.items() if k != "strict"}, where)
    reg = _registered(accelerator, where)
    scheds = [s.scheduler for s in reg.schedulers]
    path = _directory(accelerator, input_dir, "input_dir", where)
    extra = load_checkpoint(path, reg.model, reg.optimizer, scheduler=scheds[0] if scheds else None)
    mine = extra.pop(_KEY, None) or {}
    if len(mine.get("schedulers", [])) != max(len(scheds) - 1, 0):
        raise ValueError(
            f"{where}: the checkpoint holds {len(mine.get('schedulers', [])) + 1} schedulers, "
            f"the Accelerator {len(scheds)}"
        )
    for s, state in zip(scheds[1:], mine.get("schedulers", []), strict=True):
        s.load_state_dict(state)
    custom = mine.get("custom", [])
    if len(custom) != len(accelerator._custom_objects):
        raise ValueError(
            f"{where}: the checkpoint holds {len(custom)} objects registered for checkpointing, "
            f"the Accelerator {len(accelerator._custom_objects)}"
        )
    for o, state in zip(accelerator._custom_objects, custom, strict=True):
        o.load_state_dict(state)
    if "step" in mine:
        accelerator.step = int(mine["step"])
    return extra
