"""Train a small MLP with FusedAdamW (one process) or ZeroOptimizer (under torchrun).

python python/train_example.py [--steps 50]
torchrun --nproc-per-node 2 python/train_example.py --stage 2   # or 1, or 3

On a GPU node each rank takes the GPU of its LOCAL_RANK (set before the process group, so NCCL
binds to it) and trains there on NCCL; elsewhere on the CPU with gloo.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch import nn

import zero_kernels


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument(
        "--stage",
        type=int,
        default=0,
        choices=[0, 1, 2, 3],
        help="0: FusedAdamW on every rank (DDP-style all-reduce); 1, 2, 3: ZeRO",
    )
    ap.add_argument("--width", type=int, default=256)
    args = ap.parse_args()

    distributed = "WORLD_SIZE" in os.environ
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)  # before the group: NCCL binds this rank to its GPU
    else:
        device = torch.device("cpu")
    if distributed:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    rank = dist.get_rank() if distributed else 0
    if rank == 0:
        backend = dist.get_backend() if distributed else "none"
        print(f"device {device}, process group backend {backend}", flush=True)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, args.width), nn.GELU(), nn.Linear(args.width, 1))
    model.to(device)  # before the optimizer: it shards the params where they are
    if args.stage == 0:
        if distributed:
            ids = [device.index] if device.type == "cuda" else None
            model = nn.parallel.DistributedDataParallel(model, device_ids=ids)
        opt = zero_kernels.FusedAdamW(model.parameters(), lr=3e-3)
    else:
        if not distributed:
            raise SystemExit("--stage 1-3 needs torchrun (e.g. torchrun --nproc-per-node 2 ...)")
        opt = zero_kernels.ZeroOptimizer(model, torch.optim.AdamW, stage=args.stage, lr=3e-3)

    gen = torch.Generator().manual_seed(1 + rank)
    w_true = torch.randn(32, 1, generator=torch.Generator().manual_seed(42))
    for step in range(1, args.steps + 1):
        x = torch.randn(64, 32, generator=gen)  # drawn on the CPU: the same data on any device
        y = torch.sin(x @ w_true)
        x, y = x.to(device), y.to(device)
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # global norm, every stage
        opt.step()
        if rank == 0 and (step == 1 or step % 10 == 0):
            print(f"step {step:4d}  loss {loss.item():.5f}", flush=True)
    if distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
