"""Peak memory of `zero-kernels checkpoint convert --from deepspeed` (issue 50).

Writes a synthetic DeepSpeed ZeRO-2 checkpoint (the layout DeepSpeed 0.19 writes: per rank a
flat fp32 partition and Adam's moments on it; ``--params`` params of ``--numel`` elements over
``--world`` ranks), then converts it in a fresh process that samples its own anonymous resident
memory (``RssAnon`` of /proc/self/status, every 2 ms) and reports the peak above what it held
before the call, beside the state's size. The converter streams param by param, so the peak is
about one param's fp32 tensor (plus the writer's chunk), whatever the checkpoint's size; the
file pages the OS maps in (``torch.load(mmap=True)``) are page cache, counted apart (RssFile).

    python bench/bench_deepspeed_convert.py [--params 24] [--numel 2000000] [--world 2]
        [--memory-limit-mb M]

``--memory-limit-mb``: the converting process runs in a memory cgroup of its own limited to M
MiB (page cache included, which the kernel reclaims under the limit; root and cgroup v1's
memory controller at /sys/fs/cgroup/memory needed), so a checkpoint larger than the budget
shows it converts within it: the kernel kills the process if it does not.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import torch


def make_synthetic(folder: str, params: int, numel: int, world: int) -> int:
    """A DeepSpeed ZeRO-2 checkpoint of ``params`` params of ``numel`` elements; its bytes."""
    tag = os.path.join(folder, "global_step7")
    os.makedirs(tag)
    shapes = {f"layer{i}.weight": torch.Size([numel]) for i in range(params)}
    total = params * numel
    size = -(-total // world)
    torch.save(
        {
            "module": {},
            "param_shapes": [shapes],
            "buffer_names": [],
            "global_steps": 7,
            "lr_scheduler": {"last_batch_iteration": 6},
            "dp_world_size": world,
            "ds_config": {"optimizer": {"type": "AdamW"}},
            "ds_version": "synthetic",
        },
        os.path.join(tag, "mp_rank_00_model_states.pt"),
    )
    g = torch.Generator().manual_seed(0)
    for r in range(world):
        n = size
        part = torch.randn(n, generator=g)
        torch.save(
            {
                "optimizer_state_dict": {
                    "zero_stage": 2,
                    "single_partition_of_fp32_groups": [part],
                    "base_optimizer_state": {
                        "state": {0: {"step": 7, "exp_avg": part * 0.1, "exp_avg_sq": part.abs()}},
                        "param_groups": [
                            {
                                "lr": 1e-3,
                                "betas": [0.9, 0.999],
                                "eps": 1e-8,
                                "weight_decay": 0.0,
                                "params": [0],
                            }
                        ],
                    },
                    "group_paddings": [size * world - total],
                    "partition_count": [world],
                }
            },
            os.path.join(tag, f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt"),
        )
        del part
    with open(os.path.join(folder, "latest"), "w") as f:
        f.write("global_step7")
    return 3 * 4 * total


_CHILD = r"""
import json, sys, threading, time
def anon():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
from zero_kernels.checkpoint.deepspeed_convert import convert_deepspeed_checkpoint
base = anon(); peak = [base]; done = [False]
def sample():
    while not done[0]:
        peak[0] = max(peak[0], anon()); time.sleep(0.002)
t = threading.Thread(target=sample); t.start()
t0 = time.perf_counter()
out = convert_deepspeed_checkpoint(sys.argv[1], sys.argv[2])
dt = time.perf_counter() - t0
done[0] = True; t.join()
print(json.dumps({"peak_anon_above_start": peak[0] - base, "seconds": dt, "out": out}))
"""


CGROUP_V1 = "/sys/fs/cgroup/memory"


def _limited(limit_mb: int):
    """A fresh v1 memory cgroup of ``limit_mb`` MiB; returns (its path, a preexec_fn that moves
    the child into it)."""
    path = os.path.join(CGROUP_V1, f"zk-convert-{os.getpid()}")
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "memory.limit_in_bytes"), "w") as f:
        f.write(str(limit_mb * 2**20))

    def enter():
        with open(os.path.join(path, "cgroup.procs"), "w") as f:
            f.write(str(os.getpid()))

    return path, enter


def measure(
    params: int, numel: int, world: int, tmp: str | None = None, limit_mb: int | None = None
) -> dict:
    with tempfile.TemporaryDirectory(dir=tmp) as d:
        src = os.path.join(d, "ds")
        os.makedirs(src)
        state = make_synthetic(src, params, numel, world)
        cg, enter = _limited(limit_mb) if limit_mb else (None, None)
        try:
            r = subprocess.run(
                [sys.executable, "-c", _CHILD, src, os.path.join(d, "ours")],
                capture_output=True,
                text=True,
                preexec_fn=enter,
            )
            if r.returncode:
                raise RuntimeError(
                    f"convert exited {r.returncode} (-9: the cgroup's OOM kill)\n{r.stderr}"
                )
            out = json.loads(r.stdout.strip().splitlines()[-1])
            if cg:
                with open(os.path.join(cg, "memory.max_usage_in_bytes")) as f:
                    out["cgroup_peak"] = int(f.read())
                with open(os.path.join(cg, "memory.failcnt")) as f:
                    out["cgroup_failcnt"] = int(f.read())
        finally:
            if cg:
                os.rmdir(cg)
        out.update(state_bytes=state, param_bytes=4 * numel, params=params, world=world)
        return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", type=int, default=24)
    ap.add_argument("--numel", type=int, default=2_000_000)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--memory-limit-mb", type=int, default=None)
    ap.add_argument("--tmp", default=None, help="where the checkpoints go (default: TMPDIR)")
    a = ap.parse_args()
    t0 = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    r = measure(a.params, a.numel, a.world, a.tmp, a.memory_limit_mb)
    mb = 2**20
    print(
        f"{t0}, torch {torch.__version__}: state {r['state_bytes'] / mb:.0f} MiB "
        f"({a.params} params x {a.numel:,} elements, {a.world} ranks); convert "
        f"{r['seconds']:.1f} s, peak anonymous memory above start "
        f"{r['peak_anon_above_start'] / mb:.1f}"
        f" MiB (one param's fp32: {r['param_bytes'] / mb:.1f} MiB)"
        + (
            f"; in a cgroup of {a.memory_limit_mb} MiB: its peak (page cache included) "
            f"{r['cgroup_peak'] / mb:.0f} MiB, {r['cgroup_failcnt']} reclaims at the limit"
            if a.memory_limit_mb
            else ""
        )
    )


if __name__ == "__main__":
    main()
