"""`zero_kernels.integrations.accelerate` against the same accelerate script with DDP
(``accelerator.prepare(model, opt, dl, sched)``), on spawned gloo ranks with ``Accelerator(cpu=
True)``: per-step losses with clipping and accumulation 2 at stages 1-3, resume from a mid-run
``accelerator.save_state`` (fp32 and bf16 params), ``mixed_precision="bf16"``, and the errors.
Run by tests/integrations/test_integration_accelerate.py."""

from __future__ import annotations

import os
import shutil
import tempfile

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.state import AcceleratorState, GradientState
from accelerate.utils import AutocastKwargs, DataLoaderConfiguration, DistributedType
from dist_utils import run_checks
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from zero_kernels import ZeroOptimizer
from zero_kernels.integrations import accelerate as zka
from zero_kernels.policy import CommPolicy

MICRO = 12  # micro-batches per rank: 6 optimizer steps with accumulation 2
SAVE_AT = 6  # micro-batches before the mid-run save_state


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        for b in self.blocks:
            x = torch.tanh(b(x))
        return self.head(x)


class _Counter:
    """An object given to ``accelerator.register_for_checkpointing``."""

    n = 0

    def state_dict(self):
        return {"n": self.n}

    def load_state_dict(self, state):
        self.n = state["n"]


def _accelerator(**kwargs) -> Accelerator:
    """A fresh Accelerator over the process group dist_utils made (accelerate keeps its state
    in process-wide singletons: reset between scripts)."""
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    return Accelerator(cpu=True, gradient_accumulation_steps=2, **kwargs)


def _script(
    mode,
    stage=2,
    *,
    dtype=torch.float32,
    ckpt=None,
    save_at=None,
    resume=False,
    norms=None,
    **acc_kwargs,
):
    """The user's script: DDP (``mode="ddp"``) or the ZeRO version, same seeds and data; the
    local loss of every micro-batch (the gradient norms before clipping into ``norms``)."""
    accelerator = _accelerator(**acc_kwargs)
    torch.manual_seed(0)
    model = _Net().to(dtype)
    opt = torch.optim.AdamW(
        [
            {"params": [p for n, p in model.named_parameters() if n.endswith("weight")]},
            {
                "params": [p for n, p in model.named_parameters() if n.endswith("bias")],
                "weight_decay": 0.0,
            },
        ],
        lr=2e-2,
        weight_decay=0.1,
    )
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + 0.1 * s))
    g = torch.Generator().manual_seed(1)
    n = MICRO * 4 * accelerator.num_processes
    data = TensorDataset(torch.randn(n, 8, generator=g), torch.randn(n, 2, generator=g))
    dl = DataLoader(data, batch_size=4, shuffle=False)
    if mode == "ddp":
        model, opt, dl, sched = accelerator.prepare(model, opt, dl, sched)
    else:
        model, opt, dl, sched = zka.prepare(
            accelerator, model, opt, dl, sched, zero={"stage": stage}
        )
    counter = _Counter()
    accelerator.register_for_checkpointing(counter)
    skip = 0
    if resume:
        accelerator.load_state(ckpt)
        skip = SAVE_AT
        dl = accelerator.skip_first_batches(dl, skip)
        assert counter.n == skip, (counter.n, skip)  # a registered object came back
    losses = []
    for i, (x, y) in enumerate(dl, start=skip):
        with accelerator.accumulate(model):
            loss = F.mse_loss(model(x.to(dtype)).float(), y)
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                norm = accelerator.clip_grad_norm_(model.parameters(), 0.3)
                if norms is not None:
                    norms.append(float(norm))
            opt.step()
            sched.step()
            opt.zero_grad()
        losses.append(loss.item())
        counter.n += 1
        if save_at == i + 1:
            accelerator.save_state(ckpt)
    if mode != "ddp":
        opt.optimizer.close()
    return losses


def _rel(a, b) -> float:
    assert len(a) == len(b), (len(a), len(b))
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b, strict=True))


def _tmpdir(rank: int) -> str:
    """One directory for every rank (rank 0 makes it, the others are told its name)."""
    name = [tempfile.mkdtemp(prefix="zk-acc-") if rank == 0 else None]
    torch.distributed.broadcast_object_list(name, src=0)
    return name[0]


def check_parity_vs_ddp(rank, world) -> dict:
    ddp_norms = []
    ddp = _script("ddp", norms=ddp_norms)
    assert max(ddp_norms) > 0.3, f"clipping never acted: {ddp_norms}"
    out = {}
    for stage in (1, 2, 3):
        norms = []
        zero = _script("zero", stage, norms=norms)
        gap = _rel(zero, ddp)
        assert gap <= 1e-5, f"stage {stage}: losses differ from DDP by {gap:.3g} relative"
        ngap = _rel(norms, ddp_norms)
        assert ngap <= 1e-5, f"stage {stage}: grad norms differ from DDP by {ngap:.3g}"
        out[f"stage {stage}"] = gap
    return out


def check_bf16_autocast_vs_ddp(rank, world) -> dict:
    out = {}
    kw = {"mixed_precision": "bf16", "kwargs_handlers": [AutocastKwargs(cache_enabled=False)]}
    ddp = _script("ddp", **kw)
    assert _rel(ddp, _script("ddp")) > 1e-4, "autocast made no difference"
    for stage in (2, 3):
        gap = _rel(_script("zero", stage, **kw), ddp)
        assert gap <= 1e-5, f"stage {stage}: bf16 autocast losses differ from DDP by {gap:.3g}"
        out[f"stage {stage}"] = gap
    return out


def check_resume(rank, world) -> dict:
    out = {}
    f32, bf16 = torch.float32, torch.bfloat16
    # (stage saved, stage resumed, params dtype); 2 -> 3: the checkpoint reshards
    for saved, resumed, dtype in (
        (2, 2, f32),
        (3, 3, f32),
        (1, 1, bf16),
        (3, 3, bf16),
        (2, 3, f32),
    ):
        ckpt = _tmpdir(rank)
        full = _script("zero", saved, dtype=dtype, ckpt=ckpt, save_at=SAVE_AT)
        again = _script("zero", resumed, dtype=dtype, ckpt=ckpt, resume=True)
        gap = _rel(again, full[SAVE_AT:])
        tag = f"stage {saved}->{resumed} {str(dtype).split('.')[-1]}"
        tol = 1e-6 if saved == resumed else 1e-5  # another stage: another reduction order
        assert gap <= tol, f"{tag}: resumed losses differ by {gap:.3g}: {again} vs {full}"
        out[tag] = gap
        if rank == 0:
            shutil.rmtree(ckpt, ignore_errors=True)
    return out


def _raises(exc, fn, *words) -> str:
    try:
        fn()
    except exc as e:
        msg = str(e)
        assert all(w in msg for w in words), msg
        return msg
    raise AssertionError(f"no {exc.__name__} naming {words}")


def check_errors_and_passthrough(rank, world) -> dict:
    acc = _accelerator()
    model = _Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    # a second module among the objects would end up in DDP
    _raises(TypeError, lambda: zka.prepare(acc, model, opt, _Net()), "objects[0]", "_Net")
    _raises(TypeError, lambda: zka.prepare(acc, model, opt, zero={"stag": 2}), "stag")
    # a plugin that shards by itself: refused, naming it
    acc.state.distributed_type = DistributedType.FSDP
    try:
        _raises(ValueError, lambda: zka.prepare(acc, model, opt), "FSDP", "'FSDP'")
    finally:
        acc.state.distributed_type = DistributedType.MULTI_CPU
    # fp16 through accelerate's GradScaler: refused
    acc.state._mixed_precision = "fp16"
    try:
        _raises(ValueError, lambda: zka.prepare(acc, model, opt), "mixed_precision='fp16'")
    finally:
        acc.state._mixed_precision = "no"
    # bf16 autocast at stage 3 with the cache on
    acc16 = _accelerator(mixed_precision="bf16")
    _raises(
        ValueError,
        lambda: zka.prepare(acc16, model, opt, zero={"stage": 3}),
        "cache_enabled=False",
    )
    # a ready ZeroOptimizer: kept, the params not copied, its methods through the wrapper
    acc = _accelerator()
    model = _Net()
    zo = ZeroOptimizer(model, torch.optim.AdamW, stage=1, lr=1e-2)
    ptrs = [p.data_ptr() for p in model.parameters()]
    (
        m,
        opt,
    ) = zka.prepare(acc, model, zo)
    assert m is model and opt.optimizer is zo
    assert [p.data_ptr() for p in model.parameters()] == ptrs, "params copied"
    assert opt.stage == 1 and callable(opt.no_sync) and opt in acc._optimizers
    _raises(ValueError, lambda: zka.prepare(acc, model, zo), "already has", "free_memory()")
    # accumulate(model) enters the ZeroOptimizer's no_sync on micro-batches (stage 1: no reduce)
    reducer = zo.parts.core.reducer
    seen = []
    with acc.accumulate(model):  # step 1 of 2: no sync
        seen.append(reducer.sync)
    with acc.accumulate(model):  # step 2: sync
        seen.append(reducer.sync)
    assert seen == [False, True], seen
    _raises(ValueError, lambda: zka.save_state(_accelerator(), "x"), "was not given")
    # accelerator.free_memory() lets go of it: the next prepare closes it (the params whole
    # again, no hooks left) and takes another model
    m, opt = acc.free_memory(m, opt)
    assert m is None and opt is None and zo.closed is False
    model2 = _Net()
    m2, opt2 = zka.prepare(acc, model2, torch.optim.AdamW(model2.parameters(), lr=1e-2))
    assert zo.closed
    m2(torch.randn(4, 8)).pow(2).mean().backward()
    opt2.step()
    opt2.optimizer.close()
    zo.close()
    # DDP's broadcast_buffers as the accelerator's DistributedDataParallelKwargs set it: taken
    # (default: True, as DDP's), a different zero= value or ready optimizer an error
    from accelerate.utils import DistributedDataParallelKwargs as DDPKw

    off = [DDPKw(broadcast_buffers=False)]
    for handlers, zero, want in (([], None, True), (off, None, False), (off, {"stage": 1}, False)):
        model = _Net()
        _, opt = zka.prepare(
            _accelerator(kwargs_handlers=handlers),
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            zero=zero,
        )
        assert opt.optimizer.policy.comm.broadcast_buffers is want, (handlers, zero)
        opt.optimizer.close()
    model = _Net()
    _raises(
        ValueError,
        lambda: zka.prepare(
            _accelerator(kwargs_handlers=off),
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            zero={"comm": CommPolicy(broadcast_buffers=True)},
        ),
        "DistributedDataParallelKwargs(broadcast_buffers)=False",
        "broadcast_buffers=True",
    )
    zo = ZeroOptimizer(model, torch.optim.SGD, stage=1, lr=0.1)
    _raises(
        ValueError,
        lambda: zka.prepare(_accelerator(kwargs_handlers=off), model, zo),
        "differ",
    )
    zo.close()
    # even_batches=False at stage 3: ranks with fewer batches left the others in an all-gather
    # until the timeout (the process group's, 30 min by default); refused, naming it
    model = _Net()
    _raises(
        ValueError,
        lambda: zka.prepare(
            _accelerator(dataloader_config=DataLoaderConfiguration(even_batches=False)),
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            zero={"stage": 3},
        ),
        "even_batches=False",
        "stage 3",
    )
    _, opt = zka.prepare(  # stages 1-2 run it (their forwards have no collective)
        _accelerator(dataloader_config=DataLoaderConfiguration(even_batches=False)),
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        zero={"stage": 2},
    )
    opt.optimizer.close()
    return {"accelerate": __import__("accelerate").__version__}


def check_clipping(rank, world) -> dict:
    """``accelerator.clip_grad_value_`` at the end of each window: DDP's losses at stages 1-3.
    Clipping on a micro-batch that does not end a window: a RuntimeError naming
    sync_gradients (before: stage 1 clipped nothing, stages 2-3 clipped the average so far;
    weights 13.9% / 0.58% from DDP's, no error)."""
    out = {}

    def script(mode, stage=2, every=False, how="value"):
        accelerator = _accelerator()
        torch.manual_seed(0)
        model = _Net()
        opt = torch.optim.AdamW(model.parameters(), lr=2e-2)
        g = torch.Generator().manual_seed(1)
        n = 8 * accelerator.num_processes
        data = TensorDataset(torch.randn(n, 8, generator=g), torch.randn(n, 2, generator=g))
        dl = DataLoader(data, batch_size=2, shuffle=False)
        if mode == "ddp":
            model, opt, dl = accelerator.prepare(model, opt, dl)
        else:
            model, opt, dl = zka.prepare(accelerator, model, opt, dl, zero={"stage": stage})
        losses = []
        try:
            for x, y in dl:
                with accelerator.accumulate(model):
                    loss = F.mse_loss(model(x), y)
                    accelerator.backward(loss)
                    if every or accelerator.sync_gradients:
                        if how == "value":
                            accelerator.clip_grad_value_(model.parameters(), 0.02)
                        else:
                            accelerator.clip_grad_norm_(model.parameters(), 0.1)
                    opt.step()
                    opt.zero_grad()
                losses.append(loss.item())
        finally:
            if mode != "ddp":
                opt.optimizer.close()
        return losses

    ddp = script("ddp")
    for stage in (1, 2, 3):
        gap = _rel(script("zero", stage), ddp)
        assert gap <= 1e-5, f"stage {stage}: clip_grad_value_ losses differ from DDP by {gap:.3g}"
        out[f"stage {stage} clip_grad_value_"] = gap
        for how in ("value", "norm"):
            _raises(
                RuntimeError,
                lambda s=stage, h=how: script("zero", s, every=True, how=h),
                "sync_gradients is False",
                f"clip_grad_{how}_",
            )
        out[f"stage {stage} mid-window"] = "raised"
    return out


def check_save_model(rank, world) -> dict:
    """``accelerator.save_model`` (safetensors) and ``accelerator.save(model.state_dict(),
    safe_serialization=True)`` write every tensor at stages 1-3, as under DDP. At stages 1/2 the
    params share one flat buffer, and accelerate dropped all but one of them as "shared"
    ([Note: state dict copies] in zero_kernels/optimizer/param_access.py)."""
    from safetensors.torch import load_file

    out = {}
    d = _tmpdir(rank)
    try:
        for stage in (1, 2, 3):
            accelerator = _accelerator()
            torch.manual_seed(0)
            model = _Net()
            opt = torch.optim.AdamW(model.parameters(), lr=2e-2)
            model, opt = zka.prepare(accelerator, model, opt, zero={"stage": stage})
            model(torch.randn(4, 8)).pow(2).mean().backward()
            opt.step()
            want = {k: v.clone() for k, v in model.state_dict().items()}  # collective at 3
            if stage != 3:  # every trained param's entry is a tensor of its own
                ptrs = {v.untyped_storage().data_ptr() for v in model.state_dict().values()}
                assert len(ptrs) == len(want), (stage, len(ptrs), len(want))
            accelerator.save_model(model, f"{d}/s{stage}")
            sd = model.state_dict()
            accelerator.save(sd, f"{d}/s{stage}.safetensors", safe_serialization=True)
            torch.distributed.barrier()
            for path in (f"{d}/s{stage}/model.safetensors", f"{d}/s{stage}.safetensors"):
                got = load_file(path)
                assert sorted(got) == sorted(want), (stage, path, sorted(got))
                assert all(torch.equal(got[k], want[k]) for k in want), (stage, path)
            opt.optimizer.close()
            out[f"stage {stage}"] = len(want)
    finally:
        torch.distributed.barrier()
        if rank == 0:
            shutil.rmtree(d, ignore_errors=True)
    return out


def run(rank: int, world: int) -> dict:
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world)
    )
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")  # unused: the group exists already
    return run_checks(
        rank,
        world,
        [
            check_errors_and_passthrough,
            check_parity_vs_ddp,
            check_resume,
            check_bf16_autocast_vs_ddp,
            check_save_model,
            check_clipping,
        ],
    )
