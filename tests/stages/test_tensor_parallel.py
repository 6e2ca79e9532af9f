"""ZeroOptimizer over tensor parallelism (2-D mesh, dp 2 x tp 2, gloo): training equal to the
DDP of the TP model at stages 1 and 2 with gradient accumulation, clipping over the whole model
across tp and dp, a non-finite verdict shared by every rank, and the refusals of what is not
built with tp (tests/stages/tp_checks.py, one spawned group of 4 ranks)."""

import pytest
import tp_checks
from dist_utils import SharedRun

TP = SharedRun(tp_checks.tp_all, timeout=240)


@pytest.mark.distributed
@pytest.mark.parametrize("check", tp_checks.CHECKS)
def test_tensor_parallel(check):
    TP.check(4, check)
