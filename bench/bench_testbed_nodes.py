"""Bytes per node over the namespace testbed's link at several ranks per node, against the
estimator (`zero_kernels.tools.estimate_links.cross_node`, what `zero-kernels estimate --nodes`
prints).

    python bench/bench_testbed_nodes.py [--nodes 2] [--ranks-per-node 4] [--rate 1gbit]
        [--steps 2] [--warmup 1] [--size small] [--cands stage3,stage3_ring,...] [--out FILE]

Needs root (`zero_kernels.tools.testbed`). The demo's GPT (``--size``, fp32, AdamW, 4 sequences
per rank per step) in fresh torchrun ranks for each candidate; tc's counters between two marks
around the measured steps give each node's bytes sent over the link per step (payload and
Ethernet/IP/TCP headers, ~4.7%), beside the estimator's payload for the same configuration and
the bytes the ranks counted as sent across nodes (``comm_ledger``'s ``cross_node_bytes``).

Candidates (every one ``ZeroOptimizer(model, AdamW, policy=ZeroPolicy.resolve(...))``):
    stage3            stage 3, the default algorithm choice (across hosts: by the bytes on the
                      link, [Note: link-aware choice] in zero_kernels/comm/choose.py)
    stage3_ring       stage 3 with ZERO_KERNELS_COMM_ALGO=ring
    stage3_pairwise   stage 3 with ZERO_KERNELS_COMM_ALGO=pairwise (what the probe picked before)
    stage3_zpp        stage 3, secondary_shard="node" + int8 weights + int4 gradients (two hops)
    stage3_zpp8       the same with int8 gradients
    stage2            stage 2, default choice
    stage2_g8         stage 2 with int8 gradients (two hops across the nodes)
    stage2_g8_1hop    the same in one hop (ZERO_KERNELS_GRAD_HOPS=1)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
# candidate -> (policy options, environment, the estimator's row)
CANDIDATES = {
    "stage3": ({"stage": 3}, {}, "stage 3"),
    "stage3_ring": ({"stage": 3}, {"ZERO_KERNELS_COMM_ALGO": "ring"}, "stage 3"),
    "stage3_pairwise": ({"stage": 3}, {"ZERO_KERNELS_COMM_ALGO": "pairwise"}, None),
    "stage3_zpp": (
        {
            "stage": 3,
            "secondary_shard": "node",
            "quantize_weights": "int8",
            "quantize_grads": "int4",
        },
        {},
        "stage 3, secondary_shard=node + int8 weights + int4 grads",
    ),
    "stage3_zpp8": (
        {
            "stage": 3,
            "secondary_shard": "node",
            "quantize_weights": "int8",
            "quantize_grads": "int8",
        },
        {},
        "stage 3, secondary_shard=node + int8 weights + int8 grads",
    ),
    "stage2": ({"stage": 2}, {}, "stage 2"),
    "stage2_g8": ({"stage": 2, "quantize_grads": "int8"}, {}, "stage 2, int8 grads"),
    "stage2_g8_1hop": (
        {"stage": 2, "quantize_grads": "int8"},
        {"ZERO_KERNELS_GRAD_HOPS": "1"},
        "stage 2, int8 grads",
    ),
}
HEADERS = 1.047  # tc's count over the payload at an MTU of 1500 (docs/topology.md)


def _worker(args) -> None:
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from zero_kernels import ZeroOptimizer, comm
    from zero_kernels.policy import ZeroPolicy
    from zero_kernels.tools import testbed
    from zero_kernels.tools.models import build_gpt, get_batch, load_corpus

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=300))
    rank, world = dist.get_rank(), dist.get_world_size()
    per_node = int(os.environ["LOCAL_WORLD_SIZE"])
    torch.manual_seed(0)
    model = build_gpt(args.size)
    n_params = sum(p.numel() for p in model.parameters())
    options = CANDIDATES[args.worker][0]
    opt = ZeroOptimizer(
        model, torch.optim.AdamW, policy=ZeroPolicy.resolve(**options), lr=1e-3, weight_decay=0.01
    )
    data = load_corpus()
    block = model.cfg.block_size
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            testbed.mark("start")
        x, y = get_batch(data, 4, block, seed=0, step=step, rank=rank)
        opt.zero_grad(set_to_none=True)
        model(x, y).backward()
        opt.step()
    testbed.mark("end")
    cross = sum(e["cross_node_bytes"] for e in opt.comm_ledger[-args.steps :])
    crosses = comm.all_gather_object(cross)
    if rank == 0:
        out = {
            "cand": args.worker,
            "params": n_params,
            "ranks": world,
            "ranks_per_node": per_node,
            "counted_bytes_per_node_per_step": [
                sum(crosses[k * per_node : (k + 1) * per_node]) / args.steps
                for k in range(world // per_node)
            ],
            "choices": {k: list(v) for k, v in opt.comm_stats["choices"].items()},
        }
        with open(os.path.join(testbed.out_dir(), "result.json"), "w") as f:
            json.dump(out, f)
    opt.close()
    dist.barrier()
    comm.exit_process(0)  # [Note: leaving a rank] in zero_kernels/comm


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--ranks-per-node", type=int, default=4)
    p.add_argument("--rate", default="1gbit")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--size", default="small", help="the demo GPT's size (default small)")
    p.add_argument("--cands", default=",".join(CANDIDATES))
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per run")
    p.add_argument("--out", default=None)
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        _worker(args)
        return 0
    from zero_kernels.tools import testbed as tb
    from zero_kernels.tools.estimate_links import cross_node

    cands = args.cands.split(",")
    bad = [c for c in cands if c not in CANDIDATES]
    if bad:
        p.error(f"--cands: unknown {bad}; choose from {list(CANDIDATES)}")
    why = tb.why_not()
    if why:
        print(f"no testbed here: {why}", file=sys.stderr)
        return 77
    worker = ["--steps", args.steps, "--warmup", args.warmup, "--size", args.size]
    rows = []
    with tb.Testbed(args.nodes, rate=args.rate) as bed:
        for c in cands:
            t0 = time.monotonic()
            res = bed.run(
                __file__,
                ["--worker", c, *worker],
                ranks_per_node=args.ranks_per_node,
                timeout=args.timeout,
                env=CANDIDATES[c][1],
            )
            if not res.ok:
                tail = "\n".join(n.log[-2500:] for n in res.nodes)
                raise SystemExit(f"{c} failed (exit codes {res.exit_codes}):\n{tail}")
            with open(os.path.join(res.out_dir, "result.json")) as f:
                r = json.load(f)
            link = res.between("start", "end")
            r["sent_bytes_per_node_per_step"] = [b.sent / args.steps for b in link]
            label = CANDIDATES[c][2]
            hops = int(CANDIDATES[c][1].get("ZERO_KERNELS_GRAD_HOPS", 0)) or "auto"
            est = {
                x["config"]: x["bytes"]
                for x in cross_node(r["params"], args.nodes, args.ranks_per_node, grad_hops=hops)
            }
            r["estimate_bytes_per_node_per_step"] = est.get(label)
            r["estimate_row"] = label
            r["wall_s"] = round(time.monotonic() - t0, 1)
            rows.append(r)
            tc = max(r["sent_bytes_per_node_per_step"])
            e = r["estimate_bytes_per_node_per_step"]
            print(
                f"{c}: tc {tc / 1e6:.2f} MB/node/step, counted "
                f"{max(r['counted_bytes_per_node_per_step']) / 1e6:.2f}, estimate "
                + (f"{e / 1e6:.2f} (tc / estimate {tc / e:.3f})" if e else "-")
                + f", {r['wall_s']} s",
                flush=True,
            )
    base = {r["cand"]: max(r["sent_bytes_per_node_per_step"]) for r in rows}
    print(f"\n{args.nodes} nodes x {args.ranks_per_node} ranks, {args.rate}, GPT {args.size}")
    print("| candidate | MB/node/step (tc) | counted | estimate | tc/estimate | vs stage3_ring |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        tc, e = max(r["sent_bytes_per_node_per_step"]), r["estimate_bytes_per_node_per_step"]
        ring = base.get("stage3_ring")
        counted = max(r["counted_bytes_per_node_per_step"])
        print(
            f"| {r['cand']} | {tc / 1e6:.2f} | {counted / 1e6:.2f}"
            f" | {e / 1e6 if e else float('nan'):.2f} | {tc / e if e else float('nan'):.3f} | "
            f"{tc / ring if ring else float('nan'):.3f} |"
        )
    out = args.out or os.path.join(
        HERE, "results", f"testbed_nodes_{args.nodes}x{args.ranks_per_node}.json"
    )
    os.makedirs(os.path.dirname(out), exist_ok=True)
    doc = {
        "bench": "testbed_nodes",
        "command": "python bench/bench_testbed_nodes.py " + " ".join(sys.argv[1:]),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
        "rows": rows,
    }
    with open(out, "w") as f:
        json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
