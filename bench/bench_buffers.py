"""What keeping buffers equal costs: a BatchNorm-heavy model, ZeRO against DDP, each with its
buffers broadcast before a training forward and without ([Note: replicated module state] in
zero_kernels/optimizer/replicas.py).

One spawned gloo group of ``--world`` ranks builds, side by side, every candidate over the same
model (``--blocks`` blocks of Linear(width, width, bias=False) + BatchNorm1d + ReLU: three
buffers per block) and times their steps in turn, ``--rounds`` rounds of ``--steps`` steps
after 2 warm-up steps each, so that the candidates share the machine's state; medians per
candidate:

  ddp           DDP(broadcast_buffers=True) + AdamW(fused=True)
  ddp_nobcast   DDP(broadcast_buffers=False) + AdamW(fused=True)
  zero2         ZeroOptimizer stage 2 (broadcast_buffers=True, the default)
  zero2_nobcast ZeroOptimizer stage 2, broadcast_buffers=False

It also checks that the two broadcasting candidates end with equal buffers on every rank (the
point of the broadcast) and reports `comm_stats["broadcast_bytes"]` per step.

    python bench/bench_buffers.py [--world 2] [--blocks 48] [--width 256] [--batch 32]
                                  [--steps 20] [--rounds 3] [--out bench/results]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import init_gloo, machine, markdown_table, run_group, write_results  # noqa: E402

from zero_kernels.policy import ZeroPolicy

CANDS = ["ddp", "ddp_nobcast", "zero2", "zero2_nobcast"]


def _model(a):
    from torch import nn

    torch.manual_seed(0)
    layers = []
    for _ in range(a.blocks):
        layers += [nn.Linear(a.width, a.width, bias=False), nn.BatchNorm1d(a.width), nn.ReLU()]
    return nn.Sequential(*layers)


def worker(rank, world, port, a, q) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from zero_kernels import ZeroOptimizer

    init_gloo(rank, world, port)
    runs = {}
    for name in CANDS:
        m = _model(a)
        if name.startswith("ddp"):
            fwd = DDP(m, broadcast_buffers=name == "ddp")
            opt = torch.optim.AdamW(m.parameters(), lr=1e-3, fused=True)
        else:
            fwd = m
            opt = ZeroOptimizer(
                m,
                torch.optim.AdamW,
                policy=ZeroPolicy.resolve(stage=2, broadcast_buffers=name == "zero2"),
                lr=1e-3,
            )
        runs[name] = (m, fwd, opt)
    g = torch.Generator().manual_seed(rank)
    xs = [torch.randn(a.batch, a.width, generator=g) for _ in range(4)]

    def step(name, i):
        m, fwd, opt = runs[name]
        opt.zero_grad()
        fwd(xs[i % len(xs)]).square().mean().backward()
        opt.step()

    times = {n: [] for n in CANDS}
    for _ in range(a.rounds):
        for name in CANDS:
            for i in range(2):
                step(name, i)
            dist.barrier()
            t = time.perf_counter()
            for i in range(a.steps):
                step(name, i)
            dist.barrier()
            times[name].append((time.perf_counter() - t) / a.steps)
    out = {"times": times}
    for name in ("ddp", "zero2"):  # after a broadcast forward every rank has rank 0's buffers
        m, fwd, opt = runs[name]
        m.eval()  # the evaluation forward broadcasts (the last one trained) and updates nothing
        with torch.no_grad():
            fwd(xs[0])
        bufs = torch.cat([b.flatten().double() for b in m.buffers()])
        ref = bufs.clone()
        dist.broadcast(ref, 0)
        out[f"{name} buffers equal rank 0's"] = bool(torch.equal(bufs, ref))
    zo = runs["zero2"][2]
    out["broadcast_bytes"] = zo.comm_stats["broadcast_bytes"]
    out["broadcast_calls"] = zo.comm_stats["broadcast_calls"]
    out["buffer_bytes"] = sum(b.numel() * b.element_size() for b in runs["zero2"][0].buffers())
    for name in ("zero2", "zero2_nobcast"):
        runs[name][2].close()
    q.put((rank, out))
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--blocks", type=int, default=48)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default="bench/results")
    a = ap.parse_args()
    res = run_group(worker, a.world, a)
    # a step's time: the slowest rank's, median over rounds
    med = {
        n: statistics.median(max(r["times"][n][k] for r in res) for k in range(a.rounds))
        for n in CANDS
    }
    rows = []
    for n in CANDS:
        rows.append(
            {
                "candidate": n,
                "step_ms": round(med[n] * 1e3, 2),
                "vs_ddp": round(med[n] / med["ddp"], 3),
                "rounds_ms": "/".join(
                    f"{max(r['times'][n][k] for r in res) * 1e3:.1f}" for k in range(a.rounds)
                ),
            }
        )
    r0 = res[0]
    payload = {
        "machine": machine(),
        "args": vars(a),
        "buffers_equal": {k: [r[k] for r in res] for k in r0 if k.endswith("rank 0's")},
        "buffer_bytes": r0["buffer_bytes"],
        "broadcast_calls": r0["broadcast_calls"],
        "broadcast_bytes": r0["broadcast_bytes"],
    }
    jpath, _ = write_results(a.out, "buffers", payload, rows)
    print(markdown_table(rows, ["candidate", "step_ms", "vs_ddp", "rounds_ms"]))
    print(
        f"buffers: {r0['buffer_bytes']} bytes; zero2 broadcast {r0['broadcast_calls']} times, "
        f"{r0['broadcast_bytes']} bytes; equal on every rank after a broadcast: "
        f"{payload['buffers_equal']}"
    )
    print(f"wrote {jpath}")


if __name__ == "__main__":
    main()
