"""torch's ``clip_grad_norm_`` over a ZeroOptimizer's `ShardedGrad`s against
``opt.clip_grad_norm_`` and against torch's clip of a DDP model's plain gradients, on ``--world``
gloo ranks ([Note: one collective per clip] in zero_kernels/partition/grads.py).

The model: ``--layers`` Linear(``--width``, ``--width``) layers (26 layers: 52 params, the
model issue 51 cites). One backward, then the candidates in turn (A B C A B C ...), each a clip
with a max norm far above the gradients' norm (the gradients keep their values; torch's clip
still multiplies them by its clamped coefficient, 1.0, as in training). Per candidate: the median
milliseconds per clip of the slower rank, and the all-reduces one clip issues (``comm_stats``).

    python bench/bench_clip.py [--world 2] [--stage 2] [--repeats 200]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, ".."))

from harness import init_gloo, run_group  # noqa: E402

CANDIDATES = ("torch_clip", "opt_clip", "ddp_torch_clip")


def _model(args) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        *[torch.nn.Linear(args.width, args.width) for _ in range(args.layers)]
    )


def worker(rank, world, port, args, q):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from zero_kernels import ZeroOptimizer

    init_gloo(rank, world, port)
    m1, m2 = _model(args), _model(args)
    zo = ZeroOptimizer(m1, torch.optim.AdamW, stage=args.stage, lr=1e-3)
    ddp = DDP(m2)
    x = torch.randn(8, args.width, generator=torch.Generator().manual_seed(rank))
    m1(x).pow(2).mean().backward()
    ddp(x).pow(2).mean().backward()
    runs = {
        "torch_clip": lambda: torch.nn.utils.clip_grad_norm_(m1.parameters(), 1e6),
        "opt_clip": lambda: zo.clip_grad_norm_(1e6),
        "ddp_torch_clip": lambda: torch.nn.utils.clip_grad_norm_(m2.parameters(), 1e6),
    }
    times = {k: [] for k in CANDIDATES}
    calls = {}
    for k in CANDIDATES:  # warm-up, and the all-reduces of one call
        zo.reset_comm_stats()
        runs[k]()
        calls[k] = zo.comm_stats["all_reduce_calls"]
    for _ in range(args.repeats):
        for k in CANDIDATES:
            dist.barrier()
            t0 = time.perf_counter()
            runs[k]()
            times[k].append(time.perf_counter() - t0)
    zo.close()
    q.put((rank, {k: (statistics.median(v) * 1e3, calls[k]) for k, v in times.items()}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--stage", type=int, default=2)
    ap.add_argument("--layers", type=int, default=26)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=200)
    args = ap.parse_args()
    res = run_group(worker, args.world, args)
    print(
        f"world {args.world}, stage {args.stage}, {2 * args.layers} params, "
        f"torch {torch.__version__}"
    )
    print(f"{'candidate':<16} {'ms per clip':>12} {'all-reduces':>12}")
    for k in CANDIDATES:
        ms = max(r[k][0] for r in res)
        print(f"{k:<16} {ms:>12.3f} {res[0][k][1]:>12}")


if __name__ == "__main__":
    main()
