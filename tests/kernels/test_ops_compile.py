"""The kernels as torch.library custom ops: schemas, opcheck, and torch.compile without breaks.

The compiled `FusedAdamW.step` uses backend="aot_eager" (dynamo + AOT autograd's
functionalization of the op, no C++ compile: seconds on 2 cores); one test goes through inductor
with fullgraph=True on `ops.adam_step` (~15 s here, most of it the C++ compile of ``p.sum()``).
"""

from __future__ import annotations

import os

import pytest
import torch
import torch._dynamo

from zero_kernels import FusedAdamW, native, ops
from zero_kernels.ops import AdamHyper, library, reference

needs_native = pytest.mark.skipif(native.load() is None, reason="native extension not built")
BACKENDS = ["reference", pytest.param("cpu", marks=needs_native)]
HYPER_ARGS = (
    "lr",
    "beta1",
    "beta2",
    "eps",
    "weight_decay",
    "step",
    "adamw",
    "amsgrad",
    "maximize",
    "grad_scale",
    "check_finite",
    "backend",
)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _hyper(step: int = 3, **kw) -> AdamHyper:
    base = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, adamw=True)
    return AdamHyper(step=step, **{**base, **kw})


def _tensors(n: int, dtype=torch.float32, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    p = torch.randn(n, generator=gen).to(dtype)
    g = torch.randn(n, generator=gen).to(dtype)
    m = (0.1 * torch.randn(n, generator=gen)).to(dtype)
    v = torch.rand(n, generator=gen).to(dtype)
    return p, g, m, v


# ---- registration ----


def test_ops_are_registered_with_keyword_only_hyper_parameters():
    for name, schema in (
        ("adam_step_", library.ADAM_STEP_SCHEMA),
        ("adam_step_multi_", library.ADAM_STEP_MULTI_SCHEMA),
    ):
        op = getattr(torch.ops.zero_kernels, name).default
        assert str(op._schema) == f"zero_kernels::{name}{schema}"
        args = {a.name: a for a in op._schema.arguments}
        for h in HYPER_ARGS:
            assert args[h].kwarg_only, h
        written = {a.name for a in op._schema.arguments if a.alias_info and a.alias_info.is_write}
        assert "grad" not in written and "grads" not in written
        assert {"found_inf"} <= written


def test_op_called_through_the_dispatcher_matches_reference():
    p, g, m, v = _tensors(1000)
    rp, rm, rv = p.clone(), m.clone(), v.clone()
    out, rout = torch.empty(1000, dtype=torch.bfloat16), torch.empty(1000, dtype=torch.bfloat16)
    found, rfound = torch.zeros(1), torch.zeros(1)
    h = _hyper(grad_scale=0.5)
    torch.ops.zero_kernels.adam_step_(
        p, g, m, v, None, out, found, **library.hyper_kwargs(h, True, "auto")
    )
    reference.adam_step(rp, g, rm, rv, h, out_lowp=rout, found_inf=rfound, check_finite=True)
    torch.testing.assert_close((p, m, v, out, found), (rp, rm, rv, rout, rfound))


def test_op_falls_back_to_reference_without_the_native_extension(monkeypatch):
    monkeypatch.setattr(native, "load", lambda: None)
    monkeypatch.setattr(native, "error", lambda: ImportError("no _C in this test"))
    p, g, m, v = _tensors(100)
    rp, rm, rv = p.clone(), m.clone(), v.clone()
    h = _hyper()
    torch.ops.zero_kernels.adam_step_(p, g, m, v, **library.hyper_kwargs(h, False, "auto"))
    reference.adam_step(rp, g, rm, rv, h)
    assert torch.equal(p, rp) and torch.equal(m, rm) and torch.equal(v, rv)  # same code ran
    with pytest.raises(RuntimeError, match="no _C in this test"):
        torch.ops.zero_kernels.adam_step_(p, g, m, v, **library.hyper_kwargs(h, False, "cpu"))


def test_op_checks_arguments_like_the_python_entry_point():
    p, g, m, v = _tensors(8)
    kw = library.hyper_kwargs(_hyper(), False, "auto")
    with pytest.raises(ValueError, match="grad.numel"):
        torch.ops.zero_kernels.adam_step_(p, g[:4], m, v, None, None, None, **kw)
    with pytest.raises(ValueError, match="backend must be one of"):
        torch.ops.zero_kernels.adam_step_(p, g, m, v, None, None, None, **{**kw, "backend": "x"})
    with pytest.raises(ValueError, match="check_finite=True needs found_inf"):
        kw["check_finite"] = True
        torch.ops.zero_kernels.adam_step_(p, g, m, v, None, None, None, **kw)


# ---- opcheck: schema (declared mutations), autograd registration, fake impl, AOT dispatch ----


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "case", ["fp32", "amsgrad_outlowp_checkfinite", "bf16_state_fp32_grad", "maximize_adam_l2"]
)
def test_opcheck_adam_step(case, backend):
    n = 37
    dtype = torch.bfloat16 if case == "bf16_state_fp32_grad" else torch.float32
    p, g, m, v = _tensors(n, dtype)
    if case == "bf16_state_fp32_grad":
        g = g.float()
    vmax = out = found = None
    h = _hyper()
    if case == "amsgrad_outlowp_checkfinite":
        h = _hyper(amsgrad=True, grad_scale=0.25)
        vmax = v.clone() + 0.5
        out = torch.empty(n, dtype=torch.float16)
        found = torch.zeros(1)
    if case == "maximize_adam_l2":
        h = _hyper(adamw=False, maximize=True, step=1)
    kw = library.hyper_kwargs(h, found is not None, backend)
    torch.library.opcheck(
        torch.ops.zero_kernels.adam_step_.default, (p, g, m, v, vmax, out, found), kw
    )


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("amsgrad", [False, True])
def test_opcheck_adam_step_multi(amsgrad, backend):
    sizes = (5, 64, 1)
    ts = [_tensors(n, seed=i) for i, n in enumerate(sizes)]
    ps, gs, ms, vs = (list(x) for x in zip(*ts))
    vmaxes = [v.clone() for v in vs] if amsgrad else []
    kw = library.hyper_kwargs(_hyper(amsgrad=amsgrad), True, backend)
    torch.library.opcheck(
        torch.ops.zero_kernels.adam_step_multi_.default,
        (ps, gs, ms, vs, vmaxes, torch.zeros(1)),
        kw,
    )


# ---- torch.compile ----


def _model_and_data():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    x, y = torch.randn(6, 8), torch.randn(6, 4)
    return model, x, y


def _train(step_fn_of, steps: int = 4):
    model, x, y = _model_and_data()
    opt = FusedAdamW(model.parameters(), lr=1e-2, weight_decay=0.1, amsgrad=True)
    step = step_fn_of(opt)
    for _ in range(steps):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        step()
    return model, opt


def test_compiled_fused_adamw_step_matches_eager():
    eager_model, eager_opt = _train(lambda opt: opt.step)
    model, opt = _train(lambda opt: torch.compile(opt.step, backend="aot_eager"))
    for a, b in zip(eager_model.parameters(), model.parameters()):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7)
        for key in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "step"):
            torch.testing.assert_close(opt.state[b][key], eager_opt.state[a][key])


def _op_nodes(explained, name: str) -> list:
    target = getattr(torch.ops.zero_kernels, name).default
    return [n for g in explained.graphs for n in g.graph.nodes if n.target is target]


def test_compiled_fused_adamw_step_keeps_the_op_whole():
    model, x, y = _model_and_data()
    opt = FusedAdamW(model.parameters(), lr=1e-2)
    torch.nn.functional.mse_loss(model(x), y).backward()
    explained = torch._dynamo.explain(opt.step)()
    # the whole group's update is one op node in one graph ...
    nodes = _op_nodes(explained, "adam_step_multi_")
    assert len(nodes) == 1, explained
    assert len(nodes[0].args[0]) == len(list(model.parameters()))
    # ... and no graph break comes from inside zero_kernels.ops (the one break FusedAdamW has
    # is its host read of the step counters, `torch.stack(steps).tolist()`, before the op)
    ops_dir = os.path.dirname(ops.__file__)
    for reason in explained.break_reasons:
        for frame in reason.user_stack:
            assert not frame.filename.startswith(ops_dir), (reason.reason, reason.user_stack)


def test_adam_step_compiles_fullgraph_with_inductor_and_a_symbolic_step():
    def step_fn(p, g, m, v, out, found, step: int):
        h = _hyper(step=step, grad_scale=0.5)
        ops.adam_step(p, g, m, v, h, out_lowp=out, found_inf=found, check_finite=True)
        return p.sum()

    compiled = torch.compile(step_fn, backend="inductor", fullgraph=True)  # any break: error
    p, g, m, v = _tensors(1000)
    rp, rm, rv = p.clone(), m.clone(), v.clone()
    out, rout = torch.empty(1000, dtype=torch.bfloat16), torch.empty(1000, dtype=torch.bfloat16)
    found, rfound = torch.zeros(1), torch.zeros(1)
    frames_before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    for step in range(1, 5):
        total = compiled(p, g, m, v, out, found, step)
        h = _hyper(step=step, grad_scale=0.5)
        reference.adam_step(rp, g, rm, rv, h, out_lowp=rout, found_inf=rfound, check_finite=True)
        torch.testing.assert_close(total, rp.sum(), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close((p, m, v, out, found), (rp, rm, rv, rout, rfound))
    # step 1 is specialised, then one graph with a symbolic step serves every later step
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - frames_before <= 2


def test_explicit_ops_entry_points_go_through_the_op_under_a_dispatch_mode():
    # a fake tensor mode must see the op (eager fast path off), and its fake impl checks args
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        p, g, m, v = (torch.empty(16) for _ in range(4))
        ops.adam_step(p, g, m, v, _hyper())
        with pytest.raises(ValueError, match="exp_avg.numel"):
            ops.adam_step(p, g, m[:8], v, _hyper())
