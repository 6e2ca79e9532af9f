"""Each top-level key of a DeepSpeed config and what it becomes here: the handlers of
`zero_kernels.integrations.ds_config` ([Note: DeepSpeed config] there).

A handler ``h(m, key, value)`` adds one `Line` per key it reads to mapping ``m`` (``m.add(key,
value, kind, becomes)``) and sets what it maps (``m.options``, ``m.optimizer_class``,
``m.scheduler``...). `KEYS` names the handler of each top-level key; a key not in it is refused.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

__all__ = ["KEYS", "deepspeed_lr_lambda"]


def _auto(m, key: str, value) -> bool:
    if value == "auto":
        m.add(key, value, "refused", "'auto' with nothing to resolve it from (see hf_args=)")
        return True
    return False


def _num(m, key: str, value, *, integer=False, positive=False) -> bool:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if ok and integer:
        ok = float(value).is_integer()
    if ok and positive:
        ok = value > 0
    if not ok and not _auto(m, key, value):
        what = "an integer" if integer else "a number"
        m.add(key, value, "refused", f"{what}{' > 0' if positive else ''} expected")
    return ok


def _bool(m, key: str, value) -> bool:
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


KEYS: dict[str, Callable] = {
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
