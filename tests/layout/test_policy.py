"""The named policies ([Note: policies] in zero_kernels/policy.py): resolved from the keyword
options or given whole, each field checked where it is defined, one source for each choice
(issue 21). In-process, world size 1."""

import copy

import pytest
import torch
from torch import nn

from zero_kernels import ZeroOptimizer
from zero_kernels.policy import (
    CommPolicy,
    GatherPolicy,
    OffloadPolicy,
    PrecisionPolicy,
    ShardPolicy,
    ZeroPolicy,
)


def test_stages_are_shard_policies():
    assert [ShardPolicy.of_stage(s) for s in (1, 2, 3)] == [
        ShardPolicy(params=True, grads=True),
        ShardPolicy(params=True, grads=False),
        ShardPolicy(params=False, grads=False),
    ]
    assert [ShardPolicy.of_stage(s).stage for s in (1, 2, 3)] == [1, 2, 3]
    p = ZeroPolicy.resolve(3, prefetch=2, bucket_size_mb=4)
    assert p.stage == 3 and p.gather.prefetch == 2 and p.comm.bucket_size_mb == 4
    assert p.gather.check_order == "pass"  # stage 3's default module-order check
    assert ZeroPolicy.resolve(2).gather.check_order is None
    assert PrecisionPolicy(reduce_dtype=torch.float32).reduce_dtype is None
    d = p.describe()
    assert d["gather.prefetch"] == 2 and d["shard.params"] is False


@pytest.mark.parametrize(
    "make, err, match",
    [
        (
            lambda: ShardPolicy.of_stage(4),
            ValueError,
            "stage must be the int 1, 2 or 3, got stage=4",
        ),
        (lambda: ShardPolicy(params=False, grads=True), ValueError, "not a ZeRO stage"),
        (lambda: ShardPolicy(params=1), TypeError, "ShardPolicy.params must be a bool"),
        (lambda: GatherPolicy(prefetch=-1), ValueError, "prefetch=-1"),
        (lambda: GatherPolicy(check_order="always"), ValueError, "check_order='always'"),
        (lambda: CommPolicy(bucket_size_mb=0), ValueError, "bucket_size_mb=0"),
        (lambda: CommPolicy(max_inflight_buckets=0), ValueError, "max_inflight_buckets=0"),
        (lambda: CommPolicy(timeout=-1), ValueError, "timeout=-1"),
        (lambda: CommPolicy(shard_group="nodes"), ValueError, "shard_group='nodes'"),
        (lambda: CommPolicy(shard_group=0), ValueError, "shard_group=0"),
        (lambda: CommPolicy(shard_group=2.0), ValueError, "shard_group=2.0"),
        (lambda: PrecisionPolicy(reduce_dtype=torch.int8), ValueError, "reduce_dtype=torch.int8"),
        (lambda: PrecisionPolicy(loss_scale=-2), ValueError, "loss_scale=-2"),
        (
            lambda: OffloadPolicy(offload_params="nvme"),
            ValueError,
            "params='nvme' needs offload_dir",
        ),
        (lambda: OffloadPolicy(offload_params="cpu"), ValueError, "params='cpu' keeps"),
        (
            lambda: OffloadPolicy("cpu", "nvme", "/x"),
            NotImplementedError,
            "offload_optimizer='cpu' with offload_params='nvme'",
        ),
        (lambda: OffloadPolicy(offload_params="disk"), ValueError, "'disk'"),
        (
            lambda: ZeroPolicy.resolve(2, offload_params="nvme", offload_dir="/x"),
            ValueError,
            "offload_params='nvme' is a stage-3 option",
        ),
        (lambda: OffloadPolicy(offload_optimizer="disk"), ValueError, "'disk'"),
        (lambda: OffloadPolicy(offload_optimizer="nvme"), ValueError, "offload_dir="),
        (  # the host tier takes no folder (tests/offload/test_offload_host.py runs it)
            lambda: OffloadPolicy(offload_optimizer="cpu", offload_dir="/x"),
            ValueError,
            "offload_dir='/x' given without",
        ),
        (lambda: OffloadPolicy("nvme", None, "/x", 0.05), ValueError, "offload_staging_mb"),
        (lambda: ZeroPolicy.resolve(2, persist_below=8), ValueError, "persist_below= is a stage-3"),
        (lambda: ZeroPolicy.resolve(3, overlap_param_gather=True), ValueError, "stage 1/2 option"),
        (
            lambda: ZeroPolicy.resolve(1, reduce_dtype=torch.bfloat16),
            NotImplementedError,
            "stage 1",
        ),
        (lambda: ZeroPolicy.resolve(2, bogus=1), TypeError, "bogus"),
        (lambda: ZeroPolicy(shard=3), TypeError, "ZeroPolicy.shard must be a ShardPolicy"),
    ],
)
def test_each_field_checked_where_defined(make, err, match):
    with pytest.raises(err, match=match):
        make()


def _train(m, zo, steps=3):
    for s in range(steps):
        zo.zero_grad()
        m(torch.full((3, 4), 0.1 * (s + 1))).pow(2).mean().backward()
        zo.step()


def test_policy_object_trains_as_the_keywords_do():
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    for stage in (1, 2, 3):
        a, b = copy.deepcopy(base), copy.deepcopy(base)
        za = ZeroOptimizer(a, torch.optim.AdamW, stage=stage, bucket_size_mb=1, lr=1e-2)
        pol = ZeroPolicy(shard=ShardPolicy.of_stage(stage), comm=CommPolicy(bucket_size_mb=1))
        zb = ZeroOptimizer(b, torch.optim.AdamW, policy=pol, lr=1e-2)
        assert zb.policy == za.policy and zb.stage == stage
        _train(a, za)
        _train(b, zb)
        with za.gathered_params(), zb.gathered_params():
            for p, q in zip(a.parameters(), b.parameters()):
                assert torch.equal(p, q)
        za.close()
        zb.close()


def test_policy_and_keywords_not_both():
    m = nn.Linear(4, 2)
    pol = ZeroPolicy.resolve(3)
    with pytest.raises(ValueError, match=r"policy= and prefetch= given together"):
        ZeroOptimizer(m, torch.optim.SGD, policy=pol, prefetch=2, lr=0.1)
    with pytest.raises(ValueError, match=r"policy= and stage=, bucket_size_mb= given"):
        ZeroOptimizer(m, torch.optim.SGD, policy=pol, stage=3, bucket_size_mb=1, lr=0.1)
    with pytest.raises(TypeError, match="policy must be a zero_kernels.policy.ZeroPolicy"):
        ZeroOptimizer(m, torch.optim.SGD, policy={"stage": 3}, lr=0.1)


def test_optimizer_and_params_arguments_named():
    """An optimizer instance where the class goes, and params that are no iterable: errors that
    name the argument and say what to pass (before: the instance's whole repr; 'NoneType' object
    is not iterable)."""
    m = nn.Linear(4, 2)
    with pytest.raises(TypeError, match=r"got an instance of AdamW: pass the class"):
        ZeroOptimizer(m, torch.optim.AdamW(m.parameters()), lr=0.1)
    with pytest.raises(TypeError, match=r"optimizer_class=.adamw."):
        ZeroOptimizer(m, "adamw", lr=0.1)
    with pytest.raises(TypeError, match=r"params must be an nn.Module or an iterable .*NoneType"):
        ZeroOptimizer(None, torch.optim.AdamW, lr=0.1)
    with pytest.raises(TypeError, match=r"got a single Tensor"):
        ZeroOptimizer(m.weight, torch.optim.AdamW, lr=0.1)
