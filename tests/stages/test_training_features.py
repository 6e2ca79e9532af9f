"""Clipping, accumulation, odd params, precision and loss scaling, checkpoints, comm pattern and
memory of ZeroOptimizer (gloo, spawned ranks): one spawned group per world size runs every
concern (zero_checks.FEATURE_CHECKS), each concern is a test of its own."""

import pytest
import zero_checks
from dist_utils import SharedRun

pytestmark = pytest.mark.distributed

FEATURES = SharedRun(zero_checks.features_all, timeout=400)


@pytest.mark.parametrize("check", [c.__name__ for c in zero_checks.FEATURE_CHECKS])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_features(world, check):
    FEATURES.check(world, check)
