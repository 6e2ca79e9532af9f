"""Train a GPT with tensor parallelism inside ZeRO: tp=2 x dp=2 on 4 local ranks.

torchrun --nproc-per-node 4 python/train_tp.py [--stage 1|2|3] [--steps 30]

The model is `zero_kernels.tools.tp_models.TPGPT`, split over the "tp" dim of a 2-D DeviceMesh by
`parallelize_gpt` (column-wise q/k/v and fc, row-wise o and fc_proj, sequence-parallel norms);
ZeroOptimizer shards each rank's local tensors over the "dp" dim (docs/tensor_parallel.md). Both
ranks of a tp pair read the same batch; the two dp ranks read different ones. On CPUs over gloo
(a GPU node: pass --device cuda, one GPU per rank).
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from zero_kernels import ZeroOptimizer
from zero_kernels.policy import ZeroPolicy
from zero_kernels.tools.models import GPTConfig, get_batch, load_corpus
from zero_kernels.tools.tp_models import TPGPT, parallelize_gpt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--stage", type=int, default=2, choices=[1, 2, 3])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    args = ap.parse_args()
    if "WORLD_SIZE" not in os.environ:
        raise SystemExit("run under torchrun: torchrun --nproc-per-node 4 python/train_tp.py")
    world = int(os.environ["WORLD_SIZE"])
    if world % args.tp:
        raise SystemExit(f"--tp {args.tp} must divide the {world} ranks")
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    mesh = init_device_mesh(args.device, (world // args.tp, args.tp), mesh_dim_names=("dp", "tp"))

    cfg = GPTConfig(vocab_size=256, block_size=64, n_layer=4, n_head=4, n_embd=128)
    torch.manual_seed(0)  # the same init on every rank: each tp rank keeps its slice
    model = parallelize_gpt(TPGPT(cfg).to(args.device), mesh["tp"])
    opt = ZeroOptimizer(
        model,
        torch.optim.AdamW,
        policy=ZeroPolicy.resolve(stage=args.stage),
        process_group=mesh["dp"].get_group(),  # or the 2-D mesh itself
        lr=3e-3,
        weight_decay=0.1,
    )
    data = load_corpus()
    dp_rank = mesh["dp"].get_local_rank()
    for step in range(args.steps):
        x, y = get_batch(data, 8, cfg.block_size, seed=0, step=step, rank=dp_rank)
        loss = model(x.to(args.device), y.to(args.device))
        loss.backward()
        norm = opt.clip_grad_norm_(1.0)  # the whole model's norm, across tp and dp
        opt.step()
        opt.zero_grad()
        if dist.get_rank() == 0 and (step % 10 == 0 or step == args.steps - 1):
            print(f"step {step:3d}  loss {loss.item():.4f}  grad norm {float(norm):.3f}")
    w = opt.full_param(model.blocks[0].fc.weight)  # whole tensors, gathered over dp and tp
    if dist.get_rank() == 0:
        print(
            f"fc.weight of block 0: whole shape {tuple(w.shape)}; stage {args.stage}, "
            f"dp {world // args.tp} x tp {args.tp}"
        )
    opt.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
