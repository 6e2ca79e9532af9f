"""Which kernel backend runs: native (cpu, cuda), triton or reference.

``auto`` picks the fastest backend that loads for the tensors' device and logs one line saying why
when it has to fall back; a backend asked for by name that cannot run raises with the reason.
Imported by `zero_kernels.ops` (the public functions) and `zero_kernels.ops.library` (the custom
ops), neither of which imports the other's internals.
"""

from __future__ import annotations

import logging
import os

import torch

from .. import _native

__all__ = ["BACKENDS", "resolve_backend"]

log = logging.getLogger("zero_kernels")

BACKENDS = ("auto", "cpu", "cuda", "triton", "reference")
_said: set[str] = set()


def _say_once(msg: str) -> None:
    if msg not in _said:
        _said.add(msg)
        log.warning(msg)


def _triton_error() -> BaseException | None:
    try:
        from . import triton_adam  # noqa: F401
    except Exception as e:  # ImportError, or triton present but broken
        return e
    return None


def resolve_backend(backend: str, device: torch.device) -> str:
    """The backend that will run for tensors on ``device``: one of cpu, cuda, triton, reference."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got backend={backend!r}")
    dev = torch.device(device).type
    if backend == "auto":
        if dev == "cpu":
            if _native.load() is not None:
                return "cpu"
            _say_once(
                f"zero_kernels: native extension not loaded ({_native.error()}); "
                "using the pure-torch reference kernels"
            )
            return "reference"
        if dev == "cuda":
            if _native.has_cuda_kernels():
                return "cuda"
            if _triton_error() is None:
                _say_once("zero_kernels: extension has no CUDA kernels; using the Triton kernels")
                return "triton"
            _say_once("zero_kernels: no CUDA kernels and no Triton; using the reference kernels")
            return "reference"
        return "reference"
    if backend == "cpu":
        if dev != "cpu":
            raise ValueError(f"backend='cpu' needs CPU tensors, got device={dev!r}")
        if _native.load() is None:
            raise RuntimeError(
                f"backend='cpu': native extension failed to load: {_native.error()!r}"
            )
    elif backend == "cuda":
        if dev != "cuda":
            raise ValueError(f"backend='cuda' needs CUDA tensors, got device={dev!r}")
        if not _native.has_cuda_kernels():
            why = _native.error() or "the extension was built without CUDA kernels"
            raise RuntimeError(f"backend='cuda' cannot run: {why!r}")
    elif backend == "triton":
        if dev == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(
                "backend='triton' got CPU tensors: Triton runs on CPU tensors only under its "
                "interpreter (set TRITON_INTERPRET=1 before importing triton), or use "
                f"backend='cpu' or 'auto'; got device={dev!r}, "
                f"TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET')!r}"
            )
        err = _triton_error()
        if err is not None:
            raise RuntimeError(f"backend='triton' cannot run: {err!r}")
    return backend
