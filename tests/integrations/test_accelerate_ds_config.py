"""`zero_kernels.integrations.accelerate.prepare` with ``zero=`` a DeepSpeed config, read as
accelerate's DeepSpeed plugin reads it ([Note: accelerate and a DeepSpeed config] in
zero_kernels/integrations/accelerate_ds.py).

The checkpoints real DeepSpeed wrote (tests/checkpoints/fixtures/deepspeed) are resumed under
accelerate from the config they were trained with ("auto" in place of the batch size, clipping,
lr and weight decay, filled from the data loader, accelerate's default and the DummyOptim):
the next 3 steps equal DeepSpeed's own resumed run, in this process at world size 1 and on 2
spawned gloo ranks (accelerate's data loader gives each rank DeepSpeed's rows; the config's
scheduler steps once per optimizer step, as DeepSpeed's engine steps it). The rest runs in this
process: accelerate's one-source rule for the optimizer and scheduler blocks, "auto" resolved
or refused by name, the values the Accelerator owns, and clipping left to the script."""

from __future__ import annotations

import json
import os
import pathlib
import types
import warnings

import pytest
import torch

pytest.importorskip("accelerate")

import test_deepspeed_migration as dsm  # noqa: E402
from accelerate import Accelerator  # noqa: E402
from accelerate.state import AcceleratorState, GradientState  # noqa: E402
from accelerate.utils.deepspeed import DummyOptim, DummyScheduler  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from zero_kernels.checkpoint.deepspeed import (  # noqa: E402
    load_deepspeed_checkpoint,
    read_deepspeed_checkpoint,
)
from zero_kernels.integrations import accelerate as zka  # noqa: E402
from zero_kernels.integrations.accelerate_ds import resolve_deepspeed_config  # noqa: E402


def _config(case: str) -> dict:
    """The config DeepSpeed trained ``case`` with, "auto" where accelerate can fill it."""
    cfg = read_deepspeed_checkpoint(os.path.join(dsm.DS, case)).ds_config
    cfg["train_micro_batch_size_per_gpu"] = "auto"  # the data loader's
    cfg["gradient_clipping"] = "auto"  # accelerate's 1.0 (the run's)
    cfg["optimizer"]["params"].update(lr="auto", weight_decay="auto")  # the DummyOptim's
    return cfg


def _accelerator(**kw) -> Accelerator:
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    return Accelerator(cpu=True, **kw)


@pytest.fixture
def fresh_state():
    """accelerate keeps its state in process-wide singletons: none left for the next test."""
    yield
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def resume_under_accelerate(case: str, zero, rank: int, world: int) -> dict:
    """``case``'s DeepSpeed checkpoint resumed by an accelerate script given ``zero`` (the
    config): 3 steps over accelerate's data loader; the differences from DeepSpeed's run."""
    ref = torch.load(os.path.join(dsm.DS, case, "reference.pt"), weights_only=True)
    accelerator = _accelerator()
    torch.manual_seed(5)  # other values than DeepSpeed's: the load must replace them
    model = dsm.tiny_model()
    xs = torch.cat([x for x, _ in ref["batches"]])
    ys = torch.cat([y for _, y in ref["batches"]])
    dl = DataLoader(TensorDataset(xs, ys), batch_size=12 // world, shuffle=False)
    dummy = DummyOptim(model.parameters(), lr=1e-2, weight_decay=0.01)
    model, opt, dl, sched = zka.prepare(
        accelerator, model, dummy, dl, DummyScheduler(dummy), zero=zero
    )
    dtype = next(model.parameters()).dtype
    ckpt = os.path.join(dsm.DS, case)
    load_deepspeed_checkpoint(ckpt, model, opt.optimizer, scheduler=sched.scheduler)
    losses, lrs = [], []
    for x, y in dl:
        lrs.append(opt.param_groups[0]["lr"])
        loss = (model(x.to(dtype)).float() * model.scale - y).pow(2).mean()
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(model.parameters(), opt.max_grad_norm)
        opt.step()
        sched.step()
        opt.zero_grad()
        t = loss.detach().clone()
        if world > 1:
            torch.distributed.all_reduce(t)
        losses.append(t.item() / world)
    out = {
        "dtype": str(dtype),
        "stage": opt.optimizer.stage,
        "max_grad_norm": opt.max_grad_norm,
        "after": dsm._err(model, opt.optimizer, ref["after"]),
        "loss": max(abs(a - b) for a, b in zip(losses, ref["losses"], strict=True)),
        "lr": max(abs(a - b) for a, b in zip(lrs, ref["lrs"], strict=True)),
        "steps": len(losses),
    }
    opt.optimizer.close()
    return out


def _check(r: dict, case: str) -> None:
    dt = case.split("_")[1]
    assert r["steps"] == 3, r
    assert r["stage"] == int(case[5]) and r["max_grad_norm"] == 1.0, r
    assert r["dtype"] == ("torch.bfloat16" if dt == "bf16" else "torch.float32"), r
    assert r["after"] <= dsm.TOL[dt] and r["loss"] <= dsm.LOSS_TOL[dt], r
    assert r["lr"] <= 1e-15, r


@pytest.mark.parametrize("case", ["stage2_fp32", "stage3_bf16"])
def test_deepspeed_run_resumes_under_accelerate_world_1(case, tmp_path, fresh_state):
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(_config(case)))
    zero = str(path) if case == "stage2_fp32" else pathlib.Path(path)  # a str and a Path
    _check(resume_under_accelerate(case, zero, 0, 1), case)


def _worker(rank: int, world: int) -> dict:
    # accelerate finds the process group dist_utils made through torchrun's variables
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world)
    )
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")  # unused: the group exists already
    return {
        "stage1_fp32": resume_under_accelerate("stage1_fp32", _config("stage1_fp32"), rank, world)
    }


@pytest.mark.distributed
def test_deepspeed_run_resumes_under_accelerate_world_2():
    """DeepSpeed's own split: 6 rows a rank (the "auto" batch size from the loader's 6)."""
    from dist_utils import run_workers

    for res in run_workers(_worker, 2, timeout=240):
        _check(res["stage1_fp32"], "stage1_fp32")


# ---------------------------------------------------------------------------- the rules
def _model_and_cfg(**blocks):
    model = dsm.tiny_model()
    cfg = {"zero_optimization": {"stage": 2}, "gradient_clipping": 0.5, **blocks}
    return model, cfg


ADAMW = {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.99], "weight_decay": 0.0}}
WARMUP = {"type": "WarmupLR", "params": {"warmup_num_steps": 3, "warmup_max_lr": 1e-3}}


def test_one_source_for_optimizer_and_scheduler(fresh_state):
    acc = _accelerator()
    model, cfg = _model_and_cfg(optimizer=ADAMW, scheduler=WARMUP)
    torch_opt = torch.optim.AdamW(model.parameters())
    with pytest.raises(ValueError, match=r"'optimizer' block \(type 'AdamW'\).*AdamW was given"):
        zka.prepare(acc, model, torch_opt, zero=cfg)
    dummy = DummyOptim(model.parameters())
    sched = torch.optim.lr_scheduler.LambdaLR(torch_opt, lambda s: 1.0)
    with pytest.raises(ValueError, match=r"'scheduler' block \(type 'WarmupLR'\).*LambdaLR"):
        zka.prepare(acc, model, dummy, sched, zero=cfg)
    with pytest.raises(ValueError, match=r"'scheduler' block .* no accelerate.utils.Dummy"):
        zka.prepare(acc, model, dummy, zero=cfg)
    call = DummyScheduler(dummy, lr_scheduler_callable=lambda o: None)
    with pytest.raises(ValueError, match=r"'scheduler' block .*lr_scheduler_callable"):
        zka.prepare(acc, model, dummy, call, zero=cfg)
    model, bare = _model_and_cfg()
    with pytest.raises(ValueError, match=r"DummyOptim was given .* no 'optimizer' block"):
        zka.prepare(acc, model, DummyOptim(model.parameters()), zero=bare)
    opt = torch.optim.AdamW(model.parameters())
    with pytest.raises(ValueError, match=r"DummyScheduler with no lr_scheduler_callable"):
        zka.prepare(acc, model, opt, DummyScheduler(opt), zero=bare)
    with pytest.raises(TypeError, match=r"DummyOptim given with zero=\{'stage': 2\}"):
        zka.prepare(acc, model, DummyOptim(model.parameters()), zero={"stage": 2})
    assert acc._optimizers == [] and not hasattr(acc, "_zero_kernels")  # nothing was built


def test_auto_resolved_as_accelerate_does():
    """At 2 processes (an Accelerator's fields, no process group): the loaders' smallest batch
    size, x accumulation x processes, the model's hidden size, the DummyOptim's lr and weight
    decay, the DummyScheduler's steps (total over the processes, rounded up)."""
    acc = types.SimpleNamespace(
        num_processes=2, split_batches=False, gradient_accumulation_steps=4, mixed_precision="bf16"
    )
    model = dsm.tiny_model()
    model.config = types.SimpleNamespace(hidden_size=24)
    dummy = DummyOptim(model.parameters(), lr=3e-3, weight_decay=0.1)
    keys = ("warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "total_num_steps")
    decay = {"type": "WarmupDecayLR", "params": dict.fromkeys(keys, "auto")}
    cfg = {
        "train_micro_batch_size_per_gpu": "auto",
        "train_batch_size": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto"}},
        "scheduler": decay,
        "zero_optimization": {
            "stage": 3,
            "reduce_bucket_size": "auto",
            "stage3_prefetch_bucket_size": "auto",
            "stage3_param_persistence_threshold": "auto",
        },
    }
    data = TensorDataset(torch.zeros(8, 12))
    loaders = [DataLoader(data, batch_size=4), DataLoader(data, batch_size=3)]
    sched = DummyScheduler(dummy, total_num_steps=101, warmup_num_steps=0)
    got = resolve_deepspeed_config(
        cfg, acc, model=model, optimizer=dummy, objects=[*loaders, sched]
    )
    assert got["train_micro_batch_size_per_gpu"] == 3 and got["train_batch_size"] == 24
    assert got["gradient_accumulation_steps"] == 4 and got["gradient_clipping"] == 1.0
    assert got["optimizer"]["params"] == {"lr": 3e-3, "weight_decay": 0.1}
    assert got["scheduler"]["params"] == {
        "warmup_min_lr": 0,
        "warmup_max_lr": 3e-3,
        "warmup_num_steps": 1,
        "total_num_steps": 51,
    }
    zo = got["zero_optimization"]
    assert (zo["reduce_bucket_size"], zo["stage3_prefetch_bucket_size"]) == (576, 518)
    assert zo["stage3_param_persistence_threshold"] == 240
    assert got["bf16"] == {"enabled": True}  # accelerate's plugin adds it under bf16
    assert cfg["train_batch_size"] == "auto"  # the caller's dict is left as it was


def test_auto_that_cannot_be_resolved_named(fresh_state):
    acc = _accelerator()
    model, cfg = _model_and_cfg(
        optimizer={"type": "AdamW", "params": {"lr": 1e-3, "betas": "auto"}},
        train_micro_batch_size_per_gpu="auto",
    )
    cfg["zero_optimization"]["reduce_bucket_size"] = "auto"
    with pytest.raises(ValueError) as e:
        zka.prepare(acc, model, DummyOptim(model.parameters()), zero=cfg)
    msg = str(e.value)
    assert "optimizer.params.betas: accelerate does not resolve it" in msg, msg
    assert "train_micro_batch_size_per_gpu: no data loader" in msg, msg
    assert "zero_optimization.reduce_bucket_size: the model has no config.hidden_size" in msg


def test_values_the_accelerator_owns_must_agree(fresh_state, tmp_path):
    acc = _accelerator(gradient_accumulation_steps=2, mixed_precision="bf16")
    model, cfg = _model_and_cfg(
        gradient_accumulation_steps=4,
        train_micro_batch_size_per_gpu=2,
        train_batch_size=5,
        bf16={"enabled": False},
        fp16={"enabled": True},
    )
    with pytest.raises(NotImplementedError) as e:
        zka.prepare(acc, model, torch.optim.AdamW(model.parameters()), zero=cfg)
    msg = str(e.value)
    for key in ("gradient_accumulation_steps=4", "train_batch_size=5", "bf16.enabled=False",
                "fp16.enabled=True"):  # fmt: skip
        assert key in msg, msg
    with pytest.raises(FileNotFoundError, match="nope.json"):
        zka.prepare(acc, model, torch.optim.AdamW(model.parameters()), zero=tmp_path / "nope.json")


def test_torch_optimizer_and_clipping_left_to_the_script(fresh_state, monkeypatch):
    """No optimizer block: the torch optimizer's class and groups; bf16 from mixed_precision
    casts the model (accelerate's plugin adds bf16 under bf16); clipping at the config's norm
    through accelerator.clip_grad_norm_, another max_norm refused, a step unclipped
    clipped inside it (as DeepSpeed's engine) and warned."""
    acc = _accelerator(mixed_precision="bf16")
    model, cfg = _model_and_cfg()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5)
    model, zopt, sched = zka.prepare(acc, model, opt, sched, zero=cfg)
    try:
        assert zopt.optimizer.optimizer_class is torch.optim.SGD and zopt.optimizer.stage == 2
        assert next(model.parameters()).dtype == torch.bfloat16
        assert zopt.max_grad_norm == 0.5 and zopt.param_groups[0]["lr"] == 0.05
        x = torch.randn(4, 12)

        def backward():
            acc.backward(model(x.to(torch.bfloat16)).float().pow(2).mean() * 100)

        backward()
        with pytest.raises(ValueError, match=r"max_norm=1.0\) and .*gradient_clipping=0.5"):
            acc.clip_grad_norm_(model.parameters(), 1.0)
        norm = acc.clip_grad_norm_(model.parameters(), zopt.max_grad_norm)
        assert norm > 0.5
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            zopt.step()  # clipped first: no warning
        zopt.zero_grad()
        backward()
        before = float(zopt.optimizer.clip_grad_norm_(float("inf")))  # the norm alone
        assert before > 0.5
        inner, clipped = zopt.optimizer, []

        def clip(max_norm, *a, **k):  # records what the step clips (the gradients it leaves)
            norm = type(inner).clip_grad_norm_(inner, max_norm, *a, **k)
            after = type(inner).clip_grad_norm_(inner, float("inf"))
            clipped.append((max_norm, float(norm), float(after)))
            return norm

        monkeypatch.setattr(inner, "clip_grad_norm_", clip)
        with pytest.warns(UserWarning, match=r"clipped at .* gradient_clipping=0.5"):
            zopt.step()
        # clipped inside the step, as DeepSpeed's engine does, before the update
        assert len(clipped) == 1 and clipped[0][0] == 0.5, clipped
        assert clipped[0][1] == pytest.approx(before) and clipped[0][2] == pytest.approx(
            0.5, rel=1e-3
        )
    finally:
        zopt.optimizer.close()


def test_dummy_scheduler_callable_without_a_block(fresh_state):
    """No scheduler block: the DummyScheduler's lr_scheduler_callable builds the scheduler over
    the ZeroOptimizer (DeepSpeed's client scheduler), stepped once per optimizer step."""
    acc = _accelerator()
    model, cfg = _model_and_cfg(optimizer=ADAMW)
    dummy = DummyOptim(model.parameters())
    made = []

    def make(opt):
        made.append(opt)
        return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5**s)

    model, zopt, sched = zka.prepare(
        acc, model, dummy, DummyScheduler(dummy, lr_scheduler_callable=make), zero=cfg
    )
    try:
        assert made == [zopt.optimizer] and sched.scheduler.optimizer is zopt.optimizer
        assert zopt.optimizer.optimizer_class is torch.optim.AdamW
        assert zopt.param_groups[0]["betas"] == (0.9, 0.99) and zopt.param_groups[0]["lr"] == 1e-3
        acc.backward(model(torch.randn(2, 12)).pow(2).mean())
        acc.clip_grad_norm_(model.parameters(), zopt.max_grad_norm)
        zopt.step()
        sched.step()
        assert zopt.param_groups[0]["lr"] == 5e-4  # one step, not num_processes
    finally:
        zopt.optimizer.close()


def test_gradient_clipping_zero_means_no_clip(fresh_state):
    acc = _accelerator()
    model, cfg = _model_and_cfg(gradient_clipping=0)
    model, zopt = zka.prepare(acc, model, torch.optim.AdamW(model.parameters()), zero=cfg)
    try:
        assert zopt.max_grad_norm is None
        acc.backward(model(torch.randn(2, 12)).pow(2).mean())
        with pytest.raises(ValueError, match=r"gradient_clipping=0 \(no clipping\).*'inf'"):
            acc.clip_grad_norm_(model.parameters(), 1.0)
        assert acc.clip_grad_norm_(model.parameters(), float("inf")) > 0
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            zopt.step()  # nothing to clip: no warning
    finally:
        zopt.optimizer.close()
