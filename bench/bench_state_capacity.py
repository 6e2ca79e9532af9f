"""Capacity at a fixed memory budget: ZeroOptimizer stage 3 on ``--world`` ranks (gloo, this
host) with fp32 / bf16 / int8 moments, with both offloads to NVMe, and DDP, the demo GPT at a few
depths each.

Per configuration and depth one group trains ``--steps`` steps (AdamW, fused step) and each rank
reports its peak RSS (``VmHWM``), ``memory_report()``'s model-state bytes and the step time. The
peak is fitted per configuration as ``a + b * n_params`` over the depths by least squares (the
same width and batch: what differs is the params and their state; with
``--activation-checkpointing`` the saved activations barely grow with depth). ZeRO's models are
built on the meta device and materialised shard by shard (as a model larger than one rank's
memory must be): built whole on every rank, construction's peak would hide the state's. DDP's
is built whole (it needs every param on every rank), with ``AdamW(fused=True)``, gradients as
bucket views and ``zero_grad(set_to_none=True)``. The capacity at ``--budget-mib`` per rank is
``(budget - a) / b`` params; the table gives each configuration's capacity against fp32 state's
and DDP's. Model-state bytes per param (params, grads, moments, masters) are reported beside it,
from ``memory_report``.

Configurations (``--configs``; default: ``--dtypes`` at stage 3): ``ddp``; ``stage3_<dtype>``;
``offload_<dtype>``: stage 3 with ``offload_optimizer="nvme"`` and ``offload_params="nvme"`` in
``--offload-dir`` (the files' bytes are on disk, not in the peak). ``--check-x K`` then trains
each offload configuration once more at the depth whose params are K times DDP's fitted
capacity and reports its measured peak against the budget: the target as a run, not a fit.

    python bench/bench_state_capacity.py [--world 4] [--embd 384] [--layers 4,8,12] [--steps 3]
                                         [--budget-mib 1024] [--dtypes fp32,bf16,int8]
                                         [--configs ddp,stage3_fp32,offload_fp32]
                                         [--layers-for offload=8,16,32] [--check-x 10]
                                         [--offload-dir /var/tmp]
                                         [--param-dtype float32|bfloat16]
                                         [--activation-checkpointing] [--out bench/results]
                                         [--tag NAME]
"""

from __future__ import annotations

import argparse
import math
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
    from zero_kernels.tools.models import GPT, GPTConfig, get_batch, load_corpus

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
    dt = getattr(torch, cfg["param_dtype"])
    kind = cfg["kind"]
    if kind == "ddp":  # every param on every rank: built whole
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = GPT(gc).to(dt)
        fwd = DDP(model, gradient_as_bucket_view=True)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1, fused=True)
        zero = lambda: opt.zero_grad(set_to_none=True)  # noqa: E731
    else:
        with torch.device("meta"):  # materialised shard by shard: no rank holds the model
            model = GPT(gc).to(dt)
        extra = {}
        if kind == "offload":
            extra = dict(
                offload_optimizer="nvme", offload_params="nvme", offload_dir=cfg["offload_dir"]
            )
        opt = zero_kernels.ZeroOptimizer(
            model,
            torch.optim.AdamW,
            policy=zero_kernels.ZeroPolicy.resolve(
                stage=3, state_dtype=cfg["state_dtype"], **extra
            ),
            lr=3e-4,
            weight_decay=0.1,
        )
        fwd, zero = model, opt.zero_grad
    corpus = load_corpus()
    times, losses = [], []
    for step in range(cfg["steps"]):
        x, y = get_batch(corpus, cfg["batch"], cfg["seq"], seed=0, step=step, rank=rank)
        t0 = time.perf_counter()
        zero()
        loss = fwd(x, y)
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - t0)
        losses.append(float(loss))
    if kind == "ddp":
        n = sum(p.numel() for p in model.parameters())
        rep = {"model_state_bytes": 16 * n, "optim_state_bytes": 8 * n}  # fp32: p, g, m, v
        opt.close = lambda: None
    else:
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


def _depths(text: str, what: str) -> list[int]:
    depths = [int(x) for x in text.split(",")]
    if len(depths) < 2 or sorted(set(depths)) != depths:
        raise SystemExit(f"{what} must be >= 2 increasing depths, got {text!r}")
    return depths


def _parse_config(name: str) -> tuple[str, str]:
    if name == "ddp":
        return "ddp", "fp32"
    kind, _, sd = name.partition("_")
    if kind not in ("stage3", "offload") or sd not in ("fp32", "bf16", "int8"):
        raise SystemExit(
            f"--configs: {name!r} is not ddp, stage3_<dtype> or offload_<dtype> "
            "(dtype fp32, bf16 or int8)"
        )
    return kind, sd


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--embd", type=int, default=384)
    ap.add_argument("--layers", default="4,8,12", help="depths (the fit's points, >= 2)")
    ap.add_argument(
        "--layers-for",
        default="",
        help="other depths per kind, e.g. offload=8,16,32;ddp=2,4,6 (default: --layers)",
    )
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--budget-mib", type=float, default=1024.0)
    ap.add_argument("--dtypes", default="fp32,bf16,int8")
    ap.add_argument("--configs", default="", help="ddp, stage3_<dtype>, offload_<dtype>")
    ap.add_argument("--offload-dir", default="/var/tmp")
    ap.add_argument(
        "--check-x",
        type=float,
        default=0.0,
        help="train each offload config at K x DDP's fitted capacity (needs ddp)",
    )
    ap.add_argument("--param-dtype", default="float32")
    ap.add_argument(
        "--activation-checkpointing",
        action="store_true",
        help="recompute blocks in backward: activations stop growing with depth, so the fit "
        "sees the model state and not the activations",
    )
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    ap.add_argument("--tag", default="", help="results as state_capacity_<tag>.{json,csv}")
    args = ap.parse_args()
    depths = _depths(args.layers, "--layers")
    per_kind = {}
    for part in filter(None, args.layers_for.split(";")):
        k, _, v = part.partition("=")
        per_kind[k.strip()] = _depths(v, f"--layers-for {k}")
    configs = (
        args.configs.split(",") if args.configs else [f"stage3_{d}" for d in args.dtypes.split(",")]
    )
    rows, raw, checks = [], {}, []

    def cfg_for(kind, sd, d, steps):
        return dict(
            kind=kind,
            layers=d,
            embd=args.embd,
            seq=args.seq,
            batch=args.batch,
            steps=steps,
            state_dtype=sd,
            param_dtype=args.param_dtype,
            ckpt=args.activation_checkpointing,
            offload_dir=args.offload_dir,
        )

    def run(name, kind, sd, d, steps=args.steps):
        reps = run_group(worker, args.world, cfg_for(kind, sd, d, steps), timeout=1800)
        hwm = max(r["hwm"] for r in reps)
        n = reps[0]["params"]
        print(
            f"  {name:12} layers {d:3}: {n / 1e6:.1f}M params, peak RSS/rank "
            f"{hwm / 2**20:.0f} MiB, step {statistics.median(r['step_s'] for r in reps):.3f} s",
            flush=True,
        )
        return n, hwm, reps

    for name in configs:
        kind, sd = _parse_config(name)
        pts = []
        for d in per_kind.get(kind, depths):
            pts.append(run(name, kind, sd, d))
            raw[f"{name}/{d}"] = pts[-1][2]
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
                "config": name,
                "peak_bytes_per_param": round(b, 3),
                "fixed_MiB": round(a / 2**20, 1),
                "capacity_Mparams": round(cap / 1e6, 1),
                "model_state_bytes_per_param": round(ms, 3),
                "step_s": round(statistics.median(r["step_s"] for r in r1), 3),
                "final_loss": round(statistics.mean(r["losses"][-1] for r in r1), 4),
            }
        )
    for ref in ("stage3_fp32", "ddp"):
        base = next((r for r in rows if r["config"] == ref), None)
        for r in rows:
            if base:
                r[f"capacity_vs_{ref}"] = round(r["capacity_Mparams"] / base["capacity_Mparams"], 3)
    ddp = next((r for r in rows if r["config"] == "ddp"), None)
    if args.check_x and ddp:
        want = args.check_x * ddp["capacity_Mparams"] * 1e6
        for name in configs:
            kind, sd = _parse_config(name)
            if kind != "offload":
                continue
            ds = per_kind.get(kind, depths)  # params = n(first) + per layer * (d - first)
            n_a, n_b = raw[f"{name}/{ds[0]}"][0]["params"], raw[f"{name}/{ds[-1]}"][0]["params"]
            per_layer = (n_b - n_a) / (ds[-1] - ds[0])
            d = ds[0] + math.ceil((want - n_a) / per_layer)
            n, hwm, reps = run(f"{name} x{args.check_x:g}", kind, sd, d)
            raw[f"{name}/check/{d}"] = reps
            checks.append(
                {
                    "config": name,
                    "layers": d,
                    "Mparams": round(n / 1e6, 1),
                    "vs_ddp_capacity": round(n / (ddp["capacity_Mparams"] * 1e6), 2),
                    "peak_MiB": round(hwm / 2**20, 1),
                    "within_budget": hwm <= args.budget_mib * 2**20,
                    "step_s": round(statistics.median(r["step_s"] for r in reps), 2),
                    "final_loss": round(statistics.mean(r["losses"][-1] for r in reps), 4),
                }
            )
        print(markdown_table(checks, list(checks[0])) if checks else "")
    keys = list(rows[0])
    print(markdown_table(rows, keys))
    payload = {
        "machine": machine(),
        "command": " ".join([sys.executable, *sys.argv]),
        "args": vars(args),
        "raw": raw,
        "checks": checks,
        "budget_MiB": args.budget_mib,
    }
    name = f"state_capacity_{args.tag}" if args.tag else "state_capacity"
    write_results(args.out, name, payload, rows)


if __name__ == "__main__":
    main()
