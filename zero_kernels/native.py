"""Loads the compiled extension ``zero_kernels._C`` once and remembers why it failed, if it did.

No compilation happens here: the extension is built by ``pip install`` (setup.py). Without it the
package still imports and the ``auto`` backend falls back to the pure-torch reference.
"""

from __future__ import annotations

import logging
from types import ModuleType

log = logging.getLogger("zero_kernels")

_module: ModuleType | None = None
_error: BaseException | None = None
_loaded = False


def load() -> ModuleType | None:
    """The extension module, or None (then `error()` says why)."""
    global _module, _error, _loaded
    if not _loaded:
        _loaded = True
        try:
            import torch  # noqa: F401  (the extension links against libtorch)

            from zero_kernels import _C as module

            _module = module
        except ImportError as e:  # not built, or built against another torch
            _error = e
    return _module


def error() -> BaseException | None:
    load()
    return _error


def has_cuda_kernels() -> bool:
    m = load()
    return bool(m is not None and m.has_cuda())


def cuda_archs() -> tuple[str, ...] | None:
    """The CUDA images the extension holds ("sm_80", "sm_90", "compute_90"...); None where it
    does not say (built before it listed them, or without CUDA kernels)."""
    m = load()
    fn = getattr(m, "cuda_archs", None) if m is not None else None
    listed = fn() if fn is not None else ""
    return tuple(a for a in listed.split(",") if a) or None
