"""The demo's report: measured figures beside the formulas, as JSON, a PNG and a printed summary."""

from __future__ import annotations

import json
import math
import platform
import sys
from pathlib import Path

import torch

from ..tools import estimate as est
from ..tools.models import build_gpt

__all__ = ["build_report", "optimizer_state_total", "write_report"]

# The demo's optimizer names -> the estimator's.
_EST_OPT = {
    "adamw": "adam",
    "adam": "adam",
    "fused-adamw": "adam",
    "sgd": "sgd-momentum",
    "adafactor": "adafactor",
    "muon": "muon",
}


def model_shapes(size: str) -> list[tuple[int, ...]]:
    with torch.device("meta"):
        model = build_gpt(size)
    return [tuple(p.shape) for p in model.parameters() if p.requires_grad]


def stage3_units(size: str) -> tuple[int, int]:
    """``(largest unit, root unit)`` parameter counts of the demo's GPT at stage 3 (a unit per
    block; the root unit is the rest: embeddings, final norm, the tied head)."""
    with torch.device("meta"):
        model = build_gpt(size)
    blocks = [sum(p.numel() for p in b.parameters()) for b in model.blocks]
    total = sum(p.numel() for p in model.parameters())
    return max(blocks, default=0), total - sum(blocks)


def optimizer_state_total(optimizer: str, precision: str, shapes) -> float:
    """Unsharded optimizer-state bytes of the demo's optimizer on these parameter shapes."""
    prec = est.PRECISIONS[precision]
    n = sum(math.prod(s) for s in shapes)
    if optimizer == "muon":  # momentum for matrices, AdamW's two moments for the rest
        mats = sum(math.prod(s) for s in shapes if len(s) == 2)
        return float(prec.master_bytes * n + prec.state_elem_bytes * (mats + 2 * (n - mats)))
    return est.optimizer_state_bytes(_EST_OPT[optimizer], prec, n, shapes)


def _mean(xs):
    return sum(xs) / len(xs) if xs else 0.0


def build_report(cfg, world: int, device: torch.device, per_rank: list[dict]) -> dict:
    """Combine every rank's runs (a list, by rank, of {stage: run}) into the report dict."""
    shapes = model_shapes(cfg.model_size)
    n_params = sum(math.prod(s) for s in shapes)
    precision = "mixed" if cfg.precision == "bf16" else "fp32"
    # ZeroOptimizer reduces and holds grads in fp32 whatever the params' dtype
    zero_precision = "mixed-fp32-grads" if cfg.precision == "bf16" else "fp32"
    k_total = optimizer_state_total(cfg.optimizer, precision, shapes)
    stages_run = sorted(per_rank[0])
    runs = {}
    for s in stages_run:
        rs = [r[s] for r in per_rank]
        loss = [_mean([r["losses"][i] for r in rs]) for i in range(len(rs[0]["losses"]))]
        f = est.estimate_stage(
            s,
            n_params,
            world,
            precision=precision if s == 0 else zero_precision,
            optimizer=_EST_OPT[cfg.optimizer],
            optim_bytes_total=k_total,
            bucket_mb=cfg.bucket_mb,
            **(
                dict(zip(("largest_layer", "root_params"), stage3_units(cfg.model_size)))
                if s == 3
                else {}
            ),
        )
        mem = [r["memory"] for r in rs]
        # model states (what the formula counts); comm buffers are reported beside them
        measured_total = [m["params"] + m["grads"] + m["optim"] for m in mem]
        formula = {
            "params": f.params_bytes,
            "grads": f.grads_bytes,
            "optim": f.optim_bytes,
            "total": f.total_bytes - f.live_bytes,  # model states; the live window apart
            "comm_buffers": f.comm_buffer_bytes,
            "live": f.live_bytes,
            "precision": precision if s == 0 else zero_precision,
        }
        rel = {
            k: (_mean([m[k] for m in mem]) - formula[k]) / formula[k] if formula[k] else 0.0
            for k in ("params", "grads", "optim")
        }
        states = f.total_bytes - f.live_bytes
        rel["total"] = (_mean(measured_total) - states) / states
        comm = {k: _mean([r["comm"][k] for r in rs]) for k in rs[0]["comm"]}
        runs[str(s)] = {
            "stage": s,
            "loss": loss,
            "step_time_s": max(r["step_time_s"] for r in rs),
            "memory_per_rank": mem,
            "memory_total_per_rank": measured_total,
            "comm_buffers_per_rank": [m.get("comm_buffers", 0) for m in mem],
            "memory_formula": formula,
            "memory_rel_error": rel,
            "comm_per_step": comm,
            "comm_formula": {
                "all_reduce_bytes": f.all_reduce_bytes,
                "reduce_scatter_bytes": f.reduce_scatter_bytes,
                "all_gather_bytes": f.all_gather_bytes,
                "wire_bytes_per_rank": f.wire_bytes,
            },
        }
    main = str(cfg.stage)
    base = runs.get("0")
    diff = None
    if base is not None and cfg.stage != 0:
        diff = max((abs(a - b) for a, b in zip(runs[main]["loss"], base["loss"])), default=0.0)
    all_stages = est.estimate(
        n_params,
        world,
        precision=precision,
        optimizer=_EST_OPT[cfg.optimizer],
        bucket_mb=cfg.bucket_mb,
    )
    return {
        "command": "zero-kernels " + " ".join(sys.argv[1:]) if sys.argv else "",
        "config": {k: getattr(cfg, k) for k in cfg.__dataclass_fields__},
        "machine": {
            "platform": platform.platform(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "device": str(device.type),
            "backend": "nccl" if device.type == "cuda" else "gloo",
            "cpu_threads_per_rank": torch.get_num_threads(),
        },
        "world_size": world,
        "n_params": n_params,
        "stage": cfg.stage,
        "runs": runs,
        "loss_max_abs_diff_vs_ddp": diff,
        "final_loss": runs[main]["loss"][-1] if runs[main]["loss"] else None,
        "estimate": [s.as_dict() for s in all_stages.stages],
    }


def _print_summary(report: dict, out: Path, png: Path | None) -> None:
    b = est.format_bytes
    r = report["runs"][str(report["stage"])]
    cfg = report["config"]
    print(
        f"\nzero-kernels demo: stage {report['stage']}, {report['world_size']} ranks "
        f"({report['machine']['backend']}), GPT '{cfg['model_size']}' "
        f"{report['n_params'] / 1e6:.2f}M params, {cfg['precision']}, {cfg['optimizer']}, "
        f"{cfg['steps']} steps"
    )
    diff = report["loss_max_abs_diff_vs_ddp"]
    print(
        f"  mean loss over ranks: {r['loss'][0]:.4f} -> {r['loss'][-1]:.4f}"
        + (f"; largest difference to DDP {diff:.2e}" if diff is not None else "")
    )
    print(f"  {'per rank':<14}{'measured':>14}{'formula':>14}{'error':>9}")
    for k in ("params", "grads", "optim", "total"):
        meas = (
            sum(m[k] for m in r["memory_per_rank"]) / len(r["memory_per_rank"])
            if k != "total"
            else sum(r["memory_total_per_rank"]) / len(r["memory_total_per_rank"])
        )
        print(
            f"  {k:<14}{b(meas):>14}{b(r['memory_formula'][k]):>14}"
            f"{100 * r['memory_rel_error'][k]:>8.1f}%"
        )
    bufs = r.get("comm_buffers_per_rank") or [0]
    print(
        f"  {'comm buffers':<14}{b(max(bufs)):>14}"
        f"{b(r['memory_formula'].get('comm_buffers', 0)):>14}   (not model states: "
        "gradient buckets in flight)"
    )
    live = [m.get("live", 0) for m in r["memory_per_rank"]]
    if r["memory_formula"].get("live"):
        print(
            f"  {'live window':<14}{b(max(live)):>14}{b(r['memory_formula']['live']):>14}   "
            "(stage 3: most params gathered at once, measured)"
        )
    if r["memory_formula"].get("precision") == "mixed-fp32-grads":
        print("  (formula with fp32 grads: ZeroOptimizer reduces and holds grads in fp32)")
    c = r["comm_per_step"]
    print(
        f"  per step: all-reduce {b(c['all_reduce_bytes'])}, reduce-scatter "
        f"{b(c['reduce_scatter_bytes'])}, all-gather {b(c['all_gather_bytes'])}; "
        f"exposed comm {1e3 * c['exposed_comm_s']:.2f} ms; step {1e3 * r['step_time_s']:.1f} ms"
    )
    base = report["runs"].get("0")
    if base is not None and report["stage"] != 0:
        print(
            f"  DDP: step {1e3 * base['step_time_s']:.1f} ms, memory per rank "
            f"{b(sum(base['memory_total_per_rank']) / len(base['memory_total_per_rank']))}"
        )
    print(f"  report: {out / 'report.json'}" + (f", plot: {png}" if png else ""))


def _plot(report: dict, path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("  (no PNG: matplotlib is not installed; pip install matplotlib)", file=sys.stderr)
        return None
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    stages = [e["stage"] for e in report["estimate"]]
    bottom = [0.0] * len(stages)
    for key, label in (
        ("params_bytes", "params"),
        ("grads_bytes", "grads"),
        ("optim_bytes", "optimizer state"),
        ("live_bytes", "stage-3 live"),
    ):
        vals = [e[key] / 1e6 for e in report["estimate"]]
        ax1.bar(stages, vals, bottom=bottom, label=f"{label} (formula)", alpha=0.7)
        bottom = [a + v for a, v in zip(bottom, vals)]
    for s, r in report["runs"].items():
        ys = [t / 1e6 for t in r["memory_total_per_rank"]]
        ax1.scatter(
            [int(s)] * len(ys),
            ys,
            color="k",
            marker="x",
            zorder=3,
            label="measured (each rank)" if s == min(report["runs"]) else None,
        )
    ax1.set_xticks(stages, [f"{s}" + (" (DDP)" if s == 0 else "") for s in stages])
    ax1.set_xlabel("ZeRO stage")
    ax1.set_ylabel("model-state MB per rank")
    ax1.set_title(f"memory per rank, N={report['world_size']}")
    ax1.legend(fontsize=7, loc="lower left")
    for s, r in sorted(report["runs"].items()):
        ax2.plot(
            r["loss"],
            label="DDP" if s == "0" else f"ZeRO stage {s}",
            linestyle="-" if s == "0" else "--",
        )
    ax2.set_xlabel("step")
    ax2.set_ylabel("loss (mean over ranks)")
    diff = report["loss_max_abs_diff_vs_ddp"]
    ax2.set_title("loss" + (f" (max |diff| to DDP {diff:.1e})" if diff is not None else ""))
    ax2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_report(cfg, report: dict) -> None:
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(report, indent=1))
    png = _plot(report, out / "report.png")
    _print_summary(report, out, png)
