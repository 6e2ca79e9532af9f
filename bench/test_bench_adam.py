"""bench_adam.py's candidates under pytest-benchmark: the Adam step at 1M and 10M params.

- plain step (28 bytes/param): `FusedAdamW` against torch.optim.AdamW ``fused=True`` and
  ``foreach=True``;
- full shard step (34 bytes/param): `ops.adam_step(check_finite, grad_scale, out_lowp)` in one
  pass against torch's unscale + fused AdamW + bf16 copy-out (its grad restore is untimed setup).

Each benchmark's ``extra_info`` holds the achieved GB/s (from the median), this run's bandwidth
floor and the fraction of it reached. pytest-benchmark times one candidate after another; the
alternating side-by-side ratios are `python bench/bench_adam.py`'s.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("pytest_benchmark")

import bench_adam  # noqa: E402  (bench/ is on sys.path: bench/conftest.py)

SIZES = {"1M": 1_000_000, "10M": 10_000_000}
ROUNDS = {"1M": 100, "10M": 30}
PLAIN = {
    "FusedAdamW": "zero_kernels FusedAdamW",
    "torch_fused": "torch AdamW fused",
    "torch_foreach": "torch AdamW foreach",
}
SHARD = {"zero_kernels_one_pass": "zero_kernels one pass", "torch_pipeline": "torch pipeline"}


def _synced(fn, device: str):
    if device != "cuda":
        return fn

    def run():
        fn()
        torch.cuda.synchronize()

    return run


def _run(benchmark, bandwidth, device, fn, setup, size: str, bytes_per_param: int) -> None:
    n = SIZES[size]
    benchmark.extra_info.update(params=n, bytes_per_param=bytes_per_param, device=device)
    benchmark.pedantic(
        _synced(fn, device),
        setup=None if setup is None else _synced(setup, device),
        rounds=ROUNDS[size],
        warmup_rounds=2,
    )
    if benchmark.stats is None:  # --benchmark-disable: ran once, nothing measured
        return
    gbps = bytes_per_param * n / benchmark.stats.stats.median / 1e9
    benchmark.extra_info.update(
        GBps=round(gbps, 2),
        floor_GBps=bandwidth["floor_GBps"],
        bw_fraction=round(gbps / bandwidth["floor_GBps"], 3),
        bandwidth=bandwidth,
    )


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("candidate", PLAIN)
def test_plain_step(benchmark, bandwidth, device, size, candidate):
    benchmark.group = f"plain step, {size} params"
    step = bench_adam.plain_candidate(PLAIN[candidate], SIZES[size], device)
    _run(benchmark, bandwidth, device, step, None, size, bytes_per_param=28)


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("candidate", SHARD)
def test_shard_step(benchmark, bandwidth, device, size, candidate):
    benchmark.group = f"full shard step, {size} params"
    step, restore = bench_adam.shard_candidate(SHARD[candidate], SIZES[size], device)
    _run(benchmark, bandwidth, device, step, restore, size, bytes_per_param=34)
