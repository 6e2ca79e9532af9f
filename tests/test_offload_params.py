"""offload_params="nvme" (issue 23): stage 3's param shards in a file between uses; at 2 ranks,
bitwise the run without offload (fp32, bf16, clipping, with offload_optimizer, prefetch and
resharding on and off, params kept whole), reads ahead taken, checkpoints across offload and
stage, whole-param access, memory counts, the file's lifetime, refusals. One spawned group
(tests/offload_params_checks.py)."""

import os
import shutil
import tempfile

import offload_params_checks
import pytest
from dist_utils import SharedRun

RUN = SharedRun(offload_params_checks.worker, timeout=400)


@pytest.fixture(scope="module", autouse=True)
def _offload_dir():
    # a disk, not tmpfs, where there is one: O_DIRECT is what the tier uses
    base = "/var/tmp" if os.path.isdir("/var/tmp") else None
    d = tempfile.mkdtemp(prefix="zk-offp-", dir=base)
    os.environ["ZK_TEST_OFFLOAD_DIR"] = d  # read by the spawned ranks at import
    yield
    os.environ.pop("ZK_TEST_OFFLOAD_DIR", None)
    left = os.listdir(d)
    shutil.rmtree(d, ignore_errors=True)
    assert not left, f"offload files left behind: {left}"


@pytest.mark.distributed
@pytest.mark.parametrize("check", [c.__name__ for c in offload_params_checks.CHECKS])
def test_offload_params(check):
    RUN.check(2, check)
