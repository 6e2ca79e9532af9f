"""A DistributedDataParallel over a ZeroOptimizer's params is an error on every rank, in every
order, with both find_unused_parameters values ([Note: wrappers] in
zero_kernels/optimizer/wrappers.py);
run on spawned gloo ranks by tests/stages/test_wrappers.py."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from zero_opt import zero_opt

from zero_kernels import ZeroOptimizer
from zero_kernels.optimizer import wrappers


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(6, 6) for _ in range(2))
        self.head = nn.Linear(6, 2)

    def forward(self, x):
        for b in self.blocks:
            x = torch.tanh(b(x))
        return self.head(x)


def _raises(what: str, fn, *args, **kwargs) -> str:
    try:
        fn(*args, **kwargs)
    except RuntimeError as e:
        msg = str(e)
        assert "held by a ZeroOptimizer" in msg and "Do not wrap" in msg, msg
        return msg
    raise AssertionError(f"{what}: no error")


def check_orders(rank: int, world: int) -> dict:
    out = {}
    x = torch.randn(3, 6, generator=torch.Generator().manual_seed(rank))
    for stage in (1, 2, 3):
        for fup in (False, True):
            tag = f"stage {stage} find_unused={fup}"
            # the optimizer first, then DDP: DDP's constructor raises before any collective
            m = _Net()
            zo = zero_opt(m, torch.optim.AdamW, stage=stage, lr=1e-2, timeout=30)
            msg = _raises(tag, DDP, m, find_unused_parameters=fup)
            assert "'blocks.0.weight'" in msg, msg
            # the optimizer still trains (nothing was left half-built)
            m(x).pow(2).mean().backward()
            zo.step()
            zo.close()
            DDP(m, find_unused_parameters=fup)  # closed: the params are free again
            out[f"{tag}: optimizer then DDP"] = "raised"
            # DDP first, then the optimizer (the model, the DDP itself, or params only)
            m = _Net()
            ddp = DDP(m, find_unused_parameters=fup)
            for arg in (m, ddp):
                _raises(tag, ZeroOptimizer, arg, torch.optim.AdamW, stage=stage, lr=1e-2)
            if stage != 3:  # stage 3 needs the model
                _raises(tag, ZeroOptimizer, m.parameters(), torch.optim.AdamW, stage=stage, lr=1e-2)
            out[f"{tag}: DDP then optimizer"] = "raised"
            # a DDP the guard did not see being built (zero_kernels imported after it): the
            # model's forward under it raises
            for p in m.parameters():
                delattr(p, wrappers.MARK)
            zo = zero_opt(m, torch.optim.AdamW, stage=stage, lr=1e-2, timeout=30)
            msg = _raises(tag, ddp, x)
            assert "DistributedDataParallel.forward" in msg, msg
            out[f"{tag}: unmarked DDP, forward"] = "raised"
            zo.close()
            del ddp
    return out


def _type_error(fn, *words) -> str:
    try:
        fn()
    except TypeError as e:
        msg = str(e)
        assert all(w in msg for w in words), msg
        return "raised"
    raise AssertionError(f"no error: {words}")


def check_fsdp_and_dtensor(rank: int, world: int) -> dict:
    """A model under FSDP (FullyShardedDataParallel's flat params; FSDP2's fully_shard) or
    tensor parallelism (DTensor params or buffers): a TypeError naming the param or module at
    every stage, before any collective. (Before: FSDP2 and tensor-parallel params failed in
    the constructor with "got mixed torch.Tensor and DTensor", FSDP1's at the first step with
    a size mismatch.)"""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, distribute_tensor
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    out = {}
    mesh = init_device_mesh("cpu", (world,))
    for stage in (1, 2, 3):

        def build(model, stage=stage):
            return lambda: ZeroOptimizer(model, torch.optim.AdamW, stage=stage, lr=1e-2)

        f1 = FSDP(_Net(), device_id=torch.device("cpu"))
        out[f"stage {stage} FSDP"] = _type_error(
            build(f1), "the model is a FullyShardedDataParallel"
        )
        if stage != 3:  # params only: stage 3 needs the model
            flat = list(f1.parameters())
            out[f"stage {stage} FSDP params"] = _type_error(build(flat), "flat parameter")
        f2 = _Net()
        fully_shard(f2.blocks[0])
        out[f"stage {stage} fully_shard"] = _type_error(
            build(f2), "param blocks.0.weight is a DTensor", "Shard(dim=0)"
        )
        tp = _Net()
        parallelize_module(tp, mesh, {"head": ColwiseParallel()})
        out[f"stage {stage} tensor parallel"] = _type_error(build(tp), "param head.weight")
        frozen = _Net()  # a DTensor buffer beside plain trainable params
        frozen.register_buffer("table", distribute_tensor(torch.ones(4, 2), mesh))
        assert isinstance(frozen.table, DTensor)
        out[f"stage {stage} DTensor buffer"] = _type_error(build(frozen), "buffer table")
    # FSDP applied after the optimizer: the next step's error names FSDP (FSDP1's flat params
    # read as plain Parameters by class name, so before this only FSDP2's were named)
    for kind in ("FullyShardedDataParallel", "fully_shard"):
        m = _Net()
        zo = ZeroOptimizer(m, torch.optim.AdamW, stage=2, lr=1e-2)
        if kind == "fully_shard":
            fully_shard(m)
        else:
            FSDP(m, device_id=torch.device("cpu"))
        try:
            zo.step()
            raise AssertionError(f"{kind} after the optimizer: no error")
        except RuntimeError as e:
            assert "were replaced" in str(e) and "FSDP's now" in str(e), e
        out[f"{kind} after the optimizer"] = "raised"
    return out
