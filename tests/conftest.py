import os
import shutil
import sys
import tempfile

import pytest

# Triton runs on the CPU only through its interpreter; set before anything imports triton.
os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, os.path.dirname(__file__))

# the `testbed` fixture (several namespace nodes over a rate-limited link): tests/testbed_fixture.py
pytest_plugins = ["testbed_fixture"]


@pytest.fixture(scope="module")
def offload_dir():
    """A folder for the offload tiers' files, on a disk rather than tmpfs where there is one
    (O_DIRECT is what the tiers use), named to the spawned ranks by ``ZK_TEST_OFFLOAD_DIR``
    (they read it at import); it must be empty again when the module's tests are done."""
    base = "/var/tmp" if os.path.isdir("/var/tmp") else None
    d = tempfile.mkdtemp(prefix="zk-offload-", dir=base)
    os.environ["ZK_TEST_OFFLOAD_DIR"] = d
    yield d
    os.environ.pop("ZK_TEST_OFFLOAD_DIR", None)
    left = os.listdir(d)
    shutil.rmtree(d, ignore_errors=True)
    assert not left, f"offload files left behind: {left}"
