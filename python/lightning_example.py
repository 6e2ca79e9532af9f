"""Train a small residual MLP with Lightning, ZeRO (stage 1-3) through `ZeroStrategy`, or DDP.

python python/lightning_example.py --devices 2 --stage 3       # Lightning starts the 2nd rank
python python/lightning_example.py --devices 2 --ddp           # the same run with DDP
python python/lightning_example.py --devices 2 --stage 3 --ckpt-dir /tmp/ck   # saves per epoch;
python python/lightning_example.py --devices 2 --stage 3 --ckpt-dir /tmp/ck --resume  # resumes
torchrun --nproc-per-node 2 python/lightning_example.py --stage 2   # or under torchrun

The change against a DDP script (2 lines; ``configure_optimizers`` returns the plain torch
optimizer, clipping, accumulation, checkpoints and ``fit(ckpt_path=...)`` stay as they are):

    +import zero_kernels.integrations.lightning  # registers zero_kernels_stage_1/2/3
    -trainer = L.Trainer(strategy="ddp", devices=2, gradient_clip_val=1.0, ...)
    +trainer = L.Trainer(strategy="zero_kernels_stage_3", devices=2, gradient_clip_val=1.0, ...)

``ZeroStrategy(stage=3, bucket_size_mb=..., ...)`` takes `ZeroOptimizer`'s options. A checkpoint
is a directory (`zero_kernels.save_checkpoint`'s, plus Lightning's loop state); it resumes at
any world size and stage.
"""

from __future__ import annotations

import argparse
import glob
import os

import torch
from torch import nn

try:
    import lightning.pytorch as L
except ImportError:  # the older package name
    import pytorch_lightning as L

import zero_kernels.integrations.lightning  # noqa: F401  (registers zero_kernels_stage_1/2/3)


class Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc = nn.Linear(width, width)

    def forward(self, x):
        return x + torch.tanh(self.fc(self.norm(x)))


class Regressor(L.LightningModule):
    """The blocks are an ``nn.ModuleList``: at stage 3 each is a unit, gathered for its own
    forward and backward; the embedding and head are the root unit."""

    def __init__(self, width: int = 64, depth: int = 4, lr: float = 3e-3):
        super().__init__()
        self.save_hyperparameters()
        self.embed = nn.Linear(16, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, 1)

    def forward(self, x):
        x = self.embed(x)
        for b in self.blocks:
            x = b(x)
        return self.head(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        self.log("loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def configure_optimizers(self):
        # a plain torch optimizer: the strategy turns it into a ZeroOptimizer of the same class
        decay = [p for n, p in self.named_parameters() if n.endswith("weight") and p.dim() > 1]
        other = [
            p for n, p in self.named_parameters() if not (n.endswith("weight") and p.dim() > 1)
        ]
        opt = torch.optim.AdamW(
            [{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}],
            lr=self.hparams.lr,
        )
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=100)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def data(n: int = 2048):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 16, generator=g)
    y = (x[:, :4].sum(1, keepdim=True) + 0.1 * torch.randn(n, 1, generator=g)).tanh()
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=32)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--stage", type=int, default=2, choices=[1, 2, 3])
    ap.add_argument("--ddp", action="store_true", help="Lightning's strategy='ddp' instead")
    ap.add_argument("--devices", type=int, default=int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--ckpt-dir", default=None, help="save a checkpoint per epoch there")
    ap.add_argument("--resume", action="store_true", help="resume from --ckpt-dir's last one")
    args = ap.parse_args()

    L.seed_everything(0)
    strategy = "ddp" if args.ddp else f"zero_kernels_stage_{args.stage}"
    callbacks = []
    if args.ckpt_dir:
        callbacks.append(L.callbacks.ModelCheckpoint(dirpath=args.ckpt_dir, save_top_k=-1))
    trainer = L.Trainer(
        accelerator="gpu" if torch.cuda.is_available() else "cpu",
        devices=args.devices,
        strategy=strategy,
        max_epochs=args.epochs,
        gradient_clip_val=1.0,
        accumulate_grad_batches=2,
        callbacks=callbacks,
        enable_checkpointing=bool(args.ckpt_dir),
        logger=False,
    )
    ckpt = None
    if args.resume:
        found = sorted(
            glob.glob(os.path.join(args.ckpt_dir or ".", "*.ckpt")), key=os.path.getmtime
        )
        ckpt = found[-1] if found else None
    model = Regressor()
    trainer.fit(model, data(), ckpt_path=ckpt)
    if trainer.is_global_zero:
        print(f"{strategy}: loss {trainer.callback_metrics['loss'].item():.5f}")


if __name__ == "__main__":
    main()
