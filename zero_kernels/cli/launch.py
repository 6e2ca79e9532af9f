"""What the command's jobs (demo, tune, bench) share about launching ranks and the machine they
run on: whether torchrun started this process, a free port for spawned ranks, the stages this
install can run, the cores this process may use and a description of the machine."""

from __future__ import annotations

import os
import platform
import socket

__all__ = ["available_stages", "cores", "free_port", "machine", "under_torchrun"]


def under_torchrun() -> bool:
    """Whether this process is a rank started by torchrun (its variables are set)."""
    return "LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ and "RANK" in os.environ


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for the rendezvous of spawned ranks)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def available_stages() -> tuple[int, ...]:
    """0 (DDP) always; 1, 2 and 3 when ZeroOptimizer is importable."""
    stages = [0]
    try:
        from ..optimizer import ZeroOptimizer  # noqa: F401

        stages += [1, 2, 3]
    except ImportError:
        pass
    return tuple(stages)


def cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def machine() -> dict:
    """The machine and versions a measurement was taken with."""
    import torch

    from .._version import __version__

    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cores": cores(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "zero_kernels": __version__,
        "backend": "gloo (CPU)",
    }
