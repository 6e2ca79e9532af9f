"""The offload tiers against the same run in RAM: step time, the optimizer step against the I/O
bound, bytes moved, RSS per rank, memory_report's counts.

Configurations (``--configs``, default all): ``ram``; ``opt`` (offload_optimizer="nvme"),
``params`` (offload_params="nvme", stage 3), ``both``; ``ram_bf16`` and ``opt_bf16``: the same
with ``state_dtype="bf16"`` (bf16 moments: half the offload file and its I/O); ``ram_int8`` and
``opt_int8`` with ``"int8"`` (codes and scales: a quarter). Each round spawns one group per
configuration in turn, each rank training ``--layers`` units of Linear(d, d) + Tanh (an
``nn.ModuleList``: one stage-3 unit per layer; fused AdamW, clipping) for ``--steps`` timed
steps after 2 warm-up steps. Per rank and step: the whole step and ``opt.step()`` alone (wall),
the bytes the offload files read and wrote, and the bytes the process read from and wrote to
the block device (``/proc/self/io`` read_bytes/write_bytes, which O_DIRECT I/O counts and the
page cache does not hide); RSS is ``VmHWM`` (peak) and ``VmRSS`` after the last step. The disk is
measured in the same run with `zero_kernels.offload.probe_disk` (O_DIRECT, the directory used)
before and after the groups; the I/O bound of the optimizer step is (bytes it reads / read
bandwidth + bytes it writes / write bandwidth) summed over the ranks, which share the disk
(``opt`` only: with ``params`` the shards move during forward and backward too).

    python bench/bench_offload.py [--dir /var/tmp] [--world 2] [--stage 3] [--d 1024]
                                  [--layers 16] [--steps 5] [--rounds 2] [--configs ram,opt]
                                  [--dtype float32|bfloat16] [--out bench/results]
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

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import (  # noqa: E402
    init_gloo,
    machine,
    markdown_table,
    run_group,
    status_bytes,
    write_results,
)

from zero_kernels.policy import ZeroPolicy

CONFIGS = {
    "ram": {},
    "opt": {"offload_optimizer": "nvme"},
    "params": {"offload_params": "nvme"},
    "both": {"offload_params": "nvme", "offload_optimizer": "nvme"},
    "ram_bf16": {"state_dtype": "bf16"},  # bf16 moments (state_dtype): half the file and I/O
    "opt_bf16": {"offload_optimizer": "nvme", "state_dtype": "bf16"},
    "ram_int8": {"state_dtype": "int8"},  # int8 codes + scales: a quarter
    "opt_int8": {"offload_optimizer": "nvme", "state_dtype": "int8"},
}


def _io() -> dict:
    out = {}
    with open("/proc/self/io") as f:
        for line in f:
            k, v = line.split(":")
            out[k.strip()] = int(v)
    return out


def _moved(opt) -> tuple[int, int]:
    """Bytes the offload files read and wrote so far."""
    core = opt.parts.core
    files = [s for s in (core.runner.swap, core.store.tier) if s is not None]
    return sum(s.bytes_read for s in files), sum(s.bytes_written for s in files)


def worker(rank, world, port, cfg, q):
    import torch.distributed as dist
    from torch import nn

    import zero_kernels

    init_gloo(rank, world, port)

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
    model = Net(cfg["d"], cfg["layers"]).to(dtype)
    kw = dict(CONFIGS[cfg["name"]])
    if any(k.startswith("offload_") for k in kw):
        kw["offload_dir"] = cfg["dir"]
    opt = zero_kernels.ZeroOptimizer(
        model,
        torch.optim.AdamW,
        policy=ZeroPolicy.resolve(stage=cfg["stage"], bucket_size_mb=cfg["bucket_mb"], **kw),
        lr=1e-4,
    )
    x = torch.randn(cfg["batch"], cfg["d"], dtype=dtype)
    steps = []
    for s in range(2 + cfg["steps"]):
        io0, (r0, w0) = _io(), _moved(opt)
        t0 = time.perf_counter()
        opt.zero_grad()
        model(x).float().square().mean().backward()
        opt.clip_grad_norm_(1.0)
        t1 = time.perf_counter()
        sr, sw = _moved(opt)
        opt.step()
        t2 = time.perf_counter()
        io1, (r1, w1) = _io(), _moved(opt)
        if s >= 2:
            steps.append(
                {
                    "step_s": t2 - t0,
                    "opt_step_s": t2 - t1,
                    "file_read": r1 - r0,
                    "file_written": w1 - w0,
                    "opt_file_read": r1 - sr,
                    "opt_file_written": w1 - sw,
                    "dev_read": io1["read_bytes"] - io0["read_bytes"],
                    "dev_written": io1["write_bytes"] - io0["write_bytes"],
                }
            )
    q.put(
        (
            rank,
            {
                "steps": steps,
                "hwm": status_bytes("VmHWM"),
                "rss": status_bytes("VmRSS"),
                "params": sum(p.numel() for p in model.parameters()),
                "mem": opt.memory_report(),
            },
        )
    )
    opt.close()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", default="/var/tmp")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--stage", type=int, default=3)
    ap.add_argument("--d", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--bucket-mb", type=float, default=25.0)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--out", default="bench/results")
    a = ap.parse_args()
    names = a.configs.split(",")
    bad = [n for n in names if n not in CONFIGS]
    if bad or (a.stage != 3 and any("offload_params" in CONFIGS[n] for n in names)):
        raise SystemExit(f"--configs: unknown or not at stage {a.stage}: {a.configs!r}")
    from zero_kernels.offload import probe_disk

    work = tempfile.mkdtemp(prefix="zk-bench-offload-", dir=a.dir)
    disk = [probe_disk(work, mb=256)]
    base = {k: v for k, v in vars(a).items() if k not in ("configs", "out")} | {"dir": work}
    res: dict[str, list] = {n: [] for n in names}
    for _ in range(a.rounds):
        for name in names:
            res[name].append(run_group(worker, a.world, {**base, "name": name}))
    disk.append(probe_disk(work, mb=256))
    os.rmdir(work)  # the files were removed by close()
    rd = statistics.mean(x["read_gbps"] for x in disk) * 1e9
    wr = statistics.mean(x["write_gbps"] for x in disk) * 1e9
    mb = 2**20
    rows = []
    for name, groups in res.items():
        ranks = [r for g in groups for r in g]
        steps = [s for r in ranks for s in r["steps"]]

        def per_step(k, steps=steps):  # median per rank, summed over the ranks
            return statistics.median(s[k] for s in steps) * a.world

        file_rw = per_step("file_read") + per_step("file_written")
        dev_rw = per_step("dev_read") + per_step("dev_written")
        bound = per_step("opt_file_read") / rd + per_step("opt_file_written") / wr
        opt_s = per_step("opt_step_s") / a.world
        m = ranks[0]["mem"]
        rows.append(
            {
                "config": name,
                "params": ranks[0]["params"],
                "step_ms": round(per_step("step_s") / a.world * 1e3, 1),
                "opt_step_ms": round(opt_s * 1e3, 1),
                "opt_io_bound_ms": round(bound * 1e3, 1) if bound else "-",
                "opt_step/bound": round(opt_s / bound, 2) if bound else "-",
                "file_MB_per_step": round(file_rw / 1e6, 1),
                "device_MB_per_step": round(dev_rw / 1e6, 1),
                "device/file": round(dev_rw / file_rw, 2) if file_rw else "-",
                "peak_rss_MB": round(max(r["hwm"] for r in ranks) / mb, 1),
                "rss_after_MB": round(max(r["rss"] for r in ranks) / mb, 1),
                "param_MB": round(m["param_bytes"] / mb, 2),
                "param_disk_MB": round(m.get("offload_param_disk_bytes", 0) / mb, 2),
                "moments_in_ram_MB": round(m["optim_state_bytes"] / mb, 1),
                "staging_MB": round(m["offload_staging_bytes"] / mb, 1),
            }
        )
    cmd = "python " + " ".join(sys.argv)
    payload = {"machine": machine(), "disk": disk, "args": vars(a), "command": cmd}
    print(json.dumps(disk))
    print(markdown_table(rows, list(rows[0])))
    write_results(a.out, "offload", payload, rows)


if __name__ == "__main__":
    main()
