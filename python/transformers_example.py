"""Fine-tune a small GPT-2 (built from a config, random tokens) with Hugging Face Trainer and ZeRO.

torchrun --nproc-per-node 2 python/transformers_example.py --stage 3 [--steps 20] [--out DIR]
torchrun --nproc-per-node 2 python/transformers_example.py --ddp     # Trainer's own DDP, to compare

Against the DDP script the change is two lines:

    from zero_kernels.integrations.transformers import ZeroTrainer   # 1
    trainer = ZeroTrainer(model=model, args=args, train_dataset=ds,  # 2: Trainer -> ZeroTrainer,
                          zero={"stage": 3})                         #    plus zero=

Checkpoints land in OUT/checkpoint-N (the sharded state in checkpoint-N/zero_kernels/); run the
same command with --resume to continue from the latest; OUT/final loads with from_pretrained.
"""

from __future__ import annotations

import argparse
import glob
import os

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from zero_kernels.integrations.transformers import ZeroTrainer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--stage", type=int, default=2, choices=[1, 2, 3])
    ap.add_argument("--ddp", action="store_true", help="plain Trainer (DDP) instead")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--out", default="zk_trainer_example")
    ap.add_argument("--resume", action="store_true", help="continue from the latest checkpoint")
    a = ap.parse_args()

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=4, n_embd=128, n_head=4, vocab_size=512))
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 512, (512, 64), generator=g)
    ds = [{"input_ids": x, "labels": x} for x in ids]
    args = TrainingArguments(
        output_dir=a.out,
        use_cpu=not torch.cuda.is_available(),
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        max_steps=a.steps,
        learning_rate=3e-4,
        weight_decay=0.1,
        max_grad_norm=1.0,
        logging_steps=5,
        save_steps=10,
        report_to=[],
    )
    if a.ddp:
        trainer = Trainer(model=model, args=args, train_dataset=ds)
    else:
        trainer = ZeroTrainer(model=model, args=args, train_dataset=ds, zero={"stage": a.stage})
    ckpts = sorted(
        glob.glob(os.path.join(a.out, "checkpoint-*")), key=lambda p: int(p.split("-")[-1])
    )
    trainer.train(resume_from_checkpoint=ckpts[-1] if a.resume and ckpts else None)
    trainer.save_model(os.path.join(a.out, "final"))  # whole tensors, also at stage 3


if __name__ == "__main__":
    main()
