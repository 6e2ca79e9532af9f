"""Checkpoint save/load (issue 9, "Measured"): ours, torch.save of a consolidated state, and
torch.distributed.checkpoint (DCP), side by side at world size 2, with the disk's write bandwidth
measured in the same run.

Model: `zero_kernels.tools.models` ``large`` (86M params, fp32), ZeroOptimizer stage 2 + AdamW
after one
step (params, exp_avg, exp_avg_sq: 1.03 GB of training state). Candidates, each a save and a load
of the same state on the same 2 gloo ranks (1 thread each), timed alternately (round k starts at
candidate k), every call fenced by barriers, its time the slower rank's, medians over rounds:

    ours        zero_kernels.save_checkpoint / load_checkpoint: each rank writes its pieces
                (safetensors), rank 0 meta.json; load verifies every sha256 (split over the
                ranks) and reads each rank's ranges back into the optimizer, then all-gathers
    torch_save  opt.consolidated_state_dict(to=0) + model.state_dict() -> torch.save on rank 0
                (fsync'ed); load: torch.load(weights_only=True) on every rank, then
                opt.load_state_dict (reshards the consolidated state) + model.load_state_dict
    dcp         torch.distributed.checkpoint.save/load (FileSystemWriter/Reader, its default
                planner) of the same pieces as 1-D ShardedTensors per param (values, exp_avg,
                exp_avg_sq at their element offsets, so DCP could reshard them), ``step`` one
                plain tensor per piece; load writes into the optimizer's own tensors, then
                all-gathers

    disk        the floor, a candidate like the others: every rank writes as many bytes as its
                shard (params + exp_avg + exp_avg_sq) in 16 MiB writes, fsync, rename, all at
                once; load reads them back. Each save's fraction of this bandwidth is reported.

Loads read files just written: from the page cache (the machine is shared; no cache is dropped),
so load times measure the software path, not the disk.

Then rank 0 exports the last checkpoint of ours to one consolidated safetensors file
(`zero_kernels.checkpoint.export_model`, what ``zero-kernels checkpoint export`` runs): its time and
peak extra memory against the model's size.

Peak extra memory per rank: a thread samples /proc/self/status every 2 ms during the call;
reported is the largest increase of RssAnon (allocated memory; mapped file pages excluded) and of
VmRSS (incl. file pages mapped by mmap readers) over the value before the call, the larger rank.

    python bench/bench_checkpoint.py [--rounds 3] [--model large] [--out bench/results]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time

import torch
import torch.multiprocessing as mp

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, ".."))

from harness import machine, markdown_table, write_results  # noqa: E402

KINDS = ("disk", "ours", "torch_save", "dcp")


# ---------------------------------------------------------------------------- measuring
class Peak:
    """Largest RssAnon / VmRSS increase while inside the context (sampled every 2 ms)."""

    def __init__(self):
        self.anon = self.rss = 0

    @staticmethod
    def _read() -> tuple[int, int]:
        anon = rss = 0
        with open("/proc/self/status") as f:
            for ln in f:
                if ln.startswith("RssAnon:"):
                    anon = int(ln.split()[1]) * 1024
                elif ln.startswith("VmRSS:"):
                    rss = int(ln.split()[1]) * 1024
        return anon, rss

    def __enter__(self):
        self.base = self._read()
        self.top = list(self.base)
        self.stop = False

        def run():
            while not self.stop:
                a, r = self._read()
                self.top[0], self.top[1] = max(self.top[0], a), max(self.top[1], r)
                time.sleep(0.002)

        self.t = threading.Thread(target=run, daemon=True)
        self.t.start()
        return self

    def __exit__(self, *exc):
        self.stop = True
        self.t.join()
        a, r = self._read()
        self.anon = max(self.top[0], a) - self.base[0]
        self.rss = max(self.top[1], r) - self.base[1]


def write_file(path: str, nbytes: int, chunk: int = 16 << 20) -> None:
    """``nbytes`` of random bytes in 16 MiB writes, fsync'ed (what a rank's save writes)."""
    buf = torch.randint(0, 255, (chunk,), dtype=torch.uint8).numpy()
    with open(path + ".tmp", "wb", buffering=0) as f:
        left = nbytes
        while left > 0:
            left -= f.write(buf[: min(chunk, left)])
        os.fsync(f.fileno())
    os.replace(path + ".tmp", path)


def read_file(path: str, chunk: int = 16 << 20) -> None:
    buf = bytearray(chunk)
    with open(path, "rb", buffering=0) as f:
        while f.readinto(buf):
            pass


# ---------------------------------------------------------------------------- candidates
def _dcp_state(opt, names):
    """DCP state dict: per param 1-D ShardedTensors of this rank's pieces (values, exp_avg,
    exp_avg_sq) with every rank's chunk in the global metadata; ``step`` plain (replicated)."""
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
    from torch.distributed._shard.sharded_tensor.metadata import (
        ShardedTensorMetadata,
        TensorProperties,
    )

    from zero_kernels.layout import pieces

    layout = opt.layout
    chunks: dict[int, list[ShardMetadata]] = {}
    for r in range(layout.world_size):
        for buf in pieces(layout, r):
            for pc in buf:
                if pc.numel:
                    chunks.setdefault(pc.index, []).append(
                        ShardMetadata([pc.offset], [pc.numel], f"rank:{r}/cpu")
                    )
    numel = {s.index: s.numel for b in layout.buffers for s in b.slots}
    state = {}
    for _i, _k, pc, ip, _g in opt.parts.core.runner.all_pieces():
        if not pc.numel:
            continue
        st = opt.parts.core.runner.inner.state[ip]
        mine = next(c for c in chunks[pc.index] if c.shard_offsets[0] == pc.offset)
        meta = ShardedTensorMetadata(chunks[pc.index], torch.Size([numel[pc.index]]))
        meta.tensor_properties = TensorProperties(dtype=torch.float32)
        for key, t in (("p", ip), ("m", st["exp_avg"]), ("v", st["exp_avg_sq"])):
            state[f"{key}/{names[pc.index]}"] = (
                ShardedTensor._init_from_local_shards_and_global_metadata(
                    [Shard(t.detach().view(-1), mine)], meta
                )
            )
        state[f"step/{names[pc.index]}/{pc.offset}"] = st["step"]  # one key per piece
    return state


def _candidates(model, opt, work: str, rank: int):
    import torch.distributed.checkpoint as dcp

    import zero_kernels as zk
    from zero_kernels import comm

    names = {i: opt.layout_name(i) for i in opt.parts.core.trainable}
    paths = {k: os.path.join(work, k) for k in KINDS}

    def ours_save():
        zk.save_checkpoint(paths["ours"], model, opt, keep_last=1)

    def ours_load():
        zk.load_checkpoint(paths["ours"], model, opt)

    tfile = os.path.join(work, "torch_save.pt")

    def torch_save():
        full = opt.consolidated_state_dict(to=0)
        if rank == 0:
            with open(tfile + ".tmp", "wb") as f:
                torch.save({"model": model.state_dict(), "optim": full}, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tfile + ".tmp", tfile)
        comm.barrier()

    def torch_load():
        sd = torch.load(tfile, weights_only=True)
        opt.load_state_dict(sd["optim"])
        model.load_state_dict(sd["model"])

    def dcp_save():
        if rank == 0:
            shutil.rmtree(paths["dcp"], ignore_errors=True)
        comm.barrier()
        dcp.save(_dcp_state(opt, names), checkpoint_id=paths["dcp"])

    def dcp_load():
        st = _dcp_state(opt, names)
        dcp.load(st, checkpoint_id=paths["dcp"])
        for _i, _k, pc, ip, _g in opt.parts.core.runner.all_pieces():
            if pc.numel:
                opt.parts.core.runner.inner.state[ip]["step"].copy_(
                    st[f"step/{names[pc.index]}/{pc.offset}"]
                )
        opt.parts.full.refresh_params()

    disk_file = os.path.join(work, f"disk{rank}")
    shard_bytes = sum(
        ip.numel() * 4 * 3 for _i, _k, _pc, ip, _g in opt.parts.core.runner.all_pieces()
    )  # params, exp_avg, exp_avg_sq of this rank: the bytes its save writes

    return {
        "disk": (
            lambda: write_file(disk_file, shard_bytes),
            lambda: read_file(disk_file),
            lambda: shard_bytes * comm.world_size(),
        ),
        "ours": (ours_save, ours_load, lambda: _du(paths["ours"])),
        "torch_save": (torch_save, torch_load, lambda: _du(tfile)),
        "dcp": (dcp_save, dcp_load, lambda: _du(paths["dcp"])),
    }


def _du(path: str) -> int:
    if os.path.isfile(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def _fingerprint(opt) -> float:
    s = 0.0
    for _i, _k, _pc, ip, _g in opt.parts.core.runner.all_pieces():
        st = opt.parts.core.runner.inner.state.get(ip) or {}
        s += float(ip.double().sum()) + sum(
            float(v.double().sum()) for k, v in st.items() if k != "step"
        )
    return s


# ---------------------------------------------------------------------------- worker
def _worker(rank: int, world: int, port: int, args, work: str, q) -> None:
    import warnings

    import torch.distributed as dist

    from zero_kernels import ZeroOptimizer, comm
    from zero_kernels.tools.models import build_gpt

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        torch.manual_seed(0)
        model = build_gpt(args.model)
        opt = ZeroOptimizer(model, torch.optim.AdamW, stage=2, lr=1e-4)
        x = torch.randint(0, 256, (1, 8))
        model(x, x).backward()
        opt.step()
        n_params = sum(p.numel() for p in model.parameters())
        out = {"n_params": n_params, "times": {}, "peak": {}}
        cands = _candidates(model, opt, work, rank)
        ref = _fingerprint(opt)
        for k in KINDS:
            out["times"][k] = {"save": [], "load": []}
            out["peak"][k] = {"save": [0, 0], "load": [0, 0]}
        order = list(KINDS)
        for r in range(args.rounds):
            for k in order[r % len(order) :] + order[: r % len(order)]:
                for what, fn in (("save", cands[k][0]), ("load", cands[k][1])):
                    comm.barrier()
                    with Peak() as pk:
                        t0 = time.perf_counter()
                        fn()
                        dt = time.perf_counter() - t0
                    comm.barrier()
                    out["times"][k][what].append(max(comm.all_gather_object(dt)))
                    p = out["peak"][k][what]
                    p[0], p[1] = max(p[0], pk.anon), max(p[1], pk.rss)
                    if what == "load":
                        f = _fingerprint(opt)
                        assert abs(f - ref) <= 1e-9 * abs(ref), (k, f, ref)
        out["bytes"] = {k: cands[k][2]() for k in KINDS}
        if rank == 0:  # the consolidated export of the last save, streamed by one process
            from zero_kernels.checkpoint import export_model

            dst = os.path.join(work, "export.safetensors")
            with Peak() as pk:
                t0 = time.perf_counter()
                info = export_model(os.path.join(work, "ours"), dst)
                dt = time.perf_counter() - t0
            out["export"] = {
                "s": round(dt, 3),
                "bytes": info["bytes"],
                "extra_anon_MB": round(pk.anon / 1e6, 1),
                "extra_rss_MB": round(pk.rss / 1e6, 1),
            }
        q.put((rank, out))
    except BaseException as e:
        import traceback

        q.put((rank, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    finally:
        dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument(
        "--model", default="large", help="zero_kernels.tools.models size (default large)"
    )
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    ap.add_argument("--dir", default=None, help="where checkpoints are written (default /tmp)")
    args = ap.parse_args()
    work = tempfile.mkdtemp(prefix="zk_ckpt_bench_", dir=args.dir)
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    t0 = time.time()
    procs = [
        ctx.Process(target=_worker, args=(r, args.world, port, args, work, q))
        for r in range(args.world)
    ]
    for p in procs:
        p.start()
    res = {}
    try:
        for _ in procs:
            r, out = q.get(timeout=1800)
            if isinstance(out, str):
                raise SystemExit(f"rank {r} failed: {out}")
            res[r] = out
    finally:
        for p in procs:
            p.join(timeout=30)
        shutil.rmtree(work, ignore_errors=True)
    r0 = res[0]
    disk_s = statistics.median(r0["times"]["disk"]["save"])
    agg = round(r0["bytes"]["disk"] / disk_s / 1e9, 3)
    rows = []
    for k in KINDS:
        nbytes = r0["bytes"][k]
        row = {"candidate": k, "bytes_GB": round(nbytes / 1e9, 3)}
        for what in ("save", "load"):
            med = statistics.median(r0["times"][k][what])
            row[f"{what}_s"] = round(med, 3)
            peaks = [res[r]["peak"][k][what] for r in res]
            row[f"{what}_extra_anon_MB"] = round(max(p[0] for p in peaks) / 1e6, 1)
            row[f"{what}_extra_rss_MB"] = round(max(p[1] for p in peaks) / 1e6, 1)
        row["save_GBps"] = round(nbytes / row["save_s"] / 1e9, 3)
        row["save_fraction_of_disk"] = round(row["save_GBps"] / agg, 2)
        rows.append(row)
    payload = {
        "machine": machine(),
        "model": args.model,
        "n_params": r0["n_params"],
        "world": args.world,
        "rounds": args.rounds,
        "disk": {"write_GBps": agg, "dir": os.path.dirname(work)},
        "wall_s": round(time.time() - t0, 1),
        "times_s": r0["times"],
        "export": r0["export"],
        "loadavg_1_5_15_after": list(os.getloadavg()),
    }
    jpath, _ = write_results(args.out, "checkpoint_ws2", payload, rows)
    keys = list(rows[0])
    print(markdown_table(rows, keys))
    print(f"disk write: {agg} GB/s (every rank its shard's bytes at once, fsync'ed)")
    print(f"export (one process, streamed): {r0['export']}")
    print("wrote", jpath)


if __name__ == "__main__":
    main()
