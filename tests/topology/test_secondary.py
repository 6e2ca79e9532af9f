"""Stage 3's secondary shard (issue 22, ``secondary_shard``, ZeRO++'s hpZ) on 4 gloo ranks in
blocks of 2: bitwise equal to plain stage 3 in the hard cases, the backward's all-gathers inside
the block, the kept bytes, quantized weights, bad values. One spawned group; each concern its
own test (tests/topology/secondary_checks.py)."""

import pytest
import secondary_checks
from dist_utils import SharedRun

RUN = SharedRun(secondary_checks.worker, timeout=600)


@pytest.mark.distributed
@pytest.mark.parametrize("check", [c.__name__ for c in secondary_checks.CHECKS])
def test_secondary(check):
    RUN.check(4, check)
