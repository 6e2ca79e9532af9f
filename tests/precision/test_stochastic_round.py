"""bf16_stochastic_round (issue 25): bf16 params stepped without fp32 masters, rounded back
stochastically ([Note: stochastic rounding] in zero_kernels/ops/sr.py). The rounding op on every
backend (bitwise equal, unbiased, inf/NaN as round to nearest, refusals); FusedAdamW with the
option (fp32 moments kept through a load, resume bitwise); ZeroOptimizer at stages 1-3 at 2 ranks
bitwise equal to FusedAdamW in one process, no masters, checkpoints
(tests/precision/sr_checks.py)."""

from __future__ import annotations

import copy
import os

import pytest
import sr_checks
import torch
from dist_utils import SharedRun
from torch import nn

import zero_kernels
from zero_kernels import native
from zero_kernels.ops.sr import sr_key, stochastic_round_bf16_

RUN = SharedRun(sr_checks.worker, timeout=300)


def _backends():
    out = ["reference"]
    if native.load() is not None:
        out.append("cpu")
    try:
        import triton  # noqa: F401

        from zero_kernels.ops import triton_sr  # noqa: F401

        if os.environ.get("TRITON_INTERPRET") == "1":
            out.append("triton")
    except Exception:
        pass
    return out


def _values(n=4099):
    torch.manual_seed(0)
    x = torch.randn(n) * torch.logspace(-30, 30, n)
    x[:8] = torch.tensor([float("inf"), float("-inf"), float("nan"), 0.0, -0.0, 3.4e38, -1e-40, 1])
    return x


def test_backends_bitwise_equal_and_non_finite():
    x = _values()
    got = {}
    for be in _backends():
        d = torch.empty(x.numel(), dtype=torch.bfloat16)
        stochastic_round_bf16_(d, x, sr_key(7, 3), first=2**32 - 100, backend=be)
        got[be] = d.view(torch.int16).clone()
    assert len(got) >= 2, got.keys()  # the native kernel (or Triton) against the reference
    ref = got["reference"]
    for be, v in got.items():
        assert torch.equal(v, ref), be
    d = ref.view(torch.bfloat16)
    # inf and NaN as round to nearest; zeros keep their sign; every value is one of the two
    # bf16 neighbours of x (toward zero or away from it)
    assert d[0] == float("inf") and d[1] == float("-inf") and torch.isnan(d[2])
    assert d[3].item() == 0.0 and torch.signbit(d[4]) and not torch.signbit(d[3])
    lo = x.bfloat16()  # nearest
    down = (x.view(torch.int32) & ~0xFFFF).view(torch.float32)  # truncated toward zero
    fin = torch.isfinite(x) & torch.isfinite(d.float())
    up = torch.nextafter(down.bfloat16(), torch.where(x < 0, -torch.inf, torch.inf).bfloat16())
    ok = (d.float() == down) | (d.float() == up.float())
    assert bool(ok[fin].all())
    assert bool((d.float() != lo.float())[fin].any()), "never rounded away from nearest"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a CUDA device (bench/gpu_check.sh)")
def test_cuda_backends_equal_cpu():
    x = _values()
    want = torch.empty(x.numel(), dtype=torch.bfloat16)
    stochastic_round_bf16_(want, x, sr_key(7, 3), first=5, backend="reference")
    for be in ("auto", "triton", "reference"):
        d = torch.empty(x.numel(), dtype=torch.bfloat16, device="cuda")
        stochastic_round_bf16_(d, x.cuda(), sr_key(7, 3), first=5, backend=be)
        assert torch.equal(d.cpu().view(torch.int16), want.view(torch.int16)), be
    # FusedAdamW with the option on CUDA params: the CPU run's bits
    got = []
    for dev in ("cpu", "cuda"):
        torch.manual_seed(0)
        p = nn.Parameter(torch.randn(5000).bfloat16().to(dev))
        o = zero_kernels.FusedAdamW([p], lr=1e-2, bf16_stochastic_round=True)
        for t in range(3):
            p.grad = torch.full_like(p, 0.01 * (t + 1))
            o.step()
        got.append(p.detach().cpu())
    assert torch.equal(got[0], got[1])


def test_unbiased_and_keyed():
    """E[round(x)] = x: 1 + 2^-10 is an eighth of a bf16 ulp above 1 (nearest: always 1)."""
    x = torch.full((4096,), 1.0 + 2**-10)
    d = torch.empty(4096, dtype=torch.bfloat16)
    acc = torch.zeros(4096, dtype=torch.float64)
    for step in range(64):
        stochastic_round_bf16_(d, x, sr_key(step, 0))
        acc += d.double()
    mean = (acc / 64).mean().item()
    assert abs(mean - (1 + 2**-10)) < 5e-5, mean  # up 1/8 of the time, within 0.007
    # another key, another draw; the same key and index, the same draw
    a, b = torch.empty_like(d), torch.empty_like(d)
    stochastic_round_bf16_(a, x, sr_key(1, 0))
    stochastic_round_bf16_(b, x, sr_key(1, 1))
    assert not torch.equal(a, b)
    c = torch.empty(4000, dtype=torch.bfloat16)
    stochastic_round_bf16_(c, x[96:], sr_key(1, 0), first=96)
    assert torch.equal(c, a[96:]), "the draw of element j depends on its index, not the call"


def test_refusals():
    x = torch.ones(4)
    with pytest.raises(TypeError, match="src must be float32 and dst bfloat16"):
        stochastic_round_bf16_(torch.empty(4, dtype=torch.float16), x, 0)
    with pytest.raises(ValueError, match="one numel"):
        stochastic_round_bf16_(torch.empty(5, dtype=torch.bfloat16), x, 0)
    with pytest.raises(TypeError, match="bf16_stochastic_round must be a bool"):
        zero_kernels.FusedAdamW([nn.Parameter(x)], bf16_stochastic_round=1)


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 300), nn.Tanh(), nn.Linear(300, 8)).to(torch.bfloat16)


def _run(steps, sr=True, load_at=None, **kw):
    m = _net()
    make = lambda mod: zero_kernels.FusedAdamW(  # noqa: E731
        mod.parameters(), lr=1e-3, bf16_stochastic_round=sr, **kw
    )
    o = make(m)
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(1)).bfloat16()
    for t in range(steps):
        if t == load_at:
            sd_m, sd_o = copy.deepcopy(m.state_dict()), copy.deepcopy(o.state_dict())
            m = nn.Sequential(nn.Linear(64, 300), nn.Tanh(), nn.Linear(300, 8)).bfloat16()
            o = make(m)
            m.load_state_dict(sd_m)
            o.load_state_dict(sd_o)
        o.zero_grad()
        m(x).float().square().mean().backward()
        o.step()
    return [p.detach().clone() for p in m.parameters()], o


@pytest.mark.parametrize("state_dtype", ["fp32", "int8"])
def test_fused_adamw_resume_bitwise_and_state_kept(state_dtype):
    kw = {"state_dtype": state_dtype, "min_lowbit_numel": 1000}
    a, o = _run(6, **kw)
    big = o.state[next(p for p in o.state if p.numel() >= 1000)]
    if state_dtype == "fp32":
        assert big["exp_avg"].dtype == torch.float32  # fp32 moments, not the param's bf16
    else:
        assert big["exp_avg"].dtype == torch.int8 and big["exp_avg_scale"].dtype == torch.float32
    b, o2 = _run(6, load_at=3, **kw)
    assert all(torch.equal(x, y) for x, y in zip(a, b)), "resume differs"
    big2 = o2.state[next(p for p in o2.state if p.numel() >= 1000)]
    for k, v in big.items():
        if torch.is_tensor(v):
            assert v.dtype == big2[k].dtype and torch.equal(v, big2[k]), k
    c, _ = _run(6, sr=False, **kw)
    assert any(not torch.equal(x, y) for x, y in zip(a, c))


@pytest.mark.distributed
@pytest.mark.parametrize("check", [c.__name__ for c in sr_checks.CHECKS])
def test_zero_stochastic_round(check):
    RUN.check(2, check)
