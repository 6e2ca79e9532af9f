"""Checks run inside 2 gloo workers for tests/integrations/test_integration_transformers.py:
ZeroTrainer
against Trainer's own DDP run (same seeds, data, arguments), its checkpoints and saves."""

from __future__ import annotations

import os
import tempfile

import torch
from dist_utils import run_checks

from zero_kernels.policy import CommPolicy, GatherPolicy

VOCAB, SEQ = 64, 16


def launcher_env(rank: int, world: int) -> None:
    """What torchrun sets, so that TrainingArguments/accelerate see the process group (already
    initialised by the harness: the address is not used)."""
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT="29500",
    )


def dataset(n: int = 64) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        ids = torch.randint(0, VOCAB, (SEQ,), generator=g)
        out.append({"input_ids": ids, "labels": ids})
    return out


def gpt2(seed: int = 0, dtype=torch.float32):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    cfg = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=SEQ)
    return GPT2LMHeadModel(cfg).to(dtype)


def train(cls, out: str, *, steps=6, model=None, resume=None, save_steps=None, targs=None, **kw):
    """Train; returns (trainer, per-micro-batch losses on this rank)."""
    from transformers import TrainingArguments

    losses: list[float] = []

    class Recorded(cls):
        def training_step(self, *a, **k):
            loss = super().training_step(*a, **k)
            losses.append(float(loss))
            return loss

    args = TrainingArguments(
        output_dir=out,
        use_cpu=True,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        max_steps=steps,
        max_grad_norm=0.5,  # clipping on: the grad norms here are ~1
        learning_rate=1e-3,
        weight_decay=0.1,
        warmup_steps=2,
        logging_steps=1,
        save_strategy="steps" if save_steps else "no",
        save_steps=save_steps or 500,
        report_to=[],
        disable_tqdm=True,
        log_level="error",
        seed=0,
        dataloader_num_workers=0,
        **(targs or {}),
    )
    tr = Recorded(
        model=model if model is not None else gpt2(), args=args, train_dataset=dataset(), **kw
    )
    tr.train(resume_from_checkpoint=resume)
    return tr, losses


def other_arch(kind: str, seed: int = 0):
    """A small Llama (grouped-query attention, rotary embeddings' non-persistent ``inv_freq``
    buffer, tied embeddings) or Mixtral (experts as 3-D params, a router, its auxiliary loss)."""
    from transformers import LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM

    torch.manual_seed(seed)
    common = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=SEQ,
    )
    if kind == "llama":
        return LlamaForCausalLM(LlamaConfig(tie_word_embeddings=True, **common))
    cfg = MixtralConfig(
        num_local_experts=8,
        num_experts_per_tok=2,
        output_router_logits=True,
        router_aux_loss_coef=0.01,
        **common,
    )
    return MixtralForCausalLM(cfg)


def rel(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b) and a, (len(a), len(b))
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def weights(tr) -> dict:
    return {k: v.detach().float().clone() for k, v in tr.model.state_dict().items()}


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


# the test sets it before spawning (the ranks share it)
TMP = os.environ.get("ZK_TEST_HF_DIR") or os.path.join(tempfile.gettempdir(), "zk-hf")
BASE: dict = {}


def baseline(rank, world):
    from transformers import Trainer

    tr, losses = train(Trainer, f"{TMP}/ddp")
    assert type(tr.model_wrapped).__name__ == "DistributedDataParallel"
    BASE["losses"], BASE["w"] = losses, weights(tr)
    return {"micro_batches": len(losses)}


def _parity(stage, rank, world):
    from zero_kernels.integrations.transformers import ZeroTrainer

    tr, losses = train(ZeroTrainer, f"{TMP}/z{stage}", zero={"stage": stage})
    z = tr.zero_optimizer
    assert z is not None and z.stage == stage, z
    assert tr.model_wrapped is tr.model, type(tr.model_wrapped)  # never DDP
    assert type(z.parts.core.runner.inner).__name__ == "AdamW"
    assert [g["weight_decay"] for g in z.param_groups] == [0.1, 0.0]  # Trainer's groups
    w = weights(tr)
    gap, wgap = rel(losses, BASE["losses"]), max_diff(w, BASE["w"])
    assert gap <= 1e-5, (gap, losses, BASE["losses"])
    assert wgap <= 1e-5, wgap
    return {"loss_rel": gap, "weights_abs": wgap}


def parity_stage1(rank, world):
    return _parity(1, rank, world)


def parity_stage2(rank, world):
    return _parity(2, rank, world)


def parity_stage3(rank, world):
    return _parity(3, rank, world)


def parity_llama_mixtral(rank, world):
    """Two more architectures at stage 3 against Trainer's DDP run: per-step losses and the
    final weights (a Llama; a Mixtral, whose loss holds the router's auxiliary loss)."""
    from transformers import Trainer

    from zero_kernels.integrations.transformers import ZeroTrainer

    out = {}
    for kind in ("llama", "mixtral"):
        ddp, want = train(Trainer, f"{TMP}/{kind}_ddp", steps=4, model=other_arch(kind))
        tr, got = train(
            ZeroTrainer, f"{TMP}/{kind}_z3", steps=4, model=other_arch(kind), zero={"stage": 3}
        )
        assert tr.zero_optimizer.stage == 3 and tr.model_wrapped is tr.model
        gap, wgap = rel(got, want), max_diff(weights(tr), weights(ddp))
        assert gap <= 1e-5, (kind, gap, got, want)
        assert wgap <= 1e-5, (kind, wgap)
        out[kind] = {"loss_rel": gap, "weights_abs": wgap}
    return out


def lora_shard_frozen(rank, world):
    """PEFT's LoRA over a Llama through ZeroTrainer at stage 3 with shard_frozen=True, against
    Trainer's DDP run: per-step losses, every weight (the frozen base's included), and
    ``save_model`` (PEFT's adapter file, read through the model's gathered state dict)."""
    from peft import LoraConfig, get_peft_model
    from safetensors.torch import load_file
    from transformers import Trainer

    from zero_kernels.integrations.transformers import ZeroTrainer

    def lora():
        cfg = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"])
        m = get_peft_model(other_arch("llama"), cfg)
        for n, p in m.named_parameters():  # B starts at zero in PEFT: A would get no gradient
            if "lora_B" in n:
                torch.nn.init.normal_(p, std=0.05, generator=torch.Generator().manual_seed(len(n)))
        return m

    ddp, want = train(Trainer, f"{TMP}/lora_ddp", steps=4, model=lora())
    zero = {"stage": 3, "gather": GatherPolicy(shard_frozen=True)}
    tr, got = train(ZeroTrainer, f"{TMP}/lora_z3", steps=4, model=lora(), zero=zero)
    core = tr.zero_optimizer.parts.core
    assert len(core.frozen) > 10 and all(not p.requires_grad for p in core.frozen.values())
    gap, wgap = rel(got, want), max_diff(weights(tr), weights(ddp))
    assert gap <= 1e-5, (gap, got, want)
    assert wgap <= 1e-5, wgap
    tr.save_model(f"{TMP}/lora_z3/final")
    ddp.save_model(f"{TMP}/lora_ddp/final")
    if rank == 0:
        a = load_file(f"{TMP}/lora_z3/final/adapter_model.safetensors")
        b = load_file(f"{TMP}/lora_ddp/final/adapter_model.safetensors")
        assert a.keys() == b.keys() and len(a) == 12, sorted(a)  # 2 layers x 3 x (A, B)
        assert max(float((a[k] - b[k]).abs().max()) for k in a) <= 1e-5
    return {"loss_rel": gap, "weights_abs": wgap}


def evaluate_stage3(rank, world):
    """eval_strategy="steps": evaluations between optimizer steps (no-grad forwards of the
    sharded model) give Trainer's DDP eval losses, and training goes on as DDP's."""
    from transformers import Trainer, TrainerCallback

    from zero_kernels.integrations.transformers import ZeroTrainer

    class Evals(TrainerCallback):
        def __init__(self):
            self.losses = []

        def on_evaluate(self, args, state, control, metrics=None, **kw):
            self.losses.append(metrics["eval_loss"])

    ev = {"eval_strategy": "steps", "eval_steps": 2, "per_device_eval_batch_size": 3}
    runs = {}
    for name, cls, kw in (("ddp", Trainer, {}), ("z3", ZeroTrainer, {"zero": {"stage": 3}})):
        cb = Evals()
        tr, losses = train(
            cls, f"{TMP}/eval_{name}", targs=ev, eval_dataset=dataset(10), callbacks=[cb], **kw
        )
        runs[name] = (losses, cb.losses, weights(tr))
    (got, got_ev, w), (want, want_ev, w_ddp) = runs["z3"], runs["ddp"]
    assert len(got_ev) == len(want_ev) == 3, (got_ev, want_ev)
    gaps = (rel(got, want), rel(got_ev, want_ev), max_diff(w, w_ddp))
    assert gaps[0] <= 1e-5 and gaps[1] <= 1e-5 and gaps[2] <= 1e-5, gaps
    return {"loss_rel": gaps[0], "eval_loss_rel": gaps[1], "weights_abs": gaps[2]}


def _resume(stage, dtype, stage_after=None):
    """checkpoint-4 of an 8-step run, resumed by a fresh trainer over a model of other values:
    its steps 5-8 repeat the uninterrupted run's."""
    from zero_kernels.integrations.transformers import ZeroTrainer

    d = f"{TMP}/resume{stage}{str(dtype)[6:]}{stage_after or ''}"
    tr, full = train(
        ZeroTrainer, d, steps=8, save_steps=4, model=gpt2(0, dtype), zero={"stage": stage}
    )
    ck = os.path.join(d, "checkpoint-4")
    assert os.path.isdir(os.path.join(ck, "zero_kernels")), os.listdir(ck)
    w_full = weights(tr)
    tr2, later = train(
        ZeroTrainer,
        d + "b",
        steps=8,
        model=gpt2(1, dtype),
        resume=ck,
        zero={"stage": stage_after or stage},
    )
    assert tr2.zero_optimizer.stage == (stage_after or stage)
    assert len(later) == 8, len(later)  # steps 5-8, accumulation 2
    gap = rel(later, full[8:])
    assert gap <= 1e-6, (gap, later, full[8:])
    wgap = max_diff(weights(tr2), w_full)
    assert wgap <= 1e-6, wgap
    return {"loss_rel": gap, "weights_abs": wgap}


def checkpointing_stage3(rank, world):
    """Gradient checkpointing (where HF's DDP runs find_unused_parameters=False): stage 3 against
    Trainer's DDP run with it on."""
    from transformers import Trainer

    from zero_kernels.integrations.transformers import ZeroTrainer

    gc = {"activation_checkpointing": True}
    _, want = train(Trainer, f"{TMP}/gc_ddp", steps=3, targs=gc)
    tr, got = train(ZeroTrainer, f"{TMP}/gc_z3", steps=3, targs=gc, zero={"stage": 3})
    assert tr.model.is_activation_checkpointing
    gap = rel(got, want)
    assert gap <= 1e-5, (gap, got, want)
    return {"loss_rel": gap}


def resume_stage3_fp32(rank, world):
    return _resume(3, torch.float32)


def resume_stage2_bf16(rank, world):
    return _resume(2, torch.bfloat16)


def resume_stage1_into_stage3(rank, world):
    return _resume(1, torch.float32, stage_after=3)


def save_model_stage3(rank, world):
    """save_model() at stage 3: every rank gathers, rank 0 writes; from_pretrained loads it."""
    from transformers import GPT2LMHeadModel

    from zero_kernels.integrations.transformers import ZeroTrainer

    tr, _ = train(ZeroTrainer, f"{TMP}/save", steps=2, zero={"stage": 3})
    out = f"{TMP}/saved"
    tr.save_model(out)
    w = weights(tr)  # collective at stage 3, every rank
    torch.distributed.barrier()
    loaded = GPT2LMHeadModel.from_pretrained(out)
    wl = {k: v.float() for k, v in loaded.state_dict().items()}
    gap = max_diff(wl, w)
    assert gap == 0.0, gap
    assert not any(torch.isnan(v).any() for v in wl.values())
    return {"files": sorted(os.listdir(out))}


def given_optimizer(rank, world):
    """optimizers=(a plain torch optimizer, None) is turned into a ZeroOptimizer."""
    from zero_kernels.integrations.transformers import ZeroTrainer

    model = gpt2()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    tr, losses = train(
        ZeroTrainer,
        f"{TMP}/given",
        steps=2,
        model=model,
        optimizers=(opt, None),
        zero={"stage": 2},
    )
    z = tr.zero_optimizer
    assert z.stage == 2 and tr.model_wrapped is tr.model
    assert (
        type(z.parts.core.runner.inner).__name__ == "SGD" and z.param_groups[0]["momentum"] == 0.9
    )
    return {"micro_batches": len(losses)}


def given_scheduler(rank, world):
    """optimizers=(torch optimizer, a scheduler over it): the scheduler drives the
    ZeroOptimizer's lr, as it drives the torch optimizer's under Trainer's DDP."""
    from transformers import Trainer

    from zero_kernels.integrations.transformers import ZeroTrainer

    def run(cls, name, **kw):
        model = gpt2()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + 3 * s))
        tr, losses = train(cls, f"{TMP}/{name}", model=model, optimizers=(opt, sched), **kw)
        return tr, losses

    _, want = run(Trainer, "sched_ddp")
    tr, got = run(ZeroTrainer, "sched_z2", zero={"stage": 2})
    lr = tr.zero_optimizer.param_groups[0]["lr"]
    assert abs(lr - 1e-3 / (1 + 3 * 6)) < 1e-12, lr  # six steps of the schedule
    gap = rel(got, want)
    assert gap <= 1e-5, (gap, got, want)
    return {"loss_rel": gap}


def refusals(rank, world):
    from transformers import Trainer, TrainingArguments

    from zero_kernels.integrations.transformers import ZeroTrainer

    msgs = {}
    args = TrainingArguments(output_dir=f"{TMP}/x", use_cpu=True, report_to=[])
    for bad, what in (({"stage": 2, "lr": 1.0}, "unknown key"), ([2], "must be a dict")):
        try:
            ZeroTrainer(model=gpt2(), args=args, zero=bad)
            raise AssertionError(f"zero={bad!r} was accepted")
        except (TypeError, ValueError) as e:
            assert what in str(e), e
            msgs[what] = "raised"
    # TrainingArguments(ddp_broadcast_buffers) becomes the optimizer's broadcast_buffers (unset:
    # DDP's default, True); another value in zero= is an error naming both
    for flag, want in ((None, True), (False, False), (True, True)):
        a = TrainingArguments(
            output_dir=f"{TMP}/x", use_cpu=True, report_to=[], ddp_broadcast_buffers=flag
        )
        comm = ZeroTrainer(model=gpt2(), args=a).zero.get("comm") or CommPolicy()
        assert comm.broadcast_buffers is want
    a = TrainingArguments(
        output_dir=f"{TMP}/x", use_cpu=True, report_to=[], ddp_broadcast_buffers=False
    )
    try:
        ZeroTrainer(model=gpt2(), args=a, zero={"comm": CommPolicy(broadcast_buffers=True)})
        raise AssertionError("ddp_broadcast_buffers=False with zero broadcast_buffers=True")
    except ValueError as e:
        assert "ddp_broadcast_buffers)=False" in str(e) and "broadcast_buffers=True" in str(e)
        msgs["broadcast_buffers"] = "raised"
    # a plain Trainer's checkpoint: one rank's optimizer.pt of another optimizer
    d = f"{TMP}/plain"
    train(Trainer, d, steps=2, save_steps=2)
    try:
        train(ZeroTrainer, d + "z", steps=4, resume=f"{d}/checkpoint-2", zero={"stage": 2})
        raise AssertionError("a plain Trainer checkpoint was resumed")
    except ValueError as e:
        assert "holds no zero_kernels/" in str(e), e
        msgs["plain checkpoint"] = "raised"
    return msgs


CHECKS = [
    baseline,
    parity_stage1,
    parity_stage2,
    parity_stage3,
    parity_llama_mixtral,
    lora_shard_frozen,
    evaluate_stage3,
    checkpointing_stage3,
    resume_stage3_fp32,
    resume_stage2_bf16,
    resume_stage1_into_stage3,
    save_model_stage3,
    given_optimizer,
    given_scheduler,
    refusals,
]


def worker(rank, world):
    launcher_env(rank, world)
    os.makedirs(TMP, exist_ok=True)
    return run_checks(rank, world, CHECKS)
