"""ZeRO stage 3 (issue 7, "Measured"): step time against FSDP2 and DeepSpeed ZeRO-3 at world
size 2, capacity (the largest GPT each stage trains under a per-rank memory limit) at 4 ranks,
and per-rank bytes against the formulas (tensor counts and peak RSS) at 4 ranks.

Part "timing" (world size 2, gloo on CPU, 1 thread per rank; zero_kernels.tools.models.GPT, every
candidate built from the same seed, trained on the same per-rank batches with the same AdamW
hyper-parameters):

    ddp                     DDP(gradient_as_bucket_view=True) + torch AdamW(fused=True)
    fsdp2_reshard           torch.distributed.fsdp.fully_shard on each block of model.blocks, then
    fsdp2_noreshard         the root (reshard_after_forward True / False), torch AdamW(fused=True)
                            (fused works on FSDP2's DTensor params on CPU)
    fsdp2_*_prefetch        the same plus explicit prefetch of the next block in forward and the
                            previous one in backward, with asynchronous all-gathers
                            (``_set_unshard_async_op(True)``: on CPU FSDP2's default all-gathers
                            are synchronous, so prefetching only overlaps with async_op)
    deepspeed_zero3         deepspeed.initialize, zero_optimization stage 3 (overlap_comm,
                            contiguous_gradients; DeepSpeed's default prefetch / persistence
                            settings), DeepSpeedCPUAdam(adamw_mode=True), DS_ACCELERATOR=cpu
    ours_reshard            ZeroOptimizer(model, AdamW, stage=3, reshard_after_forward=True,
    ours_noreshard          prefetch=1) / reshard_after_forward=False, prefetch=1 /
    ours_prefetch0          reshard_after_forward=True, prefetch=0 (what prefetch overlaps)
    ours_*native / _pairwise / _shm   (optional, --cands) the same with zero_kernels.comm's
                            algorithm pinned instead of probed
    ours_*_noshm            (optional) the same with the probe choosing among native, pairwise
                            and ring only (as before the shm algorithm)
    ours_*_check_first / _check_every   (optional) the same with check_order="first" / "every"
                            (default "pass")
    ours_*_onegroup         (optional) the same with the reduce-scatters on the main group (no
                            twin group: stage 3 before [Note: backward gathers])
    <any but deepspeed>_compile   (optional) the same with the model (DDP: the DDP module) run
                            through torch.compile (inductor); its ratios are to the _compile
                            variants of ddp / fsdp2_*

Every candidate runs in its own spawned process group (own 2 processes, own TCP store). All groups
are started first and stay alive; the parent runs one step of one group at a time (the others
block on a queue), in rounds whose order rotates (A B C .. / B C .. A / ...). Warm-up rounds are
excluded; medians over the measured rounds; a step's time is the slower rank's; "paired" ratios
are medians over rounds of the ratio of two candidates' steps in the same round. Exposed
communication per step: the union of every Python-level wait on a collective (torch's Work.wait,
which synchronous collectives call too) and the time from the last gradient produced to the end
of backward (where a post-accumulate-grad hook on the params fires at all: not for FSDP2's
DTensor params, whose collectives are all synchronous waits).

Part "capacity" (4 ranks): per-rank memory limit on peak RSS above the import baseline (RSS after
importing torch and the libraries, initialising the process group and `_warm_up`, which loads what
a first use would load lazily: torch._dynamo, ~150 MB, and the kernels' code pages). For each of
DDP and stages 1, 2, 3 the largest GPT depth (width fixed) that trains ``--cap-steps`` steps: every
trial in 4 fresh processes; a trial fits if max over ranks of (peak RSS - baseline) <= limit. A
watchdog in every rank ends a trial as soon as its VmHWM passes the limit (so failing trials are
cheap and never take the machine's memory). Depths are searched by bracketing: a first guess from
the formula, then points inside the bracket [largest fit, smallest fail] predicted by a line
through the measured peaks (bisection when there is no line yet), until the bracket is 1 wide.
Stage 3 builds the model on the meta device; DDP and stages 1, 2 build it normally.
``--cap-cands`` also takes ``stage3_prefetch0_inflight1`` (the leanest stage 3: no unit gathered
ahead, one reduce-scatter in flight; the knobs a user maximising model size would set).
``--cap-ckpt``: every candidate's GPT uses activation checkpointing (as the ZeRO paper's largest
runs did), so activations, which no stage shards, weigh less.

Part "memory" (4 ranks): a 67M-param MLP (8 x Linear(2896, 2896)) and the timing GPT: peak RSS
per rank above the import baseline, per phase (the high-water mark is reset at each phase start
through /proc/self/clear_refs, so each phase's own peak is exact), in bytes/param against the
formulas; and stage 3's tensor counts (memory_report(): params, grads, optimizer state, gathered
units' peak, communication buffers) against zero_kernels.tools.estimate's stage-3 figure.

    python bench/bench_stage3.py [--quick] [--out DIR] [--parts timing,capacity,memory]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("DS_ACCELERATOR", "cpu")

from torch import nn  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, ".."))

import harness  # noqa: E402
from harness import markdown_table, run_info, run_timing, write_results  # noqa: E402
from stage3_candidates import build, gpt_batch, gpt_cfg, import_libs  # noqa: E402
from stage3_memory import MiB, capacity_search, memory_rows  # noqa: E402

MB = 1e6


# ------------------------------------------------------------------------------------ timing


def _timing_model(name: str, args) -> nn.Module:
    from zero_kernels.tools.models import GPT

    return GPT(gpt_cfg(args.layers, args.d, args.heads, args.tokens))


def _timing_ready(name: str, opt) -> dict:
    return {
        "units": [n for n, _ in opt.parts.core.unit_modules] if name.startswith("ours") else None
    }


# the timing part's candidates, for harness.run_timing (module-level functions: spawn pickles them)
TIMING = dict(
    imports=import_libs, model=_timing_model, build=build, batch=gpt_batch, ready=_timing_ready
)


def summarize_timing(raw: dict, cands: list[str]) -> list[dict]:
    steps = raw["steps"]

    def per_round(name, key="step_s"):
        return harness.per_round(steps, name, key)

    def paired(name, other):
        return harness.paired(steps, name, other)

    fsdp = [c for c in cands if c.startswith("fsdp2")]
    best_fsdp = min(fsdp, key=lambda c: statistics.median(per_round(c))) if fsdp else None
    rows = []
    for name in cands:
        med = statistics.median(per_round(name))
        fin, su = raw["finals"][name], raw["setup"][name]
        sfx = "_compile" if name.endswith("_compile") else ""
        row = {
            "candidate": name,
            "median_step_s": round(med, 4),
            "min_step_s": round(min(per_round(name)), 4),
            # a _compile candidate against the peers' _compile variants
            "vs_ddp_paired": paired(name, "ddp" + sfx),
            "vs_fsdp2_reshard_paired": paired(name, "fsdp2_reshard" + sfx),
            "vs_fsdp2_noreshard_paired": paired(name, "fsdp2_noreshard" + sfx),
            "vs_best_fsdp2_paired": paired(name, best_fsdp) if best_fsdp else "",
            "fwd_s": round(statistics.median(per_round(name, "fwd_s")), 4),
            "bwd_s": round(statistics.median(per_round(name, "bwd_s")), 4),
            "opt_s": round(statistics.median(per_round(name, "opt_s")), 4),
            "exposed_comm_s": round(statistics.median(per_round(name, "exposed_comm_s")), 4),
            "fwd_wait_s": round(statistics.median(per_round(name, "fwd_wait_s")), 4),
            "bwd_wait_s": round(statistics.median(per_round(name, "bwd_wait_s")), 4),
            "opt_wait_s": round(statistics.median(per_round(name, "opt_wait_s")), 4),
            "peak_rss_MB": round(max(f["peak_rss"] for f in fin.values()) / MB, 1),
            "peak_minus_import_MB": round(
                max(fin[r]["peak_rss"] - su[r]["rss_after_import"] for r in fin) / MB, 1
            ),
            "last_loss_rank0": round(steps[name][-1][0]["loss"], 5),
            "n": len(steps[name]),
        }
        if name.startswith("ours"):
            cs = fin[0]["comm_stats"]
            row["own_exposed_comm_s"] = round(cs["exposed_comm_s"] / max(cs["steps"], 1), 4)
            row["all_gather_MB_per_step"] = round(
                cs["all_gather_bytes"] / max(cs["steps"], 1) / MB, 2
            )
            row["reduce_scatter_MB_per_step"] = round(
                cs["reduce_scatter_bytes"] / max(cs["steps"], 1) / MB, 2
            )
        rows.append(row)
    return rows, best_fsdp


# ------------------------------------------------------------------------------------ main


def main():
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--quick",
        action="store_true",
        help="smoke run (~6 min): tiny models, capacity of DDP and stage 3, 3 memory runs",
    )
    ap.add_argument("--out", default=os.path.join(HERE, "results"), help="folder for stage3_*.json")
    ap.add_argument("--parts", default="timing,capacity,memory")
    ap.add_argument("--tag", default="", help="suffix of the output names (e.g. a regime)")
    # timing
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--d", type=int, default=256)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=12, help="measured rounds")
    ap.add_argument("--bucket-mb", type=float, default=25.0)
    ap.add_argument(
        "--cands",
        default="ddp,fsdp2_reshard,fsdp2_noreshard,fsdp2_reshard_prefetch,"
        "fsdp2_noreshard_prefetch,deepspeed_zero3,ours_reshard,ours_noreshard,ours_prefetch0",
    )
    # capacity
    ap.add_argument("--cap-limit-mib", type=float, default=1024)
    ap.add_argument("--cap-d", type=int, default=512)
    ap.add_argument("--cap-heads", type=int, default=8)
    ap.add_argument("--cap-tokens", type=int, default=64)
    ap.add_argument("--cap-batch", type=int, default=1)
    ap.add_argument("--cap-steps", type=int, default=3)
    ap.add_argument("--cap-cands", default="ddp,stage1,stage2,stage3")
    ap.add_argument(
        "--cap-ckpt",
        action="store_true",
        help="capacity: the GPT recomputes each block in backward (activation checkpointing) "
        "for every candidate",
    )
    ap.add_argument(
        "--merge",
        action="store_true",
        help="capacity: keep the other candidates' searches already in the output file "
        "(to split the search over several runs)",
    )
    # memory
    ap.add_argument("--mlp-width", type=int, default=2896)
    ap.add_argument("--mlp-layers", type=int, default=8)
    ap.add_argument("--mlp-batch", type=int, default=16)
    ap.add_argument("--mem-steps", type=int, default=3)
    ap.add_argument("--mem-runs", default="", help="indices of the memory runs to do (default all)")
    ap.add_argument(
        "--malloc-mmap-threshold",
        type=int,
        default=None,
        help="set MALLOC_MMAP_THRESHOLD_ (bytes) for every rank: glibc then serves every "
        "allocation above it with its own mmap, given back to the OS when freed, instead of "
        "raising the threshold dynamically (up to 32 MiB) and keeping freed blocks in its heap",
    )
    args = ap.parse_args()
    if args.malloc_mmap_threshold is not None:  # read by glibc at the start of each rank
        os.environ["MALLOC_MMAP_THRESHOLD_"] = str(args.malloc_mmap_threshold)
    if args.quick:
        args.layers, args.d, args.heads, args.tokens, args.batch = 2, 64, 4, 32, 2
        args.warmup, args.repeats = 1, 2
        args.cap_limit_mib, args.cap_d, args.cap_tokens = 48, 128, 32
        args.mlp_width, args.mlp_layers = 512, 8
        args.mem_steps = args.cap_steps = 2
        if args.cap_cands == ap.get_default("cap_cands"):
            args.cap_cands = "ddp,stage3"
        if not args.mem_runs:
            args.mem_runs = "0,3,7"  # MLP: DDP and stage 3; GPT: stage 3
    parts = set(args.parts.split(","))
    tag = f"_{args.tag}" if args.tag else ""

    def log(msg):
        print(msg, flush=True)

    t_start = time.perf_counter()
    info = run_info("bench_stage3.py")
    config = {k: v for k, v in vars(args).items() if k not in ("out", "parts", "tag")}
    cands = args.cands.split(",")
    if "deepspeed_zero3" in cands and info["deepspeed"].startswith("not available"):
        log(f"[timing] DeepSpeed not measured: {info['deepspeed']}")
        cands.remove("deepspeed_zero3")

    if "timing" in parts:
        raw = run_timing(TIMING, args, cands, log)
        info["load_avg_after_timing"] = os.getloadavg()
        rows, best_fsdp = summarize_timing(raw, cands)
        psi = raw["setup"][cands[0]][0]["psi"]
        j, _ = write_results(
            args.out,
            f"stage3_timing{tag}",
            {
                "machine": info,
                "config": config,
                "world_size": 2,
                "params": psi,
                "best_fsdp2": best_fsdp,
                "ours": {n: raw["finals"][n][0] for n in cands if n.startswith("ours")},
                "units": {n: raw["setup"][n][0]["units"] for n in cands if n.startswith("ours")},
                "per_step": raw["steps"],
                "setup": raw["setup"],
            },
            rows,
        )
        log(f"[timing] {psi / 1e6:.2f}M params, world size 2; wrote {j}")
        log(
            markdown_table(
                rows,
                [
                    "candidate",
                    "median_step_s",
                    "vs_ddp_paired",
                    "vs_fsdp2_reshard_paired",
                    "vs_fsdp2_noreshard_paired",
                    "vs_best_fsdp2_paired",
                    "fwd_s",
                    "bwd_s",
                    "opt_s",
                    "exposed_comm_s",
                    "fwd_wait_s",
                    "bwd_wait_s",
                    "own_exposed_comm_s",
                    "peak_rss_MB",
                    "peak_minus_import_MB",
                    "last_loss_rank0",
                ],
            )
        )
    if "capacity" in parts:
        results = []
        cap_path = os.path.join(args.out, f"stage3_capacity{tag}.json")
        if args.merge and os.path.exists(cap_path):  # searches of earlier runs (one per run)
            import json

            with open(cap_path) as f:
                results = json.load(f)["searches"]
        for cand in args.cap_cands.split(","):
            res = capacity_search(cand, args, log)
            res["machine"] = dict(info, load_avg_after=os.getloadavg())
            res["config"] = {k: v for k, v in config.items() if k.startswith(("cap_", "bucket"))}
            results = [r for r in results if r["candidate"] != cand] + [res]
            log(
                f"[capacity] {cand}: {res['max_layers']} layers, {res['max_params'] / 1e6:.1f}M "
                f"params ({res['search_s']:.0f}s)"
            )
        order = ["ddp", "stage1", "stage2", "stage3"]
        results.sort(key=lambda r: order.index(r["candidate"]) if r["candidate"] in order else 9)
        ddp = next((r for r in results if r["candidate"] == "ddp"), None)
        rows = []
        for r in results:
            rows.append(
                {
                    "candidate": r["candidate"],
                    "max_layers": r["max_layers"],
                    "max_params_M": round(r["max_params"] / 1e6, 2),
                    "vs_ddp_params": round(r["max_params"] / ddp["max_params"], 2)
                    if ddp and ddp["max_params"]
                    else "",
                    "peak_above_base_MiB": round((r["peak_above_base_at_max"] or 0) / MiB, 1),
                    "first_fail_layers": r["first_fail_layers"],
                    "trials": len(r["trials"]),
                    "search_s": r["search_s"],
                }
            )
        j, _ = write_results(
            args.out,
            f"stage3_capacity{tag}",
            {"machine": info, "config": config, "world_size": 4, "searches": results},
            rows,
        )
        log(f"[capacity] limit {args.cap_limit_mib:.0f} MiB per rank, 4 ranks; wrote {j}")
        log(markdown_table(rows, list(rows[0])))
    if "memory" in parts:
        rss_rows, s3_rows, raw = memory_rows(args, log)
        mem_path = os.path.join(args.out, f"stage3_memory{tag}.json")
        for r in raw.values():
            r["machine"] = info
        if args.merge and os.path.exists(mem_path):  # runs of earlier invocations
            import json

            with open(mem_path) as f:
                old = json.load(f)
            key = lambda r: (r["model"], r["candidate"])  # noqa: E731
            new_keys = {key(r) for r in rss_rows}
            rss_rows = [r for r in old["rows"] if key(r) not in new_keys] + rss_rows
            s3_rows = [r for r in old["stage3_tensor_bytes"] if key(r) not in new_keys] + s3_rows
            raw = {**{k: v for k, v in old["trials"].items() if k not in raw}, **raw}
        j, _ = write_results(
            args.out,
            f"stage3_memory{tag}",
            {
                "machine": info,
                "config": config,
                "world_size": 4,
                "stage3_tensor_bytes": s3_rows,
                "trials": raw,
            },
            rss_rows,
        )
        log(f"[memory] wrote {j}")
        log(
            markdown_table(
                rss_rows,
                [
                    "model",
                    "candidate",
                    "params",
                    "peak_above_base_MB",
                    "bytes_per_param",
                    "formula_bytes_per_param",
                    "peak_vs_formula",
                    "formula_with_scratch_bpp",
                    "peak_vs_formula_with_scratch",
                    "peak_phase",
                    "end_rss_bpp",
                ],
            )
        )
        log(markdown_table(s3_rows, list(s3_rows[0])) if s3_rows else "")
    log(f"[stage3] done in {time.perf_counter() - t_start:.0f}s")


if __name__ == "__main__":
    main()
