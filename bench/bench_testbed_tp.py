"""ZeRO over tensor parallelism on the two-node testbed: tp inside a node, dp across, so the bytes
on the link are dp's only; and the negative control, the mesh transposed (tp across the link).

    python bench/bench_testbed_tp.py [--nodes 2] [--ranks-per-node 2] [--tp 2] [--rate 1gbit]
        [--steps 2] [--warmup 1] [--cands zero1,zero2,zero3,fsdp2_tp]
        [--layouts tp_inside,tp_across] [--out FILE]

Needs root (`zero_kernels.tools.testbed`). One torchrun run on the testbed; in it, for each
layout, every candidate in turn builds the TP GPT of `zero_kernels.tools.tp_models`
(`parallelize_gpt`, sequence parallel, fp32, ``--size``), runs ``--warmup`` steps, then
``--steps`` steps between two marks (tc's counters: each node's bytes sent over the link,
payload plus Ethernet/IP/TCP headers, ~4.7%).

Layouts (torchrun numbers ranks node-major: node k holds ranks k R .. k R + R - 1;
``init_device_mesh`` lays ranks out row-major over its dims):
    tp_inside   init_device_mesh("cpu", (dp, tp), ("dp", "tp")): a tp group is R consecutive
                ranks' block of tp, inside a node; each dp group takes one rank of each tp
                block, across the nodes. The link carries dp's collectives only.
    tp_across   init_device_mesh("cpu", (tp, dp), ("tp", "dp")): the same mesh transposed; with
                dp = R the dp groups are the nodes and the tp groups cross the link.

Candidates (each dp over ``mesh["dp"]``, the model split over ``mesh["tp"]``):
    zero1/2/3   ZeroOptimizer(model, AdamW, policy=ZeroPolicy.resolve(stage=s),
                process_group=mesh["dp"].get_group())
    fsdp2_tp    fully_shard(block, mesh=mesh["dp"]) on each block, then the root; torch AdamW

Against what they should send:
    dp estimate the estimator's bytes per node per step for the stage's dp collectives
                (`zero_kernels.tools.estimate_links.cross_node`, ring collectives, fp32
                gradients) over each rank's local elements (what ZeRO shards: 1/tp of every
                split param, the whole of a replicated one; ``params/tp`` is the estimate's
                ``--tp`` figure), times the tp ranks of a node (each in a dp group of its own).
                FSDP2 is priced as stage 3 (two all-gathers and a reduce-scatter).
                The stage-3 rows count the root unit (embeddings, final norm, head) gathered
                twice; ZeroOptimizer and FSDP2 keep it gathered from forward to backward, so
                they send one gather of it less (``counted``: ZeroOptimizer's own ledger of
                its bytes across nodes).
    tp payload  the collectives over the tp group, counted in one warm-up step by a
                dispatch mode: DTensor's (functional collectives on the local tensors) and
                ZeroOptimizer's own (c10d: at stages 2-3 the deferred tp sums of Partial
                gradients, [Note: deferred tp sums]), priced as gloo sends them across a link
                with one rank of the group on each node (all-gather: its chunk to each of the
                g-1 others; all-reduce: ring, 2 (g-1)/g; reduce-scatter: gloo's is an
                all-reduce and a cut, 2 (g-1)/g too), times the ranks of a node. It must be ~0
                on the link with tp inside the nodes and is what the transposed control sends.

Output: the table (MB per node per step, the busier node's) and ``--out`` (default
bench/results/testbed_tp_<nodes>x<ranks>.json: every node's figures, the groups, the losses).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
CANDIDATES = ("zero1", "zero2", "zero3", "fsdp2_tp")
LAYOUTS = {"tp_inside": ("dp", "tp"), "tp_across": ("tp", "dp")}
SIZES = {  # name -> (GPTConfig kwargs, sequences per dp rank)
    "small": (dict(vocab_size=256, block_size=64, n_layer=4, n_head=4, n_embd=128), 8),
    "tiny": (dict(vocab_size=128, block_size=32, n_layer=2, n_head=2, n_embd=64), 16),
}


# -- counting tp's collectives


def _tp_counter():
    """A dispatch mode that sums, per collective and process group, the bytes of its inputs:
    the functional collectives DTensor's redistributions run on local tensors, and the c10d
    collectives (``dist.all_reduce`` and the like: ZeroOptimizer's deferred tp sums of
    ``Partial`` gradients, its norms and flags, FSDP2's and ZeroOptimizer's dp collectives);
    the caller keeps the tp group's."""
    import torch
    from torch.distributed import ProcessGroup
    from torch.distributed.distributed_c10d import _resolve_process_group
    from torch.distributed.tensor import DTensor
    from torch.utils._python_dispatch import TorchDispatchMode

    fc, c10d = torch.ops._c10d_functional, torch.ops.c10d
    funcol = {  # op -> (name, index of the group's name)
        fc.all_gather_into_tensor: ("all_gather", 2),
        fc.reduce_scatter_tensor: ("reduce_scatter", 3),
        fc.all_reduce: ("all_reduce", 2),
        fc.all_reduce_: ("all_reduce", 2),
        fc.all_to_all_single: ("all_to_all", 3),
    }
    c10d_ops = {  # op -> (name, index of the input, of the ProcessGroup)
        c10d.allreduce_: ("all_reduce", 0, 1),
        c10d._allgather_base_: ("all_gather", 1, 2),
        c10d._reduce_scatter_base_: ("reduce_scatter", 1, 2),
        c10d.broadcast_: ("broadcast", 0, 1),
    }

    def nbytes(t) -> int:
        ts = t if isinstance(t, (list, tuple)) else [t]
        return sum(x.numel() * x.element_size() for x in ts)

    class Counter(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.bytes: dict = {}  # (op, group_name, group_size, "funcol"|"c10d") -> bytes

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if any(issubclass(t, DTensor) for t in types):
                return NotImplemented  # let DTensor turn it into collectives on local tensors
            packet = getattr(func, "overloadpacket", None)
            key = None
            if packet in funcol:
                op, i = funcol[packet]
                pg = _resolve_process_group(args[i])
                key, n = (op, args[i], pg.size(), "funcol"), nbytes(args[0])
            elif packet in c10d_ops:
                op, i, j = c10d_ops[packet]
                pg = ProcessGroup.unbox(args[j])  # a ScriptObject here
                key, n = (op, pg.group_name, pg.size(), "c10d"), nbytes(args[i])
            if key is not None:
                self.bytes[key] = self.bytes.get(key, 0) + n
            return func(*args, **(kwargs or {}))

    return Counter()


def link_send_bytes(op: str, in_bytes: float, g: int) -> float:
    """What one rank sends of a collective of ``in_bytes`` of input over a gloo group of ``g``
    with one rank per node: an all-gather its chunk to the g-1 others, an all-reduce 2 (g-1)/g
    (ring), a reduce-scatter the same (gloo's ``reduce_scatter_tensor`` all-reduces the input
    and keeps its chunk), an all-to-all (g-1)/g, a broadcast at most its input."""
    return {
        "broadcast": in_bytes,
        "all_gather": (g - 1) * in_bytes,
        "reduce_scatter": 2 * (g - 1) / g * in_bytes,
        "all_reduce": 2 * (g - 1) / g * in_bytes,
        "all_to_all": (g - 1) / g * in_bytes,
    }[op]


# -- the ranks


def _build(cand: str, mesh, cfg):
    import torch

    from zero_kernels import ZeroOptimizer
    from zero_kernels.policy import ZeroPolicy
    from zero_kernels.tools.tp_models import TPGPT, parallelize_gpt

    torch.manual_seed(0)  # the same init on every rank: each tp rank keeps its slice
    model = parallelize_gpt(TPGPT(cfg), mesh["tp"])
    local = _local_elements(model)  # before FSDP2 shards them over dp
    if cand == "fsdp2_tp":
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False), local
    opt = ZeroOptimizer(
        model,
        torch.optim.AdamW,
        policy=ZeroPolicy.resolve(stage=int(cand[-1])),
        process_group=mesh["dp"].get_group(),
        lr=1e-3,
    )
    return model, opt, local


def _local_elements(model) -> int:
    from torch.distributed.tensor import DTensor

    return sum(
        (p.to_local() if isinstance(p, DTensor) else p).numel()
        for p in model.parameters()
        if p.requires_grad
    )


def _worker(args) -> None:
    """Every layout of ``args.worker`` (comma-separated) in turn, in these ranks; rank 0 writes
    {layout: ...} into the testbed's out folder (result.json)."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from zero_kernels import comm
    from zero_kernels.tools import testbed

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=300))
    out = {layout: _layout(layout, args) for layout in args.worker.split(",")}
    if dist.get_rank() == 0:
        with open(os.path.join(testbed.out_dir(), "result.json"), "w") as f:
            json.dump(out, f)
    dist.barrier()
    comm.exit_process(0)  # [Note: leaving a rank] in zero_kernels/comm


def _layout(layout: str, args) -> dict:
    """Every candidate on the mesh of ``layout``: its groups, and per candidate what the ranks
    counted (tp's payload, ZeroOptimizer's bytes across nodes); the link's bytes are read by
    the controller between the marks "<layout> <cand> start" and "... end"."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from zero_kernels import ZeroOptimizer, comm
    from zero_kernels.tools import testbed
    from zero_kernels.tools.models import GPTConfig

    rank, world = dist.get_rank(), dist.get_world_size()
    per_node = int(os.environ["LOCAL_WORLD_SIZE"])
    nodes = world // per_node
    node_of = [r // per_node for r in range(world)]  # torchrun: node-major ranks
    kwargs, batch = SIZES[args.size]
    cfg = GPTConfig(**kwargs)
    names = LAYOUTS[layout]
    shape = tuple(args.tp if n == "tp" else world // args.tp for n in names)
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    groups = {d: comm.all_gather_object(mesh[d].mesh.tolist()) for d in ("dp", "tp")}
    groups = {d: sorted({tuple(g) for g in gs}) for d, gs in groups.items()}
    out = {"mesh_dims": names, "mesh_shape": shape, "groups": groups, "cands": {}}
    out["groups_cross_nodes"] = {
        d: [len({node_of[r] for r in g}) > 1 for g in gs] for d, gs in groups.items()
    }
    tp_name = mesh["tp"].get_group().group_name
    dp_rank = mesh["dp"].get_local_rank()

    def step(model, opt, s: int) -> float:
        g = torch.Generator().manual_seed(1000 * s + dp_rank)  # a tp pair reads the same batch
        idx = torch.randint(0, cfg.vocab_size, (batch, cfg.block_size + 1), generator=g)
        loss = model(idx[:, :-1], idx[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad()
        return float(loss.detach())

    def per_node_sum(values) -> list:
        values = list(values)
        return [sum(v for v, n in zip(values, node_of) if n == k) for k in range(nodes)]

    for cand in args.cands.split(","):
        model, opt, local = _build(cand, mesh, cfg)
        counter = _tp_counter()
        losses = []
        with counter:  # warm-up step 0: tp's collectives counted (they are alike every step)
            losses.append(step(model, opt, 0))
        for s in range(1, args.warmup):
            losses.append(step(model, opt, s))
        testbed.mark(f"{layout} {cand} start")
        for s in range(args.warmup, args.warmup + args.steps):
            losses.append(step(model, opt, s))
        testbed.mark(f"{layout} {cand} end")
        tp_in = {k: v for k, v in counter.bytes.items() if k[1] == tp_name}
        counted = None
        if isinstance(opt, ZeroOptimizer):
            led = opt.comm_ledger[-args.steps :]
            counted = sum(e.get("cross_node_bytes", 0) for e in led) / args.steps
            opt.close()
        row = {
            "local_elements": local,
            "params": sum(p.numel() for p in model.parameters()),
            "tp_payload": {f"{op} g{g} {src}": b for (op, _, g, src), b in tp_in.items()},
            "tp_send": sum(link_send_bytes(op, b, g) for (op, _, g, _), b in tp_in.items()),
            "other_groups_bytes": sum(v for k, v in counter.bytes.items() if k[1] != tp_name),
            "counted": counted,
            "losses": losses,
        }
        rows = comm.all_gather_object(row)
        if rank == 0:
            c = {k: rows[0][k] for k in ("local_elements", "params", "tp_payload", "losses")}
            c["tp_send_bytes_per_node"] = per_node_sum(r["tp_send"] for r in rows)
            c["other_groups_bytes"] = max(r["other_groups_bytes"] for r in rows)
            c["counted_cross_bytes_per_node"] = (
                None if counted is None else per_node_sum(r["counted"] for r in rows)
            )
            out["cands"][cand] = c
        del model, opt
        dist.barrier()
    return out


# -- the controller


def dp_estimate(cand: str, local: int, nodes: int, ranks_per_node: int, tp: int) -> float:
    """Bytes per node per step of the dp collectives with tp inside the nodes: the estimator's
    row of the stage (`cross_node` over one rank's ``local`` elements, ranks_per_node / tp
    ranks of each dp group on a node, the node's tp ranks each in a dp group of its own)."""
    from zero_kernels.tools.estimate_links import cross_node

    row = "stage 3" if cand == "fsdp2_tp" else f"stage {cand[-1]}"
    rows = cross_node(local, nodes, ranks_per_node // tp, tp=tp)
    return {r["config"]: r["bytes"] for r in rows}[row]


def worker_args(steps: int, warmup: int, size: str, tp: int, cands: str, layouts: str) -> list:
    """The script's arguments for one testbed run of ``layouts`` (comma-separated)."""
    return ["--worker", layouts, "--steps", steps, "--warmup", warmup, "--size", size]  + [
        "--tp", tp, "--cands", cands,
    ]  # fmt: skip


def collect(res, steps: int, tp: int) -> dict:
    """{layout: ...} of a testbed run (`TestbedResult`): the ranks' counts, each candidate's
    link bytes per node per step between its marks and the estimator's dp bytes."""
    if not res.ok:
        tail = "\n".join(open(n.log).read()[-3000:] for n in res.nodes)
        raise RuntimeError(f"the run failed (exit codes {res.exit_codes}):\n{tail}")
    with open(os.path.join(res.out_dir, "result.json")) as f:
        runs = json.load(f)
    nodes, rpn = len(res.nodes), res.ranks_per_node
    for layout, r in runs.items():
        for cand, c in r["cands"].items():
            link = res.between(f"{layout} {cand} start", f"{layout} {cand} end")
            c["sent_bytes_per_node_per_step"] = [b.sent / steps for b in link]
            c["dp_estimate_bytes_per_node_per_step"] = dp_estimate(
                cand, c["local_elements"], nodes, rpn, tp
            )
            c["dp_estimate_params_over_tp"] = dp_estimate(
                cand, -(-c["params"] // tp), nodes, rpn, tp
            )
    return runs


def table(runs: dict, cands: list[str]) -> str:
    """The markdown table, MB per node per step (the busier node's)."""
    ins = runs.get("tp_inside", {}).get("cands", {})
    acr = runs.get("tp_across", {}).get("cands", {})
    lines = [
        "| candidate | link, tp inside | counted | dp estimate | link / estimate "
        "| link, transposed | tp payload across | transposed / tp payload "
        "| inside / transposed |",
        "|---|---|---|---|---|---|---|---|---|",
    ]

    def mb(x):
        return "" if x is None else f"{x / 1e6:.3f}"

    def ratio(x, y):
        return "" if x is None or not y else f"{x / y:.3f}"

    for c in cands:
        a, b = ins.get(c, {}), acr.get(c, {})
        sent_in = max(a["sent_bytes_per_node_per_step"]) if a else None
        counted = a.get("counted_cross_bytes_per_node")
        counted = max(counted) if counted else None
        est = a.get("dp_estimate_bytes_per_node_per_step")
        sent_x = max(b["sent_bytes_per_node_per_step"]) if b else None
        tp_x = max((b or a)["tp_send_bytes_per_node"]) if (a or b) else None
        cells = [mb(sent_in), mb(counted), mb(est), ratio(sent_in, est), mb(sent_x)]
        cells += [mb(tp_x), ratio(sent_x, tp_x), ratio(sent_in, sent_x)]
        lines.append(f"| {c} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--ranks-per-node", type=int, default=2)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--rate", default="1gbit")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--size", default="small", choices=list(SIZES))
    p.add_argument("--cands", default=",".join(CANDIDATES))
    p.add_argument("--layouts", default=",".join(LAYOUTS))
    p.add_argument("--timeout", type=float, default=400.0, help="seconds per run")
    p.add_argument("--out", default=None)
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        _worker(args)
        return 0
    cands = args.cands.split(",")
    bad = [c for c in cands if c not in CANDIDATES] + [
        x for x in args.layouts.split(",") if x not in LAYOUTS
    ]
    if bad:
        p.error(f"unknown {bad}; candidates {list(CANDIDATES)}, layouts {list(LAYOUTS)}")
    if args.ranks_per_node % args.tp or args.warmup < 1 or args.steps < 1:
        p.error("--tp must divide --ranks-per-node (tp inside a node); --warmup, --steps >= 1")
    from zero_kernels.tools import testbed as tb

    why = tb.why_not()
    if why:
        print(f"no testbed here: {why}", file=sys.stderr)
        return 77
    t0 = time.monotonic()
    res = tb.run(
        os.path.abspath(__file__),
        worker_args(args.steps, args.warmup, args.size, args.tp, args.cands, args.layouts),
        nodes=args.nodes,
        ranks_per_node=args.ranks_per_node,
        rate=args.rate,
        timeout=args.timeout,
    )
    runs = collect(res, args.steps, args.tp)
    print(f"one testbed run, {time.monotonic() - t0:.1f} s")
    for layout, r in runs.items():
        print(f"{layout}: groups {r['groups']}, cross nodes {r['groups_cross_nodes']}")
    print(
        f"\n{args.nodes} nodes x {args.ranks_per_node} ranks, tp {args.tp}, {args.rate}, "
        f"TP GPT {args.size}, {args.steps} measured steps"
    )
    print(table(runs, cands))
    out = args.out or os.path.join(
        HERE, "results", f"testbed_tp_{args.nodes}x{args.ranks_per_node}.json"
    )
    os.makedirs(os.path.dirname(out), exist_ok=True)
    model = ""
    try:
        with open("/proc/cpuinfo") as f:
            model = next((ln.split(":", 1)[1].strip() for ln in f if "model name" in ln), "")
    except OSError:
        pass
    import torch

    doc = {
        "bench": "testbed_tp",
        "command": "python bench/bench_testbed_tp.py " + " ".join(sys.argv[1:]),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "cpu": model,
            "torch": torch.__version__,
        },
        "runs": runs,
    }
    with open(out, "w") as f:
        json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
