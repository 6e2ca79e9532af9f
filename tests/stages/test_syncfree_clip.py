"""``torch.nn.utils.clip_grad_norm_`` on `ShardedGrad`s without host reads (issue 21): with the
sync-free mode ([Note: no host sync] in zero_kernels/partition/syncfree.py) switched on for CPU
tensors,
torch's clip (2-, inf- and 3-norm, foreach True/False/None) reads nothing back to the host and
gives DDP + torch's clip, at stages 1-3."""

import pytest
import syncfree_clip_checks
from dist_utils import run_workers


@pytest.mark.distributed
@pytest.mark.parametrize("world", [2])
def test_torch_clip_syncfree(world):
    rep = run_workers(syncfree_clip_checks.check_torch_clip_syncfree, world, timeout=400)
    assert len(rep[0]) == len(syncfree_clip_checks.CASES) + 1, rep[0]
