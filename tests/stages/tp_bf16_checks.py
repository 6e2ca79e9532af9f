"""Checks run in 4 spawned gloo ranks (dp 2 x tp 2) by tests/stages/test_tp_bf16.py: ZeroOptimizer
stages 1-3 over the tensor-parallel GPT of `zero_kernels.tools.tp_models` (sequence parallel:
its norms' gradients arrive ``Partial`` over tp) against FSDP2 over the same TP model, 10 AdamW
steps with gradient accumulation 2 and clipping, fp32 params and bf16 params with fp32 masters.

The references:

- fp32: FSDP2 ``fully_shard(mesh=mesh["dp"])`` on each block and the root, torch AdamW, the
  whole gradients clipped by hand (torch's clip refuses FSDP2's mix of 1-D and 2-D meshes);
- bf16: the same FSDP2 with ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``: its
  sharded params are fp32 (the masters), gathered and computed in bf16, the gradients reduced in
  fp32, the step on fp32. That is what ours does with bf16 params and fp32 masters (the
  forward and backward on the bf16 params, fp32 reduction, the step on the masters, the params
  the masters rounded), so the comparison holds each arithmetic step to an equal one. Both start
  from the same values: FSDP2's fp32 params are the bf16 init widened.

What is compared: the losses of every step, the fp32 params (ours: ``opt.full_param``, the
masters) against FSDP2's whole fp32 params, and (bf16) the model's bf16 params against FSDP2's
rounded to bf16.
"""

from __future__ import annotations

import math

import torch
from numerics import rel_err
from torch.distributed.tensor import DTensor
from tp_checks import gpt, mesh

from zero_kernels import ZeroOptimizer
from zero_kernels.policy import ZeroPolicy

STEPS = 10
CLIP = 0.5
LR = 1e-2
# fp32: the sums run in other orders (FSDP2 reduces each micro-batch where our stage 1 adds the
# local micro-batches first; our fused AdamW step against torch's), each rounding at 6e-8;
# measured 1e-7 to 8e-7 after 10 steps
TOL_FP32 = 1e-5
# bf16, in lockstep: the same fp32 roundings as fp32 (masters 1e-7 apart) are enough, in a run
# left to itself, to round some bf16 param to its neighbour on one side only (2^-8 relative),
# after which the runs differ by bf16's resolution and no longer by their arithmetic (measured:
# a step 5 where the losses first differ, masters 1e-3 to 2e-2 apart by step 10, stage 1 as
# stages 2/3). So each step starts from FSDP2's params after the one before (set_full_param:
# masters and params), each step's arithmetic compared at 1e-5 while the bf16 forward and
# backward, the reduction of bf16 gradients over tp and dp and the step on the masters run as
# they do in training; Adam's moments are each run's own
TOL_BF16 = 1e-5
# the bf16 params (the masters rounded) against FSDP2's fp32 params rounded to bf16: a master
# 1e-7 off can round to the neighbouring bf16 value, one bf16 ulp (2^-8 relative) of one element
TOL_BF16_PARAMS = 2.0**-8


def _whole(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _batches(step: int):
    """Two micro-batches of this dp rank (the same on its tp ranks)."""
    g = torch.Generator().manual_seed(100 * step + mesh()["dp"].get_local_rank())
    return [torch.randint(0, 32, (2, 9), generator=g) for _ in range(2)]


def _fsdp2(dtype: torch.dtype):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    m = gpt()
    kw = {}
    if dtype != torch.float32:  # fp32 params that start from the bf16 init widened
        with torch.no_grad():
            for p in m.parameters():
                p.copy_(p.to(dtype).float())
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    for block in m.blocks:
        fully_shard(block, mesh=mesh()["dp"], **kw)
    fully_shard(m, mesh=mesh()["dp"], **kw)
    return m, torch.optim.AdamW(m.parameters(), lr=LR, foreach=False)


def train_fsdp2(dtype: torch.dtype):
    """FSDP2's losses and whole fp32 params after each of STEPS steps."""
    m, opt = _fsdp2(dtype)
    losses, params = [], []
    for step in range(STEPS):
        mbs = _batches(step)
        for idx in mbs:
            loss = m(idx[:, :-1], idx[:, 1:])
            loss.backward()
        losses.append(float(loss.detach()))
        total = math.sqrt(
            sum(float(_whole(p.grad).double().square().sum()) for p in m.parameters())
        )
        for p in m.parameters():
            p.grad.mul_(min(CLIP / (total + 1e-6), 1.0))
        opt.step()
        opt.zero_grad()
        params.append([_whole(p.detach()) for p in m.parameters()])
    return losses, params


def _ours(stage: int, dtype: torch.dtype):
    m = gpt().to(dtype)
    pol = ZeroPolicy.resolve(stage=stage, bucket_size_mb=0.001)  # several buckets per unit
    opt = ZeroOptimizer(
        m, torch.optim.AdamW, policy=pol, process_group=mesh()["dp"].get_group(), lr=LR
    )
    return m, opt


def train_ours(stage: int, dtype: torch.dtype, ref=None):
    """Ours: the loss of each step, the whole fp32 params (masters) after each step (after the
    last only without ``ref``), and the model's whole params after the last. ``ref`` (a
    reference's params after each step): lockstep, each step from the reference's params after
    the one before (``set_full_param``: masters and params)."""
    m, opt = _ours(stage, dtype)
    losses, masters = [], []
    for step in range(STEPS):
        if ref is not None and step > 0:
            for p, v in zip(m.parameters(), ref[step - 1], strict=True):
                opt.set_full_param(p, v)
        mbs = _batches(step)
        with opt.no_sync():
            m(mbs[0][:, :-1], mbs[0][:, 1:]).backward()
        loss = m(mbs[1][:, :-1], mbs[1][:, 1:])
        loss.backward()
        losses.append(float(loss.detach()))
        opt.clip_grad_norm_(CLIP)
        opt.step()
        opt.zero_grad()
        if ref is not None or step == STEPS - 1:
            masters.append([opt.full_param(p) for p in m.parameters()])
    with opt.gathered_params():  # stage 3: the params are whole here only
        params = [_whole(p.detach()).clone() for p in m.parameters()]
    opt.close()
    return losses, masters, params


def _loss_err(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))


def _param_err(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(rel_err(x, y) for x, y in zip(a, b, strict=True))


def check_fp32_matches_fsdp2(rank, world):
    """fp32 params: stages 1-3 give FSDP2's losses and params within TOL_FP32 at every step."""
    ref_losses, ref_params = train_fsdp2(torch.float32)
    out = {}
    for stage in (1, 2, 3):
        losses, masters, params = train_ours(stage, torch.float32)
        assert _param_err(masters[-1], params) == 0.0  # fp32: no masters apart
        out[stage] = {
            "loss": _loss_err(losses, ref_losses),
            "param": _param_err(params, ref_params[-1]),
        }
    assert all(v <= TOL_FP32 for d in out.values() for v in d.values()), out
    return out


def check_bf16_matches_fsdp2(rank, world):
    """bf16 params with fp32 masters: stages 1-3 against FSDP2 with MixedPrecisionPolicy(bf16
    params, fp32 reduction), in lockstep (each step from FSDP2's params after the one before:
    see TOL_BF16): losses and masters within TOL_BF16 at every step, the bf16 params after the
    last within TOL_BF16_PARAMS of FSDP2's fp32 params rounded to bf16."""
    ref_losses, ref_params = train_fsdp2(torch.bfloat16)
    out = {}
    for stage in (1, 2, 3):
        losses, masters, params = train_ours(stage, torch.bfloat16, ref=ref_params)
        assert all(p.dtype == torch.bfloat16 for p in params)
        assert all(t.dtype == torch.float32 for t in masters[-1])
        rounded = [t.to(torch.bfloat16) for t in ref_params[-1]]
        out[stage] = {
            "loss": _loss_err(losses, ref_losses),
            "master": max(_param_err(a, b) for a, b in zip(masters, ref_params, strict=True)),
            "param": _param_err(params, rounded),
        }
    ok = all(
        d["loss"] <= TOL_BF16 and d["master"] <= TOL_BF16 and d["param"] <= TOL_BF16_PARAMS
        for d in out.values()
    )
    assert ok, out
    return out


CHECKS = ["check_fp32_matches_fsdp2", "check_bf16_matches_fsdp2"]


def tp_bf16_all(rank, world):
    from dist_utils import run_checks

    return run_checks(rank, world, [globals()[c] for c in CHECKS])
