"""Collectives on gloo (issue 10): all_reduce against reduce-scatter and all-gather by each of
comm's algorithms (native = the backend's own, pairwise and ring over batch_isend_irecv, shm
through files in /dev/shm that every rank maps).

Spawned gloo ranks (torch.multiprocessing, 1 torch thread each), fp32 buffers of each size (the
full buffer: all_reduce's tensor, the reduce-scatter input, the all-gather output). Candidates
alternate A B C .. within every repeat; each call is fenced by a barrier, its time is the slower
rank's; medians over the repeats. Reduce-scatters average (``avg=True``, as the optimizer calls
them). Also records what the probe picks for each size with no override, and what probing every
size class of both operations costs.

    python bench/bench_comm.py [--world 2] [--sizes-mb 1,4,16,76] [--repeats 9] [--out DIR]
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time
import traceback
from datetime import timedelta

import torch
import torch.multiprocessing as mp

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, ".."))

from harness import machine, markdown_table, write_results  # noqa: E402

MB = 1e6
ALGOS = ("native", "pairwise", "ring", "shm")
CANDS = ["all_reduce"] + [f"{op}_{a}" for op in ("reduce_scatter", "all_gather") for a in ALGOS]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(comm, name: str, full, shard, ar) -> None:
    if name == "all_reduce":
        comm.all_reduce(ar)
        return
    op, algo = name.rsplit("_", 1)
    comm.set_algorithm(op, algo)
    if op == "reduce_scatter":
        comm.reduce_scatter(shard, full, avg=True).wait()
    else:
        comm.all_gather(full, shard).wait()


def worker(rank: int, world: int, port: int, args, q) -> None:
    import torch.distributed as dist

    from zero_kernels import comm

    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=300),
        )
        # the probe with no override: every size class of both operations, then the picks
        t0 = time.perf_counter()
        for c in range(6):
            nbytes = (16 << 10) << (2 * c)
            for op in ("reduce_scatter", "all_gather"):
                comm.choose_algorithm(op, nbytes)
        probe_s = time.perf_counter() - t0
        picks = {
            mb: {
                op: comm.choose_algorithm(op, int(mb * MB))
                for op in ("reduce_scatter", "all_gather")
            }
            for mb in args.sizes_mb
        }
        probes = {f"{op} {label}": v for (op, label), v in comm.probe_results().items()}
        times: dict = {}
        for mb in args.sizes_mb:
            numel = int(mb * MB) // 4 // world * world
            full = torch.randn(numel)
            shard = torch.empty(numel // world)
            ar = full.clone()

            for name in CANDS:  # warm-up
                comm.barrier()
                _run(comm, name, full, shard, ar)
            per = {name: [] for name in CANDS}
            for _ in range(args.repeats):
                for name in CANDS:
                    comm.barrier()
                    t = time.perf_counter()
                    _run(comm, name, full, shard, ar)
                    per[name].append(time.perf_counter() - t)
            times[mb] = per
        got = comm.gather_object(times, 0)
        if rank == 0:
            q.put(("ok", {"times": got, "picks": picks, "probe_s": probe_s, "probes": probes}))
        comm.barrier()
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001
        q.put(("error", f"rank {rank}:\n{traceback.format_exc()}"))


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--sizes-mb", default="1,4,16,76", help="full buffer sizes, MB (1e6 bytes)")
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    args = ap.parse_args()
    args.sizes_mb = [float(s) for s in args.sizes_mb.split(",")]
    info = machine()  # before the workers: the command and versions of this run

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(target=worker, args=(r, args.world, port, args, q), daemon=True)
        for r in range(args.world)
    ]
    t0 = time.perf_counter()
    for p in procs:
        p.start()
    status, payload = q.get(timeout=900)
    for p in procs:
        p.join(timeout=30)
    if status != "ok":
        raise SystemExit(payload)

    rows, raw = [], {}
    for mb in args.sizes_mb:
        per_rank = [t[mb] for t in payload["times"]]
        row = {"size_MB": mb, "numel": int(mb * MB) // 4 // args.world * args.world}
        for name in CANDS:
            slowest = [max(t[name][i] for t in per_rank) for i in range(args.repeats)]
            row[f"{name}_ms"] = round(statistics.median(slowest) * 1e3, 2)
            raw.setdefault(str(mb), {})[name] = [round(x * 1e3, 2) for x in slowest]
        ar = row["all_reduce_ms"]
        for op, short in (("reduce_scatter", "rs"), ("all_gather", "ag")):
            row[f"{short}_pairwise_vs_native"] = round(
                row[f"{op}_native_ms"] / row[f"{op}_pairwise_ms"], 2
            )
            row[f"{short}_auto"] = payload["picks"][mb][op]
        row["native_rs+ag_vs_all_reduce"] = round(
            (row["reduce_scatter_native_ms"] + row["all_gather_native_ms"]) / ar, 2
        )
        row["pairwise_rs+ag_vs_all_reduce"] = round(
            (row["reduce_scatter_pairwise_ms"] + row["all_gather_pairwise_ms"]) / ar, 2
        )
        row["shm_rs+ag_vs_all_reduce"] = round(
            (row["reduce_scatter_shm_ms"] + row["all_gather_shm_ms"]) / ar, 2
        )
        rows.append(row)

    wall = time.perf_counter() - t0
    meta = {
        "machine": info,
        "world": args.world,
        "backend": "gloo",
        "dtype": "float32",
        "repeats": args.repeats,
        "worker_torch_threads": 1,
        "loadavg_1_5_15_after": [round(x, 2) for x in os.getloadavg()],  # shared machine
        "timing": "barrier before each call; per repeat the slower rank; median over repeats",
        "probe_all_classes_s": round(payload["probe_s"], 3),
        "probes": payload["probes"],
        "wall_s": round(wall, 1),
        "slower_rank_ms_per_repeat": raw,
    }
    jpath, _ = write_results(
        args.out, f"comm_cpu_ws{args.world}" if args.world != 2 else "comm_cpu", meta, rows
    )
    keys = ["size_MB", "all_reduce_ms"]
    keys += [f"{op}_{a}_ms" for op in ("reduce_scatter", "all_gather") for a in ALGOS]
    keys += ["rs_auto", "ag_auto", "native_rs+ag_vs_all_reduce", "pairwise_rs+ag_vs_all_reduce"]
    keys += ["shm_rs+ag_vs_all_reduce"]
    print(markdown_table(rows, keys))
    print(
        f"\nprobe of every size class, both ops: {payload['probe_s']:.3f} s; wall {wall:.0f} s; "
        f"{jpath}"
    )


if __name__ == "__main__":
    main()
