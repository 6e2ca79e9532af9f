"""ZeroOptimizer stages 1 and 2 against DDP + the same torch optimizer (gloo, spawned ranks):
every optimizer at world sizes 1-4, and the option variants (forced partitions, host_cache=False)
with one optimizer each at 2 ranks (and 3), in the same spawned groups."""

import pytest
import zero_checks
from dist_utils import SharedRun

pytestmark = pytest.mark.distributed

PARITY = SharedRun(zero_checks.parity_all, timeout=400)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_parity_every_optimizer(world):
    rep = PARITY.check(world, "check_parity")[0]
    # flat sharding for element-wise optimizers, whole params for the others
    modes = {k.split()[0]: v[2] for k, v in rep.items()}
    assert modes["Adafactor"] == modes["Lamb"] == modes["Muon"] == "whole"
    assert modes["SGD"] == modes["AdamW"] == modes["SignSGD"] == "flat"
    if world <= 2:  # no reordering of sums: non-fused optimizers give DDP's bits exactly
        assert rep[f"SGD mlp stage=1 world={world}"][1], rep


@pytest.mark.parametrize(
    "world, check",
    [(w, c.__name__) for c, worlds in zero_checks.PARITY_VARIANTS.items() for w in worlds],
)
def test_parity_variant(world, check):
    PARITY.check(world, check)
