"""Kernel benchmark: the fused Adam/AdamW step against torch.optim (and DeepSpeed's CPU Adam).

Two comparisons per size, each timed side by side in one run with the streaming floor measured
in the same run:

- plain step (28 bytes/param: read p, g, m, v; write p, m, v): FusedAdamW against
  torch.optim.AdamW default, foreach=True and fused=True, and DeepSpeed's CPU Adam if installed;
  with them the low-bit-state steps (bf16 moments, 20 bytes/param; int8 moments, block 256, 16
  bytes/param + 16 bytes/block of scales), as FusedAdamW(state_dtype=...) and as
  zero_kernels.ops.lowbit.adam_step_lowbit, and the best probe variant of each pattern;
- full shard step (34 bytes/param: + the non-finite scan's read of g, + the bf16 copy-out):
  `zero_kernels.ops.adam_step(check_finite, grad_scale, out_lowp)` in one call against the best
  torch pipeline doing the same work (_amp_foreach_non_finite_check_and_unscale_, fused AdamW,
  copy to bf16).

The floor ("true floor") of a pattern is the fastest variant of `_C.stream_probe_variant` (the
pattern's exact traffic with no math; software prefetch 0-2048 elements, plain or non-temporal
stores, 1 or all threads) swept at each size (`harness.stream_floor`), then re-timed among the
kernels (that time is the floor); each kernel's ``floor_fraction`` = floor time / its time,
against its own pattern.

    python bench/bench_adam.py [--sizes 1e6,1e7,5e7] [--quick] [--device cpu|cuda] [--out DIR]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# the repo itself, for a checkout built in place (bench/gpu_check.sh) rather than installed
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from harness import (  # noqa: E402
    PROBE_PATTERNS,
    best_probe,
    machine,
    markdown_table,
    memory_bandwidth,
    side_by_side,
    stream_floor,
    write_results,
)

from zero_kernels import FusedAdamW, ops  # noqa: E402
from zero_kernels.ops import AdamHyper, lowbit  # noqa: E402

STATE_BLOCK = 256

LR, WD = 1e-3, 1e-2


def _param(n: int, device: str, seed: int) -> torch.nn.Parameter:
    gen = torch.Generator(device=device).manual_seed(seed)
    p = torch.nn.Parameter(torch.randn(n, device=device, generator=gen))
    p.grad = torch.randn(n, device=device, generator=gen) * 1e-2
    return p


def _deepspeed_adam(p):
    try:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        return DeepSpeedCPUAdam([p], lr=LR, weight_decay=WD, adamw_mode=True)
    except Exception as e:  # not installed, or its op failed to build
        print(
            f"  DeepSpeedCPUAdam skipped: {type(e).__name__}: {str(e).splitlines()[0][:120]} "
            "(install: pip install --no-deps deepspeed, DS_ACCELERATOR=cpu)"
        )
        return None


def _plain_optimizers(backend: str) -> dict:
    """Plain-step candidates: name -> (param -> optimizer, or None when it cannot run here)."""
    return {
        "zero_kernels FusedAdamW": lambda p: FusedAdamW(
            [p], lr=LR, weight_decay=WD, backend=backend
        ),
        "torch AdamW default": lambda p: torch.optim.AdamW([p], lr=LR, weight_decay=WD),
        "torch AdamW foreach": lambda p: torch.optim.AdamW(
            [p], lr=LR, weight_decay=WD, foreach=True
        ),
        "torch AdamW fused": lambda p: torch.optim.AdamW([p], lr=LR, weight_decay=WD, fused=True),
        "DeepSpeed CPUAdam": _deepspeed_adam if backend == "cpu" else (lambda p: None),
    }


PLAIN_CANDIDATES = tuple(_plain_optimizers("cpu"))
SHARD_CANDIDATES = ("zero_kernels one pass", "torch pipeline")


def plain_candidate(name: str, n: int, device: str):
    """``opt.step`` of candidate ``name`` over one fresh n-element param (None: unavailable)."""
    backend = "cuda" if device == "cuda" else "cpu"
    opt = _plain_optimizers(backend)[name](_param(n, device, 0))
    return None if opt is None else opt.step


def lowbit_candidate(name: str, n: int, device: str):
    """``step`` of a low-bit-state candidate ("FusedAdamW bf16|int8", "adam_step_lowbit
    bf16|int8") over one fresh n-element param."""
    backend = "cuda" if device == "cuda" else "cpu"
    kind, sd = name.rsplit(" ", 1)
    p = _param(n, device, 0)
    if kind == "zero_kernels FusedAdamW":
        opt = FusedAdamW(
            [p], lr=LR, weight_decay=WD, backend=backend, state_dtype=sd, state_block=STATE_BLOCK
        )
        return opt.step
    if kind != "zero_kernels adam_step_lowbit":
        raise ValueError(f"lowbit_candidate: unknown candidate {name!r}")
    state = lowbit.new_state(n, sd, STATE_BLOCK, device)
    count = {"step": 0}

    def step():
        count["step"] += 1
        h = AdamHyper(
            lr=LR, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=WD, step=count["step"], adamw=True
        )
        lowbit.adam_step_lowbit(
            p.data, p.grad, state, h, state_dtype=sd, block=STATE_BLOCK, backend=backend
        )

    return step


LOWBIT_CANDIDATES = {  # name -> its probe pattern
    "zero_kernels FusedAdamW bf16": "bf16",
    "zero_kernels adam_step_lowbit bf16": "bf16",
    "zero_kernels FusedAdamW int8": "int8",
    "zero_kernels adam_step_lowbit int8": "int8",
}


def plain_step(n: int, device: str, repeats: int, with_deepspeed: bool, floor: dict) -> dict:
    cands = {}
    for name in PLAIN_CANDIDATES:
        if name == "DeepSpeed CPUAdam" and not with_deepspeed:
            continue
        step = plain_candidate(name, n, device)
        if step is not None:
            cands[name] = step
    for name in LOWBIT_CANDIDATES:
        cands[name] = lowbit_candidate(name, n, device)
    for pat, row in floor.get("best", {}).items():
        cands[f"floor {pat}"] = best_probe(n, row)
    return side_by_side(cands, repeats=repeats, device=device)


def pattern_of(name: str) -> str:
    """The probe pattern a candidate's traffic is held against."""
    if name.startswith("floor "):
        return name.split(" ", 1)[1]
    return LOWBIT_CANDIDATES.get(name, "fp32")


def shard_candidate(name: str, n: int, device: str):
    """(step, restore) of a full-shard-step candidate; ``restore`` (or None) resets its input
    between calls and is not part of the timed work."""
    backend = "cuda" if device == "cuda" else "cpu"
    scale = 1.0 / 1024  # 1 / loss scale (times a clip coefficient in real use)
    if name == "zero_kernels one pass":  # ours: one call
        p = _param(n, device, 1)
        g = p.grad
        m, v = torch.zeros_like(p), torch.zeros_like(p)
        out = torch.empty(n, dtype=torch.bfloat16, device=device)
        found = torch.zeros(1, device=device)
        state = {"step": 0}

        def ours():
            state["step"] += 1
            h = AdamHyper(
                lr=LR,
                beta1=0.9,
                beta2=0.999,
                eps=1e-8,
                weight_decay=WD,
                step=state["step"],
                adamw=True,
                grad_scale=scale,
            )
            ops.adam_step(
                p.data,
                g,
                m,
                v,
                h,
                out_lowp=out,
                found_inf=found,
                check_finite=True,
                backend=backend,
            )

        return ours, None
    if name != "torch pipeline":
        raise ValueError(f"shard_candidate: name must be one of {SHARD_CANDIDATES}, got {name!r}")
    # torch: unscale + inf check (one op), fused AdamW, copy-out
    q = _param(n, device, 1)
    opt = torch.optim.AdamW([q], lr=LR, weight_decay=WD, fused=True)
    qout = torch.empty(n, dtype=torch.bfloat16, device=device)
    qfound = torch.zeros(1, device=device)
    inv = torch.full((1,), scale, device=device)
    grad_copy = q.grad.clone()

    def torch_pipeline():
        torch._amp_foreach_non_finite_check_and_unscale_([q.grad], qfound, inv)
        opt.step()
        qout.copy_(q.detach())

    def restore():  # the unscale works in place; restore so every run sees the same grads
        q.grad.copy_(grad_copy)

    return torch_pipeline, restore


def shard_step(n: int, device: str, repeats: int) -> dict:
    ours, _ = shard_candidate("zero_kernels one pass", n, device)
    pipeline, restore = shard_candidate("torch pipeline", n, device)

    def restore_and_pipeline():
        restore()
        pipeline()

    res = side_by_side(
        {
            "zero_kernels one pass": ours,
            "torch pipeline": restore_and_pipeline,
            "(grad restore, subtracted)": restore,
        },
        repeats=repeats,
        device=device,
    )
    restored = res.pop("(grad restore, subtracted)")["median_s"]
    res["torch pipeline"]["median_s"] -= restored
    res["torch pipeline"]["min_s"] -= restored
    return res


SWEEP_KERNELS = (
    "zero_kernels FusedAdamW",
    "zero_kernels adam_step_lowbit bf16",
    "zero_kernels adam_step_lowbit int8",
)


def prefetch_sweep(sizes: list[int], distances: list[int], repeats: int) -> list[dict]:
    """The real steps at each software prefetch distance, side by side with torch's fused step,
    each candidate on its own buffers (as in the plain-step table): the measurement behind the
    per-CPU-family default (`_C.default_prefetch_distance`, csrc/adam_cpu_scalar.cpp)."""
    from zero_kernels import native

    mod = native.load()
    if mod is None:
        raise SystemExit("--prefetch-sweep needs the native extension")
    rows = []
    try:
        for n in sizes:
            cands = {"torch AdamW fused": plain_candidate("torch AdamW fused", n, "cpu")}
            for name in SWEEP_KERNELS:
                for d in distances:
                    if name in LOWBIT_CANDIDATES:
                        step = lowbit_candidate(name, n, "cpu")
                    else:
                        step = plain_candidate(name, n, "cpu")

                    def at(step=step, d=d):
                        mod.set_prefetch_distance(d)
                        step()

                    cands[f"{name} pf{d}"] = at
            res = side_by_side(cands, repeats=repeats)
            ref = res["torch AdamW fused"]["median_s"]
            for name, r in res.items():
                rows.append(
                    {
                        "params": n,
                        "candidate": name,
                        "median_ms": round(1e3 * r["median_s"], 3),
                        "speedup_vs_torch_fused": round(ref / r["median_s"], 3),
                    }
                )
    finally:
        mod.set_prefetch_distance(mod.default_prefetch_distance())
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="1e6,1e7,5e7", help="comma-separated param counts")
    ap.add_argument("--quick", action="store_true", help="smoke run: 1e6 and 4e6, 3 repeats")
    ap.add_argument(
        "--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cpu", "cuda"]
    )
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--no-deepspeed", action="store_true")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    ap.add_argument(
        "--prefetch-sweep",
        default="",
        metavar="D1,D2,...",
        help="instead of the tables: the CPU steps at these prefetch distances (elements) "
        "against torch's fused step",
    )
    args = ap.parse_args(argv)
    try:
        sizes = [int(float(s)) for s in args.sizes.split(",")]
    except ValueError:
        ap.error(f"--sizes must be comma-separated numbers, got {args.sizes!r}")
    repeats = args.repeats
    if args.quick:
        sizes, repeats = [1_000_000, 4_000_000], 3
    info = machine()
    if args.prefetch_sweep:
        try:
            dists = [int(d) for d in args.prefetch_sweep.split(",")]
        except ValueError:
            ap.error(f"--prefetch-sweep must be comma-separated ints, got {args.prefetch_sweep!r}")
        if args.device != "cpu" or any(d < 0 for d in dists):
            ap.error(f"--prefetch-sweep: CPU only, distances >= 0, got {args.prefetch_sweep!r}")
        rows = prefetch_sweep(sizes, dists, repeats)
        fam, model = info.get("cpu_family"), info.get("cpu_model")
        print(f"machine: {info['cpu']}, family {fam} model {model}")
        print(markdown_table(rows, list(rows[0])))
        j, c = write_results(args.out, "adam_prefetch_sweep", {"machine": info}, rows)
        print(f"wrote {j} and {c}")
        return 0
    bw = memory_bandwidth(max(sizes) if not args.quick else 4_000_000, args.device)
    print(
        f"machine: {info['cpu']} ({info['cores']} cores, {info['torch_threads']} torch threads),"
        f" torch {info['torch']}, isa {info.get('zero_kernels_cpu_isa')},"
        f" prefetch {info.get('zero_kernels_prefetch')}"
    )
    print(
        f"bandwidth: copy {bw['copy_GBps']} GB/s, in-place rmw {bw['rmw_GBps']} GB/s, "
        f"old step probe {bw.get('step_pattern_GBps', '-')} GB/s"
    )
    rows, floors = [], {}
    for n in sizes:
        floor = stream_floor(n, repeats) if args.device == "cpu" else {}
        floors[n] = floor
        for pat, row in floor.get("best", {}).items():
            print(
                f"  n={n:,} floor {pat}: {row['GBps']} GB/s (prefetch {row['prefetch']}, "
                f"{'nt' if row['nt'] else 'plain'} stores, {row['threads']} threads)"
            )
        plain = plain_step(n, args.device, repeats, not args.no_deepspeed, floor)
        shard = shard_step(n, args.device, repeats)
        # a pattern's floor: its best swept variant re-timed here, among the kernels (the sweep
        # reuses one pattern's buffers from variant to variant: at sizes that fit in the
        # last-level cache its times are cache-warm, the kernels' are not)
        floor_ms = {
            name.split(" ", 1)[1]: 1e3 * r["median_s"]
            for name, r in plain.items()
            if name.startswith("floor ")
        }
        for kind, res in (("plain step", plain), ("shard step", shard)):
            for name, r in res.items():
                pat = pattern_of(name)
                bytes_per_param = 34 if kind == "shard step" else PROBE_PATTERNS[pat]
                ms = 1e3 * r["median_s"]
                gbps = bytes_per_param * n / r["median_s"] / 1e9
                fl = floor_ms.get(pat)
                rows.append(
                    {
                        "kind": kind,
                        "params": n,
                        "candidate": name,
                        "pattern": pat,
                        "bytes_per_param": bytes_per_param,
                        "median_ms": round(ms, 3),
                        "GBps": round(gbps, 2),
                        # the floor's GB/s of this pattern / this candidate's (shard step: its
                        # 34 bytes at the fp32 pattern's floor rate)
                        "floor_fraction": (
                            round(gbps / (PROBE_PATTERNS[pat] * n / fl / 1e6), 3) if fl else ""
                        ),
                    }
                )
        base = {(r["kind"], r["candidate"]): r["median_ms"] for r in rows if r["params"] == n}
        for r in rows:
            if r["params"] == n:
                ref = (
                    base[("plain step", "torch AdamW fused")]
                    if r["kind"] == "plain step"
                    else base[("shard step", "torch pipeline")]
                )
                r["speedup_vs_torch_best"] = round(ref / r["median_ms"], 3)
        print(f"n={n:,} done", flush=True)
    keys = [
        "kind",
        "params",
        "candidate",
        "pattern",
        "median_ms",
        "GBps",
        "floor_fraction",
        "speedup_vs_torch_best",
    ]
    print(markdown_table(rows, keys))
    name = f"adam_{args.device}" + ("_quick" if args.quick else "")
    payload = {"machine": info, "bandwidth": bw, "floor": {str(n): f for n, f in floors.items()}}
    j, c = write_results(args.out, name, payload, rows)
    print(f"wrote {j} and {c}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
