"""`ZeroTrainer`: Hugging Face's ``Trainer`` with a `ZeroOptimizer` in place of DDP and the
optimizer.

    trainer = ZeroTrainer(model=model, args=args, train_dataset=ds, zero={"stage": 3})
    trainer.train()                     # resume_from_checkpoint=... works as with Trainer
    trainer.save_model("out")           # whole tensors at every stage; from_pretrained loads it

[Note: ZeroTrainer]
Everything ``TrainingArguments`` says is kept: batch size, ``gradient_accumulation_steps``,
``max_grad_norm``, the scheduler, ``optim``/learning rate/weight decay (Trainer builds its plain
torch optimizer with its decay / no-decay groups, then `create_optimizer` turns it into a
`ZeroOptimizer` of the same class over the same groups, [Note: from a torch optimizer]). What
changes, and why:

- the model is never wrapped in DDP: Trainer hands it to ``accelerator.prepare``, whose
  ``prepare_model`` wraps it in DDP at 2+ ranks; the accelerator's ``prepare_model`` is given
  ``evaluation_mode=True`` (no DDP) and ``device_placement=False`` for it, and the optimizer
  skips accelerate's state_dict round trip (``device_placement=False``);
- the model is never moved to an indexed CPU device: with ``use_cpu=True`` at 2 ranks
  ``args.device`` is ``cpu:0`` and ``tensor.to(torch.device("cpu", 0))`` copies a CPU tensor,
  which replaced the params of an optimizer built before Trainer (`_move_model_to_device`);
- accumulation: micro-batches that do not end an optimizer step run under the optimizer's
  ``no_sync()`` (stage 1 reduces once per step; stages 2/3 reduce each micro-batch into the
  shard, the same numbers);
- ``ddp_broadcast_buffers`` (what Trainer passes to DDP's ``broadcast_buffers``) becomes the
  optimizer's ``broadcast_buffers`` (unset: True, DDP's default; [Note: replicated module
  state]);
- clipping (``max_grad_norm``) and the logged ``grad_norm`` go through the optimizer's
  ``clip_grad_norm_`` (one pass over the shards, one all-reduce);
- ``save_model()``/``save_pretrained``: ``model.state_dict()`` is collective at stage 3, so every
  rank takes it (whole tensors, gathered unit by unit) and the main process writes, as Trainer
  does; the folder loads with ``from_pretrained``;
- checkpoints: Trainer's ``optimizer.pt`` would hold rank 0's shard only; the optimizer, its fp32
  masters, the scheduler and each rank's RNG go to ``checkpoint-N/zero_kernels/`` through
  `zero_kernels.save_checkpoint` (every rank writes its pieces), and ``resume_from_checkpoint``
  loads them with `zero_kernels.load_checkpoint`, at the same or another world size and stage
  (data order aside, as with Trainer). ``trainer_state.json`` and the RNG files stay Trainer's.

Refused with an error: DeepSpeed or FSDP in the arguments (two sharding engines), fp16 mixed
precision (accelerate's GradScaler; use ``bf16=True``, or fp16 params, which the optimizer's own
loss scaler covers), a resume from a checkpoint without ``zero_kernels/`` (a plain Trainer's
``optimizer.pt`` is one rank's state of another optimizer).

Private Trainer methods are overridden (``_move_model_to_device``, ``_save``,
``_save_optimizer_and_scheduler``, ``_load_optimizer_and_scheduler``, ``_load_from_checkpoint``,
``_clip_grad_norm``, ``_get_grad_norm``), so the construction checks the installed Trainer:

- a release whose Trainer lacks one of them, or takes other parameters (``OVERRIDES``; so every
  transformers before 5.3, which has no ``_clip_grad_norm`` and whose ``create_optimizer`` takes
  no model), raises, naming the method: the override would never be called, and clipping or
  checkpoints would silently bypass the sharded optimizer;
- a release in ``TESTED`` (major.minor; the test extra's upper bound is the newest of them)
  runs quietly;
- any other release that passes the check runs with one warning per process saying so
  (``ZERO_KERNELS_UNTESTED_TRANSFORMERS=1`` silences it): a new minor release works on the day
  it comes out, and tests/integrations/test_integration_transformers.py says whether it really does.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import warnings

import torch
import transformers
from torch import nn

from .common import (
    check_not_wrapped,
    from_torch_optimizer,
    is_zero,
    with_broadcast_buffers,
    zero_kwargs,
)
from .ds_config import is_deepspeed_config, zero_for_trainer

__all__ = ["OVERRIDES", "TESTED", "ZERO_DIR", "ZeroTrainer"]

TESTED = ("5.24", "5.25")  # major.minor of the transformers releases the tests ran on
ZERO_DIR = "zero_kernels"  # the folder inside checkpoint-N holding the sharded state

# the Trainer methods ZeroTrainer overrides, with the parameters (after self) it relies on
OVERRIDES = {
    "create_accelerator_and_postprocess": (),
    "_move_model_to_device": ("model", "device"),
    "create_optimizer": ("model",),
    "training_step": ("model", "inputs", "num_items_in_batch"),
    "_clip_grad_norm": ("model",),
    "_get_grad_norm": ("model", "grad_norm"),
    "_save": ("output_dir", "state_dict"),
    "_save_optimizer_and_scheduler": ("output_dir",),
    "_load_from_checkpoint": ("resume_from_checkpoint", "model"),
    "_load_optimizer_and_scheduler": ("checkpoint",),
}
_warned: set[str] = set()  # the untested versions warned about in this process


def check_version(trainer_cls: type | None = None, version: str | None = None) -> None:
    """Refuse a Trainer that does not have the methods ZeroTrainer overrides (with their
    parameters); warn once for a release outside ``TESTED``. See the module's docstring."""
    trainer_cls = transformers.Trainer if trainer_cls is None else trainer_cls
    version = transformers.__version__ if version is None else version
    for name, want in OVERRIDES.items():
        fn = getattr(trainer_cls, name, None)
        if not callable(fn):
            raise RuntimeError(
                f"ZeroTrainer: transformers {version}'s Trainer has no {name}(), which ZeroTrainer "
                "overrides (without it the sharded optimizer would be bypassed silently); "
                f"install transformers>=5.3 (tested: {', '.join(t + '.x' for t in TESTED)})"
            )
        got = tuple(inspect.signature(fn).parameters)[1:]
        if got[: len(want)] != want:
            raise RuntimeError(
                f"ZeroTrainer: transformers {version}'s Trainer.{name} takes {got}, ZeroTrainer "
                f"overrides it as taking {want}; this release is not supported (tested: "
                f"{', '.join(t + '.x' for t in TESTED)})"
            )
    if ".".join(version.split(".")[:2]) in TESTED or version in _warned:
        return
    if os.environ.get("ZERO_KERNELS_UNTESTED_TRANSFORMERS") == "1":
        return
    _warned.add(version)
    warnings.warn(
        f"ZeroTrainer was tested with transformers {', '.join(t + '.x' for t in TESTED)}; this "
        f"is {version}. The Trainer methods it overrides are there with the expected "
        "parameters, so it runs; tests/integrations/test_integration_transformers.py says "
        "whether it gives DDP's results. ZERO_KERNELS_UNTESTED_TRANSFORMERS=1 silences this "
        "warning",
        UserWarning,
        stacklevel=3,
    )


def _inner(optimizer):
    """The ZeroOptimizer under accelerate's AcceleratedOptimizer wrapper(s)."""
    while optimizer is not None and not is_zero(optimizer):
        optimizer = getattr(optimizer, "optimizer", None)
    return optimizer


class ZeroTrainer(transformers.Trainer):
    """A ``transformers.Trainer`` taking every Trainer argument plus ``zero=``: `ZeroOptimizer`
    keyword arguments as a dict, a `ZeroPolicy` (default stage 2), or the DeepSpeed config a run
    passed to ``TrainingArguments(deepspeed=...)`` (a path or its dict, read as
    `zero_kernels.integrations.ds_config.zero_for_trainer` reads it). See [Note: ZeroTrainer]."""

    def __init__(self, *args, zero=None, **kwargs):
        check_version()
        ds_config = zero if is_deepspeed_config(zero) else None  # DeepSpeed's file, read below
        self.zero = zero_kwargs(None if ds_config is not None else zero, "ZeroTrainer")
        super().__init__(*args, **kwargs)
        a = self.args
        if getattr(a, "deepspeed", None):
            raise ValueError(
                f"ZeroTrainer: TrainingArguments(deepspeed={a.deepspeed!r}) asks for DeepSpeed's "
                "ZeRO; ZeroTrainer is the sharding engine here. Leave deepspeed unset and pass "
                f"the same file as ZeroTrainer(..., zero={a.deepspeed!r})"
            )
        if ds_config is not None:  # as TrainingArguments(deepspeed=...) would read it
            policy = zero_for_trainer(ds_config, a, model=self.model)
            self.zero = zero_kwargs(policy, "ZeroTrainer")
        if getattr(a, "fsdp", None):
            raise ValueError(
                f"ZeroTrainer: TrainingArguments(fsdp={a.fsdp!r}) asks for FSDP; ZeroTrainer "
                "shards the model itself (zero={'stage': 3} for parameters). Leave fsdp unset"
            )
        if a.fp16:
            raise ValueError(
                "ZeroTrainer: TrainingArguments(fp16=True) is accelerate's GradScaler over "
                "autocast, not supported with ZeroTrainer; use bf16=True, or fp16 params (the "
                "ZeroOptimizer's own loss scaler covers them)"
            )
        # DDP's broadcast_buffers as Trainer passes it to DDP (None: DDP's default, True)
        self.zero = with_broadcast_buffers(
            self.zero,
            a.ddp_broadcast_buffers,
            "TrainingArguments(ddp_broadcast_buffers)",
            "ZeroTrainer",
        )
        if self.optimizer is not None:
            check_not_wrapped(self.model, "ZeroTrainer")
            if is_zero(_inner(self.optimizer)):  # a ready one: its choice must agree
                with_broadcast_buffers(
                    {"policy": _inner(self.optimizer).policy},
                    a.ddp_broadcast_buffers,
                    "TrainingArguments(ddp_broadcast_buffers)",
                    "ZeroTrainer",
                )

    # ---- the accelerator keeps the model out of DDP
    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        acc = self.accelerator
        prepare_model, prepare_optimizer = acc.prepare_model, acc.prepare_optimizer

        def keep_out_of_ddp(model, device_placement=None, evaluation_mode=False):
            # evaluation_mode=True is accelerate's "no DDP wrapper"; the model is already on
            # its device (Trainer moved it), and a move to cpu:0 would copy its params
            return prepare_model(model, device_placement=False, evaluation_mode=True)

        def no_round_trip(optimizer, device_placement=None):
            # accelerate re-loads an optimizer's state_dict onto the device; the shards already
            # are where they belong
            return prepare_optimizer(optimizer, device_placement=False)

        acc.prepare_model = keep_out_of_ddp
        acc.prepare_optimizer = no_round_trip

    def _move_model_to_device(self, model: nn.Module, device: torch.device) -> None:
        device = torch.device(device)
        if device.type == "cpu" and all(p.device.type == "cpu" for p in model.parameters()):
            return  # .to(cpu:0) copies CPU tensors (see [Note: ZeroTrainer])
        if self.optimizer is not None and is_zero(_inner(self.optimizer)):
            raise ValueError(
                f"ZeroTrainer: the model must be on {device} before its ZeroOptimizer is built "
                "(moving it replaces the params the optimizer holds); move it first, or pass "
                "zero= and let ZeroTrainer build the optimizer"
            )
        super()._move_model_to_device(model, device)

    # ---- the optimizer
    def create_optimizer(self, model=None):
        super().create_optimizer(model)
        if not is_zero(_inner(self.optimizer)):
            self.optimizer = from_torch_optimizer(
                self.model, self.optimizer, self.zero, "ZeroTrainer"
            )
        return self.optimizer

    @property
    def zero_optimizer(self):
        """The `ZeroOptimizer` (None before ``train()`` built it)."""
        return _inner(self.optimizer)

    def training_step(self, model, inputs, num_items_in_batch=None):
        opt = self.zero_optimizer
        last = self.accelerator.sync_gradients
        with contextlib.nullcontext() if last or opt is None else opt.no_sync():
            return super().training_step(model, inputs, num_items_in_batch)

    def _clip_grad_norm(self, model):
        return self.zero_optimizer.clip_grad_norm_(self.args.max_grad_norm)

    def _get_grad_norm(self, model, grad_norm=None):
        if grad_norm is None:
            grad_norm = self.zero_optimizer.clip_grad_norm_(float("inf"))
        return grad_norm

    # ---- saving the model: collective at stage 3, one writer
    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        if state_dict is None and self.zero_optimizer is not None:
            state_dict = self.model.state_dict()  # every rank: a collective at stage 3
        if not self.args.should_save:
            return
        super()._save(output_dir, state_dict=state_dict)

    # ---- checkpoints through zero_kernels.save_checkpoint / load_checkpoint
    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        from ..checkpoint import save_checkpoint

        save_checkpoint(
            os.path.join(output_dir, ZERO_DIR),
            self.model,
            self.zero_optimizer,
            scheduler=self.lr_scheduler,
            extra={"step": int(self.state.global_step)},
            keep_last=1,
        )

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        if os.path.isdir(os.path.join(resume_from_checkpoint, ZERO_DIR)):
            return  # the params come with the optimizer, at full precision, at load
        super()._load_from_checkpoint(resume_from_checkpoint, model)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None:
            return
        from ..checkpoint import load_checkpoint

        where = os.path.join(checkpoint, ZERO_DIR)
        if not os.path.isdir(where):
            raise ValueError(
                f"ZeroTrainer: resume_from_checkpoint={checkpoint!r} holds no {ZERO_DIR}/ "
                "folder: it was not saved by ZeroTrainer (a plain Trainer's optimizer.pt is one "
                "rank's state of another optimizer). Start from its weights instead "
                "(from_pretrained) without resume_from_checkpoint"
            )
        load_checkpoint(where, self.model, self.zero_optimizer, scheduler=self.lr_scheduler)
