"""Train a small MLP with Hugging Face Accelerate: DDP (``--stage 0``) or a ZeroOptimizer.

torchrun --nproc-per-node 2 python/accelerate_example.py --stage 3 --ckpt /tmp/zk-acc  # CPU: gloo
accelerate launch --multi_gpu --num_processes 2 python/accelerate_example.py --stage 2  # GPUs
(``accelerate launch --cpu`` starts one process whatever ``--num_processes``; torchrun starts
several.) Run it again with the same ``--ckpt`` to resume from the checkpoint saved halfway.

Against the DDP script, two lines change (see ``main``); ``accelerator.backward``,
``accelerator.accumulate(model)``, ``clip_grad_norm_``, the scheduler and
``accelerator.save_state`` / ``load_state`` stay as they were::

    + from zero_kernels.integrations import accelerate as zka
    - model, opt, dl, sched = accelerator.prepare(model, opt, dl, sched)
    + model, opt, dl, sched = zka.prepare(accelerator, model, opt, dl, sched, zero={"stage": 3})

With ``--ckpt DIR`` it saves halfway (``accelerator.save_state``: zero_kernels' checkpoint at
stages 1-3, accelerate's own at 0) and, started again with the same ``DIR``, resumes from there
(``accelerator.load_state``), skipping the batches already seen; the losses printed after it are
the uninterrupted run's.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import AutocastKwargs
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from zero_kernels.integrations import accelerate as zka


class MLP(nn.Module):
    """Blocks in a ModuleList: stage 3 gathers one block at a time."""

    def __init__(self, width: int):
        super().__init__()
        self.inp = nn.Linear(16, width)
        self.blocks = nn.ModuleList(nn.Linear(width, width) for _ in range(3))
        self.out = nn.Linear(width, 1)

    def forward(self, x):
        x = F.gelu(self.inp(x))
        for b in self.blocks:
            x = x + F.gelu(b(x))
        return self.out(x)


class Progress:
    """Batches trained so far, registered for checkpointing (``state_dict`` of JSON values)."""

    def __init__(self):
        self.batches = 0

    def state_dict(self) -> dict:
        return {"batches": self.batches}

    def load_state_dict(self, state: dict) -> None:
        self.batches = int(state["batches"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--stage", type=int, default=2, choices=[0, 1, 2, 3], help="0: DDP")
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--accumulation", type=int, default=2)
    ap.add_argument("--bf16", action="store_true", help="mixed_precision='bf16' (autocast)")
    ap.add_argument("--ckpt", default=None, help="save halfway here; resume from it if present")
    args = ap.parse_args()

    accelerator = Accelerator(
        cpu=not torch.cuda.is_available(),
        gradient_accumulation_steps=args.accumulation,
        mixed_precision="bf16" if args.bf16 else "no",
        # stage 3 keeps one unit gathered at a time: autocast's weight cache must be off
        kwargs_handlers=[AutocastKwargs(cache_enabled=False)],
    )
    accelerator.print(
        f"{accelerator.num_processes} processes, stage {args.stage} ({accelerator.device})"
    )
    torch.manual_seed(0)
    model = MLP(args.width)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2048, 16, generator=g)
    data = TensorDataset(x, x.sin().sum(1, keepdim=True))
    dl = DataLoader(data, batch_size=16, shuffle=False)
    batches = len(dl) // accelerator.num_processes * args.epochs
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, 3e-3, total_steps=batches + 1)

    if args.stage == 0:
        model, opt, dl, sched = accelerator.prepare(model, opt, dl, sched)
    else:  # the one line that differs from the DDP script (and the import)
        model, opt, dl, sched = zka.prepare(
            accelerator, model, opt, dl, sched, zero={"stage": args.stage}
        )

    progress = Progress()
    accelerator.register_for_checkpointing(progress)  # saved with the state, by either path
    resuming = bool(args.ckpt) and os.path.isdir(args.ckpt)
    if resuming:
        accelerator.load_state(args.ckpt)
        accelerator.print(f"resumed from {args.ckpt} at batch {progress.batches}")
    start = progress.batches
    for epoch in range(args.epochs):
        done = start - epoch * len(dl)  # batches of this epoch already trained
        if done >= len(dl):
            continue
        loader = accelerator.skip_first_batches(dl, done) if done > 0 else dl
        for xb, yb in loader:
            with accelerator.accumulate(model):
                loss = F.mse_loss(model(xb), yb)
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                sched.step()
                opt.zero_grad()
            progress.batches += 1
            if args.ckpt and not resuming and progress.batches == batches // 2:
                accelerator.save_state(args.ckpt)
                accelerator.print(f"saved at batch {progress.batches} to {args.ckpt}")
        accelerator.print(f"epoch {epoch}: loss {accelerator.reduce(loss, 'mean').item():.6f}")
    accelerator.end_training()


if __name__ == "__main__":
    main()
