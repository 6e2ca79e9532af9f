"""Gradient norms accurate whatever a shard's length ([Note: accurate norms] in
zero_kernels/partition/syncfree.py): `pow_sum` against float64 on long heavy-tailed tensors (fp32,
bf16,
fp64; p = 1, 2, 3; lengths around its row size), and ``ZeroOptimizer.clip_grad_norm_`` against the
float64 norm of DDP's gradients at stages 1-3 (tests/stages/clip_norm_checks.py). torch's own
``clip_grad_norm_`` over `ShardedGrad`s: one collective per call ([Note: one collective per clip]
in zero_kernels/partition/grads.py), counted at world size 8 on torch's fake process group, with
DDP's norms and clipped gradients, and norms that follow every change of the gradients (spawned
gloo ranks)."""

import json
import subprocess
import sys
import textwrap

import clip_norm_checks
import pytest
import torch
from dist_utils import SharedRun, run_workers

from zero_kernels.partition import syncfree
from zero_kernels.partition.syncfree import NORM_ROW, pow_sum


def _heavy_tailed(n: int) -> torch.Tensor:
    """Gaussian blocks of 1000 whose scales span four decades (gradients of a real model)."""
    g = torch.Generator().manual_seed(0)
    scale = 10 ** (torch.rand(n // 1000 + 1, generator=g) * 4 - 4)
    return torch.randn(n, generator=g) * scale.repeat_interleave(1000)[:n]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_pow_sum_accurate_on_long_tensors(dtype):
    x = _heavy_tailed(4_000_037).to(dtype)
    for p in (1.0, 2.0, 3.0):
        exact = float(x.double().abs().pow(p).sum())
        ours = pow_sum(x, p)
        assert ours.dtype == torch.float64 and ours.dim() == 0
        err = abs(float(ours) - exact) / exact
        bound = 1e-12 if dtype == torch.float64 else 3e-7 * p
        # torch's own reduction of the whole fp32 tensor: ~4e-4 (p=2) to 3e-3 (p=1) here
        assert err <= bound, (dtype, p, err)


def test_pow_sum_lengths_around_a_row():
    assert float(pow_sum(torch.zeros(0), 2.0)) == 0.0
    for n in (1, NORM_ROW - 1, NORM_ROW, NORM_ROW + 1, 3 * NORM_ROW + 17):
        x = _heavy_tailed(n) + 1e-3
        for p in (1.0, 2.0):
            exact = float(x.double().abs().pow(p).sum())
            assert abs(float(pow_sum(x, p)) - exact) <= 1e-6 * exact, (n, p)
    # a view's own elements only (a shard is a view into a flat buffer)
    buf = torch.ones(3 * NORM_ROW)
    part = float(pow_sum(buf[NORM_ROW + 5 : 2 * NORM_ROW], 2.0))
    assert abs(part - (NORM_ROW - 5)) <= 1e-7 * NORM_ROW, part


def test_pow_sum_in_passes(monkeypatch):
    """bf16/fp16 rows come NORM_PASS elements per call: several passes sum to one's result."""
    x = _heavy_tailed(50_003)
    for dtype in (torch.bfloat16, torch.float16):
        y = x.to(dtype)
        whole = float(pow_sum(y, 2.0))
        monkeypatch.setattr(syncfree, "NORM_PASS", 4 * NORM_ROW)
        parts = float(pow_sum(y, 2.0))
        monkeypatch.undo()
        exact = float(y.double().pow(2).sum())
        assert abs(parts - exact) <= 1e-7 * exact and abs(whole - exact) <= 1e-7 * exact, dtype


CLIP = SharedRun(clip_norm_checks.clip_all, timeout=600)


@pytest.mark.distributed
def test_clip_grad_norm_matches_float64():
    rep = CLIP.check(2, "check_clip_norms")
    assert len(rep[0]) == len(clip_norm_checks.CASES), rep[0]
    assert all(v <= clip_norm_checks.NORM_TOL for v in rep[0].values()), rep[0]


@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize(
    "check",
    [
        "check_torch_clip_one_collective",
        "check_torch_clip_cases",
        "check_norms_follow_grads",
        "check_max_norm_inf",
    ],
)
def test_torch_clip_sharded_grads(world, check):
    """torch's clip over ShardedGrads: DDP's norm and grads with one collective (p = 2, inf, 1,
    foreach None/True/False, stages 1-3, two dtypes, param groups, a frozen layer), on a subset,
    over two optimizers, on non-finite grads; norms read by the user after each change of the
    gradients are the new ones."""
    CLIP.check(world, check)


FAKE_CLIP = """
import json, torch, torch.distributed as dist
from torch import nn
from torch.testing._internal.distributed.fake_pg import FakeStore

torch.set_num_threads(1)
dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
from zero_kernels import CommPolicy, ZeroOptimizer

calls = []
for name in ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter",
             "reduce_scatter_tensor", "broadcast", "all_to_all_single", "barrier"):
    def counted(*a, _f=getattr(dist, name), _n=name, **k):
        calls.append(_n)
        return _f(*a, **k)
    setattr(dist, name, counted)

def collectives(opt):
    return sum(v for k, v in opt.comm_stats.items() if k.endswith("_calls"))

out = {}
for stage in (1, 2, 3):
    torch.manual_seed(0)
    m = nn.Sequential(*[nn.Linear(16, 16) for _ in range(12)])  # 24 params
    comm = CommPolicy(bucket_size_mb=0.001)
    opt = ZeroOptimizer(m, torch.optim.AdamW, stage=stage, comm=comm, lr=1e-3)
    m(torch.randn(4, 16)).pow(2).mean().backward()
    for what, clip in (
        ("torch p=2", lambda: torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)),
        ("torch p=inf foreach", lambda: torch.nn.utils.clip_grad_norm_(
            m.parameters(), 1.0, float("inf"), foreach=True)),
        ("torch p=2 foreach=False", lambda: torch.nn.utils.clip_grad_norm_(
            m.parameters(), 1.0, foreach=False)),
        ("opt", lambda: opt.clip_grad_norm_(1.0)),
    ):
        calls.clear()
        before = collectives(opt)
        clip()
        out[f"stage {stage} {what}"] = [len(calls), collectives(opt) - before]
    opt.close()
print(json.dumps(out))
"""


def test_torch_clip_one_collective_at_world_8():
    """torch's clip_grad_norm_ over a 24-param model's ShardedGrads at stages 1-3, world size 8
    on torch's fake process group (in a subprocess: the pytest process keeps no group): one
    collective per call, as ``opt.clip_grad_norm_`` (it was one per param: 24)."""
    r = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(FAKE_CLIP)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-4000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert len(got) == 12, got
    assert all(v == [1, 1] for v in got.values()), got


@pytest.mark.distributed
def test_sharded_grad_norm_takes_no_copy():
    rep = run_workers(clip_norm_checks.check_sharded_grad_norm_memory, 1, timeout=200)
    assert rep[0]["peak_bytes"] <= rep[0]["grad_bytes"] // 4, rep[0]
