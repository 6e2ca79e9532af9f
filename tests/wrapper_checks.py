"""A DistributedDataParallel over a ZeroOptimizer's params is an error on every rank, in every
order, with both find_unused_parameters values ([Note: wrappers] in zero_kernels/wrappers.py);
run on spawned gloo ranks by tests/test_wrappers.py."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from zero_kernels import ZeroOptimizer


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
            zo = ZeroOptimizer(m, torch.optim.AdamW, stage=stage, lr=1e-2, timeout=30)
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
                del p._zero_kernels_ddp
            zo = ZeroOptimizer(m, torch.optim.AdamW, stage=stage, lr=1e-2, timeout=30)
            msg = _raises(tag, ddp, x)
            assert "DistributedDataParallel.forward" in msg, msg
            out[f"{tag}: unmarked DDP, forward"] = "raised"
            zo.close()
            del ddp
    return out
