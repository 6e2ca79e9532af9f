"""Stage 3 under torch.autocast: what autocast's weight copies cost ([Note: autocast] in
zero_kernels/partition/units.py).

2 gloo ranks, a 33.5M-param MLP (16 units of Linear(1024, 1024), Tanh, Linear(1024, 1024)),
``ZeroOptimizer(stage=3)`` + AdamW, batch 4. Variants: fp32 params without autocast; fp32 params
under ``torch.autocast("cpu", torch.bfloat16)`` with autocast's cache on and off; bf16 params
(fp32 master shards) under the same autocast. Per step, rank 0's peak RSS (VmHWM, reset through
/proc/self/clear_refs at the step's start) at the end of the forward and of the backward.

    python bench/stage3_autocast.py [--out bench/results] [--tag autocast]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.multiprocessing as mp
import torch.utils.checkpoint
from torch import nn

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, ".."))

from harness import free_port, init_gloo, markdown_table, run_info, write_results  # noqa: E402

MB = 1e6
VARIANTS = ("fp32", "autocast", "autocast_nocache", "bf16_params_autocast")
# --variants also takes: *_ckpt (every unit under non-reentrant activation checkpointing) and
# autocast_ckpt_clear (the same, autocast's cache cleared after each unit's forward)


def _hwm() -> int:
    with open("/proc/self/status") as f:
        return next(int(ln.split()[1]) * 1024 for ln in f if ln.startswith("VmHWM"))


def _reset_hwm() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


class MLP(nn.Module):
    def __init__(self, d: int, n: int, ckpt: bool = False):
        super().__init__()
        self.ckpt = ckpt
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(d, d), nn.Tanh(), nn.Linear(d, d)) for _ in range(n)
        )

    def forward(self, x):
        for b in self.blocks:
            if self.ckpt:
                x = torch.utils.checkpoint.checkpoint(b, x, use_reentrant=False)
            else:
                x = b(x)
        return x


def worker(rank, port, variant, args, q):
    import warnings

    from zero_kernels import ZeroOptimizer

    init_gloo(rank, 2, port)
    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    m = MLP(args.d, args.units, ckpt="_ckpt" in variant)
    if variant.endswith("_clear"):
        for b in m.blocks:
            b.register_forward_hook(lambda *a: torch.clear_autocast_cache())
    if variant.startswith("bf16"):
        m = m.to(torch.bfloat16)
    zo = ZeroOptimizer(m, torch.optim.AdamW, stage=3, lr=1e-4)
    x = torch.randn(4, args.d, generator=torch.Generator().manual_seed(rank))
    rows = []
    for step in range(args.steps):
        _reset_hwm()
        start = _hwm()
        if variant.startswith("fp32"):
            out = m(x)
        else:
            with torch.autocast(
                "cpu", dtype=torch.bfloat16, cache_enabled="nocache" not in variant
            ):
                out = m(x.to(next(m.parameters()).dtype))
        fwd = _hwm()
        out.float().pow(2).mean().backward()
        bwd = _hwm()
        zo.step()
        zo.zero_grad()
        rows.append(
            {"step": step, "start_MB": start / MB, "fwd_peak_MB": fwd / MB, "bwd_peak_MB": bwd / MB}
        )
    if rank == 0:
        q.put(rows)
    zo.close()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    ap.add_argument("--tag", default="autocast")
    ap.add_argument("--d", type=int, default=1024)
    ap.add_argument("--units", type=int, default=16)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    table = []
    for v in args.variants.split(","):
        q = ctx.Queue()
        port = free_port()
        procs = [ctx.Process(target=worker, args=(r, port, v, args, q)) for r in range(2)]
        for p in procs:
            p.start()
        rows = q.get(timeout=600)
        for p in procs:
            p.join(60)
            if p.exitcode != 0:
                raise RuntimeError(f"{v}: a rank exited with {p.exitcode}")
        for r in rows:
            table.append(
                {
                    "variant": v,
                    **{k: round(x, 1) if isinstance(x, float) else x for k, x in r.items()},
                }
            )
        print(v, rows[0], rows[-1], flush=True)
    params = sum(p.numel() for p in MLP(args.d, args.units).parameters())
    payload = {**run_info(os.path.basename(__file__)), "config": vars(args), "params": params}
    print(markdown_table(table, ["variant", "step", "start_MB", "fwd_peak_MB", "bwd_peak_MB"]))
    write_results(args.out, f"stage3_{args.tag}", payload, table)


if __name__ == "__main__":
    main()
