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
    """The part keywords, one ZeroPolicy, and `ZeroPolicy.resolve`'s flat names build the same
    policy and train alike."""
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    for stage in (1, 2, 3):
        a, b, c = copy.deepcopy(base), copy.deepcopy(base), copy.deepcopy(base)
        comm = CommPolicy(bucket_size_mb=1)
        za = ZeroOptimizer(a, torch.optim.AdamW, stage=stage, comm=comm, lr=1e-2)
        pol = ZeroPolicy(shard=ShardPolicy.of_stage(stage), comm=CommPolicy(bucket_size_mb=1))
        zb = ZeroOptimizer(b, torch.optim.AdamW, policy=pol, lr=1e-2)
        flat = ZeroPolicy.resolve(stage=stage, bucket_size_mb=1)
        zc = ZeroOptimizer(c, torch.optim.AdamW, policy=flat, lr=1e-2)
        assert zb.policy == za.policy == zc.policy and zb.stage == stage
        for m, z in ((a, za), (b, zb), (c, zc)):
            _train(m, z)
        with za.gathered_params(), zb.gathered_params(), zc.gathered_params():
            for p, q, r in zip(a.parameters(), b.parameters(), c.parameters()):
                assert torch.equal(p, q) and torch.equal(p, r)
        for z in (za, zb, zc):
            z.close()


def test_policy_and_keywords_not_both():
    m = nn.Linear(4, 2)
    pol = ZeroPolicy.resolve(3)
    with pytest.raises(ValueError, match=r"policy= and gather= given together"):
        ZeroOptimizer(m, torch.optim.SGD, policy=pol, gather=GatherPolicy(prefetch=2), lr=0.1)
    with pytest.raises(ValueError, match=r"policy= and stage=, comm= given"):
        ZeroOptimizer(m, torch.optim.SGD, policy=pol, stage=3, comm=CommPolicy(), lr=0.1)
    with pytest.raises(TypeError, match="policy must be a zero_kernels.policy.ZeroPolicy"):
        ZeroOptimizer(m, torch.optim.SGD, policy={"stage": 3}, lr=0.1)
    with pytest.raises(TypeError, match=r"ZeroPolicy.gather must be a GatherPolicy"):
        ZeroOptimizer(m, torch.optim.SGD, gather=CommPolicy(), lr=0.1)


def test_a_flat_option_names_its_policy():
    """One way to configure: a policy's field given as a keyword is a TypeError that names the
    policy and both ways to pass it, before anything is built."""
    m = nn.Linear(4, 2)
    for name, value, part, cls in (
        ("bucket_size_mb", 1, "comm", "CommPolicy"),
        ("prefetch", 2, "gather", "GatherPolicy"),
        ("state_dtype", "bf16", "precision", "PrecisionPolicy"),
        ("offload_optimizer", "cpu", "offload", "OffloadPolicy"),
        ("nonfinite", "skip", "execution", "ExecutionPolicy"),
    ):
        with pytest.raises(TypeError, match=rf"{name} is a field of {cls}. Pass {part}={cls}"):
            ZeroOptimizer(m, torch.optim.SGD, lr=0.1, **{name: value})
        assert m.weight.grad is None and type(m.weight) is nn.Parameter


def test_signature_fits_on_one_screen_and_each_option_is_documented_once():
    import ast
    import dataclasses
    import inspect

    from zero_kernels import policy as P

    named = [n for n in inspect.signature(ZeroOptimizer.__init__).parameters if n != "self"]
    assert named[-1] == "defaults" and len(named) - 1 <= 12, named
    # every policy field carries its own docstring (a string right under it), and the
    # constructor's docstring names no field: each option is documented once, in its policy
    tree = ast.parse(inspect.getsource(P))
    doc = inspect.getdoc(ZeroOptimizer)
    for _, cls in P.PARTS:
        node = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls.__name__)
        body = node.body
        for f in dataclasses.fields(cls):
            i = next(
                k
                for k, s in enumerate(body)
                if isinstance(s, ast.AnnAssign) and s.target.id == f.name
            )
            nxt = body[i + 1]
            assert isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant), f.name
            assert len(nxt.value.value.split()) >= 5, f.name
            if f.name not in named:  # ShardPolicy.params is also the first argument's name
                assert f"{f.name}:" not in doc and f"{f.name}=" not in doc, f.name


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
