"""add_param_group at stages 1-3 gives torch's result (issue 21)."""

import param_group_checks
import pytest
import torch
from dist_utils import run_workers
from torch import nn

from zero_kernels import ZeroOptimizer


@pytest.mark.distributed
def test_add_param_group_matches_torch():
    reps = run_workers(param_group_checks.check_add_param_group, 2, timeout=300)
    for rep in reps:
        assert len(rep) == 6 and set(rep.values()) == {"ok"}, rep


def test_add_param_group_bad_input():
    a, b = nn.Linear(3, 3), nn.Linear(3, 3)
    zo = ZeroOptimizer(a.parameters(), torch.optim.SGD, stage=2, lr=0.1)
    with pytest.raises(ValueError, match="more than one parameter group"):
        zo.add_param_group({"params": [a.weight]})
    with pytest.raises(TypeError, match="must be a dict with 'params'"):
        zo.add_param_group([b.weight])
    zo.add_param_group({"params": b.parameters(), "lr": 0.5})
    assert [g["lr"] for g in zo.param_groups] == [0.1, 0.5]
    zo.close()
