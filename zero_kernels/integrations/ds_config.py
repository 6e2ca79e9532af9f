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
import math
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from ..policy import ZeroPolicy

__all__ = [
    "DeepSpeedMapping",
    "DeepSpeedRun",
    "Line",
    "build_from_deepspeed_config",
    "map_deepspeed_config",
]

KINDS = ("mapped", "caller", "same", "speed", "differs", "refused")


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
                stacklevel=3,
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
    if isinstance(config, (str, os.PathLike)):
        with open(config) as f:
            try:
                cfg = json.load(f)
            except ValueError as e:
                where = os.fspath(config)
                raise ValueError(f"DeepSpeed config {where!r}: not JSON ({e})") from None
    elif isinstance(config, dict):
        cfg = copy.deepcopy(config)
    else:
        raise TypeError(f"config must be a path or a dict, got {type(config).__name__}")
    if not isinstance(cfg, dict):
        raise ValueError(f"DeepSpeed config: a JSON object expected, got {type(cfg).__name__}")
    m = DeepSpeedMapping(allow_differences=bool(allow_differences))
    _resolve_auto(cfg, m, model, hf_args, num_training_steps)
    for key, value in cfg.items():
        handler = _TOP.get(key)
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


def _auto(m: DeepSpeedMapping, key: str, value) -> bool:
    if value == "auto":
        m.add(key, value, "refused", "'auto' with nothing to resolve it from (see hf_args=)")
        return True
    return False


def _num(m: DeepSpeedMapping, key: str, value, *, integer=False, positive=False) -> bool:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if ok and integer:
        ok = float(value).is_integer()
    if ok and positive:
        ok = value > 0
    if not ok and not _auto(m, key, value):
        what = "an integer" if integer else "a number"
        m.add(key, value, "refused", f"{what}{' > 0' if positive else ''} expected")
    return ok


def _bool(m: DeepSpeedMapping, key: str, value) -> bool:
    if not isinstance(value, bool):
        if not _auto(m, key, value):
            m.add(key, value, "refused", "true or false expected")
        return False
    return True


def _ignore_speed(why: str):
    def h(m, key, value):
        m.add(key, value, "speed", why)

    return h


def _caller(why: str):
    def h(m, key, value):
        if not _auto(m, key, value):
            m.batch[key] = value
            m.add(key, value, "caller", why)

    return h


def _off_only(why: str, off=(False, None, 0)):
    """A feature that is fine when off and refused when on."""

    def h(m, key, value):
        if isinstance(value, dict):
            on = value.get("enabled", bool(value))
        else:
            on = value
        if on in off:
            m.add(key, value, "same", "off (as here)")
        else:
            m.add(key, value, "refused", why)

    return h


def _gradient_clipping(m, key, value):
    if not _num(m, key, value):
        return
    if value < 0:
        m.add(key, value, "refused", "a norm >= 0 expected")
    elif value == 0:
        m.add(key, value, "same", "no clipping")
    else:
        m.clip_grad_norm = float(value)
        m.add(key, value, "caller", f"call opt.clip_grad_norm_({float(value)!r}) before opt.step()")


def _communication_data_type(m, key, value):
    dt = {None: None, "fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
    if value not in dt:
        m.add(key, value, "refused", "one of 'fp32', 'bf16', 'fp16' expected")
        return
    if dt[value] is not None:
        m.options["reduce_dtype"] = dt[value]
    m.add(key, value, "mapped", f"reduce_dtype={dt[value]} (stages 2/3)")


def _factor_one(why: str):
    def h(m, key, value):
        if _num(m, key, value):
            if value == 1:
                m.add(key, value, "same", "1 (as here)")
            else:
                m.add(key, value, "refused", why)

    return h


def _data_types(m, key, value):
    if not isinstance(value, dict):
        m.add(key, value, "refused", "a dict expected")
        return
    for k, v in value.items():
        if k == "grad_accum_dtype" and v in (None, "fp32"):
            m.add(f"{key}.{k}", v, "same", "gradients accumulate in fp32 here")
        elif k == "grad_accum_dtype":
            m.add(f"{key}.{k}", v, "differs", "gradients accumulate in fp32 here (reduce_dtype "
                  "sets the reduction's dtype)")  # fmt: skip
        else:
            m.add(f"{key}.{k}", v, "refused", "not a key zero_kernels knows")


# ---- optimizer
_OPT_KEYS = {"lr", "betas", "eps", "weight_decay", "amsgrad"}


def _optimizer(m, key, value):
    if not isinstance(value, dict):
        m.add(key, value, "refused", "a dict with 'type' and 'params' expected")
        return
    typ = value.get("type")
    params = dict(value.get("params") or {})
    for k in value:
        if k not in ("type", "params"):
            m.add(f"{key}.{k}", value[k], "refused", "not a key of DeepSpeed's optimizer block")
    name = str(typ).lower() if isinstance(typ, str) else None
    if name not in ("adam", "adamw"):
        m.add(f"{key}.type", typ, "refused", "only Adam and AdamW map to torch classes here")
        return
    w_mode = params.pop("adam_w_mode", True)
    if not isinstance(w_mode, bool):
        m.add(f"{key}.params.adam_w_mode", w_mode, "refused", "true or false expected")
        w_mode = True
    elif "adam_w_mode" in (value.get("params") or {}):
        m.add(f"{key}.params.adam_w_mode", w_mode, "mapped", "decoupled weight decay" if w_mode
              else "L2 weight decay (torch.optim.Adam)")  # fmt: skip
    cls = torch.optim.AdamW if name == "adamw" or w_mode else torch.optim.Adam
    m.optimizer_class = cls
    note = (
        " (DeepSpeed's 'Adam' decouples weight decay unless adam_w_mode is false)"
        if name == "adam" and cls is torch.optim.AdamW
        else ""
    )
    m.add(f"{key}.type", typ, "mapped", f"torch.optim.{cls.__name__}{note}")
    for k in ("torch_adam", "fused", "foreach"):
        if k in params:
            m.add(f"{key}.params.{k}", params.pop(k), "speed", "the kernel is chosen here")
    if "max_grad_norm" in params:
        m.add(f"{key}.params.max_grad_norm", params.pop("max_grad_norm"), "refused",
              "DeepSpeed refuses it too: use gradient_clipping")  # fmt: skip
    for k, v in params.items():
        full = f"{key}.params.{k}"
        if k not in _OPT_KEYS:
            m.add(full, v, "refused", f"not a parameter of torch.optim.{cls.__name__}")
        elif _auto(m, full, v):
            continue
        elif k == "betas":
            if not (isinstance(v, (list, tuple)) and len(v) == 2):
                m.add(full, v, "refused", "two numbers expected")
                continue
            m.optimizer_kwargs[k] = (float(v[0]), float(v[1]))
            m.add(full, v, "mapped", f"betas={m.optimizer_kwargs[k]!r}")
        elif k == "amsgrad":
            if _bool(m, full, v):
                m.optimizer_kwargs[k] = v
                m.add(full, v, "mapped", f"amsgrad={v}")
        elif _num(m, full, v):
            m.optimizer_kwargs[k] = float(v)
            m.add(full, v, "mapped", f"{k}={float(v)!r}")


# ---- scheduler
def _gamma(t: int, warm: int, kind: str) -> float:
    """DeepSpeed's warmup fraction at iteration ``t`` (< warm)."""
    if kind == "log":
        return math.log(t + 1) / math.log(warm)
    return t / warm


def deepspeed_lr_lambda(name: str, p: dict, base_lr: float) -> Callable[[int], float]:
    """LambdaLR's factor at its ``last_epoch`` e for DeepSpeed scheduler ``name`` with params
    ``p`` (resolved), over base lr ``base_lr`` (also WarmupLR's max lr when ``p`` has none, as
    DeepSpeed takes the optimizer's): DeepSpeed's iteration is e - 1 (its lr before its first
    step is that of iteration -1). Formulas in [Note: DeepSpeed config]."""
    warm = max(2, int(p.get("warmup_num_steps", 1000)))
    kind = p.get("warmup_type", "log")
    if name in ("WarmupLR", "WarmupDecayLR"):
        lo = float(p.get("warmup_min_lr", 0.0))
        hi = float(p.get("warmup_max_lr", base_lr if name == "WarmupLR" else 0.001))
        total = int(p.get("total_num_steps", 0)) if name == "WarmupDecayLR" else None

        def f(e: int) -> float:
            t = e - 1
            if t < 0:
                g = 0.0
            elif t < warm:
                g = _gamma(t, warm, kind)
            elif total is None:
                g = 1.0
            else:
                g = max(0.0, (total - t) / max(1.0, total - warm))
            return (lo + (hi - lo) * g) / base_lr

        return f
    assert name == "WarmupCosineLR", name
    total = int(p["total_num_steps"])
    lo_r = float(p.get("warmup_min_ratio", 0.0))
    cos_min = float(p.get("cos_min_ratio", 0.0001))

    def c(e: int) -> float:
        t = e - 1
        if t < 0:
            return 0.0
        if t < warm:
            return lo_r + _gamma(t, warm, kind) * (1.0 - lo_r)
        prog = min(1.0, (t - warm + 1) / max(1, total - warm))
        return max(0.0, cos_min + (1.0 - cos_min) * (1 + math.cos(math.pi * prog)) / 2)

    return c


_SCHED_KEYS = {
    "WarmupLR": {"warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type"},
    "WarmupDecayLR": {
        "warmup_min_lr",
        "warmup_max_lr",
        "warmup_num_steps",
        "warmup_type",
        "total_num_steps",
    },
    "WarmupCosineLR": {
        "total_num_steps",
        "warmup_min_ratio",
        "warmup_num_steps",
        "cos_min_ratio",
        "warmup_type",
    },
}


def _scheduler(m, key, value):
    if not isinstance(value, dict):
        m.add(key, value, "refused", "a dict with 'type' and 'params' expected")
        return
    name = value.get("type")
    if name not in _SCHED_KEYS:
        m.add(f"{key}.type", name, "refused", f"only {', '.join(_SCHED_KEYS)} map here")
        return
    p = dict(value.get("params") or {})
    ok = True
    for k, v in p.items():
        full = f"{key}.params.{k}"
        if k == "last_batch_iteration" and v == -1:
            m.add(full, v, "same", "a new schedule")
        elif k not in _SCHED_KEYS[name]:
            m.add(full, v, "refused", f"not a parameter of DeepSpeed's {name}")
            ok = False
        elif k == "warmup_type":
            if v not in ("log", "linear"):
                m.add(full, v, "refused", "'log' or 'linear' expected")
                ok = False
        elif isinstance(v, list):
            m.add(full, v, "refused", "one value for every param group only (lists: not here)")
            ok = False
        elif not _num(m, full, v, integer=k.endswith("steps")):
            ok = False
    if name == "WarmupCosineLR" and "total_num_steps" not in p:
        m.add(f"{key}.params.total_num_steps", None, "refused", "WarmupCosineLR needs it")
        ok = False
    if p.get("warmup_num_steps", 1) <= 0 if ok else False:
        m.add(f"{key}.params.warmup_num_steps", p["warmup_num_steps"], "refused", "> 0 expected")
        ok = False
    if not ok:
        return
    if "warmup_max_lr" in p and float(p["warmup_max_lr"]) <= 0:
        m.add(f"{key}.params.warmup_max_lr", p.get("warmup_max_lr"), "refused", "> 0 expected")
        return

    def factory(optimizer):
        if name == "WarmupCosineLR" or (name == "WarmupLR" and "warmup_max_lr" not in p):
            base = None  # the optimizer's own lr
        else:
            base = float(p.get("warmup_max_lr", 0.001))
            for g in optimizer.param_groups:
                g["lr"] = base
                g["initial_lr"] = base
        fns = [
            deepspeed_lr_lambda(name, p, base if base is not None else g["lr"])
            for g in optimizer.param_groups
        ]
        return torch.optim.lr_scheduler.LambdaLR(optimizer, fns)

    m.scheduler = factory
    base = "warmup_max_lr" if "warmup_max_lr" in p else "the optimizer's lr"
    if name == "WarmupDecayLR" and "warmup_max_lr" not in p:
        base = "warmup_max_lr (DeepSpeed's default 0.001)"
    m.add(f"{key}.type", name, "mapped", f"torch LambdaLR, DeepSpeed's formula over {base}")
    for k, v in p.items():
        if k != "last_batch_iteration":
            m.add(f"{key}.params.{k}", v, "mapped", f"{name}'s {k}")


# ---- precision
def _bf16(m, key, value):
    if not isinstance(value, dict):
        m.add(key, value, "refused", "a dict expected")
        return
    for k, v in value.items():
        full = f"{key}.{k}"
        if k != "enabled":
            m.add(full, v, "refused", "not supported here (bf16 keeps fp32 masters, no options)")
        elif _bool(m, full, v):
            if v:
                if m.dtype is torch.float16:
                    m.add(full, v, "refused", "bf16 and fp16 both enabled")
                    continue
                m.dtype = torch.bfloat16
                m.add(full, v, "mapped", "model cast to bfloat16 (as DeepSpeed's engine does), "
                      "fp32 masters; gradients reduced in fp32 (DeepSpeed: in bf16 unless "
                      "communication_data_type)")  # fmt: skip
            else:
                m.add(full, v, "same", "off")


_FP16_DEFAULTS = {"initial_scale_power": 16, "loss_scale_window": 1000, "hysteresis": 2,
                  "min_loss_scale": 1}  # fmt: skip


def _fp16(m, key, value):
    if not isinstance(value, dict):
        m.add(key, value, "refused", "a dict expected")
        return
    v = dict(value)
    on = v.pop("enabled", False)
    if not _bool(m, f"{key}.enabled", on):
        return
    if not on:
        m.add(f"{key}.enabled", on, "same", "off")
        for k, x in v.items():
            m.add(f"{key}.{k}", x, "same", "fp16 is off")
        return
    if m.dtype is torch.bfloat16:
        m.add(f"{key}.enabled", on, "refused", "bf16 and fp16 both enabled")
        return
    m.dtype = torch.float16
    m.add(f"{key}.enabled", on, "mapped", "model cast to float16 (as DeepSpeed's engine does), "
          "fp32 masters")  # fmt: skip
    ls = v.pop("loss_scale", 0)
    if not _num(m, f"{key}.loss_scale", ls) or ls < 0:
        if isinstance(ls, (int, float)) and ls < 0:
            m.add(f"{key}.loss_scale", ls, "refused", ">= 0 expected (0: dynamic)")
        return
    if ls > 0:
        m.options["loss_scale"] = float(ls)
        m.add(f"{key}.loss_scale", ls, "mapped", f"loss_scale={float(ls)!r} (static)")
        for k, x in v.items():
            m.add(f"{key}.{k}", x, "same", "no effect with a static loss scale (as DeepSpeed)")
        return
    m.options["loss_scale"] = "dynamic"
    m.add(f"{key}.loss_scale", ls, "mapped", "loss_scale='dynamic'")
    for k, x in v.items():
        if k not in _FP16_DEFAULTS and k not in ("auto_cast", "consecutive_hysteresis"):
            m.add(f"{key}.{k}", x, "refused", "not a key of DeepSpeed's fp16 block")
    if v.get("auto_cast", False):
        m.add(f"{key}.auto_cast", v["auto_cast"], "refused", "autocast is the caller's here")
    elif "auto_cast" in v:
        m.add(f"{key}.auto_cast", False, "same", "off")
    vals = {k: v.get(k, d) for k, d in _FP16_DEFAULTS.items()}
    shown = {k: (x if k in v else f"{x} (DeepSpeed's default)") for k, x in vals.items()}
    p = vals["initial_scale_power"]
    if _num(m, f"{key}.initial_scale_power", p, integer=True):
        m.scaler["loss_scale"] = float(2 ** int(p))
        m.add(f"{key}.initial_scale_power", shown["initial_scale_power"], "mapped",
              f"opt.loss_scale = {2 ** int(p)} (set after construction)")  # fmt: skip
    w = vals["loss_scale_window"]
    if _num(m, f"{key}.loss_scale_window", w, integer=True, positive=True):
        m.scaler["growth_interval"] = int(w)
        m.add(f"{key}.loss_scale_window", shown["loss_scale_window"], "mapped",
              f"opt.growth_interval = {int(w)}")  # fmt: skip
    if vals["hysteresis"] != 1:
        m.add(f"{key}.hysteresis", shown["hysteresis"], "differs",
              "here the scale halves at the first overflow (hysteresis 1)")  # fmt: skip
    else:
        m.add(f"{key}.hysteresis", 1, "same", "halves at the first overflow")
    if "consecutive_hysteresis" in v:
        m.add(f"{key}.consecutive_hysteresis", v["consecutive_hysteresis"], "same",
              "no effect with hysteresis 1" if vals["hysteresis"] == 1 else
              "see hysteresis")  # fmt: skip
    if vals["min_loss_scale"] != 1:
        m.add(f"{key}.min_loss_scale", shown["min_loss_scale"], "differs",
              "the scale never goes below 1 here")  # fmt: skip
    else:
        m.add(f"{key}.min_loss_scale", 1, "same", "never below 1")


# ---- zero_optimization
def _offload(kind: str):
    """offload_optimizer / offload_param: device none|cpu|nvme (+ nvme_path)."""
    target = "offload_optimizer" if kind == "offload_optimizer" else "offload_params"

    def h(m, key, value):
        if not isinstance(value, dict):
            m.add(key, value, "refused", "a dict with 'device' expected")
            return
        dev = value.get("device", "none")
        for k, v in value.items():
            full = f"{key}.{k}"
            if k == "device":
                if dev in ("none", None):
                    m.add(full, v, "same", "no offload")
                elif dev in ("cpu", "nvme"):
                    m.options[target] = dev
                    m.add(full, v, "mapped", f"{target}={dev!r}")
                else:
                    m.add(full, v, "refused", "'none', 'cpu' or 'nvme' expected")
            elif k == "nvme_path":
                if dev != "nvme":
                    m.add(full, v, "same", "no effect without device 'nvme' (as DeepSpeed)")
                    continue
                old = m.options.get("offload_dir")
                if old is not None and old != v:
                    m.add(full, v, "refused", f"one offload_dir here for both tiers, got {old!r} "
                          "too")  # fmt: skip
                else:
                    m.options["offload_dir"] = v
                    m.add(full, v, "mapped", f"offload_dir={v!r}")
            elif k == "ratio":
                if v == 1 or v == 1.0:
                    m.add(full, v, "same", "all of it")
                else:
                    m.add(full, v, "refused", "a partial offload is not supported here")
            elif k in ("pin_memory", "buffer_count", "buffer_size", "fast_init", "max_in_cpu",
                       "pipeline_read", "pipeline_write", "pipeline"):  # fmt: skip
                m.add(full, v, "speed", "the offload tier sizes its own buffers "
                      "(offload_staging_mb)")  # fmt: skip
            else:
                m.add(full, v, "refused", f"not a key of DeepSpeed's {kind}")

    return h


def _zo_stage(m, key, value):
    if value in (1, 2, 3) and not isinstance(value, bool):
        m.stage = int(value)
        m.add(key, value, "mapped", f"stage={value}")
    elif value == 0:
        m.add(key, value, "refused", "stage 0 is plain DDP: use DistributedDataParallel")
    else:
        m.add(key, value, "refused", "1, 2 or 3 expected")


def _zo_bucket(m, key, value):
    if _num(m, key, value, positive=True):
        mb = float(value) * 4 / 2**20
        m.options["bucket_size_mb"] = mb
        m.add(key, value, "mapped", f"bucket_size_mb={mb:.6g} (elements x 4 bytes)")


def _zo_bool(option: str):
    def h(m, key, value):
        if _bool(m, key, value):
            m.options[option] = value
            m.add(key, value, "mapped", f"{option}={value}")

    return h


def _zo_true_same(why_false: str):
    def h(m, key, value):
        if _bool(m, key, value):
            if value:
                m.add(key, value, "same", "as here")
            else:
                m.add(key, value, "speed", why_false)

    return h


def _zo_persist(m, key, value):
    if not _num(m, key, value, integer=True):
        return
    if value < 0:
        m.add(key, value, "refused", ">= 0 expected")
    elif m.stage != 3:
        m.add(key, value, "same", f"no effect at stage {m.stage} (as DeepSpeed)")
    else:
        m.options["persist_below"] = int(value)
        m.add(key, value, "mapped", f"persist_below={int(value)}")


def _zo_prefetch(m, key, value):
    if not _num(m, key, value, integer=True):
        return
    if m.stage != 3:
        m.add(key, value, "same", f"no effect at stage {m.stage} (as DeepSpeed)")
    elif value == 0:
        m.options["prefetch"] = 0
        m.add(key, value, "mapped", "prefetch=0")
    else:
        m.add(key, value, "speed", "prefetch here counts units ahead (prefetch=, default 1)")


def _zo_stage3_only_speed(why: str):
    def h(m, key, value):
        if m.stage != 3:
            m.add(key, value, "same", f"no effect at stage {m.stage} (as DeepSpeed)")
        else:
            m.add(key, value, "speed", why)

    return h


def _zo_hpz(m, key, value):
    if not _num(m, key, value, integer=True, positive=True):
        return
    if value == 1:
        m.add(key, value, "same", "no secondary shard")
    elif m.stage != 3:
        m.add(key, value, "same", f"no effect at stage {m.stage} (as DeepSpeed)")
    else:
        m.options["secondary_shard"] = int(value)
        m.add(key, value, "mapped", f"secondary_shard={int(value)}")


def _zo_quant(option: str, stage3_only: bool):
    def h(m, key, value):
        if not _bool(m, key, value):
            return
        if not value:
            m.add(key, value, "same", "off")
        elif stage3_only and m.stage != 3:
            m.add(key, value, "same", f"no effect at stage {m.stage} (as DeepSpeed)")
        else:
            m.options[option] = "int8"
            m.add(key, value, "mapped", f"{option}='int8'")

    return h


def _zo_mics(m, key, value):
    if not _num(m, key, value, integer=True):
        return
    if value in (-1, 0):
        m.add(key, value, "same", "shard over the whole group")
    elif value < 0:
        m.add(key, value, "refused", "-1 or a positive size expected")
    else:
        m.options["shard_group"] = int(value)
        m.add(key, value, "mapped", f"shard_group={int(value)} (sharded in blocks of "
              f"{int(value)} ranks, replicated across them)")  # fmt: skip


def _zo_cpu_offload(m, key, value):
    if _bool(m, key, value):
        if value:
            m.options["offload_optimizer"] = "cpu"
            m.add(key, value, "mapped", "offload_optimizer='cpu'")
        else:
            m.add(key, value, "same", "no offload")


_SPEED = "tunes speed or memory only; zero_kernels decides it"
_ZO = {
    "stage": _zo_stage,  # read first (see _zero_optimization)
    "reduce_bucket_size": _zo_bucket,
    "overlap_comm": _zo_bool("overlap_comm"),
    "contiguous_gradients": _zo_true_same("gradients always go to flat buckets here"),
    "reduce_scatter": _zo_true_same("gradients are always reduce-scattered here"),
    "allgather_partitions": _zo_true_same("params are always all-gathered here"),
    "allgather_bucket_size": _ignore_speed(_SPEED + " (gathers follow the buckets)"),
    "stage3_param_persistence_threshold": _zo_persist,
    "stage3_prefetch_bucket_size": _zo_prefetch,
    "stage3_max_live_parameters": _zo_stage3_only_speed(_SPEED),
    "stage3_max_reuse_distance": _zo_stage3_only_speed(_SPEED),
    "stage3_gather_16bit_weights_on_model_save": _ignore_speed(
        "saves here hold full precision; zero_kernels.checkpoint.export_model writes one file"
    ),
    "stage3_gather_fp16_weights_on_model_save": _ignore_speed(
        "saves here hold full precision; zero_kernels.checkpoint.export_model writes one file"
    ),
    "stage3_module_granularity_threshold": _zo_stage3_only_speed(_SPEED),
    "sub_group_size": _ignore_speed(_SPEED),
    "round_robin_gradients": _ignore_speed(_SPEED),
    "elastic_checkpoint": _ignore_speed("checkpoints here load at any world size anyway"),
    "load_from_fp32_weights": _zo_true_same("masters always come from the fp32 values saved"),
    "ignore_unused_parameters": _zo_true_same("unused parameters are refused"),
    "memory_efficient_linear": _ignore_speed(_SPEED),
    "use_multi_rank_bucket_allreduce": _ignore_speed(_SPEED),
    "log_trace_cache_warnings": _ignore_speed("logging only"),
    "offload_optimizer": _offload("offload_optimizer"),
    "offload_param": _offload("offload_param"),
    "cpu_offload": _zo_cpu_offload,
    "zero_hpz_partition_size": _zo_hpz,
    "zero_quantized_weights": _zo_quant("quantize_weights", True),
    "zero_quantized_gradients": _zo_quant("quantize_grads", False),
    "zero_quantized_nontrainable_weights": _off_only("quantized frozen weights: not here"),
    "mics_shard_size": _zo_mics,
    "mics_hierarchical_params_gather": _ignore_speed(_SPEED + " (hierarchy follows the hosts)"),
    "legacy_stage1": _off_only("DeepSpeed's legacy stage 1 is not reproduced"),
    "zeropp_loco_param": _off_only("LoCo error feedback is not reproduced"),
}


def _zero_optimization(m, key, value):
    if not isinstance(value, dict):
        m.add(key, value, "refused", "a dict expected")
        return
    if "stage" in value:
        _zo_stage(m, f"{key}.stage", value["stage"])
    else:
        m.add(f"{key}.stage", None, "refused", "no stage given (DeepSpeed's default 0 is DDP)")
    for k, v in value.items():
        if k == "stage":
            continue
        full = f"{key}.{k}"
        handler = _ZO.get(k)
        if handler is None:
            m.add(full, v, "refused", "not a zero_optimization key zero_kernels knows")
        elif not _auto(m, full, v):
            handler(m, full, v)


_TOP: dict[str, Callable] = {
    "train_batch_size": _caller("your data loader: global batch (all ranks, all micro-steps)"),
    "train_micro_batch_size_per_gpu": _caller("your data loader: batch per rank and micro-step"),
    "gradient_accumulation_steps": _caller(
        "your loop: backward that many micro-batches (under opt.no_sync() but the last), "
        "then opt.step()"
    ),
    "gradient_clipping": _gradient_clipping,
    "optimizer": _optimizer,
    "scheduler": _scheduler,
    "zero_optimization": _zero_optimization,
    "bf16": _bf16,
    "bfloat16": _bf16,
    "fp16": _fp16,
    "amp": _off_only("apex amp is not supported"),
    "communication_data_type": _communication_data_type,
    "prescale_gradients": _off_only("gradients are divided once, after the sum, here"),
    "gradient_predivide_factor": _factor_one("gradients are divided once, after the sum, here"),
    "data_types": _data_types,
    "steps_per_print": _ignore_speed("logging only"),
    "wall_clock_breakdown": _ignore_speed("logging only (opt.comm_stats() has timings)"),
    "dump_state": _ignore_speed("logging only"),
    "memory_breakdown": _ignore_speed("logging only (opt.memory_report())"),
    "flops_profiler": _ignore_speed("profiling only"),
    "tensorboard": _ignore_speed("logging only"),
    "wandb": _ignore_speed("logging only"),
    "csv_monitor": _ignore_speed("logging only"),
    "comet": _ignore_speed("logging only"),
    "comms_logger": _ignore_speed("logging only (opt.comm_ledger())"),
    "aio": _ignore_speed(_SPEED + " (the NVMe tier's queue and blocks)"),
    "zero_allow_untested_optimizer": _ignore_speed("any torch optimizer is allowed here"),
    "zero_force_ds_cpu_optimizer": _ignore_speed("the CPU kernel is chosen here"),
    "checkpoint": _ignore_speed("checkpoints: zero_kernels.checkpoint (any world size)"),
    "activation_checkpointing": _off_only(
        "activation checkpointing is the model's (torch.utils.checkpoint)", off=(False, None, {})
    ),
    "sparse_attention": _off_only("not supported", off=(False, None, {})),
    "pipeline": _off_only("pipeline parallelism is not supported", off=(False, None, {})),
    "elasticity": _off_only("elastic batch sizes are not supported"),
    "compression_training": _off_only("not supported", off=(False, None, {})),
    "curriculum_learning": _off_only("not supported"),
    "data_efficiency": _off_only("not supported"),
    "seq_parallel_communication_data_type": _ignore_speed("sequence parallelism is not here"),
}


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
