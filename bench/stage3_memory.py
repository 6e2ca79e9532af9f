"""bench_stage3's parts "capacity" and "memory": RSS trials in fresh process groups (peak RSS
above the import baseline per phase, a watchdog at a limit), the depth search under a
per-rank limit, and per-rank bytes against the formulas (see bench_stage3.py's docstring)."""

from __future__ import annotations

import ctypes
import dataclasses
import math
import os
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

from harness import ON_MARK, free_port, init_gloo, status_bytes  # noqa: E402
from stage3_candidates import MiB, build, gpt_cfg, import_libs  # noqa: E402

MB = 1e6


def _reset_hwm() -> None:
    """Reset this process's peak RSS (VmHWM, and with it ru_maxrss) to its current RSS."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


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


def _shm_mapped() -> int:
    """Bytes of zero_kernels.comm's shared-memory slots this rank maps (0: shm not used)."""
    from zero_kernels.comm import shm

    return shm.mapped_bytes()


def _scratch_kind(ranks: list) -> str:
    """Which collectives' scratch a trial used (`estimate_stage`'s ``comm_scratch``): the shm
    slots, pairwise receive buffers, or both (the probe chose per size class)."""
    shm = any(rk.get("shm_mapped_bytes") for rk in ranks)
    pairwise = any(
        (ph.get("comm_scratch") or {}).get("cached", 0) for rk in ranks for ph in rk["phases"]
    )
    return "pairwise+shm" if shm and pairwise else "shm" if shm else "pairwise"


def _scratch() -> dict:
    """zero_kernels.comm's cached p2p receive buffers (in use / cached bytes)."""
    from zero_kernels import comm

    return dict(comm.scratch_bytes())


def _host_cache() -> dict:
    """zero_kernels.hostmem's live and cached bytes, hits and misses (the host block cache)."""
    from zero_kernels import hostmem

    return hostmem.stats()


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
                    "host_cache": _host_cache(),
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
        import_libs(name)
        from zero_kernels.tools.models import GPT

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
                cfg = gpt_cfg(spec["layers"], spec["d"], spec["heads"], spec["tokens"])
                if spec.get("ckpt"):
                    cfg = dataclasses.replace(cfg, activation_checkpointing=True)
                model = GPT(cfg)
        psi = sum(p.numel() for p in model.parameters())
        largest_param = max(p.numel() for p in model.parameters())
        largest, root, n_units = _units_info(model)
        pk.mark("build model")
        step, opt = build(name, model, _NS(bucket_mb=spec["bucket_mb"], batch=spec["batch"]), 1e-4)
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
            "largest_param": largest_param,
            "largest_unit": largest,
            "root_unit": root,
            "n_units": n_units,
            "baseline_rss": baseline,
            "baseline_malloc": base_malloc,
            "malloc_mmap_threshold": os.environ.get("MALLOC_MMAP_THRESHOLD_"),
            "host_cache_env": os.environ.get("ZERO_KERNELS_HOST_CACHE"),
            "peak_above_base": pk.peak - baseline,
            "shm_mapped_bytes": _shm_mapped(),
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
        meta=cand.startswith("stage3"),
        ckpt=args.cap_ckpt,
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
    depth = max(1, int(0.8 * limit / (FORMULA_BPP[cand.split("_")[0]] * per_layer)))
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
    from zero_kernels.tools.estimate import estimate_stage

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
        ("mlp", "ddp + host cache", dict(mlp, cand="ddp_hostcache")),
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
        base_cand = spec["cand"].removesuffix("_hostcache").removesuffix("_nocache")
        stage = {"ddp": 0, "stage1": 1, "stage2": 2}.get(base_cand, 3)
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
            largest_param=ranks[0]["largest_param"],
            comm_scratch=_scratch_kind(ranks),
        )
        if stage == 3 and "noreshard" in spec["cand"]:
            est_live = None  # the window then spans forward to backward: not the estimator's
        else:
            est_live = est.live_bytes
        formula = est.total_bytes + est.comm_buffer_bytes
        with_scratch = formula + est.scratch_bytes  # + receive buffers, autograd's largest grad
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
            "formula_scratch_bpp": round(est.scratch_bytes / psi, 2),
            "shm_mapped_MB": round(max(rk.get("shm_mapped_bytes", 0) for rk in ranks) / MB, 1),
            "comm_scratch": _scratch_kind(ranks),
            "formula_with_scratch_bpp": round(with_scratch / psi, 2),
            "peak_vs_formula_with_scratch": round(peak / with_scratch, 3),
            "peak_phase": worst,
            **{f"phase: {k} (bpp)": round(v / psi, 2) for k, v in phases.items()},
            "end_rss_bpp": round(max(rk["phases"][-1]["rss_above_base"] for rk in ranks) / psi, 2),
            "loss_last_rank0": round(ranks[0]["losses"][-1], 6),
        }
        rss_rows.append(row)
        log(
            f"[memory] {model_name} {label}: {psi / 1e6:.1f}M params, peak-base "
            f"{peak / MB:.0f} MB = {peak / psi:.2f} B/param (formula {formula / psi:.2f}, "
            f"with scratch {with_scratch / psi:.2f}), "
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
