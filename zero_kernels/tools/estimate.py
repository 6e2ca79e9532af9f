"""Per-rank model-state memory and communication per step of each ZeRO stage: the formulas.

Pure functions (no process group, no weights): `zero-kernels estimate` prints them, the demo
holds its measured bytes against them, and the tests pin the ZeRO paper's figures.

[Note: the formulas]
Ψ parameters, N data-parallel ranks, p / g bytes per parameter of params / grads, K bytes of
optimizer state per parameter (fp32 master copy included in mixed precision):

    stage 0 (DDP)   (p + g + K) Ψ             all-reduce of grads          2Ψ elements
    stage 1         (p + g) Ψ + K Ψ / N       reduce-scatter + all-gather  2Ψ
    stage 2         p Ψ + (g + K) Ψ / N       reduce-scatter + all-gather  2Ψ
    stage 3         (p + g + K) Ψ / N + live  all-gather x2 + r-scatter    3Ψ

Mixed-precision Adam: p = g = 2, K = 4 (master) + 4 (exp_avg) + 4 (exp_avg_sq) = 12; for Ψ = 7.5B,
N = 64 that is 120, 31.4, 16.6 and 1.9 GB (decimal GB), the paper's figure 1. ZeroOptimizer
reduces and holds gradients in fp32 whatever the params' dtype: precision "mixed-fp32-grads"
(g = 4) is what it holds with bf16/fp16 params; fp32 training has no master copy (K = 8).
"Live" for stage 3 is the window of gathered full parameters: the root unit (the params outside
the repeated layers, gathered for the whole step; ``root_params``), the running layer and the
``prefetch`` ones gathered ahead. The unsharded gradients of the layers being reduce-scattered are
ZeroOptimizer's stage-3 communication buffers (as stage 2's buckets: ``max_inflight_buckets``
layers of fp32 gradients), reported with the buffers.
Communication per step is the paper's volume, in bytes of the dtype each collective carries
(``comm_bytes``): an all-reduce counts 2Ψ (it is a reduce-scatter plus an all-gather), so DDP
moves 2Ψ grads, stages 1 and 2 Ψ grads reduce-scattered + Ψ params all-gathered, stage 3 one more
Ψ of params (gathered again for backward). Per collective the fields hold the payload (size of the
full buffer reduced or gathered, an all-reduce's once), and ``wire_bytes`` is what one rank puts
on the wire with ring algorithms ((N-1)/N of each reduce-scatter's or all-gather's payload).

Communication buffers are not model states and not in the totals, but real memory, reported on
their own (``comm_buffer_bytes``): stage 2 holds up to ``max_inflight_buckets`` bucket buffers of
up to ``bucket_mb`` MiB (fp32 grads) while reducing, each sized to its bucket (so never more than
all grads); stage 3 as many of its largest units' gradients (a bucket is a layer or the root
unit); stage 1 reduce-scatters in place in its full gradient buffer and DDP's grads are
views of its buckets (``gradient_as_bucket_view``): none.

Scratch (``scratch_bytes``, also outside the totals) is the rest of what a step needs at its
peak: the collectives' own buffers, and the gradient autograd produces whole for one param (the
largest, ``largest_param``) before the hook copies it into its bucket: every data-parallel
implementation has that one, DDP included. The collectives' buffers depend on the algorithm
(``comm_scratch``): the receive buffers of the pairwise reduce-scatter (gloo ranks on several
hosts; `zero_kernels.comm` keeps them cached between steps): per bucket in flight one shard per
peer, less the one that lands in the output (stage 1 reduces in place: (N-1)/N of each in-flight
bucket; stages 2/3 into a separate shard: (N-2)/N of each bucket buffer); or, for ranks on one
host (the probe's pick there), the shared-memory slots: a bounded size per process group
whatever the model ([Note: shared-memory collectives] in zero_kernels/comm/shm.py).
"""

from __future__ import annotations

import importlib
import inspect
import json
import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

__all__ = [
    "OPTIMIZERS",
    "PRECISIONS",
    "STAGES",
    "ModelInfo",
    "Precision",
    "StageEstimate",
    "estimate",
    "estimate_stage",
    "precision_of",
    "format_bytes",
    "model_info",
    "optimizer_state_bytes",
    "parse_bytes",
    "parse_count",
]

STAGES = (0, 1, 2, 3)
GB = 1e9
DEFAULT_BUCKET_MB = 25.0  # ZeroOptimizer's bucket_size_mb (MiB of fp32 gradient per bucket)
GRAD_REDUCE_BYTES = 4  # ZeroOptimizer reduces gradients in fp32
# comm.shm: SLOTS slots of at most SLOT_BYTES each, per process group and rank
SHM_SLOT_BYTES = 2 * (4 << 20)


@dataclass(frozen=True)
class Precision:
    name: str
    param_bytes: int  # bytes per parameter of the model's weights
    grad_bytes: int  # bytes per parameter of the gradients
    master_bytes: int  # fp32 master copy kept by the optimizer (0 without one)
    state_elem_bytes: int  # bytes of one optimizer-state element (exp_avg, momentum, ...)


PRECISIONS: dict[str, Precision] = {
    # bf16/fp16 weights and grads, fp32 master weights and fp32 states (the paper's setting)
    "mixed": Precision("mixed", 2, 2, 4, 4),
    "fp32": Precision("fp32", 4, 4, 0, 4),
    # bf16/fp16 weights, fp32 grads (ZeroOptimizer reduces and holds grads in fp32), fp32 master
    "mixed-fp32-grads": Precision("mixed-fp32-grads", 2, 4, 4, 4),
    # pure bf16: weights, grads and states all bf16, no master copy
    "bf16": Precision("bf16", 2, 2, 0, 2),
    # bf16 weights without a master (ZeroOptimizer's bf16_stochastic_round), fp32 grads/states
    "bf16-sr": Precision("bf16-sr", 2, 4, 0, 4),
}
_PRECISION_ALIASES = {"fp16": "mixed", "amp": "mixed", "float32": "fp32", "pure-bf16": "bf16"}

# Full-size state tensors per parameter; "factored" (Adafactor) is computed from shapes.
OPTIMIZERS: dict[str, int | str] = {
    "adam": 2,
    "adamw": 2,
    "lamb": 2,
    "sgd-momentum": 1,
    "sgd": 0,
    "muon": 1,  # momentum buffer (the demo's Muon uses AdamW for non-matrix params)
    "lion": 1,
    "adagrad": 1,
    "rmsprop": 1,
    "adafactor": "factored",
}


def _choice(name: str, value: str, choices: Iterable[str], aliases: dict[str, str]) -> str:
    v = value.strip().lower()
    v = aliases.get(v, v)
    if v not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}; got {value!r}")
    return v


def precision_of(name: str) -> Precision:
    """The `Precision` a ``--precision`` value names (aliases such as "fp16" and "amp" taken);
    a ValueError naming the choices otherwise."""
    return PRECISIONS[_choice("--precision", name, PRECISIONS, _PRECISION_ALIASES)]


def parse_count(text: str | int | float, *, name: str = "--params") -> int:
    """`7.5B`, `1.3e9`, `125M`, `350k`, `7_000_000` -> an integer count."""
    if isinstance(text, int | float):
        value = float(text)
    else:
        m = re.fullmatch(
            r"\s*([0-9][0-9_]*(?:\.[0-9]*)?(?:[eE][+-]?[0-9]+)?)\s*([kKmMbBgGtT]?)\s*", text
        )
        if not m:
            raise ValueError(f"{name} must be a count like 7.5B, 1.3e9, 125M or 350k; got {text!r}")
        scale = {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}[m.group(2).lower()]
        value = float(m.group(1).replace("_", "")) * scale
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a positive count; got {text!r}")
    return int(round(value))


def parse_bytes(text: str | int | float, *, name: str = "--gpu-mem") -> int:
    """`80GB`, `80G`, `80` (GB), `24GiB`, `512MB`, `4096B` (bytes) -> bytes."""
    if isinstance(text, int | float):
        return int(float(text) * GB)
    m = re.fullmatch(
        r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([kKmMgGtT]?)(i?)([bB]?)\s*", text
    )
    if not m or float(m.group(1)) <= 0 or (m.group(3) and not m.group(2)):
        raise ValueError(f"{name} must be a size like 80GB, 24GiB or 80 (GB); got {text!r}")
    if not m.group(2) and m.group(4):  # "4096B": bytes
        return int(float(m.group(1)))
    unit = m.group(2).lower() or "g"
    base = 1024 if m.group(3) else 1000
    return int(float(m.group(1)) * base ** {"k": 1, "m": 2, "g": 3, "t": 4}[unit])


def format_bytes(n: float) -> str:
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.3g} {unit}" if n / scale < 100 else f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"


# ---------------------------------------------------------------------------------------------
# Models: parameter shapes from a factory on the meta device or from a config.json
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelInfo:
    """What the formulas need from a model: its trainable parameter shapes and largest layer."""

    name: str
    shapes: tuple[tuple[int, ...], ...]  # unique trainable parameters (tied ones once)
    largest_layer: int  # parameters of the largest layer (a stage-3 gather unit)
    frozen: int = 0  # elements of the params that do not train (requires_grad=False)

    @property
    def n_params(self) -> int:
        return sum(math.prod(s) for s in self.shapes)


def _shapes_of_module(module) -> tuple[tuple[tuple[int, ...], ...], int, int]:
    """(trainable shapes, the largest layer's trainable params, frozen params)."""
    import torch
    from torch import nn

    seen: set[int] = set()
    shapes = []
    frozen = 0
    for p in module.parameters():  # parameters() already yields a tied tensor once
        if id(p) in seen:
            continue
        seen.add(id(p))
        if p.requires_grad:
            shapes.append(tuple(p.shape))
        else:
            frozen += p.numel()

    # A "layer" is what stage 3 gathers at once: an element of a ModuleList/Sequential (a block),
    # else a leaf module.
    def count(m: nn.Module) -> int:
        return sum(p.numel() for p in m.parameters() if p.requires_grad)

    layers = [
        c
        for m in module.modules()
        if isinstance(m, nn.ModuleList | nn.Sequential)
        for c in m.children()
    ]
    if not layers:
        layers = [m for m in module.modules() if not list(m.children())]
    largest = max((count(m) for m in layers), default=0)
    del torch
    return tuple(shapes), largest, frozen


def _from_factory(spec: str) -> ModelInfo:
    import torch

    mod_name, _, attr = spec.partition(":")
    try:
        mod = importlib.import_module(mod_name)
    except ImportError as e:
        raise ValueError(f"--model: cannot import module {mod_name!r} ({e})") from None
    factory = mod
    for part in attr.split("."):
        if not hasattr(factory, part):
            raise ValueError(f"--model: module {mod_name!r} has no attribute {attr!r}")
        factory = getattr(factory, part)
    if not callable(factory):
        raise ValueError(f"--model: {spec!r} is not callable")
    try:
        inspect.signature(factory).bind()
    except TypeError as e:  # e.g. torch.nn:Linear, whose constructor needs arguments
        raise ValueError(
            f"--model {spec!r} must be a factory callable with no arguments; "
            f"calling {attr}() would fail: {e}"
        ) from None
    except ValueError:  # no signature to inspect (some builtins): just call it
        pass
    try:
        with torch.device("meta"):
            model = factory()
    except Exception as e:  # the factory itself failed: one line naming --model, value and why
        why = (str(e).strip().splitlines() or [""])[0]
        raise ValueError(
            f"--model {spec!r}: building it on the meta device failed: {type(e).__name__}: {why}"
        ) from None
    if not isinstance(model, torch.nn.Module):
        raise ValueError(
            f"--model: {spec!r} returned {type(model).__name__}, not a torch.nn.Module"
        )
    shapes, largest, frozen = _shapes_of_module(model)
    return ModelInfo(spec, shapes, largest, frozen)


def _config_shapes(cfg: dict) -> tuple[tuple[tuple[int, ...], ...], int]:
    """Parameter shapes of a GPT-2 or LLaMA-style transformers config (no transformers needed)."""

    def get(*keys, default=None):
        for k in keys:
            if cfg.get(k) is not None:
                return cfg[k]
        if default is None:
            raise ValueError(f"--model: config.json lacks {' / '.join(keys)}")
        return default

    kind = str(cfg.get("model_type", "")).lower()
    vocab = int(get("vocab_size"))
    if kind in ("gpt2", "gpt_neo", "gpt-2") or "n_embd" in cfg:
        d = int(get("n_embd", "hidden_size"))
        n_layer = int(get("n_layer", "num_hidden_layers"))
        n_pos = int(get("n_positions", "max_position_embeddings", default=1024))
        inner = int(cfg.get("n_inner") or 4 * d)
        tied = bool(cfg.get("tie_word_embeddings", True))
        layer = [
            (d,),
            (d,),
            (d, 3 * d),
            (3 * d,),
            (d, d),
            (d,),
            (d,),
            (d,),
            (d, inner),
            (inner,),
            (inner, d),
            (d,),
        ]
        shapes = [(vocab, d), (n_pos, d)] + layer * n_layer + [(d,), (d,)]
        if not tied:
            shapes.append((vocab, d))
    elif "hidden_size" in cfg and "intermediate_size" in cfg:  # LLaMA / Mistral / Qwen style
        d = int(get("hidden_size"))
        n_layer = int(get("num_hidden_layers"))
        inner = int(get("intermediate_size"))
        heads = int(get("num_attention_heads"))
        kv = int(cfg.get("num_key_value_heads") or heads)
        hd = int(cfg.get("head_dim") or d // heads)
        tied = bool(cfg.get("tie_word_embeddings", False))
        bias = bool(cfg.get("attention_bias", False))
        layer = [
            (heads * hd, d),
            (kv * hd, d),
            (kv * hd, d),
            (d, heads * hd),
            (inner, d),
            (inner, d),
            (d, inner),
            (d,),
            (d,),
        ]
        if bias:
            layer += [(heads * hd,), (kv * hd,), (kv * hd,)]
        shapes = [(vocab, d)] + layer * n_layer + [(d,)]
        if not tied:
            shapes.append((vocab, d))
    else:
        raise ValueError(
            "--model: config.json is neither GPT-2 style (n_embd, n_layer) nor "
            "LLaMA style (hidden_size, intermediate_size, num_hidden_layers)"
        )
    largest = max(sum(math.prod(s) for s in layer), vocab * d)
    return tuple(shapes), largest


def model_info(spec: str) -> ModelInfo:
    """A model from `package.module:factory` (built on the meta device) or a `config.json` path."""
    p = Path(spec)
    if spec.endswith(".json") or p.is_file() or p.is_dir():
        if p.is_dir():
            p = p / "config.json"
        if not p.is_file():
            raise ValueError(f"--model: no such file {str(p)!r}")
        try:
            cfg = json.loads(p.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"--model: {str(p)!r} is not valid JSON ({e})") from None
        shapes, largest = _config_shapes(cfg)
        return ModelInfo(str(p), shapes, largest)
    if ":" not in spec:
        raise ValueError(
            f"--model must be `package.module:factory` or a config.json path; got {spec!r}"
        )
    return _from_factory(spec)


# ---------------------------------------------------------------------------------------------
# The formulas
# ---------------------------------------------------------------------------------------------


def optimizer_state_bytes(
    optimizer: str,
    precision: str | Precision,
    n_params: int,
    shapes: Sequence[tuple[int, ...]] | None = None,
    state_dtype: str = "fp32",
    state_block: int = 256,
) -> float:
    """Bytes of optimizer state (master copy included) for the whole model, unsharded.

    Adafactor keeps row + column second moments for matrices and a full one for vectors, so it
    needs `shapes`; without them it is counted as factored to ~0 bytes per parameter.
    ``state_dtype`` (adam): the fused step's moments in "bf16" (4 bytes per param) or "int8"
    (2 + 8 / ``state_block``: codes and one fp32 scale per block for each moment), masters as
    they are ([Note: low-bit state] in `zero_kernels.ops.lowbit`).
    """
    from ..ops.lowbit import check_state_dtype, state_bytes_per_param

    prec = precision if isinstance(precision, Precision) else PRECISIONS[precision]
    opt = _choice("--optimizer", optimizer, OPTIMIZERS, {"sgd_momentum": "sgd-momentum"})
    n_state = OPTIMIZERS[opt]
    master = prec.master_bytes * n_params
    check_state_dtype(state_dtype, state_block, "--state-dtype")
    if state_dtype != "fp32":
        if n_state != 2:
            raise ValueError(
                f"--state-dtype {state_dtype} is the fused Adam step's format; "
                f"got --optimizer {opt}"
            )
        if prec.state_elem_bytes != 4:
            raise ValueError("--state-dtype needs fp32 moments to shrink (mixed or fp32 precision)")
        return float(master + state_bytes_per_param(state_dtype, state_block) * n_params)
    if n_state == "factored":
        if shapes is None:
            return float(master)
        elems = sum(s[-2] + s[-1] if len(s) >= 2 else math.prod(s) for s in shapes)
        return float(master + prec.state_elem_bytes * elems)
    return float(master + n_state * prec.state_elem_bytes * n_params)


@dataclass(frozen=True)
class StageEstimate:
    stage: int
    world_size: int
    params_bytes: float  # per rank
    grads_bytes: float
    optim_bytes: float
    live_bytes: float  # stage 3's window of gathered layers (0 for stages 0-2)
    total_bytes: float  # model states (+ stage 3's live window); comm buffers not included
    comm_elements: float  # per step, in units of parameters (2Ψ or 3Ψ)
    comm_bytes: float  # per step, the paper's volume in bytes (all-reduce = 2x its payload)
    all_reduce_bytes: float  # payload per step
    reduce_scatter_bytes: float
    all_gather_bytes: float
    wire_bytes: float  # bytes one rank sends per step with ring collectives
    fits: bool | None = None
    comm_buffer_bytes: float = 0.0  # stage 2's in-flight bucket buffers (see the Note)
    scratch_bytes: float = 0.0  # receive buffers + autograd's largest gradient (see the Note)
    # offload_optimizer="nvme": the Adam moments on disk (out of optim_bytes), the staging
    # buffers in RAM (in total_bytes), the bytes read plus written per step, per rank
    offload_disk_bytes: float = 0.0
    offload_staging_bytes: float = 0.0
    offload_io_bytes: float = 0.0
    # stage 3's secondary shard (hpZ): the 1/K of every unit's params kept from its forward to
    # its backward, at its peak (the end of the forward); in total_bytes
    secondary_bytes: float = 0.0
    shard_size: int = 0  # ranks each state is sharded over (the world unless hierarchical)
    # offload_optimizer="cpu" (the host tier): the masters and moments in host memory (out of
    # optim_bytes and the device's total) with the pinned staging of one gradient shard and one
    # param shard; the bytes crossing the bus per step (gradient shard down, param shard up,
    # and an fp32 param shard down too: it has no master)
    offload_host_bytes: float = 0.0
    offload_bus_bytes: float = 0.0
    # params that do not train (a frozen base under adapters): whole on every rank at every
    # stage (ZeroOptimizer's stage 3 does not shard them either); in total_bytes
    frozen_bytes: float = 0.0

    def as_dict(self) -> dict:
        return asdict(self)


def _check_divides(name: str, k, total: int, what: str) -> None:
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= total or total % k:
        raise ValueError(f"{name} must be a rank count dividing {what}; got {k!r}")


def estimate_stage(
    stage: int,
    n_params: int,
    world_size: int,
    *,
    precision: str = "mixed",
    optimizer: str = "adam",
    optim_bytes_total: float | None = None,
    largest_layer: int | None = None,
    prefetch: int = 1,
    gpu_mem: int | None = None,
    bucket_mb: float = DEFAULT_BUCKET_MB,
    max_inflight_buckets: int = 2,
    root_params: int = 0,
    reshard_after_forward: bool = True,
    largest_param: int | None = None,
    comm_scratch: str = "pairwise",
    offload_optimizer: str | None = None,
    offload_staging_mb: float = 48.0,
    offload_params: str | None = None,
    state_dtype: str = "fp32",
    shard_size: int | None = None,
    secondary_shard: int | None = None,
    frozen_params: int = 0,
    shard_frozen: bool = False,
) -> StageEstimate:
    """Per-rank model-state bytes, comm buffers and per-step communication of one stage (see
    the Note above); ``bucket_mb`` / ``max_inflight_buckets`` / ``reshard_after_forward`` as
    ZeroOptimizer's (stage 3 without resharding: every unit stays gathered from its forward to
    its backward, so the live window is the whole model, and params are gathered once: 2Ψ).
    ``largest_param``: elements of the largest param, whose gradient autograd allocates whole
    (counted in ``scratch_bytes``). ``comm_scratch``: the collectives' scratch in
    ``scratch_bytes``, "pairwise" (receive buffers), "shm" (the shared-memory slots, what the
    probe picks for ranks on one host: at most `SHM_SLOT_BYTES` per process group, one group
    at stages 1-2, two at stage 3 where the reduce-scatters have a group of their own) or
    "pairwise+shm" (both: the probe chose per size class, some each way).
    ``offload_optimizer="cpu"`` (stages 1-3, adam; [Note: host tier]): the masters and moments
    leave the device (``optim_bytes`` 0) for ``offload_host_bytes`` with the pinned staging;
    ``offload_bus_bytes`` cross the bus per step.
    ``offload_optimizer="nvme"`` (stages 1-3, adam): the fp32 moments (8 bytes per param) leave
    ``optim_bytes`` for ``offload_disk_bytes``, the staging buffers join the total, and every
    step reads and writes them once (``offload_io_bytes``; [Note: offload]).
    ``offload_params="nvme"`` (stage 3): the param shards and the fp32 masters go to disk too
    (the gathered window stays in ``live_bytes``); a step reads each shard three times (the
    forward's and the backward's all-gathers, the step) and writes it once, and reads and
    writes the masters once ([Note: param offload]).
    ``shard_size=K`` (``shard_group``, [Note: hierarchy] in `zero_kernels.comm.hier`): the
    states are sharded over groups of K ranks and replicated across the N/K groups: shards
    are 1/K; the gradients are reduce-scattered inside the group and their shards all-reduced
    across the groups (2 (R-1)/R of the shard on the wire, R = N/K replicas).
    ``secondary_shard=S`` (stage 3, hpZ, [Note: secondary shard]): each rank keeps 1/S of every
    unit's gathered params from its forward to its backward (``secondary_bytes``, all but the
    root unit's ``root_params``: the peak, at the end of the forward), and the backward's
    all-gathers run over the S ranks of its block.
    ``frozen_params``: params that do not train, at the params' dtype, whole on every rank at
    every stage (``frozen_bytes``, in the total): they have no gradient or optimizer state,
    and ZeroOptimizer's stage 3 keeps them whole unless ``shard_frozen`` (stage 3: 1/N per
    rank, all-gathered with their units as the trained params are: their bytes join
    ``comm_bytes`` and ``wire_bytes``; the live window counts the trained params only)."""
    if offload_params not in (None, "nvme", "cpu"):
        raise ValueError(f"--offload-params must be nvme or cpu; got {offload_params!r}")

    if offload_params and stage != 3:
        raise ValueError(f"--offload-params is a stage-3 option; got stage {stage}")
    if offload_optimizer not in (None, "nvme", "cpu"):
        raise ValueError(f"--offload-optimizer must be nvme or cpu; got {offload_optimizer!r}")
    if (offload_params == "cpu") != (offload_optimizer == "cpu") and offload_params:
        raise ValueError(
            "--offload-params cpu goes with --offload-optimizer cpu (and nvme with nvme or "
            f"alone); got --offload-optimizer {offload_optimizer} --offload-params {offload_params}"
        )
    if offload_optimizer and stage == 0:
        raise ValueError("--offload-optimizer is a ZeroOptimizer option (stages 1-3), not DDP's")
    if offload_optimizer and OPTIMIZERS.get(optimizer) != 2:
        raise ValueError(
            f"--offload-optimizer {offload_optimizer} offloads the fused Adam step's state; got "
            f"--optimizer {optimizer}"
        )
    if stage not in STAGES:
        raise ValueError(f"--stage must be one of {STAGES}; got {stage!r}")
    if world_size < 1:
        raise ValueError(f"--world-size must be >= 1; got {world_size}")
    shard_size = world_size if shard_size is None else shard_size
    _check_divides("--shard-group", shard_size, world_size, f"--world-size {world_size}")
    if stage == 0 and shard_size != world_size:
        raise ValueError("--shard-group is a ZeroOptimizer option (stages 1-3), not DDP's")
    if secondary_shard is not None:
        if stage != 3:
            raise ValueError(f"--secondary-shard is a stage-3 option; got stage {stage}")
        what = f"the shard group's {shard_size} ranks"
        _check_divides("--secondary-shard", secondary_shard, shard_size, what)
    prec = precision_of(precision)
    psi, n = float(n_params), float(shard_size)
    replicas = world_size // shard_size
    p, g = prec.param_bytes * psi, prec.grad_bytes * psi
    k = (
        optimizer_state_bytes(optimizer, prec, n_params)
        if optim_bytes_total is None
        else float(optim_bytes_total)
    )
    live = 0.0
    if stage == 0:
        pb, gb, ob = p, g, k
    elif stage == 1:
        pb, gb, ob = p, g, k / n
    elif stage == 2:
        pb, gb, ob = p, g / n, k / n
    else:
        pb, gb, ob = p / n, g / n, k / n
        if not reshard_after_forward:
            live = p
        elif largest_layer:
            live = (root_params + (1 + prefetch) * largest_layer) * prec.param_bytes
    ring = (n - 1) / n
    if stage == 0:
        ar, rs, ag, elems = g, 0.0, 0.0, 2.0
        wire = 2 * ring * g
    elif stage in (1, 2):
        ar, rs, ag, elems = 0.0, g, p, 2.0
        wire = ring * (g + p)
    elif not reshard_after_forward:
        ar, rs, ag, elems = 0.0, g, p, 2.0
        wire = ring * (g + p)
    else:
        ar, rs, ag, elems = 0.0, g, 2 * p, 3.0
        wire = ring * (g + 2 * p)
    if stage and replicas > 1:  # the gradient shards all-reduced across the replica groups
        ar += g / n
        wire += 2 * (replicas - 1) / replicas * g / n
    second = 0.0
    if secondary_shard is not None:
        second = max(psi - root_params, 0.0) * prec.param_bytes / secondary_shard
        if reshard_after_forward:  # the backward's gathers: ring over the block, not the group
            wire += ((secondary_shard - 1) / secondary_shard - ring) * p
    disk = staging = io = host = bus = 0.0
    if offload_optimizer == "cpu":
        shard = psi / n
        fetch = prec.param_bytes if prec.master_bytes == 0 else 0  # fp32: no master
        host = ob + (prec.grad_bytes + prec.param_bytes) * shard
        bus = (prec.grad_bytes + prec.param_bytes + fetch) * shard
        ob = 0.0
        if offload_params == "cpu":  # the shards themselves on the host, not staged
            gathers = 2 if reshard_after_forward else 1  # each all-gather copies its input in
            bus = (prec.grad_bytes + gathers * prec.param_bytes) * shard
            pb = 0.0
    elif offload_optimizer:  # nvme
        moments = {"fp32": 8.0, "bf16": 4.0}.get(state_dtype, 2 + 8 / 256)  # per param
        disk = moments * psi / n  # exp_avg + exp_avg_sq (+ int8 scales), this rank's shard
        ob -= disk
        staging = offload_staging_mb * 2**20
        io = 2 * disk
    if offload_params == "nvme":
        masters = prec.master_bytes * psi / n
        disk += pb + masters
        io += 4 * pb + 2 * masters
        pb, ob = 0.0, ob - masters
    if not isinstance(frozen_params, int) or frozen_params < 0:
        raise ValueError(f"--frozen must be a param count >= 0; got {frozen_params!r}")
    frozen = frozen_params * prec.param_bytes
    if shard_frozen and stage == 3:  # [Note: frozen shards]: gathered as the trained params
        gathered = (2 if reshard_after_forward else 1) * frozen
        ag += gathered
        wire += ring * gathered
        frozen = frozen / n
    elif shard_frozen:
        raise ValueError(f"--shard-frozen is a stage-3 option; got stage {stage}")
    total = pb + gb + ob + live + staging + second + frozen
    comm_bytes = 2 * ar + rs + ag  # an all-reduce is a reduce-scatter plus an all-gather
    buffers = 0.0
    if stage == 2:
        # each buffer is sized to its bucket: the max_inflight largest buckets, at most all grads
        buffers = min(max_inflight_buckets * bucket_mb * 2**20, GRAD_REDUCE_BYTES * psi)
    elif stage == 3 and largest_layer:  # a bucket is a layer (or the root unit)
        biggest = sorted([root_params] + [largest_layer] * max_inflight_buckets, reverse=True)
        buffers = min(sum(biggest[:max_inflight_buckets]), psi) * GRAD_REDUCE_BYTES
    # scratch: the shm slots (per process group), the pairwise reduce-scatters' receive buffers
    # (one shard per peer whose chunk does not land in the output: N-1 in place (stage 1, in
    # max_inflight buckets of its full gradient buffer), N-2 into a separate shard (stages 2/3,
    # per in-flight bucket buffer)), and autograd's whole gradient of the largest param before
    # the hook buckets it
    kinds = ("pairwise", "shm", "pairwise+shm")
    if comm_scratch not in kinds:
        raise ValueError(f"comm_scratch must be one of {kinds}; got {comm_scratch!r}")
    recv = 0.0
    if "shm" in comm_scratch and stage != 0 and n > 1:
        recv += (2 if stage == 3 else 1) * SHM_SLOT_BYTES
    if "pairwise" in comm_scratch and stage == 1:
        recv += (n - 1) / n * min(max_inflight_buckets * bucket_mb * 2**20, GRAD_REDUCE_BYTES * psi)
    elif "pairwise" in comm_scratch and stage in (2, 3):
        recv += max(n - 2, 0) / n * buffers
    scratch = recv + (largest_param or 0) * prec.param_bytes
    fits = None if gpu_mem is None else total + buffers + scratch <= gpu_mem
    return StageEstimate(
        stage=stage,
        world_size=world_size,
        params_bytes=pb,
        grads_bytes=gb,
        optim_bytes=ob,
        live_bytes=live,
        total_bytes=total,
        comm_elements=elems * psi,
        comm_bytes=comm_bytes,
        all_reduce_bytes=ar,
        reduce_scatter_bytes=rs,
        all_gather_bytes=ag,
        wire_bytes=wire,
        fits=fits,
        comm_buffer_bytes=buffers,
        scratch_bytes=scratch,
        offload_disk_bytes=disk,
        offload_staging_bytes=staging,
        offload_io_bytes=io,
        secondary_bytes=second,
        shard_size=shard_size,
        offload_host_bytes=host,
        offload_bus_bytes=bus,
        frozen_bytes=frozen,
    )


@dataclass(frozen=True)
class Estimate:
    n_params: int
    world_size: int
    precision: str
    optimizer: str
    model: str | None
    largest_layer: int | None
    stages: list[StageEstimate] = field(default_factory=list)
    bucket_mb: float = DEFAULT_BUCKET_MB
    frozen_params: int = 0
    tp: int = 1  # tensor-parallel size: the stages above hold each rank's params / tp

    def as_dict(self) -> dict:
        d = asdict(self)
        d["stages"] = [s.as_dict() for s in self.stages]
        return d


def estimate(
    n_params: int | None = None,
    world_size: int = 1,
    *,
    model: str | None = None,
    precision: str = "mixed",
    optimizer: str = "adam",
    prefetch: int = 1,
    gpu_mem: int | None = None,
    stages: Sequence[int] = STAGES,
    bucket_mb: float = DEFAULT_BUCKET_MB,
    max_inflight_buckets: int = 2,
    offload_optimizer: str | None = None,
    offload_staging_mb: float = 48.0,
    offload_params: str | None = None,
    state_dtype: str = "fp32",
    state_block: int = 256,
    shard_size: int | None = None,
    secondary_shard: int | None = None,
    frozen: int | None = None,
    shard_frozen: bool = False,
    tp: int = 1,
) -> Estimate:
    """All stages for a parameter count or a model spec (see `model_info`); with
    ``offload_optimizer``, stages 1-3 offload (DDP's row stays as it is); with
    ``offload_params``, stage 3's params and masters too; with ``state_dtype`` (adam), stages
    1-3 keep the moments in bf16 or int8 (DDP's row stays torch's fp32 state); with
    ``shard_size`` (hierarchical sharding) stages 1-3 shard over groups of that many ranks;
    with ``secondary_shard``, stage 3 keeps hpZ's secondary shard; ``frozen`` (with a param
    count; a model counts its own requires_grad=False params) adds params that do not train,
    which ``shard_frozen`` shards at stage 3. ``tp``: tensor parallelism of that size beside
    the ``world_size`` data-parallel ranks (`zero_kernels.optimizer.tensor_parallel`): each rank
    holds 1/tp of every param (its local tensors), which ZeRO shards over dp, so every row is
    the stage's formula over params / tp (rounded up; tp's own activation collectives are not
    counted)."""
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ValueError(f"--tp must be an int >= 1, got {tp!r}")
    shapes = None
    largest = None
    if model is not None:
        if frozen is not None:
            raise ValueError(
                "--frozen goes with --params; --model counts the model's own frozen params "
                "(requires_grad=False)"
            )
        info = model_info(model)
        shapes, largest = info.shapes, info.largest_layer
        n_params, frozen = info.n_params, info.frozen
    if n_params is None:
        raise ValueError("give --params or --model")
    if tp > 1:  # each rank's local tensors: a 1/tp slice of every param
        n_params = -(-n_params // tp)
        largest = -(-largest // tp) if largest else largest
        if shapes:
            shapes = tuple((-(-s[0] // tp), *s[1:]) if s else s for s in shapes)
        frozen = -(-frozen // tp) if frozen else frozen
    frozen = frozen or 0
    prec = _choice("--precision", precision, PRECISIONS, _PRECISION_ALIASES)
    opt = _choice("--optimizer", optimizer, OPTIMIZERS, {"sgd_momentum": "sgd-momentum"})
    k = optimizer_state_bytes(opt, prec, n_params, shapes)
    k_low = optimizer_state_bytes(opt, prec, n_params, shapes, state_dtype, state_block)
    rows = [
        estimate_stage(
            s,
            n_params,
            world_size,
            precision=prec,
            optimizer=opt,
            optim_bytes_total=k_low if s else k,
            largest_layer=largest,
            prefetch=prefetch,
            gpu_mem=gpu_mem,
            bucket_mb=bucket_mb,
            max_inflight_buckets=max_inflight_buckets,
            largest_param=max((math.prod(x) for x in shapes), default=0) if shapes else None,
            offload_optimizer=offload_optimizer if s else None,
            offload_staging_mb=offload_staging_mb,
            offload_params=offload_params if s == 3 else None,
            state_dtype=state_dtype if s else "fp32",
            shard_size=shard_size if s else None,
            secondary_shard=secondary_shard if s == 3 else None,
            frozen_params=frozen,
            shard_frozen=shard_frozen and s == 3,
        )
        for s in stages
    ]
    return Estimate(n_params, world_size, prec, opt, model, largest, rows, bucket_mb, frozen, tp)
