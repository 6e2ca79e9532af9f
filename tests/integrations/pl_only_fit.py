"""Run by tests/integrations/test_integration_lightning.py::test_fit_with_only_pytorch_lightning
under
``python -S`` with a site-packages that has ``pytorch_lightning`` and not ``lightning``: one
process, stages 1-3 against the framework's ``DDPStrategy`` (the same losses), and stage 3's
refusal of a weight-averaging callback (the framework's own class). Prints one JSON line."""

import json
import os
import sys

import pytorch_lightning as PL
import torch
from torch import nn

try:
    import lightning  # noqa: F401

    raise SystemExit("the 'lightning' package must not be importable here")
except ImportError:
    pass

from zero_kernels.integrations.lightning import ZeroStrategy  # noqa: E402

os.environ.update(
    RANK="0",
    LOCAL_RANK="0",
    GROUP_RANK="0",
    WORLD_SIZE="1",
    LOCAL_WORLD_SIZE="1",
    MASTER_ADDR="127.0.0.1",
    MASTER_PORT=sys.argv[1],
    TORCHELASTIC_RUN_ID="zk-pl-only",
)


class Net(PL.LightningModule):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(8, 16), nn.Linear(16, 16)])
        self.head = nn.Linear(16, 1)
        self.losses: list[float] = []

    def forward(self, x):
        for b in self.blocks:
            x = torch.tanh(b(x))
        return self.head(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.1)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        x, y = torch.randn(16, 8, generator=g), torch.randn(16, 1, generator=g)
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=4)


def fit(strategy, callbacks=()):
    PL.seed_everything(0, verbose=False)
    model = Net()
    trainer = PL.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=strategy,
        max_epochs=2,
        gradient_clip_val=0.05,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=list(callbacks),
    )
    trainer.fit(model)
    return model.losses, trainer


out = {}
plain, _ = fit(PL.strategies.DDPStrategy())
for stage in (1, 2, 3):
    losses, trainer = fit(ZeroStrategy(stage=stage))
    trainer.strategy.close()
    out[f"stage{stage}"] = max(abs(a - b) for a, b in zip(losses, plain, strict=True))
try:
    fit(ZeroStrategy(stage=3), callbacks=[PL.callbacks.StochasticWeightAveraging(1e-2)])
    out["swa"] = "no error"
except NotImplementedError as e:
    out["swa"] = str(e)
print(json.dumps(out))
