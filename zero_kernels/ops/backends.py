"""Which kernel backend runs: native (cpu, cuda), triton or reference.

``auto`` picks the fastest backend that loads for the tensors' device and logs one line saying why
when it has to fall back; a backend asked for by name that cannot run raises with the reason.

[Note: CUDA images]
The native CUDA kernels run on a GPU only where the extension holds an image for it: machine code
sm_XY runs on capability X.y for y >= Y (the same major; an "a" suffix, sm_90a, on X.Y only), PTX
compute_XY is compiled by the driver for any capability >= X.Y. setup.py builds machine code for
each arch of ZERO_KERNELS_CUDA_ARCH (default 80;90) and PTX for the newest, and the extension
lists them (``_C.cuda_archs()``). ``auto`` checks the device against that list when it chooses
(`cuda_image_missing`, pure), before any launch, and on a GPU none of it runs on uses Triton,
saying why in one line; an explicit ``backend="cuda"`` raises there instead of failing at the
first launch with "no kernel image is available". An extension built before it listed its
images is taken to run (as before).
Imported by `zero_kernels.ops` (the public functions) and `zero_kernels.ops.library` (the custom
ops), neither of which imports the other's internals.
"""

from __future__ import annotations

import logging
import os

import torch

from .. import native

__all__ = ["BACKENDS", "cuda_image_missing", "resolve_backend"]

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


def _arch_number(name: str) -> int:
    return int("".join(c for c in name if c.isdigit()) or 0)


def cuda_image_missing(archs, capability: tuple[int, int]) -> str | None:
    """None where one of the CUDA images ``archs`` ("sm_80", "compute_90"...) runs on a GPU of
    ``capability`` (major, minor); else why not, in words ([Note: CUDA images]). ``archs``
    None (not known) is taken to run."""
    if archs is None:
        return None
    major, minor = capability
    cap = 10 * major + minor
    for a in archs:
        kind, _, arch = a.partition("_")
        n = _arch_number(arch)
        exact = arch.endswith("a")  # arch-specific: that capability only
        if kind == "sm" and (n == cap if exact else (n // 10 == major and n % 10 <= minor)):
            return None
        if kind == "compute" and (n == cap if exact else n <= cap):
            return None
    return (
        f"the extension's CUDA kernels hold {', '.join(archs) or 'no image'}, none of which runs "
        f"on this GPU (sm_{cap}); rebuild with ZERO_KERNELS_CUDA_ARCH={major}{minor}"
    )


_image_missing: dict[int, str | None] = {}  # CUDA device index -> `cuda_image_missing`'s answer


def _device_image_missing(device: torch.device) -> str | None:
    """`cuda_image_missing` for the native extension and ``device`` (cached per device)."""
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _image_missing:
        cap = torch.cuda.get_device_capability(idx)
        _image_missing[idx] = cuda_image_missing(native.cuda_archs(), cap)
    return _image_missing[idx]


def resolve_backend(backend: str, device: torch.device) -> str:
    """The backend that will run for tensors on ``device``: one of cpu, cuda, triton, reference."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got backend={backend!r}")
    dev = torch.device(device).type
    if backend == "auto":
        if dev == "cpu":
            if native.load() is not None:
                return "cpu"
            _say_once(
                f"zero_kernels: native extension not loaded ({native.error()}); "
                "using the pure-torch reference kernels"
            )
            return "reference"
        if dev == "cuda":
            if native.has_cuda_kernels():
                why = _device_image_missing(torch.device(device))
                if why is None:
                    return "cuda"
            else:
                why = "extension has no CUDA kernels"
            if _triton_error() is None:
                _say_once(f"zero_kernels: {why}; using the Triton kernels")
                return "triton"
            _say_once(f"zero_kernels: {why}, and no Triton; using the reference kernels")
            return "reference"
        return "reference"
    if backend == "cpu":
        if dev != "cpu":
            raise ValueError(f"backend='cpu' needs CPU tensors, got device={dev!r}")
        if native.load() is None:
            raise RuntimeError(
                f"backend='cpu': native extension failed to load: {native.error()!r}"
            )
    elif backend == "cuda":
        if dev != "cuda":
            raise ValueError(f"backend='cuda' needs CUDA tensors, got device={dev!r}")
        if not native.has_cuda_kernels():
            why = native.error() or "the extension was built without CUDA kernels"
            raise RuntimeError(f"backend='cuda' cannot run: {why!r}")
        why = _device_image_missing(torch.device(device))
        if why is not None:
            raise RuntimeError(f"backend='cuda' cannot run: {why}")
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
