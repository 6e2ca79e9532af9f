"""ZeroOptimizer stages 1 and 2 against DDP + the same torch optimizer (gloo, spawned ranks)."""

import pytest
import zero_checks
from dist_utils import run_workers

pytestmark = pytest.mark.distributed


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_parity_every_optimizer(world):
    reports = run_workers(zero_checks.check_parity, world, timeout=400)
    rep = reports[0]
    # flat sharding for element-wise optimizers, whole params for the others
    modes = {k.split()[0]: v[2] for k, v in rep.items()}
    assert modes["Adafactor"] == modes["Lamb"] == modes["Muon"] == "whole"
    assert modes["SGD"] == modes["AdamW"] == modes["SignSGD"] == "flat"
    if world <= 2:  # no reordering of sums: non-fused optimizers give DDP's bits exactly
        assert rep[f"SGD mlp stage=1 world={world}"][1], rep
