"""The result of `zero-kernels tune`: the recommendation, the table, tune.json and tune.png.

Every figure is labelled as what it is: ``measured`` (a trial or the probe ran it here) or
``predicted`` ([Note: the prediction] in `zero_kernels.cli.tune_plan`); a configuration that
did not run has no measured figures at all.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

from ..tools import estimate as est

__all__ = ["finish"]

_STATUS_ORDER = {"measured": 0, "failed": 1, "not_run": 2, "over_limit": 3}


def _ms(s: float | None) -> str:
    return "-" if s is None else f"{1e3 * s:.1f} ms"


def _aggregate(t: dict, limit: int | None) -> dict:
    """One trial's JSON entry: its configuration, measured figures (the slower rank's median
    step, the largest peak), the prediction, and whether it fits."""
    c = t["config"]
    entry = {
        "config": c.as_dict(),
        "policy_options": c.policy_options() if c.stage else None,
        "status": t["status"],
        "why": t.get("why"),
        "measured": None,
        "predicted": {**t["predicted"], "memory": t["memory"]},
        "ratio_measured_to_predicted": None,
        "fits": None,
    }
    if t["status"] == "over_limit":
        entry["why"] = f"over limit (predicted {est.format_bytes(t['memory']['total_bytes'])})"
        entry["fits"] = False
    if t["status"] != "measured":
        return entry
    runs = t["runs"]  # each a list by rank
    slow = [max(ranks, key=lambda r: r["step_time_s"]) for ranks in runs]  # per run
    step = statistics.median(r["step_time_s"] for r in slow)
    peaks = [max(r["peak_rss_bytes"] for r in ranks) for ranks in runs]
    peak = max(peaks)
    ranks = runs[0]
    entry["measured"] = {
        "step_time_s": step,
        "step_time_s_per_run": [r["step_time_s"] for r in slow],
        "step_time_s_per_rank": [r["step_time_s"] for r in ranks],
        "step_times_s_per_rank": [r["step_times_s"] for r in ranks],
        "spread": _spread([x for r in slow for x in r["step_times_s"]]),
        "peak_rss_bytes": peak,
        "peak_rss_bytes_per_rank": [r["peak_rss_bytes"] for r in ranks],
        "peak_rss_bytes_per_run": peaks,
        "hwm_reset": all(r["hwm_reset"] for ranks in runs for r in ranks),
        "exposed_comm_s": max((r.get("exposed_comm_s", 0.0) for r in ranks), default=0.0)
        if c.stage
        else None,
        "model_state_bytes_per_rank": [r.get("model_state_bytes") for r in ranks]
        if c.stage
        else None,
        "algorithms": ranks[0].get("algorithms"),
        "comm_choices": ranks[0].get("comm_choices"),
        "what": "measured: median of the timed steps of the slower rank (median over rounds); "
        "peak anonymous RSS above the baseline, the largest rank and round; per_rank: round 1",
    }
    entry["ratio_measured_to_predicted"] = step / t["predicted"]["step_time_s"]
    entry["fits"] = limit is None or peak <= limit
    if not entry["fits"]:
        entry["why"] = f"measured peak {est.format_bytes(peak)} > limit"
    return entry


def _spread(xs: list[float]) -> float:
    """Half the interquartile range (half the range below 4 steps) over the median."""
    if len(xs) < 2:
        return 0.0
    if len(xs) >= 4:
        q1, _, q3 = statistics.quantiles(xs, n=4)
    else:
        q1, q3 = min(xs), max(xs)
    return (q3 - q1) / 2 / statistics.median(xs)


def _kwargs_text(kw: dict) -> str:
    parts = []
    for k, v in kw.items():
        parts.append(f"{k}={v}" if k == "reduce_dtype" else f"{k}={v!r}")
    return ", ".join(parts)


def recommend(trials: list[dict]) -> tuple[dict | None, dict | None]:
    """(fastest measured ZeRO trial that fits, DDP's trial if measured). A hierarchical or
    quantized trial is taken only where it measured faster than its twin without (flat,
    unquantized) by more than the noise (`_pairs`), where that twin fits too: else the twin."""
    fit = [
        t for t in trials if t["status"] == "measured" and t["fits"] and t["config"]["stage"] != 0
    ]
    best = min(fit, key=lambda t: t["measured"]["step_time_s"], default=None)
    for base in (_FLAT, _QUANT):  # the simpler twin where the extra option did not pay
        if best is None:
            break
        twin = _twin(best, fit, base)
        if twin is not None and _verdict(best, twin) != "faster":
            best = twin
    ddp = next((t for t in trials if t["config"]["stage"] == 0 and t["status"] == "measured"), None)
    return best, ddp


_QUANT = {"quantize_weights": "none", "quantize_grads": "none"}
_FLAT = {"shard_group": "world", "secondary_shard": None}


def quantization_pairs(trials: list[dict]) -> list[dict]:
    """Each measured quantized trial beside its twin without quantization (the same settings
    otherwise), where that was measured too: whether quantizing paid here ("faster"/"slower"
    where the medians differ by more than the larger of the two spreads, else "within noise")."""
    return _pairs(trials, _QUANT, "unquantized")


def hierarchy_pairs(trials: list[dict]) -> list[dict]:
    """Each measured trial with ``shard_group="node"`` or ``secondary_shard`` beside its flat
    twin (tune across nodes), judged as `quantization_pairs` does."""
    return _pairs(trials, _FLAT, "flat")


def _plain(c: dict, base: dict) -> bool:
    return all(c.get(k, v) == v for k, v in base.items())


def _twin(t: dict, trials: list[dict], base: dict) -> dict | None:
    """The measured trial with ``base``'s values and ``t``'s other settings (None: ``t`` has
    them itself, or the twin was not measured)."""
    if _plain(t["config"], base):
        return None

    def key(c: dict) -> tuple:  # the settings other than ``base``'s
        return tuple(sorted((k, str(v)) for k, v in c.items() if k not in {"label", *base}))

    k = key(t["config"])
    twins = [u for u in trials if u["status"] == "measured" and _plain(u["config"], base)]
    return next((u for u in twins if key(u["config"]) == k), None)


def _verdict(t: dict, twin: dict) -> str:
    """ "faster"/"slower" where the medians differ by more than the larger spread."""
    a, b = t["measured"]["step_time_s"], twin["measured"]["step_time_s"]
    noise = max(t["measured"]["spread"], twin["measured"]["spread"]) * max(a, b)
    return "within noise" if abs(a - b) <= noise else "faster" if a < b else "slower"


def _pairs(trials: list[dict], base: dict, name: str) -> list[dict]:
    """Trials that differ from ``base``'s values beside their twin with ``base``'s values."""
    out = []
    for t in trials:
        twin = _twin(t, trials, base) if t["status"] == "measured" else None
        if twin is not None:
            out.append(
                {"label": t["config"]["label"], "step_time_s": t["measured"]["step_time_s"],
                 name: twin["config"]["label"],
                 f"{name}_step_time_s": twin["measured"]["step_time_s"],
                 "verdict": _verdict(t, twin)}
            )  # fmt: skip
    return out


def _sort_key(t: dict):
    m = t["measured"]
    return (
        _STATUS_ORDER[t["status"]],
        not t["fits"],
        m["step_time_s"] if m else t["predicted"]["step_time_s"],
    )


def _print_table(res: dict) -> None:
    b = est.format_bytes
    mdl, cfg = res["model"], res["settings"]
    limit = res["mem_limit_bytes"]
    print(
        f"zero-kernels tune: {mdl['label']}, {mdl['n_params'] / 1e6:.3g}M params, "
        f"{res['world_size']} ranks (gloo, {cfg['threads']} thread(s) each), batch "
        f"{cfg['batch_size']} per rank, {cfg['warmup']} + {cfg['steps']} steps per trial; limit "
        + (f"{b(limit)} per rank ({res['mem_limit_source']})" if limit else "none")
    )
    rows = res["bandwidth"]
    sizes = sorted({r["bytes"] for r in rows})
    print("\ncollective time, measured (ms; slower rank, median of runs; GB/s of the buffer):")

    def what(r: dict) -> tuple:  # across nodes the link too ([Note: tune across nodes])
        scope = r.get("scope", "world")
        op = r["op"] if scope == "world" else f"{r['op']} ({scope} {r['ranks']})"
        return op, r["algorithm"]

    w = max(16, *(len(what(r)[0]) + 2 for r in rows))
    print(f"  {'op':<{w}}{'algorithm':<11}" + "".join(f"{b(s):>20}" for s in sizes))
    for key in dict.fromkeys(what(r) for r in rows):
        cells = {r["bytes"]: r for r in rows if what(r) == key}
        line = "".join(
            f"{1e3 * cells[s]['seconds']:>9.2f} ({cells[s]['gb_per_s']:5.2f} GB/s)"
            if s in cells
            else f"{'-':>20}"
            for s in sizes
        )
        print(f"  {key[0]:<{w}}{key[1]:<11}{line}")
    if res["world_size"] == 2:
        print("  (ring: not measured at 2 ranks, where it is the pairwise exchange)")
    c = res["compute"]
    opt = list(c["optimizer_step_s"].values())
    print(
        f"compute, measured: forward + backward {_ms(c['fwd_bwd_s'])}, optimizer step "
        f"{_ms(opt[0])} (DDP, all params) / {_ms(opt[1])} (ZeRO shard), activations "
        f"{b(c['activation_bytes'])}"
    )
    head = (
        f"\n  {'#':>2}  {'configuration':<60}{'measured':>11}{'±':>5}{'predicted':>11}{'ratio':>7}"
        f"{'peak RSS':>11}{'pred. mem':>11}  fits"
    )
    print(head + "\n  " + "-" * (len(head) - 3))
    for i, t in enumerate(res["trials"], 1):
        m, p = t["measured"], t["predicted"]
        fits = {True: "yes", False: "no", None: ""}[t["fits"]]
        if t["status"] != "measured":
            fits = t["why"] or t["status"]
        elif not t["fits"]:
            fits = f"no ({t['why']})"
        label = t["config"]["label"] + (" (ref.)" if t["config"]["stage"] == 0 else "")
        star = "*" if res["recommendation"] and res["recommendation"]["index"] == i - 1 else " "
        print(
            f" {star}{i:>2}  {label:<60}{_ms(m['step_time_s'] if m else None):>11}"
            + (f"{100 * m['spread']:>4.0f}%" if m else f"{'':>5}")
            + f"{_ms(p['step_time_s']):>11}"
            + (f"{t['ratio_measured_to_predicted']:>7.2f}" if m else f"{'-':>7}")
            + f"{b(m['peak_rss_bytes']) if m else '-':>11}{b(p['memory']['total_bytes']):>11}"
            + f"  {fits}"
        )
    print(
        "  measured: the slower rank's median step (±: half its interquartile range) and the "
        "largest peak RSS above the baseline;\n  predicted: the model of [Note: the prediction] "
        f"in zero_kernels/cli/tune_plan.py (overlap efficiency {res['prediction']['overlap']:.2g})"
    )


def _print_verdict(res: dict) -> None:
    rec, ddp = res["recommendation"], res["ddp"]
    if rec is None:
        small = res["smallest_predicted"]
        print(
            "\nno configuration fits"
            + (
                f" {est.format_bytes(res['mem_limit_bytes'])} per rank"
                if res["mem_limit_bytes"]
                else ""
            )
            + (
                f": the smallest predicted is {small['label']} "
                f"({est.format_bytes(small['predicted_bytes'])} per rank predicted"
                + (
                    f", {est.format_bytes(small['measured_bytes'])} measured"
                    if small["measured_bytes"] is not None
                    else ""
                )
                + ")"
                if small
                else ""
            )
        )
        return
    print(
        f"\nrecommended: {rec['label']}: {_ms(rec['step_time_s'])} per step measured "
        f"(predicted {_ms(rec['predicted_step_time_s'])}), peak "
        f"{est.format_bytes(rec['peak_rss_bytes'])} per rank"
    )
    print(
        "  zero_kernels.ZeroOptimizer(model, torch.optim.AdamW, "
        f"policy=ZeroPolicy.resolve({rec['kwargs_text']}), lr=...)"
    )
    words = {
        "faster": "faster here",
        "slower": "slower here: not worth it on these links",
        "within noise": "the same within the noise: not worth it here",
    }
    for key, what, twin, name in (
        ("hierarchy", "across nodes", "flat", "flat"),
        ("quantization", "quantized", "unquantized", "without"),
    ):
        for p in res.get(key, ()):
            print(
                f"  {what}: {p['label']}: {_ms(p['step_time_s'])} against "
                f"{_ms(p[f'{twin}_step_time_s'])} {name} ({words[p['verdict']]})"
            )
    if ddp is not None:
        faster = ddp["step_time_s"] < rec["step_time_s"]
        print(
            f"  DDP + AdamW(fused=True): {_ms(ddp['step_time_s'])} measured, "
            f"{'fits' if ddp['fits'] else 'does not fit'}"
            + (
                " -- faster here: without a memory constraint plain DDP is the faster choice"
                if faster and ddp["fits"]
                else f" ({ddp['step_time_s'] / rec['step_time_s']:.2f}x the recommended step)"
            )
        )


def _plot(res: dict, path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("  (no tune.png: matplotlib is not installed)", file=sys.stderr)
        return None
    trials = res["trials"]
    labels = [t["config"]["label"] for t in trials]
    y = list(range(len(trials)))[::-1]
    fig, (ax1, ax2) = plt.subplots(
        1, 2, figsize=(13, 1.5 + 0.35 * len(trials)), sharey=True, width_ratios=[3, 2]
    )
    rec = res["recommendation"]["index"] if res["recommendation"] else None
    for yi, (i, t) in zip(y, enumerate(trials)):
        m, p = t["measured"], t["predicted"]
        if m:
            color = "tab:green" if i == rec else ("tab:blue" if t["fits"] else "tab:red")
            ax1.barh(yi, 1e3 * m["step_time_s"], color=color, alpha=0.8)
            ax2.barh(yi, m["peak_rss_bytes"] / 1e6, color=color, alpha=0.8)
            if not t["fits"]:
                ax1.text(1e3 * m["step_time_s"], yi, " over limit", va="center", fontsize=7)
        else:
            ax1.barh(yi, 1e3 * p["step_time_s"], color="none", edgecolor="grey", hatch="//")
            ax1.text(
                1e3 * p["step_time_s"],
                yi,
                f" not run: {t['why'] or t['status']}",
                va="center",
                fontsize=7,
                color="grey",
            )
        ax1.plot(1e3 * p["step_time_s"], yi, "k|", markersize=12)
        ax2.plot(p["memory"]["total_bytes"] / 1e6, yi, "k|", markersize=12)
    limit = res["mem_limit_bytes"]
    shown = [t["measured"]["peak_rss_bytes"] for t in trials if t["measured"]]
    shown += [t["predicted"]["memory"]["total_bytes"] for t in trials]
    if limit and limit <= 2 * max(shown, default=0):
        ax2.axvline(limit / 1e6, color="tab:red", linestyle="--", label="limit")
        ax2.legend(fontsize=7)
    elif limit:  # far above every bar: a line there would squash them
        ax2.set_title(f"limit {est.format_bytes(limit)} (off the scale)", fontsize=8)
    ax1.set_yticks(y, labels, fontsize=7)
    ax1.set_xlabel("step time, ms (bars measured, | predicted, hatched: not run)")
    ax2.set_xlabel("peak RSS per rank above baseline, MB (| predicted)")
    ax1.set_title(
        f"zero-kernels tune: {res['model']['label']}, {res['world_size']} ranks "
        "(green: recommended, red: over the limit)",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def finish(cfg, facts, measured, probe_json: dict, trials: list[dict], elapsed: float) -> int:
    """Aggregate, recommend, print, write; the exit code (1 when nothing fits)."""
    from .launch import machine

    entries = sorted((_aggregate(t, cfg.mem_limit) for t in trials), key=_sort_key)
    best, ddp = recommend(entries)
    zero = [e for e in entries if e["config"]["stage"] != 0]
    small = min(zero, key=lambda e: e["predicted"]["memory"]["total_bytes"], default=None)
    res = {
        "command": "zero-kernels " + " ".join(cfg.argv),
        "machine": {**machine(), "hwm_reset": probe_json["hwm_reset"]},
        "model": {
            "label": cfg.source.label,
            "source": cfg.source.kind,
            "spec": cfg.source.spec,
            "n_params": facts.n_params,
            "input": facts.input,
            "stage3_units": list(facts.unit_numels),
            "stage3_root_params": facts.root_numel,
        },
        "world_size": cfg.nproc,
        "settings": {
            "threads": cfg.threads,
            "batch_size": cfg.source.batch_size,
            "seq_len": cfg.source.seq_len,
            "steps": cfg.steps,
            "warmup": cfg.warmup,
            "stages": list(cfg.stages),
            "buckets_mb": list(cfg.buckets or ()),
            "prefetch": list(cfg.prefetch),
            "reduce_dtypes": list(cfg.reduce_dtypes),
            "state_dtypes": list(cfg.state_dtypes),
            "offloads": list(cfg.offloads),
            "quantize_weights": list(cfg.quantize_weights),
            "quantize_grads": list(cfg.quantize_grads),
            "overlap_param_gather": list(cfg.overlap),
            "ddp": cfg.ddp,
            "max_trials": cfg.max_trials,
            "repeats": cfg.repeats,
            "time_budget_s": cfg.time_budget_s,
            "seed": cfg.seed,
            "optimizer": "torch.optim.AdamW(lr=1e-3, weight_decay=0.01)",
        },
        "mem_limit_bytes": cfg.mem_limit,
        "mem_limit_source": cfg.mem_limit_source,
        "bandwidth": probe_json["bandwidth"],
        "compute": probe_json["compute"],
        "disk": probe_json.get("disk"),  # the offload folder's O_DIRECT bandwidth, if measured
        "prediction": {
            "overlap": measured.overlap,
            "what": "step = measured compute + measured optimizer step + exposed communication "
            "from the measured bandwidth; memory = zero_kernels.tools.estimate + measured "
            "activations ([Note: the prediction] in zero_kernels/cli/tune_plan.py)",
        },
        "trials": entries,
        "quantization": quantization_pairs(entries),
        "hierarchy": hierarchy_pairs(entries),
        "hosts": probe_json.get("hosts"),  # the ranks of each node (proven), across nodes
        "recommendation": None,
        "ddp": None,
        "smallest_predicted": None,
        "elapsed_s": elapsed,
    }
    if best is not None:
        kw = best["policy_options"]
        res["recommendation"] = {
            "index": entries.index(best),
            "label": best["config"]["label"],
            "policy_options": kw,
            "kwargs_text": _kwargs_text(kw),
            "step_time_s": best["measured"]["step_time_s"],
            "predicted_step_time_s": best["predicted"]["step_time_s"],
            "peak_rss_bytes": best["measured"]["peak_rss_bytes"],
        }
    if ddp is not None:
        res["ddp"] = {
            "step_time_s": ddp["measured"]["step_time_s"],
            "fits": ddp["fits"],
            "faster_than_recommended": best is not None
            and ddp["measured"]["step_time_s"] < best["measured"]["step_time_s"],
        }
    if small is not None:
        res["smallest_predicted"] = {
            "label": small["config"]["label"],
            "predicted_bytes": small["predicted"]["memory"]["total_bytes"],
            "measured_bytes": small["measured"]["peak_rss_bytes"] if small["measured"] else None,
        }
    _print_table(res)
    _print_verdict(res)
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "tune.json").write_text(json.dumps(res, indent=1, default=str))
    png = _plot(res, out / "tune.png")
    print(f"  written: {out / 'tune.json'}" + (f", {png}" if png else ""))
    if best is None:
        print(
            "zero-kernels tune: no ZeRO configuration fits"
            + (f" {est.format_bytes(cfg.mem_limit)} per rank" if cfg.mem_limit else "")
            + " (see the table)",
            file=sys.stderr,
        )
        return 1
    return 0
