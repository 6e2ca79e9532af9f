"""Params that are never resharded are units too (issue 21, [Note: kept whole]): stages 1/2 hold
one kept unit per bucket, stage 3 its persistent unit; a step's all-gathers are held by those
units and finished by the one mechanism (`Unit.finish`) that stage 3's resharded units use. One
rank, in-process (the multi-rank result of overlap_param_gather is
contract_checks.check_overlap_gather)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from zero_opt import zero_opt

from zero_kernels.partition.kept import KeptWhole
from zero_kernels.partition.units import Unit, UnitState

X = torch.randn(3, 4, generator=torch.Generator().manual_seed(1))


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))


def test_transition_tables():
    kept = Unit(0, "k", None, persistent=True)
    kept.move(UnitState.GATHERING)
    kept.move(UnitState.GATHERED)
    kept.move(UnitState.GATHERING)  # a step's all-gather of new values, in place
    kept.move(UnitState.GATHERED)
    with pytest.raises(AssertionError, match="GATHERED -> UnitState.SHARDED"):
        kept.move(UnitState.SHARDED)  # never resharded
    resharded = Unit(1, "r", None)
    resharded.move(UnitState.GATHERING)
    resharded.move(UnitState.GATHERED)
    with pytest.raises(AssertionError, match="GATHERED -> UnitState.GATHERING"):
        resharded.move(UnitState.GATHERING)  # must be freed first
    with pytest.raises(AssertionError, match="unit r is resharded"):
        KeptWhole([resharded], "unit", None, str)


class _Handle:
    def __init__(self, log, name):
        self.log, self.name = log, name

    def wait(self, timeout_s=None, what="", watch=None):
        self.log.append((self.name, what))


def test_launched_and_waited_once():
    log = []
    units = []
    for k in range(3):
        u = Unit(k, str(k), None, persistent=True)
        u.buckets.append((0, k))
        u.move(UnitState.GATHERING)
        u.move(UnitState.GATHERED)
        units.append(u)
    kept = KeptWhole(units, "bucket", 5.0, lambda: "step 7")
    kept.launched([((0, 0), _Handle(log, "a")), ((0, 2), _Handle(log, "b"))])
    assert kept.in_flight == 2
    assert [u.state for u in units] == [
        UnitState.GATHERING,
        UnitState.GATHERED,
        UnitState.GATHERING,
    ]
    kept.wait([2, 1])
    assert log == [("b", "step 7: all-gather of bucket 2")]
    kept.wait([2])  # nothing left in flight there
    kept.wait_all()
    assert log[1] == ("a", "step 7: all-gather of bucket 0") and len(log) == 2
    assert kept.in_flight == 0 and all(u.state is UnitState.GATHERED for u in units)


@pytest.mark.parametrize("stage", [1, 2])
def test_stages_1_2_are_kept_units(stage):
    model, ref = _net(), _net()
    zo = zero_opt(
        model,
        torch.optim.SGD,
        stage=stage,
        lr=0.1,
        overlap_param_gather=True,
        bucket_size_mb=0.0002,
    )
    kept = zo.parts.core.kept
    n_buckets = sum(len(b.buckets) for b in zo.parts.core.layout.buffers)
    assert n_buckets >= 2 and len(kept.units) == n_buckets  # one unit per bucket
    assert all(u.persistent and u.state is UnitState.GATHERED for u in kept.units)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(3):
        model(X).sum().backward()
        zo.step()
        zo.zero_grad()
        ref(X).sum().backward()
        opt.step()
        opt.zero_grad()
        assert zo.parts.params.in_flight == n_buckets  # left for the next forward
        if step == 1:
            zo.wait_params()
            assert zo.parts.params.in_flight == 0
    model[0](X)  # the first module's forward waits for its own units only
    assert 0 < zo.parts.params.in_flight < n_buckets
    zo.wait_params()
    for p, r in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p, r)
    zo.close()


def test_stage_3_persistent_unit_is_kept():
    model = _net()
    zo = zero_opt(model, torch.optim.SGD, stage=3, lr=0.1, units=[nn.Linear], persist_below=1000)
    core = zo.parts.core
    assert core.kept.units == [core.units.persistent] and core.kept.noun == "unit"
    model(X).sum().backward()
    zo.step()
    # without overlap_param_gather the step finishes its all-gathers itself
    assert zo.parts.params.in_flight == 0
    assert core.units.persistent.state is UnitState.GATHERED
    zo.close()
