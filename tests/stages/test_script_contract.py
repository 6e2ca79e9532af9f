"""The script contract (issue 8): torch's tools on sharded grads, torch's per-param semantics,
lifecycle, ranks that disagree, non-finite grads (spawned gloo ranks), and bad input (in-process,
no process group: world size 1)."""

import math
import subprocess
import sys

import contract_checks
import pytest
import torch
from dist_utils import SharedRun, run_workers
from torch import nn
from zero_opt import zero_opt

from zero_kernels import ZeroOptimizer

CONTRACT = SharedRun(contract_checks.contract_all, timeout=500)


@pytest.mark.distributed
@pytest.mark.parametrize(
    "world, check",
    [(w, c.__name__) for w in (1, 2, 3) for c in contract_checks.contract_checks(w)],
)
def test_contract(world, check):
    reps = CONTRACT.check(world, check)
    if check == "check_lone_collective":
        assert reps[0]["lone call s"] < 30  # an error on the lone rank, not a hang


@pytest.mark.distributed
@pytest.mark.parametrize("what", ["eval", "accumulate", "accumulate2"])
def test_join_stage3_refusals(what):
    rep = run_workers(contract_checks.check_join_refusals, 2, what, timeout=120)
    assert rep[1] == {what: "ok"}, rep


def _m():
    return nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))


@pytest.mark.parametrize(
    "kwargs, exc, words",
    [
        ({"stage": True}, ValueError, "stage=True"),
        ({"stage": 4}, ValueError, "stage=4"),
        ({"bucket_size_mb": math.inf}, ValueError, "bucket_size_mb=inf"),
        ({"bucket_size_mb": 0}, ValueError, "bucket_size_mb=0"),
        ({"kernel_backend": "bogus"}, ValueError, "kernel_backend='bogus'"),
        ({"nonfinite": "ignore"}, ValueError, "nonfinite='ignore'"),
        ({"timeout": -1}, ValueError, "timeout=-1"),
        ({"max_inflight_buckets": 0}, ValueError, "max_inflight_buckets=0"),
        ({"lrr": 0.1}, TypeError, "'lrr'"),
    ],
)
def test_bad_arguments(kwargs, exc, words):
    kw = {"lr": 0.1, **kwargs}
    with pytest.raises(exc) as e:
        zero_opt(_m(), torch.optim.SGD, **kw)
    assert words in str(e.value), str(e.value)


def test_unknown_kwarg_says_who_rejected_it():
    with pytest.raises(TypeError) as e:
        ZeroOptimizer(_m(), torch.optim.AdamW, lr=0.1, betaz=(0.9, 0.99))
    msg = str(e.value)
    assert "ZeroOptimizer" in msg and "AdamW" in msg and "betas" in msg, msg


def test_bad_params():
    # sparse gradients
    emb = nn.Sequential(nn.Embedding(10, 4, sparse=True), nn.Linear(4, 2))
    with pytest.raises(NotImplementedError, match="sparse=True"):
        ZeroOptimizer(emb, torch.optim.SGD, lr=0.1)
    # a non-leaf tensor
    w = nn.Parameter(torch.ones(3))
    with pytest.raises(ValueError, match="not a leaf"):
        ZeroOptimizer([w * 2], torch.optim.SGD, lr=0.1)
    # meta tensors without their module: nothing to materialise them with
    with torch.device("meta"):
        meta = _m()
    with pytest.raises(ValueError, match="meta device"):
        ZeroOptimizer(list(meta.parameters()), torch.optim.SGD, stage=2, lr=0.1)
    # integer params
    with pytest.raises(TypeError, match="dtype torch.int64"):
        ZeroOptimizer([torch.zeros(3, dtype=torch.int64)], torch.optim.SGD, lr=0.1)
    # after all these failures the model is free for an optimizer
    m = _m()
    with pytest.raises(ValueError):
        ZeroOptimizer(m, torch.optim.SGD, lr=-1.0)
    ZeroOptimizer(m, torch.optim.SGD, lr=0.1).close()


def test_world_size_without_process_group():
    code = (
        "import torch, torch.nn as nn\n"
        "from zero_kernels import ZeroOptimizer\n"
        "try:\n"
        "    ZeroOptimizer(nn.Linear(2, 2), torch.optim.SGD, lr=0.1)\n"
        "except RuntimeError as e:\n"
        "    print('ERR', e)\n"
    )
    env = {"WORLD_SIZE": "2", "RANK": "0", "PATH": "/usr/bin:/bin"}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
    )
    assert "ERR WORLD_SIZE=2" in out.stdout and "init_process_group" in out.stdout, out


def test_sharded_grad_repr_and_closed_use():
    m = _m()
    zo = ZeroOptimizer(m, torch.optim.SGD, lr=0.1)
    m(torch.ones(3, 4)).sum().backward()
    g = m[0].weight.grad
    assert "ShardedGrad" in repr(g) and "full_grad" in repr(g)
    zo.close()
    assert m[0].weight.grad is None
    with pytest.raises(RuntimeError, match="closed"):
        zo.step()


def test_param_groups_show_inner_keys():
    m = _m()
    zo = ZeroOptimizer(m, torch.optim.AdamW, lr=0.1)
    inner = zo.parts.core.runner.inner.param_groups[0]
    missing = set(inner) - set(zo.param_groups[0])
    assert not missing, missing
    zo.close()


def _stalled_rank(rank, world):
    """A rank that stalls before backward: with timeout=, the others raise CollectiveTimeout
    within the timeout, naming the step, the phase and the bucket; no hang."""
    import time

    from zero_kernels.comm import CollectiveTimeout

    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 64), nn.Linear(64, 64), nn.Linear(64, 2))
    zo = zero_opt(m, torch.optim.AdamW, stage=2, bucket_size_mb=0.005, lr=0.1, timeout=2)
    x = torch.randn(4, 8)
    m(x).sum().backward()
    zo.step()  # one healthy step
    zo.zero_grad()
    if rank == world - 1:
        time.sleep(12)  # stalls (a slow disk, a debugger, SIGSTOP)
    t0 = time.monotonic()
    try:
        m(x).sum().backward()
        zo.step()
        return ("no error", 0.0)
    except CollectiveTimeout as e:
        return (str(e), time.monotonic() - t0)
    except RuntimeError as e:  # the stalled rank, when it comes back, finds its peers gone
        return (f"peer: {e}"[:200], time.monotonic() - t0)


@pytest.mark.distributed
def test_timeout_names_step_phase_and_bucket():
    out = run_workers(_stalled_rank, 2, timeout=120)
    msg, took = out[0]
    assert "step 1" in msg and "backward" in msg and "bucket" in msg, msg
    assert took < 10, took
