"""ZeRO stage 3 (issue 7, "Measured"): step time against FSDP2 and DeepSpeed ZeRO-3 at world
size 2, capacity (the largest GPT each stage trains under a per-rank memory limit) at 4 ranks,
and per-rank bytes against the formulas (tensor counts and peak RSS) at 4 ranks.

Part "timing" (world size 2, gloo on CPU, 1 thread per rank; zero_kernels.models.GPT, every
candidate built from the same seed, trained on the same per-rank batches with the same AdamW
hyper-parameters):

    ddp                     DDP(gradient_as_bucket_view=True) + torch AdamW(fused=True)
    fsdp2_reshard           torch.distributed.fsdp.fully_shard on each block of model.blocks, then
    fsdp2_noreshard         the root (reshard_after_forward True / False), torch AdamW(fused=True)
                            (fused works on FSDP2's DTensor params on CPU)
    fsdp2_*_prefetch        the same plus explicit prefetch of the next block in forward and the
                            previous one in backward, with asynchronous all-gathers
                            (``_set_unshard_async_op(True)``: on CPU FSDP2's default all-gathers
                            are synchronous, so prefetching only overlaps with async_op)
    deepspeed_zero3         deepspeed.initialize, zero_optimization stage 3 (overlap_comm,
                            contiguous_gradients; DeepSpeed's default prefetch / persistence
                            settings), DeepSpeedCPUAdam(adamw_mode=True), DS_ACCELERATOR=cpu
    ours_reshard            ZeroOptimizer(model, AdamW, stage=3, reshard_after_forward=True,
    ours_noreshard          prefetch=1) / reshard_after_forward=False, prefetch=1 /
    ours_prefetch0          reshard_after_forward=True, prefetch=0 (what prefetch overlaps)
    ours_*_native / _pairwise   (optional, --cands) the same with zero_kernels.comm's algorithm
                            pinned instead of probed

Every candidate runs in its own spawned process group (own 2 processes, own TCP store). All groups
are started first and stay alive; the parent runs one step of one group at a time (the others
block on a queue), in rounds whose order rotates (A B C .. / B C .. A / ...). Warm-up rounds are
excluded; medians over the measured rounds; a step's time is the slower rank's; "paired" ratios
are medians over rounds of the ratio of two candidates' steps in the same round. Exposed
communication per step: the union of every Python-level wait on a collective (torch's Work.wait,
which synchronous collectives call too) and the time from the last gradient produced to the end
of backward (where a post-accumulate-grad hook on the params fires at all: not for FSDP2's
DTensor params, whose collectives are all synchronous waits).

Part "capacity" (4 ranks): per-rank memory limit on peak RSS above the import baseline (RSS after
importing torch and the libraries, initialising the process group and `_warm_up`, which loads what
a first use would load lazily: torch._dynamo, ~150 MB, and the kernels' code pages). For each of
DDP and stages 1, 2, 3 the largest GPT depth (width fixed) that trains ``--cap-steps`` steps: every
trial in 4 fresh processes; a trial fits if max over ranks of (peak RSS - baseline) <= limit. A
watchdog in every rank ends a trial as soon as its VmHWM passes the limit (so failing trials are
cheap and never take the machine's memory). Depths are searched by bracketing: a first guess from
the formula, then points inside the bracket [largest fit, smallest fail] predicted by a line
through the measured peaks (bisection when there is no line yet), until the bracket is 1 wide.
Stage 3 builds the model on the meta device; DDP and stages 1, 2 build it normally.

Part "memory" (4 ranks): a 67M-param MLP (8 x Linear(2896, 2896)) and the timing GPT: peak RSS
per rank above the import baseline, per phase (the high-water mark is reset at each phase start
through /proc/self/clear_refs, so each phase's own peak is exact), in bytes/param against the
formulas; and stage 3's tensor counts (memory_report(): params, grads, optimizer state, gathered
units' peak, communication buffers) against zero_kernels.estimate's stage-3 figure.

    python bench/bench_stage3.py [--quick] [--out DIR] [--parts timing,capacity,memory]
"""

from __future__ import annotations

import argparse
import ctypes
import math
import os
import statistics
import sys
import threading
import time
import traceback

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from torch import nn  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, ".."))

import harness  # noqa: E402
from harness import (  # noqa: E402
    ON_MARK,
    free_port,
    init_gloo,
    markdown_table,
    marked_step,
    run_info,
    run_timing,
    status_bytes,
    write_results,
)

MB = 1e6
MiB = 2**20
ADAMW = dict(weight_decay=0.01, betas=(0.9, 0.999), eps=1e-8)


def _reset_hwm() -> None:
    """Reset this process's peak RSS (VmHWM, and with it ru_maxrss) to its current RSS."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _import_libs(name: str) -> None:
    """The candidate's libraries, imported before the baseline (their import is not training
    memory)."""
    from torch.nn.parallel import DistributedDataParallel  # noqa: F401

    import zero_kernels  # noqa: F401
    import zero_kernels.models  # noqa: F401

    if name.startswith("fsdp2"):
        from torch.distributed.fsdp import fully_shard  # noqa: F401
    if name.startswith("deepspeed"):
        import deepspeed  # noqa: F401
        from deepspeed.ops.adam import DeepSpeedCPUAdam  # noqa: F401
    _warm_up()


def _warm_up() -> None:
    """What any candidate's first use pulls in lazily, done before the baseline so that it is
    not counted as training memory: torch._dynamo and its ~900 modules (sympy...: ~150 MB of
    RSS, imported by the first DDP construction or meta-device init), and the code pages of the
    CPU kernels (a tiny GPT's forward, backward and fused AdamW step)."""
    import torch._dynamo  # noqa: F401

    from zero_kernels.models import GPT

    with torch.device("meta"):
        nn.Embedding(8, 8)
    torch.manual_seed(0)
    m = GPT(_gpt_cfg(1, 32, 4, 16))
    opt = torch.optim.AdamW(m.parameters(), fused=True)
    x = torch.randint(0, 256, (1, 16))
    m(x, x).backward()
    opt.step()
    del m, opt


def _gpt_cfg(layers: int, d: int, heads: int, tokens: int):
    from zero_kernels.models import GPTConfig

    return GPTConfig(vocab_size=256, block_size=tokens, n_layer=layers, n_head=heads, n_embd=d)


def _gpt_batch(args, rank: int, step: int):
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randint(0, 256, (args.batch, args.tokens), generator=g)
    return x, torch.roll(x, -1, dims=1)


def _build(name: str, model: nn.Module, args, lr: float):
    """-> (step(x, y) -> loss, optimizer-or-engine). Candidates as in the module docstring."""
    kw = dict(lr=lr, **ADAMW)
    if name == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        ddp = DDP(model, gradient_as_bucket_view=True, bucket_cap_mb=args.bucket_mb)
        opt = torch.optim.AdamW(model.parameters(), fused=True, **kw)

        # None (not zeros): backward makes them views of DDP's buckets again, and the
        # buckets rebuilt in the 2nd step do not coexist with the 1st step's (+4 B/param)
        zero = lambda: opt.zero_grad(set_to_none=True)  # noqa: E731
        return marked_step(lambda x, y: _fwd_loss(ddp, x, y), opt.step, zero), opt
    if name.startswith("fsdp2"):
        from torch.distributed.fsdp import fully_shard

        reshard = "_noreshard" not in name
        blocks = list(model.blocks)
        for b in blocks:
            fully_shard(b, reshard_after_forward=reshard)
        fully_shard(model, reshard_after_forward=reshard)
        if name.endswith("_prefetch"):
            for i, b in enumerate(blocks):
                if i + 1 < len(blocks):
                    b.set_modules_to_forward_prefetch([blocks[i + 1]])
                if i > 0:
                    b.set_modules_to_backward_prefetch([blocks[i - 1]])
            model._set_unshard_async_op(True)
        opt = torch.optim.AdamW(model.parameters(), fused=True, **kw)

        zero = lambda: opt.zero_grad(set_to_none=True)  # noqa: E731
        return marked_step(lambda x, y: _fwd_loss(model, x, y), opt.step, zero), opt
    if name.startswith("deepspeed"):
        import deepspeed
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        opt = DeepSpeedCPUAdam(model.parameters(), adamw_mode=True, **kw)
        elems = int(args.bucket_mb * MiB) // 4
        cfg = {
            "train_micro_batch_size_per_gpu": args.batch,
            "gradient_accumulation_steps": 1,
            "gradient_clipping": 0.0,
            "fp16": {"enabled": False},
            "bf16": {"enabled": False},
            "zero_optimization": {
                "stage": 3,
                "overlap_comm": True,
                "contiguous_gradients": True,
                "reduce_bucket_size": elems,
            },
            "steps_per_print": 10**9,
            "wall_clock_breakdown": False,
        }
        engine, _, _, _ = deepspeed.initialize(
            model=model, optimizer=opt, config=cfg, dist_init_required=False
        )

        step = marked_step(
            lambda x, y: _fwd_loss(engine, x, y), engine.step, backward=engine.backward
        )
        return step, engine
    if name.startswith(("ours", "stage")):
        from zero_kernels import ZeroOptimizer

        stage = 3 if name.startswith("ours") else int(name[5])
        for algo in ("native", "pairwise"):  # pin the collectives' algorithm (default: probe)
            if name.endswith("_" + algo):
                from zero_kernels import comm

                comm.set_algorithm("all", algo)
                name = name[: -len(algo) - 1]
        extra = {}
        if stage == 3:
            extra = dict(
                reshard_after_forward="_noreshard" not in name,
                prefetch=0 if name.endswith("prefetch0") else 1,
            )
        opt = ZeroOptimizer(
            model, torch.optim.AdamW, stage=stage, bucket_size_mb=args.bucket_mb, **extra, **kw
        )

        return marked_step(lambda x, y: _fwd_loss(model, x, y), opt.step, opt.zero_grad), opt
    raise ValueError(f"unknown candidate {name!r}")


def _fwd_loss(fwd, x, y):
    if y is None:  # the MLP
        return fwd(x).pow(2).mean()
    return fwd(x, y)


# ------------------------------------------------------------------------------------ timing


def _timing_model(name: str, args) -> nn.Module:
    from zero_kernels.models import GPT

    return GPT(_gpt_cfg(args.layers, args.d, args.heads, args.tokens))


def _timing_ready(name: str, opt) -> dict:
    return {"units": [n for n, _ in opt._unit_modules] if name.startswith("ours") else None}


# the timing part's candidates, for harness.run_timing (module-level functions: spawn pickles them)
TIMING = dict(
    imports=_import_libs, model=_timing_model, build=_build, batch=_gpt_batch, ready=_timing_ready
)


def summarize_timing(raw: dict, cands: list[str]) -> list[dict]:
    steps = raw["steps"]

    def per_round(name, key="step_s"):
        return harness.per_round(steps, name, key)

    def paired(name, other):
        return harness.paired(steps, name, other)

    fsdp = [c for c in cands if c.startswith("fsdp2")]
    best_fsdp = min(fsdp, key=lambda c: statistics.median(per_round(c))) if fsdp else None
    rows = []
    for name in cands:
        med = statistics.median(per_round(name))
        fin, su = raw["finals"][name], raw["setup"][name]
        row = {
            "candidate": name,
            "median_step_s": round(med, 4),
            "min_step_s": round(min(per_round(name)), 4),
            "vs_ddp_paired": paired(name, "ddp"),
            "vs_fsdp2_reshard_paired": paired(name, "fsdp2_reshard"),
            "vs_fsdp2_noreshard_paired": paired(name, "fsdp2_noreshard"),
            "vs_best_fsdp2_paired": paired(name, best_fsdp) if best_fsdp else "",
            "fwd_s": round(statistics.median(per_round(name, "fwd_s")), 4),
            "bwd_s": round(statistics.median(per_round(name, "bwd_s")), 4),
            "opt_s": round(statistics.median(per_round(name, "opt_s")), 4),
            "exposed_comm_s": round(statistics.median(per_round(name, "exposed_comm_s")), 4),
            "fwd_wait_s": round(statistics.median(per_round(name, "fwd_wait_s")), 4),
            "bwd_wait_s": round(statistics.median(per_round(name, "bwd_wait_s")), 4),
            "opt_wait_s": round(statistics.median(per_round(name, "opt_wait_s")), 4),
            "peak_rss_MB": round(max(f["peak_rss"] for f in fin.values()) / MB, 1),
            "peak_minus_import_MB": round(
                max(fin[r]["peak_rss"] - su[r]["rss_after_import"] for r in fin) / MB, 1
            ),
            "last_loss_rank0": round(steps[name][-1][0]["loss"], 5),
            "n": len(steps[name]),
        }
        if name.startswith("ours"):
            cs = fin[0]["comm_stats"]
            row["own_exposed_comm_s"] = round(cs["exposed_comm_s"] / max(cs["steps"], 1), 4)
            row["all_gather_MB_per_step"] = round(
                cs["all_gather_bytes"] / max(cs["steps"], 1) / MB, 2
            )
            row["reduce_scatter_MB_per_step"] = round(
                cs["reduce_scatter_bytes"] / max(cs["steps"], 1) / MB, 2
            )
        rows.append(row)
    return rows, best_fsdp


# ------------------------------------------------------------------------------------ RSS trials


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (k, ctypes.c_size_t)
        for k in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def _malloc_stats() -> dict:
    """glibc's heap: bytes in the main arena (``arena``), in use there (``uordblks``), free but
    kept by the allocator (``fordblks``), and in mmapped chunks (``hblkhd``)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = _MallInfo2
        m = libc.mallinfo2()
    except (OSError, AttributeError):
        return {}
    return {k: int(getattr(m, k)) for k in ("arena", "uordblks", "fordblks", "hblkhd")}


def _scratch() -> dict:
    """zero_kernels.comm's cached p2p receive buffers (in use / cached bytes)."""
    from zero_kernels import comm

    return dict(comm.scratch_bytes())


class _Peak:
    """Peak RSS since ``start()`` with per-phase peaks (the high-water mark is reset at every
    phase start) and a watchdog that reports and stops the trial once it passes ``limit``."""

    def __init__(self, baseline: int, limit: float | None, on_over):
        self.baseline, self.limit, self.on_over = baseline, limit, on_over
        self.peak = status_bytes("VmRSS")
        self.phases: list[dict] = []
        self.lock = threading.Lock()
        self.stop = False
        _reset_hwm()
        if limit is not None:
            threading.Thread(target=self._watch, daemon=True).start()

    def _watch(self):
        while not self.stop:
            with self.lock:
                self.peak = max(self.peak, status_bytes("VmHWM"))
                over = self.peak - self.baseline > self.limit
            if over:
                self.on_over(self.peak)
                return
            time.sleep(0.01)

    def mark(self, phase: str) -> None:
        with self.lock:
            hwm = status_bytes("VmHWM")
            self.peak = max(self.peak, hwm)
            self.phases.append(
                {
                    "phase": phase,
                    "peak_above_base": hwm - self.baseline,
                    "rss_above_base": status_bytes("VmRSS") - self.baseline,
                    "malloc": _malloc_stats(),
                    "comm_scratch": _scratch(),
                }
            )
            _reset_hwm()


def _mlp(width: int, layers: int) -> nn.Module:
    return nn.Sequential(*(nn.Linear(width, width) for _ in range(layers)))


def _units_info(model: nn.Module) -> tuple[int, int, int]:
    """(largest unit, root unit, number of units) in params, as ZeroOptimizer splits stage 3."""
    from zero_kernels.partition.units import find_units

    units = find_units(model, None)
    in_units = {id(p) for _, m in units for p in m.parameters()}
    sizes = [sum(p.numel() for p in m.parameters()) for _, m in units]
    root = sum(p.numel() for p in model.parameters() if id(p) not in in_units)
    return max(sizes, default=0), root, len(units)


def rss_worker(spec: dict, rank: int, world: int, port: int, res_q) -> None:
    """One trial: build, wrap and train ``spec`` for a few steps; report peaks above the
    import baseline (per phase) and, for ZeroOptimizer, memory_report()."""
    try:
        name = spec["cand"]
        init_gloo(rank, world, port)
        _import_libs(name)
        from zero_kernels.models import GPT

        dist.barrier()
        baseline = status_bytes("VmRSS")

        def over(peak):
            res_q.put((rank, "over", {"peak_above_base": peak - baseline}))

        base_malloc = _malloc_stats()
        pk = _Peak(baseline, spec.get("limit"), over)
        meta = spec.get("meta", False)
        torch.manual_seed(0)
        with torch.device("meta") if meta else _nullctx():
            if spec["model"] == "mlp":
                model = _mlp(spec["width"], spec["layers"])
            else:
                model = GPT(_gpt_cfg(spec["layers"], spec["d"], spec["heads"], spec["tokens"]))
        psi = sum(p.numel() for p in model.parameters())
        largest, root, n_units = _units_info(model)
        pk.mark("build model")
        step, opt = _build(name, model, _NS(bucket_mb=spec["bucket_mb"], batch=spec["batch"]), 1e-4)
        dist.barrier()
        pk.mark("construct optimizer")
        t0 = time.perf_counter()
        losses = []
        step_no = [0]
        ON_MARK.append(lambda what: pk.mark(f"step {step_no[0]} {what}"))
        for i in range(spec["steps"]):
            step_no[0] = i + 1
            g = torch.Generator().manual_seed(1000 * i + rank)
            if spec["model"] == "mlp":
                x, y = torch.randn(spec["batch"], spec["width"], generator=g), None
            else:
                x = torch.randint(0, 256, (spec["batch"], spec["tokens"]), generator=g)
                y = torch.roll(x, -1, dims=1)
            losses.append(float(step(x, y).detach()))
            pk.mark(f"step {i + 1} opt")
        dist.barrier()
        pk.stop = True
        out = {
            "psi": psi,
            "largest_unit": largest,
            "root_unit": root,
            "n_units": n_units,
            "baseline_rss": baseline,
            "baseline_malloc": base_malloc,
            "malloc_mmap_threshold": os.environ.get("MALLOC_MMAP_THRESHOLD_"),
            "peak_above_base": pk.peak - baseline,
            "phases": pk.phases,
            "losses": losses,
            "train_s": time.perf_counter() - t0,
        }
        if hasattr(opt, "memory_report"):
            out["memory_report"] = opt.memory_report()
        res_q.put((rank, "ok", out))
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001
        res_q.put((rank, "error", traceback.format_exc()))


class _NS:
    def __init__(self, **kw):
        self.__dict__.update(kw)


class _nullctx:
    def __enter__(self):
        return None

    def __exit__(self, *a):
        return False


def run_rss_trial(spec: dict, world: int, timeout: float = 600) -> dict:
    """4 fresh processes; -> {"fit": bool, "peak_above_base": max over ranks, "ranks": [...]}."""
    for _attempt in range(3):  # a port taken between choosing and binding it: choose again
        r = _rss_trial(spec, world, timeout)
        if "EADDRINUSE" not in r.get("error", ""):
            return r
    return r


def _rss_trial(spec: dict, world: int, timeout: float) -> dict:
    ctx = mp.get_context("spawn")
    res_q = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=rss_worker, args=(spec, r, world, port, res_q), daemon=True)
        for r in range(world)
    ]
    for p in procs:
        p.start()
    t0 = time.perf_counter()
    ranks: dict[int, dict] = {}
    result = {"fit": True}
    try:
        while len(ranks) < world:
            rank, kind, payload = res_q.get(timeout=timeout)
            if kind == "ok":
                ranks[rank] = payload
                continue
            if kind == "over":
                result = {"fit": False, "over_rank": rank, **payload}
            else:
                result = {"fit": False, "error": payload}
            break
    finally:
        for p in procs:
            if p.is_alive() and not (result["fit"] and len(ranks) == world):
                p.kill()
        for p in procs:
            p.join(timeout=60)
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    if result["fit"]:
        result["ranks"] = [ranks[r] for r in range(world)]
        result["peak_above_base"] = max(r["peak_above_base"] for r in ranks.values())
        lim = spec.get("limit")
        result["fit"] = lim is None or result["peak_above_base"] <= lim
    return result


# ------------------------------------------------------------------------------------ capacity


def _gpt_params(layers: int, d: int, tokens: int) -> int:
    per = 12 * d * d + 13 * d
    return layers * per + 256 * d + tokens * d + 2 * d


FORMULA_BPP = {"ddp": 16.0, "stage1": 4 + 4 + 8 / 4, "stage2": 4 + 12 / 4, "stage3": 16 / 4}


def capacity_search(cand: str, args, log) -> dict:
    world = 4
    limit = int(args.cap_limit_mib * MiB)
    per_layer = 12 * args.cap_d**2 + 13 * args.cap_d
    spec0 = dict(
        cand=cand,
        model="gpt",
        d=args.cap_d,
        heads=args.cap_heads,
        tokens=args.cap_tokens,
        batch=args.cap_batch,
        bucket_mb=args.bucket_mb,
        steps=args.cap_steps,
        limit=limit,
        meta=cand == "stage3",
    )
    trials: list[dict] = []
    lo, hi = 0, None  # largest depth that fits, smallest that does not

    def line_guess():
        pts = sorted({(t["layers"], t["peak_above_base"]) for t in trials if t["fit"]})
        if len(pts) >= 2:
            (d0, m0), (d1, m1) = pts[-2], pts[-1]
            slope = (m1 - m0) / (d1 - d0)
            if slope > 0:
                return int(math.floor(d1 + (limit - m1) / slope))
        if len(pts) == 1:  # a line through the origin: overestimates the slope, so guesses low
            d0, m0 = pts[0]
            return int(math.floor(d0 * limit / max(m0, 1)))
        return None

    # first guess from the formula, 80% of the limit (activations and buffers are not in it)
    depth = max(1, int(0.8 * limit / (FORMULA_BPP[cand] * per_layer)))
    t_start = time.perf_counter()
    while True:
        r = run_rss_trial({**spec0, "layers": depth}, world)
        entry = {
            "layers": depth,
            "params": _gpt_params(depth, args.cap_d, args.cap_tokens),
            "fit": r["fit"],
            "peak_above_base": r.get("peak_above_base"),
            "wall_s": r["wall_s"],
        }
        if "error" in r:
            entry["error"] = r["error"][-2000:]
        if r.get("ranks"):
            entry["peak_above_base_per_rank"] = [x["peak_above_base"] for x in r["ranks"]]
            entry["phases_rank0"] = r["ranks"][0]["phases"]
            entry["psi"] = r["ranks"][0]["psi"]
            entry["params"] = entry["psi"]
        trials.append(entry)
        pk = entry["peak_above_base"]
        log(
            f"[capacity] {cand} depth {depth} ({entry['params'] / 1e6:.1f}M): "
            f"{'fits' if r['fit'] else 'does not fit'}"
            + (f", peak-base {pk / MiB:.0f} MiB" if pk is not None else "")
            + (f" ({r['error'].strip().splitlines()[-1]})" if "error" in r else "")
            + f", {r['wall_s']:.0f}s"
        )
        if "error" in r:  # a crash is not a memory verdict: stop rather than guess
            raise RuntimeError(f"capacity {cand} depth {depth} failed:\n{r['error']}")
        if r["fit"]:
            lo = max(lo, depth)
        else:
            hi = depth if hi is None else min(hi, depth)
        if hi is not None and hi - lo <= 1:
            break
        g = line_guess()
        if hi is None:  # no failure yet: go up, at least 25% (the origin line guesses low)
            nxt = max(g or 0, lo + max(1, lo // 4))
        elif lo == 0:  # no fit yet: halve
            nxt = max(1, hi // 2)
        else:  # inside the bracket: the line through two fits, else the midpoint
            two = len({t["layers"] for t in trials if t["fit"]}) >= 2
            nxt = g if g is not None and two else (lo + hi) // 2
            nxt = min(max(nxt, lo + 1), hi - 1)
        depth = nxt
    best = next((t for t in trials if t["layers"] == lo), None)
    return {
        "candidate": cand,
        "max_layers": lo,
        "max_params": best["params"] if best else 0,
        "peak_above_base_at_max": best["peak_above_base"] if best else None,
        "first_fail_layers": hi,
        "trials": trials,
        "search_s": round(time.perf_counter() - t_start, 1),
    }


# ------------------------------------------------------------------------------------ memory


def memory_rows(args, log) -> tuple[list[dict], list[dict], dict]:
    """Peak RSS per phase on the MLP at 4 ranks for DDP and stages 1-3 (stages 1/2 also built
    on the meta device), and stage-3 tensor counts on the MLP and the timing GPT."""
    from zero_kernels.estimate import estimate_stage

    world = 4
    base = dict(bucket_mb=args.bucket_mb, steps=args.mem_steps, limit=None)
    mlp = dict(
        base, model="mlp", width=args.mlp_width, layers=args.mlp_layers, batch=args.mlp_batch
    )
    gpt = dict(
        base,
        model="gpt",
        layers=args.layers,
        d=args.d,
        heads=args.heads,
        tokens=args.tokens,
        batch=args.batch,
    )
    runs = [
        ("mlp", "ddp", dict(mlp, cand="ddp")),
        ("mlp", "stage1", dict(mlp, cand="stage1")),
        ("mlp", "stage2", dict(mlp, cand="stage2")),
        ("mlp", "stage3", dict(mlp, cand="ours_reshard", meta=True)),
        ("mlp", "stage1 (meta build)", dict(mlp, cand="stage1", meta=True)),
        ("mlp", "stage2 (meta build)", dict(mlp, cand="stage2", meta=True)),
        ("mlp", "stage3 (normal build)", dict(mlp, cand="ours_reshard")),
        ("gpt", "stage3", dict(gpt, cand="ours_reshard", meta=True)),
        ("gpt", "stage3 no reshard", dict(gpt, cand="ours_noreshard", meta=True)),
    ]
    if args.mem_runs:
        keep = set(args.mem_runs.split(","))
        runs = [r for i, r in enumerate(runs) if str(i) in keep]
    rss_rows, s3_rows, raw = [], [], {}
    for model_name, label, spec in runs:
        r = run_rss_trial(spec, world)
        if "error" in r:
            raise RuntimeError(f"{model_name} {label}: {r['error']}")
        raw[f"{model_name} {label}"] = r
        ranks = r["ranks"]
        psi = ranks[0]["psi"]
        stage = {"ddp": 0, "stage1": 1, "stage2": 2}.get(spec["cand"], 3)
        largest, root = ranks[0]["largest_unit"], ranks[0]["root_unit"]
        est = estimate_stage(
            stage,
            psi,
            world,
            precision="fp32",
            optimizer="adamw",
            largest_layer=largest if stage == 3 else None,
            root_params=root if stage == 3 else 0,
            prefetch=1,
            bucket_mb=args.bucket_mb,
        )
        if stage == 3 and "noreshard" in spec["cand"]:
            est_live = None  # the window then spans forward to backward: not the estimator's
        else:
            est_live = est.live_bytes
        formula = est.total_bytes + est.comm_buffer_bytes
        peak = r["peak_above_base"]
        # which phase holds the peak (max over ranks of each phase's own peak)
        phases = {}
        for rk in ranks:
            for ph in rk["phases"]:
                phases[ph["phase"]] = max(phases.get(ph["phase"], 0), ph["peak_above_base"])
        worst = max(phases, key=phases.get)
        row = {
            "model": model_name,
            "candidate": label,
            "params": psi,
            "peak_above_base_MB": round(peak / MB, 1),
            "bytes_per_param": round(peak / psi, 2),
            "formula_bytes_per_param": round(formula / psi, 2),
            "formula_model_states_bpp": round((est.total_bytes - est.live_bytes) / psi, 2),
            "formula_live_bpp": round(est.live_bytes / psi, 2),
            "formula_comm_buffers_bpp": round(est.comm_buffer_bytes / psi, 2),
            "peak_vs_formula": round(peak / formula, 3),
            "peak_phase": worst,
            **{f"phase: {k} (bpp)": round(v / psi, 2) for k, v in phases.items()},
            "end_rss_bpp": round(max(rk["phases"][-1]["rss_above_base"] for rk in ranks) / psi, 2),
            "loss_last_rank0": round(ranks[0]["losses"][-1], 6),
        }
        rss_rows.append(row)
        log(
            f"[memory] {model_name} {label}: {psi / 1e6:.1f}M params, peak-base "
            f"{peak / MB:.0f} MB = {peak / psi:.2f} B/param (formula {formula / psi:.2f}), "
            f"phases " + ", ".join(f"{k} {v / psi:.2f}" for k, v in phases.items())
        )
        if stage == 3:
            reps = [rk["memory_report"] for rk in ranks]

            def mx(key, reps=reps):
                return max(rep.get(key, 0) for rep in reps)

            states = max(
                rep["param_bytes"]
                + rep["grad_bytes"]
                + rep["master_bytes"]
                + rep["optim_state_bytes"]
                for rep in reps
            )
            live = mx("gathered_param_peak_bytes")
            est_states = est.total_bytes - est.live_bytes
            s3_rows.append(
                {
                    "model": model_name,
                    "candidate": label,
                    "world_size": world,
                    "params": psi,
                    "units": ranks[0]["n_units"],
                    "largest_unit": largest,
                    "root_unit": root,
                    "params_MB": round(mx("param_bytes") / MB, 3),
                    "params_formula_MB": round(est.params_bytes / MB, 3),
                    "grads_MB": round(mx("grad_bytes") / MB, 3),
                    "grads_formula_MB": round(est.grads_bytes / MB, 3),
                    "optim_MB": round(
                        max(rep["master_bytes"] + rep["optim_state_bytes"] for rep in reps) / MB, 3
                    ),
                    "optim_formula_MB": round(est.optim_bytes / MB, 3),
                    "model_states_MB": round(states / MB, 3),
                    "model_states_formula_MB": round(est_states / MB, 3),
                    "live_peak_MB": round(live / MB, 3),
                    "live_formula_MB": round(est_live / MB, 3) if est_live is not None else "",
                    "total_MB": round((states + live) / MB, 3),
                    "total_formula_MB": round(est.total_bytes / MB, 3),
                    "total_vs_formula": round((states + live) / est.total_bytes, 4),
                    "comm_buffers_peak_MB": round(mx("comm_buffer_peak_bytes") / MB, 3),
                    "comm_buffers_formula_MB": round(est.comm_buffer_bytes / MB, 3),
                    "comm_buffers_now_MB": round(mx("comm_buffer_bytes") / MB, 3),
                }
            )
    return rss_rows, s3_rows, raw


# ------------------------------------------------------------------------------------ main


def main():
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--quick",
        action="store_true",
        help="smoke run (~6 min): tiny models, capacity of DDP and stage 3, 3 memory runs",
    )
    ap.add_argument("--out", default=os.path.join(HERE, "results"), help="folder for stage3_*.json")
    ap.add_argument("--parts", default="timing,capacity,memory")
    ap.add_argument("--tag", default="", help="suffix of the output names (e.g. a regime)")
    # timing
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--d", type=int, default=256)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=12, help="measured rounds")
    ap.add_argument("--bucket-mb", type=float, default=25.0)
    ap.add_argument(
        "--cands",
        default="ddp,fsdp2_reshard,fsdp2_noreshard,fsdp2_reshard_prefetch,"
        "fsdp2_noreshard_prefetch,deepspeed_zero3,ours_reshard,ours_noreshard,ours_prefetch0",
    )
    # capacity
    ap.add_argument("--cap-limit-mib", type=float, default=1024)
    ap.add_argument("--cap-d", type=int, default=512)
    ap.add_argument("--cap-heads", type=int, default=8)
    ap.add_argument("--cap-tokens", type=int, default=64)
    ap.add_argument("--cap-batch", type=int, default=1)
    ap.add_argument("--cap-steps", type=int, default=3)
    ap.add_argument("--cap-cands", default="ddp,stage1,stage2,stage3")
    ap.add_argument(
        "--merge",
        action="store_true",
        help="capacity: keep the other candidates' searches already in the output file "
        "(to split the search over several runs)",
    )
    # memory
    ap.add_argument("--mlp-width", type=int, default=2896)
    ap.add_argument("--mlp-layers", type=int, default=8)
    ap.add_argument("--mlp-batch", type=int, default=16)
    ap.add_argument("--mem-steps", type=int, default=3)
    ap.add_argument("--mem-runs", default="", help="indices of the memory runs to do (default all)")
    ap.add_argument(
        "--malloc-mmap-threshold",
        type=int,
        default=None,
        help="set MALLOC_MMAP_THRESHOLD_ (bytes) for every rank: glibc then serves every "
        "allocation above it with its own mmap, given back to the OS when freed, instead of "
        "raising the threshold dynamically (up to 32 MiB) and keeping freed blocks in its heap",
    )
    args = ap.parse_args()
    if args.malloc_mmap_threshold is not None:  # read by glibc at the start of each rank
        os.environ["MALLOC_MMAP_THRESHOLD_"] = str(args.malloc_mmap_threshold)
    if args.quick:
        args.layers, args.d, args.heads, args.tokens, args.batch = 2, 64, 4, 32, 2
        args.warmup, args.repeats = 1, 2
        args.cap_limit_mib, args.cap_d, args.cap_tokens = 48, 128, 32
        args.mlp_width, args.mlp_layers = 512, 8
        args.mem_steps = args.cap_steps = 2
        if args.cap_cands == ap.get_default("cap_cands"):
            args.cap_cands = "ddp,stage3"
        if not args.mem_runs:
            args.mem_runs = "0,3,7"  # MLP: DDP and stage 3; GPT: stage 3
    parts = set(args.parts.split(","))
    tag = f"_{args.tag}" if args.tag else ""

    def log(msg):
        print(msg, flush=True)

    t_start = time.perf_counter()
    info = run_info("bench_stage3.py")
    config = {k: v for k, v in vars(args).items() if k not in ("out", "parts", "tag")}
    cands = args.cands.split(",")
    if "deepspeed_zero3" in cands and info["deepspeed"].startswith("not available"):
        log(f"[timing] DeepSpeed not measured: {info['deepspeed']}")
        cands.remove("deepspeed_zero3")

    if "timing" in parts:
        raw = run_timing(TIMING, args, cands, log)
        info["load_avg_after_timing"] = os.getloadavg()
        rows, best_fsdp = summarize_timing(raw, cands)
        psi = raw["setup"][cands[0]][0]["psi"]
        j, _ = write_results(
            args.out,
            f"stage3_timing{tag}",
            {
                "machine": info,
                "config": config,
                "world_size": 2,
                "params": psi,
                "best_fsdp2": best_fsdp,
                "ours": {n: raw["finals"][n][0] for n in cands if n.startswith("ours")},
                "units": {n: raw["setup"][n][0]["units"] for n in cands if n.startswith("ours")},
                "per_step": raw["steps"],
                "setup": raw["setup"],
            },
            rows,
        )
        log(f"[timing] {psi / 1e6:.2f}M params, world size 2; wrote {j}")
        log(
            markdown_table(
                rows,
                [
                    "candidate",
                    "median_step_s",
                    "vs_ddp_paired",
                    "vs_fsdp2_reshard_paired",
                    "vs_fsdp2_noreshard_paired",
                    "vs_best_fsdp2_paired",
                    "fwd_s",
                    "bwd_s",
                    "opt_s",
                    "exposed_comm_s",
                    "fwd_wait_s",
                    "bwd_wait_s",
                    "own_exposed_comm_s",
                    "peak_rss_MB",
                    "peak_minus_import_MB",
                    "last_loss_rank0",
                ],
            )
        )
    if "capacity" in parts:
        results = []
        cap_path = os.path.join(args.out, f"stage3_capacity{tag}.json")
        if args.merge and os.path.exists(cap_path):  # searches of earlier runs (one per run)
            import json

            with open(cap_path) as f:
                results = json.load(f)["searches"]
        for cand in args.cap_cands.split(","):
            res = capacity_search(cand, args, log)
            res["machine"] = dict(info, load_avg_after=os.getloadavg())
            res["config"] = {k: v for k, v in config.items() if k.startswith(("cap_", "bucket"))}
            results = [r for r in results if r["candidate"] != cand] + [res]
            log(
                f"[capacity] {cand}: {res['max_layers']} layers, {res['max_params'] / 1e6:.1f}M "
                f"params ({res['search_s']:.0f}s)"
            )
        order = ["ddp", "stage1", "stage2", "stage3"]
        results.sort(key=lambda r: order.index(r["candidate"]) if r["candidate"] in order else 9)
        ddp = next((r for r in results if r["candidate"] == "ddp"), None)
        rows = []
        for r in results:
            rows.append(
                {
                    "candidate": r["candidate"],
                    "max_layers": r["max_layers"],
                    "max_params_M": round(r["max_params"] / 1e6, 2),
                    "vs_ddp_params": round(r["max_params"] / ddp["max_params"], 2)
                    if ddp and ddp["max_params"]
                    else "",
                    "peak_above_base_MiB": round((r["peak_above_base_at_max"] or 0) / MiB, 1),
                    "first_fail_layers": r["first_fail_layers"],
                    "trials": len(r["trials"]),
                    "search_s": r["search_s"],
                }
            )
        j, _ = write_results(
            args.out,
            f"stage3_capacity{tag}",
            {"machine": info, "config": config, "world_size": 4, "searches": results},
            rows,
        )
        log(f"[capacity] limit {args.cap_limit_mib:.0f} MiB per rank, 4 ranks; wrote {j}")
        log(markdown_table(rows, list(rows[0])))
    if "memory" in parts:
        rss_rows, s3_rows, raw = memory_rows(args, log)
        mem_path = os.path.join(args.out, f"stage3_memory{tag}.json")
        for r in raw.values():
            r["machine"] = info
        if args.merge and os.path.exists(mem_path):  # runs of earlier invocations
            import json

            with open(mem_path) as f:
                old = json.load(f)
            key = lambda r: (r["model"], r["candidate"])  # noqa: E731
            new_keys = {key(r) for r in rss_rows}
            rss_rows = [r for r in old["rows"] if key(r) not in new_keys] + rss_rows
            s3_rows = [r for r in old["stage3_tensor_bytes"] if key(r) not in new_keys] + s3_rows
            raw = {**{k: v for k, v in old["trials"].items() if k not in raw}, **raw}
        j, _ = write_results(
            args.out,
            f"stage3_memory{tag}",
            {
                "machine": info,
                "config": config,
                "world_size": 4,
                "stage3_tensor_bytes": s3_rows,
                "trials": raw,
            },
            rss_rows,
        )
        log(f"[memory] wrote {j}")
        log(
            markdown_table(
                rss_rows,
                [
                    "model",
                    "candidate",
                    "params",
                    "peak_above_base_MB",
                    "bytes_per_param",
                    "formula_bytes_per_param",
                    "peak_vs_formula",
                    "peak_phase",
                    "end_rss_bpp",
                ],
            )
        )
        log(markdown_table(s3_rows, list(s3_rows[0])) if s3_rows else "")
    log(f"[stage3] done in {time.perf_counter() - t_start:.0f}s")


if __name__ == "__main__":
    main()
