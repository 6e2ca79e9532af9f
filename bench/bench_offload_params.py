"""Stage 3 with offload_params="nvme" (and offload_optimizer="nvme") against the same run in RAM:
step time, bytes moved, RSS per rank (peak and after the steps), memory_report's counts.

Each round spawns one group per configuration in turn (ram, params, both, ram, ...), each rank
training ``--blocks`` units of Linear(d, d) + Tanh (an ``nn.ModuleList``: one unit per block;
stage 3, fused AdamW, clipping) for ``--steps`` timed steps after 2 warm-up steps. RSS is the
process's ``VmHWM`` (peak) and ``VmRSS`` after the last step; the offloaded shards' pages are
returned with ``MADV_DONTNEED`` ([Note: param offload]), so what the counts say is gone should
be gone from RSS too.

    python bench/bench_offload_params.py [--dir /var/tmp] [--d 1024] [--blocks 16] [--steps 4]
                                         [--rounds 1] [--dtype float32|bfloat16]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import free_port  # noqa: E402

CONFIGS = {
    "ram": {},
    "params": {"offload_params": "nvme"},
    "both": {"offload_params": "nvme", "offload_optimizer": "nvme"},
}


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return 0


def worker(rank, world, port, cfg, q):
    import torch.distributed as dist
    from torch import nn

    import zero_kernels

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )

    class Net(nn.Module):
        def __init__(self, d, n):
            super().__init__()
            self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(d, d), nn.Tanh()) for _ in range(n))

        def forward(self, x):
            for b in self.blocks:
                x = b(x)
            return x

    torch.manual_seed(0)
    dtype = getattr(torch, cfg["dtype"])
    model = Net(cfg["d"], cfg["blocks"]).to(dtype)
    kw = dict(CONFIGS[cfg["name"]])
    if kw:
        kw["offload_dir"] = cfg["dir"]
    opt = zero_kernels.ZeroOptimizer(
        model, torch.optim.AdamW, stage=3, lr=1e-4, bucket_size_mb=cfg["bucket_mb"], **kw
    )
    x = torch.randn(cfg["batch"], cfg["d"], dtype=dtype)
    times = []
    for s in range(2 + cfg["steps"]):
        t0 = time.perf_counter()
        opt.zero_grad()
        model(x).float().square().mean().backward()
        opt.clip_grad_norm_(1.0)
        opt.step()
        if s >= 2:
            times.append(time.perf_counter() - t0)
    rep = opt.memory_report()
    out = {
        "step_s": statistics.median(times),
        "hwm": _status("VmHWM"),
        "rss": _status("VmRSS"),
        "params": sum(p.numel() for p in model.parameters()),
        "mem": rep,
    }
    opt.close()
    q.put((rank, out))
    dist.destroy_process_group()


def run_group(world, cfg) -> list[dict]:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    ps = [ctx.Process(target=worker, args=(r, world, port, cfg, q)) for r in range(world)]
    for p in ps:
        p.start()
    got = dict(q.get(timeout=1800) for _ in ps)
    for p in ps:
        p.join(60)
    return [got[r] for r in range(world)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", default="/var/tmp")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--d", type=int, default=1024)
    ap.add_argument("--blocks", type=int, default=16)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--bucket-mb", type=float, default=25.0)
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    args = ap.parse_args()
    d = tempfile.mkdtemp(prefix="zk-bench-offp-", dir=args.dir)
    rows = {}
    for _ in range(args.rounds):
        for name in CONFIGS:
            cfg = dict(vars(args), name=name, dir=d)
            rows.setdefault(name, []).append(run_group(args.world, cfg))
    os.rmdir(d)  # the files were removed by close()
    MB = 2**20
    for name, groups in rows.items():
        ranks = [r for g in groups for r in g]
        m = ranks[0]["mem"]
        print(
            json.dumps(
                {
                    "config": name,
                    "params": ranks[0]["params"],
                    "step_ms": round(1e3 * statistics.median(r["step_s"] for r in ranks), 1),
                    "peak_rss_MB": round(max(r["hwm"] for r in ranks) / MB, 1),
                    "rss_after_MB": round(max(r["rss"] for r in ranks) / MB, 1),
                    "param_MB": round(m["param_bytes"] / MB, 2),
                    "master_MB": round(m["master_bytes"] / MB, 2),
                    "optim_state_MB": round(m["optim_state_bytes"] / MB, 2),
                    "param_disk_MB": round(m["offload_param_disk_bytes"] / MB, 2),
                    "param_ram_peak_MB": round(m["offload_param_ram_peak_bytes"] / MB, 2),
                    "gathered_peak_MB": round(m["gathered_param_peak_bytes"] / MB, 2),
                }
            )
        )


if __name__ == "__main__":
    main()
