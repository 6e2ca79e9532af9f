"""Which GPUs the native CUDA kernels run on ([Note: CUDA images] in zero_kernels/ops/backends.py):
setup.py builds machine code for each listed arch and PTX for the newest, the extension lists
them, and backend "auto" uses Triton, saying why once, on a GPU none of them runs on (before, an
sm_120 GPU got the CUDA backend and failed at the first launch: "no kernel image is available").
Pure decisions, on the CPU: the GPU's capability and the extension's list are stand-ins."""

import ast
import logging
import os
import sys

import pytest
import torch

from zero_kernels import native
from zero_kernels.ops import backends
from zero_kernels.ops.backends import cuda_image_missing

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BUILT = ("sm_80", "sm_90", "compute_90")  # setup.py's default images


@pytest.mark.parametrize("cap", [(8, 0), (8, 6), (8, 9), (9, 0), (10, 0), (10, 3), (12, 0)])
def test_default_images_run_on_ampere_hopper_and_newer(cap):
    assert cuda_image_missing(BUILT, cap) is None


@pytest.mark.parametrize(
    "archs, cap",
    [
        (BUILT, (7, 5)),  # older than any image
        (("sm_80", "sm_90"), (12, 0)),  # machine code only (the build before): no image for sm_120
        (("sm_80", "sm_90"), (10, 0)),
        (("sm_90a",), (10, 0)),  # arch-specific code runs on its own capability only
        (("compute_90a",), (12, 0)),
        ((), (9, 0)),
    ],
)
def test_no_image_says_why(archs, cap):
    why = cuda_image_missing(archs, cap)
    assert why is not None and f"sm_{cap[0]}{cap[1]}" in why, why
    assert f"ZERO_KERNELS_CUDA_ARCH={cap[0]}{cap[1]}" in why, why


def test_arch_specific_and_unknown_lists():
    assert cuda_image_missing(("sm_90a",), (9, 0)) is None
    assert cuda_image_missing(("sm_86",), (8, 9)) is None and cuda_image_missing(("sm_86",), (8, 0))
    assert cuda_image_missing(None, (12, 0)) is None  # an extension that does not list: as before


@pytest.fixture
def gpu(monkeypatch):
    """A CUDA extension on a stand-in GPU of capability ``gpu.cap`` with Triton present."""

    class GPU:
        cap = (12, 0)
        archs = ("sm_80", "sm_90")

    monkeypatch.setattr(native, "has_cuda_kernels", lambda: True)
    monkeypatch.setattr(native, "cuda_archs", lambda: GPU.archs)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda idx=None: GPU.cap)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(backends, "_triton_error", lambda: None)
    monkeypatch.setattr(backends, "_image_missing", {})
    monkeypatch.setattr(backends, "_said", set())
    return GPU


def test_auto_uses_triton_where_no_image_runs_and_says_why_once(gpu, caplog):
    with caplog.at_level(logging.WARNING, logger="zero_kernels"):
        for _ in range(3):
            assert backends.resolve_backend("auto", torch.device("cuda", 0)) == "triton"
    lines = [r.getMessage() for r in caplog.records if "Triton" in r.getMessage()]
    assert len(lines) == 1 and "sm_80, sm_90" in lines[0] and "sm_120" in lines[0], lines
    with pytest.raises(RuntimeError, match="sm_120"):
        backends.resolve_backend("cuda", torch.device("cuda", 0))


def test_auto_keeps_the_native_kernels_where_an_image_runs(gpu):
    gpu.archs = BUILT  # PTX for compute_90: the driver compiles it for sm_120
    assert backends.resolve_backend("auto", torch.device("cuda", 0)) == "cuda"
    assert backends.resolve_backend("cuda", "cuda") == "cuda"


def _setup_function(name: str):
    """A function of setup.py, compiled alone (running setup.py would build)."""
    tree = ast.parse(open(os.path.join(ROOT, "setup.py")).read())
    fn = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name]
    assert fn, f"setup.py has no {name}()"
    ns = {"sys": sys}
    exec(compile(ast.Module(fn, []), "setup.py", "exec"), ns)
    return ns[name]


def test_setup_builds_ptx_for_the_newest_arch():
    images = _setup_function("cuda_images")
    assert tuple(images("80;90")) == BUILT
    assert images("90,80") == ["sm_90", "sm_80", "compute_90"]
    assert images("80;90a") == ["sm_80", "sm_90a", "compute_90"]  # portable PTX
    assert images("80;90;100;120")[-1] == "compute_120"
    for cap in ((9, 0), (12, 0)):
        assert cuda_image_missing(images("90"), cap) is None
    with pytest.raises(SystemExit):
        images("")


def test_the_extension_lists_its_images_or_nothing():
    archs = native.cuda_archs()  # None: a CPU build, or one from before the list
    assert archs is None or all(a.startswith(("sm_", "compute_")) for a in archs), archs
