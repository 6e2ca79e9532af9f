"""offload_optimizer="nvme" against the same run in RAM: step time, the optimizer step against
the I/O bound, bytes moved, peak RSS per rank.

Each round spawns one group per configuration (in turn: ram, nvme, ram, nvme, ...), each rank
training an MLP of ``--layers`` Linear(d, d) layers (stage ``--stage``, fused AdamW) for
``--steps`` timed steps after 2 warm-up steps. Per rank and step: the whole step and
``opt.step()`` alone (wall), the bytes the offload file read and wrote, and the bytes the
process read from and wrote to the block device (``/proc/self/io`` read_bytes/write_bytes,
which O_DIRECT I/O counts and the page cache does not hide). The disk is measured in the same
run with `zero_kernels.offload.probe_disk` (O_DIRECT, the directory used) before and after the
groups; the I/O bound of a step is (bytes read / read bandwidth + bytes written / write
bandwidth) summed over the ranks, which share the disk.

    python bench/bench_offload.py [--dir /var/tmp] [--world 2] [--stage 2] [--d 1024]
                                  [--layers 16] [--steps 6] [--rounds 2] [--out bench/results]
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
from harness import free_port, machine, markdown_table, write_results  # noqa: E402


def _io() -> dict:
    out = {}
    with open("/proc/self/io") as f:
        for line in f:
            k, v = line.split(":")
            out[k.strip()] = int(v)
    return out


def _hwm() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
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
    torch.manual_seed(0)
    d = cfg["d"]
    model = nn.Sequential(*[nn.Linear(d, d) for _ in range(cfg["layers"])])
    kw = {}
    if cfg["offload"]:
        kw = {"offload_optimizer": "nvme", "offload_dir": cfg["dir"]}
    opt = zero_kernels.ZeroOptimizer(
        model,
        torch.optim.AdamW,
        stage=cfg["stage"],
        lr=1e-4,
        bucket_size_mb=cfg["bucket_mb"],
        **kw,
    )
    x = torch.randn(cfg["batch"], d)
    steps = []
    sw = opt.parts.core.runner.swap
    for s in range(2 + cfg["steps"]):
        io0 = _io()
        r0, w0 = (sw.bytes_read, sw.bytes_written) if sw else (0, 0)
        t0 = time.perf_counter()
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.clip_grad_norm_(1.0)
        t1 = time.perf_counter()
        opt.step()
        t2 = time.perf_counter()
        io1 = _io()
        if s >= 2:
            steps.append(
                {
                    "step_s": t2 - t0,
                    "opt_step_s": t2 - t1,
                    "file_read": (sw.bytes_read - r0) if sw else 0,
                    "file_written": (sw.bytes_written - w0) if sw else 0,
                    "dev_read": io1["read_bytes"] - io0["read_bytes"],
                    "dev_written": io1["write_bytes"] - io0["write_bytes"],
                }
            )
    rep = opt.memory_report()
    q.put(
        (
            rank,
            {
                "steps": steps,
                "hwm": _hwm(),
                "params": sum(p.numel() for p in model.parameters()),
                "mem": rep,
                "o_direct": bool(sw.file.direct) if sw else None,
            },
        )
    )
    opt.close()
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
        if p.exitcode not in (0, None):
            raise RuntimeError(f"rank exited with {p.exitcode}")
    return [got[r] for r in range(world)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", default="/var/tmp")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--stage", type=int, default=2)
    ap.add_argument("--d", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--bucket-mb", type=float, default=25.0)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default="bench/results")
    a = ap.parse_args()
    from zero_kernels.offload import probe_disk

    work = tempfile.mkdtemp(prefix="zk-bench-offload-", dir=a.dir)
    disk = [probe_disk(work, mb=256)]
    base = {
        "d": a.d,
        "layers": a.layers,
        "batch": a.batch,
        "stage": a.stage,
        "steps": a.steps,
        "bucket_mb": a.bucket_mb,
        "dir": work,
    }
    res: dict[str, list] = {"ram": [], "nvme": []}
    for _ in range(a.rounds):
        for name in ("ram", "nvme"):
            res[name].append(run_group(a.world, {**base, "offload": name == "nvme"}))
    disk.append(probe_disk(work, mb=256))
    os.rmdir(work)
    rd = statistics.mean(x["read_gbps"] for x in disk) * 1e9
    wr = statistics.mean(x["write_gbps"] for x in disk) * 1e9
    rows = []
    for name, groups in res.items():
        steps = [s for g in groups for r in g for s in r["steps"]]

        def per_step(k, steps=steps):
            return statistics.median(s[k] for s in steps)

        file_r = per_step("file_read") * a.world
        file_w = per_step("file_written") * a.world
        dev_r = per_step("dev_read") * a.world
        dev_w = per_step("dev_written") * a.world
        bound = file_r / rd + file_w / wr
        opt_s = per_step("opt_step_s")
        mem = groups[0][0]["mem"]
        rows.append(
            {
                "config": name,
                "params": groups[0][0]["params"],
                "step_ms": round(per_step("step_s") * 1e3, 1),
                "opt_step_ms": round(opt_s * 1e3, 1),
                "io_bound_ms": round(bound * 1e3, 1) if bound else "-",
                "opt_step/bound": round(opt_s / bound, 2) if bound else "-",
                "file_MB_per_step": round((file_r + file_w) / 1e6, 1),
                "device_MB_per_step": round((dev_r + dev_w) / 1e6, 1),
                "device/file": round((dev_r + dev_w) / (file_r + file_w), 2) if file_r else "-",
                "peak_rss_MB": round(max(r["hwm"] for g in groups for r in g) / 2**20, 1),
                "state_in_ram_MB": round(mem["optim_state_bytes"] / 2**20, 1),
                "staging_MB": round(mem["offload_staging_bytes"] / 2**20, 1),
                "o_direct": groups[0][0]["o_direct"],
            }
        )
    cmd = "python " + " ".join(sys.argv)
    payload = {"machine": machine(), "disk": disk, "args": vars(a), "command": cmd}
    keys = list(rows[0])
    print(json.dumps(disk))
    print(markdown_table(rows, keys))
    write_results(a.out, "offload", payload, rows)


if __name__ == "__main__":
    main()
