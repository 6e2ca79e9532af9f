"""Convergence of stage 3 with quantized weight all-gathers (issue 22, ``quantize_weights``).

Trains the demo's GPT (``zero-kernels demo`` defaults: size "small", AdamW lr 1e-3 and weight
decay 0.01, 8 sequences per rank per step, 1 MiB buckets, seed 0) on 2 spawned gloo ranks (one
thread each) with ``ZeroOptimizer(stage=3)`` in four runs on the same seed and the same batches:

    fp32 params            quantize_weights=None     and   "int8"
    bf16 params (.to(bf16)) quantize_weights=None     and   "int8"

Every step's loss (mean over the ranks) is recorded and checked finite. Reported per dtype: the
final loss (mean of the last 20 steps) of the quantized run relative to the unquantized one
(issue target: within 1%), the largest per-step relative loss difference, and the bytes
all-gathered per step (``opt.comm_stats["all_gather_bytes"] / steps``, counted from after
construction) with their ratio quantized / unquantized.

Resume check, fp32 + int8: train K steps, ``save_checkpoint`` into a temporary directory, build
a fresh model (other init seed) and optimizer, ``load_checkpoint``, train on to N, and compare
the continued steps' losses with those of the uninterrupted fp32 + int8 run (max relative
difference; batches are a pure function of the step, so the two see the same data).

    python bench/bench_quant_convergence.py [--steps 300] [--resume-at 150] [--seed 0]
        [--world 2] [--variant q8|hpz_q8_g4|hpz|g4|hpz_q8|...] [--dtypes fp32,bf16]
        [--out bench/results]

``--variant hpz_q8_g4`` (an even ``--world`` of 4 or more): the quantized runs are ZeRO++'s
three together, ``secondary_shard=2`` (hpZ over blocks of 2 ranks) with int8 weights and int4
gradients; the resume check runs in that configuration too. ``hpz``, ``g4`` and ``hpz_q8`` turn
on one part (or hpZ with int8 weights) to tell which one moves the loss; ``--dtypes fp32``
runs the fp32 pair only. ``jitter`` quantizes nothing: its second run starts from the same
weights with one ulp added to a random 1% of them, which measures how far training's own
sensitivity moves the final loss (the floor under any quantizer's band).

Writes OUT/quant_convergence.json and OUT/quant_convergence.png (loss curves per dtype); with
``--seed S`` (S != 0: another init and other batches, as the demo's ``--seed``) the files are
named quant_convergence_seedS.*, and ``--tag T`` appends T to the names; ``--resume-at 0``
skips the resume check.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import queue
import shutil
import socket
import sys
import tempfile
import time
import traceback
from datetime import timedelta

import torch
import torch.multiprocessing as mp

from zero_kernels.policy import ZeroPolicy

WORLD = 2  # default --world
LAST = 20  # final loss = mean of the last LAST steps
RUNS = [  # (name, dtype, quantize_weights)
    ("fp32", "fp32", None),
    ("fp32_int8", "fp32", "int8"),
    ("bf16", "bf16", None),
    ("bf16_int8", "bf16", "int8"),
]
DEMO = dict(size="small", lr=1e-3, weight_decay=0.01, batch_size=8, bucket_mb=1.0, seed=0)
# --variant: what the quantized runs turn on (the "int8" runs of RUNS)
VARIANTS = {
    "q8": {"quantize_weights": "int8"},
    # ZeRO++'s three together: hpZ over blocks of 2 ranks, int8 weights, int4 gradients
    "hpz_q8_g4": {"quantize_weights": "int8", "quantize_grads": "int4", "secondary_shard": 2},
    # each of the three alone, and hpZ with int8 weights: which one moves the loss
    "hpz": {"secondary_shard": 2},
    "g4": {"quantize_grads": "int4"},
    "hpz_q8": {"quantize_weights": "int8", "secondary_shard": 2},
    # the norms' and biases' params (< 1024 elements in the "small" GPT; the matrices have >= 16384)
    # kept whole (never gathered, so never quantized), as DeepSpeed's persistence threshold does
    "hpz_q8_pb": {"quantize_weights": "int8", "secondary_shard": 2, "persist_below": 1024},
    "hpz_q8_g4_pb": {
        "quantize_weights": "int8",
        "quantize_grads": "int4",
        "secondary_shard": 2,
        "persist_below": 1024,
    },
    # hpZ + int8 weights + int8 gradients: quantized weights and gradients, int8 both ways
    "hpz_q8_g8": {"quantize_weights": "int8", "quantize_grads": "int8", "secondary_shard": 2},
    # no quantization: the "quantized" run is the unquantized one with one ulp added to 1% of
    # the initial weights (`_jitter`), the spread of training itself that a 1% band sits in;
    # jitter2 and jitter3 pick other elements
    "jitter": {"_jitter": 1},
    "jitter2": {"_jitter": 2},
    "jitter3": {"_jitter": 3},
    # the same three with int4 gradient blocks of 16 elements instead of the default 32
    # (comm.quant.GRAD_BLOCK; keys starting with "_" are the bench's, not ZeroOptimizer's)
    "hpz_q8_g4_b16": {
        "quantize_weights": "int8",
        "quantize_grads": "int4",
        "secondary_shard": 2,
        "_int4_block": 16,
    },
    "hpz_q8_g4_ef": {
        "quantize_weights": "int8",
        "quantize_grads": "int4",
        "secondary_shard": 2,
        "grad_error_feedback": True,
    },
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _build(dtype: str, quant: str | None, init_seed: int, variant: str = "q8"):
    from zero_kernels.optimizer import ZeroOptimizer
    from zero_kernels.tools.models import build_gpt

    torch.manual_seed(init_seed)
    model = build_gpt(DEMO["size"])
    if dtype == "bf16":
        model = model.to(torch.bfloat16)
    options = dict(VARIANTS[variant]) if quant else {}
    if "_jitter" in options:
        _jitter(model, init_seed, options.pop("_jitter"))
    if "_int4_block" in options:
        from zero_kernels.comm import quant as comm_quant

        comm_quant.GRAD_BLOCK[4] = options.pop("_int4_block")
    opt = ZeroOptimizer(
        model,
        torch.optim.AdamW,
        policy=ZeroPolicy.resolve(stage=3, bucket_size_mb=DEMO["bucket_mb"], **options),
        lr=DEMO["lr"],
        weight_decay=DEMO["weight_decay"],
    )
    opt.reset_comm_stats()  # count the training steps' collectives only
    return model, opt


def _jitter(model, seed: int, which: int = 1) -> None:
    """One ulp (of the param's dtype) away from zero on a random 1% of every param's elements
    (``which`` picks another 1%)."""
    g = torch.Generator().manual_seed(10_000 * which + seed)
    with torch.no_grad():
        for p in model.parameters():
            bits = p.view(torch.int16 if p.element_size() == 2 else torch.int32).reshape(-1)
            pick = torch.rand(bits.numel(), generator=g) < 0.01
            bits[pick] += 1


def _train(
    model, opt, data, rank: int, start: int, stop: int, seed: int
) -> tuple[list[float], float]:
    """Steps start..stop-1; returns the losses (mean over ranks) and the seconds taken."""
    import torch.distributed as dist

    from zero_kernels.tools.models import get_batch

    block = model.cfg.block_size
    losses = []
    t0 = time.perf_counter()
    for step in range(start, stop):
        x, y = get_batch(data, DEMO["batch_size"], block, seed=seed, step=step, rank=rank)
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        lv = loss.detach().float().reshape(1).clone()
        dist.all_reduce(lv)
        losses.append(lv.item() / dist.get_world_size())
    return losses, time.perf_counter() - t0


def _worker(
    rank: int,
    steps: int,
    resume_at: int,
    ckpt_dir: str,
    seed: int,
    variant: str = "q8",
    dtypes: tuple = ("fp32", "bf16"),
) -> dict:
    from zero_kernels.checkpoint import load_checkpoint, save_checkpoint
    from zero_kernels.tools.models import load_corpus

    data = load_corpus()
    out: dict = {"runs": {}}
    for name, dtype, quant in RUNS:
        if dtype not in dtypes:
            continue
        model, opt = _build(dtype, quant, seed, variant)
        losses, secs = _train(model, opt, data, rank, 0, steps, seed)
        st = opt.comm_stats
        out["runs"][name] = {
            "dtype": dtype,
            "quantize_weights": quant,
            "losses": losses,
            "seconds": secs,
            "all_gather_bytes_per_step": st["all_gather_bytes"] / max(st["steps"], 1),
            "all_gather_calls_per_step": st["all_gather_calls"] / max(st["steps"], 1),
            "reduce_scatter_bytes_per_step": st["reduce_scatter_bytes"] / max(st["steps"], 1),
            "nonfinite_steps": st["nonfinite_steps"],
        }
        opt.close()
        del model, opt

    if not resume_at:
        return out
    # resume check in the fp32 + int8 configuration
    model, opt = _build("fp32", "int8", seed, variant)
    first, _ = _train(model, opt, data, rank, 0, resume_at, seed)
    save_checkpoint(ckpt_dir, model, opt)
    opt.close()
    del model, opt
    model, opt = _build("fp32", "int8", seed + 1, variant)  # other init: the load replaces it
    load_checkpoint(ckpt_dir, model, opt)
    rest, _ = _train(model, opt, data, rank, resume_at, steps, seed)
    out["resume"] = {"first": first, "rest": rest}
    return out


def _entry(rank: int, port: int, world: int, args: tuple, q) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=300),
        )
        q.put((rank, "ok", _worker(rank, *args)))
    except BaseException:
        q.put((rank, "err", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _spawn(args: tuple, timeout: float, world: int = WORLD) -> list[dict]:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(target=_entry, args=(r, port, world, args, q), daemon=True)
        for r in range(world)
    ]
    for p in procs:
        p.start()
    results: dict[int, dict] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(results) < world:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"ranks did not finish within {timeout:.0f} s")
            try:
                rank, status, payload = q.get(timeout=min(left, 5.0))
            except queue.Empty:
                if any(p.exitcode not in (None, 0) for p in procs):
                    raise RuntimeError("a rank died without reporting") from None
                continue
            if status != "ok":
                raise RuntimeError(f"rank {rank} failed:\n{payload}")
            results[rank] = payload
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.terminate()
    return [results[r] for r in range(world)]


def _rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


def _summarise(res: dict, steps: int, resume_at: int) -> dict:
    runs = res["runs"]
    for r in runs.values():
        r["all_finite"] = all(math.isfinite(v) for v in r["losses"])
        r["final_loss"] = sum(r["losses"][-LAST:]) / len(r["losses"][-LAST:])
    compare = {}
    for dtype in ("fp32", "bf16"):
        if dtype not in runs:
            continue
        base, q = runs[dtype], runs[f"{dtype}_int8"]
        compare[dtype] = {
            "final_loss_unquantized": base["final_loss"],
            "final_loss_int8": q["final_loss"],
            "final_rel_diff": (q["final_loss"] - base["final_loss"]) / base["final_loss"],
            "within_1pct": _rel(q["final_loss"], base["final_loss"]) <= 0.01,
            "max_step_rel_diff": max(_rel(a, b) for a, b in zip(q["losses"], base["losses"])),
            "all_gather_bytes_per_step_unquantized": base["all_gather_bytes_per_step"],
            "all_gather_bytes_per_step_int8": q["all_gather_bytes_per_step"],
            "all_gather_bytes_ratio": q["all_gather_bytes_per_step"]
            / base["all_gather_bytes_per_step"],
            "all_finite": base["all_finite"] and q["all_finite"],
        }
    if "resume" not in res:
        return {"compare": compare}
    ref = runs["fp32_int8"]["losses"]
    first, rest = res["resume"]["first"], res["resume"]["rest"]
    diffs = [_rel(a, b) for a, b in zip(rest, ref[resume_at:])]
    resume = {
        "resume_at": resume_at,
        "first_part_equal_to_uninterrupted": first == ref[:resume_at],
        "continued_steps": len(rest),
        "continued_max_rel_diff": max(diffs) if diffs else 0.0,
        "continued_bitwise_equal_steps": sum(a == b for a, b in zip(rest, ref[resume_at:])),
        "continued_all_finite": all(math.isfinite(v) for v in rest),
        "losses_continued": rest,
    }
    return {"compare": compare, "resume": resume}


def _plot(runs: dict, path: str, ranks: str = "2 gloo ranks", variant: str = "q8") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dtypes = [d for d in ("fp32", "bf16") if d in runs]
    fig, axes = plt.subplots(1, len(dtypes), figsize=(5.5 * len(dtypes), 4), sharey=True)
    axes = axes if len(dtypes) > 1 else [axes]
    for ax, dtype in zip(axes, dtypes):
        for name, style in ((dtype, "-"), (f"{dtype}_int8", "--")):
            r = runs[name]
            label = f"{dtype}, " + (variant if r["quantize_weights"] else "unquantized")
            ax.plot(range(1, len(r["losses"]) + 1), r["losses"], style, label=label, lw=1)
        ax.set_title(f"{dtype} params, stage 3, {ranks}")
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend()
    axes[0].set_ylabel("loss (mean over ranks)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--resume-at", type=int, default=None, help="default: steps // 2; 0: skip")
    ap.add_argument(
        "--seed", type=int, default=0, help="init and batch seed (the demo's --seed); default 0"
    )
    ap.add_argument("--tag", default="", help="suffix of the result files' names")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    ap.add_argument("--timeout", type=float, default=3600.0)
    ap.add_argument("--world", type=int, default=WORLD, help=f"gloo ranks (default {WORLD})")
    ap.add_argument(
        "--variant",
        default="q8",
        choices=sorted(VARIANTS),
        help="what the quantized runs turn on: q8 (int8 weights, default), hpz_q8_g4 "
        "(secondary_shard=2 + int8 weights + int4 grads; needs --world 4 or more, even), "
        "hpz_q8_g4_ef (the same with grad_error_feedback=True), or one part: hpz, g4, hpz_q8; "
        "jitter: no quantization, one ulp on 1%% of the initial weights (the noise floor)",
    )
    ap.add_argument("--dtypes", default="fp32,bf16", help="param dtypes run (default both)")
    args = ap.parse_args(argv)
    dtypes = tuple(args.dtypes.split(","))
    if not dtypes or any(d not in ("fp32", "bf16") for d in dtypes):
        ap.error(f"--dtypes: fp32 and/or bf16, got {args.dtypes!r}")
    if "secondary_shard" in VARIANTS[args.variant] and (args.world < 4 or args.world % 2):
        ap.error(f"--variant {args.variant} needs an even --world >= 4 (blocks of 2 ranks)")
    resume_at = args.resume_at if args.resume_at is not None else args.steps // 2
    if not 0 <= resume_at < args.steps or args.steps < LAST:
        ap.error(f"need {LAST} <= steps and 0 <= resume-at < steps")

    ckpt_dir = tempfile.mkdtemp(prefix="zk_quant_conv_")
    t0 = time.perf_counter()
    try:
        per_rank = _spawn(
            (args.steps, resume_at, ckpt_dir, args.seed, args.variant, dtypes),
            args.timeout,
            args.world,
        )
    finally:
        shutil.rmtree(ckpt_dir, ignore_errors=True)
    wall = time.perf_counter() - t0
    res = per_rank[0]  # losses are already means over ranks; rank 0's counters
    for name, r in res["runs"].items():  # the ranks agree on the mean losses
        assert r["losses"] == per_rank[1]["runs"][name]["losses"], name
    summary = _summarise(res, args.steps, resume_at)

    os.makedirs(args.out, exist_ok=True)
    doc = {
        "bench": "quant_convergence",
        "command": "python bench/bench_quant_convergence.py " + " ".join(sys.argv[1:]),
        "steps": args.steps,
        "world_size": args.world,
        "variant": {args.variant: VARIANTS[args.variant]},
        "threads_per_rank": 1,
        "demo_config": {**DEMO, "seed": args.seed},
        "final_loss_window": LAST,
        "wall_s": wall,
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor(),
            "cpus": os.cpu_count(),
            "torch": torch.__version__,
        },
        **summary,
        "runs": res["runs"],
    }
    stem = "quant_convergence" + (f"_seed{args.seed}" if args.seed else "") + args.tag
    with open(os.path.join(args.out, stem + ".json"), "w") as f:
        json.dump(doc, f, indent=1)
    _plot(res["runs"], os.path.join(args.out, stem + ".png"), f"{args.world} ranks", args.variant)

    print(f"steps {args.steps}, {args.world} gloo ranks, {args.variant}, wall {wall:.0f} s")
    print(
        "| params | final loss unquantized | final loss int8 | rel. diff | max per-step rel. "
        "diff | all-gather B/step unquantized | int8 | ratio | finite |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for dtype, c in summary["compare"].items():
        print(
            f"| {dtype} | {c['final_loss_unquantized']:.4f} | {c['final_loss_int8']:.4f} | "
            f"{100 * c['final_rel_diff']:+.3f}% | {100 * c['max_step_rel_diff']:.3f}% | "
            f"{c['all_gather_bytes_per_step_unquantized']:,.0f} | "
            f"{c['all_gather_bytes_per_step_int8']:,.0f} | {c['all_gather_bytes_ratio']:.3f} | "
            f"{c['all_finite']} |"
        )
    for name, r in res["runs"].items():
        print(f"  {name}: {r['seconds']:.1f} s, {r['seconds'] / args.steps * 1e3:.0f} ms/step")
    if "resume" not in summary:
        return 0
    rs = summary["resume"]
    print(
        f"resume at {resume_at}: first part equal {rs['first_part_equal_to_uninterrupted']}, "
        f"continued {rs['continued_steps']} steps, "
        f"max rel diff {rs['continued_max_rel_diff']:.3g}, "
        f"bitwise equal steps {rs['continued_bitwise_equal_steps']}/{rs['continued_steps']}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
