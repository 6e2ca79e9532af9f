"""Offload side by side with DeepSpeed ZeRO-3 on the CPU accelerator: step time and peak RSS.

Candidates (each a torchrun group of ``--world`` ranks, in turn, ``--rounds`` times):
  ours_ram        ZeroOptimizer stage 3, fused AdamW, state in RAM
  ours_nvme_opt   ... offload_optimizer="nvme" (the moments on disk)
  ds_cpu          DeepSpeed ZeRO-3, offload_optimizer + offload_param to "cpu" (DeepSpeedCPUAdam)
  ds_nvme_opt     DeepSpeed ZeRO-3, offload_optimizer to "nvme" (async_io op: needs libaio-dev)
  ds_nvme         DeepSpeed ZeRO-3, offload_optimizer + offload_param to "nvme"
The model: ``--layers`` Linear(d, d), fp32, batch 8, clipping at 1.0, Adam lr 1e-4; 2 warm-up
steps, ``--steps`` timed. DeepSpeed runs with DS_ACCELERATOR=cpu (gloo); a candidate that fails
is reported with the last line of its error.

    python bench/bench_offload_peers.py [--dir /var/tmp] [--world 2] [--width 1024] [--layers 16]
                                        [--steps 5] [--rounds 2] [--out bench/results]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import machine, markdown_table, status_bytes, write_results  # noqa: E402

CANDIDATES = ["ours_ram", "ours_nvme_opt", "ds_cpu", "ds_nvme_opt", "ds_nvme"]


def worker(a) -> None:
    import torch
    from torch import nn

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(a.d, a.d) for _ in range(a.layers)])
    x = torch.randn(8, a.d)
    name = a.worker
    if name.startswith("ours"):
        import torch.distributed as dist

        import zero_kernels

        dist.init_process_group("gloo")
        kw = {"offload_optimizer": "nvme", "offload_dir": a.dir} if "nvme" in name else {}
        pol = zero_kernels.ZeroPolicy.resolve(stage=3, **kw)
        opt = zero_kernels.ZeroOptimizer(model, torch.optim.AdamW, policy=pol, lr=1e-4)

        def step():
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.clip_grad_norm_(1.0)
            opt.step()
    else:
        import deepspeed

        z = {"stage": 3}
        if name == "ds_cpu":
            z |= {"offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}
        else:
            z["offload_optimizer"] = {"device": "nvme", "nvme_path": a.dir}
            if name == "ds_nvme":
                z["offload_param"] = {"device": "nvme", "nvme_path": a.dir}
        cfg = {
            "train_micro_batch_size_per_gpu": 8,
            "optimizer": {"type": "Adam", "params": {"lr": 1e-4}},
            "zero_optimization": z,
            "gradient_clipping": 1.0,
        }
        engine, *_ = deepspeed.initialize(
            model=model, model_parameters=model.parameters(), config=cfg
        )

        def step():
            loss = engine(x).square().mean()
            engine.backward(loss)
            engine.step()

    ts = []
    for s in range(2 + a.steps):
        t0 = time.perf_counter()
        step()
        if s >= 2:
            ts.append(time.perf_counter() - t0)
    rank = int(os.environ.get("RANK", 0))
    print(
        "RESULT " + json.dumps({"rank": rank, "steps": ts, "hwm": status_bytes("VmHWM")}),
        flush=True,
    )


def run(name: str, a, work: str) -> dict:
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={a.world}",
        "--master-port",
        str(29600 + CANDIDATES.index(name)),
        __file__,
        "--worker",
        name,
        "--dir",
        work,
        "--width",
        str(a.d),
        "--layers",
        str(a.layers),
        "--steps",
        str(a.steps),
    ]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1200)
    # the ranks' lines can interleave in torchrun's merged stdout: find each object
    res = [json.loads(m) for m in re.findall(r"RESULT (\{[^}]*\})", p.stdout)]
    if len(res) != a.world:
        err = [ln for ln in (p.stderr + p.stdout).splitlines() if "Error" in ln]
        return {"error": (err or ["rc " + str(p.returncode)])[-1][-200:]}
    return {
        "step_s": statistics.median(t for r in res for t in r["steps"]),
        "hwm": max(r["hwm"] for r in res),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--dir", default="/var/tmp")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--width", dest="d", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default="bench/results")
    a = ap.parse_args()
    if a.worker:
        return worker(a)
    work = tempfile.mkdtemp(prefix="zk-offload-peers-", dir=a.dir)
    got: dict[str, list] = {c: [] for c in CANDIDATES}
    try:
        for _ in range(a.rounds):
            for c in CANDIDATES:
                got[c].append(run(c, a, work))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    rows = []
    base = None
    for c, rs in got.items():
        ok = [r for r in rs if "error" in r] == []
        if not ok:
            rows.append(
                {
                    "candidate": c,
                    "step_ms": "-",
                    "vs_ours_ram": "-",
                    "peak_rss_MB": "-",
                    "note": next(r["error"] for r in rs if "error" in r),
                }
            )
            continue
        st = statistics.median(r["step_s"] for r in rs)
        base = base or st
        rows.append(
            {
                "candidate": c,
                "step_ms": round(st * 1e3, 1),
                "vs_ours_ram": round(st / base, 2),
                "peak_rss_MB": round(max(r["hwm"] for r in rs) / 2**20, 1),
                "note": "",
            }
        )
    cmd = "python " + " ".join(sys.argv)
    print(markdown_table(rows, list(rows[0])))
    write_results(
        a.out, "offload_peers", {"machine": machine(), "args": vars(a), "command": cmd}, rows
    )


if __name__ == "__main__":
    main()
