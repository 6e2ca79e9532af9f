"""Blockwise int8/int4 quantization: throughput per backend and accuracy per block size.

1. Throughput (CPU): quantize and dequantize of an n-element fp32 (or bf16) tensor per backend
   (the native kernel at each instruction set this CPU runs, and the pure-torch reference), timed
   side by side (A B C A B C ..., medians) at the default block. Reported as GB/s of the input
   tensor (n * element size / time) and as the fraction of the memory floor the bytes it moves
   reach (floor: the faster of torch's copy and in-place add, measured in the same run). Then the
   native kernel's throughput against the block size.
2. Accuracy: relative error RMS(x - deq) / RMS(x) against the block size (32 .. 4096) for int8
   and int4, on Gaussian data and on gradient-like heavy-tailed data (Student-t, 3 degrees of
   freedom, times a log-normal magnitude per row of 1000 elements, so large blocks straddle rows
   of different scale as a flat bucket of many parameters does), with the median per-row
   relative error (what the small rows in a bucket keep), and the bytes per element sent.

    python bench/bench_quant.py [--n 8e6] [--repeats 7] [--threads T] [--quick] [--out DIR]
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import (  # noqa: E402
    machine,
    markdown_table,
    memory_bandwidth,
    side_by_side,
    write_results,
)

from zero_kernels import native, ops  # noqa: E402

BLOCKS = [32, 64, 128, 256, 512, 1024, 2048, 4096]


def isas() -> list[str]:
    mod = native.load()
    if mod is None or not hasattr(mod, "quantize_blockwise"):
        return []
    order = ["scalar", "avx2", "avx512"]
    mod.set_cpu_isa("auto")
    return order[: order.index(mod.cpu_isa()) + 1]


def backend_call(name: str):
    """(backend, isa) of a candidate name: 'cpu-avx512' -> ('cpu', 'avx512')."""
    if name.startswith("cpu-"):
        return "cpu", name[4:]
    return name, None


def runner(name: str, fn):
    backend, isa = backend_call(name)
    mod = native.load()

    def run():
        if isa is not None:
            mod.set_cpu_isa(isa)
        fn(backend)

    return run


def moved_bytes(op: str, n: int, elem: int, bits: int, block: int, error: bool) -> int:
    """Bytes a kernel reads and writes: the input, q, scales (and the residual, read + written)."""
    qb = n if bits == 8 else (n + 1) // 2
    sb = 4 * math.ceil(n / block)
    if op == "quantize":
        return n * elem + qb + sb + (8 * n if error else 0)
    if op == "dequantize+acc":
        return qb + sb + 8 * n
    return qb + sb + n * elem


def throughput(n: int, repeats: int, floor: float) -> list[dict]:
    names = [f"cpu-{i}" for i in reversed(isas())] + ["reference"]
    block = ops.DEFAULT_BLOCK
    rows = []
    gen = torch.Generator().manual_seed(0)
    x32 = torch.randn(n, generator=gen)
    cases = [
        ("quantize", torch.float32, 8, False),
        ("quantize", torch.float32, 4, False),
        ("quantize", torch.bfloat16, 8, False),
        ("quantize", torch.float32, 8, True),
        ("dequantize", torch.float32, 8, False),
        ("dequantize", torch.float32, 4, False),
        ("dequantize", torch.bfloat16, 8, False),
        ("dequantize+acc", torch.float32, 8, False),
    ]
    for op, dtype, bits, error in cases:
        x = x32.to(dtype)
        err = torch.zeros(n) if error else None
        q, s = ops.quantize_blockwise(x32, bits, block)
        out = torch.empty(n, dtype=dtype)

        def call(backend, op=op, x=x, err=err, q=q, s=s, out=out, bits=bits):
            if op == "quantize":
                ops.quantize_blockwise(x, bits, block, error=err, out=(q, s), backend=backend)
            else:
                ops.dequantize_blockwise(
                    q, s, bits, block, n, out=out, accumulate=op.endswith("acc"), backend=backend
                )

        reps = repeats
        res = side_by_side({nm: runner(nm, call) for nm in names}, repeats=reps, warmup=1)
        elem = x.element_size()
        moved = moved_bytes(op, n, elem, bits, block, error)
        for nm in names:
            t = res[nm]["median_s"]
            rows.append(
                {
                    "op": op + (" +error" if error else ""),
                    "dtype": str(dtype).replace("torch.", ""),
                    "bits": bits,
                    "block": block,
                    "backend": nm,
                    "median_ms": round(t * 1e3, 3),
                    "input_GBps": round(n * elem / t / 1e9, 2),
                    "moved_GBps": round(moved / t / 1e9, 2),
                    "fraction_of_floor": round(moved / t / 1e9 / floor, 2),
                }
            )
            print(rows[-1], flush=True)
    if native.load() is not None:
        native.load().set_cpu_isa("auto")
    return rows


def throughput_vs_block(n: int, repeats: int, floor: float) -> list[dict]:
    if not isas():
        return []
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(n, generator=gen)
    rows = []
    for bits in (8, 4):
        for op in ("quantize", "dequantize"):
            cands = {}
            bufs = {}
            for block in BLOCKS:
                q, s = ops.quantize_blockwise(x, bits, block)
                out = torch.empty(n)
                bufs[block] = (q, s, out)

                def call(block=block, q=q, s=s, out=out, op=op, bits=bits):
                    if op == "quantize":
                        ops.quantize_blockwise(x, bits, block, out=(q, s), backend="cpu")
                    else:
                        ops.dequantize_blockwise(q, s, bits, block, n, out=out, backend="cpu")

                cands[block] = call
            res = side_by_side(cands, repeats=repeats, warmup=1)
            for block in BLOCKS:
                t = res[block]["median_s"]
                moved = moved_bytes(op, n, 4, bits, block, False)
                rows.append(
                    {
                        "op": op,
                        "bits": bits,
                        "block": block,
                        "backend": f"cpu-{isas()[-1]}",
                        "median_ms": round(t * 1e3, 3),
                        "input_GBps": round(4 * n / t / 1e9, 2),
                        "fraction_of_floor": round(moved / t / 1e9 / floor, 2),
                    }
                )
                print(rows[-1], flush=True)
    return rows


def data(kind: str, n: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(2)
    if kind == "gaussian":
        return torch.randn(n, generator=gen)
    t3 = torch.randn(n, generator=gen) / (torch.randn(n, 3, generator=gen).pow(2).mean(1)).sqrt()
    rows = -(-n // 1000)
    mag = torch.exp(torch.randn(rows, generator=gen)).repeat_interleave(1000)[:n]
    return t3 * mag


def accuracy(n: int) -> list[dict]:
    rows = []
    for kind in ("gaussian", "gradient-like"):
        x = data(kind, n)
        xr = x[: n // 1000 * 1000].view(-1, 1000)
        for bits in (8, 4):
            for block in BLOCKS:
                q, s = ops.quantize_blockwise(x, bits, block)
                d = ops.dequantize_blockwise(q, s, bits, block, n)
                e = (x - d).double()
                rel = (e.pow(2).mean().sqrt() / x.double().pow(2).mean().sqrt()).item()
                er = e[: xr.numel()].view(-1, 1000)
                per_row = er.pow(2).mean(1).sqrt() / xr.double().pow(2).mean(1).sqrt()
                nq, ns = ops.quantized_sizes(n, bits, block)
                rows.append(
                    {
                        "data": kind,
                        "bits": bits,
                        "block": block,
                        "rel_rms_error": f"{rel:.3e}",
                        "median_row_rel_error": f"{per_row.median().item():.3e}",
                        "bytes_per_elem": round((nq + 4 * ns) / n, 4),
                        "vs_bf16": round(2 * n / (nq + 4 * ns), 2),
                    }
                )
                print(rows[-1], flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=float, default=8e6, help="elements in the throughput runs")
    ap.add_argument("--n-accuracy", type=float, default=4e6, help="elements per accuracy run")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--quick", action="store_true", help="small smoke run")
    ap.add_argument("--out", default="bench/results")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    n = int(args.n) if not args.quick else 1_000_003
    na = int(args.n_accuracy) if not args.quick else 200_000
    reps = args.repeats if not args.quick else 3
    info = machine()
    info["loadavg_before"] = os.getloadavg()  # the machine is shared: how busy it was
    print(info, flush=True)
    bw = memory_bandwidth(n_floats=n, repeats=reps)
    floor = max(bw["copy_GBps"], bw["rmw_GBps"])
    print("bandwidth", bw, flush=True)
    rows_t = throughput(n, reps, floor)
    rows_b = throughput_vs_block(n, reps, floor)
    rows_a = accuracy(na)
    info["loadavg_after"] = os.getloadavg()
    payload = {
        "machine": info,
        "bandwidth": bw,
        "floor_GBps": floor,
        "n": n,
        "n_accuracy": na,
        "default_block": ops.DEFAULT_BLOCK,
        "throughput_vs_block": rows_b,
        "accuracy": rows_a,
    }
    name = f"quant_cpu_t{torch.get_num_threads()}" + ("_quick" if args.quick else "")
    jpath, _ = write_results(args.out, name, payload, rows_t)
    keys_t = ["op", "dtype", "bits", "backend", "median_ms", "input_GBps", "fraction_of_floor"]
    print(markdown_table(rows_t, keys_t))
    print()
    print(markdown_table(rows_b, ["op", "bits", "block", "input_GBps", "fraction_of_floor"]))
    print()
    keys_a = [
        "data",
        "bits",
        "block",
        "rel_rms_error",
        "median_row_rel_error",
        "bytes_per_elem",
        "vs_bf16",
    ]
    print(markdown_table(rows_a, keys_a))
    print("wrote", jpath)


if __name__ == "__main__":
    main()
