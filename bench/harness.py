"""Side-by-side timing and the machine's memory bandwidth, measured in the same run.

Candidates are timed alternately (A B C A B C ...) so that drift in the machine (frequency, other
load) hits all of them alike, and each is summarised by its median. Every figure is written with
the machine, the versions and the command that produced it.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

import torch


def machine() -> dict:
    cpu = platform.processor() or ""
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name"))
    except (OSError, StopIteration):
        pass
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10
        ).stdout.strip()
    except OSError:
        commit = ""
    info = {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "commit": commit,
        "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
    }
    try:
        from zero_kernels import _native

        mod = _native.load()
        info["zero_kernels_cpu_isa"] = mod.cpu_isa() if mod is not None else None
    except ImportError:
        pass
    return info


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def side_by_side(
    cands: dict[str, Callable[[], object]], repeats: int = 7, warmup: int = 2, device: str = "cpu"
) -> dict[str, dict]:
    """Median and min seconds per call of each candidate, timed alternately."""
    for fn in cands.values():
        for _ in range(warmup):
            fn()
    _sync(device)
    times: dict[str, list[float]] = {k: [] for k in cands}
    for _ in range(repeats):
        for name, fn in cands.items():
            _sync(device)
            t0 = time.perf_counter()
            fn()
            _sync(device)
            times[name].append(time.perf_counter() - t0)
    return {
        k: {"median_s": statistics.median(v), "min_s": min(v), "n": len(v)}
        for k, v in times.items()
    }


def memory_bandwidth(n_floats: int = 50_000_000, device: str = "cpu", repeats: int = 7) -> dict:
    """Streaming bandwidth in GB/s (1e9 bytes/s), measured on this device in this run.

    - copy: b.copy_(a) with torch, 8 bytes per element (read a, write b);
    - rmw: a.add_(b) with torch, 12 bytes per element (read a and b, write a back in place);
    - step_pattern (CPU, native extension): p += g, m += g, v += g, 28 bytes per element: the
      exact memory traffic of an Adam step (4 streams read, 3 written in place) with no math.
    The largest is the floor a kernel's fraction is reported against: a kernel at 1.0 moves its
    bytes as fast as the fastest of these pure-memory loops.
    """
    a = torch.rand(n_floats, device=device)
    b = torch.rand(n_floats, device=device)
    cands = {"copy": lambda: b.copy_(a), "rmw": lambda: a.add_(b, alpha=1e-9)}
    probe = None
    if device == "cpu":
        try:
            from zero_kernels import _native

            probe = _native.load()
        except ImportError:
            probe = None
    if probe is not None:
        c, d = torch.rand(n_floats), torch.rand(n_floats)
        g = torch.zeros(n_floats)
        cands["step_pattern"] = lambda: probe.stream_probe(a, g, c, d)
    res = side_by_side(cands, repeats=repeats, device=device)
    out = {
        "copy_GBps": round(8 * n_floats / res["copy"]["median_s"] / 1e9, 2),
        "rmw_GBps": round(12 * n_floats / res["rmw"]["median_s"] / 1e9, 2),
    }
    if "step_pattern" in res:
        out["step_pattern_GBps"] = round(28 * n_floats / res["step_pattern"]["median_s"] / 1e9, 2)
    out["floor_GBps"] = max(out.values())
    out["n_floats"] = n_floats
    return out


def write_results(out_dir: str, name: str, payload: dict, rows: list[dict]) -> tuple[str, str]:
    """Write ``name``.json (everything) and ``name``.csv (the rows); returns their paths."""
    os.makedirs(out_dir, exist_ok=True)
    jpath = os.path.join(out_dir, f"{name}.json")
    cpath = os.path.join(out_dir, f"{name}.csv")
    with open(jpath, "w") as f:
        json.dump({**payload, "rows": rows}, f, indent=2)
    if rows:
        keys = list(rows[0])
        with open(cpath, "w") as f:
            f.write(",".join(keys) + "\n")
            for r in rows:
                f.write(",".join(str(r.get(k, "")) for k in keys) + "\n")
    return jpath, cpath


def markdown_table(rows: list[dict], keys: list[str]) -> str:
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    for r in rows:
        lines.append("| " + " | ".join(str(r.get(k, "")) for k in keys) + " |")
    return "\n".join(lines)
