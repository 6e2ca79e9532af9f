"""FusedAdam / FusedAdamW as drop-in torch optimizers: parity, state_dict interchange, errors."""

from __future__ import annotations

import itertools

import pytest
import torch
from kernel_utils import TOL_MULTISTEP, assert_close

from zero_kernels import FusedAdam, FusedAdamW, native

BACKENDS = (["cpu"] if native.load() is not None else []) + ["reference"]
PAIRS = [(FusedAdamW, torch.optim.AdamW), (FusedAdam, torch.optim.Adam)]


def twin_params(shapes, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    base = [torch.randn(s, generator=gen) for s in shapes]
    a = [torch.nn.Parameter(t.clone().to(dtype)) for t in base]
    b = [torch.nn.Parameter(t.clone().to(dtype)) for t in base]
    return a, b


def drive(opt_a, opt_b, pa, pb, steps, seed=1, skip_every=0):
    gen = torch.Generator().manual_seed(seed)
    for s in range(steps):
        for i, (x, y) in enumerate(zip(pa, pb)):
            if skip_every and (s + i) % skip_every == 0:
                x.grad = y.grad = None  # a param with no grad this step
                continue
            g = torch.randn(x.shape, generator=gen).to(x.dtype)
            x.grad, y.grad = g.clone(), g.clone()
        opt_a.step()
        opt_b.step()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("ours,theirs", PAIRS)
def test_parity_fp32_every_variant(backend, ours, theirs):
    for amsgrad, maximize, wd in itertools.product([False, True], [False, True], [0.0, 0.05]):
        # the 2^20+3 size once (it dominates the time), the small odd sizes for every variant
        big = [(2**20 + 3,)] if (amsgrad, maximize, wd) == (True, True, 0.05) else []
        shapes = [(1,), (7,), (31, 33), (1023,)] + big
        pa, pb = twin_params(shapes)
        kw = dict(
            lr=1e-2,
            betas=(0.8, 0.95),
            eps=1e-6,
            weight_decay=wd,
            amsgrad=amsgrad,
            maximize=maximize,
        )
        oa, ob = ours(pa, backend=backend, **kw), theirs(pb, **kw)
        drive(oa, ob, pa, pb, steps=20)
        for x, y in zip(pa, pb):
            assert_close(
                x,
                y,
                f"{ours.__name__} ams={amsgrad} max={maximize} wd={wd}",
                TOL_MULTISTEP[torch.float32],
            )
        for x, y in zip(pa, pb):
            for key in ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if amsgrad else ()):
                assert_close(oa.state[x][key], ob.state[y][key], key, TOL_MULTISTEP[torch.float32])
            assert oa.state[x]["step"].item() == ob.state[y]["step"].item() == 20


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("ours,theirs", PAIRS)
def test_parity_bf16_matches_torch_fused(backend, ours, theirs):
    # torch's fused=True also runs bf16 params with fp32 math and bf16 state
    for amsgrad, maximize in ((False, False), (True, True)):
        big = [(2**20 + 3,)] if not amsgrad and backend == "cpu" else []
        pa, pb = twin_params([(1,), (7,), (1023,), (64, 65)] + big, dtype=torch.bfloat16)
        kw = dict(lr=1e-2, weight_decay=0.1, amsgrad=amsgrad, maximize=maximize)
        oa = ours(pa, backend=backend, **kw)
        ob = theirs(pb, fused=True, **kw)
        drive(oa, ob, pa, pb, steps=20)
        for x, y in zip(pa, pb):
            assert x.dtype == torch.bfloat16 and oa.state[x]["exp_avg"].dtype == torch.bfloat16
            assert_close(x, y, f"bf16 param ams={amsgrad}", TOL_MULTISTEP[torch.bfloat16])


@pytest.mark.parametrize("backend", BACKENDS)
def test_param_groups_scheduler_and_missing_grads(backend):
    pa, pb = twin_params([(10,), (20,), (5, 5), (3,)])

    def groups(ps):
        return [
            {"params": ps[:2], "lr": 1e-2, "weight_decay": 0.0},
            {"params": ps[2:], "lr": 3e-3, "weight_decay": 0.2, "betas": (0.5, 0.9)},
        ]

    oa = FusedAdamW(groups(pa), backend=backend)
    ob = torch.optim.AdamW(groups(pb))
    sa = torch.optim.lr_scheduler.StepLR(oa, step_size=5, gamma=0.5)
    sb = torch.optim.lr_scheduler.StepLR(ob, step_size=5, gamma=0.5)
    for _ in range(4):
        drive(oa, ob, pa, pb, steps=6, skip_every=3)
        sa.step()
        sb.step()
    assert oa.param_groups[1]["lr"] == ob.param_groups[1]["lr"]
    for x, y in zip(pa, pb):
        assert_close(x, y, "groups", TOL_MULTISTEP[torch.float32])
        assert oa.state[x]["step"].item() == ob.state[y]["step"].item()


@pytest.mark.parametrize("ours,theirs", PAIRS)
def test_state_dict_interchange_both_ways(ours, theirs):
    pa, pb = twin_params([(9,), (4, 6)])
    oa, ob = ours(pa, lr=5e-3, amsgrad=True), theirs(pb, lr=5e-3, amsgrad=True)
    drive(oa, ob, pa, pb, steps=5)
    sd_ours, sd_theirs = oa.state_dict(), ob.state_dict()
    assert set(sd_ours["state"][0]) == set(sd_theirs["state"][0])
    assert set(sd_ours["param_groups"][0]) == set(sd_theirs["param_groups"][0])
    # ours -> torch and torch -> ours, then both continue identically
    pc, pd = twin_params([(9,), (4, 6)])
    with torch.no_grad():
        for c, d, a in zip(pc, pd, pa):
            c.copy_(a)
            d.copy_(a)
    oc = theirs(pc, lr=1.0)
    oc.load_state_dict(sd_ours)
    od = ours(pd, lr=1.0)
    od.load_state_dict(sd_theirs)
    assert od.param_groups[0]["lr"] == 5e-3 and od.param_groups[0]["amsgrad"]
    drive(od, oc, pd, pc, steps=5)
    for c, d in zip(pc, pd):
        assert_close(d, c, "after interchange", TOL_MULTISTEP[torch.float32])
    assert od.state[pd[0]]["step"].item() == 10


def test_non_contiguous_and_mixed_dtypes():
    # One group holding a transposed fp32 param, a plain fp32 param and a bf16 param. The
    # reference for fp32 is torch's default AdamW: torch 2.13's fused=True CPU kernel goes wrong
    # (0.07 off after 5 steps) when a grad's strides differ from its param's, the case below.
    gen = torch.Generator().manual_seed(0)
    t = torch.randn(8, 6, generator=gen)
    pa = [
        torch.nn.Parameter(t.clone().t()),
        torch.nn.Parameter(torch.randn(5, generator=gen)),
        torch.nn.Parameter(torch.randn(6, generator=gen).to(torch.bfloat16)),
    ]
    pb = [torch.nn.Parameter(x.detach().clone()) for x in pa[:2]]
    pc = [torch.nn.Parameter(pa[2].detach().clone())]
    oa = FusedAdamW(pa, lr=1e-2)
    ob, oc = torch.optim.AdamW(pb, lr=1e-2), torch.optim.AdamW(pc, lr=1e-2, fused=True)
    for s in range(6):
        for i, (x, y) in enumerate(zip(pa, pb + pc)):
            g = torch.randn(x.shape, generator=gen).to(x.dtype)
            if i == 0 and s % 2:
                g = g.t().contiguous().t()  # strides equal to the param's: stepped in place
            x.grad, y.grad = g, g.clone()
        oa.step()
        ob.step()
        oc.step()
    assert not pa[0].is_contiguous() and not oa.state[pa[0]]["exp_avg"].is_contiguous()
    for x, y in zip(pa, pb + pc):
        assert_close(x, y, f"non-contiguous / mixed {x.dtype}", TOL_MULTISTEP[x.dtype])


def test_bad_hyperparameters_raise_like_torch():
    p = [torch.nn.Parameter(torch.randn(3))]
    for kw, msg in [
        ({"lr": -1.0}, "learning rate"),
        ({"eps": -1.0}, "epsilon"),
        ({"betas": (1.0, 0.9)}, "beta parameter at index 0"),
        ({"betas": (0.9, -0.1)}, "beta parameter at index 1"),
        ({"weight_decay": -0.1}, "weight_decay"),
        ({"backend": "tpu"}, "backend"),
    ]:
        with pytest.raises(ValueError, match=msg):
            FusedAdamW(p, **kw)
    with pytest.raises(NotImplementedError, match="capturable"):
        FusedAdam(p, capturable=True)


def test_sparse_grads_and_integer_params_are_refused():
    emb = torch.nn.Embedding(10, 3, sparse=True)
    opt = FusedAdam(emb.parameters())
    emb(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(RuntimeError, match="sparse"):
        opt.step()


def test_explicit_unavailable_backend_raises_on_step():
    p = torch.nn.Parameter(torch.randn(3))
    opt = FusedAdamW([p], backend="cuda")
    p.grad = torch.randn(3)
    with pytest.raises((RuntimeError, ValueError), match="cuda"):
        opt.step()


@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_step_marks_params_and_moments_written(backend):
    """The step writes params and moments in place: their version counters move (autograd then
    refuses a backward through a graph that saved the old values), one or several params, on
    the native call as on the reference one."""
    if backend == "cpu" and native.load() is None:
        pytest.skip("native extension not built")
    ps = [torch.nn.Parameter(torch.randn(n)) for n in (7, 300)]
    for p in ps:
        p.grad = torch.randn_like(p)
    for params in (ps[:1], ps):
        opt = FusedAdamW(params, lr=1e-2, backend=backend)
        opt.step()
        before = [p._version for p in params]
        moments = [opt.state[p]["exp_avg"]._version for p in params]
        opt.step()
        assert all(p._version > b for p, b in zip(params, before))
        assert all(opt.state[p]["exp_avg"]._version > b for p, b in zip(params, moments))
    w = torch.nn.Parameter(torch.randn(3))
    y = (w * w).sum()  # saves w for backward
    w.grad = torch.ones(3)
    FusedAdamW([w], backend=backend).step()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.backward()
