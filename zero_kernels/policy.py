"""Named, frozen policies: every choice of a `ZeroOptimizer`, each in one documented field.

[Note: policies]
The options live once, as fields of these objects (a docstring under each field: what it does,
its default, its cost). `ZeroOptimizer` takes ``stage=`` as the shorthand of the shard policy and
the other policies as keywords of their own (``gather=``, ``precision=``, ``comm=``,
``offload=``, ``execution=``), or one `ZeroPolicy` holding them all (``policy=``: a run's whole
configuration as one value to print, compare across ranks, save and rebuild from). The parts
below the facade (the gradient store and reducer, the param store, the unit scheduler) read a
policy field, never ``stage`` or a keyword. A new option is a field of one policy and the one
place that acts on it.

    ShardPolicy      what stays whole on every rank between uses: the ZeRO stage
                     (stage 1: params and grads, 2: params, 3: nothing)
    GatherPolicy     stage 3: when params are gathered and freed (resharding, prefetch, params
                     kept whole, the module-order check, hpZ, frozen shards); stages 1/2: the
                     step's all-gathers left in flight for the next forward
    PrecisionPolicy  the gradient reduction's dtype, the loss scale, the optimizer state's dtype;
                     the params keep their own dtype, with fp32 masters where they are lower
    CommPolicy       buckets, overlap, timeouts, the shard group (hierarchy), quantized
                     collectives, the module's buffers
    OffloadPolicy    offload tiers: the Adam moments and stage 3's param shards on NVMe or host
    ExecutionPolicy  how each rank runs its part: the layout of the optimizer's state, the fused
                     Adam kernel, what a non-finite step does, the host block cache, and how a
                     model built on the meta device is materialized
    ZeroPolicy       the six together

``ZeroPolicy.resolve(stage=3, prefetch=2, bucket_size_mb=50)`` builds one from flat field names
(each name belongs to one policy): the form for configuration files and sweeps
(`zero_kernels.integrations.ds_config` maps DeepSpeed's keys onto it). As FSDP2's
``MixedPrecisionPolicy``/``OffloadPolicy`` do, each policy checks its own fields, naming the
argument and the value.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import torch

__all__ = [
    "CommPolicy",
    "ExecutionPolicy",
    "GatherPolicy",
    "OffloadPolicy",
    "PrecisionPolicy",
    "ShardPolicy",
    "ZeroPolicy",
]


@dataclass(frozen=True)
class ShardPolicy:
    """What stays whole on every rank between uses: the ZeRO stage (``stage=`` builds it with
    `ShardPolicy.of_stage`). Memory per rank of params + grads + Adam state (P params, N ranks,
    fp32): stage 1 ``8P + 8P/N``, stage 2 ``4P + 12P/N``, stage 3 ``16P/N`` plus the units in use
    (docs/stages.md)."""

    params: bool = True
    """True: params stay whole between steps (stages 1 and 2); False: each unit's params are
    gathered for its forward and backward and freed after (stage 3: an all-gather per use)."""
    grads: bool = False
    """True: a full-size local gradient buffer, reduced in place (stage 1); False: only this
    rank's reduced shard is kept, bucket buffers live while they are filled (stages 2, 3)."""

    def __post_init__(self):
        for name in ("params", "grads"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"ShardPolicy.{name} must be a bool, got {getattr(self, name)!r}")
        if self.grads and not self.params:
            raise ValueError(
                "ShardPolicy(params=False, grads=True): whole gradients of sharded params are "
                "not a ZeRO stage (stage 3 shards both)"
            )

    @classmethod
    def of_stage(cls, stage: int) -> ShardPolicy:
        if isinstance(stage, bool) or stage not in (1, 2, 3):
            raise ValueError(f"stage must be the int 1, 2 or 3, got stage={stage!r}")
        return cls(params=stage != 3, grads=stage == 1)

    @property
    def stage(self) -> int:
        """The ZeRO stage this is (for reports, checkpoints and the estimator)."""
        return 1 if self.grads else 2 if self.params else 3


@dataclass(frozen=True)
class GatherPolicy:
    """When params are gathered and freed (stage 3's units; stages 1/2's step all-gathers)."""

    reshard_after_forward: bool = True
    """Stage 3: free a unit after its forward and gather it again for its backward (default);
    False keeps it from its forward to the end of the backward (one all-gather less per unit,
    the unit's whole params held that long)."""
    prefetch: int = 1
    """Stage 3: units whose all-gathers start ahead of their use (default 1); each costs one
    unit's gathered params of memory."""
    persist_below: int = 0
    """Stage 3: params of fewer elements are kept whole on every rank (no gather; default 0,
    none): DeepSpeed's ``stage3_param_persistence_threshold``."""
    check_order: str | None = None
    """Stage 3 (None: "pass"): every mode checks in the first forward that every rank runs the
    same units in the same order. "pass" also compares a hash of each pass's all-gathers,
    reduce-scatters and unit forwards at the end of every forward and backward (one small
    all-reduce on a side group per pass): a later change of modules on some rank is a
    ValueError on every rank before an output of that pass is used; a rank that runs fewer
    modules is found once a wait has lasted 2 s. "every" compares before each launch (1.06-1.30x
    step time measured). "first": the first forward only."""
    overlap_param_gather: bool = False
    """Stages 1/2 with the model: ``step()`` returns with the all-gathers of the new params in
    flight, and each module's forward pre-hook waits for the buckets holding its params, so they
    overlap the next forward (as Megatron's). Params read before the next forward are incomplete
    until ``opt.wait_params()`` (state dicts and this optimizer's methods call it)."""
    secondary_shard: object = None
    """Stage 3 (ZeRO++'s hpZ): None (default), "node" or an int K. After a unit's forward each
    rank keeps 1/K of its gathered params (K: the ranks of one node, or consecutive blocks of K
    ranks), and the unit's backward all-gathers inside those K ranks instead of the shard group.
    Costs 1/K of every unit's params per rank from its forward to its backward; results equal
    those without it ([Note: secondary shard] in `zero_kernels.partition.secondary`)."""
    shard_frozen: bool = False
    """Stage 3: the model's params that do not train (``requires_grad=False``: a frozen base
    under adapters) are sharded 1/N per rank and gathered with their unit as the trained ones
    are (as FSDP's and DeepSpeed's); False (default) keeps them whole on every rank ([Note:
    frozen shards] in `zero_kernels.partition.frozen`)."""

    def __post_init__(self):
        if not isinstance(self.reshard_after_forward, bool):
            raise TypeError(
                "reshard_after_forward must be a bool, got "
                f"reshard_after_forward={self.reshard_after_forward!r}"
            )
        p = self.prefetch
        if isinstance(p, bool) or not isinstance(p, int) or p < 0:
            raise ValueError(f"prefetch must be an int >= 0, got prefetch={p!r}")
        pb = self.persist_below
        if isinstance(pb, bool) or not isinstance(pb, int) or pb < 0:
            raise ValueError(f"persist_below must be an int >= 0, got persist_below={pb!r}")
        if self.check_order not in (None, "first", "pass", "every"):
            raise ValueError(
                "check_order must be 'pass', 'every' or 'first', got "
                f"check_order={self.check_order!r}"
            )
        if not isinstance(self.shard_frozen, bool):
            raise TypeError(f"shard_frozen must be a bool, got shard_frozen={self.shard_frozen!r}")
        ss = self.secondary_shard
        if ss not in (None, "node") and (isinstance(ss, bool) or not isinstance(ss, int) or ss < 1):
            raise ValueError(
                f"secondary_shard must be None, 'node' or an int >= 1, got secondary_shard={ss!r}"
            )
        if ss is not None and not self.reshard_after_forward:
            raise ValueError(
                f"secondary_shard={ss!r} with reshard_after_forward=False: the units stay "
                "gathered from their forward to their backward, there is nothing to keep a "
                "secondary shard of; drop one of them"
            )


_REDUCE_DTYPES = (None, torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class PrecisionPolicy:
    """Dtypes of the reduction and the optimizer state, and the loss scale. The params keep
    their own dtype, with fp32 masters where they are lower ([Note: modes] in
    `zero_kernels.partition.runner`)."""

    reduce_dtype: torch.dtype | None = None
    """Stages 2/3: the dtype gradients are accumulated and reduce-scattered in (None: fp32;
    float64 params: float64). ``torch.bfloat16`` halves the bytes; the result is added into the
    fp32 gradient shard (accuracy cost in docs/benchmarks.md)."""
    loss_scale: float | str | None = "auto"
    """None, a positive number (static), "dynamic", or "auto" (default: dynamic with fp16
    params, else none). A scaled step with inf/NaN gradients is skipped and the scale lowered."""
    state_dtype: str = "fp32"
    """How the fused Adam step keeps exp_avg/exp_avg_sq: "fp32" (torch's, 8 bytes per param),
    "bf16" (4) or "int8" (blockwise, 2 + 8/state_block); fp32 math in every case. Needs the
    fused step (Adam/AdamW, flat layout, no amsgrad). Checkpoints hold the moments as they are
    and load into any state_dtype ([Note: low-bit state] in `zero_kernels.ops.lowbit`)."""
    state_block: int = 256
    """int8 state: elements per quantization block (a multiple of 64 up to 4096)."""
    bf16_stochastic_round: bool = False
    """bf16 params stepped without fp32 masters (4 bytes per param less): the fused step runs on
    an fp32 copy of each bucket's shard and writes it back rounded stochastically ([Note:
    stochastic rounding] in `zero_kernels.ops.sr`)."""

    def __post_init__(self):
        from .ops.lowbit import check_state_dtype

        check_state_dtype(self.state_dtype, self.state_block)
        sr = self.bf16_stochastic_round
        if not isinstance(sr, bool):
            raise TypeError(f"bf16_stochastic_round must be a bool, got {sr!r}")
        if self.reduce_dtype not in _REDUCE_DTYPES:
            raise ValueError(
                "reduce_dtype must be None, torch.float32, torch.bfloat16 or torch.float16, "
                f"got reduce_dtype={self.reduce_dtype!r}"
            )
        if self.reduce_dtype == torch.float32:  # the default: fp32 (float64 params: float64)
            object.__setattr__(self, "reduce_dtype", None)
        ls = self.loss_scale
        if not (
            ls is None
            or ls in ("auto", "dynamic")
            or (isinstance(ls, (int, float)) and not isinstance(ls, bool) and ls > 0)
        ):
            raise ValueError(
                "loss_scale must be None, 'auto', 'dynamic' or a positive number, "
                f"got loss_scale={ls!r}"
            )


@dataclass(frozen=True)
class CommPolicy:
    """How gradients and params move: buckets, overlap, timeouts, the shard group, quantized
    collectives, the module's buffers."""

    bucket_size_mb: float = 25.0
    """A gradient bucket's target size in MiB at 4 bytes per element (default 25): larger
    buckets mean fewer collectives and more memory in flight."""
    overlap_comm: bool = True
    """Reduce each bucket during backward as it fills (default); False reduces all at the end."""
    max_inflight_buckets: int = 2
    """Stages 2/3: most bucket buffers held at once (filled or reduce-scattered); beyond it the
    oldest reduce-scatter is waited for and its buffer reused (1: no overlap). Stage 1: most
    reduce-scatters in flight. Bounds communication memory to this many buckets."""
    timeout: float | None = None
    """Seconds bounding every collective of backward and step (None: the process group's own,
    30 min on gloo): a rank that stalls, dies or raises makes the others raise
    `zero_kernels.comm.CollectiveTimeout` naming the step, the phase and the bucket or unit.
    Collective-only calls (``consolidated_state_dict``, ``full_param``) check arrival within it
    (default 300)."""
    shard_group: object = "world"
    """The ranks the state is sharded over, replicated across the others ([Note: hierarchy] in
    `zero_kernels.comm.hier`): "world" (default: the whole process group), "node" (the ranks of
    each host), an int K (consecutive blocks of K ranks) or a torch ``DeviceMesh`` (replicate x
    shard, as FSDP2's HSDP takes it). Params gather inside the shard group; gradients
    reduce-scatter there, then all-reduce across groups at shard size."""
    quantize_weights: str | None = None
    """Stage 3 (ZeRO++'s qwZ): None or "int8"/"int4": the per-use all-gathers send the other
    ranks' chunks blockwise-quantized (a quarter / an eighth of fp32's bytes); params of one
    dimension are kept whole and exact; shards, step, gradients and every gather that hands
    params out stay exact ([Note: quantized all-gather] in `zero_kernels.comm.quant`)."""
    quantize_grads: str | None = None
    """None or "int8"/"int4" (ZeRO++'s qgZ): each gradient bucket's reduce-scatter sends the
    other ranks' chunks blockwise-quantized and sums in fp32, the own chunk exact; inf/NaN
    still reach ``nonfinite``; params of one dimension reduce exact in buckets of their own
    ([Note: quantized reduce-scatter] in `zero_kernels.comm.quant`). A flat group whose ranks
    are on several nodes of >= 2 ranks each reduces in two hops instead: exact among a node's
    ranks, then quantized across the nodes on the node's slice, 1/L of one hop's bytes across
    ([Note: two-hop quantized reduce-scatter] in `zero_kernels.comm.hier_quant`;
    ``ZERO_KERNELS_GRAD_HOPS=1`` keeps one hop)."""
    grad_error_feedback: bool = False
    """With ``quantize_grads``: what each quantization drops is kept per rank (fp32, one
    gradient shard's bytes) and added to the next step's gradient before it is quantized
    ([Note: error feedback] in `zero_kernels.comm.quant`)."""
    broadcast_buffers: bool = True
    """Rank 0's module buffers broadcast to every rank before a forward that follows a training
    forward (and before the first), as DDP's option of that name ([Note: replicated module
    state] in `zero_kernels.optimizer.replicas`)."""

    def __post_init__(self):
        b = self.bucket_size_mb
        if isinstance(b, bool) or not isinstance(b, (int, float)) or not 0 < b < math.inf:
            raise ValueError(
                f"bucket_size_mb must be a finite number > 0, got bucket_size_mb={b!r}"
            )
        m = self.max_inflight_buckets
        if isinstance(m, bool) or not isinstance(m, int) or m < 1:
            raise ValueError(
                f"max_inflight_buckets must be an int >= 1, got max_inflight_buckets={m!r}"
            )
        t = self.timeout
        if t is not None and (isinstance(t, bool) or not isinstance(t, (int, float)) or t <= 0):
            raise ValueError(f"timeout must be None or seconds > 0, got timeout={t!r}")
        qw = self.quantize_weights
        if qw is not None and qw not in ("int8", "int4"):
            raise ValueError(
                f"quantize_weights must be None, 'int8' or 'int4', got quantize_weights={qw!r}"
            )
        qg = self.quantize_grads
        if qg is not None and qg not in ("int8", "int4"):
            raise ValueError(
                f"quantize_grads must be None, 'int8' or 'int4', got quantize_grads={qg!r}"
            )
        ef = self.grad_error_feedback
        if not isinstance(ef, bool):
            raise TypeError(f"grad_error_feedback must be a bool, got grad_error_feedback={ef!r}")
        if ef and qg is None:
            raise ValueError(
                "grad_error_feedback=True keeps what quantize_grads drops: it needs "
                "quantize_grads='int8' or 'int4'"
            )
        bb = self.broadcast_buffers
        if not isinstance(bb, bool):
            raise TypeError(f"broadcast_buffers must be a bool, got broadcast_buffers={bb!r}")
        sg = self.shard_group
        mesh = type(sg).__name__ == "DeviceMesh" and hasattr(sg, "get_group")
        if not mesh and sg not in ("world", "node"):
            if isinstance(sg, bool) or not isinstance(sg, int) or sg < 1:
                raise ValueError(
                    "shard_group must be 'world', 'node', an int >= 1 or a torch DeviceMesh, "
                    f"got shard_group={sg!r}"
                )


@dataclass(frozen=True)
class OffloadPolicy:
    """Where state lives when it is not in use ([Note: offload] in `zero_kernels.offload`)."""

    offload_optimizer: str | None = None
    """None; "nvme": the fused Adam step's moments in a file under ``offload_dir``, read chunk
    by chunk ahead of the step and written behind it (results bitwise those without offload);
    "cpu": for params on a GPU, the fp32 masters and the moments in host memory and the step on
    the CPU kernel ([Note: host tier] in `zero_kernels.offload.host`)."""
    offload_params: str | None = None
    """Stage 3: None; "nvme": each bucket's param shard in a file under ``offload_dir`` between
    its uses, read ahead of its all-gathers and its step ([Note: param offload] in
    `zero_kernels.offload.params`); "cpu" (with ``offload_optimizer="cpu"``): the shards in
    pinned host memory, copied to the device as the input of each all-gather."""
    offload_dir: str | None = None
    """The folder for "nvme" (needed then, refused otherwise); may differ per rank."""
    offload_staging_mb: float = 48.0
    """MiB of staging buffers in all for "nvme" (three: stepping, reading ahead, writing
    behind; at least 0.1)."""

    def __post_init__(self):
        v = self.offload_optimizer
        if v not in (None, "cpu", "nvme"):
            raise ValueError(f"offload_optimizer must be None, 'cpu' or 'nvme', got {v!r}")
        q = self.offload_params
        if q not in (None, "cpu", "nvme"):
            raise ValueError(f"offload_params must be None, 'cpu' or 'nvme', got {q!r}")
        if q == "cpu" and v != "cpu":
            raise ValueError(
                "offload_params='cpu' keeps the param shards where the host tier steps them: "
                f"it needs offload_optimizer='cpu', got offload_optimizer={v!r}"
            )
        if v == "cpu" and q == "nvme":
            raise NotImplementedError(
                "offload_optimizer='cpu' with offload_params='nvme' is not built yet; use "
                "'nvme' for both, or 'cpu' for both"
            )
        for name, w in (("offload_optimizer", v), ("offload_params", q)):
            if w == "nvme" and not self.offload_dir:
                raise ValueError(
                    f"{name}='nvme' needs offload_dir= (a folder on the disk to use; "
                    f"got offload_dir={self.offload_dir!r})"
                )
        if "nvme" not in (v, q) and self.offload_dir is not None:  # the "cpu" tiers take none
            raise ValueError(
                f"offload_dir={self.offload_dir!r} given without offload_optimizer='nvme' or "
                "offload_params='nvme'"
            )
        k = self.offload_staging_mb
        if isinstance(k, bool) or not isinstance(k, (int, float)) or not k >= 0.1:
            raise ValueError(f"offload_staging_mb must be a number >= 0.1 (MiB), got {k!r}")


NONFINITE = ("step", "skip", "raise")
PARTITIONS = ("auto", "flat", "whole")


@dataclass(frozen=True)
class ExecutionPolicy:
    """How each rank runs its part: the layout of the optimizer's state, the fused kernel, what
    a non-finite step does, the host block cache, and how a meta-device model is materialized."""

    partition: str = "auto"
    """"auto" (default: flat shards for element-wise optimizers, whole params for the others),
    "flat" or "whole" ([Note: modes] in `zero_kernels.partition.runner`)."""
    fused_adam: bool = True
    """torch's Adam/AdamW (flat layout) step through `zero_kernels.ops.adam_step`, one pass
    over each shard (default); False runs the torch optimizer on the shard."""
    kernel_backend: str = "auto"
    """The fused step's kernel: "auto" (default: CUDA, Triton or CPU by the params' device),
    "cpu", "cuda", "triton" or "reference" (`zero_kernels.ops`)."""
    nonfinite: str = "step"
    """What a step does with inf/NaN gradients: "step" (default, torch's behaviour: step
    anyway, counted in ``comm_stats["nonfinite_steps"]``, the first one logged), "skip" (every
    rank skips the step) or "raise". With a loss scale the step is always skipped."""
    host_cache: bool | None = None
    """Params on the CPU: make the host block cache torch's CPU allocator for blocks of 1 MiB
    and more (process-wide, [Note: host block cache] in `zero_kernels.hostmem`). None (default):
    on unless ``ZERO_KERNELS_HOST_CACHE=0`` or ``zero_kernels.hostmem.disable()``; False: not
    installed by this optimizer. ``opt.host_cache`` says whether it is in use."""
    init_fn: object = None
    """Stage 3, a model built on the meta device: called as ``init_fn(module)`` for each
    module as its unit is materialized into its shard (None: the module's own
    ``reset_parameters``); may differ in identity across ranks, not in effect."""
    seed: int = 0
    """The RNG seed each unit's materialization starts from (default 0): every rank draws the
    same values whatever the world size."""

    def __post_init__(self):
        from .ops.backends import BACKENDS

        if self.partition not in PARTITIONS:
            raise ValueError(
                f"partition must be one of {PARTITIONS}, got partition={self.partition!r}"
            )
        if not isinstance(self.fused_adam, bool):
            raise TypeError(f"fused_adam must be a bool, got fused_adam={self.fused_adam!r}")
        if self.kernel_backend not in BACKENDS:
            raise ValueError(
                f"kernel_backend must be one of {BACKENDS}, got "
                f"kernel_backend={self.kernel_backend!r}"
            )
        if self.nonfinite not in NONFINITE:
            raise ValueError(
                f"nonfinite must be one of {NONFINITE}, got nonfinite={self.nonfinite!r}"
            )
        if self.host_cache not in (None, True, False):
            raise TypeError(
                f"host_cache must be None, True or False, got host_cache={self.host_cache!r}"
            )
        if self.init_fn is not None and not callable(self.init_fn):
            raise TypeError(f"init_fn must be None or a callable, got init_fn={self.init_fn!r}")
        s = self.seed
        if isinstance(s, bool) or not isinstance(s, int):
            raise TypeError(f"seed must be an int, got seed={s!r}")


# the parts of a ZeroPolicy: (field, class, the ZeroOptimizer keyword that takes it)
PARTS = (
    ("shard", ShardPolicy),
    ("gather", GatherPolicy),
    ("precision", PrecisionPolicy),
    ("comm", CommPolicy),
    ("offload", OffloadPolicy),
    ("execution", ExecutionPolicy),
)


def option_owner(name: str) -> str | None:
    """The part (``"comm"``, ...) whose field ``name`` is, for the flat names of
    `ZeroPolicy.resolve`; None where no policy has it."""
    for part, cls in PARTS[1:]:
        if name in {f.name for f in dataclasses.fields(cls)}:
            return part
    return None


def flat_option_error(where: str, names) -> TypeError:
    """The error for policy fields given as flat keywords (``names``): each named with its
    policy, and both ways to pass them."""
    names = sorted(names)
    cls = dict((p, c.__name__) for p, c in PARTS)
    owner = {k: option_owner(k) for k in names}
    k = names[0]
    return TypeError(
        f"{where} got {', '.join(f'{n}=' for n in names)}: "
        + "; ".join(f"{n} is a field of {cls[owner[n]]}" for n in names)
        + f". Pass {owner[k]}={cls[owner[k]]}({k}=...), or "
        f"policy=ZeroPolicy.resolve(stage=..., {k}=...) (zero_kernels.policy)"
    )


@dataclass(frozen=True)
class ZeroPolicy:
    """Every choice of a ZeroOptimizer: the six policies (see [Note: policies])."""

    shard: ShardPolicy = field(default_factory=ShardPolicy)
    gather: GatherPolicy = field(default_factory=GatherPolicy)
    precision: PrecisionPolicy = field(default_factory=PrecisionPolicy)
    comm: CommPolicy = field(default_factory=CommPolicy)
    offload: OffloadPolicy = field(default_factory=OffloadPolicy)
    execution: ExecutionPolicy = field(default_factory=ExecutionPolicy)

    def __post_init__(self):
        for name, cls in PARTS:
            v = getattr(self, name)
            if not isinstance(v, cls):
                raise TypeError(f"ZeroPolicy.{name} must be a {cls.__name__}, got {v!r}")
        g, s = self.gather, self.shard
        whole = s.params
        if whole:
            for name, default in (
                ("persist_below", 0),
                ("check_order", None),
                ("secondary_shard", None),
                ("shard_frozen", False),
            ):
                if getattr(g, name) != default:
                    raise ValueError(
                        f"{name}= is a stage-3 option, got stage={s.stage}, "
                        f"{name}={getattr(g, name)!r}"
                    )
        elif g.overlap_param_gather:
            raise ValueError(
                "overlap_param_gather=True is a stage 1/2 option (stage 3 gathers at use "
                "anyway); got stage=3"
            )
        if whole and self.offload.offload_params is not None:
            raise ValueError(
                f"offload_params={self.offload.offload_params!r} is a stage-3 option (params "
                f"are whole between uses at stages 1/2); got stage={s.stage}"
            )
        if whole and self.comm.quantize_weights is not None:
            raise ValueError(
                f"quantize_weights={self.comm.quantize_weights!r} is a stage-3 option (its "
                "all-gathers before each use; at stages 1/2 the gathered params are the "
                f"model's values between steps); got stage={s.stage}"
            )
        if s.grads and self.precision.reduce_dtype is not None:
            raise NotImplementedError(
                f"reduce_dtype={self.precision.reduce_dtype} at stage 1: stage 1 reduces in "
                "place in its full gradient buffer, which is also the optimizer's gradient; use "
                "stage 2 or 3"
            )
        if not whole and g.check_order is None:
            object.__setattr__(self, "gather", dataclasses.replace(g, check_order="pass"))

    @property
    def stage(self) -> int:
        return self.shard.stage

    @classmethod
    def of(cls, stage=None, **parts) -> ZeroPolicy:
        """The policy of `ZeroOptimizer`'s keywords: ``stage`` (1, 2 or 3; None: 2) and the part
        policies (``gather=GatherPolicy(...)``, ...; None: its defaults)."""
        shard = ShardPolicy.of_stage(2 if stage is None else stage)
        given = {k: v for k, v in parts.items() if v is not None}
        return cls(shard=shard, **given)

    @classmethod
    def resolve(cls, stage: int | ShardPolicy = 2, **options) -> ZeroPolicy:
        """The policy of flat field names: ``stage`` and any field of the part policies, each
        name belonging to one (``ZeroPolicy.resolve(stage=3, prefetch=2, bucket_size_mb=50)``);
        an unknown name is a TypeError naming it."""
        shard = stage if isinstance(stage, ShardPolicy) else ShardPolicy.of_stage(stage)
        unknown = sorted(k for k in options if option_owner(k) is None)
        if unknown:
            raise TypeError(f"ZeroPolicy.resolve: unknown option(s) {unknown}")
        parts = {}
        for name, sub in PARTS[1:]:
            names = {f.name for f in dataclasses.fields(sub)}
            parts[name] = sub(**{k: v for k, v in options.items() if k in names})
        return cls(shard=shard, **parts)

    def replace(self, **options) -> ZeroPolicy:
        """This policy with the flat-named fields ``options`` changed (``stage`` too)."""
        stage = options.pop("stage", self.shard)
        flat = {
            f.name: getattr(getattr(self, part), f.name)
            for part, sub in PARTS[1:]
            for f in dataclasses.fields(sub)
        }
        if not self.shard.params and self.gather.check_order == "pass":
            flat["check_order"] = None  # stage 3's default, resolved again
        unknown = sorted(k for k in options if option_owner(k) is None)
        if unknown:
            raise TypeError(f"ZeroPolicy.replace: unknown option(s) {unknown}")
        return ZeroPolicy.resolve(stage, **{**flat, **options})

    def describe(self) -> dict:
        """Every field, for reports (plain values)."""
        out = {}
        for name, _ in PARTS:
            for f in dataclasses.fields(getattr(self, name)):
                v = getattr(getattr(self, name), f.name)
                plain = v is None or isinstance(v, (bool, int, float, str))
                out[f"{name}.{f.name}"] = v if plain else str(v)
        return out

    def must_agree(self) -> dict:
        """What every rank's policy must hold alike (`describe` less `RANK_LOCAL`'s values:
        only whether each is set is compared)."""
        out = self.describe()
        for k in RANK_LOCAL:
            out[k] = "set" if out[k] is not None else None
        return out


# Fields that name a rank's own resources or objects and change no collective: they may differ
# across ranks (a node with one NVMe drive per rank mounts one folder for each; a callable's
# identity is the process's own)
RANK_LOCAL = ("offload.offload_dir", "execution.init_fn")
