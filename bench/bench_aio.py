"""The NVMe tier's I/O engine (zero_kernels.offload.aio): bandwidth by backend, mode, chunk size
and queue depth, on a real disk directory (not tmpfs: checked with statfs).

Pattern: what the swapper does with a shard, one request of ``--mb`` MiB written at offset 0 of
its file, then read back into the same aligned buffer; each candidate keeps its file open across
rounds (the first, warm-up round allocates its blocks, later writes overwrite them, as the
swapper's do). Candidates run alternately (A B C A B C ...), medians over ``--repeats`` rounds.

    direct     O_DIRECT: write and read timed to the request's completion (no fsync: an O_DIRECT
               write is complete when the device has it, and the swapper does not fsync)
    buffered   write timed up to its fsync (otherwise it only measures memcpy into the page
               cache); the file's pages are dropped (POSIX_FADV_DONTNEED) before the read, so
               the read comes from the device too

Sweep 1: native engine (auto: io_uring here), O_DIRECT, chunk size x queue depth. Sweep 2: at the
defaults, native io_uring / native threads / python, O_DIRECT / buffered. cpu_ms_per_GB is this
process's CPU time (every thread, user + system, io_uring's kernel workers included) per GB moved,
write and read together: what the I/O takes from the cores the training step runs on.

    python bench/bench_aio.py [--dir /var/tmp/zk-aio-bench] [--mb 256] [--repeats 5] [--quick]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import machine, markdown_table, write_results  # noqa: E402

from zero_kernels.offload import aio  # noqa: E402

MiB = 1 << 20
TMPFS_MAGIC = 0x01021994


def filesystem(directory: str) -> str:
    """The filesystem type of ``directory`` (from /proc/mounts: the longest mount prefix)."""
    best, kind = "", "?"
    real = os.path.realpath(directory)
    with open("/proc/mounts") as f:
        for line in f:
            parts = line.split()
            mnt, fstype = parts[1], parts[2]
            if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) > len(best):
                best, kind = mnt, fstype
    return kind


class Candidate:
    def __init__(self, directory: str, name: str, nbytes: int, **kw):
        self.name = name
        self.direct = kw.get("direct", True)
        self.f = aio.AioFile(os.path.join(directory, f"bench-{name}.bin"), nbytes, **kw)
        self.buf = aio.aligned_empty(nbytes, torch.uint8).fill_(0x5A)
        self.write_s: list[float] = []
        self.read_s: list[float] = []
        self.cpu_s: list[float] = []  # this process's CPU time (all threads) for write + read

    def run(self, keep: bool) -> None:
        fd = self.f.fd
        c0 = time.process_time()
        t0 = time.perf_counter()
        self.f.write(self.buf, 0)
        if not self.f.direct:
            os.fsync(fd)
        t1 = time.perf_counter()
        if not self.f.direct:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        t2 = time.perf_counter()
        self.f.read(self.buf, 0)
        t3 = time.perf_counter()
        c1 = time.process_time()
        if keep:
            self.cpu_s.append(c1 - c0)
            self.write_s.append(t1 - t0)
            self.read_s.append(t3 - t2)

    def row(self, **extra) -> dict:
        n = self.buf.numel()
        w, r = statistics.median(self.write_s), statistics.median(self.read_s)
        return {
            "candidate": self.name,
            **extra,
            "direct": self.f.direct,
            "engine": self.f.engine,
            "write_GBps": round(n / w / 1e9, 2),
            "read_GBps": round(n / r / 1e9, 2),
            "cpu_ms_per_GB": round(statistics.median(self.cpu_s) / (2 * n / 1e9) * 1e3, 1),
            "write_min_s": round(min(self.write_s), 4),
            "read_min_s": round(min(self.read_s), 4),
            "rounds": len(self.write_s),
        }


def run_all(cands: list[Candidate], repeats: int) -> None:
    for c in cands:
        c.run(keep=False)  # warm-up: allocates the file's blocks
    for _ in range(repeats):
        for c in cands:
            c.run(keep=True)
    for c in cands:
        c.f.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", default="/var/tmp/zk-aio-bench")
    ap.add_argument("--mb", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="smoke run: 32 MiB, 2 rounds, few configs")
    ap.add_argument("--chunks-kib", default="256,1024,4096,16384", help="sweep 1's chunk sizes")
    ap.add_argument("--depths", default="1,2,4,8", help="sweep 1's queue depths")
    ap.add_argument("--engines", default="auto", help="sweep 1's native engines (io_uring,threads)")
    ap.add_argument("--no-compare", action="store_true", help="sweep 1 only")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = ap.parse_args()
    if args.quick:
        args.mb, args.repeats = 32, 2
    os.makedirs(args.dir, exist_ok=True)
    fs = filesystem(args.dir)
    if fs in ("tmpfs", "ramfs"):
        sys.exit(f"{args.dir} is on {fs}: give --dir a directory on a real disk")
    nbytes = args.mb * MiB
    native, why = aio.native_engine_class()
    print(f"dir {args.dir} ({fs}), {args.mb} MiB per request, {args.repeats} rounds")
    if native is None:
        print(f"no native engine ({why}): python backend only")

    chunks = [int(k) * 1024 for k in args.chunks_kib.split(",")]
    depths = [int(d) for d in args.depths.split(",")]
    engines = args.engines.split(",")
    if args.quick:
        chunks, depths = [MiB, 4 * MiB], [1, 4]
    backend = "native" if native is not None else "python"
    if backend == "python":
        engines = ["auto"]
    sweep = []
    for e in engines:
        for c in chunks:
            for d in depths:
                sweep.append(
                    Candidate(
                        args.dir,
                        f"{backend}-{e}-c{c // 1024}k-q{d}",
                        nbytes,
                        backend=backend,
                        chunk_bytes=c,
                        threads=d,
                        engine=e,
                    )
                )
    run_all(sweep, args.repeats)
    rows1 = [c.row(chunk_KiB=c.f.chunk_bytes // 1024, queue_depth=c.f.threads) for c in sweep]
    print("\nSweep 1: chunk size x queue depth, O_DIRECT\n")
    keys1 = ["candidate", "engine", "chunk_KiB", "queue_depth", "write_GBps", "read_GBps"]
    keys1.append("cpu_ms_per_GB")
    print(markdown_table(rows1, keys1))

    if args.no_compare:
        write_results(args.out, "aio_sweep", {"machine": machine(), "dir": args.dir}, rows1)
        return
    kinds = [("python", {"backend": "python"})]
    if native is not None:
        kinds = [
            ("native-io_uring", {"backend": "native", "engine": "io_uring"}),
            ("native-threads", {"backend": "native", "engine": "threads"}),
            *kinds,
        ]
        ok, uring_why = aio.native.load().aio_uring_supported()
        if not ok:
            print(f"no io_uring here ({uring_why})")
            kinds.pop(0)
    cmp = [
        Candidate(args.dir, f"{name}-{'direct' if d else 'buffered'}", nbytes, direct=d, **kw)
        for name, kw in kinds
        for d in (True, False)
    ]
    run_all(cmp, args.repeats)
    rows2 = [c.row(chunk_KiB=aio.CHUNK_BYTES // 1024, queue_depth=aio.THREADS) for c in cmp]
    print(
        f"\nSweep 2: backends and modes at the defaults ({aio.CHUNK_BYTES // MiB} MiB, "
        f"depth {aio.THREADS})\n"
    )
    keys2 = ["candidate", "engine", "direct", "write_GBps", "read_GBps", "cpu_ms_per_GB"]
    print(markdown_table(rows2, keys2))
    payload = {"machine": machine(), "dir": args.dir, "fs": fs, "mb": args.mb}
    paths = write_results(
        args.out, "aio" + ("_quick" if args.quick else ""), payload, rows1 + rows2
    )
    print("\nwrote", *paths)


if __name__ == "__main__":
    main()
