"""ZeroOptimizer(state_dtype="bf16") (issue 25): the sharded fused step with bf16 moments at 2
ranks, stages 1-3, against FusedAdamW(state_dtype="bf16") on the averaged gradients; memory,
checkpoints across stage and state dtype, refusals. One spawned group
(tests/precision/lowbit_checks.py)."""

import lowbit_checks
import pytest
from dist_utils import SharedRun

RUN = SharedRun(lowbit_checks.worker, timeout=300)


@pytest.mark.distributed
@pytest.mark.parametrize("check", [c.__name__ for c in lowbit_checks.CHECKS])
def test_lowbit_zero(check):
    RUN.check(2, check)
