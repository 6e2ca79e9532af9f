"""Leaving ``with ZeroOptimizer(...)`` through an exception on one rank, and close() called on
one rank only, end on that rank without a hang (issue 21): no collective in the first, a bounded
one in the second. Run on spawned gloo ranks by tests/stages/test_close.py."""

from __future__ import annotations

import time

import torch
from torch import nn
from zero_opt import zero_opt

from zero_kernels.comm import CollectiveTimeout


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(6, 6) for _ in range(3))

    def forward(self, x):
        for b in self.blocks:
            x = torch.tanh(b(x))
        return x


class Boom(Exception):
    pass


def check_close(rank: int, world: int) -> dict:
    out = {}
    x = torch.randn(2, 6)
    # an exception inside the with-block on rank 1 only: rank 1 leaves at once with its own
    # exception; rank 0's next collective times out instead of waiting forever
    t0 = time.monotonic()
    try:
        with zero_opt(Net(), torch.optim.SGD, stage=3, lr=0.1, timeout=4) as zo:
            m = zo.parts.core.module
            m(x).sum().backward()
            zo.step()
            if rank == 1:
                raise Boom("a bad batch")
            m(x).sum().backward()
            zo.step()
    except Boom:
        took = time.monotonic() - t0
        assert took < 3, f"rank 1 took {took:.1f} s to leave the with-block"
        out["raising rank leaves at once"] = "ok"
    except (CollectiveTimeout, RuntimeError, ValueError) as e:
        assert rank == 0, (rank, e)
        out["other rank gets an error"] = "ok"
    return out


def check_close_one_rank(rank: int, world: int) -> dict:
    """In a process group of its own (a gloo wait that timed out above closes the group's
    pairs): close() on one rank only is a RuntimeError after the timeout on that rank."""
    out = {}
    zo = zero_opt(Net(), torch.optim.SGD, stage=3, lr=0.1, timeout=3)
    if rank == 0:
        t0 = time.monotonic()
        try:
            zo.close()
            raise AssertionError("close() on one rank returned")
        except RuntimeError as e:
            assert "collective" in str(e), e
            assert time.monotonic() - t0 < 30
        assert zo.closed and all(
            getattr(p, "_zero_kernels_owner", None) is None
            for p in zo.parts.core.module.parameters()
        ), "close() that failed left the optimizer half open"
        out["close on one rank raises"] = "ok"
    else:
        time.sleep(8)  # past rank 0's timeout, then leave without closing
        out["close on one rank raises"] = "ok"
    return out
