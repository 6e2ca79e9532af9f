"""DDP, ZeRO stages 1-3 and FSDP2 (HSDP and plain) across the namespace testbed's nodes.

    python bench/bench_testbed.py [--rate 1gbit] [--nodes 2] [--ranks-per-node 2] [--steps 5]
        [--warmup 2] [--rounds 1] [--cands ddp_fused,ours_stage1,...] [--out FILE.json]

Needs root (`zero_kernels.tools.testbed`: network namespaces joined by a tbf-limited link, [Note:
the
testbed]). A GPT of 7.52M params (6 layers, d=320, 128 tokens, tied head), fp32, AdamW; every
candidate in fresh torchrun ranks on the testbed (candidates in turn, `--rounds` times over). For
each: seconds per step (per step the slowest rank, then the median over the measured steps after
`--warmup`), and MB per node per step over the link, from tc's counters between two marks around
the measured steps (`testbed.mark`; sent by the node, and received), beside the formula's bytes
and, for ours, the bytes the ranks themselves counted as sent across nodes (``comm_ledger``'s
``cross_node_bytes`` of the measured steps summed over a node's ranks: [Note: bytes by link] in
zero_kernels/comm/links.py).

Candidates:
    ddp_fused      DDP(gradient_as_bucket_view=True, 25 MB buckets) + torch AdamW(fused=True)
    ours_stage1/2/3  zero_kernels.ZeroOptimizer(model, AdamW, stage=1/2/3), default algorithm
                   choice (the probe runs on the testbed: shm is out, the ranks span 2 hosts)
    ours_stage2_node, ours_stage3_node  the same with shard_group="node" (hierarchical: sharded
                   within each node, the gradient shards all-reduced across nodes, as HSDP)
    ours_stage2_node_g8, ours_stage3_node_g8  shard_group="node" with quantize_grads="int8":
                   the hop across the nodes (the gradient shards' all-reduce) quantized, the
                   reduce-scatter inside the node exact ([Note: quantized two-hop])
    ours_stage3_q8  stage 3 with quantize_weights="int8" (its all-gathers carry int8 blocks
                   and their scales: the recorded collectives' bytes give the formula)
    ours_stage3_q8g8  the same and quantize_grads="int8" (the reduce-scatters an all-to-all of
                   int8 chunks, each rank's to each rank of the other node: R (N-R)/N of it)
    ours_stage3_hpz, ours_stage3_q8_hpz, ours_stage3_q8g8_hpz, ours_stage3_q8g4_hpz  stage 3
                   with secondary_shard="node" (ZeRO++'s hpZ: the backward's all-gathers inside
                   each node), plain / with int8 weights / and int8 or int4 grads
    fsdp2_hsdp     fully_shard per block and the root on a 2D mesh (replicate across nodes x shard
                   within one) + torch AdamW(fused=True), resharding after forward
    fsdp2          fully_shard over all ranks (1D mesh) + torch AdamW(fused=True), resharding
    ds_zero3, ds_zero3_hpz  DeepSpeed ZeRO-3 (DS_ACCELERATOR=cpu, its AdamW: FusedAdam on the
                   CPU), the second with zero_hpz_partition_size = ranks per node. Its quantized
                   options (zero_quantized_weights / _gradients) do not run on the CPU:
                   QuantizerBuilder().load() raises "This op had not been implemented on CPU
                   backend" (deepspeed 0.19.8)

[Note: the formula]
M = 4 Psi bytes (fp32 params, and as many gradient bytes); N = n_nodes x R ranks, node-major
(node k holds ranks kR .. kR + R - 1); bytes of payload per node per step, each way (tc counts
~4.7% more: Ethernet/IP/TCP headers and acknowledgements). Traffic between the ranks of a node
stays on it. Per collective over the whole group, of a full buffer of M bytes:

- ring (gloo's all-reduce and all-gather, ours `ring`): rank r sends to r + 1 only, so n_nodes of
  the N ring edges cross the link, one leaving each node. All-reduce: reduce-scatter then
  all-gather around the ring, 2 (N-1)/N M per edge; all-gather: (N-1)/N M per edge.
- pairwise (ours): every rank sends its M/N to (all-gather), or the owner's M/N chunk of its input
  to (reduce-scatter), each of the N - R ranks of the other nodes: R (N-R)/N M per node.
- gloo's native reduce_scatter_tensor: an all-reduce, then each rank keeps its chunk: 2 (N-1)/N M
  (measured on this testbed: 1.571 M per node at N = 4, against 0.785 M for a ring reduce-scatter;
  tc's 1.047 overhead included).

Per step: DDP one all-reduce of the gradients, 2 (N-1)/N M; ours stages 1 and 2 a reduce-scatter
of the gradients and an all-gather of the params, stage 3 an all-gather in the forward, another
in the backward and the reduce-scatter, each at the algorithm the probe chose for its size (the
bench records every collective's size and algorithm during the measured steps and sums their
bytes); FSDP2 over all ranks two gloo all-gathers and a gloo reduce-scatter, (N-1)/N M x 2 +
2 (N-1)/N M; HSDP gathers and reduce-scatters within the node and all-reduces its gradient shard
of M/R across the n_nodes ranks of its replicate group (a ring of n_nodes), 2 (n_nodes-1)/n_nodes
M/R per rank, R ranks per node: 2 (n_nodes-1)/n_nodes M. At 2 x 2 ranks: DDP 1.5 M, stage 1/2
2 M (pairwise) or 1.5 M (ring), stage 3 3 M (pairwise) or 2.25 M (ring), FSDP2 3 M, HSDP 1 M.
Small collectives (stage 3's order check, the loss scaler's flags, the marks' barriers) are left
out of the formula.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

from zero_kernels.policy import ZeroPolicy

HERE = os.path.dirname(os.path.abspath(__file__))
CANDIDATES = (
    "ddp_fused",
    "ours_stage1",
    "ours_stage2",
    "ours_stage3",
    "ours_stage2_node",
    "ours_stage3_node",
    "ours_stage2_node_g8",
    "ours_stage3_node_g8",
    "ours_stage3_q8",
    "ours_stage3_q8g8",
    "ours_stage3_hpz",
    "ours_stage3_q8_hpz",
    "ours_stage3_q8g8_hpz",
    "ours_stage3_q8g4_hpz",
    "fsdp2_hsdp",
    "fsdp2",
    "ds_zero3",
    "ds_zero3_hpz",
)
CFG = dict(n_layer=6, n_head=5, n_embd=320, block_size=128)  # 7.52M params


# -- the formula


def collective_factor(op: str, algo: str, n_ranks: int, per_node: int) -> float:
    """Bytes per node over the link per byte of the full buffer ([Note: the formula])."""
    n = n_ranks
    if op == "all_reduce" or (op == "reduce_scatter" and algo == "native"):
        return 2 * (n - 1) / n
    if algo in ("ring", "native"):  # gloo's all-gather is a ring
        return (n - 1) / n
    if algo in ("pairwise", "alltoall"):  # every rank to each rank of the other nodes
        return per_node * (n - per_node) / n
    raise ValueError(f"no formula for {op} with algorithm {algo!r} across nodes")


def expected_bytes(cand: str, m: float, n_nodes: int, per_node: int, launched=None) -> float:
    """Payload bytes per node per step of ``cand`` (``launched``: ours' (op, bytes, algorithm)
    per step)."""
    n = n_nodes * per_node
    if cand == "ddp_fused":
        return collective_factor("all_reduce", "ring", n, per_node) * m
    if cand.startswith("ds_zero3"):  # rings (tc's count matched it); hpZ: one gather crosses
        ag = collective_factor("all_gather", "ring", n, per_node)
        rs = collective_factor("reduce_scatter", "ring", n, per_node)
        return ((1 if cand.endswith("_hpz") else 2) * ag + rs) * m
    if cand == "fsdp2":
        ag = collective_factor("all_gather", "native", n, per_node)
        return (2 * ag + collective_factor("reduce_scatter", "native", n, per_node)) * m
    if cand == "fsdp2_hsdp":
        return 2 * (n_nodes - 1) / n_nodes * m
    if "_node" in cand:  # shard_group="node": as HSDP, plus any collective over all ranks
        q = (1 + 4 / 256) / 4 if cand.endswith("_g8") else 1.0  # the hop across quantized
        return 2 * (n_nodes - 1) / n_nodes * m * q + sum(
            nb * collective_factor(op, a, n, per_node) for op, nb, a in launched
        )
    return sum(nb * collective_factor(op, a, n, per_node) for op, nb, a in launched)


# -- on the testbed: one candidate in every rank


def _worker(args) -> None:
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from zero_kernels import comm
    from zero_kernels.tools import testbed
    from zero_kernels.tools.models import GPT, GPTConfig, get_batch, load_corpus

    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", timeout=timedelta(seconds=300))
    rank, world = dist.get_rank(), dist.get_world_size()
    per_node = int(os.environ["LOCAL_WORLD_SIZE"])
    torch.manual_seed(0)
    model = GPT(GPTConfig(**CFG))
    n_params = sum(p.numel() for p in model.parameters())
    kw = dict(lr=1e-3, weight_decay=0.01)
    cand = args.worker
    launched: list = []
    recording = [False]
    if cand == "ddp_fused":
        from torch.nn.parallel import DistributedDataParallel as DDP

        run = DDP(model, bucket_cap_mb=25, gradient_as_bucket_view=True)
        opt = torch.optim.AdamW(model.parameters(), fused=True, **kw)
    elif cand.startswith("fsdp2"):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        if cand == "fsdp2_hsdp":  # rows: nodes (replicate), columns: a node's ranks (shard)
            mesh = init_device_mesh(
                "cpu", (world // per_node, per_node), mesh_dim_names=("replicate", "shard")
            )
        else:
            mesh = init_device_mesh("cpu", (world,))
        for b in model.blocks:
            fully_shard(b, mesh=mesh)
        fully_shard(model, mesh=mesh)
        run = model
        opt = torch.optim.AdamW(model.parameters(), fused=True, **kw)
    elif cand.startswith("ds_zero3"):
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        import deepspeed

        z = {"stage": 3}
        if cand.endswith("_hpz"):
            z["zero_hpz_partition_size"] = per_node
        cfg = {
            "train_micro_batch_size_per_gpu": args.batch,
            "optimizer": {"type": "AdamW", "params": dict(kw)},
            "zero_optimization": z,
        }
        engine, *_ = deepspeed.initialize(
            model=model, model_parameters=model.parameters(), config=cfg
        )

        class _DS:  # the loop's calls, on the engine
            def __call__(self, x, y):
                loss = engine(x, y)
                loss.backward = lambda: engine.backward(loss)
                return loss

            def zero_grad(self, set_to_none=True):
                pass  # the engine zeroes after its step

            def step(self):
                engine.step()

        run = opt = _DS()
    elif cand.startswith("ours_stage"):
        from zero_kernels import ZeroOptimizer

        choose = comm.choose_algorithm

        def recorded(op, nbytes, **kwargs):  # what every collective of ours used
            algo = choose(op, nbytes, **kwargs)
            if recording[0] and comm.world_size(kwargs.get("group")) == world:  # across nodes
                launched.append((op, nbytes, algo))
            return algo

        comm.choose_algorithm = recorded
        rsq = comm.quant.reduce_scatter_quantized

        def recorded_rsq(output, input, **kwargs):  # quantize_grads: an all-to-all, no choice
            h = rsq(output, input, **kwargs)
            if recording[0] and comm.world_size(kwargs.get("group")) == world:
                sent = h.inner.tensors[1] if hasattr(h, "inner") else None
                if sent is not None:
                    launched.append(("all_to_all", sent.numel(), "alltoall"))
            return h

        comm.quant.reduce_scatter_quantized = recorded_rsq
        stage = int(cand[len("ours_stage")])
        sg = "node" if "_node" in cand else "world"
        qw = "int8" if "_q8" in cand else None
        qg = "int8" if "g8" in cand else "int4" if "g4" in cand else None
        ss = "node" if cand.endswith("_hpz") else None
        opt = ZeroOptimizer(
            model,
            torch.optim.AdamW,
            policy=ZeroPolicy.resolve(
                stage=stage,
                shard_group=sg,
                quantize_weights=qw,
                quantize_grads=qg,
                secondary_shard=ss,
            ),
            **kw,
        )
        run = model
    else:
        raise ValueError(f"--worker must be one of {CANDIDATES}; got {cand!r}")

    data = load_corpus()
    times, losses = [], []
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            testbed.mark("start")
            recording[0] = True
        x, y = get_batch(data, args.batch, CFG["block_size"], seed=0, step=step, rank=rank)
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = run(x, y)
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
    recording[0] = False
    testbed.mark("end")
    every = comm.all_gather_object(times[args.warmup :])
    # ours: what the ranks counted as sent across nodes ([Note: bytes by link]), the measured steps
    cross = (
        sum(e["cross_node_bytes"] for e in opt.comm_ledger[-args.steps :])
        if (cand.startswith("ours_stage"))
        else None
    )
    crosses = comm.all_gather_object(cross)
    if rank == 0:
        slowest = [max(col) for col in zip(*every)]
        m = 4.0 * n_params
        per_step = [(op, nb, a) for op, nb, a in launched[: len(launched) // args.steps]]
        if launched and len(launched) % args.steps:
            raise AssertionError(f"{len(launched)} collectives over {args.steps} steps")
        out = {
            "cand": cand,
            "params": n_params,
            "ranks": world,
            "ranks_per_node": per_node,
            "step_s": slowest,
            "median_step_s": statistics.median(slowest),
            "losses": losses,
            "expected_bytes_per_node_per_step": expected_bytes(
                cand, m, world // per_node, per_node, per_step
            ),
            "launched_per_step": per_step,
            "counted_bytes_per_node_per_step": None
            if cross is None
            else [
                sum(crosses[k * per_node : (k + 1) * per_node]) / args.steps
                for k in range(world // per_node)
            ],
            "probe": {f"{op} {c}": r for (op, c), r in comm.probe_results().items()},
        }
        with open(os.path.join(testbed.out_dir(), "result.json"), "w") as f:
            json.dump(out, f)
    if cand.startswith("ours_stage"):
        opt.close()
    dist.barrier()
    # the results are written: leave without the interpreter's teardown, where gloo's worker
    # threads can abort the process ([Note: leaving a rank] in zero_kernels/comm)
    comm.exit_process(0)


# -- the controller


def _busy_cpu_s() -> float:
    """CPU seconds the whole machine has spent busy (every process, /proc/stat)."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    idle = v[3] + (v[4] if len(v) > 4 else 0)  # idle + iowait
    return (sum(v[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def _own_cpu_s() -> float:
    """CPU seconds of this process and of every descendant it reaped (the nodes' trees: each
    parent in them waits for its children)."""
    import resource

    s, c = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return s.ru_utime + s.ru_stime + c.ru_utime + c.ru_stime


def summarize(rows: dict, cands) -> list[dict]:
    """Per candidate, medians over the rounds: the step time, the bytes (the larger of the
    nodes'), the formula's bytes and measured / formula, each round against its own formula (the
    probe, which times the algorithms, may choose differently from one run to the next)."""
    summary = []
    for c in cands:
        rs = rows[c]
        sent = [max(r["sent_bytes_per_node_per_step"]) for r in rs]
        recv = [max(r["received_bytes_per_node_per_step"]) for r in rs]
        formula = [r["expected_bytes_per_node_per_step"] for r in rs]
        counted = [max(r.get("counted_bytes_per_node_per_step") or [0]) for r in rs]
        summary.append(
            {
                "cand": c,
                "median_step_s": statistics.median(r["median_step_s"] for r in rs),
                "step_s_per_round": [r["median_step_s"] for r in rs],
                "mb_sent_per_node_per_step": statistics.median(sent) / 1e6,
                "mb_received_per_node_per_step": statistics.median(recv) / 1e6,
                "mb_formula_per_node_per_step": statistics.median(formula) / 1e6,
                "measured_over_formula": statistics.median(m / f for m, f in zip(sent, formula)),
                # comm_stats' cross_node_bytes (the ranks' own count), None for the peers
                "mb_counted_per_node_per_step": statistics.median(counted) / 1e6
                if all(counted)
                else None,
                "measured_over_counted": statistics.median(m / c for m, c in zip(sent, counted))
                if all(counted)
                else None,
                "mb_sent_per_round": [round(x / 1e6, 2) for x in sent],
                "mb_formula_per_round": [round(x / 1e6, 2) for x in formula],
                "algorithms_per_round": [
                    sorted({f"{op}:{a}" for op, _, a in r["launched_per_step"]}) for r in rs
                ],
                "others_cores_per_round": [r["others_cores"] for r in rs],
            }
        )
    return summary


def print_table(summary: list[dict]) -> None:
    head = f"{'candidate':<13}{'s/step':>8}{'(rounds)':>22}{'MB/node/step':>14}{'formula MB':>12}"
    print(head + f"{'ratio':>7}{'counted MB':>12}{'ratio':>7}")
    for s in summary:
        rounds = "/".join(f"{x:.2f}" for x in s["step_s_per_round"])
        counted = s.get("mb_counted_per_node_per_step")
        tail = f"{counted:>12.1f}{s['measured_over_counted']:>7.3f}" if counted else f"{'-':>12}"
        print(
            f"{s['cand']:<13}{s['median_step_s']:>8.3f}{rounds:>22}"
            f"{s['mb_sent_per_node_per_step']:>14.1f}{s['mb_formula_per_node_per_step']:>12.1f}"
            f"{s['measured_over_formula']:>7.3f}{tail}"
        )
    for s in summary:
        algos = s["algorithms_per_round"]
        if any(algos):
            print(f"  {s['cand']}: " + " | ".join(" ".join(a) for a in algos))


def _resummarize(path: str) -> int:
    """Recompute the summary of a saved run from its per-round rows (the file is rewritten)."""
    with open(path) as f:
        out = json.load(f)
    cands = [s["cand"] for s in out["summary"]]
    out["summary"] = summarize(out["runs"], cands)
    print_table(out["summary"])
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
    return 0


def _controller(args) -> int:
    sys.path.insert(0, os.path.dirname(HERE))
    from zero_kernels.cli.launch import machine
    from zero_kernels.tools import testbed as tb

    cands = args.cands.split(",")
    bad = [c for c in cands if c not in CANDIDATES]
    if bad:
        raise SystemExit(f"--cands: unknown {bad}; choose from {','.join(CANDIDATES)}")
    why = tb.unavailable()
    if why is not None:
        print(f"bench_testbed: skipped: {why}", file=sys.stderr)
        return tb.EXIT_UNAVAILABLE
    rows: dict = {c: [] for c in cands}
    load = {"before": os.getloadavg()}
    t_start = time.time()
    worker_args = ["--steps", args.steps, "--warmup", args.warmup, "--batch", args.batch]
    worker_args += ["--threads", args.threads]
    with tb.Testbed(args.nodes, rate=args.rate) as bed:
        for rnd in range(args.rounds):
            for c in cands:
                busy0, own0, t0 = _busy_cpu_s(), _own_cpu_s(), time.monotonic()
                res = bed.run(
                    __file__,
                    ["--worker", c, *worker_args],
                    ranks_per_node=args.ranks_per_node,
                    timeout=args.timeout,
                )
                wall = time.monotonic() - t0
                # what the machine's other users took meanwhile, in cores on average
                others = max(0.0, (_busy_cpu_s() - busy0) - (_own_cpu_s() - own0)) / wall
                if not res.ok:
                    tail = "\n".join(n.log[-2500:] for n in res.nodes)
                    raise SystemExit(f"{c} failed (exit codes {res.exit_codes}):\n{tail}")
                with open(os.path.join(res.out_dir, "result.json")) as f:
                    r = json.load(f)
                link = res.between("start", "end")
                r["sent_bytes_per_node_per_step"] = [b.sent / args.steps for b in link]
                r["received_bytes_per_node_per_step"] = [b.received / args.steps for b in link]
                r["round"] = rnd
                r["others_cores"] = round(others, 3)
                rows[c].append(r)
                mb = max(r["sent_bytes_per_node_per_step"]) / 1e6
                print(
                    f"round {rnd} {c:<12} {r['median_step_s']:.3f} s/step, {mb:.1f} MB/node/step"
                    f" (other users: {others:.2f} cores)",
                    flush=True,
                )
    load["after"] = os.getloadavg()
    others_all = [r["others_cores"] for c in cands for r in rows[c]]
    summary = summarize(rows, cands)
    print(
        f"\n{args.nodes} nodes x {args.ranks_per_node} ranks, link {tb.format_rate(bed.rate_bps)}, "
        f"{rows[cands[0]][0]['params'] / 1e6:.2f}M params fp32 AdamW, batch {args.batch} x "
        f"{CFG['block_size']} per rank, {args.steps} steps after {args.warmup}, "
        f"{args.rounds} round(s); load average {load['before'][0]:.2f} before, "
        f"{load['after'][0]:.2f} after (the bench's own ranks included); other users took "
        f"{max(others_all):.2f} cores at most (mean over a run), {statistics.mean(others_all):.2f}"
        " on average"
    )
    print_table(summary)
    out = {
        "command": " ".join([os.path.relpath(sys.argv[0]), *sys.argv[1:]]),
        "machine": machine(),
        "date": time.strftime("%Y-%m-%d %H:%M", time.localtime(t_start)),
        "seconds": round(time.time() - t_start, 1),
        "load_avg_1_5_15": load,
        "other_users_cores": {"max": max(others_all), "mean": statistics.mean(others_all)},
        "rate_bps": bed.rate_bps,
        "nodes": args.nodes,
        "ranks_per_node": args.ranks_per_node,
        "config": {**CFG, "batch": args.batch, "steps": args.steps, "warmup": args.warmup},
        "summary": summary,
        "runs": rows,
    }
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
        print(f"wrote {args.out}")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rate", default="1gbit", help="link rate (default 1gbit)")
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--ranks-per-node", type=int, default=2)
    p.add_argument("--steps", type=int, default=5, help="measured steps per run (default 5)")
    p.add_argument("--warmup", type=int, default=2, help="steps before them (default 2)")
    p.add_argument("--rounds", type=int, default=1, help="runs of every candidate (default 1)")
    p.add_argument("--batch", type=int, default=4, help="sequences per rank per step (default 4)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank (default 1)")
    p.add_argument("--cands", default=",".join(CANDIDATES))
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per run (default 600)")
    p.add_argument(
        "--out",
        default=os.path.join(HERE, "results", "testbed_2x2_1gbit.json"),
        help="JSON results (default bench/results/testbed_2x2_1gbit.json; '' for none)",
    )
    p.add_argument(
        "--resummarize", default=None, metavar="FILE", help="recompute a saved run's summary"
    )
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # inside the testbed
    args = p.parse_args(argv)
    if args.worker is not None:
        _worker(args)
        return 0
    if args.resummarize:
        return _resummarize(args.resummarize)
    return _controller(args)


if __name__ == "__main__":
    sys.exit(main())
