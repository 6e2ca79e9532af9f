"""Checkpoints of offloaded state (issue 23): streamed bucket by bucket against the whole state
read into RAM first, side by side in one run.

Each rank trains ``--layers`` units of Linear(d, d) + Tanh at stage 3 with both offloads
(``offload_optimizer="nvme"``, ``offload_params="nvme"``, fused AdamW, fp32) for 2 steps, then,
for ``--rounds`` rounds (the order alternating), saves and loads a checkpoint in each mode:

    streamed   save_checkpoint / load_checkpoint as they are: one bucket's offloaded state in
               RAM at a time ([Note: streamed checkpoints] in zero_kernels/checkpoint/save.py)
    resident   the same calls inside ``opt.sharded_state.resident()`` (entered and left inside
               the timed call): every moment and param shard read into RAM first, written back
               after, as checkpoints did before streaming

Per call: the wall time (the slower rank, fenced by barriers), the peak increase of RssAnon
(allocated memory, sampled every 2 ms: `bench_checkpoint.Peak`) and of VmRSS (``VmHWM`` after
resetting it through /proc/self/clear_refs: it also counts the pages of the checkpoint files a
load maps, which are page cache, not allocated), the larger rank; beside them the bytes of
offloaded state per rank (moments + param shards). The page cache is not dropped (the rank
files are read back from it on load).

    python bench/bench_ckpt_offload.py [--dir /var/tmp] [--world 2] [--d 1024] [--layers 16]
                                       [--rounds 2] [--state-dtype fp32] [--out bench/results]

With ``--state-dtype int8`` the streamed save holds the codes and scales of the rank's moments
(2 bytes per element; not a bucket at a time) and never decodes them; ``resident`` decodes them
to fp32 (8 bytes more per element), as every int8 save did before.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_checkpoint import Peak  # noqa: E402
from harness import (  # noqa: E402
    init_gloo,
    machine,
    markdown_table,
    run_group,
    status_bytes,
    write_results,
)

from zero_kernels.policy import ZeroPolicy


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def worker(rank, world, port, cfg, q):
    import torch.distributed as dist
    from torch import nn

    import zero_kernels

    init_gloo(rank, world, port)
    torch.manual_seed(0)
    d = cfg["d"]
    model = nn.Sequential(
        *[nn.Sequential(nn.Linear(d, d), nn.Tanh()) for _ in range(cfg["layers"])]
    )
    opt = zero_kernels.ZeroOptimizer(
        model,
        torch.optim.AdamW,
        policy=ZeroPolicy.resolve(
            stage=3, offload_optimizer="nvme", offload_params="nvme", offload_dir=cfg["dir"]
        ),
        lr=1e-3,
        units=[nn.Sequential],
        **({"state_dtype": cfg["state_dtype"]} if cfg["state_dtype"] != "fp32" else {}),
    )
    for s in range(2):
        x = torch.randn(8, d, generator=torch.Generator().manual_seed(s * 10 + rank))
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    core = opt.parts.core
    offloaded = core.runner.swap.moment_bytes() + sum(
        r.nbytes for r in core.store.tier.records.values() if not r.pinned
    )
    root = os.path.join(cfg["dir"], f"zk-bench-ckpt-offload-{cfg['token']}")
    rows = []
    modes = ["streamed", "resident"]
    for rnd in range(cfg["rounds"]):
        for mode in modes if rnd % 2 == 0 else modes[::-1]:
            for call in ("save", "load"):
                ctx = (
                    opt.sharded_state.resident() if mode == "resident" else contextlib.nullcontext()
                )
                dist.barrier()
                _reset_peak()
                rss0 = status_bytes("VmRSS")
                t0 = time.perf_counter()
                with Peak() as pk, ctx:
                    if call == "save":
                        zero_kernels.save_checkpoint(root, model, opt, keep_last=1)
                    else:
                        zero_kernels.load_checkpoint(root, model, opt)
                dt = time.perf_counter() - t0
                hwm = status_bytes("VmHWM") - rss0
                dist.barrier()
                rows.append(
                    {"round": rnd, "mode": mode, "call": call, "s": dt, "anon": pk.anon, "hwm": hwm}
                )
    dist.barrier()
    if rank == 0:
        shutil.rmtree(root, ignore_errors=True)
    n = sum(p.numel() for p in model.parameters())
    q.put((rank, {"rows": rows, "offloaded": offloaded, "params": n}))
    opt.close()
    dist.destroy_process_group()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default="/var/tmp", help="offload and checkpoint folder")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--d", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument(
        "--state-dtype",
        default="fp32",
        choices=("fp32", "bf16", "int8"),
        help="the moments' format (int8: a save writes the codes as they are, not decoded)",
    )
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    a = ap.parse_args(argv)
    work = tempfile.mkdtemp(prefix="zk-ckpt-offload-", dir=a.dir)
    cfg = {
        "d": a.d,
        "layers": a.layers,
        "rounds": a.rounds,
        "dir": work,
        "token": os.getpid(),
        "state_dtype": a.state_dtype,
    }
    try:
        res = run_group(worker, a.world, cfg)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    table = []
    for mode in ("streamed", "resident"):
        for call in ("save", "load"):
            per_round = {}
            for r in res:
                for row in r["rows"]:
                    if row["mode"] == mode and row["call"] == call:
                        k = per_round.setdefault(row["round"], [0.0, 0, 0])
                        k[0], k[1] = max(k[0], row["s"]), max(k[1], row["anon"])
                        k[2] = max(k[2], row["hwm"])
            table.append(
                {
                    "mode": mode,
                    "call": call,
                    "s (median, slower rank)": round(
                        statistics.median(v[0] for v in per_round.values()), 3
                    ),
                    "peak RssAnon above before, MiB (largest)": round(
                        max(v[1] for v in per_round.values()) / 2**20, 1
                    ),
                    "peak VmRSS (incl. mapped checkpoint file pages), MiB": round(
                        max(v[2] for v in per_round.values()) / 2**20, 1
                    ),
                    "offloaded state per rank, MiB": round(
                        max(r["offloaded"] for r in res) / 2**20, 1
                    ),
                }
            )
    cmd = "python bench/bench_ckpt_offload.py " + " ".join(argv or sys.argv[1:])
    payload = {"machine": machine(), "command": cmd, "params": res[0]["params"], "config": cfg}
    name = "ckpt_offload" + ("" if a.state_dtype == "fp32" else f"_{a.state_dtype}")
    write_results(a.out, name, payload, table)
    print(json.dumps(payload["machine"]))
    print(f"{res[0]['params'] / 1e6:.1f}M params, world {a.world}; {cmd}")
    print(markdown_table(table, list(table[0])))


if __name__ == "__main__":
    main()
