"""Named, frozen policies: what `ZeroOptimizer`'s parts read instead of an integer stage.

[Note: policies]
The user's options map once, at construction, to these objects; the parts below the facade
(the gradient store and reducer, the param store, the unit scheduler) read a policy field, never
``stage`` or a keyword. A new option is a field of one policy and the one place that acts on it.

    ShardPolicy      what stays whole on every rank between uses: the ZeRO stage
                     (stage 1: params and grads, 2: params, 3: nothing)
    GatherPolicy     stage 3: when params are gathered and freed (resharding, prefetch, params
                     kept whole, the module-order check); stages 1/2: the step's all-gathers
                     left in flight for the next forward
    PrecisionPolicy  the gradient reduction's dtype and the loss scale; the params keep their own
                     dtype, with fp32 masters where they are lower (see [Note: modes])
    CommPolicy       bucket size, overlap, buffers in flight, the collectives' timeout, and the
                     group the state is sharded over (room for hierarchy: "world" only today)
    OffloadPolicy    offload tiers: offload_optimizer='nvme' (the Adam moments on disk),
                     offload_params='nvme' (stage 3's param shards on disk)
    ZeroPolicy       the five together

``stage=1|2|3`` stays the shorthand: ``ZeroPolicy.resolve(stage=2, ...)`` builds the same as
``ZeroPolicy(shard=ShardPolicy.of_stage(2), ...)``, and ``ZeroOptimizer(..., policy=...)`` takes
the object itself. As FSDP2's ``MixedPrecisionPolicy``/``OffloadPolicy`` do, each policy checks its
own fields, naming the argument and the value; unlike them, one object holds every choice, so a
run's configuration is one value to print, compare across ranks and save.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import torch

__all__ = [
    "CommPolicy",
    "GatherPolicy",
    "OffloadPolicy",
    "PrecisionPolicy",
    "ShardPolicy",
    "ZeroPolicy",
    "resolve_given",
]


@dataclass(frozen=True)
class ShardPolicy:
    """What stays whole on every rank between uses.

    params: params stay whole between steps (stages 1 and 2); False: each unit's params are
        gathered for its forward and backward and freed after (stage 3).
    grads: a full-size local gradient buffer, reduced in place (stage 1); False: only this
        rank's reduced shard is kept, bucket buffers live while they are filled (stages 2, 3).
    """

    params: bool = True
    grads: bool = False

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
    """When params are gathered and freed.

    reshard_after_forward: stage 3: free a unit after its forward (gather it again for its
        backward); False keeps it to the end of the backward.
    prefetch: stage 3: units whose all-gathers start ahead of their use.
    persist_below: stage 3: params of fewer elements are kept whole on every rank.
    check_order: stage 3: "pass", "every" or "first" (see ZeroOptimizer); None: "pass".
    overlap_param_gather: stages 1/2: the step's all-gathers stay in flight, each module's
        forward waits for its own buckets.
    secondary_shard: stage 3 (ZeRO++'s hpZ): None, "node" or an int K: after a unit's forward
        each rank keeps 1/K of its gathered params (K: the ranks of one node, or consecutive
        blocks of K ranks of the shard group), and the unit's backward all-gathers them inside
        those K ranks instead of across the shard group ([Note: secondary shard] in
        `zero_kernels.partition.secondary`).
    shard_frozen: stage 3: the model's params that do not train (``requires_grad=False``: a
        frozen base under adapters) are sharded and gathered with their unit as the trained
        ones are, instead of kept whole on every rank ([Note: frozen shards] in
        `zero_kernels.partition.frozen`).
    """

    reshard_after_forward: bool = True
    prefetch: int = 1
    persist_below: int = 0
    check_order: str | None = None
    overlap_param_gather: bool = False
    secondary_shard: object = None
    shard_frozen: bool = False

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
    """reduce_dtype: stages 2/3: the dtype gradients are accumulated and reduce-scattered in
    (None: fp32; float64 params: float64). loss_scale: None, a positive number (static),
    "dynamic", or "auto" (dynamic with fp16 params, else none). state_dtype: how the fused
    Adam step stores exp_avg/exp_avg_sq: "fp32" (torch's), "bf16" (half the bytes) or "int8"
    (blockwise, ``state_block`` elements per block, a quarter: [Note: int8 shard state] in
    `zero_kernels.partition.lowbit_state`); fp32 math in every case
    (`zero_kernels.ops.lowbit` [Note: low-bit state]). bf16_stochastic_round: bf16 params have
    no fp32 master: the fused step runs on an fp32 copy of each bucket's shard and writes it
    back rounded stochastically (`zero_kernels.ops.sr` [Note: stochastic rounding])."""

    reduce_dtype: torch.dtype | None = None
    loss_scale: float | str | None = "auto"
    state_dtype: str = "fp32"
    state_block: int = 256
    bf16_stochastic_round: bool = False

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
    """bucket_size_mb: a gradient bucket's target size (MiB at 4 bytes per element);
    overlap_comm: reduce buckets during backward; max_inflight_buckets: bucket buffers (stage
    2/3) or reduce-scatters (stage 1) held at once; timeout: seconds bounding every collective of
    backward and step (None: the process group's own); shard_group: the ranks the state is
    sharded over: "world" (the whole process group), "node" (the ranks of each host), an int K
    (consecutive blocks of K ranks) or a torch DeviceMesh (replicate x shard, as FSDP2 takes
    it); replicated across those groups ([Note: hierarchy] in `zero_kernels.comm.hier`);
    quantize_weights: None or "int8"/"int4": stage 3's per-use all-gathers send the other ranks'
    chunks blockwise-quantized, params of one dimension kept whole and exact ([Note: quantized
    all-gather] in `zero_kernels.comm.quant`);
    quantize_grads: None or "int8"/"int4": each gradient bucket's reduce-scatter sends the
    chunks for the other ranks quantized and sums them in fp32 ([Note: quantized
    reduce-scatter] in `zero_kernels.comm.quant`); grad_error_feedback: with quantize_grads, what
    each quantization drops is kept per rank and added to the next step's gradient before it
    is quantized ([Note: error feedback] in `zero_kernels.comm.quant`); broadcast_buffers: rank
    0's buffers broadcast to every rank before a forward that follows a training forward (and
    before the first), as DDP's option of that name ([Note: replicated module state] in
    `zero_kernels.optimizer.replicas`)."""

    bucket_size_mb: float = 25.0
    overlap_comm: bool = True
    max_inflight_buckets: int = 2
    timeout: float | None = None
    shard_group: object = "world"
    quantize_weights: str | None = None
    quantize_grads: str | None = None
    grad_error_feedback: bool = False
    broadcast_buffers: bool = True

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
    """Where state lives when it is not in use ([Note: offload] in `zero_kernels.offload`).

    offload_optimizer: ``"nvme"`` keeps the Adam moments of the fused step (exp_avg,
    exp_avg_sq, max_exp_avg_sq) in a file under ``offload_dir``, read chunk by chunk ahead of the
    step and written behind it, through staging buffers of ``offload_staging_mb`` MiB in all
    (three: stepping, reading ahead, writing behind; at least 0.1 MiB); ``"cpu"``: the fp32
    masters and the moments in host memory and the step on the CPU kernel, for params on a GPU
    ([Note: host tier] in `zero_kernels.offload.host`; on CPU params it runs the same copies, for
    nothing). offload_params (stage 3 only): ``"nvme"``
    keeps each bucket's param shard in a file under ``offload_dir`` between its uses (its
    all-gathers and its step), read ahead of them and written behind the step ([Note: param
    offload] in `zero_kernels.offload.params`); ``"cpu"`` (with ``offload_optimizer="cpu"``): the
    shards in pinned host memory, where the host tier steps them, copied to the device as the
    input of each all-gather ([Note: host tier])."""

    offload_optimizer: str | None = None
    offload_params: str | None = None
    offload_dir: str | None = None
    offload_staging_mb: float = 48.0

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


@dataclass(frozen=True)
class ZeroPolicy:
    """Every choice of a ZeroOptimizer (see [Note: policies])."""

    shard: ShardPolicy = field(default_factory=ShardPolicy)
    gather: GatherPolicy = field(default_factory=GatherPolicy)
    precision: PrecisionPolicy = field(default_factory=PrecisionPolicy)
    comm: CommPolicy = field(default_factory=CommPolicy)
    offload: OffloadPolicy = field(default_factory=OffloadPolicy)

    def __post_init__(self):
        for name, cls in (
            ("shard", ShardPolicy),
            ("gather", GatherPolicy),
            ("precision", PrecisionPolicy),
            ("comm", CommPolicy),
            ("offload", OffloadPolicy),
        ):
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
    def resolve(cls, stage: int | ShardPolicy = 2, **options) -> ZeroPolicy:
        """The policy of ZeroOptimizer's keyword options (``stage`` and those named in the
        policies' fields; an unknown name is a TypeError naming it)."""
        shard = stage if isinstance(stage, ShardPolicy) else ShardPolicy.of_stage(stage)
        parts = {}
        for name, sub in (
            ("gather", GatherPolicy),
            ("precision", PrecisionPolicy),
            ("comm", CommPolicy),
            ("offload", OffloadPolicy),
        ):
            names = {f.name for f in dataclasses.fields(sub)}
            parts[name] = sub(**{k: options.pop(k) for k in list(options) if k in names})
        if options:
            raise TypeError(f"ZeroPolicy.resolve: unknown option(s) {sorted(options)}")
        return cls(shard=shard, **parts)

    def describe(self) -> dict:
        """Every field, for reports (plain values)."""
        out = {}
        for name in ("shard", "gather", "precision", "comm", "offload"):
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


# Fields that name a rank's own resources and change no collective: they may differ across
# ranks (a node with one NVMe drive per rank mounts one folder for each; nodes never share one)
RANK_LOCAL = ("offload.offload_dir",)


def resolve_given(stage, policy, defaults: dict, **options) -> ZeroPolicy:
    """The run's `ZeroPolicy`: ``policy`` itself, or the one ``stage`` and the keyword options
    make. Given a policy, an option also given with a value other than its default
    (``defaults``: name -> default) is a ValueError naming it: one source for each choice."""
    if policy is None:
        return ZeroPolicy.resolve(stage, **options)
    if not isinstance(policy, ZeroPolicy):
        raise TypeError(
            f"policy must be a zero_kernels.policy.ZeroPolicy, got {type(policy).__name__}"
        )
    both = [k for k, v in {"stage": stage, **options}.items() if v != defaults[k]]
    if both:
        raise ValueError(
            f"policy= and {', '.join(f'{k}=' for k in both)} given together: set "
            f"{'them' if len(both) > 1 else 'it'} in the policy (each choice in one place)"
        )
    return policy
