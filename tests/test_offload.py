"""offload_optimizer="nvme" (issue 23): the fused Adam step's moments in a file, streamed bucket by
bucket; at 2 ranks, bitwise the run without offload at stages 1-3 (fp32, bf16, amsgrad,
clipping), its I/O per step, checkpoints saved and loaded across offload and stage, state dicts,
memory counts, the file's lifetime, refusals. One spawned group (tests/offload_checks.py)."""

import os
import shutil
import tempfile

import offload_checks
import pytest
from dist_utils import SharedRun

RUN = SharedRun(offload_checks.worker, timeout=400)


@pytest.fixture(scope="module", autouse=True)
def _offload_dir():
    # a disk, not tmpfs, where there is one: O_DIRECT is what the tier uses
    base = "/var/tmp" if os.path.isdir("/var/tmp") else None
    d = tempfile.mkdtemp(prefix="zk-offload-", dir=base)
    os.environ["ZK_TEST_OFFLOAD_DIR"] = d  # read by the spawned ranks at import
    yield
    os.environ.pop("ZK_TEST_OFFLOAD_DIR", None)
    left = os.listdir(d)
    shutil.rmtree(d, ignore_errors=True)
    assert not left, f"offload files left behind: {left}"


@pytest.mark.distributed
@pytest.mark.parametrize("check", [c.__name__ for c in offload_checks.CHECKS])
def test_offload(check):
    RUN.check(2, check)
