"""offload_optimizer="cpu" (issue 23): the host tier, masters and moments in host memory and the
step on the CPU kernel for params on a GPU. On CPU params (every CI run) it runs the same code
path with host copies: bitwise the run without it at stages 1-3 (fp32, bf16, amsgrad, int8 and
bf16 moments, stochastic rounding, clipping), its copies per step, memory counts, checkpoints
across the tier and stage, state dicts, a skipped step, refusals. One spawned group
(tests/offload/offload_host_checks.py); the GPU run is bench/gpu_offload_check.py."""

import offload_host_checks
import pytest
from dist_utils import SharedRun

RUN = SharedRun(offload_host_checks.worker, timeout=400)

pytestmark = pytest.mark.usefixtures("offload_dir")  # tests/conftest.py


@pytest.mark.distributed
@pytest.mark.parametrize("check", [c.__name__ for c in offload_host_checks.CHECKS])
def test_offload_host(check):
    RUN.check(2, check)
