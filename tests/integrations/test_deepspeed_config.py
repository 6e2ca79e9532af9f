"""DeepSpeed's ds_config.json read as policies (zero_kernels.integrations.ds_config): the example
configs of DeepSpeed's docs for ZeRO 1-3, offload and ZeRO++ (written here from the docs' JSON:
the ZeRO, ZeRO-Offload, ZeRO-Infinity, ZeRO++ and MiCS tutorials and the config-json page), key
by key; "auto" as transformers resolves it; the LR schedules against DeepSpeed's own sequences
(recorded by tests/checkpoints/fixtures/make_deepspeed_fixtures.py); the CLI; and one 2-rank
gloo run built from a config stepping equal to the same policy built by hand."""

from __future__ import annotations

import copy
import json
import os

import pytest
import torch
from torch import nn

from zero_kernels import ZeroOptimizer
from zero_kernels.integrations.ds_config import (
    build_from_deepspeed_config,
    map_deepspeed_config,
)
from zero_kernels.policy import ZeroPolicy

HERE = os.path.dirname(os.path.abspath(__file__))
SCHEDULES = os.path.join(HERE, "..", "checkpoints", "fixtures", "deepspeed", "schedules.json")

# config-json page: optimizer, scheduler, fp16 blocks
CONFIG_JSON = {
    "train_batch_size": 8,
    "gradient_accumulation_steps": 1,
    "optimizer": {
        "type": "Adam",
        "params": {"lr": 0.001, "betas": [0.8, 0.999], "eps": 1e-8, "weight_decay": 3e-7},
    },
    "scheduler": {
        "type": "WarmupLR",
        "params": {"warmup_min_lr": 0, "warmup_max_lr": 0.001, "warmup_num_steps": 1000},
    },
    "fp16": {
        "enabled": True,
        "auto_cast": False,
        "loss_scale": 0,
        "initial_scale_power": 16,
        "loss_scale_window": 1000,
        "hysteresis": 2,
        "consecutive_hysteresis": False,
        "min_loss_scale": 1,
    },
}
ZERO1 = {"zero_optimization": {"stage": 1, "reduce_bucket_size": 5e8}}
ZERO2 = {
    "zero_optimization": {
        "stage": 2,
        "allgather_partitions": True,
        "allgather_bucket_size": 5e8,
        "overlap_comm": False,
        "reduce_scatter": True,
        "reduce_bucket_size": 5e8,
        "contiguous_gradients": True,
    }
}
ZERO2_OFFLOAD = {
    "zero_optimization": {
        "stage": 2,
        "offload_optimizer": {"device": "cpu"},
        "contiguous_gradients": True,
        "overlap_comm": True,
    }
}
ZERO3_OFFLOAD = {
    "zero_optimization": {
        "stage": 3,
        "contiguous_gradients": True,
        "stage3_max_live_parameters": 1e9,
        "stage3_max_reuse_distance": 1e9,
        "stage3_prefetch_bucket_size": 1e7,
        "stage3_param_persistence_threshold": 1e5,
        "reduce_bucket_size": 1e7,
        "sub_group_size": 1e9,
        "offload_optimizer": {"device": "cpu"},
        "offload_param": {"device": "cpu"},
    }
}
ZERO_INFINITY = {
    "zero_optimization": {
        "stage": 3,
        "offload_optimizer": {
            "device": "nvme",
            "nvme_path": "/local_nvme",
            "pin_memory": True,
            "buffer_count": 4,
            "fast_init": False,
        },
        "offload_param": {
            "device": "nvme",
            "nvme_path": "/local_nvme",
            "pin_memory": True,
            "buffer_count": 5,
            "buffer_size": 1e8,
            "max_in_cpu": 1e9,
        },
    },
    "aio": {
        "block_size": 262144,
        "queue_depth": 32,
        "thread_count": 1,
        "single_submit": False,
        "overlap_events": True,
    },
}
ZEROPP = {
    "zero_optimization": {
        "stage": 3,
        "reduce_bucket_size": 10000000,
        "reduce_scatter": True,
        "zero_quantized_weights": True,
        "zero_hpz_partition_size": 16,
        "zero_quantized_gradients": True,
        "contiguous_gradients": True,
        "overlap_comm": True,
    }
}
MICS = {
    "zero_optimization": {
        "stage": 3,
        "mics_shard_size": 8,
        "mics_hierarchical_params_gather": False,
    }
}


def kinds(m) -> dict:
    return {ln.key: ln.kind for ln in m.lines}


def test_config_json_page_example():
    m = map_deepspeed_config(CONFIG_JSON | ZERO1)
    k = kinds(m)
    assert k["train_batch_size"] == "caller" and m.batch["train_batch_size"] == 8
    assert k["optimizer.type"] == "mapped" and m.optimizer_class is torch.optim.AdamW  # DS's Adam
    assert m.optimizer_kwargs == {
        "lr": 0.001,
        "betas": (0.8, 0.999),
        "eps": 1e-8,
        "weight_decay": 3e-7,
    }
    assert k["scheduler.type"] == "mapped" and m.scheduler is not None
    assert k["fp16.enabled"] == "mapped" and m.dtype is torch.float16
    assert m.options["loss_scale"] == "dynamic"
    assert m.scaler == {"loss_scale": 2.0**16, "growth_interval": 1000}
    assert k["fp16.hysteresis"] == "differs" and k["fp16.min_loss_scale"] == "same"
    assert k["fp16.auto_cast"] == "same" and k["fp16.consecutive_hysteresis"] == "same"
    assert k["zero_optimization.reduce_bucket_size"] == "mapped"
    assert m.options["bucket_size_mb"] == pytest.approx(5e8 * 4 / 2**20)
    # gradient_clipping absent: DeepSpeed 0.19 clips at 1.0 by default, said as a caller line
    assert k["gradient_clipping"] == "caller" and m.clip_grad_norm == 1.0
    assert [ln.key for ln in m.refused] == ["fp16.hysteresis"]
    with pytest.raises(NotImplementedError, match=r"fp16.hysteresis=2"):
        m.check()
    m2 = map_deepspeed_config(CONFIG_JSON | ZERO1, allow_differences=True)
    with pytest.warns(UserWarning, match="fp16.hysteresis"):
        m2.check()
    assert m2.policy().stage == 1


def test_zero2_tutorial():
    m = map_deepspeed_config(ZERO2)
    k = kinds(m)
    assert k == {
        "zero_optimization.stage": "mapped",
        "zero_optimization.allgather_partitions": "same",
        "zero_optimization.allgather_bucket_size": "speed",
        "zero_optimization.overlap_comm": "mapped",
        "zero_optimization.reduce_scatter": "same",
        "zero_optimization.reduce_bucket_size": "mapped",
        "zero_optimization.contiguous_gradients": "same",
        "gradient_clipping": "caller",
        "optimizer": "caller",
    }
    assert m.stage == 2 and m.options["overlap_comm"] is False
    assert [ln.key for ln in m.warnings] == ["zero_optimization.allgather_bucket_size"]
    with pytest.warns(UserWarning, match="allgather_bucket_size") as got:
        m.check()
    assert got[0].filename == __file__, got[0].filename  # the caller's line, not ours
    assert m.policy() == ZeroPolicy.resolve(
        stage=2, overlap_comm=False, bucket_size_mb=5e8 * 4 / 2**20
    )


def test_zero_offload_tutorial():
    m = map_deepspeed_config(ZERO2_OFFLOAD)
    assert kinds(m)["zero_optimization.offload_optimizer.device"] == "mapped"
    assert m.policy() == ZeroPolicy.resolve(stage=2, offload_optimizer="cpu", overlap_comm=True)
    assert not m.refused


def test_zero3_offload_tutorial():
    m = map_deepspeed_config(ZERO3_OFFLOAD)
    k = kinds(m)
    assert k["zero_optimization.stage3_max_live_parameters"] == "speed"
    assert k["zero_optimization.stage3_max_reuse_distance"] == "speed"
    assert k["zero_optimization.stage3_prefetch_bucket_size"] == "speed"
    assert k["zero_optimization.sub_group_size"] == "speed"
    assert k["zero_optimization.stage3_param_persistence_threshold"] == "mapped"
    assert k["zero_optimization.offload_param.device"] == "mapped"
    assert not m.refused
    assert m.policy() == ZeroPolicy.resolve(
        stage=3,
        persist_below=100000,
        bucket_size_mb=1e7 * 4 / 2**20,
        offload_optimizer="cpu",
        offload_params="cpu",
    )


def test_zero_infinity_tutorial():
    m = map_deepspeed_config(ZERO_INFINITY)
    k = kinds(m)
    assert m.options["offload_dir"] == "/local_nvme"
    assert m.options["offload_optimizer"] == "nvme" and m.options["offload_params"] == "nvme"
    for key in ("pin_memory", "buffer_count", "fast_init"):
        assert k[f"zero_optimization.offload_optimizer.{key}"] == "speed"
    for key in ("buffer_size", "max_in_cpu"):
        assert k[f"zero_optimization.offload_param.{key}"] == "speed"
    assert k["aio"] == "speed"
    assert not m.refused and m.policy().offload.offload_dir == "/local_nvme"
    # two different nvme paths: one offload_dir here, refused by name
    two = copy.deepcopy(ZERO_INFINITY)
    two["zero_optimization"]["offload_param"]["nvme_path"] = "/other"
    bad = map_deepspeed_config(two).refused
    assert [ln.key for ln in bad] == ["zero_optimization.offload_param.nvme_path"]


def test_zeropp_tutorial():
    m = map_deepspeed_config(ZEROPP)
    assert not m.refused
    assert m.policy() == ZeroPolicy.resolve(
        stage=3,
        bucket_size_mb=1e7 * 4 / 2**20,
        quantize_weights="int8",
        quantize_grads="int8",
        secondary_shard=16,
        overlap_comm=True,
    )


def test_mics_tutorial():
    m = map_deepspeed_config(MICS)
    assert not m.refused and m.options["shard_group"] == 8
    assert kinds(m)["zero_optimization.mics_hierarchical_params_gather"] == "speed"


def test_refused_keys_are_listed_in_one_error():
    cfg = {
        "zero_optimization": {
            "stage": 2,
            "cpu_offload_params": True,
            "offload_optimizer": {"device": "cpu", "ratio": 0.3},
        },
        "optimizer": {"type": "Lamb", "params": {"lr": 1e-3}},
        "scheduler": {"type": "OneCycle", "params": {}},
        "amp": {"enabled": True},
        "fp16": {"enabled": True, "loss_scale": 128},
        "some_typo": 1,
    }
    m = map_deepspeed_config(cfg)
    with pytest.raises(NotImplementedError) as e:
        m.check()
    msg = str(e.value)
    for key in (
        "zero_optimization.cpu_offload_params=True",
        "zero_optimization.offload_optimizer.ratio=0.3",
        "optimizer.type='Lamb'",
        "scheduler.type='OneCycle'",
        "amp=",
        "some_typo=1",
    ):
        assert key in msg, key
    assert "6 key(s)" in msg
    assert m.options["loss_scale"] == 128.0  # the static scale still mapped
    stage0 = map_deepspeed_config({"zero_optimization": {"stage": 0}})
    assert "DistributedDataParallel" in stage0.refused[0].becomes
    # a combination the policy refuses: said with the policy's own message
    combo = map_deepspeed_config(
        {"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}}
    )
    assert any("offload_params='cpu'" in ln.becomes for ln in combo.refused)


def test_auto_values_resolve_as_transformers():
    class Args:
        learning_rate = 3e-4
        adam_beta1, adam_beta2, adam_epsilon, weight_decay = 0.9, 0.95, 1e-6, 0.1
        max_grad_norm = 0.5
        per_device_train_batch_size, gradient_accumulation_steps = 4, 2
        warmup_steps = 7
        fp16, bf16 = False, True

    class Model(nn.Linear):
        class config:  # noqa: N801 - as a transformers model's
            hidden_size = 64

    cfg = {
        "train_batch_size": "auto",
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "bf16": {"enabled": "auto"},
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"},
        },
        "scheduler": {
            "type": "WarmupDecayLR",
            "params": {
                "warmup_min_lr": "auto",
                "warmup_max_lr": "auto",
                "warmup_num_steps": "auto",
                "total_num_steps": "auto",
            },
        },
        "zero_optimization": {
            "stage": 3,
            "reduce_bucket_size": "auto",
            "stage3_prefetch_bucket_size": "auto",
            "stage3_param_persistence_threshold": "auto",
        },
    }
    m = map_deepspeed_config(cfg, model=Model(2, 2), hf_args=Args(), num_training_steps=100)
    assert not m.refused, m.explain()
    assert m.optimizer_kwargs == {
        "lr": 3e-4,
        "betas": (0.9, 0.95),
        "eps": 1e-6,
        "weight_decay": 0.1,
    }
    assert m.clip_grad_norm == 0.5 and m.dtype is torch.bfloat16
    assert m.batch == {
        "train_batch_size": 8,
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 2,
    }
    assert m.options["bucket_size_mb"] == pytest.approx(64 * 64 * 4 / 2**20)
    assert m.options["persist_below"] == 640
    p = {ln.key: ln.value for ln in m.lines}
    assert p["scheduler.params.warmup_num_steps"] == 7
    assert p["scheduler.params.total_num_steps"] == 100
    assert p["scheduler.params.warmup_min_lr"] == 0
    # nothing to resolve from: refused by name, as transformers raises
    bare = map_deepspeed_config(
        {
            "zero_optimization": {"stage": 2, "reduce_bucket_size": "auto"},
            "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": "auto"}},
        }
    )
    assert sorted(ln.key for ln in bare.refused) == [
        "scheduler.params.total_num_steps",
        "zero_optimization.reduce_bucket_size",
    ]


def _schedules() -> list[dict]:
    with open(SCHEDULES) as f:
        return json.load(f)


@pytest.mark.parametrize("i", range(6))
def test_schedules_equal_deepspeeds(i):
    """Our LambdaLR gives the learning rate DeepSpeed's scheduler gave at every step."""
    case = _schedules()[i]
    m = map_deepspeed_config(
        {
            "zero_optimization": {"stage": 1},
            "scheduler": {"type": case["type"], "params": case["params"]},
        }
    )
    assert not m.refused, m.explain()
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=case["optimizer_lr"])
    sched = m.scheduler(opt)
    got = []
    for _ in case["lrs"]:
        got.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert got == pytest.approx(case["lrs"], rel=1e-12, abs=1e-15), (case, got)


def test_explain_cli(tmp_path, capsys):
    from zero_kernels.cli.main import main

    p = tmp_path / "ds_config.json"
    p.write_text(json.dumps(ZEROPP | {"bf16": {"enabled": True}}))
    assert main(["config", "explain", str(p)]) == 0
    out = capsys.readouterr().out
    assert "zero_optimization.zero_hpz_partition_size" in out and "secondary_shard=16" in out
    assert "policy=ZeroPolicy.resolve(stage=3" in out
    p.write_text(json.dumps(CONFIG_JSON | ZERO1))
    assert main(["config", "explain", str(p)]) == 1
    assert "differs  fp16.hysteresis" in capsys.readouterr().out
    assert main(["config", "explain", str(p), "--allow-differences", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["refused"] == []
    p.write_text("{not json")
    assert main(["config", "explain", str(p)]) == 2


# ---------------------------------------------------------------------------- 2 gloo ranks
def _tiny():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 3))


RUN_CFG = {
    "gradient_clipping": 0.05,
    "optimizer": {"type": "Adam", "params": {"lr": 0.02, "betas": [0.8, 0.9], "weight_decay": 0.1}},
    "scheduler": {
        "type": "WarmupLR",
        "params": {
            "warmup_min_lr": 0.002,
            "warmup_max_lr": 0.02,
            "warmup_num_steps": 3,
            "warmup_type": "linear",
        },
    },
    "zero_optimization": {
        "stage": 2,
        "reduce_bucket_size": 40,
        "overlap_comm": True,
        "allgather_bucket_size": 40,
    },
}


def _built_run(rank: int, world: int) -> list:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # allgather_bucket_size: a speed-only warning
        a_model = _tiny()
        run = ZeroOptimizer.from_deepspeed_config(a_model, RUN_CFG)
    b_model = _tiny()
    pol = ZeroPolicy.resolve(stage=2, bucket_size_mb=40 * 4 / 2**20, overlap_comm=True)
    b_opt = ZeroOptimizer(
        b_model, torch.optim.AdamW, policy=pol, lr=0.02, betas=(0.8, 0.9), weight_decay=0.1
    )
    for g in b_opt.param_groups:
        g["lr"] = 0.02
    b_sched = torch.optim.lr_scheduler.LambdaLR(
        b_opt, lambda e: (0.002 + 0.018 * (0.0 if e < 1 else min(1.0, (e - 1) / 3))) / 0.02
    )
    out = []
    for step in range(5):
        g = torch.Generator().manual_seed(step * 10 + rank)
        x, y = torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g)
        for model, opt, sched, clip in (
            (a_model, run.optimizer, run.lr_scheduler, run.clip_grad_norm),
            (b_model, b_opt, b_sched, 0.05),
        ):
            opt.zero_grad()
            (model(x) - y).pow(2).mean().backward()
            opt.clip_grad_norm_(clip)
            opt.step()
            sched.step()
        for pa, pb in zip(a_model.parameters(), b_model.parameters()):
            assert torch.equal(pa, pb), f"step {step}: differs"
        out.append(float(run.optimizer.param_groups[0]["lr"]))
    run.optimizer.close()
    b_opt.close()
    return out


def test_built_from_config_steps_as_by_hand():
    from dist_utils import run_workers

    lrs = run_workers(_built_run, 2, timeout=120)
    assert lrs[0] == lrs[1]
    assert lrs[0] == pytest.approx([0.002, 0.008, 0.014, 0.02, 0.02])


def test_build_refuses_before_touching_the_model():
    model = _tiny()
    before = [p.clone() for p in model.parameters()]
    with pytest.raises(NotImplementedError, match="optimizer.type='Lamb'"):
        build_from_deepspeed_config(
            ZeroOptimizer,
            model,
            {
                "zero_optimization": {"stage": 1},
                "bf16": {"enabled": True},
                "optimizer": {"type": "Lamb"},
            },
        )
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_zero_for_trainer_checks_the_trainers_arguments(tmp_path):
    """ZeroTrainer's zero= from a config written for TrainingArguments(deepspeed=...): "auto"
    from the arguments, other Trainer-owned values must agree, the scheduler block refused."""
    from transformers import TrainingArguments

    from zero_kernels.integrations.ds_config import zero_for_trainer

    args = TrainingArguments(
        output_dir=str(tmp_path),
        learning_rate=3e-4,
        weight_decay=0.1,
        per_device_train_batch_size=4,
        report_to=[],
    )
    hf = {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"},
        },
        "zero_optimization": {
            "stage": 3,
            "overlap_comm": True,
            "stage3_param_persistence_threshold": 100,
        },
    }
    assert zero_for_trainer(hf, args) == ZeroPolicy.resolve(
        stage=3, overlap_comm=True, persist_below=100
    )
    bad = copy.deepcopy(hf)
    bad["optimizer"]["params"]["lr"] = 1e-3
    bad["train_micro_batch_size_per_gpu"] = 8
    bad["scheduler"] = {"type": "WarmupDecayLR", "params": {"total_num_steps": 10}}
    bad["fp16"] = {"enabled": True, "loss_scale": 128}
    with pytest.raises(NotImplementedError) as e:
        zero_for_trainer(bad, args)
    msg = str(e.value)
    for key in (
        "optimizer.params.lr=0.001",
        "train_micro_batch_size_per_gpu=8",
        "scheduler.type='WarmupDecayLR'",
        "fp16.enabled=True",
    ):
        assert key in msg, (key, msg)
    assert "says 0.0003" in msg


def test_zero_trainer_takes_the_deepspeed_file(tmp_path):
    """ZeroTrainer(zero="ds_config.json"): the file a run gave TrainingArguments(deepspeed=...),
    read as zero_for_trainer reads it; a mismatch with the Trainer's arguments raises at
    construction, naming the key."""
    import json

    from transformers import TrainingArguments

    from zero_kernels.integrations.transformers import ZeroTrainer

    args = TrainingArguments(
        output_dir=str(tmp_path), learning_rate=3e-4, use_cpu=True, report_to=[]
    )
    cfg = {
        "train_micro_batch_size_per_gpu": "auto",
        "optimizer": {"type": "AdamW", "params": {"lr": "auto"}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 100},
    }
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(cfg))
    want = ZeroPolicy.resolve(stage=3, persist_below=100)
    for given in (str(path), path, cfg):
        tr = ZeroTrainer(model=nn.Linear(4, 2), args=args, zero=given)
        assert tr.zero["policy"] == want, given
    cfg["optimizer"]["params"]["lr"] = 1e-3
    with pytest.raises(NotImplementedError, match=r"optimizer.params.lr=0.001"):
        ZeroTrainer(model=nn.Linear(4, 2), args=args, zero=cfg)
