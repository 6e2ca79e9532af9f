"""The plan of `zero-kernels tune`: the grid of trial configurations, and for each one the
predicted step time and memory per rank, from what tune measured on this machine first.

Pure functions of the measurements (no process group): the predictions are printed beside the
measured trials, labelled as predictions, and order the trials so that a time budget cuts the
least promising ones.

[Note: the prediction]
    predicted step = compute + optimizer step + exposed communication

- compute: the measured forward + backward of one rank's batch (every rank at once, the slower
  rank's median); the forward is taken as 1/3 of it, the backward 2/3.
- optimizer step: measured: ``torch.optim.AdamW(fused=True)`` over every parameter (DDP), the
  fused kernel over Ψ/N elements (ZeRO stages, each rank steps its shard), in each state dtype
  of ``--state-dtypes`` (`shard_step_s`: where the CPU is arithmetic-bound int8 state is slower
  than fp32, not the 16/28 of its bytes). With offload
  (``--offload``), plus the disk's time for the bytes the tier moves per step (`offload_io_s`,
  at the ``O_DIRECT`` bandwidth measured in the offload folder; the ranks share the disk).
- communication: the ZeRO paper's volumes, one collective per bucket (stages 1/2, DDP) or per
  unit (stage 3); each collective's time is read off the measured bandwidth table (piecewise
  linear in bytes between the measured sizes; below the smallest its time, the latency; above
  the largest at its bandwidth) for the algorithm `zero_kernels.comm` would choose (a
  point-to-point one where it is at most 0.9x native's time):

      DDP        all-reduce of 4Ψ bytes, in DDP's buckets (1 MiB first, then 25 MiB)
      stage 1/2  reduce-scatter of gΨ (g = 4, 2 with bf16 reduction), all-gather of 4Ψ
      stage 3    per unit u: reduce-scatter gu, all-gather 4u twice (forward and backward);
                 the root unit gathered once
      quantized  ``quantize_weights`` (stage 3's gathers) / ``quantize_grads`` (stages 2/3's
                 reduce-scatters): the same collective at the packed bytes (1 + 4/256 per
                 element at int8, 0.5 + 4/256 at int4) plus the measured time to quantize and
                 dequantize that many elements (the probe's ``quant_s_per_elem``); the
                 quantized reduce-scatter's all-to-all is read off the reduce-scatter's table
      across      (tune under torchrun on several nodes) ``shard_group="node"``: the stage's
      nodes       collectives at N = ranks per node off the table measured inside one node,
                  plus per bucket (unit) the all-reduce of its shard (gu/N, quantized with
                  ``quantize_grads``) off the table measured across the nodes (one rank of
                  each); ``secondary_shard="node"``: stage 3's backward gathers off the
                  inside-a-node table

- overlap: a fraction α of the compute window hides communication ("overlap efficiency"):

      grads reduced during backward   exposed = last + max(0, rest - α bwd)
      stage 1/2 all-gathers           after the step, all exposed; with overlap_param_gather
                                      exposed = first + max(0, rest - α fwd)
      stage 3                         forward: first + max(0, rest - α fwd); backward gathers
                                      and reduce-scatters share the backward window

  α = clamp((cores - N·threads) / N, 0, 1): the communication of gloo (and of comm's
  point-to-point algorithms) runs on CPU threads, so it hides behind compute only where a core
  is free for it; with every core computing (2 ranks on 2 cores) nothing is hidden.
- memory per rank: `zero_kernels.tools.estimate`'s model states; stage 2's comm buffers, its two
  largest buckets as laid out (a bucket holds at least a whole parameter, whatever
  ``bucket_size_mb``); stage 3's live window (the root unit, the running unit and ``prefetch``
  more, the largest ones: a model without repeated blocks is all root) and the gradients of its
  two largest units; buffers halved with bf16 reduction; plus the activations measured in the
  compute probe. Not counted, so the measured peak is higher (a lower bound is what pruning needs: a
  configuration is never skipped that could have fit): the allocator's slack, gloo's buffers,
  the buffers of `zero_kernels.comm`'s algorithm probe (up to 32 MiB plus shards, in the first
  step), the point-to-point algorithms' receive buffers and the shared-memory slots (at most
  2 x 4 MiB per process group, `zero_kernels.tools.estimate.SHM_SLOT_BYTES`), autograd's whole
  gradient of a
  parameter before it is copied into its bucket, and stage 1/2's copy of the params into the
  flat buffer at construction.

This is a simple model meant to rank the configurations and to show where the time goes; the
table prints its ratio to the measurement for every trial.
"""

from __future__ import annotations

import bisect
from dataclasses import asdict, dataclass, replace

from ..tools import estimate as est
from .tune_model import ModelFacts

__all__ = [
    "Measured",
    "TrialConfig",
    "collective_time",
    "grid",
    "overlap_efficiency",
    "pick_algorithm",
    "predict_memory",
    "predict_time",
]

MIB = 2**20
DDP_BUCKET_MB = 25.0  # DistributedDataParallel's bucket_cap_mb default
DDP_FIRST_BUCKET_MB = 1.0  # and its smaller first bucket
P2P_MARGIN = 0.9  # as zero_kernels.comm: a p2p algorithm must take <= 0.9x native's time
FWD_FRACTION = 1 / 3  # of forward + backward
MAX_INFLIGHT = 2  # ZeroOptimizer's max_inflight_buckets default: stage 2's bucket buffers


@dataclass(frozen=True)
class TrialConfig:
    """One configuration tried. ``stage`` 0 is the reference: DDP + AdamW(fused=True)."""

    stage: int
    bucket_mb: float | None  # None at stage 3: a unit is a bucket
    reduce_dtype: str = "fp32"  # "fp32" | "bf16"
    prefetch: int | None = None  # stage 3 only
    overlap_param_gather: bool = False  # stages 1/2 only
    state_dtype: str = "fp32"  # the fused step's moments: "fp32" | "bf16" | "int8"
    offload: str = "none"  # "none" | "optimizer" (NVMe) | "both" (stage 3: params too)
    offload_dir: str | None = None  # where the offload files go (offload != "none")
    quantize_weights: str = "none"  # stage 3: "none" | "int8" | "int4"
    quantize_grads: str = "none"  # stages 2/3: "none" | "int8" | "int4"
    # across nodes ([Note: tune across nodes] in zero_kernels/cli/tune_job.py): "world" |
    # "node" (sharded inside each node, replicated across), and stage 3's secondary shard
    shard_group: str = "world"
    secondary_shard: str | None = None  # stage 3 with shard_group "world": None | "node"

    @property
    def label(self) -> str:
        if self.stage == 0:
            return "DDP + AdamW(fused=True)"
        parts = [f"stage {self.stage}"]
        if self.stage in (1, 2):
            parts.append(f"bucket {self.bucket_mb:g} MiB")
        if self.stage == 3:
            parts.append(f"prefetch {self.prefetch}")
        parts.append(f"{self.reduce_dtype} reduce")
        if self.overlap_param_gather:
            parts.append("overlap AG")
        if self.state_dtype != "fp32":
            parts.append(f"{self.state_dtype} state")
        if self.offload != "none":
            parts.append(OFFLOAD_LABELS[self.offload])
        if self.quantize_weights != "none":
            parts.append(f"{self.quantize_weights} weights")
        if self.quantize_grads != "none":
            parts.append(f"{self.quantize_grads} grads")
        if self.shard_group != "world":
            parts.append(f"shard_group {self.shard_group}")
        if self.secondary_shard is not None:
            parts.append(f"secondary_shard {self.secondary_shard}")
        return ", ".join(parts)

    def policy_options(self) -> dict:
        """This configuration (stage > 0) as the flat options of `ZeroPolicy.resolve`: the
        ZeroOptimizer is ``ZeroOptimizer(model, cls, policy=ZeroPolicy.resolve(**these))``."""
        kw: dict = {"stage": self.stage}
        if self.stage in (1, 2):
            kw["bucket_size_mb"] = self.bucket_mb
            kw["overlap_param_gather"] = self.overlap_param_gather
        if self.stage == 3:
            kw["prefetch"] = self.prefetch
        if self.reduce_dtype == "bf16":
            kw["reduce_dtype"] = "torch.bfloat16"
        if self.state_dtype != "fp32":
            kw["state_dtype"] = self.state_dtype
        if self.offload != "none":
            kw["offload_optimizer"] = "nvme"
            if self.offload == "both":
                kw["offload_params"] = "nvme"
            kw["offload_dir"] = self.offload_dir
        if self.quantize_weights != "none":
            kw["quantize_weights"] = self.quantize_weights
        if self.quantize_grads != "none":
            kw["quantize_grads"] = self.quantize_grads
        if self.shard_group != "world":
            kw["shard_group"] = self.shard_group
        if self.secondary_shard is not None:
            kw["secondary_shard"] = self.secondary_shard
        return kw

    def as_dict(self) -> dict:
        return {**asdict(self), "label": self.label, "ddp": self.stage == 0}


def grid(
    stages: tuple[int, ...],
    buckets: tuple[float, ...],
    prefetch: tuple[int, ...],
    reduce_dtypes: tuple[str, ...],
    overlap: tuple[bool, ...],
    ddp: bool,
    state_dtypes: tuple[str, ...] = ("fp32",),
    offloads: tuple[str, ...] = ("none",),
    offload_dir: str | None = None,
    quantize_weights: tuple[str, ...] = ("none",),
    quantize_grads: tuple[str, ...] = ("none",),
    hierarchy: tuple[str, ...] = ("world",),
) -> list[TrialConfig]:
    """Every valid combination: stage 1 reduces in fp32 only (it reduces in place), stage 3 has
    no buckets of a size (a unit is a bucket) and no overlap_param_gather (it gathers at use);
    prefetch is a stage-3 setting; each ZeRO configuration once per ``state_dtypes`` and per
    ``offloads`` ("both", params too, at stage 3 only); quantized weights at stage 3 and
    quantized gradients at stages 2/3 (fp32 reduction: the quantized reduce-scatter sums in
    fp32 itself), each with the others as given. ``hierarchy`` (across nodes): "world" (flat),
    "node" (every ZeRO configuration also with shard_group="node") and "secondary" (stage 3's
    also with secondary_shard="node")."""
    out = [TrialConfig(0, DDP_BUCKET_MB)] if ddp else []
    for off in offloads:
        d = offload_dir if off != "none" else None
        for sd in state_dtypes:
            for s in stages:
                qgs = quantize_grads if s >= 2 else ("none",)
                if s in (1, 2) and off != "both":
                    for b in buckets:
                        for rd in reduce_dtypes if s == 2 else ("fp32",):
                            for ov in overlap:
                                for qg in qgs if rd == "fp32" else ("none",):
                                    out.append(
                                        TrialConfig(s, b, rd, None, ov, sd, off, d, "none", qg)
                                    )
                elif s == 3:
                    for p in prefetch:
                        for rd in reduce_dtypes:
                            for qw in quantize_weights:
                                for qg in qgs if rd == "fp32" else ("none",):
                                    out.append(
                                        TrialConfig(3, None, rd, p, False, sd, off, d, qw, qg)
                                    )
    flat = list(dict.fromkeys(out))  # reduce_dtypes ("fp32",) and stage 1 may repeat
    out = [c for c in flat if "world" in hierarchy or c.stage == 0]
    for c in flat:
        if c.stage and "node" in hierarchy:
            out.append(replace(c, shard_group="node"))
        if c.stage == 3 and "secondary" in hierarchy:
            out.append(replace(c, secondary_shard="node"))
    return out


def default_buckets(n_params: int) -> tuple[float, ...]:
    """Bucket sizes worth trying: 1, 4 and 25 MiB below the model's fp32 gradient size, and the
    first one that holds it whole (one bucket)."""
    out = []
    for b in (1.0, 4.0, 25.0, 100.0):
        out.append(b)
        if b * MIB >= 4 * n_params:
            break
    return tuple(out[-3:])


def overlap_efficiency(cores: int, nproc: int, threads: int) -> float:
    """α of [Note: the prediction]: the share of a core each rank has spare for communication."""
    return max(0.0, min(1.0, (cores - nproc * threads) / nproc))


@dataclass(frozen=True)
class Measured:
    """What tune measured before the trials (see `zero_kernels.cli.tune_worker.probe`)."""

    world_size: int
    bandwidth: dict  # (op, algorithm) -> ((bytes, seconds), ...) ascending in bytes
    fwd_bwd_s: float
    optimizer_full_s: float  # AdamW(fused=True) over every parameter
    optimizer_shard_s: float  # the fused kernel over Ψ/N elements
    activation_bytes: float
    overlap: float  # α
    # the fused step over the shard per state dtype (measured), None: scaled by the bytes
    optimizer_shard_s_by_dtype: dict | None = None
    # quantizing plus dequantizing one element, per format tune tries ("int8", "int4")
    quant_s_per_elem: dict | None = None
    # the offload directory's disk, O_DIRECT (offload.probe_disk), bytes/s; None: not measured
    disk_read_bps: float | None = None
    disk_write_bps: float | None = None
    # across nodes: the bandwidth inside one node's group of ranks and across the nodes (one
    # rank of each), as ``bandwidth`` ({"node": ..., "cross": ...}); None on one host
    links: dict | None = None
    ranks_per_node: int = 0  # 0: one host


def collective_time(points, nbytes: float) -> float:
    """Seconds for ``nbytes`` from measured ``((bytes, seconds), ...)``, ascending."""
    xs = [p[0] for p in points]
    ys = [p[1] for p in points]
    if nbytes <= xs[0]:
        return ys[0]  # latency-bound: no faster than the smallest message measured
    if nbytes >= xs[-1]:
        return ys[-1] * nbytes / xs[-1]
    k = bisect.bisect_right(xs, nbytes)
    x0, x1, y0, y1 = xs[k - 1], xs[k], ys[k - 1], ys[k]
    return y0 + (y1 - y0) * (nbytes - x0) / (x1 - x0)


def pick_algorithm(bandwidth: dict, op: str, nbytes: float) -> tuple[str, float]:
    """(algorithm, seconds): native unless a p2p one takes <= P2P_MARGIN of its time."""
    times = {a: collective_time(pts, nbytes) for (o, a), pts in bandwidth.items() if o == op}
    if not times:
        raise ValueError(f"no bandwidth measured for {op}")
    if "native" not in times or op == "all_reduce":
        a = min(times, key=times.get)
        return a, times[a]
    p2p = {a: t for a, t in times.items() if a != "native"}
    if p2p:
        a = min(p2p, key=p2p.get)
        if p2p[a] <= P2P_MARGIN * times["native"]:
            return a, p2p[a]
    return "native", times["native"]


def _ddp_buckets(shapes) -> list[int]:
    """Element counts of DDP's buckets: params in reverse order, 1 MiB first, then 25 MiB."""
    out, cur, cap = [], 0, DDP_FIRST_BUCKET_MB * MIB
    for s in reversed(shapes):
        n = 1
        for d in s:
            n *= d
        cur += n
        if 4 * cur >= cap:
            out.append(cur)
            cur, cap = 0, DDP_BUCKET_MB * MIB
    if cur:
        out.append(cur)
    return out


def _hidden(times: list[float], window: float, alpha: float, keep_last: bool) -> float:
    """Exposed part of collectives run during a compute window: the last (or first) one cannot
    hide, the rest hides behind up to ``alpha * window``."""
    if not times:
        return 0.0
    edge = times[-1] if keep_last else times[0]
    return edge + max(0.0, sum(times) - edge - alpha * window)


# bytes the fused step moves per param: the measured fp32 step scaled by these (a memory stream)
_STEP_BYTES = {"fp32": 28.0, "bf16": 20.0, "int8": 16.0}
OFFLOAD_LABELS = {
    "optimizer": "offload optimizer (nvme)",
    "both": "offload optimizer+params (nvme)",
}


def shard_step_s(cfg: TrialConfig, m: Measured) -> float:
    """The fused step over one rank's shard in ``cfg``'s state dtype: measured where the probe
    timed it, else the fp32 step scaled by the bytes it moves (a memory stream)."""
    got = (m.optimizer_shard_s_by_dtype or {}).get(cfg.state_dtype)
    if got is not None:
        return got
    return m.optimizer_shard_s * _STEP_BYTES[cfg.state_dtype] / _STEP_BYTES["fp32"]


def offload_io_s(cfg: TrialConfig, n_params: int, m: Measured) -> float:
    """Seconds of disk I/O per step of ``cfg``'s offload, every rank sharing the disk: the
    moments read and written once by the step; with params too, each param shard (the fp32
    master of fp32 params) read for the forward, the backward and the step and written after
    it. 0 without offload or without a disk measurement."""
    if cfg.offload == "none" or not m.disk_read_bps or not m.disk_write_bps:
        return 0.0
    from ..ops.lowbit import state_bytes_per_param

    moments = state_bytes_per_param(cfg.state_dtype) * n_params
    read, write = moments, moments
    if cfg.offload == "both":
        read += 3 * 4.0 * n_params
        write += 4.0 * n_params
    return read / m.disk_read_bps + write / m.disk_write_bps


def predict_time(cfg: TrialConfig, facts: ModelFacts, m: Measured) -> dict:
    """Predicted seconds per step and its parts ([Note: the prediction])."""
    n, a = m.world_size, m.overlap
    fwd = FWD_FRACTION * m.fwd_bwd_s
    bwd = m.fwd_bwd_s - fwd
    g = 2 if cfg.reduce_dtype == "bf16" else 4
    algos: dict[str, str] = {}
    hier = cfg.shard_group != "world" or cfg.secondary_shard is not None
    if hier and not (m.links and m.ranks_per_node):
        raise ValueError(f"{cfg.label}: needs the bandwidth inside and across nodes (one host)")
    shard_scope = "world"
    if cfg.shard_group != "world":  # sharded inside the node ([Note: hierarchy])
        n, shard_scope = m.ranks_per_node, "node"

    def t(op: str, nbytes: float, scope: str = "world") -> float:
        bw = m.bandwidth if scope == "world" else m.links[scope]
        algo, sec = pick_algorithm(bw, op, nbytes)
        algos.setdefault(op if scope == "world" else f"{op} ({scope})", algo)
        return sec

    qw, qg = _quant(cfg.quantize_weights, m), _quant(cfg.quantize_grads, m)

    def reduced(numel: float) -> float:  # a bucket's reduction, quantized or not
        if cfg.shard_group != "world":  # inside the node, then its shard across the nodes
            across = t("all_reduce", (qg[0] if qg else g) * numel / n, "cross")
            return t("reduce_scatter", g * numel, "node") + across + (qg[1] * numel if qg else 0)
        if qg is None:
            return t("reduce_scatter", g * numel)
        nbytes, cost = qg
        return t("reduce_scatter", nbytes * numel) + cost * numel

    def gathered(numel: float, scope: str = shard_scope) -> float:
        if qw is None:
            return t("all_gather", 4 * numel, scope)
        nbytes, cost = qw
        return t("all_gather", nbytes * numel, scope) + cost * numel

    if cfg.stage == 0:
        ar = [t("all_reduce", 4 * b) for b in _ddp_buckets(facts.shapes)]
        comm, exposed = sum(ar), _hidden(ar, bwd, a, keep_last=True)
        opt = m.optimizer_full_s
    elif cfg.stage in (1, 2):
        buckets = facts.bucket_numels(n, cfg.bucket_mb)
        rs = [reduced(b) for b in buckets]
        ag = [t("all_gather", 4 * b, shard_scope) for b in buckets]
        comm = sum(rs) + sum(ag)
        exposed = _hidden(rs, bwd, a, keep_last=True)
        if cfg.overlap_param_gather:
            exposed += _hidden(list(reversed(ag)), fwd, a, keep_last=False)
        else:
            exposed += sum(ag)
        opt = shard_step_s(cfg, m)
    else:
        units = list(facts.unit_numels)
        root = gathered(facts.root_numel) if facts.root_numel else 0.0
        ag = [gathered(u) for u in units]
        # the backward's gathers: inside the node with the secondary shard (hpZ)
        ag_bwd = [gathered(u, "node") for u in units] if cfg.secondary_shard else ag
        rs = [reduced(u) for u in units + [facts.root_numel] if u]
        comm = root + sum(ag) + sum(ag_bwd) + sum(rs)
        fwd_exposed = root + _hidden(ag, fwd, a, keep_last=False)
        bwd_total = sum(ag_bwd) + sum(rs)
        bwd_exposed = (rs[-1] if rs else 0.0) + max(
            0.0, bwd_total - (rs[-1] if rs else 0.0) - a * bwd
        )
        exposed = fwd_exposed + bwd_exposed
        opt = shard_step_s(cfg, m)
    io = offload_io_s(cfg, facts.n_params, m)
    return {
        "step_time_s": m.fwd_bwd_s + opt + exposed + io,
        "offload_io_s": io,
        "compute_s": m.fwd_bwd_s,
        "optimizer_s": opt,
        "comm_s": comm,
        "exposed_comm_s": exposed,
        "algorithms": algos,
        "what": "prediction ([Note: the prediction] in zero_kernels/cli/tune_plan.py)",
    }


QUANT_BYTES = {"int8": 1 + 4 / 256, "int4": 0.5 + 4 / 256}  # per element, with block scales


def _quant(fmt: str, m: Measured) -> tuple[float, float] | None:
    """(bytes per element on the wire, seconds per element quantizing and dequantizing) of a
    quantized collective; None for "none"."""
    if fmt == "none":
        return None
    cost = (m.quant_s_per_elem or {}).get(fmt, 0.0)
    return QUANT_BYTES[fmt], cost


def predict_memory(cfg: TrialConfig, facts: ModelFacts, m: Measured) -> dict:
    """Predicted bytes per rank above the baseline: the estimator's model states, the comm
    buffers and stage-3 window of this model's real buckets and units, and the measured
    activations ([Note: the prediction])."""
    e = est.estimate_stage(
        cfg.stage,
        facts.n_params,
        m.world_size,
        precision="fp32",
        optimizer="adam",
        bucket_mb=cfg.bucket_mb or est.DEFAULT_BUCKET_MB,
        optim_bytes_total=est.optimizer_state_bytes(
            "adam", "fp32", facts.n_params, state_dtype=cfg.state_dtype
        ),
        state_dtype=cfg.state_dtype,
        offload_optimizer="nvme" if cfg.offload != "none" else None,
        offload_params="nvme" if cfg.offload == "both" else None,
    )
    states = e.total_bytes  # no live window: largest_layer not given
    live, buffers = 0.0, 0.0
    if cfg.stage == 2:  # the real buckets: one holds at least a whole param, whatever its size
        buffers = 4.0 * sum(
            sorted(facts.bucket_numels(m.world_size, cfg.bucket_mb))[-MAX_INFLIGHT:]
        )
    elif cfg.stage == 3:  # root unit + running + prefetched units; gradients of the largest
        units = sorted(facts.unit_numels)
        ahead = min(1 + (cfg.prefetch or 0), len(units))
        live = 4.0 * (facts.root_numel + sum(units[len(units) - ahead :]))
        buffers = 4.0 * sum(sorted(units + [facts.root_numel])[-MAX_INFLIGHT:])
    buffers *= 0.5 if cfg.reduce_dtype == "bf16" else 1.0
    return {
        "total_bytes": states + live + buffers + m.activation_bytes,
        "model_state_bytes": states,
        "live_bytes": live,
        "comm_buffer_bytes": buffers,
        "activation_bytes": m.activation_bytes,
        "what": "prediction: zero_kernels.tools.estimate's model states + buckets and units as "
        "laid "
        "out + measured activations",
    }
