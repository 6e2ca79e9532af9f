"""Step time at world size 2 (gloo, CPU), side by side in one run: DDP, torch's
ZeroRedundancyOptimizer, zero_kernels ZeroOptimizer stage 1 and 2 (and DeepSpeed ZeRO 1/2 when
importable: not installed here). Variants are interleaved step by step (A B A B ...) in the same
processes; medians over repeats. Also reports ZeroOptimizer's exposed communication time (waiting
on reduce-scatters after backward and on all-gathers after the step) and per-rank bytes.

    python bench/bench_stages.py [--layers 6 --d 320 --vocab 8192 --tokens 128 --repeats 6]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


class GPT(nn.Module):
    def __init__(self, vocab, d, layers):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(nn.TransformerEncoderLayer(d, 4, 4 * d, dropout=0.0,
                                                               batch_first=True, norm_first=True)
                                    for _ in range(layers))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x):
        h = self.emb(x)
        mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1])
        for b in self.blocks:
            h = b(h, src_mask=mask, is_causal=True)
        return self.head(self.norm(h))


def worker(rank, world, port, args, q):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=300))
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    from zero_kernels import ZeroOptimizer

    torch.manual_seed(0)
    base = GPT(args.vocab, args.d, args.layers)
    psi = sum(p.numel() for p in base.parameters())
    kw = dict(lr=1e-4, weight_decay=0.01)
    variants = {}
    m = copy.deepcopy(base)
    variants["ddp"] = (DDP(m), torch.optim.AdamW(m.parameters(), **kw), m)
    m = copy.deepcopy(base)
    variants["torch_zero_redundancy"] = (
        DDP(m), ZeroRedundancyOptimizer(m.parameters(), torch.optim.AdamW, **kw), m)
    for stage in (1, 2):
        m = copy.deepcopy(base)
        variants[f"ours_stage{stage}"] = (m, ZeroOptimizer(m, torch.optim.AdamW, stage=stage,
                                                           bucket_size_mb=args.bucket_mb, **kw), m)
    times = {k: [] for k in variants}
    g = torch.Generator().manual_seed(rank)
    for rep in range(args.warmup + args.repeats):
        x = torch.randint(0, args.vocab, (args.batch, args.tokens), generator=g)
        for name, (fwd, opt, _) in variants.items():
            if name.startswith("ours") and rep == args.warmup:
                opt.reset_comm_stats()
            dist.barrier()
            t0 = time.perf_counter()
            opt.zero_grad()
            out = fwd(x)
            loss = nn.functional.cross_entropy(out[:, :-1].reshape(-1, args.vocab),
                                               x[:, 1:].reshape(-1))
            loss.backward()
            opt.step()
            dt = time.perf_counter() - t0
            if rep >= args.warmup:
                times[name].append(dt)
    res = {"psi": psi, "median_step_s": {k: statistics.median(v) for k, v in times.items()},
           "all_step_s": times}
    for stage in (1, 2):
        opt = variants[f"ours_stage{stage}"][1]
        cs = opt.comm_stats
        res[f"ours_stage{stage}_comm"] = {**cs, "exposed_comm_s_per_step":
                                          cs["exposed_comm_s"] / max(cs["steps"], 1)}
        res[f"ours_stage{stage}_memory"] = opt.memory_report()
    q.put((rank, res))
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--d", type=int, default=320)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=6)
    ap.add_argument("--bucket-mb", type=float, default=25.0)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results",
                                                  "stages_ws2.json"))
    args = ap.parse_args()
    try:
        import deepspeed  # noqa: F401
        ds = "importable but not wired in this script"
    except Exception as e:  # noqa: BLE001
        ds = f"not measured: {type(e).__name__}: {e}"
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    world = 2
    ps = [ctx.Process(target=worker, args=(r, world, port, args, q)) for r in range(world)]
    for p in ps:
        p.start()
    out = dict(q.get(timeout=1800) for _ in range(world))
    for p in ps:
        p.join()
    r0 = out[0]
    med = r0["median_step_s"]
    summary = {
        "command": "python " + " ".join(sys.argv),
        "machine": f"{platform.machine()} {platform.processor() or ''} {os.cpu_count()} cores "
                   "(shared), gloo on CPU, 1 thread per rank",
        "versions": {"python": platform.python_version(), "torch": torch.__version__},
        "deepspeed": ds,
        "world_size": world,
        "params": r0["psi"],
        "median_step_s_rank0": med,
        "ratio_to_ddp": {k: v / med["ddp"] for k, v in med.items()},
        "rank0": r0,
    }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(summary, f, indent=1, default=str)
    print(json.dumps({k: summary[k] for k in ("params", "median_step_s_rank0", "ratio_to_ddp")},
                     indent=1))
    for s in (1, 2):
        print(f"stage {s}: exposed comm/step "
              f"{r0[f'ours_stage{s}_comm']['exposed_comm_s_per_step']:.4f}s, "
              f"memory {r0[f'ours_stage{s}_memory']}")


if __name__ == "__main__":
    main()
