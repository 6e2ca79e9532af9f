"""The step without host reads ([Note: no host sync] in zero_kernels/partition/syncfree.py): the
device-side forms switched on for CPU tensors give DDP's result at stages 1-3, clip_grad_norm_
returns torch's norm as a tensor, and no tensor is read on the host inside clip + step."""

import pytest
import syncfree_checks
from dist_utils import run_workers


@pytest.mark.distributed
@pytest.mark.parametrize("world", [1, 2])
def test_syncfree_step(world):
    rep = run_workers(syncfree_checks.check_syncfree, world, timeout=400)
    assert rep[0] == {"stage 1": "ok", "stage 2": "ok", "stage 3": "ok", "nonfinite": "ok"}
