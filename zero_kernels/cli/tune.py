"""`zero-kernels tune`: measure this machine, try ZeRO configurations on the user's model, and
recommend the fastest one that fits a memory limit.

[Note: what tune does]
1. The probe (one job of ``--nproc`` ranks on gloo): reduce-scatter and all-gather time per
   algorithm `zero_kernels.comm` offers (native, pairwise, ring above 2 ranks: a ring of 2
   is the pairwise exchange, and shm where the extension is built: the ranks share this host)
   and per message size (64 KiB, 1, 8, 64 MiB, capped by the model's fp32 gradient bytes,
   which are measured too), all-reduce for DDP; then forward + backward of one rank's batch on
   every rank at once, its activations, and the optimizer step.
2. The plan (`zero_kernels.cli.tune_plan`): stage x bucket size x prefetch x reduce dtype x
   overlap_param_gather (x state dtype x offload tier x quantized weights and gradients, as
   asked), plus DDP + AdamW(fused=True) for reference; each with a predicted step
   time and memory per rank. A configuration predicted over ``--mem-limit`` is not run (listed
   as "over limit"). The rest run in order of predicted time, taking the stages in turn, until
   ``--max-trials`` or ``--time-budget`` (those left are listed as not run).
3. The trials: each its own job of fresh processes (`zero_kernels.cli.tune_worker`):
   ``--warmup`` steps, then ``--steps`` timed ones; the step time is the slower rank's median,
   the memory the largest peak RSS above the baseline ([Note: peak memory] there). A trial
   fits when that peak is within the limit on every rank.
4. The recommendation: the fastest measured ZeRO configuration that fits, with its
   ZeroOptimizer(...) arguments; DDP's row says whether plain DDP would be faster, and each
   quantized trial's line whether it beat its unquantized twin by more than the noise. Exit code 0,
   or 1 when no configuration fits (the one predicted smallest is named), 2 for bad arguments.

Across nodes (under torchrun, [Note: tune across nodes] in tune_job.py) the jobs run in the
job's own ranks, the probe measures the links inside and across the nodes too, and the grid
adds shard_group="node" and secondary_shard="node".

Printed: the table on stdout, a progress bar on stderr. Written to ``--out``: tune.json
(machine, versions, command, bandwidth, compute, every trial with its configuration, measured
and predicted figures and whether it fits, the recommendation) and tune.png.
"""

from __future__ import annotations

import os
import queue as queue_mod
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from ..tools import estimate as est
from . import stop_processes
from .launch import available_stages, cores, free_port, under_torchrun
from .tune_job import JobFailed
from .tune_model import ModelFacts, ModelSource, check_size, model_facts
from .tune_plan import (
    Measured,
    default_buckets,
    grid,
    overlap_efficiency,
    predict_memory,
    predict_time,
)

__all__ = ["TuneConfig", "add_parser", "config_from_args", "run_tune"]

DEFAULT_OUT = "zero_kernels_tune"
MIB = 2**20


@dataclass(frozen=True)
class TuneConfig:
    source: ModelSource
    nproc: int = 2
    local_nproc: int = 0  # ranks on this host (under torchrun LOCAL_WORLD_SIZE); 0: nproc
    threads: int = 1  # torch threads per rank
    mem_limit: int | None = None  # bytes per rank; None: MemAvailable / nproc (or no limit)
    mem_limit_source: str = "--mem-limit"
    out: str = DEFAULT_OUT
    stages: tuple[int, ...] = (1, 2, 3)
    buckets: tuple[float, ...] | None = None  # None: default_buckets(model size)
    prefetch: tuple[int, ...] = (1, 2)
    reduce_dtypes: tuple[str, ...] = ("fp32", "bf16")
    state_dtypes: tuple[str, ...] = ("fp32",)
    offloads: tuple[str, ...] = ("none",)
    offload_dir: str | None = None  # None: <out>/offload
    quantize_weights: tuple[str, ...] = ("none",)  # stage 3
    quantize_grads: tuple[str, ...] = ("none",)  # stages 2/3
    overlap: tuple[bool, ...] = (False, True)
    ddp: bool = True
    steps: int = 10
    warmup: int = 3
    max_trials: int = 0  # 0: no limit
    repeats: int = 1  # rounds over the configurations
    time_budget_s: float = 180.0
    trial_timeout_s: float = 300.0
    seed: int = 0
    progress: bool = True
    argv: tuple[str, ...] = field(default=())


# ---------------------------------------------------------------------------------------------
# Arguments
# ---------------------------------------------------------------------------------------------


def add_parser(sub, parser_class) -> None:
    from ..tools.models import MODEL_SIZES

    t = sub.add_parser(
        "tune",
        help="measure this machine and try ZeRO configurations on a model; recommend one",
        description="Measure collective bandwidth and compute time here, run short trials of "
        "stage x bucket size x prefetch x reduce dtype x overlap on the model within a memory "
        "limit, print a table and the fastest configuration that fits (measured, with the "
        "prediction beside it); write tune.json and tune.png. Across nodes run it under "
        "torchrun on every node: the job's ranks run the trials, the links inside and across "
        "the nodes are measured, and shard_group/secondary_shard='node' are tried too.",
    )
    src = t.add_mutually_exclusive_group()
    src.add_argument(
        "--model-size", default=None, choices=list(MODEL_SIZES), help="demo GPT (default small)"
    )
    src.add_argument(
        "--model", default=None, help="package.module:factory, or a GPT-2 style config.json"
    )
    t.add_argument(
        "--nproc",
        type=int,
        default=None,
        help="ranks (default 2; at most the cores); under torchrun the job's ranks",
    )
    t.add_argument("--threads", type=int, default=1, help="torch threads per rank (default 1)")
    t.add_argument(
        "--mem-limit",
        default=None,
        help="peak memory per rank above its baseline: 2GB, 512MB, 1.5GiB, 300000000B "
        "(default: MemAvailable / nproc)",
    )
    t.add_argument(
        "--out",
        default=DEFAULT_OUT,
        help=f"folder for tune.json and tune.png (default {DEFAULT_OUT})",
    )
    t.add_argument(
        "--batch-size", type=int, default=8, help="samples per rank per step (default 8)"
    )
    t.add_argument("--seq-len", type=int, default=None, help="tokens per sample (token models)")
    t.add_argument("--steps", type=int, default=10, help="timed steps per trial (default 10)")
    t.add_argument("--warmup", type=int, default=3, help="untimed steps first (default 3)")
    t.add_argument("--stages", default="1,2,3", help="ZeRO stages to try (default 1,2,3)")
    t.add_argument("--buckets", default="auto", help="bucket sizes in MiB, e.g. 1,4,25 (auto)")
    t.add_argument("--prefetch", default="1,2", help="stage-3 prefetch values (default 1,2)")
    t.add_argument("--reduce-dtypes", default="fp32,bf16", help="stages 2/3 (default fp32,bf16)")
    t.add_argument(
        "--state-dtypes",
        default="fp32",
        help="the fused Adam step's moments to try: fp32, bf16, int8 (default fp32)",
    )
    t.add_argument(
        "--offload",
        default="none",
        help="offload tiers to try: none, optimizer (offload_optimizer='nvme', stages 1-3), "
        "both (and offload_params='nvme', stage 3); default none",
    )
    t.add_argument(
        "--offload-dir", default=None, help="the offload files' folder (default OUT/offload)"
    )
    t.add_argument(
        "--quantize-weights",
        default="none",
        help="stage 3's quantized all-gathers to try: none, int8, int4 (default none)",
    )
    t.add_argument(
        "--quantize-grads",
        default="none",
        help="stages 2/3's quantized reduce-scatters to try: none, int8, int4 (default none)",
    )
    t.add_argument("--overlap", default="off,on", help="overlap_param_gather (default off,on)")
    t.add_argument("--no-ddp", dest="ddp", action="store_false", help="skip the DDP reference")
    t.add_argument("--max-trials", type=int, default=0, help="most trials run (default 0: all)")
    t.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="rounds over the configurations, interleaved (default 1); each trial's step is "
        "the median over its rounds",
    )
    t.add_argument(
        "--time-budget", type=float, default=180.0, help="seconds for all trials (default 180)"
    )
    t.add_argument(
        "--trial-timeout", type=float, default=300.0, help="seconds before a job is stopped"
    )
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")


def _list(name: str, text: str, parse, accepted: str) -> tuple:
    """A comma-separated list; ``parse`` returns None (or raises ValueError) for a bad item."""
    out = []
    for x in (x.strip() for x in str(text).split(",")):
        try:
            v = parse(x) if x else None
        except ValueError:
            v = None
        if v is None:
            raise ValueError(f"{name} takes {accepted}, comma-separated; got {text!r}")
        out.append(v)
    return tuple(dict.fromkeys(out))


def _one_of(values: dict):
    return lambda x: values.get(x.lower())


def _words(items) -> str:
    items = [str(x) for x in items]
    return ", ".join(items[:-1]) + f" or {items[-1]}" if len(items) > 1 else items[0]


def _positive_mb(x: str) -> float:
    v = float(x)
    if not (v > 0 and v < 1e6):
        raise ValueError(x)
    return v


def _parse_limit(text: str) -> int:
    """`2GB`, `512MB`, `1.5GiB`, `123456B`, `80` (GB), as
    `zero_kernels.tools.estimate.parse_bytes`."""
    return est.parse_bytes(text, name="--mem-limit")


def _mem_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _check_out(out: str) -> None:
    """--out must be a folder tune can write in (created now, so a run does not fail at the
    end); a test file is written and removed."""
    try:
        Path(out).mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=out, prefix=".tune-write-test-"):
            pass
    except OSError as e:
        why = e.strerror or type(e).__name__
        raise ValueError(f"--out {out!r} is not a writable folder ({why})") from None


def config_from_args(args, argv: list[str] | None = None) -> TuneConfig:
    """Check every argument (ValueError naming it and its value) and build the configuration."""

    in_job = under_torchrun()  # across nodes: the job's ranks ([Note: tune across nodes])
    if in_job:
        world, local = int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_WORLD_SIZE"])
        if args.nproc is not None and args.nproc != world:
            raise ValueError(
                f"--nproc under torchrun must be the job's WORLD_SIZE={world} or left out; got "
                f"{args.nproc}"
            )
        args.nproc = world
    else:
        args.nproc = 2 if args.nproc is None else args.nproc
        local = args.nproc
    if args.model is not None:
        if args.model.endswith(".json") or Path(args.model).is_dir():
            src_kind = "config"
        else:
            src_kind = "factory"
            est.model_info(args.model)  # imports and builds it on meta; one line on failure
        spec = args.model
    else:
        spec, src_kind = args.model_size or "small", "size"
        check_size(spec)
    n_cores = cores()
    for name, v, lo in (
        ("--threads", args.threads, 1),
        ("--batch-size", args.batch_size, 1),
        ("--steps", args.steps, 1),
        ("--warmup", args.warmup, 0),
        ("--max-trials", args.max_trials, 0),
        ("--repeats", args.repeats, 1),
    ):
        if v < lo:
            raise ValueError(f"{name} must be >= {lo}; got {v}")
    if args.seq_len is not None and args.seq_len < 1:
        raise ValueError(f"--seq-len must be >= 1; got {args.seq_len}")
    if args.nproc < 2 or (not in_job and args.nproc > n_cores):
        raise ValueError(
            f"--nproc must be in 2..{n_cores} (ZeRO needs 2 ranks; this machine has {n_cores} "
            f"cores, one per rank); got {args.nproc}"
        )
    if local * args.threads > n_cores:
        what = "LOCAL_WORLD_SIZE" if in_job else "--nproc"
        raise ValueError(
            f"--threads {args.threads} x {what} {local} needs {local * args.threads} "
            f"cores; this machine has {n_cores}"
        )
    for name, v in (("--time-budget", args.time_budget), ("--trial-timeout", args.trial_timeout)):
        if not v > 0:
            raise ValueError(f"{name} must be > 0 seconds; got {v}")
    if args.mem_limit is not None:
        limit, why = _parse_limit(args.mem_limit), "--mem-limit"
    else:
        avail = _mem_available()
        limit = None if avail is None else avail // local
        why = "MemAvailable / ranks on this host"
    ok = [s for s in available_stages() if s]
    stages = _list("--stages", args.stages, _one_of({str(s): s for s in ok}), _words(ok))
    buckets = None
    if args.buckets.strip() != "auto":
        buckets = _list("--buckets", args.buckets, _positive_mb, "'auto' or sizes in MiB > 0")
    pf = {str(k): k for k in range(5)}
    prefetch = _list("--prefetch", args.prefetch, _one_of(pf), _words(pf))
    rd = {"fp32": "fp32", "bf16": "bf16"}
    dtypes = _list("--reduce-dtypes", args.reduce_dtypes, _one_of(rd), _words(rd))
    sd = {"fp32": "fp32", "bf16": "bf16", "int8": "int8"}
    state_dtypes = _list("--state-dtypes", args.state_dtypes, _one_of(sd), _words(sd))
    off = {"none": "none", "optimizer": "optimizer", "both": "both"}
    offloads = _list("--offload", args.offload, _one_of(off), _words(off))
    if "both" in offloads and 3 not in stages:
        raise ValueError("--offload both offloads params too: it needs stage 3 in --stages")
    qf = {"none": "none", "int8": "int8", "int4": "int4"}
    qws = _list("--quantize-weights", args.quantize_weights, _one_of(qf), _words(qf))
    qgs = _list("--quantize-grads", args.quantize_grads, _one_of(qf), _words(qf))
    if qws != ("none",) and 3 not in stages:
        raise ValueError("--quantize-weights quantizes stage 3's gathers: it needs stage 3")
    if qgs != ("none",) and not {2, 3} & set(stages):
        raise ValueError("--quantize-grads quantizes stages 2/3's reductions: it needs one")
    ov = {"off": False, "on": True}
    overlap = _list("--overlap", args.overlap, _one_of(ov), _words(ov))
    src = ModelSource(src_kind, spec, args.batch_size, args.seq_len)
    model_facts(src)  # builds it on the meta device: a model tune cannot run fails here
    _check_out(args.out)
    return TuneConfig(
        source=src,
        nproc=args.nproc,
        local_nproc=local,
        threads=args.threads,
        mem_limit=limit,
        mem_limit_source=why,
        out=args.out,
        stages=tuple(sorted(stages)),
        buckets=buckets,
        prefetch=prefetch,
        reduce_dtypes=dtypes,
        state_dtypes=state_dtypes,
        offloads=offloads,
        offload_dir=args.offload_dir,
        quantize_weights=qws,
        quantize_grads=qgs,
        overlap=overlap,
        ddp=args.ddp,
        steps=args.steps,
        warmup=args.warmup,
        max_trials=args.max_trials,
        repeats=args.repeats,
        time_budget_s=args.time_budget,
        trial_timeout_s=args.trial_timeout,
        seed=args.seed,
        progress=args.progress,
        argv=tuple(sys.argv[1:] if argv is None else argv),
    )


# ---------------------------------------------------------------------------------------------
# Jobs: fresh processes per probe and per trial
# ---------------------------------------------------------------------------------------------


class _Launcher:
    """Starts ``nproc`` rank processes for one job and supervises them: their results, or the
    first failing rank's error on one line (the others terminated), or a timeout."""

    is_root, nodes, ranks_per_node, links, hosts, why_flat = True, 1, 0, {}, None, None

    def __init__(self, nproc: int, timeout_s: float) -> None:
        import multiprocessing as mp

        self.nproc, self.timeout_s = nproc, timeout_s
        self.ctx = mp.get_context("forkserver")  # torch imported once; a job starts in ~0.5 s
        self.ctx.set_forkserver_preload(["zero_kernels.cli.tune_worker"])

    def run(self, job: dict) -> list:
        from .tune_worker import rank_main

        q = self.ctx.Queue()
        port = free_port()
        procs = [
            self.ctx.Process(target=rank_main, args=(i, self.nproc, port, job, q))
            for i in range(self.nproc)
        ]
        for p in procs:
            p.start()
        deadline = time.monotonic() + self.timeout_s
        result, error = None, None
        try:
            while result is None and error is None:
                try:
                    msg = q.get(timeout=0.1)
                except queue_mod.Empty:
                    msg = None
                if msg is not None and msg[0] == "ok":
                    result = msg[1]
                elif msg is not None:
                    error = f"rank {msg[1]} failed: {msg[2]}"
                    if os.environ.get("ZERO_KERNELS_TRACEBACK"):
                        print(msg[3], file=sys.stderr)
                elif any(p.exitcode not in (None, 0) for p in procs):
                    k = next(i for i, p in enumerate(procs) if p.exitcode not in (None, 0))
                    error = f"rank {k} failed with exit code {procs[k].exitcode}"
                elif time.monotonic() > deadline:
                    error = f"timed out after {self.timeout_s:g} s (--trial-timeout)"
            if result is not None:
                for p in procs:
                    p.join(max(1.0, deadline - time.monotonic()))
        finally:
            stop_processes(procs)
            q.close()
        if error is not None:
            raise JobFailed(error)
        return result

    @staticmethod
    def agree(value):  # one supervisor decides: nothing to agree on
        return value

    def close(self) -> None:
        pass


# ---------------------------------------------------------------------------------------------
# Progress
# ---------------------------------------------------------------------------------------------


class Progress:
    """tqdm on stderr when installed, else one line rewritten with \\r; nothing when off."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.total, self.n, self.enabled, self.bar = total, 0, enabled, None
        if not enabled:
            return
        try:
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc="tune", file=sys.stderr, dynamic_ncols=True)
        except ImportError:
            self.bar = None

    def show(self, what: str) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.set_postfix_str(what)
        else:
            line = f"tune: {self.n}/{self.total} {what}"
            print(f"\r{line[:100]:<100}", end="", file=sys.stderr, flush=True)

    def advance(self, k: int = 1) -> None:
        self.n += k
        if self.bar is not None:
            self.bar.update(k)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        elif self.enabled:
            print(f"\rtune: {self.n}/{self.total} done{'':<90}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------------------------


def _probe_sizes(n_params: int) -> list[int]:
    grads = 4 * n_params
    sizes = [s for s in (64 * 1024, MIB, 8 * MIB, 64 * MIB) if s < grads]
    if not sizes or grads > 1.5 * sizes[-1]:
        sizes.append(min(grads, 64 * MIB) if sizes else grads)
    return sizes


def _job(cfg: TuneConfig, kind: str, **extra) -> dict:
    return {
        "kind": kind,
        "source": cfg.source,
        "threads": cfg.threads,
        "seed": cfg.seed,
        "steps": cfg.steps,
        "warmup": cfg.warmup,
        "timeout_s": cfg.trial_timeout_s,
        **extra,
    }


def _measured(cfg: TuneConfig, per_rank: list[dict], ranks_per_node: int = 0):
    """Rank-wise probe results -> the plan's `Measured` and the JSON's probe section (across
    nodes the link tables too: [Note: tune across nodes])."""
    rows = []
    tables: dict = {}  # scope -> (op, algorithm) -> [(bytes, seconds)]
    for k, row in enumerate(per_rank[0]["bandwidth"]):
        reps = zip(*(r["bandwidth"][k]["seconds"] for r in per_rank))
        sec = statistics.median(max(rep) for rep in reps)  # the slower rank, median of runs
        scope = row.get("scope", "world")
        rows.append(
            {
                "op": row["op"],
                "algorithm": row["algorithm"],
                "bytes": row["bytes"],
                "scope": scope,
                "ranks": row.get("ranks", cfg.nproc),
                "seconds": sec,
                "gb_per_s": row["bytes"] / sec / 1e9 if sec > 0 else None,
                "runs": len(row["seconds"]),
            }
        )
        table = tables.setdefault(scope, {})
        table.setdefault((row["op"], row["algorithm"]), []).append((row["bytes"], sec))
    bandwidth = tables.pop("world")
    links = {s: {k: tuple(sorted(v)) for k, v in t.items()} for s, t in tables.items()}
    skip = ("bandwidth", "optimizer_shard_s_by_dtype", "quant_s_per_elem")
    worst = {k: max(r[k] for r in per_rank) for k in per_rank[0] if k not in skip}
    by_dtype = {
        sd: max(r["optimizer_shard_s_by_dtype"][sd] for r in per_rank)
        for sd in per_rank[0].get("optimizer_shard_s_by_dtype", {})
    }
    m = Measured(
        world_size=cfg.nproc,
        bandwidth={k: tuple(sorted(v)) for k, v in bandwidth.items()},
        fwd_bwd_s=worst["fwd_bwd_s"],
        optimizer_full_s=worst["optimizer_full_s"],
        optimizer_shard_s=worst["optimizer_shard_s"],
        optimizer_shard_s_by_dtype=by_dtype or None,
        quant_s_per_elem={
            f: max(r["quant_s_per_elem"][f] for r in per_rank)
            for f in per_rank[0].get("quant_s_per_elem", {})
        }
        or None,
        activation_bytes=float(worst["activation_bytes"]),
        links=links or None,
        ranks_per_node=ranks_per_node if links else 0,
        overlap=overlap_efficiency(cores(), cfg.local_nproc or cfg.nproc, cfg.threads),
    )
    compute = {
        "fwd_bwd_s": m.fwd_bwd_s,
        "fwd_bwd_s_per_rank": [r["fwd_bwd_s"] for r in per_rank],
        "optimizer_step_s": {
            "AdamW(fused=True), every param (DDP)": m.optimizer_full_s,
            "fused kernel, 1/N of the params (ZeRO shard)": m.optimizer_shard_s,
            **{
                f"fused kernel, 1/N of the params, {sd} state": t
                for sd, t in by_dtype.items()
                if sd != "fp32"
            },
        },
        "activation_bytes": m.activation_bytes,
        "quantize_dequantize_s_per_elem": m.quant_s_per_elem or {},
        "what": "measured: median of the timed runs, the slower rank",
    }
    return m, {"bandwidth": rows, "compute": compute, "hwm_reset": worst["hwm_reset"]}


def _order(trials: list[dict]) -> list[dict]:
    """DDP first, then the stages in turn, each in order of predicted time."""
    by_stage: dict[int, list[dict]] = {}
    for t in sorted(trials, key=lambda t: t["predicted"]["step_time_s"]):
        by_stage.setdefault(t["config"].stage, []).append(t)
    out = by_stage.pop(0, [])
    while any(by_stage.values()):
        for s in sorted(by_stage):
            if by_stage[s]:
                out.append(by_stage[s].pop(0))
    return out


def _run_trials(cfg: TuneConfig, launcher, order: list[dict], bar, t0: float) -> None:
    """Each configuration in ``order`` once per round, ``--repeats`` rounds (A B C A B C: drift
    on the machine hits every configuration alike), within --max-trials and --time-budget."""
    last_wall = None
    for rnd in range(cfg.repeats):
        for k, t in enumerate(order):
            c = t["config"]
            elapsed = time.monotonic() - t0
            guess = last_wall or (cfg.warmup + cfg.steps) * t["predicted"]["step_time_s"] + 1
            if t["status"] in ("failed", "not_run"):
                pass
            elif rnd == 0 and cfg.max_trials and k >= cfg.max_trials:
                t["status"], t["why"] = "not_run", f"--max-trials {cfg.max_trials} reached"
            elif (rnd or k) and launcher.agree(elapsed + guess > cfg.time_budget_s):
                if rnd == 0:
                    t["status"], t["why"] = "not_run", f"--time-budget {cfg.time_budget_s:g} s"
            else:
                bar.show(c.label + (f" (round {rnd + 1})" if cfg.repeats > 1 else ""))
                start = time.monotonic()
                try:
                    t.setdefault("runs", []).append(launcher.run(_job(cfg, "trial", config=c)))
                    t["status"] = "measured"
                except JobFailed as e:
                    t["status"], t["why"] = "failed", str(e)
                    t.pop("runs", None)
                last_wall = time.monotonic() - start
            bar.advance()


def _offload_dir(cfg: TuneConfig) -> str:
    return cfg.offload_dir or os.path.join(cfg.out, "offload")


def _probe_disk(directory: str, measured: Measured) -> tuple[Measured, dict]:
    """The offload folder's O_DIRECT bandwidth, for the offload trials' predicted I/O."""
    from ..offload import probe_disk

    os.makedirs(directory, exist_ok=True)
    d = probe_disk(directory, mb=64)
    m = replace(measured, disk_read_bps=d["read_gbps"] * 1e9, disk_write_bps=d["write_gbps"] * 1e9)
    return m, d


def run_tune(cfg: TuneConfig) -> int:
    """Run everything ([Note: what tune does]); returns the exit code. Under torchrun every
    rank of the job runs it ([Note: tune across nodes] in tune_job.py)."""
    if under_torchrun():
        from .tune_job import InJob

        launcher = InJob(cfg)
    else:
        launcher = _Launcher(cfg.nproc, cfg.trial_timeout_s)
    try:
        return _run(cfg, launcher)
    finally:
        launcher.close()


def _run(cfg: TuneConfig, launcher) -> int:
    import torch

    from .tune_report import finish

    t0 = time.monotonic()
    root = launcher.is_root
    if not root:
        cfg = replace(cfg, progress=False)
    if torch.cuda.is_available() and root:
        print(
            "zero-kernels tune: note: the ranks run on the CPU (gloo); tuning on GPUs (NCCL) "
            "is not implemented yet",
            file=sys.stderr,
        )
    facts: ModelFacts = model_facts(cfg.source)  # ValueError (exit 2) for a model tune can't run
    if cfg.buckets is None:
        cfg = replace(cfg, buckets=default_buckets(facts.n_params))
    hierarchy = ("world",)
    if launcher.links:  # several nodes, equal ranks in each ([Note: tune across nodes])
        hierarchy = ("world", "node") + (("secondary",) if 3 in cfg.stages else ())
    elif launcher.why_flat and root:
        print(f"zero-kernels tune: note: {launcher.why_flat}", file=sys.stderr)
    configs = grid(
        cfg.stages,
        cfg.buckets,
        cfg.prefetch,
        cfg.reduce_dtypes,
        cfg.overlap,
        cfg.ddp,
        cfg.state_dtypes,
        cfg.offloads,
        _offload_dir(cfg),
        cfg.quantize_weights,
        cfg.quantize_grads,
        hierarchy,
    )
    from ..comm import shm

    def algorithms_of(n: int, one_host: bool) -> tuple[str, ...]:
        out = ("native", "pairwise") + (("ring",) if n > 2 else ())
        return out + (("shm",) if one_host and shm.available() is None else ())

    algorithms = algorithms_of(cfg.nproc, launcher.nodes == 1)
    link_algorithms = {}
    if launcher.links:
        link_algorithms = {
            "node": algorithms_of(launcher.ranks_per_node, True),
            "cross": algorithms_of(launcher.nodes, False),
        }
    bar = Progress(len(configs) * cfg.repeats + 1, cfg.progress)
    try:
        bar.show("probe: bandwidth and compute")
        sizes = _probe_sizes(facts.n_params)
        try:
            probe = launcher.run(
                _job(
                    cfg,
                    "probe",
                    algorithms=algorithms,
                    link_algorithms=link_algorithms,
                    sizes=sizes,
                    state_dtypes=cfg.state_dtypes,
                    quant_formats=sorted({*cfg.quantize_weights, *cfg.quantize_grads} - {"none"}),
                )
            )
        except JobFailed as e:
            bar.close()
            if root:
                print(f"zero-kernels tune: error: the probe failed: {e}", file=sys.stderr)
            return 1
        bar.advance()
        measured, probe_json = _measured(cfg, probe, launcher.ranks_per_node)
        probe_json["hosts"] = launcher.hosts
        if any(c.offload != "none" for c in configs):  # the offload folder's disk, O_DIRECT
            measured, probe_json["disk"] = _probe_disk(_offload_dir(cfg), measured)
        trials = []
        for c in configs:
            mem = predict_memory(c, facts, measured)
            t = {"config": c, "predicted": predict_time(c, facts, measured), "memory": mem}
            over = cfg.mem_limit is not None and mem["total_bytes"] > cfg.mem_limit
            t["status"] = "over_limit" if over else "pending"
            trials.append(t)
        # across nodes rank 0's plan for all (its disk, its memory limit): the same trials
        # in the same order on every rank
        measured, probe_json, trials = launcher.agree((measured, probe_json, trials))
        for t in trials:
            if t["status"] == "over_limit":
                bar.advance(cfg.repeats)
        order = _order([t for t in trials if t["status"] == "pending"])
        _run_trials(cfg, launcher, order, bar, t0)
    except BaseException:
        bar.close()
        raise
    bar.close()
    code = finish(cfg, facts, measured, probe_json, trials, time.monotonic() - t0) if root else 0
    return launcher.agree(code)
