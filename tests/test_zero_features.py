"""Clipping, accumulation, odd params, precision, checkpoints, comm pattern and memory of
ZeroOptimizer (gloo, spawned ranks; several checks per spawned group)."""

import pytest
import zero_checks
from dist_utils import run_workers

pytestmark = pytest.mark.distributed


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_features(world):
    run_workers(zero_checks.features_all, world, timeout=400)
