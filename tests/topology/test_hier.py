"""Hierarchical sharding (issue 22, ``shard_group``): 4 ranks in 2 shard groups of 2 against
DDP with fused AdamW at stages 1-3, clipping over one copy of the gradients, whole-state access,
bytes across replica groups, the shorthands ("node", K, a DeviceMesh) and bad values. One spawned
group; each concern its own test (tests/topology/hier_checks.py)."""

import hier_checks
import pytest
from dist_utils import SharedRun

RUN = SharedRun(hier_checks.worker, timeout=600)


@pytest.mark.distributed
@pytest.mark.parametrize("check", [c.__name__ for c in hier_checks.CHECKS])
def test_hier(check):
    RUN.check(4, check)
