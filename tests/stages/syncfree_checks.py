"""Checks run in spawned gloo ranks by tests/stages/test_step_without_host_reads.py: the step's
device-side
bookkeeping ([Note: no host sync] in zero_kernels/partition/syncfree.py) switched on for CPU
tensors."""

from __future__ import annotations

import contextlib
import copy
import logging
import sys

import torch
from numerics import rel_err
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from zero_opt import zero_opt

from zero_kernels import ZeroOptimizer

_READS = ("item", "tolist", "__bool__", "__float__", "__int__", "__index__")


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(8, 24), nn.Tanh(), nn.Linear(24, 24), nn.Tanh(), nn.Linear(24, 3)
    )


def _x(rank: int, step: int) -> torch.Tensor:
    return torch.randn(6, 8, generator=torch.Generator().manual_seed(1000 * step + rank))


@contextlib.contextmanager
def host_reads(exempt: set[int]):
    """Record every host read of a tensor (the calls that synchronise with a GPU) made inside
    the block, except of tensors in ``exempt`` (the inner optimizer's CPU step counters, CPU
    tensors on a GPU too) and through ``syncfree.host_read`` (guarded by a passed event)."""
    seen: list[str] = []
    saved = {name: getattr(torch.Tensor, name) for name in _READS}

    def wrap(name, fn):
        def read(self, *a, **k):
            caller = sys._getframe(1).f_code
            if id(self) not in exempt and caller.co_name != "host_read":
                seen.append(f"{name} in {caller.co_name} ({caller.co_filename.split('/')[-1]})")
            return fn(self, *a, **k)

        return read

    for name, fn in saved.items():
        setattr(torch.Tensor, name, wrap(name, fn))
    try:
        yield seen
    finally:
        for name, fn in saved.items():
            setattr(torch.Tensor, name, fn)


def _step_counters(zo: ZeroOptimizer) -> set[int]:
    return {
        id(v)
        for st in zo.parts.core.runner.inner.state.values()
        for k, v in st.items()
        if k == "step" and isinstance(v, torch.Tensor)
    }


def check_syncfree(rank: int, world: int) -> dict:
    out = {}
    for stage in (1, 2, 3):
        for norm_type in (2.0, float("inf")):
            base = _model()
            m1, m2 = copy.deepcopy(base), copy.deepcopy(base)
            kw = {"lr": 1e-2, "weight_decay": 0.1}
            zo = zero_opt(m1, torch.optim.AdamW, stage=stage, bucket_size_mb=0.001, **kw)
            zo.parts.core.sync_free = True
            ddp = DDP(m2)
            to = torch.optim.AdamW(m2.parameters(), **kw)
            reads: list[str] = []
            for step in range(4):
                zo.zero_grad()
                to.zero_grad()
                m1(_x(rank, step)).pow(2).mean().backward()
                ddp(_x(rank, step)).pow(2).mean().backward()
                ctx = host_reads(_step_counters(zo)) if step >= 1 else contextlib.nullcontext([])
                with ctx as seen:
                    n1 = zo.clip_grad_norm_(0.02, norm_type)
                    zo.step()
                reads += seen
                n2 = torch.nn.utils.clip_grad_norm_(m2.parameters(), 0.02, norm_type)
                to.step()
                assert isinstance(n1, torch.Tensor) and n1.dtype == torch.float32
                assert abs(float(n1) - float(n2)) <= 1e-5 * float(n2), (stage, norm_type, n1, n2)
            assert not reads, f"stage {stage}: host reads inside clip + step: {reads}"
            if stage == 3:
                zo.wait_params()
                with zo.gathered_params(m1):
                    errs = [rel_err(a, b) for a, b in zip(m1.parameters(), m2.parameters())]
            else:
                errs = [rel_err(a, b) for a, b in zip(m1.parameters(), m2.parameters())]
            assert max(errs) <= 1e-6, (stage, norm_type, errs)
            zo.close()
        out[f"stage {stage}"] = "ok"
    # non-finite grads with nonfinite="step": counted on the device and logged once known,
    # the same count and the same first step as the host-side path (NaN params spread it on)
    seen = {}
    for sync_free in (False, True):
        m = _model()
        zo = zero_opt(m, torch.optim.AdamW, stage=2, bucket_size_mb=0.001, lr=1e-2)
        zo.parts.core.sync_free = sync_free
        records: list[str] = []

        class Keep(logging.Handler):
            def __init__(self, into: list):
                super().__init__()
                self.into = into

            def emit(self, record):
                self.into.append(record.getMessage())

        h = Keep(records)
        logging.getLogger("zero_kernels").addHandler(h)
        try:
            for step in range(4):
                zo.zero_grad()
                m(_x(rank, step)).pow(2).mean().backward()
                if step == 1 and rank == world - 1:  # a NaN in this rank's reduced shard only
                    shard = next(g for g in zo.parts.core.grads.shard_tensors() if g.numel())
                    shard.view(-1)[0] = float("nan")
                zo.step()
        finally:
            logging.getLogger("zero_kernels").removeHandler(h)
        said = [r for r in records if "non-finite gradients at step" in r]
        assert len(said) == 1, records
        seen[sync_free] = (zo.comm_stats["nonfinite_steps"], said[0])
        zo.reset_comm_stats()
        assert zo.comm_stats["nonfinite_steps"] == 0
        zo.close()
    assert seen[True] == seen[False], seen
    if rank == world - 1:
        assert seen[True][0] == 3 and "at step 1" in seen[True][1], seen
    out["nonfinite"] = "ok"
    return out
