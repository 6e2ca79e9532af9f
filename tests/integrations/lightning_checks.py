"""Checks of `zero_kernels.integrations.lightning.ZeroStrategy` run on spawned gloo ranks
(tests/integrations/test_integration_lightning.py).

Lightning is made to believe torchrun launched the ranks (RANK, LOCAL_RANK, WORLD_SIZE,
TORCHELASTIC_RUN_ID: `TorchElasticEnvironment`, no launcher of its own) and finds the process
group already initialised by the harness. Every run: a tiny MLP whose hidden layers are an
``nn.ModuleList`` (stage 3 units), AdamW with weight decay and a StepLR, 16 samples per rank
in batches of 4, ``accumulate_grad_batches=2`` (2 optimizer steps per epoch), 3 epochs,
``gradient_clip_val`` small enough to clip every step. The losses of every micro-batch are
recorded per rank.
"""

from __future__ import annotations

import math
import os
from contextlib import contextmanager

import torch
from dist_utils import run_checks
from torch import nn

EPOCHS = 3
CLIP = 0.05


def _env(rank: int, world: int) -> None:
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        GROUP_RANK="0",
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT="29500",  # unused: the process group exists
        TORCHELASTIC_RUN_ID="zk-lightning-checks",
    )


def _module(L, **kw):
    """A LightningModule class of framework ``L`` (lightning or pytorch_lightning)."""

    class Net(L.LightningModule):
        def __init__(self, manual=False, no_opt=False, zero_opt=False, after_step=False):
            super().__init__()
            self.blocks = nn.ModuleList([nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 16)])
            self.head = nn.Linear(16, 1)
            self.automatic_optimization = not manual
            self.no_opt, self.zero_opt = no_opt, zero_opt
            self.after_step: list[float] | None = [] if after_step else None
            self.losses: list[float] = []
            self.val_losses: list[float] = []

        def forward(self, x):
            for b in self.blocks:
                x = torch.tanh(b(x))
            return self.head(x)

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = nn.functional.mse_loss(self(x).float(), y.float())
            self.losses.append(loss.item())
            if self.automatic_optimization:
                return loss
            # manual: 2 micro-batches per step, clipped by norm, the scheduler per step
            opt, sched = self.optimizers(), self.lr_schedulers()
            self.manual_backward(loss / 2)
            if batch_idx % 2 == 1:
                self.clip_gradients(opt, gradient_clip_val=CLIP, gradient_clip_algorithm="norm")
                opt.step()
                opt.zero_grad()
                sched.step()
                if self.after_step is not None:  # the model again, inside the same step
                    with torch.no_grad():
                        self.after_step.append(nn.functional.mse_loss(self(x), y).item())

        def validation_step(self, batch, batch_idx):
            x, y = batch
            self.val_losses.append(nn.functional.mse_loss(self(x).float(), y.float()).item())

        def configure_optimizers(self):
            opt = torch.optim.AdamW(self.parameters(), lr=2e-2, weight_decay=0.1)
            if self.no_opt:
                return None
            if self.zero_opt:
                import zero_kernels

                return zero_kernels.ZeroOptimizer(self, torch.optim.AdamW, stage=2, lr=1e-2)
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    return Net


def _data(world: int):
    g = torch.Generator().manual_seed(123)
    x = torch.randn(16 * world, 8, generator=g)
    y = torch.randn(16 * world, 1, generator=g)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=4)


def _fit(
    L,
    strategy,
    world,
    *,
    seed=0,
    ckpt_dir=None,
    ckpt_path=None,
    precision=None,
    clip=CLIP,
    accum=2,
    trainer_kw=None,
    top_k=-1,
    **kw,
):
    """Fit a fresh model (built after ``seed_everything(seed)``): (losses, model, trainer)."""
    trainer_kw = dict(trainer_kw or {})
    L.seed_everything(seed, verbose=False)
    model = _module(L)(**kw)
    callbacks = list(trainer_kw.pop("callbacks", []))
    if ckpt_dir is not None:
        callbacks.append(
            L.callbacks.ModelCheckpoint(dirpath=ckpt_dir, every_n_epochs=1, save_top_k=top_k)
        )
    trainer = L.Trainer(
        accelerator="cpu",
        devices=world,
        strategy=strategy,
        max_epochs=EPOCHS,
        accumulate_grad_batches=accum,
        gradient_clip_val=clip,
        precision=precision,
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
        enable_checkpointing=ckpt_dir is not None,
        callbacks=callbacks,
        num_sanity_val_steps=0,
        limit_val_batches=2,
        **trainer_kw,
    )
    L.seed_everything(1, verbose=False)  # the RNG the run starts from: the same for every run
    trainer.fit(model, _data(world), _data(world), ckpt_path=ckpt_path)
    return model.losses, model, trainer


def _rel(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b), (len(a), len(b))
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b))


_STATE: dict = {}


def _lightning():
    import lightning.pytorch as L

    import zero_kernels.integrations.lightning  # noqa: F401  (registers the names)

    return L


@contextmanager
def _count_clips():
    """How often `ZeroOptimizer.clip_grad_norm_` runs inside the block."""
    import zero_kernels

    cls, calls = zero_kernels.ZeroOptimizer, []
    orig = cls.clip_grad_norm_

    def counted(self, *a, **k):
        calls.append(a)
        return orig(self, *a, **k)

    cls.clip_grad_norm_ = counted
    try:
        yield calls
    finally:
        cls.clip_grad_norm_ = orig


def check_stages_match_ddp(rank, world):
    """Stages 1-3 (by registered name) give DDP's per-micro-batch losses within 1e-5, the
    validation losses too; the clipping is the ZeroOptimizer's, once per optimizer step; with
    gradient_clip_algorithm="value" too."""
    L = _lightning()
    from zero_kernels.integrations.lightning import ZeroStrategy

    ddp, ddp_model, _ = _fit(L, "ddp", world)
    out = {}
    for stage in (1, 2, 3):
        ckpt = os.path.join(_STATE["dir"], f"s{stage}") if stage > 1 else None
        top_k = 1 if stage == 2 else -1  # stage 2: each new checkpoint removes the one before
        with _count_clips() as clips:
            got, model, trainer = _fit(
                L, f"zero_kernels_stage_{stage}", world, ckpt_dir=ckpt, top_k=top_k
            )
        assert len(clips) == EPOCHS * 2 and clips[0] == (CLIP,), clips
        opt = trainer.strategy.zero_optimizer
        assert type(trainer.strategy).__name__ == "ZeroStrategy"
        assert opt is not None and opt.sharded_state.stage == stage
        assert trainer.global_step == EPOCHS * 2, trainer.global_step
        out[f"stage{stage}"] = _rel(got, ddp)
        assert out[f"stage{stage}"] < 1e-5, (stage, out[f"stage{stage}"], got, ddp)
        out[f"stage{stage}_val"] = _rel(model.val_losses, ddp_model.val_losses)
        assert out[f"stage{stage}_val"] < 1e-5, (model.val_losses, ddp_model.val_losses)
        _STATE[f"s{stage}"] = got
        if stage == 2:
            trainer.strategy.barrier()
            assert os.listdir(ckpt) == [f"epoch={EPOCHS - 1}-step={EPOCHS * 2}.ckpt"]
        if stage == 3:  # after fit: the optimizer is alive, a save still works (collective)
            final = os.path.join(_STATE["dir"], "final.ckpt")
            for _ in range(2):  # saved again: replaced, its old side file removed
                trainer.save_checkpoint(final)
            names = sorted(os.listdir(final))
            assert len(names) == 3 and names[0] == "latest", names
            assert names[1].startswith("lightning-") and names[2].startswith("step-00000006"), names
        trainer.strategy.close()  # collective: every rank
    # the clipping acted: without it the losses after the first step differ
    noclip = _fit(L, "zero_kernels_stage_2", world, clip=0.0)[0]
    assert _rel(noclip[2:], ddp[2:]) > 1e-3
    # clipping by value (clip_grad_value_ on the ShardedGrads; refused before): DDP's losses
    by_value = {"gradient_clip_algorithm": "value"}
    ddp_v = _fit(L, "ddp", world, clip=0.01, trainer_kw=by_value)[0]
    assert _rel(ddp_v[2:], ddp[2:]) > 1e-3  # it acted
    for stage in (1, 2, 3):
        got = _fit(L, ZeroStrategy(stage=stage), world, clip=0.01, trainer_kw=by_value)[0]
        out[f"stage{stage}_value_clip"] = _rel(got, ddp_v)
        assert out[f"stage{stage}_value_clip"] < 1e-5, (stage, got, ddp_v)
    return out


def check_fp16_loss_scaler(rank, world):
    """16-mixed with a GradScaler (its inf check agreed by every rank) at stage 3 gives DDP's
    losses (CPU fp16 autocast, the plugin built by hand: Lightning picks bf16 on the CPU)."""
    L = _lightning()
    from lightning.pytorch.plugins.precision import MixedPrecision

    def plugin():
        return MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))

    ddp, _, t0 = _fit(L, "ddp", world, trainer_kw={"plugins": [plugin()]})
    got, _, t1 = _fit(L, "zero_kernels_stage_3", world, trainer_kw={"plugins": [plugin()]})
    t1.strategy.close()
    # the scale went down after the first steps' infs (65536 at the start), equally
    assert t0.precision_plugin.scaler.get_scale() == t1.precision_plugin.scaler.get_scale()
    gap = _rel(got, ddp)
    assert gap < 1e-5, (gap, got, ddp)
    return {"gap": gap, "scale": t1.precision_plugin.scaler.get_scale()}


def check_resume_fp32(rank, world):
    """Stage 3: fit from the epoch-0 checkpoint of the uninterrupted run (a model built from
    another seed) repeats its later losses within 1e-6; loops, epoch and step are restored."""
    L = _lightning()
    full = _STATE["s3"]
    path = os.path.join(_STATE["dir"], "s3", "epoch=0-step=2.ckpt")
    assert os.path.isdir(path), sorted(os.listdir(os.path.dirname(path)))
    got, model, trainer = _fit(L, "zero_kernels_stage_3", world, seed=7, ckpt_path=path)
    assert trainer.global_step == EPOCHS * 2 and trainer.current_epoch == EPOCHS
    per_epoch = len(full) // EPOCHS
    gap = _rel(got, full[per_epoch:])
    assert gap < 1e-6, (gap, got, full)
    lr = trainer.strategy.zero_optimizer.param_groups[0]["lr"]
    assert math.isclose(lr, 2e-2 * 0.5**3), lr  # the scheduler resumed with the optimizer
    trainer.strategy.close()
    # into stage 1: the same losses as the uninterrupted stage-3 run, up to reduction order
    got1, _, trainer = _fit(L, "zero_kernels_stage_1", world, seed=7, ckpt_path=path)
    trainer.strategy.close()
    gap1 = _rel(got1, full[per_epoch:])
    assert gap1 < 1e-5, (gap1, got1, full)
    return {"gap": gap, "gap_into_stage1": gap1}


def check_resume_bf16_params(rank, world):
    """bf16-true at stage 2: the resume repeats the uninterrupted run within 1e-6."""
    L = _lightning()
    d = os.path.join(_STATE["dir"], "bf16")
    full, model, trainer = _fit(L, "zero_kernels_stage_2", world, ckpt_dir=d, precision="bf16-true")
    assert next(model.parameters()).dtype == torch.bfloat16
    trainer.strategy.close()
    path = os.path.join(d, "epoch=1-step=4.ckpt")
    got, _, trainer = _fit(
        L, "zero_kernels_stage_2", world, seed=5, ckpt_path=path, precision="bf16-true"
    )
    trainer.strategy.close()
    gap = _rel(got, full[2 * len(full) // EPOCHS :])
    assert gap < 1e-6, (gap, got, full)
    return {"gap": gap}


def check_after_fit(rank, world):
    """After fit the ZeroOptimizer stays alive: ``trainer.test`` and ``validate`` run through
    it (stage 3: sharded params), a second trainer's fit on the same module closes it first;
    the test losses are DDP's; ``close()`` gives whole, finite params back."""
    L = _lightning()

    class Tested(_module(L)):
        def test_step(self, batch, batch_idx):
            x, y = batch
            self.test_losses.append(nn.functional.mse_loss(self(x), y).item())

    out = {}
    for strategy in ("ddp", "zero_kernels_stage_3"):
        L.seed_everything(0, verbose=False)
        model = Tested()
        model.test_losses = []
        for _ in range(2):  # a second trainer on the same model
            trainer = L.Trainer(
                accelerator="cpu",
                devices=world,
                strategy=strategy,
                max_epochs=1,
                enable_progress_bar=False,
                enable_model_summary=False,
                logger=False,
                enable_checkpointing=False,
            )
            trainer.fit(model, _data(world))
            trainer.test(model, _data(world), verbose=False)
            trainer.validate(model, _data(world), verbose=False)
        out[strategy] = model.test_losses
    trainer.strategy.close()
    assert all(torch.isfinite(v).all() for v in model.state_dict().values())
    gap = _rel(out["zero_kernels_stage_3"], out["ddp"])
    assert gap < 1e-5, (gap, out)
    return {"gap": gap}


def _raises(fn, exc, *words) -> str:
    try:
        fn()
    except exc as e:
        msg = str(e)
        missing = [w for w in words if w not in msg]
        assert not missing, f"{missing} not in {msg!r}"
        return msg
    raise AssertionError(f"{fn} did not raise {exc.__name__}")


def check_manual_optimization(rank, world):
    """``automatic_optimization = False``: the user's manual_backward (2 micro-batches
    accumulated), clip_gradients, opt.step, zero_grad and scheduler give DDP's losses at stages
    1-3, and the model called again after the step inside the same training step gives DDP's
    values at stages 1/2; at stage 3, where the step reshards the root unit, that call raises
    (the head's params are in the root unit) instead of reading placeholders."""
    L = _lightning()

    kw = dict(manual=True, clip=None, accum=1)  # the Trainer's clip/accumulation: automatic only
    ddp, ddp_model, _ = _fit(L, "ddp", world, after_step=True, **kw)
    out = {}
    for stage in (1, 2, 3):
        s = f"zero_kernels_stage_{stage}"
        with _count_clips() as clips:
            got, model, trainer = _fit(L, s, world, after_step=stage < 3, **kw)
        assert len(clips) == EPOCHS * 2 and clips[0] == (CLIP,), clips
        assert trainer.global_step == EPOCHS * 2, trainer.global_step
        assert trainer.strategy.zero_optimizer.sharded_state.stage == stage
        out[f"stage{stage}"] = _rel(got, ddp)
        assert out[f"stage{stage}"] < 1e-5, (stage, got, ddp)
        if stage < 3:
            out[f"stage{stage}_after_step"] = _rel(model.after_step, ddp_model.after_step)
            assert out[f"stage{stage}_after_step"] < 1e-5, (model.after_step, ddp_model.after_step)
        trainer.strategy.close()
    _raises(
        lambda: _fit(L, "zero_kernels_stage_3", world, after_step=True, **kw),
        RuntimeError,
        "'module.head'",
        "root unit",
    )
    # each step moved the params: the batch's loss after it differs from the one before it
    before = ddp_model.losses[1::2]
    assert all(abs(a - b) > 1e-6 for a, b in zip(ddp_model.after_step, before)), before
    return out


def check_errors_at_fit(rank, world):
    """What the strategy cannot honour raises at fit, on every rank, naming the setting."""
    L = _lightning()
    from zero_kernels.integrations.lightning import ZeroStrategy

    s = "zero_kernels_stage_2"
    _raises(lambda: _fit(L, s, world, no_opt=True), ValueError, "no optimizer")
    _raises(lambda: _fit(L, s, world, zero_opt=True), TypeError, "plain")

    def bad_precision():
        from lightning.pytorch.plugins.precision import DeepSpeedPrecision

        trainer = L.Trainer(
            accelerator="cpu",
            devices=world,
            strategy=ZeroStrategy(stage=1),
            plugins=[DeepSpeedPrecision("32-true")],
            max_steps=1,
            enable_progress_bar=False,
            logger=False,
        )
        trainer.fit(_module(L)(), _data(world))

    _raises(bad_precision, NotImplementedError, "DeepSpeedPrecision")
    # a callback that averages the params between steps, at stage 3 (NaN placeholders there)
    for cb in (L.callbacks.EMAWeightAveraging(), L.callbacks.StochasticWeightAveraging(1e-2)):
        _raises(
            lambda cb=cb: _fit(L, ZeroStrategy(stage=3), world, trainer_kw={"callbacks": [cb]}),
            NotImplementedError,
            type(cb).__name__,
            "stage 3",
        )
    _raises(
        lambda: _fit(L, s, world, ckpt_path=__file__), ValueError, "ckpt_path=", "not a directory"
    )
    # a run after the failures still matches
    got, _, trainer = _fit(L, s, world)
    trainer.strategy.close()
    assert _rel(got, _STATE["s2"]) == 0.0
    return {}


def check_pytorch_lightning(rank, world):
    """The pytorch_lightning package: its own class and registry; its stage 2 run gives the
    lightning run's losses exactly."""
    import pytorch_lightning as PL

    from zero_kernels.integrations.lightning import PyTorchLightningZeroStrategy

    assert PL.strategies.StrategyRegistry["zero_kernels_stage_3"]["strategy"] is (
        PyTorchLightningZeroStrategy
    )
    got, _, trainer = _fit(PL, "zero_kernels_stage_2", world)
    assert isinstance(trainer.strategy, PyTorchLightningZeroStrategy)
    trainer.strategy.close()
    gap = _rel(got, _STATE["s2"])
    assert gap == 0.0, (gap, got, _STATE["s2"])
    return {}


CHECKS = [
    check_stages_match_ddp,
    check_fp16_loss_scaler,
    check_resume_fp32,
    check_resume_bf16_params,
    check_after_fit,
    check_manual_optimization,
    check_errors_at_fit,
    check_pytorch_lightning,
]


def worker(rank: int, world: int, directory: str, names: list[str] | None = None) -> dict:
    _env(rank, world)
    _STATE.clear()
    _STATE["dir"] = directory
    import warnings

    warnings.filterwarnings("ignore")
    return run_checks(rank, world, [c for c in CHECKS if names is None or c.__name__ in names])
