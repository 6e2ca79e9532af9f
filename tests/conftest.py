import os
import shutil
import sys
import tempfile

import pytest

# Triton runs on the CPU only through its interpreter; set before anything imports triton.
os.environ.setdefault("TRITON_INTERPRET", "1")
# Tests live in folders by concern; their helpers (dist_utils, numerics, the *_checks modules
# spawned ranks import by name) are found from any folder, here and in every process a test
# starts (spawned ranks take this sys.path; subprocesses and torchrun ranks read PYTHONPATH).
_HERE = os.path.dirname(os.path.abspath(__file__))
TEST_DIRS = [_HERE] + sorted(
    os.path.join(_HERE, d)
    for d in os.listdir(_HERE)
    if os.path.isdir(os.path.join(_HERE, d))
    and d not in ("data", "testbed_scripts")
    and not d.startswith((".", "_"))
)
for _d in reversed(TEST_DIRS):
    if _d not in sys.path:
        sys.path.insert(0, _d)
os.environ["PYTHONPATH"] = os.pathsep.join(
    TEST_DIRS + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
)

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
