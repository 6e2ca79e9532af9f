"""Backend choice: the package works without the native extension, saying so once; an explicit
backend that cannot load raises with the original error."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from zero_kernels import native

BLOCKER = textwrap.dedent(
    """
    import sys, importlib.abc
    class Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name == "zero_kernels._C":
                raise ImportError("simulated: extension not built")
    sys.meta_path.insert(0, Block())
    """
)


def run_py(code: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", BLOCKER + textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_without_extension_auto_falls_back_once_and_trains():
    r = run_py(
        """
        import torch, zero_kernels
        p = torch.nn.Parameter(torch.ones(5))
        opt = zero_kernels.FusedAdamW([p], lr=0.1)
        for _ in range(3):
            p.grad = torch.ones(5)
            opt.step()
        assert p.detach().lt(1).all(), p
        print("trained")
        """
    )
    assert r.returncode == 0, r.stderr
    assert "trained" in r.stdout
    # one line saying why, not one per step
    assert r.stderr.count("native extension not loaded") == 1, r.stderr
    assert "simulated: extension not built" in r.stderr


def test_without_extension_explicit_cpu_backend_raises_with_reason():
    r = run_py(
        """
        import torch, zero_kernels
        p = torch.nn.Parameter(torch.ones(5))
        opt = zero_kernels.FusedAdamW([p], backend="cpu")
        p.grad = torch.ones(5)
        try:
            opt.step()
        except RuntimeError as e:
            print("raised:", e)
        """
    )
    assert r.returncode == 0, r.stderr
    assert "raised:" in r.stdout and "simulated: extension not built" in r.stdout


@pytest.mark.skipif(native.load() is None, reason="extension not built")
def test_with_extension_auto_picks_native_cpu():
    from zero_kernels import ops

    assert ops.resolve_backend("auto", "cpu") == "cpu"
    assert native.load().cpu_isa() in ("scalar", "avx2", "avx512")
