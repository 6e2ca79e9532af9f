"""reset_comm_stats() leaves the step counter alone; the step ledger's entries (one per step,
its outcome, what the counters grew by: [Note: the step ledger]); the list of options in the
unknown-keyword error is ZeroOptimizer's own signature (issue 21). In-process, world size 1."""

import inspect
import os

import pytest
import torch
from torch import nn
from zero_opt import zero_opt

import zero_kernels
from zero_kernels import ZeroOptimizer


def _train(m, zo, steps):
    for s in range(steps):
        zo.zero_grad()
        m(torch.full((2, 4), float(s))).pow(2).mean().backward()
        zo.step()


def test_reset_comm_stats_keeps_the_step_counter(tmp_path):
    m = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    zo = ZeroOptimizer(m, torch.optim.AdamW, stage=2, lr=1e-2)
    _train(m, zo, 3)
    assert zo.comm_stats["steps"] == 3
    zo.reset_comm_stats()
    assert zo.comm_stats["steps"] == 0 and zo.comm_stats["reduce_scatter_calls"] == 0
    zero_kernels.save_checkpoint(str(tmp_path), m, zo)
    assert os.path.isdir(tmp_path / "step-00000003"), sorted(os.listdir(tmp_path))
    _train(m, zo, 1)
    assert zo.comm_stats["steps"] == 1
    zero_kernels.save_checkpoint(str(tmp_path), m, zo)
    assert os.path.isdir(tmp_path / "step-00000004"), sorted(os.listdir(tmp_path))
    zo.close()


def test_step_ledger_one_entry_per_step_with_its_outcome():
    """A step, a skipped one (nonfinite="skip"), one that raised (nonfinite="raise"): one entry
    each with its outcome; the entries add up to comm_stats; a reset empties the ledger."""
    m = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    zo = zero_opt(m, torch.optim.AdamW, stage=2, lr=1e-2, nonfinite="skip")
    _train(m, zo, 1)
    zo.zero_grad()
    (m(torch.ones(2, 4)).sum() * float("inf")).backward()
    zo.step()  # skipped
    zo.nonfinite = zo.parts.stepper.nonfinite = "raise"
    zo.zero_grad()
    (m(torch.ones(2, 4)).sum() * float("nan")).backward()
    with pytest.raises(FloatingPointError):
        zo.step()
    ledger = zo.comm_ledger
    assert [(e["step"], e["outcome"]) for e in ledger] == [
        (0, "stepped"), (1, "skipped"), (2, "raised")
    ], ledger  # fmt: skip
    cs = zo.comm_stats
    for k in ("reduce_scatter_bytes", "reduce_scatter_calls", "all_gather_bytes"):
        assert sum(e[k] for e in ledger) == cs[k] > 0, (k, ledger, cs)
    assert ledger[0]["all_gather_calls"] > 0 and ledger[1]["all_gather_calls"] == 0  # skipped
    assert all(e["cross_node_bytes"] == e["inside_node_bytes"] == 0 for e in ledger)  # 1 rank
    zo.reset_comm_stats()
    assert zo.comm_ledger == []
    _train(m, zo, 1)
    assert [e["step"] for e in zo.comm_ledger] == [2]
    zo.close()


def test_unknown_keyword_lists_every_option():
    m = nn.Linear(4, 2)
    sig = inspect.signature(ZeroOptimizer.__init__).parameters.values()
    own = [p.name for p in sig if p.kind is inspect.Parameter.KEYWORD_ONLY]
    assert "gather" in own and "execution" in own and "policy" in own
    with pytest.raises(TypeError, match="unexpected keyword") as e:
        ZeroOptimizer(m, torch.optim.SGD, stage=1, lr=0.1, bucket_size=3)
    for name in own:
        assert name in str(e.value), name
