"""offload_optimizer="nvme" (issue 23): the fused Adam step's moments in a file, streamed bucket by
bucket; at 2 ranks, bitwise the run without offload at stages 1-3 (fp32, bf16, amsgrad,
clipping), its I/O per step, checkpoints saved and loaded across offload and stage, state dicts,
memory counts, the file's lifetime, refusals. One spawned group
(tests/offload/offload_checks.py)."""

import offload_checks
import pytest
from dist_utils import SharedRun

RUN = SharedRun(offload_checks.worker, timeout=400)


pytestmark = pytest.mark.usefixtures("offload_dir")  # tests/conftest.py


@pytest.mark.distributed
@pytest.mark.parametrize("check", [c.__name__ for c in offload_checks.CHECKS])
def test_offload(check):
    RUN.check(2, check)
