"""Checks run inside 2 gloo workers for tests/precision/test_stochastic_round.py: ZeroOptimizer(
bf16_stochastic_round=True) at stages 1-3 against FusedAdamW(bf16_stochastic_round=True) in one
process, bitwise; no fp32 masters in memory; checkpoints resumed bitwise and across the option;
the refusals."""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest
import torch
from dist_utils import run_checks
from torch import nn
from zero_opt import zero_opt

import zero_kernels
from zero_kernels.tools import estimate

STEPS = 4


def model():
    torch.manual_seed(0)
    # 40 x 33 + 33 + 33 x 8 + 8: sizes that do not divide by the world or the buckets
    return nn.Sequential(nn.Linear(40, 33), nn.GELU(), nn.Linear(33, 8)).to(torch.bfloat16)


def build(m, stage, **kw):
    kw = {"lr": 1e-2, "weight_decay": 0.1, "bucket_size_mb": 0.002} | kw
    kw.setdefault("bf16_stochastic_round", True)
    return zero_opt(m, torch.optim.AdamW, stage=stage, **kw)


def batch(step):
    # the same batch on every rank: the averaged gradient is each rank's own, exactly
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(6, 40, generator=g).bfloat16()


def train(m, opt, steps, start=0):
    for s in range(start, start + steps):
        opt.zero_grad()
        m(batch(s)).float().square().mean().backward()
        opt.step()


def reference(steps, **kw):
    """The same steps in one process with FusedAdamW(bf16_stochastic_round=True)."""
    m = model()
    o = zero_kernels.FusedAdamW(
        m.parameters(), lr=1e-2, weight_decay=0.1, bf16_stochastic_round=True, **kw
    )
    train(m, o, steps)
    return [p.detach().clone() for p in m.parameters()]


def _parity(stage, state_dtype="fp32"):
    def check(rank, world):
        m = model()
        opt = build(m, stage, state_dtype=state_dtype)
        train(m, opt, STEPS)
        rep = opt.memory_report()
        got = [v.detach().clone() for v in m.state_dict().values()]
        opt.close()
        kw = {} if state_dtype == "fp32" else {"state_dtype": state_dtype, "min_lowbit_numel": 0}
        want = reference(STEPS, **kw)
        for k, (a, b) in enumerate(zip(got, want)):
            assert a.dtype == torch.bfloat16
            if state_dtype == "fp32":
                assert torch.equal(a, b), (stage, k, (a.float() - b.float()).abs().max())
            else:  # int8 blocks follow the shard's pieces here, the tensor in FusedAdamW:
                # moments a quantization apart, params within half a step (lr) of each other
                ulp = 2.0 ** (torch.frexp(b.float().abs().clamp_min(1e-3))[1] - 8)
                d = (a.float() - b.float()).abs()
                assert bool((d <= 4 * ulp + 0.5e-2).all()), (state_dtype, k, d.max())
        assert rep["master_bytes"] == 0, rep["master_bytes"]
        if state_dtype == "fp32":  # the estimator's count (no master; fp32 grads and moments)
            n = sum(p.numel() for p in m.parameters())
            e = estimate.estimate_stage(stage, n, world, precision="bf16-sr")
            assert 0 <= rep["model_state_bytes"] - e.total_bytes <= 4096, (rep, e)
        return {"model_state_bytes": rep["model_state_bytes"]}

    check.__name__ = f"parity_stage{stage}_{state_dtype}"
    return check


def offloaded(rank, world):
    """Stage 3 with the moments and the param shards on disk: the same bits as in RAM (the
    moments stream chunk by chunk through the staging buffers into the fp32 copy)."""
    d = os.path.join(tempfile.gettempdir(), f"zk-sr-off-{os.getppid()}")  # one path, every rank
    os.makedirs(d, exist_ok=True)
    try:
        m = model()
        kw = {"offload_optimizer": "nvme", "offload_params": "nvme", "offload_dir": d}
        opt = build(m, 3, offload_staging_mb=0.1, **kw)
        train(m, opt, STEPS)
        rep = opt.memory_report()
        got = [v.detach().clone() for v in m.state_dict().values()]
        opt.close()
        assert rep["offload_disk_bytes"] > 0 and rep["master_bytes"] == 0, rep
        for k, (a, b) in enumerate(zip(got, reference(STEPS))):
            assert torch.equal(a, b), k
    finally:
        torch.distributed.barrier()
        if rank == 0:
            shutil.rmtree(d, ignore_errors=True)
    return {}


def differs_from_nearest(rank, world):
    """The option changes the numbers (the rounding is really stochastic, and the masters are
    really gone): without it the bf16 params come from fp32 masters rounded to nearest."""
    m = model()
    opt = build(m, 2, bf16_stochastic_round=False)
    train(m, opt, STEPS)
    assert opt.memory_report()["master_bytes"] > 0
    plain = [v.detach().clone() for v in m.state_dict().values()]
    opt.close()
    want = reference(STEPS)
    diff = sum(int((a != b).sum()) for a, b in zip(plain, want))
    assert diff > 0, "stochastic rounding gave round-to-nearest's params"
    return {"elements_apart": diff}


def checkpoints(rank, world):
    """Saved at stage 3 after 2 steps, loaded at stage 2 into a fresh model: the next steps
    equal the uninterrupted run's bitwise. A checkpoint saved with fp32 masters loads into the
    option (the bf16 params are the masters rounded to nearest) and the reverse."""
    d = os.path.join(tempfile.gettempdir(), f"zk-sr-ckpt-{os.getppid()}")
    want = reference(STEPS)
    m = model()
    o = build(m, 3)
    train(m, o, 2)
    path = zero_kernels.save_checkpoint(d, m, o, extra={"step": 2})
    o.close()
    torch.manual_seed(5)
    m2 = nn.Sequential(nn.Linear(40, 33), nn.GELU(), nn.Linear(33, 8)).to(torch.bfloat16)
    o2 = build(m2, 2)
    zero_kernels.load_checkpoint(path, m2, o2)
    train(m2, o2, STEPS - 2, start=2)
    got = [v.detach().clone() for v in m2.state_dict().values()]
    assert all(torch.equal(a, b) for a, b in zip(got, want)), "resume differs"
    # masters saved (no option), loaded with it; and back
    m3 = model()
    o3 = build(m3, 2, bf16_stochastic_round=False)
    train(m3, o3, 2)
    p3 = zero_kernels.save_checkpoint(d + "-m", m3, o3, extra={"step": 2})
    masters = [o3.full_param(p).clone() for p in m3.parameters()]
    o3.close()
    m4 = model()
    o4 = build(m4, 1)
    zero_kernels.load_checkpoint(p3, m4, o4)
    for p, mp in zip(m4.parameters(), masters):
        assert torch.equal(p.detach(), mp.to(torch.bfloat16)), "masters not rounded to nearest"
    train(m4, o4, 1, start=2)
    p4 = zero_kernels.save_checkpoint(d + "-s", m4, o4, extra={"step": 3})
    now = [p.detach().clone() for p in m4.parameters()]
    st4 = [o4.full_state(p)["exp_avg"].clone() for p in m4.parameters()]
    o4.close()
    # and into FusedAdamW with the option (a plain optimizer): fp32 moments, as saved
    m8 = model()
    o8 = zero_kernels.FusedAdamW(m8.parameters(), lr=1e-2, bf16_stochastic_round=True)
    zero_kernels.load_checkpoint(p4, m8, o8)
    for p, q, e in zip(m8.parameters(), now, st4):
        assert torch.equal(p.detach(), q)
        assert o8.state[p]["exp_avg"].dtype == torch.float32
        assert torch.equal(o8.state[p]["exp_avg"], e.view_as(p)), "moments not as saved"
    m5 = model()
    o5 = build(m5, 2, bf16_stochastic_round=False)
    zero_kernels.load_checkpoint(p4, m5, o5)
    for p, q in zip(m5.parameters(), now):
        assert torch.equal(p.detach(), q)
        assert torch.equal(o5.full_param(p).to(torch.bfloat16), q)
    o5.close()
    # FusedAdamW(bf16_stochastic_round=True) saved (a plain optimizer: stage 0), ZeroOptimizer
    # with the option loads it: the fp32 moments arrive as saved and the run goes on bitwise
    m6 = model()
    o6 = zero_kernels.FusedAdamW(
        m6.parameters(), lr=1e-2, weight_decay=0.1, bf16_stochastic_round=True
    )
    train(m6, o6, 2)
    p6 = zero_kernels.save_checkpoint(d + "-f", m6, o6, extra={"step": 2})
    m7 = model()
    o7 = build(m7, 2)
    zero_kernels.load_checkpoint(p6, m7, o7)
    train(m7, o7, STEPS - 2, start=2)
    got = [v.detach().clone() for v in m7.state_dict().values()]
    o7.close()
    assert all(torch.equal(a, b) for a, b in zip(got, want)), "FusedAdamW -> ZeRO resume differs"
    torch.distributed.barrier()
    if rank == 0:
        for p in (d, d + "-m", d + "-s", d + "-f"):
            shutil.rmtree(p, ignore_errors=True)
    return {}


def refusals(rank, world):
    with pytest.raises(ValueError, match="no param is bfloat16"):
        zero_opt(nn.Linear(4, 4), torch.optim.AdamW, stage=2, bf16_stochastic_round=True)
    with pytest.raises(ValueError, match="fused Adam step's result"):
        zero_opt(model(), torch.optim.SGD, stage=2, lr=0.1, bf16_stochastic_round=True)
    with pytest.raises(TypeError, match="bf16_stochastic_round must be a bool"):
        build(model(), 2, bf16_stochastic_round="yes")
    return {}


CHECKS = [
    _parity(1),
    _parity(2),
    _parity(3),
    _parity(2, "int8"),
    offloaded,
    differs_from_nearest,
    checkpoints,
    refusals,
]


def worker(rank, world):
    return run_checks(rank, world, CHECKS)
