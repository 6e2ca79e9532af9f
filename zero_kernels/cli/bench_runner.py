"""`zero-kernels bench`: run the bench/ suite, collect its JSON/CSV/PNG, print a table.

Each `bench/bench_*.py` is a script run in its own process with ``--out DIR`` (and ``--quick``
when asked, if its ``--help`` lists it). The end-to-end comparison of the stages against DDP is
also run from here with the demo's machinery (``e2e_stages``: step time and measured memory
per rank against the formula). Optional peers that are not installed are skipped with a line
saying how to install them.
"""

from __future__ import annotations

import csv
import importlib.util
import json
import re
import subprocess
import sys
import time
from pathlib import Path

__all__ = ["PEERS", "find_bench_dir", "run_bench"]

# peer -> (import name, how to get it)
PEERS = {
    "DeepSpeed ZeRO": ("deepspeed", "pip install deepspeed"),
    "torch ZeroRedundancyOptimizer": ("torch.distributed.optim", "part of torch"),
    "FSDP2 fully_shard": ("torch.distributed.fsdp", "part of torch >= 2.4"),
    "Liger-Kernel": ("liger_kernel", "pip install liger-kernel"),
}


def _has(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def find_bench_dir(bench_dir: str | None) -> Path | None:
    if bench_dir is not None:
        p = Path(bench_dir)
        if not p.is_dir():
            raise ValueError(f"--bench-dir: no such folder {bench_dir!r}")
        return p
    for p in (Path.cwd() / "bench", Path(__file__).resolve().parents[2] / "bench"):
        if p.is_dir():
            return p
    return None


def _flags(script: Path) -> str:
    try:
        r = subprocess.run(
            [sys.executable, str(script), "--help"], capture_output=True, text=True, timeout=120
        )
        return r.stdout + r.stderr
    except (subprocess.TimeoutExpired, OSError):
        return ""


def _run_script(script: Path, out: Path, quick: bool, timeout_s: float) -> dict:
    name = script.stem
    dest = out / name
    dest.mkdir(parents=True, exist_ok=True)
    help_text = _flags(script)
    cmd = [sys.executable, str(script)]
    if "--out" in help_text:
        # a script whose --out default is a .json file gets a file in its folder, else the folder
        src = script.read_text(errors="replace")
        to_file = re.search(r"""add_argument\(\s*["']--out["'].{0,300}?\.json["']""", src, re.S)
        cmd += [
            "--out",
            str(dest / f"{name.removeprefix('bench_')}.json") if to_file else str(dest),
        ]
    if quick and "--quick" in help_text:
        cmd.append("--quick")
    elif quick:  # no --quick: shrink what its flags allow
        shrink = [("--repeats", "2"), ("--warmup", "1"), ("--steps", "5")]
        extra = [x for flag, v in shrink if re.search(rf"{flag}\b", help_text) for x in (flag, v)]
        cmd += extra
        print(f"[bench] {name} has no --quick; running it with {' '.join(extra) or 'defaults'}")
    print(f"[bench] {name}: {' '.join(cmd[1:])}", flush=True)
    t0 = time.perf_counter()
    try:
        r = subprocess.run(
            cmd, capture_output=True, text=True, timeout=timeout_s, cwd=script.parent.parent
        )
        rc, text = r.returncode, r.stdout + r.stderr
    except subprocess.TimeoutExpired as e:
        rc, text = 124, f"timed out after {timeout_s:.0f} s\n{e.stdout or ''}"
    secs = time.perf_counter() - t0
    (dest / "log.txt").write_text(text)
    if rc == 0:
        tail = [ln for ln in text.strip().splitlines() if ln.strip()][-25:]
        print("\n".join(f"  {ln}" for ln in tail))
    else:
        last = (text.strip().splitlines() or ["(no output)"])[-1]
        print(f"  FAILED (exit {rc}): {last}  [log: {dest / 'log.txt'}]")
    files = sorted(
        str(p.relative_to(out)) for p in dest.rglob("*") if p.suffix in (".json", ".csv", ".png")
    )
    return {"name": name, "rc": rc, "seconds": round(secs, 1), "files": files}


def e2e_stages(out: Path, quick: bool) -> dict:
    """Step time and memory per rank of each stage against DDP, with the demo's machinery."""
    from .demo import DemoConfig, available_stages, run_demo

    dest = out / "e2e_stages"
    dest.mkdir(parents=True, exist_ok=True)
    stages = [s for s in available_stages() if s != 0] or [0]
    rows, t0, rc = [], time.perf_counter(), 0
    for s in stages:
        cfg = DemoConfig(
            stage=s,
            nproc=2,
            steps=10 if quick else 100,
            model_size="tiny" if quick else "small",
            out=str(dest / f"stage{s}"),
            progress=False,
            timeout_s=900,
        )
        print(
            f"[bench] e2e_stages: demo --stage {s} --steps {cfg.steps} "
            f"--model-size {cfg.model_size}",
            flush=True,
        )
        code = run_demo(cfg)
        rc = rc or code
        if code != 0:
            continue
        rep = json.loads((dest / f"stage{s}" / "report.json").read_text())
        for _, r in sorted(rep["runs"].items()):
            if any(row["stage"] == r["stage"] for row in rows):
                continue
            mem = sum(r["memory_total_per_rank"]) / len(r["memory_total_per_rank"])
            rows.append(
                {
                    "stage": r["stage"],
                    "step_ms": round(1e3 * r["step_time_s"], 2),
                    "mem_per_rank_bytes": int(mem),
                    "formula_bytes": int(r["memory_formula"]["total"]),
                    "exposed_comm_ms": round(1e3 * r["comm_per_step"]["exposed_comm_s"], 3),
                    "world_size": rep["world_size"],
                    "n_params": rep["n_params"],
                }
            )
    rows.sort(key=lambda r: r["stage"])
    base = next((r for r in rows if r["stage"] == 0), None)
    for r in rows:
        r["step_time_vs_ddp"] = round(r["step_ms"] / base["step_ms"], 3) if base else None
        r["memory_vs_ddp"] = (
            round(r["mem_per_rank_bytes"] / base["mem_per_rank_bytes"], 3) if base else None
        )
    (dest / "results.json").write_text(json.dumps(rows, indent=1))
    if rows:
        with open(dest / "results.csv", "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
        _plot_e2e(rows, dest / "results.png")
        print(
            f"  {'stage':<8}{'step ms':>10}{'vs DDP':>8}{'MB/rank':>10}{'formula':>10}"
            f"{'mem vs DDP':>12}{'exposed ms':>12}"
        )
        for r in rows:
            print(
                f"  {r['stage']:<8}{r['step_ms']:>10.1f}{r['step_time_vs_ddp'] or 0:>8.2f}"
                f"{r['mem_per_rank_bytes'] / 1e6:>10.2f}{r['formula_bytes'] / 1e6:>10.2f}"
                f"{r['memory_vs_ddp'] or 0:>12.2f}{r['exposed_comm_ms']:>12.2f}"
            )
    files = sorted(str(p.relative_to(out)) for p in dest.glob("results.*"))
    return {
        "name": "e2e_stages",
        "rc": rc,
        "seconds": round(time.perf_counter() - t0, 1),
        "files": files,
    }


def _plot_e2e(rows: list[dict], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("  (no PNG: matplotlib is not installed; pip install matplotlib)")
        return
    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.5))
    xs = [str(r["stage"]) for r in rows]
    a.bar(xs, [r["step_ms"] for r in rows])
    a.set_xlabel("stage (0 = DDP)")
    a.set_ylabel("step time, ms")
    b.bar(xs, [r["mem_per_rank_bytes"] / 1e6 for r in rows], label="measured")
    b.scatter(
        xs,
        [r["formula_bytes"] / 1e6 for r in rows],
        color="k",
        marker="_",
        s=400,
        label="formula",
        zorder=3,
    )
    b.set_xlabel("stage (0 = DDP)")
    b.set_ylabel("model-state MB per rank")
    b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_bench(
    *,
    quick: bool = False,
    out: str = "bench_results",
    only: list[str] | None = None,
    bench_dir: str | None = None,
    timeout_s: float = 1800.0,
) -> int:
    """Run every benchmark (filtered by ``only``); returns non-zero if one failed."""
    out_p = Path(out)
    out_p.mkdir(parents=True, exist_ok=True)
    for peer, (module, how) in PEERS.items():
        if not _has(module):
            print(f"[bench] skipping {peer}: not installed ({how})")
    bdir = find_bench_dir(bench_dir)
    scripts = sorted(bdir.glob("bench_*.py")) if bdir else []
    if bdir is None:
        print(
            "[bench] no bench/ folder here (run from the source tree or pass --bench-dir); "
            "running the built-in end-to-end comparison only"
        )
    wanted = (lambda n: any(o in n for o in only)) if only else (lambda n: True)
    results = []
    for script in scripts:
        if wanted(script.stem):
            results.append(_run_script(script, out_p, quick, timeout_s))
    if wanted("e2e_stages"):
        results.append(e2e_stages(out_p, quick))
    if not results:
        print(f"[bench] nothing matched --only {only}")
        return 2
    (out_p / "summary.json").write_text(json.dumps(results, indent=1))
    print(f"\n{'benchmark':<24}{'status':>8}{'seconds':>10}  files")
    for r in results:
        status = "ok" if r["rc"] == 0 else f"exit {r['rc']}"
        print(
            f"{r['name']:<24}{status:>8}{r['seconds']:>10.1f}  {', '.join(r['files'][:4])}"
            + (" ..." if len(r["files"]) > 4 else "")
        )
    print(f"results in {out_p}/")
    return 0 if all(r["rc"] == 0 for r in results) else 1
