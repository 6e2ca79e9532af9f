"""Capacity at a fixed memory budget with low-bit optimizer state: ZeroOptimizer stage 3 on
``--world`` ranks (gloo, this host), the demo GPT at two depths, fp32 / bf16 / int8 moments.

Per configuration and depth one group trains ``--steps`` steps (AdamW, fused step) and each rank
reports its peak RSS (``VmHWM``), ``memory_report()``'s model-state bytes and the step time. The
peak is fitted per state dtype as ``a + b * n_params`` over the depths by least squares (the
same width and batch: what differs is the params and their state; with
``--activation-checkpointing`` the saved activations barely grow with depth). The model is
built on the meta device and materialised shard by shard (as a model larger than one rank's
memory must be): built whole on every rank, construction's peak would hide the state's. The
capacity at ``--budget-mib`` per rank is ``(budget - a) / b`` params, and the table gives each
dtype's capacity against fp32 state's.
Model-state bytes per param (params, grads, moments, masters: what the state dtype changes) are
reported beside it, from ``memory_report``.

    python bench/bench_state_capacity.py [--world 4] [--embd 384] [--layers 4,8,12] [--steps 3]
                                         [--budget-mib 1024] [--dtypes fp32,bf16,int8]
                                         [--param-dtype float32|bfloat16]
                                         [--activation-checkpointing] [--out bench/results]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
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


def worker(rank, world, port, cfg, q):
    import torch.distributed as dist

    import zero_kernels
    from zero_kernels.models import GPT, GPTConfig, get_batch, load_corpus

    init_gloo(rank, world, port)
    torch.manual_seed(0)
    gc = GPTConfig(
        n_layer=cfg["layers"],
        n_head=8,
        n_embd=cfg["embd"],
        block_size=cfg["seq"],
        vocab_size=256,
        activation_checkpointing=cfg["ckpt"],
    )
    with torch.device("meta"):  # materialised shard by shard: no rank holds the whole model
        model = GPT(gc).to(getattr(torch, cfg["param_dtype"]))
    opt = zero_kernels.ZeroOptimizer(
        model,
        torch.optim.AdamW,
        stage=3,
        lr=3e-4,
        weight_decay=0.1,
        state_dtype=cfg["state_dtype"],
    )
    corpus = load_corpus()
    times, losses = [], []
    for step in range(cfg["steps"]):
        x, y = get_batch(corpus, cfg["batch"], cfg["seq"], seed=0, step=step, rank=rank)
        t0 = time.perf_counter()
        opt.zero_grad()
        loss = model(x, y)
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - t0)
        losses.append(float(loss))
    rep = opt.memory_report()
    q.put(
        (
            rank,
            {
                "hwm": status_bytes("VmHWM"),
                "model_state_bytes": rep["model_state_bytes"],
                "optim_state_bytes": rep["optim_state_bytes"],
                "params": sum(p.numel() for p in model.parameters()),
                "step_s": statistics.median(times[1:] or times),
                "losses": losses,
            },
        )
    )
    opt.close()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--embd", type=int, default=384)
    ap.add_argument("--layers", default="4,8,12", help="depths (the fit's points, >= 2)")
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--budget-mib", type=float, default=1024.0)
    ap.add_argument("--dtypes", default="fp32,bf16,int8")
    ap.add_argument("--param-dtype", default="float32")
    ap.add_argument(
        "--activation-checkpointing",
        action="store_true",
        help="recompute blocks in backward: activations stop growing with depth, so the fit "
        "sees the model state and not the activations",
    )
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = ap.parse_args()
    depths = [int(x) for x in args.layers.split(",")]
    if len(depths) < 2 or sorted(set(depths)) != depths:
        raise SystemExit(f"--layers must be >= 2 increasing depths, got {args.layers!r}")
    rows, raw = [], {}
    for sd in args.dtypes.split(","):
        pts = []
        for d in depths:
            cfg = dict(
                layers=d,
                embd=args.embd,
                seq=args.seq,
                batch=args.batch,
                steps=args.steps,
                state_dtype=sd,
                param_dtype=args.param_dtype,
                ckpt=args.activation_checkpointing,
            )
            reps = run_group(worker, args.world, cfg, timeout=900)
            raw[f"{sd}/{d}"] = reps
            hwm = max(r["hwm"] for r in reps)
            n = reps[0]["params"]
            pts.append((n, hwm, reps))
            print(
                f"  {sd:5} layers {d:3}: {n / 1e6:.1f}M params, peak RSS/rank {hwm / 2**20:.0f}"
                f" MiB, step {statistics.median(r['step_s'] for r in reps):.3f} s",
                flush=True,
            )
        # least squares of peak = a + b * n over the depths (b: peak bytes per param per rank)
        ns, hs = [p[0] for p in pts], [p[1] for p in pts]
        nm, hm = statistics.mean(ns), statistics.mean(hs)
        b = sum((n - nm) * (h - hm) for n, h in zip(ns, hs)) / sum((n - nm) ** 2 for n in ns)
        a = hm - b * nm
        n1, r1 = pts[-1][0], pts[-1][2]
        cap = (args.budget_mib * 2**20 - a) / b
        ms = statistics.mean(r["model_state_bytes"] for r in r1) * args.world / n1
        rows.append(
            {
                "state_dtype": sd,
                "peak_bytes_per_param": round(b, 3),
                "fixed_MiB": round(a / 2**20, 1),
                "capacity_Mparams": round(cap / 1e6, 1),
                "model_state_bytes_per_param": round(ms, 3),
                "step_s": round(statistics.median(r["step_s"] for r in r1), 3),
                "final_loss": round(statistics.mean(r["losses"][-1] for r in r1), 4),
            }
        )
    base = next((r for r in rows if r["state_dtype"] == "fp32"), None)
    for r in rows:
        if base:
            r["capacity_vs_fp32"] = round(r["capacity_Mparams"] / base["capacity_Mparams"], 3)
            r["model_state_vs_fp32"] = round(
                base["model_state_bytes_per_param"] / r["model_state_bytes_per_param"], 3
            )
    keys = list(rows[0])
    print(markdown_table(rows, keys))
    payload = {
        "machine": machine(),
        "command": " ".join([sys.executable, *sys.argv]),
        "args": vars(args),
        "raw": raw,
        "budget_MiB": args.budget_mib,
    }
    write_results(args.out, "state_capacity", payload, rows)


if __name__ == "__main__":
    main()
