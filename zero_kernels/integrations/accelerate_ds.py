"""A DeepSpeed config given to `zero_kernels.integrations.accelerate.prepare` as ``zero=``: the
file an accelerate run passed to its DeepSpeed plugin (``DeepSpeedPlugin(hf_ds_config=...)``,
``accelerate launch --deepspeed_config_file``), read the way accelerate reads it.

[Note: accelerate and a DeepSpeed config]
``zka.prepare(accelerator, model, optimizer, *objects, zero="ds_config.json")`` (a path, a
``Path`` or the config's dict) builds what accelerate's ``_prepare_deepspeed`` builds, with a
`ZeroOptimizer` in place of DeepSpeed's engine:

- **Optimizer and scheduler: one source each**, accelerate's rule. A config with an
  ``optimizer`` block takes ``accelerate.utils.DummyOptim(params, lr=, weight_decay=)`` as the
  optimizer (its params or param groups; the block says the class and hyper-parameters); a
  torch optimizer with the block, or a DummyOptim without it, is a ValueError naming the block.
  A ``scheduler`` block takes an ``accelerate.utils.DummyScheduler(optimizer, ...)`` among the
  objects, and the scheduler built from the block (DeepSpeed's formula, as
  `zero_kernels.integrations.ds_config` maps it) is returned in its place; a torch scheduler
  with the block, or the block with no DummyScheduler (DeepSpeed's engine stepped it; here the
  script does), is an error, and so is a DummyScheduler with neither the block nor
  ``lr_scheduler_callable`` (then ``lr_scheduler_callable(optimizer)`` is the scheduler).
  Either scheduler steps once per optimizer step, as DeepSpeed's engine steps it (not
  ``num_processes`` times, as accelerate steps a torch scheduler). accelerate exports the two
  placeholders from ``accelerate.utils`` only where DeepSpeed is installed; without it they are
  ``accelerate.utils.deepspeed.DummyOptim``/``DummyScheduler`` (the same classes).
- **"auto"** is resolved from what accelerate knows, as its ``_prepare_deepspeed`` does:
  ``train_micro_batch_size_per_gpu`` from the data loaders given (the smallest batch size;
  divided by ``num_processes`` with ``split_batches``), ``gradient_accumulation_steps`` from
  the Accelerator, ``train_batch_size`` = micro x accumulation x processes,
  ``gradient_clipping`` 1.0, ``bf16.enabled`` from ``mixed_precision``, ``fp16.enabled``
  false, the bucket sizes from the model's ``config.hidden_size`` (h*h, 0.9*h*h, 10*h),
  ``optimizer.params.lr``/``weight_decay`` from the DummyOptim, and for a DummyScheduler
  without a callable ``scheduler.params.warmup_min_lr`` 0, ``warmup_max_lr`` the DummyOptim's
  lr, ``warmup_num_steps`` max(1, its ``warmup_num_steps``) and ``total_num_steps`` its
  ``total_num_steps`` / ``num_processes`` (rounded up; whole with ``split_batches``). Any other
  "auto" (``optimizer.params.betas``, a key whose source was not given) is a ValueError naming
  the key, as accelerate raises. A value given in the config wins over the DummyOptim's, as in
  accelerate.
- **Values the Accelerator owns must agree** (as ZeroTrainer requires of TrainingArguments):
  ``gradient_accumulation_steps`` (absent: DeepSpeed's 1) must equal the Accelerator's, and
  ``train_batch_size`` must be micro x accumulation x processes (DeepSpeed refuses it too);
  ``bf16.enabled: false`` with ``mixed_precision="bf16"`` is refused. accelerate's plugin adds
  ``bf16.enabled`` under ``mixed_precision="bf16"`` when the config has no ``bf16`` block, and
  DeepSpeed then trains bf16 params with fp32 masters: so does this (the model is cast, as with
  ``bf16.enabled: true``). ``fp16`` is refused: ``accelerator.backward`` does not scale the loss
  for a ZeroOptimizer. These are listed with the config's other refused keys in one
  NotImplementedError (`DeepSpeedMapping.check`).
- **Clipping is the script's call**, as in any accelerate script: the config's
  ``gradient_clipping`` (DeepSpeed's 1.0 when absent, none when 0) is the returned optimizer's
  ``max_grad_norm``; call ``accelerator.clip_grad_norm_(model.parameters(),
  optimizer.max_grad_norm)`` when ``accelerator.sync_gradients``. DeepSpeed's engine clipped
  inside its step and ignored ``max_norm``; here ``accelerator.clip_grad_norm_`` with another
  ``max_norm`` is a ValueError naming ``gradient_clipping`` (with ``gradient_clipping: 0``
  only ``max_norm=float("inf")``, the norm alone); a step taken with no clip before it clips
  at ``gradient_clipping`` itself, as DeepSpeed's engine did (a script written for DeepSpeed
  trains as it did there), and warns once.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from accelerate.utils.deepspeed import DummyOptim, DummyScheduler
from torch.optim.lr_scheduler import LRScheduler

from ..policy import ZeroPolicy
from .common import from_torch_optimizer
from .ds_config import DeepSpeedMapping, auto_keys, map_deepspeed_config, read_deepspeed_config

__all__ = ["DeepSpeedPlan", "plan_from_deepspeed_config", "resolve_deepspeed_config"]

_HIDDEN = (
    ("zero_optimization.reduce_bucket_size", lambda h: h * h),
    ("zero_optimization.stage3_prefetch_bucket_size", lambda h: int(0.9 * h * h)),
    ("zero_optimization.stage3_param_persistence_threshold", lambda h: 10 * h),
)


def _node(cfg: dict, dotted: str):
    """The dict holding ``dotted``'s last part, and that part (None where a level is absent)."""
    *path, last = dotted.split(".")
    d = cfg
    for p in path:
        d = d.get(p) if isinstance(d, dict) else None
    return (d if isinstance(d, dict) else None), last


def _get(cfg: dict, dotted: str, default=None):
    d, k = _node(cfg, dotted)
    return default if d is None else d.get(k, default)


def _fill(cfg: dict, dotted: str, value) -> None:
    d, k = _node(cfg, dotted)
    if d is not None and d.get(k) == "auto" and value is not None:
        d[k] = value


def _hidden_size(model) -> int | None:
    cfg = getattr(model, "config", None)
    if cfg is None:
        return None
    if getattr(cfg, "hidden_size", None) is not None:
        return int(cfg.hidden_size)
    if getattr(cfg, "hidden_sizes", None):
        return int(max(cfg.hidden_sizes))
    return None


def _dummy_schedulers(objects) -> list[int]:
    return [i for i, o in enumerate(objects) if isinstance(o, DummyScheduler)]


def resolve_deepspeed_config(
    config, accelerator, *, model=None, optimizer=None, objects=(), where: str = "zero="
) -> dict:
    """DeepSpeed config ``config`` (a path or a dict) with its ``"auto"`` values resolved from
    ``accelerator``, ``model``, ``optimizer`` (a DummyOptim) and ``objects`` (the data loaders
    and a DummyScheduler given to prepare), as accelerate resolves them; a value it cannot
    resolve is a ValueError naming the key ([Note: accelerate and a DeepSpeed config])."""
    cfg = read_deepspeed_config(config)
    n = int(accelerator.num_processes)
    split = bool(getattr(accelerator, "split_batches", False))
    why: dict[str, str] = {}
    # batch sizes: the data loaders', the Accelerator's accumulation
    sizes = [getattr(o, "batch_size", None) for o in objects if hasattr(o, "batch_size")]
    if _get(cfg, "train_micro_batch_size_per_gpu") == "auto":
        if sizes and all(isinstance(s, int) for s in sizes):
            micro = min(sizes) // n if split else min(sizes)
            _fill(cfg, "train_micro_batch_size_per_gpu", micro)
        else:
            why["train_micro_batch_size_per_gpu"] = (
                "no data loader with an integer batch_size was given to prepare"
            )
    _fill(cfg, "gradient_accumulation_steps", int(accelerator.gradient_accumulation_steps))
    micro, accum = cfg.get("train_micro_batch_size_per_gpu"), cfg.get("gradient_accumulation_steps")
    if isinstance(micro, int) and isinstance(accum, int):
        _fill(cfg, "train_batch_size", micro * accum * n)
    else:
        why["train_batch_size"] = "train_micro_batch_size_per_gpu is not known"
    _fill(cfg, "gradient_clipping", 1.0)
    _fill(cfg, "zero_optimization.stage3_gather_16bit_weights_on_model_save", False)
    # precision: the Accelerator's (accelerate's plugin adds a bf16 block under bf16)
    mp = str(accelerator.mixed_precision)
    if mp == "bf16" and "bf16" not in cfg and "bfloat16" not in cfg:
        cfg["bf16"] = {"enabled": True}
    _fill(cfg, "bf16.enabled", mp == "bf16")
    _fill(cfg, "bfloat16.enabled", mp == "bf16")
    _fill(cfg, "fp16.enabled", False)
    # the model's hidden size
    autos = [k for k, _ in _HIDDEN if _get(cfg, k) == "auto"]
    if autos:
        h = _hidden_size(model)
        for k, f in _HIDDEN:
            if h is not None:
                _fill(cfg, k, f(h))
            else:
                why[k] = "the model has no config.hidden_size (or hidden_sizes)"
    # the DummyOptim's lr and weight decay; the DummyScheduler's steps
    dummy = optimizer if isinstance(optimizer, DummyOptim) else None
    for k in ("lr", "weight_decay"):
        if dummy is not None:
            _fill(cfg, f"optimizer.params.{k}", getattr(dummy, k))
        else:
            why[f"optimizer.params.{k}"] = "no accelerate.utils.DummyOptim was given"
    at = _dummy_schedulers(objects)
    sched = objects[at[0]] if at else None
    if sched is not None and sched.lr_scheduler_callable is None:
        inner = sched.optimizer
        defaults = getattr(inner, "defaults", None)
        max_lr = getattr(inner, "lr", None) if defaults is None else defaults.get("lr")
        _fill(cfg, "scheduler.params.warmup_min_lr", 0)
        _fill(cfg, "scheduler.params.warmup_max_lr", max_lr)
        _fill(cfg, "scheduler.params.warmup_num_steps", max(1, int(sched.warmup_num_steps)))
        if sched.total_num_steps is not None:
            total = int(sched.total_num_steps)
            _fill(cfg, "scheduler.params.total_num_steps", total if split else math.ceil(total / n))
        else:
            why["scheduler.params.total_num_steps"] = "DummyScheduler(total_num_steps=None)"
    else:
        for k in ("warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "total_num_steps"):
            why[f"scheduler.params.{k}"] = "no accelerate.utils.DummyScheduler was given"
    left = auto_keys(cfg)
    if left:
        body = "\n".join(
            f"  {k}: {why.get(k, 'accelerate does not resolve it either')}" for k in left
        )
        raise ValueError(
            f"{where}: the DeepSpeed config has 'auto' values that cannot be resolved here "
            f"(set them in the config):\n{body}"
        )
    return cfg


@dataclass
class DeepSpeedPlan:
    """What a DeepSpeed config makes of one `prepare` call: the mapping, the policy, the
    model's dtype, the optimizer to build, the scheduler to put at ``scheduler_at`` among the
    objects, and the clipping norm the script passes to ``accelerator.clip_grad_norm_``."""

    mapping: DeepSpeedMapping
    config: dict  # "auto" resolved
    dummy: DummyOptim | None
    scheduler_at: int | None
    make_scheduler: Callable | None  # ZeroOptimizer -> LRScheduler
    max_grad_norm: float | None

    @property
    def policy(self) -> ZeroPolicy:
        return self.mapping.policy()

    @property
    def dtype(self) -> torch.dtype | None:
        return self.mapping.dtype

    def build_optimizer(self, model, optimizer, kwargs: dict, where: str):
        """The ZeroOptimizer: the config's class over the DummyOptim's params or groups, or the
        torch optimizer given, turned into one (`from_torch_optimizer`)."""
        if self.dummy is None:
            return from_torch_optimizer(model, optimizer, kwargs, where)
        from ..optimizer import ZeroOptimizer

        params = list(self.dummy.params)
        if params and all(isinstance(g, dict) for g in params):
            groups = [dict(g) for g in params]
            for g in groups:
                g["params"] = list(g["params"])
        else:
            groups = [{"params": params}]
        m = self.mapping
        kw = {**m.optimizer_kwargs, **kwargs}
        return ZeroOptimizer(groups, m.optimizer_class, module=model, **kw)


def _check_sources(cfg: dict, optimizer, objects, where: str) -> tuple[int | None, Callable | None]:
    """accelerate's rule: the optimizer and the scheduler come from the config or from the
    code, not both; returns the DummyScheduler's place and its callable (if it brings one)."""
    opt_type = _get(cfg, "optimizer.type")
    sched_type = _get(cfg, "scheduler.type")
    dummy = isinstance(optimizer, DummyOptim)
    if "optimizer" in cfg and not dummy:
        raise ValueError(
            f"{where}: the DeepSpeed config has an 'optimizer' block (type {opt_type!r}) and a "
            f"{type(optimizer).__name__} was given too; one source, as accelerate's DeepSpeed "
            "plugin requires: pass accelerate.utils.DummyOptim(model.parameters()) as the "
            "optimizer, or remove the 'optimizer' block"
        )
    if dummy and "optimizer" not in cfg:
        raise ValueError(
            f"{where}: an accelerate.utils.DummyOptim was given and the DeepSpeed config has no "
            "'optimizer' block to build it from; add the block, or pass a torch optimizer"
        )
    torch_scheds = [i for i, o in enumerate(objects) if isinstance(o, LRScheduler)]
    at = _dummy_schedulers(objects)
    if len(at) > 1:
        raise ValueError(f"{where}: objects{at} are DummySchedulers; one scheduler at most")
    if "scheduler" in cfg and torch_scheds:
        i = torch_scheds[0]
        raise ValueError(
            f"{where}: the DeepSpeed config has a 'scheduler' block (type {sched_type!r}) and "
            f"objects[{i}] is a {type(objects[i]).__name__} too; one source, as accelerate's "
            "DeepSpeed plugin requires: pass accelerate.utils.DummyScheduler(optimizer) "
            "instead, or remove the 'scheduler' block"
        )
    if dummy and torch_scheds:
        i = torch_scheds[0]
        raise ValueError(
            f"{where}: objects[{i}] is a {type(objects[i]).__name__} with a DummyOptim as the "
            "optimizer; with a DummyOptim the scheduler is an accelerate.utils.DummyScheduler "
            "(accelerate's rule)"
        )
    if not at:
        if "scheduler" in cfg:
            raise ValueError(
                f"{where}: the DeepSpeed config has a 'scheduler' block (type {sched_type!r}) "
                "and no accelerate.utils.DummyScheduler was given: DeepSpeed's engine stepped "
                "it; here the script does. Pass DummyScheduler(optimizer) among the objects "
                "(prepare returns the scheduler in its place), or remove the block"
            )
        return None, None
    call = objects[at[0]].lr_scheduler_callable
    if "scheduler" in cfg and call is not None:
        raise ValueError(
            f"{where}: the DeepSpeed config has a 'scheduler' block (type {sched_type!r}) and "
            "the DummyScheduler has an lr_scheduler_callable; DeepSpeed would use the block "
            "and ignore the callable: give one of them"
        )
    if "scheduler" not in cfg and call is None:
        raise ValueError(
            f"{where}: objects[{at[0]}] is a DummyScheduler with no lr_scheduler_callable and "
            "the DeepSpeed config has no 'scheduler' block; give one of them"
        )
    return at[0], call


def plan_from_deepspeed_config(
    config, accelerator, model, optimizer, objects, where: str
) -> DeepSpeedPlan:
    """The `DeepSpeedPlan` of ``zero=config`` for ``prepare(accelerator, model, optimizer,
    *objects)``; raises before anything is built ([Note: accelerate and a DeepSpeed config])."""
    raw = read_deepspeed_config(config)
    at, call = _check_sources(raw, optimizer, objects, where)
    cfg = resolve_deepspeed_config(
        raw, accelerator, model=model, optimizer=optimizer, objects=objects, where=where
    )
    m = map_deepspeed_config(cfg)
    accum = cfg.get("gradient_accumulation_steps", 1)
    if accum != accelerator.gradient_accumulation_steps:
        m.add(
            "gradient_accumulation_steps",
            cfg.get("gradient_accumulation_steps", "(absent: 1)"),
            "refused",
            f"the Accelerator's gradient_accumulation_steps is "
            f"{accelerator.gradient_accumulation_steps} (set it to 'auto', or make them agree)",
        )
    micro, total = cfg.get("train_micro_batch_size_per_gpu"), cfg.get("train_batch_size")
    n = int(accelerator.num_processes)
    if isinstance(micro, int) and isinstance(total, int) and isinstance(accum, int):
        if total != micro * accum * n:
            m.add(
                "train_batch_size",
                total,
                "refused",
                f"not train_micro_batch_size_per_gpu x gradient_accumulation_steps x processes "
                f"= {micro} x {accum} x {n} (DeepSpeed refuses it too)",
            )
    mp = str(accelerator.mixed_precision)
    bf16 = _get(cfg, "bf16.enabled", _get(cfg, "bfloat16.enabled"))
    if mp == "bf16" and bf16 is False:
        m.add("bf16.enabled", False, "refused",
              "Accelerator(mixed_precision='bf16'): DeepSpeed would train in fp32 here while "
              "accelerate autocasts; make them agree")  # fmt: skip
    if _get(cfg, "fp16.enabled") is True:
        m.add("fp16.enabled", True, "refused",
              "accelerator.backward does not scale a ZeroOptimizer's loss: use bf16")  # fmt: skip
    # the caller's line "no optimizer block: pass your optimizer class" is the torch optimizer
    m.lines = [ln for ln in m.lines if not (ln.kind == "caller" and ln.key == "optimizer")]
    m.check()
    if "scheduler" in raw:
        make = m.scheduler
    elif call is not None:
        make = call
    else:
        make = None
    return DeepSpeedPlan(
        mapping=m,
        config=cfg,
        dummy=optimizer if isinstance(optimizer, DummyOptim) else None,
        scheduler_at=at,
        make_scheduler=make,
        max_grad_norm=m.clip_grad_norm,
    )
