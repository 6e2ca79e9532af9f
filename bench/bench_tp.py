"""ZeRO over tensor parallelism (issue 49, "Measured"): step time of ZeroOptimizer stages 1-3 over
a tensor-parallel GPT against FSDP2 + TP, side by side in one run, and their losses.

    torchrun --nproc_per_node 4 bench/bench_tp.py [--steps 4] [--rounds 5] [--config base|wide]
        [--candidates fsdp2_tp,zero3,...] [--out DIR]
    python bench/bench_tp.py --memory [--config base|wide] [--steps 3]    (no torchrun)

4 ranks = dp 2 x tp 2 (``init_device_mesh("cpu", (2, 2), ("dp", "tp"))``), gloo, 1 thread per
rank. The model: `zero_kernels.tools.tp_models.TPGPT` split by `parallelize_gpt` (sequence
parallel) over the tp dim; ``--config base`` (the first table: width 128, 8x64 tokens per dp
rank) or ``wide`` (width 512, 2x64 tokens: ~64x the dp bytes, params, per tp byte, activations).
Every candidate built from the same seed and trained on the same per-dp-rank batches with the
same AdamW hyper-parameters:

    fsdp2_tp       fully_shard on each block, then the root, mesh=mesh["dp"] (torchtitan's
                   composition), torch AdamW(fused=True) (it steps DTensor params on CPU)
    fsdp2_tp_keep  the same with reshard_after_forward=False (no all-gather in the backward)
    zero1/2/3      ZeroOptimizer(model, AdamW, policy=ZeroPolicy.resolve(stage=s),
                   process_group=mesh["dp"].get_group(), lr=...) (the fused sharded AdamW)
    zero3_keep     stage 3 with reshard_after_forward=False (the pair of fsdp2_tp_keep)

All candidates live in the same 4 processes; each round runs ``--steps`` steps of each, in an
order that rotates every round (A B C D / B C D A / ...); the first round is warm-up. A step's time
is the slowest rank's (a max all-reduce of each rank's time); the table gives the median over the
measured rounds and the paired ratios (median over rounds of the ratio in the same round) to
fsdp2_tp and to the stronger (faster) FSDP2 of each round. Losses: each candidate's first
``--steps`` losses against fsdp2_tp's (relative).

``--memory``: each candidate alone in 4 spawned processes: the peak RSS per rank (VmHWM, reset
before the model is built), its growth over the RSS before the build, and the bytes of params,
grads and optimizer state a rank holds after a step (before zero_grad) against the formula over
(params / tp) / dp.
"""

from __future__ import annotations

import argparse
import gc
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
# base: the table's first model; wide: 4x the width, a quarter of the tokens per dp rank, so
# that the dp traffic (params) per byte of tp traffic (activations) is ~64x base's
CONFIGS = {
    "base": (GPTConfig(vocab_size=256, block_size=64, n_layer=4, n_head=4, n_embd=128), 8),
    "wide": (GPTConfig(vocab_size=256, block_size=64, n_layer=4, n_head=8, n_embd=512), 2),
}
CFG, BATCH = CONFIGS["base"]
NAMES = ["fsdp2_tp", "fsdp2_tp_keep", "zero1", "zero2", "zero3", "zero3_keep"]
FSDP2 = ("fsdp2_tp", "fsdp2_tp_keep")


def build(name: str, mesh):
    torch.manual_seed(0)
    model = parallelize_gpt(TPGPT(CFG), mesh["tp"])
    if name in FSDP2:
        from torch.distributed.fsdp import fully_shard

        keep = name == "fsdp2_tp_keep"  # reshard_after_forward=False: no re-gather in backward
        for block in model.blocks:
            fully_shard(block, mesh=mesh["dp"], reshard_after_forward=not keep)
        fully_shard(model, mesh=mesh["dp"], reshard_after_forward=not keep)
        opt = torch.optim.AdamW(model.parameters(), lr=LR, fused=True)
    else:
        stage = int(name[4])
        # zero3_keep: reshard_after_forward=False, the pair of fsdp2_tp_keep
        kw = {"reshard_after_forward": False} if name.endswith("_keep") else {}
        opt = ZeroOptimizer(
            model,
            torch.optim.AdamW,
            policy=ZeroPolicy.resolve(stage=stage, **kw),
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


def _status_kb(key: str) -> int:
    """A ``/proc/self/status`` field in kB (VmRSS: resident now, VmHWM: its peak)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return 0


def _reset_peak() -> bool:
    """VmHWM back to the resident size now (Linux >= 4.0: ``clear_refs`` 5); False where it
    cannot be reset (then the peak counts from the process's start)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def local_elements(mesh) -> int:
    """This rank's elements of the TP model before dp sharding (its DTensors' local tensors)."""
    torch.manual_seed(0)
    m = parallelize_gpt(TPGPT(CFG), mesh["tp"])
    return sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in m.parameters())


def model_state_bytes(name: str, model, opt) -> int:
    """The bytes of params, grads and optimizer state this rank holds between steps: ours
    from ``memory_report()``; FSDP2's from the local tensors of its params (sharded over dp
    between steps), their grads and AdamW's moments."""
    if isinstance(opt, ZeroOptimizer):
        r = opt.memory_report()
        return r["param_bytes"] + r["grad_bytes"] + r["master_bytes"] + r["optim_state_bytes"]

    def nb(t) -> int:
        t = t.to_local() if hasattr(t, "to_local") else t
        return t.numel() * t.element_size()

    total = 0
    for p in model.parameters():
        total += nb(p) + (nb(p.grad) if p.grad is not None else 0)
        for v in opt.state.get(p, {}).values():
            if torch.is_tensor(v) and v.numel() > 1:  # not the step counter
                total += nb(v)
    return total


def formula_bytes(name: str, n: int, dp: int) -> float:
    """The stage's formula over this rank's local elements ``n`` / dp (fp32 params and grads,
    AdamW's two fp32 moments, no master): FSDP2 shards all three like stage 3."""
    stage = 3 if name in FSDP2 else int(name[4])
    return {1: 8 * n + 8 * n / dp, 2: 4 * n + 12 * n / dp, 3: 16 * n / dp}[stage]


def memory_worker(rank: int, name: str, config: str, steps: int, port: int, out: str) -> None:
    """One rank of the memory run of candidate ``name``, in 4 processes of its own."""
    global CFG, BATCH
    CFG, BATCH = CONFIGS[config]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=4)
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    n = local_elements(mesh)
    gc.collect()
    base = _status_kb("VmRSS")
    reset = _reset_peak()
    model, opt = build(name, mesh)
    dp_rank = mesh["dp"].get_local_rank()
    run_steps(model, opt, 0, steps - 1, dp_rank)
    x, y = batch(steps - 1, dp_rank)  # the last step's model state before zero_grad: with
    model(x, y).backward()  # the grads (FSDP2 frees its own at zero_grad, ours stay)
    opt.step()
    state = model_state_bytes(name, model, opt)
    opt.zero_grad()
    row = {
        "rank": rank,
        "peak_rss_mb": _status_kb("VmHWM") / 1024,
        "base_rss_mb": base / 1024,
        "peak_reset": reset,
        "model_state_mb": state / 2**20,
        "formula_mb": formula_bytes(name, n, 2) / 2**20,
        "local_params": n,
    }
    rows = [None] * 4
    dist.all_gather_object(rows, row)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(rows, f)
    if isinstance(opt, ZeroOptimizer):
        opt.close()
    dist.destroy_process_group()


def memory(args) -> None:
    """Peak RSS per rank and model-state bytes against the formula, each candidate alone in 4
    fresh processes (spawned here, one candidate after the other)."""
    import socket
    import tempfile

    import torch.multiprocessing as mp

    rows = {}
    for name in args.candidates:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        with tempfile.TemporaryDirectory() as d:
            out = os.path.join(d, "rows.json")
            mp.start_processes(
                memory_worker,
                args=(name, args.config, args.steps, port, out),
                nprocs=4,
                start_method="spawn",
            )
            with open(out) as f:
                rows[name] = json.load(f)
    params = sum(p.numel() for p in TPGPT(CFG).parameters())
    print(
        f"TPGPT {params / 1e6:.2f}M params ({args.config}: n_layer={CFG.n_layer}, "
        f"n_embd={CFG.n_embd}), dp 2 x tp 2, gloo, {args.steps} steps, each candidate alone in "
        f"4 processes; torch {torch.__version__}"
    )
    print(
        "| candidate | peak RSS per rank (MB, max) | peak - RSS before build (MB, max) | "
        "model state per rank (MB) | formula over (params/tp)/dp (MB) | ratio |"
    )
    print("|---|---|---|---|---|---|")
    for name, rs in rows.items():
        peak = max(r["peak_rss_mb"] for r in rs)
        grow = max(r["peak_rss_mb"] - r["base_rss_mb"] for r in rs)
        ms = max(r["model_state_mb"] for r in rs)
        fm = max(r["formula_mb"] for r in rs)
        print(f"| {name} | {peak:.0f} | {grow:.0f} | {ms:.2f} | {fm:.2f} | {ms / fm:.3f} |")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, f"bench_tp_memory_{args.config}.json"), "w") as f:
            json.dump(rows, f, indent=1)


def main() -> None:
    global CFG, BATCH
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--config", choices=sorted(CONFIGS), default="base")
    ap.add_argument("--candidates", default=",".join(NAMES), help="comma-separated")
    ap.add_argument(
        "--memory",
        action="store_true",
        help="run with python, not torchrun: peak RSS and model state per candidate, each "
        "alone in 4 spawned processes",
    )
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    CFG, BATCH = CONFIGS[args.config]
    args.candidates = args.candidates.split(",")
    if args.memory:
        memory(args)
        return
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp_rank = mesh["dp"].get_local_rank()
    names = args.candidates
    ref = next(n for n in names if n in FSDP2)
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
    fsdp = [n for n in names if n in FSDP2]
    # the stronger FSDP2 of each round (the faster of the reshard_after_forward settings)
    best = [min(step_times[f][r] for f in fsdp) for r in range(args.rounds)]
    rows = []
    for n in names:
        ratio = statistics.median(a / b for a, b in zip(step_times[n], step_times[ref]))
        vs_best = statistics.median(a / b for a, b in zip(step_times[n], best))
        err = max(abs(a - b) / abs(b) for a, b in zip(losses[n], losses[ref]))
        rows.append(
            {
                "candidate": n,
                "step_ms": round(1e3 * statistics.median(step_times[n]), 1),
                f"vs_{ref}": round(ratio, 3),
                "vs_best_fsdp2": round(vs_best, 3),
                f"loss_rel_diff_vs_{ref}": f"{err:.1e}",
            }
        )
    if dist.get_rank() == 0:
        params = sum(p.numel() for p in TPGPT(CFG).parameters())
        head = (
            f"TPGPT {params / 1e6:.2f}M params ({args.config}: n_layer={CFG.n_layer}, "
            f"n_embd={CFG.n_embd}, n_head={CFG.n_head}), batch {BATCH}x{CFG.block_size} per dp "
            f"rank, dp 2 x tp 2, gloo, {args.rounds} rounds x {args.steps} steps, "
            f"torch {torch.__version__}"
        )
        print(head)
        print(
            f"| candidate | step (ms) | vs {ref} (paired) | vs the stronger FSDP2 per round | "
            f"loss rel. diff vs {ref} |"
        )
        print("|---|---|---|---|---|")
        for row in rows:
            print(
                f"| {row['candidate']} | {row['step_ms']} | {row[f'vs_{ref}']} | "
                f"{row['vs_best_fsdp2']} | {row[f'loss_rel_diff_vs_{ref}']} |"
            )
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            name = "bench_tp.json" if args.config == "base" else f"bench_tp_{args.config}.json"
            with open(os.path.join(args.out, name), "w") as f:
                json.dump({"setup": head, "rows": rows, "losses": losses}, f, indent=1)
    for n in names:
        opt = built[n][1]
        if isinstance(opt, ZeroOptimizer):
            opt.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
