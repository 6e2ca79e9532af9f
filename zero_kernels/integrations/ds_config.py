"""DeepSpeed's ``ds_config.json`` read as zero_kernels' policies and torch's classes.

[Note: DeepSpeed config]
`map_deepspeed_config` turns a DeepSpeed config (a path or a dict) into a `DeepSpeedMapping`
without a process group: the `ZeroPolicy` options, the torch optimizer class and its
hyper-parameters, an LR scheduler factory, the gradient-clipping norm and the model's dtype. Every
key of the config lands in one `Line` of one kind:

    mapped    becomes one of ours (``zero_optimization.reduce_bucket_size`` -> ``bucket_size_mb``)
    caller    a value the training loop uses (batch sizes, ``gradient_clipping`` -> the max norm
              to pass to ``opt.clip_grad_norm_``): returned, not applied
    same      what zero_kernels does anyway (``contiguous_gradients: true``)
    speed     tunes speed or memory only, ours decides it differently: a warning
    differs   ours would train differently (``fp16.hysteresis: 2``): an error, a warning with
              ``allow_differences=True``
    refused   not supported (``optimizer.type: "Lamb"``, an unknown key): always an error

`DeepSpeedMapping.check` raises ONE error listing every ``differs``/``refused`` line; the
``speed`` lines are one warning. ``zero-kernels config explain ds_config.json`` prints the lines.

``"auto"`` values are resolved as transformers' ``HfTrainerDeepSpeedConfig`` resolves them:
from the ``TrainingArguments`` given as ``hf_args`` (or their defaults: lr 5e-5, betas
(0.9, 0.999), eps 1e-8, weight decay 0, max_grad_norm 1.0), ``num_training_steps`` for
``scheduler.params.total_num_steps``, the warmup steps of the arguments (at least 1) for
``warmup_num_steps``, ``warmup_min_lr`` 0, and the model's ``config.hidden_size`` (h) for the
bucket sizes: ``reduce_bucket_size`` h*h, ``stage3_prefetch_bucket_size`` 0.9*h*h,
``stage3_param_persistence_threshold`` 10*h.

Behaviour kept from DeepSpeed: optimizer type ``Adam`` is AdamW (decoupled weight decay) unless
``adam_w_mode`` is false, as DeepSpeed's engine builds it; ``bf16``/``fp16`` cast the model
(as its engine does) and keep fp32 masters; its schedulers set absolute learning rates, one
step late (the first two optimizer steps both use the warmup's start), reproduced exactly by
`torch.optim.lr_scheduler.LambdaLR` over base lr ``warmup_max_lr`` (WarmupLR, WarmupDecayLR)
or the optimizer's lr (WarmupCosineLR), with the formulas of DeepSpeed's scheduler docs
(deepspeed.readthedocs.io, "Learning Rate Schedulers"): t = the scheduler's iteration,
W = max(2, warmup_num_steps), g(t) = log(t + 1) / log(W) ("log") or t / W ("linear") while
t < W, then

    WarmupLR        lr = min_lr + (max_lr - min_lr) * g(t), g = 1 after warmup
    WarmupDecayLR   after warmup g = max(0, (T - t) / max(1, T - W)), T = total_num_steps
    WarmupCosineLR  lr = lr0 * r, r = min_ratio + (1 - min_ratio) * g(t) during warmup, then
                    r = max(0, c + (1 - c) * (1 + cos(pi * q)) / 2), c = cos_min_ratio,
                    q = min(1, (t - W + 1) / max(1, T - W))
"""

from __future__ import annotations

import copy
import json
import os
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from ..policy import ZeroPolicy
from .ds_keys import KEYS

__all__ = [
    "DeepSpeedMapping",
    "DeepSpeedRun",
    "Line",
    "auto_keys",
    "build_from_deepspeed_config",
    "is_deepspeed_config",
    "map_deepspeed_config",
    "read_deepspeed_config",
    "zero_for_trainer",
]

KINDS = ("mapped", "caller", "same", "speed", "differs", "refused")


def _user_level() -> int:
    """``warnings.warn``'s stacklevel that names the first caller outside zero_kernels (the
    user's line, whichever entry point read the config: from_deepspeed_config, ZeroTrainer,
    accelerate's prepare), for a ``warn`` in the function that calls this one."""
    pkg = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
    f, level = sys._getframe(2), 2  # the caller of the function that warns
    while f is not None and os.path.abspath(f.f_code.co_filename).startswith(pkg):
        f, level = f.f_back, level + 1
    return level


@dataclass(frozen=True)
class Line:
    """One key of the config: ``key`` (dotted), its ``value``, the ``kind`` (see [Note:
    DeepSpeed config]) and what it ``becomes`` here (or why not)."""

    key: str
    value: Any
    kind: str
    becomes: str


@dataclass
class DeepSpeedMapping:
    """What a DeepSpeed config means here (see [Note: DeepSpeed config])."""

    stage: int = 2
    options: dict = field(default_factory=dict)  # ZeroPolicy.resolve's, besides stage
    optimizer_class: type | None = None
    optimizer_kwargs: dict = field(default_factory=dict)
    scheduler: Callable | None = None  # optimizer -> LambdaLR
    clip_grad_norm: float | None = None
    dtype: torch.dtype | None = None  # the model's params (bf16/fp16 enabled)
    scaler: dict = field(default_factory=dict)  # {"loss_scale": 2**p, "growth_interval": w}
    batch: dict = field(default_factory=dict)  # the loop's batch sizes and accumulation
    lines: list[Line] = field(default_factory=list)
    allow_differences: bool = False

    def add(self, key: str, value, kind: str, becomes: str) -> None:
        assert kind in KINDS, kind
        self.lines.append(Line(key, value, kind, becomes))

    @property
    def refused(self) -> list[Line]:
        bad = ("refused",) if self.allow_differences else ("refused", "differs")
        return [ln for ln in self.lines if ln.kind in bad]

    @property
    def warnings(self) -> list[Line]:
        soft = ("speed", "differs") if self.allow_differences else ("speed",)
        return [ln for ln in self.lines if ln.kind in soft]

    def policy(self) -> ZeroPolicy:
        return ZeroPolicy.resolve(stage=self.stage, **self.options)

    def check(self) -> None:
        """Raise one NotImplementedError listing every refused key (and every one that would
        train differently, unless allowed); warn once for the keys that only tune speed."""
        bad = self.refused
        if bad:
            body = "\n".join(f"  {ln.key}={ln.value!r}: {ln.becomes}" for ln in bad)
            hint = (
                ""
                if self.allow_differences or all(ln.kind == "refused" for ln in bad)
                else "\n(allow_differences=True accepts the keys that train differently)"
            )
            raise NotImplementedError(
                f"DeepSpeed config: {len(bad)} key(s) not supported or treated differently "
                f"here:\n{body}{hint}"
            )
        soft = self.warnings
        if soft:
            warnings.warn(
                "DeepSpeed config: keys that tune speed or memory only, decided here by "
                "zero_kernels: "
                + "; ".join(f"{ln.key}={ln.value!r} ({ln.becomes})" for ln in soft),
                stacklevel=_user_level(),
            )

    def explain(self) -> str:
        """The mapping key by key, as ``zero-kernels config explain`` prints it."""
        width = max([len(ln.key) for ln in self.lines] + [10])
        out = []
        for ln in self.lines:
            v = json.dumps(ln.value) if _jsonable(ln.value) else repr(ln.value)
            out.append(f"{ln.kind:8s} {ln.key:{width}s} = {v:12s} -> {ln.becomes}")
        if self.optimizer_class is not None:
            kw = ", ".join(f"{k}={v!r}" for k, v in self.optimizer_kwargs.items())
            out.append(f"=> ZeroOptimizer(model, {self.optimizer_class.__qualname__}, {kw},")
        else:
            out.append("=> ZeroOptimizer(model, <your optimizer class>,")
        opts = ", ".join(f"{k}={v!r}" for k, v in self.options.items())
        sep = ", " if opts else ""
        out.append(f"     policy=ZeroPolicy.resolve(stage={self.stage}{sep}{opts}))")
        n_bad, n_warn = len(self.refused), len(self.warnings)
        out.append(
            f"{n_bad} key(s) refused, {n_warn} warning(s)"
            + (": from_deepspeed_config raises on it" if n_bad else "")
        )
        return "\n".join(out)


def _jsonable(v) -> bool:
    try:
        json.dumps(v)
        return True
    except (TypeError, ValueError):
        return False


# ---------------------------------------------------------------------------- "auto"
_HF_DEFAULTS = {
    "learning_rate": 5e-5,
    "adam_beta1": 0.9,
    "adam_beta2": 0.999,
    "adam_epsilon": 1e-8,
    "weight_decay": 0.0,
    "max_grad_norm": 1.0,
    "per_device_train_batch_size": 8,
    "gradient_accumulation_steps": 1,
    "warmup_steps": 0,
    "fp16": False,
    "bf16": False,
}


def _hf(hf_args, name: str):
    if hf_args is None:
        return _HF_DEFAULTS[name]
    if isinstance(hf_args, dict):
        return hf_args.get(name, _HF_DEFAULTS[name])
    return getattr(hf_args, name, _HF_DEFAULTS[name])


def _hidden_size(model) -> int | None:
    cfg = getattr(model, "config", None)
    for c in (cfg, getattr(cfg, "text_config", None)):
        if c is None:
            continue
        if getattr(c, "hidden_size", None) is not None:
            return int(c.hidden_size)
        if getattr(c, "hidden_sizes", None):
            return int(max(c.hidden_sizes))
    return None


def _resolve_auto(cfg: dict, m: DeepSpeedMapping, model, hf_args, num_training_steps) -> None:
    """Replace ``"auto"`` values in ``cfg`` in place, as HfTrainerDeepSpeedConfig does; one
    that cannot be resolved stays "auto" and is refused where it is read."""

    def node(dotted: str):
        *path, last = dotted.split(".")
        d = cfg
        for p in path:
            d = d.get(p) if isinstance(d, dict) else None
            if d is None:
                return None, last
        return (d, last) if isinstance(d, dict) else (None, last)

    def fill(dotted: str, value) -> None:
        d, k = node(dotted)
        if d is not None and d.get(k) == "auto" and value is not None:
            d[k] = value

    world = int(os.environ.get("WORLD_SIZE", "1"))
    micro = _hf(hf_args, "per_device_train_batch_size")
    accum = _hf(hf_args, "gradient_accumulation_steps")
    fill("train_micro_batch_size_per_gpu", micro)
    fill("gradient_accumulation_steps", accum)
    fill("train_batch_size", world * micro * accum)
    fill("gradient_clipping", _hf(hf_args, "max_grad_norm"))
    lr = _hf(hf_args, "learning_rate")
    fill("optimizer.params.lr", lr)
    fill("optimizer.params.betas", [_hf(hf_args, "adam_beta1"), _hf(hf_args, "adam_beta2")])
    fill("optimizer.params.eps", _hf(hf_args, "adam_epsilon"))
    fill("optimizer.params.weight_decay", _hf(hf_args, "weight_decay"))
    fill("scheduler.params.warmup_min_lr", 0)
    fill("scheduler.params.warmup_max_lr", lr)
    fill("fp16.enabled", bool(_hf(hf_args, "fp16")))
    fill("bf16.enabled", bool(_hf(hf_args, "bf16")))
    fill("scheduler.params.total_num_steps", num_training_steps)
    if num_training_steps is not None:
        warm = _hf(hf_args, "warmup_steps")
        get = getattr(hf_args, "get_warmup_steps", None)
        if callable(get):
            warm = get(num_training_steps)
        fill("scheduler.params.warmup_num_steps", max(1, int(warm)))
    h = _hidden_size(model) if model is not None else None
    if h is not None:
        fill("zero_optimization.reduce_bucket_size", h * h)
        fill("zero_optimization.stage3_prefetch_bucket_size", int(0.9 * h * h))
        fill("zero_optimization.stage3_param_persistence_threshold", 10 * h)


# ---------------------------------------------------------------------------- reading
_TOP_KEYS = ("zero_optimization", "train_micro_batch_size_per_gpu", "train_batch_size")


def is_deepspeed_config(zero) -> bool:
    """Whether an integration's ``zero=`` is a DeepSpeed config: a path to its JSON (str or
    ``os.PathLike``), or its dict (holding one of DeepSpeed's top-level keys
    ``zero_optimization``, ``train_micro_batch_size_per_gpu``, ``train_batch_size``), rather
    than ZeroOptimizer keyword arguments."""
    if isinstance(zero, (str, os.PathLike)):
        return True
    return isinstance(zero, dict) and any(k in zero for k in _TOP_KEYS)


def read_deepspeed_config(config: str | os.PathLike | dict) -> dict:
    """DeepSpeed config ``config`` as a dict of its own (a JSON file read, or a dict copied)."""
    if isinstance(config, (str, os.PathLike)):
        where = os.fspath(config)
        if not os.path.isfile(where):
            raise FileNotFoundError(f"DeepSpeed config {where!r}: no such file")
        with open(where) as f:
            try:
                cfg = json.load(f)
            except ValueError as e:
                raise ValueError(f"DeepSpeed config {where!r}: not JSON ({e})") from None
    elif isinstance(config, dict):
        cfg = copy.deepcopy(config)
    else:
        raise TypeError(f"config must be a path or a dict, got {type(config).__name__}: {config!r}")
    if not isinstance(cfg, dict):
        raise ValueError(f"DeepSpeed config: a JSON object expected, got {type(cfg).__name__}")
    return cfg


def auto_keys(cfg: dict, prefix: str = "") -> list[str]:
    """The dotted keys of ``cfg`` whose value is ``"auto"``, in the config's order."""
    out = []
    for k, v in cfg.items():
        if isinstance(v, dict):
            out += auto_keys(v, f"{prefix}{k}.")
        elif v == "auto":
            out.append(f"{prefix}{k}")
    return out


# ---------------------------------------------------------------------------- the mapping
def map_deepspeed_config(
    config: str | os.PathLike | dict,
    *,
    model=None,
    hf_args=None,
    num_training_steps: int | None = None,
    allow_differences: bool = False,
) -> DeepSpeedMapping:
    """The `DeepSpeedMapping` of DeepSpeed config ``config`` (a JSON file or a dict); never
    raises for a key it cannot map: those are its ``refused`` lines (`DeepSpeedMapping.check`
    raises on them). ``model``, ``hf_args``, ``num_training_steps``: what ``"auto"`` values
    resolve from (see [Note: DeepSpeed config])."""
    cfg = read_deepspeed_config(config)
    m = DeepSpeedMapping(allow_differences=bool(allow_differences))
    _resolve_auto(cfg, m, model, hf_args, num_training_steps)
    for key, value in cfg.items():
        handler = KEYS.get(key)
        if handler is None:
            m.add(key, value, "refused", "not a key zero_kernels knows (or supports)")
        else:
            handler(m, key, value)
    if "gradient_clipping" not in cfg:  # DeepSpeed 0.19 clips by default
        m.clip_grad_norm = 1.0
        m.add("gradient_clipping", "(absent)", "caller", "DeepSpeed 0.19's default 1.0: call "
              "opt.clip_grad_norm_(1.0) before opt.step()")  # fmt: skip
    if m.optimizer_class is None and "optimizer" not in cfg:
        m.add("optimizer", None, "caller", "none given: pass your optimizer class")
    try:
        m.policy()
    except (ValueError, TypeError, NotImplementedError) as e:
        m.add("zero_optimization", "(together)", "refused", f"{type(e).__name__}: {e}")
    return m


# ---------------------------------------------------------------------------- building
class DeepSpeedRun(NamedTuple):
    """What `build_from_deepspeed_config` returns: the optimizer, the LR scheduler (or None),
    the max norm for ``optimizer.clip_grad_norm_`` each step (or None) and the mapping."""

    optimizer: Any
    lr_scheduler: Any
    clip_grad_norm: float | None
    mapping: DeepSpeedMapping


def build_from_deepspeed_config(
    zero_cls,
    model: torch.nn.Module,
    config,
    *,
    optimizer_class=None,
    hf_args=None,
    num_training_steps: int | None = None,
    allow_differences: bool = False,
    **overrides,
) -> DeepSpeedRun:
    """Build ``zero_cls`` (`ZeroOptimizer`) over ``model`` as DeepSpeed config ``config`` says;
    raises one NotImplementedError listing every key it cannot take (see `map_deepspeed_config`
    and [Note: DeepSpeed config]). bf16/fp16 enabled: ``model`` is cast first, as DeepSpeed's
    engine casts it. ``optimizer_class``: without an ``optimizer`` block in the config, the
    class to use. ``overrides``: more `ZeroPolicy` options (e.g. ``timeout``), given priority."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    m = map_deepspeed_config(
        config,
        model=model,
        hf_args=hf_args,
        num_training_steps=num_training_steps,
        allow_differences=allow_differences,
    )
    cls = m.optimizer_class
    if cls is None:
        if optimizer_class is None:
            m.add("optimizer", None, "refused", "no optimizer block: pass optimizer_class=")
        cls = optimizer_class
    elif optimizer_class is not None and optimizer_class is not cls:
        m.add("optimizer.type", cls.__name__, "refused",
              f"optimizer_class={optimizer_class.__name__} given too: one source")  # fmt: skip
    m.check()
    if m.dtype is not None:
        model.to(m.dtype)
    policy = ZeroPolicy.resolve(stage=m.stage, **{**m.options, **overrides})
    opt = zero_cls(model, cls, policy=policy, **m.optimizer_kwargs)
    try:
        if opt.scaler.dynamic:
            if "loss_scale" in m.scaler:
                opt.loss_scale = m.scaler["loss_scale"]
            if "growth_interval" in m.scaler:
                opt.growth_interval = m.scaler["growth_interval"]
        sched = m.scheduler(opt) if m.scheduler is not None else None
    except BaseException:
        opt.close()
        raise
    return DeepSpeedRun(opt, sched, m.clip_grad_norm, m)


# ---------------------------------------------------------------------------- HF's Trainer
def zero_for_trainer(config, args, *, model=None, allow_differences: bool = False) -> ZeroPolicy:
    """The ``zero=`` of `zero_kernels.integrations.transformers.ZeroTrainer` for a run that
    passed DeepSpeed config ``config`` to ``TrainingArguments(deepspeed=...)``: give ``args``
    without ``deepspeed`` and ``zero=zero_for_trainer(config, args, model=model)``. As
    transformers does, ``"auto"`` values come from ``args`` and every other value the Trainer
    owns must equal its argument (optimizer lr/betas/eps/weight_decay, gradient_clipping,
    batch sizes, bf16): a mismatch is listed with the refused keys in one error. The Trainer
    builds the optimizer and the scheduler from ``args``: a ``scheduler`` block is refused (its
    warmup differs from the Trainer's; set ``lr_scheduler_type``/``warmup_steps``), and so is
    fp16 (ZeroTrainer takes bf16, or fp16 params)."""
    m = map_deepspeed_config(config, model=model, hf_args=args, allow_differences=allow_differences)
    want = {
        "optimizer.params.lr": getattr(args, "learning_rate", None),
        "optimizer.params.betas": [
            getattr(args, "adam_beta1", None),
            getattr(args, "adam_beta2", None),
        ],
        "optimizer.params.eps": getattr(args, "adam_epsilon", None),
        "optimizer.params.weight_decay": getattr(args, "weight_decay", None),
        "gradient_clipping": getattr(args, "max_grad_norm", None),
        "train_micro_batch_size_per_gpu": getattr(args, "per_device_train_batch_size", None),
        "gradient_accumulation_steps": getattr(args, "gradient_accumulation_steps", None),
    }
    for ln in list(m.lines):
        if ln.key in want and ln.kind != "refused" and ln.value != "(absent)":
            got = list(ln.value) if isinstance(ln.value, (list, tuple)) else ln.value
            if got != want[ln.key]:
                m.add(
                    ln.key,
                    ln.value,
                    "refused",
                    f"the Trainer's argument says {want[ln.key]!r} "
                    "(set it to 'auto', or make them agree)",
                )
        elif ln.key == "scheduler.type":
            m.add(
                ln.key,
                ln.value,
                "refused",
                "the Trainer builds the scheduler from "
                "TrainingArguments (lr_scheduler_type, warmup_steps); drop the block",
            )
        elif ln.key == "fp16.enabled" and ln.value is True:
            m.add(ln.key, ln.value, "refused", "ZeroTrainer takes bf16=True, or fp16 params")
    if m.dtype is torch.bfloat16 and not getattr(args, "bf16", False):
        m.add("bf16.enabled", True, "refused", "TrainingArguments(bf16=False): make them agree")
    if m.optimizer_class not in (None, torch.optim.AdamW):
        m.add("optimizer.type", "Adam", "refused", "the Trainer builds AdamW (adam_w_mode)")
    m.lines = [ln for ln in m.lines if not (ln.kind == "caller" and ln.key == "optimizer")]
    m.check()
    return m.policy()
