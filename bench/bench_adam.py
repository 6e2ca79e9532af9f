"""Kernel benchmark: the fused Adam/AdamW step against torch.optim (and DeepSpeed's CPU Adam).

Two comparisons per size, each timed side by side in one run with the memory bandwidth measured
in the same run:

- plain step (28 bytes/param: read p, g, m, v; write p, m, v): FusedAdamW against
  torch.optim.AdamW default, foreach=True and fused=True, and DeepSpeed's CPU Adam if installed;
- full shard step (34 bytes/param: + the non-finite scan's read of g, + the bf16 copy-out):
  `zero_kernels.ops.adam_step(check_finite, grad_scale, out_lowp)` in one call against the best
  torch pipeline doing the same work (_amp_foreach_non_finite_check_and_unscale_, fused AdamW,
  copy to bf16).

    python bench/bench_adam.py [--sizes 1e6,1e7,5e7] [--quick] [--device cpu|cuda] [--out DIR]
"""

from __future__ import annotations

import argparse
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

from zero_kernels import FusedAdamW, ops  # noqa: E402
from zero_kernels.ops import AdamHyper  # noqa: E402

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


def plain_step(n: int, device: str, repeats: int, with_deepspeed: bool) -> dict:
    backend = "cuda" if device == "cuda" else "cpu"
    cands, keep = {}, []

    def add(name, opt, p):
        keep.append((opt, p))
        cands[name] = opt.step

    p = _param(n, device, 0)
    add("zero_kernels FusedAdamW", FusedAdamW([p], lr=LR, weight_decay=WD, backend=backend), p)
    for name, kw in (
        ("torch AdamW default", {}),
        ("torch AdamW foreach", {"foreach": True}),
        ("torch AdamW fused", {"fused": True}),
    ):
        p = _param(n, device, 0)
        add(name, torch.optim.AdamW([p], lr=LR, weight_decay=WD, **kw), p)
    if with_deepspeed and device == "cpu":
        p = _param(n, device, 0)
        opt = _deepspeed_adam(p)
        if opt is not None:
            add("DeepSpeed CPUAdam", opt, p)
    return side_by_side(cands, repeats=repeats, device=device)


def shard_step(n: int, device: str, repeats: int) -> dict:
    backend = "cuda" if device == "cuda" else "cpu"
    scale = 1.0 / 1024  # 1 / loss scale (times a clip coefficient in real use)
    # ours: one call
    p, g = _param(n, device, 1), None
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
            p.data, g, m, v, h, out_lowp=out, found_inf=found, check_finite=True, backend=backend
        )

    # torch: unscale + inf check (one op), fused AdamW, copy-out
    q = _param(n, device, 1)
    opt = torch.optim.AdamW([q], lr=LR, weight_decay=WD, fused=True)
    qout = torch.empty(n, dtype=torch.bfloat16, device=device)
    qfound = torch.zeros(1, device=device)
    inv = torch.full((1,), scale, device=device)
    grad_copy = q.grad.clone()

    def torch_pipeline():
        q.grad.copy_(grad_copy)  # the unscale works in place; restore so every run sees the same
        torch._amp_foreach_non_finite_check_and_unscale_([q.grad], qfound, inv)
        opt.step()
        qout.copy_(q.detach())

    def restore_only():
        q.grad.copy_(grad_copy)

    res = side_by_side(
        {
            "zero_kernels one pass": ours,
            "torch pipeline": torch_pipeline,
            "(grad restore, subtracted)": restore_only,
        },
        repeats=repeats,
        device=device,
    )
    restore = res.pop("(grad restore, subtracted)")["median_s"]
    res["torch pipeline"]["median_s"] -= restore
    res["torch pipeline"]["min_s"] -= restore
    return res


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
    args = ap.parse_args(argv)
    try:
        sizes = [int(float(s)) for s in args.sizes.split(",")]
    except ValueError:
        ap.error(f"--sizes must be comma-separated numbers, got {args.sizes!r}")
    repeats = args.repeats
    if args.quick:
        sizes, repeats = [1_000_000, 4_000_000], 3
    info = machine()
    bw = memory_bandwidth(max(sizes) if not args.quick else 4_000_000, args.device)
    print(
        f"machine: {info['cpu']} ({info['cores']} cores, {info['torch_threads']} torch threads),"
        f" torch {info['torch']}, isa {info.get('zero_kernels_cpu_isa')}"
    )
    print(
        f"bandwidth: copy {bw['copy_GBps']} GB/s, in-place rmw {bw['rmw_GBps']} GB/s, "
        f"step pattern {bw.get('step_pattern_GBps', '-')} GB/s -> floor {bw['floor_GBps']} GB/s"
    )
    rows = []
    for n in sizes:
        plain = plain_step(n, args.device, repeats, not args.no_deepspeed)
        shard = shard_step(n, args.device, repeats)
        for kind, res, bytes_per_param in (("plain step", plain, 28), ("shard step", shard, 34)):
            for name, r in res.items():
                gbps = bytes_per_param * n / r["median_s"] / 1e9
                rows.append(
                    {
                        "kind": kind,
                        "params": n,
                        "candidate": name,
                        "median_ms": round(1e3 * r["median_s"], 3),
                        "GBps": round(gbps, 2),
                        "bw_fraction": round(gbps / bw["floor_GBps"], 3),
                    }
                )
        base = {r["candidate"]: r["median_ms"] for r in rows if r["params"] == n}
        for r in rows:
            if r["params"] == n:
                ref = (
                    base["torch AdamW fused"]
                    if r["kind"] == "plain step"
                    else base["torch pipeline"]
                )
                r["speedup_vs_torch_best"] = round(ref / r["median_ms"], 3)
        print(f"n={n:,} done", flush=True)
    keys = [
        "kind",
        "params",
        "candidate",
        "median_ms",
        "GBps",
        "bw_fraction",
        "speedup_vs_torch_best",
    ]
    print(markdown_table(rows, keys))
    name = f"adam_{args.device}" + ("_quick" if args.quick else "")
    j, c = write_results(args.out, name, {"machine": info, "bandwidth": bw}, rows)
    print(f"wrote {j} and {c}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
