"""ZeRO over tensor parallelism (issue 49, "Measured"): step time of ZeroOptimizer stages 1-3 over
a tensor-parallel GPT against FSDP2 + TP, side by side in one run, and their losses.

    torchrun --nproc_per_node 4 bench/bench_tp.py [--steps 4] [--rounds 5] [--out DIR]

4 ranks = dp 2 x tp 2 (``init_device_mesh("cpu", (2, 2), ("dp", "tp"))``), gloo, 1 thread per
rank. The model: `zero_kernels.tools.tp_models.TPGPT` split by `parallelize_gpt` (sequence
parallel) over the tp dim; every candidate built from the same seed and trained on the same
per-dp-rank batches with the same AdamW hyper-parameters:

    fsdp2_tp    fully_shard on each block, then the root, mesh=mesh["dp"] (torchtitan's
                composition), torch AdamW(fused=True) (it steps DTensor params on CPU)
    zero1/2/3   ZeroOptimizer(model, AdamW, policy=ZeroPolicy.resolve(stage=s),
                process_group=mesh["dp"].get_group(), lr=...) (the fused sharded AdamW)

All candidates live in the same 4 processes; each round runs ``--steps`` steps of each, in an
order that rotates every round (A B C D / B C D A / ...); the first round is warm-up. A step's time
is the slowest rank's (a max all-reduce of each rank's time); the table gives the median over the
measured rounds and the paired ratio to fsdp2_tp (median over rounds of the ratio in the same
round). Losses: each candidate's first ``--steps`` losses against fsdp2_tp's (relative).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from zero_kernels import ZeroOptimizer  # noqa: E402
from zero_kernels.policy import ZeroPolicy  # noqa: E402
from zero_kernels.tools.models import GPTConfig  # noqa: E402
from zero_kernels.tools.tp_models import TPGPT, parallelize_gpt  # noqa: E402

LR = 1e-3
CFG = GPTConfig(vocab_size=256, block_size=64, n_layer=4, n_head=4, n_embd=128)
BATCH = 8


def build(name: str, mesh):
    torch.manual_seed(0)
    model = parallelize_gpt(TPGPT(CFG), mesh["tp"])
    if name == "fsdp2_tp":
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
        opt = torch.optim.AdamW(model.parameters(), lr=LR, fused=True)
    else:
        stage = int(name[-1])
        opt = ZeroOptimizer(
            model,
            torch.optim.AdamW,
            policy=ZeroPolicy.resolve(stage=stage),
            process_group=mesh["dp"].get_group(),
            lr=LR,
        )
    return model, opt


def batch(step: int, dp_rank: int):
    g = torch.Generator().manual_seed(1000 * step + dp_rank)
    idx = torch.randint(0, CFG.vocab_size, (BATCH, CFG.block_size + 1), generator=g)
    return idx[:, :-1], idx[:, 1:]


def run_steps(model, opt, first: int, n: int, dp_rank: int) -> tuple[list[float], list[float]]:
    times, losses = [], []
    for s in range(first, first + n):
        x, y = batch(s, dp_rank)
        dist.barrier()
        t0 = time.perf_counter()
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        t = torch.tensor([time.perf_counter() - t0])
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        times.append(float(t))
        losses.append(float(loss.detach()))
    return times, losses


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp_rank = mesh["dp"].get_local_rank()
    names = ["fsdp2_tp", "zero1", "zero2", "zero3"]
    built = {n: build(n, mesh) for n in names}
    losses = {}
    for n in names:  # correctness first: the same first steps from the same init
        losses[n] = run_steps(*built[n], 0, args.steps, dp_rank)[1]
    step_times = {n: [] for n in names}  # per round: median step of the round
    for r in range(args.rounds + 1):
        order = names[r % len(names) :] + names[: r % len(names)]
        for n in order:
            ts, _ = run_steps(*built[n], args.steps * (r + 1), args.steps, dp_rank)
            if r > 0:  # round 0: warm-up
                step_times[n].append(statistics.median(ts))
    rows = []
    for n in names:
        ratio = statistics.median(
            a / b for a, b in zip(step_times[n], step_times["fsdp2_tp"], strict=True)
        )
        err = max(abs(a - b) / abs(b) for a, b in zip(losses[n], losses["fsdp2_tp"]))
        rows.append(
            {
                "candidate": n,
                "step_ms": round(1e3 * statistics.median(step_times[n]), 1),
                "vs_fsdp2_tp": round(ratio, 3),
                "loss_rel_diff_vs_fsdp2": f"{err:.1e}",
            }
        )
    if dist.get_rank() == 0:
        params = sum(p.numel() for p in TPGPT(CFG).parameters())
        head = (
            f"TPGPT {params / 1e6:.2f}M params (n_layer={CFG.n_layer}, n_embd={CFG.n_embd}), "
            f"batch {BATCH}x{CFG.block_size} per dp rank, dp 2 x tp 2, gloo, "
            f"{args.rounds} rounds x {args.steps} steps, torch {torch.__version__}"
        )
        print(head)
        print("| candidate | step (ms) | vs fsdp2_tp (paired) | loss rel. diff vs fsdp2_tp |")
        print("|---|---|---|---|")
        for row in rows:
            print(
                f"| {row['candidate']} | {row['step_ms']} | {row['vs_fsdp2_tp']} | "
                f"{row['loss_rel_diff_vs_fsdp2']} |"
            )
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, "bench_tp.json"), "w") as f:
                json.dump({"setup": head, "rows": rows, "losses": losses}, f, indent=1)
    for n in names:
        opt = built[n][1]
        if isinstance(opt, ZeroOptimizer):
            opt.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
