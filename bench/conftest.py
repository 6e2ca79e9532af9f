"""pytest-benchmark runs of the kernel benchmarks (bench/test_*.py), apart from the test suite.

    python -m pytest bench --benchmark-only [--benchmark-json=bench/results/pytest_adam_cpu.json]

``python -m pytest tests`` (and a bare ``python -m pytest``: testpaths = ["tests"]) never collects
this folder. The memory-bandwidth floor is measured once per run (`bandwidth`), before the first
benchmark, and written into every benchmark's ``extra_info`` and into the JSON's ``bandwidth``.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import machine, memory_bandwidth  # noqa: E402

DEVICE = os.environ.get("ZK_BENCH_DEVICE", "cuda" if torch.cuda.is_available() else "cpu")
FLOOR_FLOATS = 10_000_000  # the floor is measured at the largest size benchmarked (as bench_adam)

_bandwidth: dict = {}


@pytest.fixture(scope="session")
def device() -> str:
    return DEVICE


@pytest.fixture(scope="session")
def bandwidth(device) -> dict:
    """This run's streaming bandwidth (`harness.memory_bandwidth`; ``floor_GBps`` is the max)."""
    if not _bandwidth:
        _bandwidth.update(memory_bandwidth(FLOOR_FLOATS, device))
        _bandwidth["device"] = device
    return dict(_bandwidth)


def pytest_benchmark_update_machine_info(config, machine_info):
    info = machine()
    machine_info["zero_kernels"] = {
        k: info.get(k)
        for k in ("cpu", "cores", "torch_threads", "torch", "gpu", "commit", "command")
    }
    machine_info["zero_kernels"]["cpu_isa"] = info.get("zero_kernels_cpu_isa")


def pytest_benchmark_update_json(config, benchmarks, output_json):
    output_json["bandwidth"] = dict(_bandwidth)
