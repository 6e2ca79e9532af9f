"""The fused Adam/AdamW step of every backend against the pure-torch reference."""

from __future__ import annotations

import itertools
import os

import pytest
import torch
from kernel_utils import assert_close

from zero_kernels import native, ops
from zero_kernels.ops import AdamHyper, reference

_C = native.load()
needs_native = pytest.mark.skipif(
    _C is None, reason=f"native extension not built: {native.error()}"
)

try:
    import triton  # noqa: F401

    HAVE_TRITON = os.environ.get("TRITON_INTERPRET") == "1" or torch.cuda.is_available()
except ImportError:
    HAVE_TRITON = False
needs_triton = pytest.mark.skipif(
    not HAVE_TRITON, reason="triton missing (tests set TRITON_INTERPRET=1)"
)

SIZES = [1, 7, 1023, 2**20 + 3]


def cpu_isas() -> list[str]:
    if _C is None:
        return []
    order = ["scalar", "avx2", "avx512"]
    _C.set_cpu_isa("auto")
    best = _C.cpu_isa()
    return order[: order.index(best) + 1]


@pytest.fixture
def isa(request):
    _C.set_cpu_isa(request.param)
    yield request.param
    _C.set_cpu_isa("auto")


def make_state(n, dtype, grad_dtype, seed=0, amsgrad=False):
    gen = torch.Generator().manual_seed(seed)
    p = torch.randn(n, generator=gen).to(dtype)
    g = (torch.randn(n, generator=gen) * 3).to(grad_dtype)
    m = (torch.randn(n, generator=gen) * 0.1).to(dtype)
    v = torch.rand(n, generator=gen).to(dtype) * 0.01
    vm = (v.float() * torch.rand(n, generator=gen) * 2).to(dtype) if amsgrad else None
    return p, g, m, v, vm


def run(backend, hyper, state, out_dtype=None, check_finite=False, found_inf=None):
    p, g, m, v, vm = (t.clone() if t is not None else None for t in state)
    out = torch.full_like(p, 7.0, dtype=out_dtype) if out_dtype is not None else None
    f = None if found_inf is None else found_inf.clone()
    f = ops.adam_step(
        p,
        g,
        m,
        v,
        hyper,
        max_exp_avg_sq=vm,
        out_lowp=out,
        found_inf=f,
        check_finite=check_finite,
        backend=backend,
    )
    return p, m, v, vm, out, f


def compare(got, want, tag):
    for name, a, e in zip(
        ("param", "exp_avg", "exp_avg_sq", "max_exp_avg_sq", "out_lowp"), got[:5], want[:5]
    ):
        if e is None:
            assert a is None
            continue
        assert_close(a, e, f"{tag} {name}")


VARIANTS = list(itertools.product([True, False], [False, True], [False, True], [0.0, 0.1]))


def hyper_for(adamw, amsgrad, maximize, wd, step=5, grad_scale=0.37):
    return AdamHyper(
        lr=3e-3,
        beta1=0.9,
        beta2=0.99,
        eps=1e-8,
        weight_decay=wd,
        step=step,
        adamw=adamw,
        amsgrad=amsgrad,
        maximize=maximize,
        grad_scale=grad_scale,
    )


@needs_native
@pytest.mark.parametrize("isa", cpu_isas(), indirect=True)
@pytest.mark.parametrize("n", SIZES[:-1])
def test_cpu_fp32_all_variants(isa, n):
    for adamw, amsgrad, maximize, wd in VARIANTS:
        h = hyper_for(adamw, amsgrad, maximize, wd)
        state = make_state(n, torch.float32, torch.float32, seed=n, amsgrad=amsgrad)
        for out_dtype in (None, torch.bfloat16, torch.float16):
            compare(
                run("cpu", h, state, out_dtype),
                run("reference", h, state, out_dtype),
                f"{isa} n={n} adamw={adamw} ams={amsgrad} max={maximize} wd={wd} out={out_dtype}",
            )


@needs_native
def test_cpu_fp32_all_variants_large():
    """The same matrix at 2**20 + 3 elements (several threads' chunks and a tail), every ISA
    against one reference result per variant (the reference is 3-4x the kernel's time)."""
    n = SIZES[-1]
    try:
        for adamw, amsgrad, maximize, wd in VARIANTS:
            h = hyper_for(adamw, amsgrad, maximize, wd)
            state = make_state(n, torch.float32, torch.float32, seed=n, amsgrad=amsgrad)
            for out_dtype in (None, torch.bfloat16, torch.float16):
                want = run("reference", h, state, out_dtype)
                for isa in cpu_isas():
                    _C.set_cpu_isa(isa)
                    tag = f"n={n} adamw={adamw} ams={amsgrad} max={maximize} wd={wd}"
                    compare(run("cpu", h, state, out_dtype), want, f"{isa} {tag} out={out_dtype}")
    finally:
        _C.set_cpu_isa("auto")


@needs_native
@pytest.mark.parametrize("isa", cpu_isas(), indirect=True)
@pytest.mark.parametrize(
    "dtype,grad_dtype",
    [
        (torch.bfloat16, torch.bfloat16),
        (torch.bfloat16, torch.float32),
        (torch.float16, torch.float16),
        (torch.float16, torch.float32),
    ],
)
@pytest.mark.parametrize("n", [1, 7, 1023, 70001])
def test_cpu_low_precision_state(isa, dtype, grad_dtype, n):
    for adamw, amsgrad in ((True, False), (False, True)):
        h = hyper_for(adamw, amsgrad, False, 0.05)
        state = make_state(n, dtype, grad_dtype, seed=3, amsgrad=amsgrad)
        compare(
            run("cpu", h, state, torch.bfloat16),
            run("reference", h, state, torch.bfloat16),
            f"{dtype}/{grad_dtype} n={n}",
        )


@needs_triton
@pytest.mark.parametrize("n", [1, 7, 1023, 4099])
def test_triton_matches_reference(n):
    for adamw, amsgrad, maximize, wd in VARIANTS[::3]:
        h = hyper_for(adamw, amsgrad, maximize, wd)
        state = make_state(n, torch.float32, torch.float32, seed=n, amsgrad=amsgrad)
        compare(
            run("triton", h, state, torch.bfloat16),
            run("reference", h, state, torch.bfloat16),
            f"triton n={n}",
        )
    h = hyper_for(True, False, False, 0.1)
    state = make_state(n, torch.bfloat16, torch.bfloat16, seed=1)
    got, want = run("triton", h, state), run("reference", h, state)
    # the interpreter's bf16 cast may round the other way on a tie: one more ulp allowed
    for a, e, name in zip(got[:3], want[:3], ("param", "exp_avg", "exp_avg_sq")):
        assert_close(a, e, f"triton bf16 {name}", tol=(2**-6, 1e-6))


BACKENDS_FOR_FLAG = (
    (["cpu"] if _C is not None else []) + ["reference"] + (["triton"] if HAVE_TRITON else [])
)


@pytest.mark.parametrize("backend", BACKENDS_FOR_FLAG)
@pytest.mark.parametrize("where", [0, 17, 1022])
@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_non_finite_grad_leaves_everything_untouched(backend, where, bad):
    n = 1023
    h = hyper_for(True, True, False, 0.1)
    p, g, m, v, vm = make_state(n, torch.float32, torch.float32, amsgrad=True)
    g[where] = bad
    got = run(backend, h, (p, g, m, v, vm), torch.bfloat16, check_finite=True)
    assert got[5].item() == 1.0, f"{backend}: found_inf not set for {bad} at {where}"
    for name, a, e in zip(("param", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"), got, (p, m, v, vm)):
        assert torch.equal(a, e), f"{backend}: {name} changed although a grad was {bad}"
    assert bool((got[4].float() == 7.0).all()), f"{backend}: out_lowp written on overflow"


@pytest.mark.parametrize("backend", BACKENDS_FOR_FLAG)
def test_finite_grads_that_overflow_after_scaling_are_flagged(backend):
    p, g, m, v, _ = make_state(64, torch.float32, torch.float32)
    g[3] = 3e38
    h = hyper_for(True, False, False, 0.0, grad_scale=10.0)
    got = run(backend, h, (p, g, m, v, None), check_finite=True)
    assert got[5].item() == 1.0
    assert torch.equal(got[0], p)


@pytest.mark.parametrize("backend", BACKENDS_FOR_FLAG)
def test_preset_found_inf_skips_and_clear_flag_steps(backend):
    state = make_state(100, torch.float32, torch.float32)
    h = hyper_for(True, False, False, 0.1)
    skipped = run(backend, h, state, found_inf=torch.ones(1))
    assert torch.equal(skipped[0], state[0]), "a set found_inf must skip the step"
    stepped = run(backend, h, state, found_inf=torch.zeros(1), check_finite=True)
    assert stepped[5].item() == 0.0
    assert not torch.equal(stepped[0], state[0])


@needs_native
def test_multi_tensor_scan_happens_before_any_update():
    ps = [torch.randn(n) for n in (5, 100, 3)]
    gs = [torch.randn_like(p) for p in ps]
    gs[-1][2] = float("nan")
    ms = [torch.zeros_like(p) for p in ps]
    vs = [torch.zeros_like(p) for p in ps]
    before = [p.clone() for p in ps]
    f = ops.adam_step_multi(
        ps, gs, ms, vs, hyper_for(True, False, False, 0.1), check_finite=True, backend="cpu"
    )
    assert f.item() == 1.0
    assert all(torch.equal(a, b) for a, b in zip(ps, before))


def test_bad_arguments_name_the_argument():
    p, g, m, v, _ = make_state(8, torch.float32, torch.float32)
    h = hyper_for(True, False, False, 0.0)
    with pytest.raises(ValueError, match="backend"):
        ops.adam_step(p, g, m, v, h, backend="tpu")
    with pytest.raises(ValueError, match="grad.numel"):
        ops.adam_step(p, g[:4], m, v, h)
    with pytest.raises(TypeError, match="exp_avg.dtype"):
        ops.adam_step(p, g, m.double(), v, h)
    with pytest.raises(ValueError, match="contiguous"):
        ops.adam_step(p.view(2, 4).t(), g.view(2, 4).t(), m, v, h)
    with pytest.raises(ValueError, match="max_exp_avg_sq"):
        ops.adam_step(p, g, m, v, hyper_for(True, True, False, 0.0))
    with pytest.raises(ValueError, match="step"):
        AdamHyper(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, step=0, adamw=True)
    with pytest.raises(ValueError, match="beta2"):
        AdamHyper(lr=1e-3, beta1=0.9, beta2=1.0, eps=1e-8, weight_decay=0.0, step=1, adamw=True)
    if _C is not None:
        with pytest.raises(ValueError, match="isa"):
            _C.set_cpu_isa("sse9")


def test_explicit_backend_that_cannot_run_raises():
    p, g, m, v, _ = make_state(8, torch.float32, torch.float32)
    h = hyper_for(True, False, False, 0.0)
    with pytest.raises((RuntimeError, ValueError), match="cuda"):
        ops.adam_step(p, g, m, v, h, backend="cuda")


@needs_native
def test_conversions_are_bit_exact_against_torch():
    specials = torch.tensor(
        [
            0.0,
            -0.0,
            1.0,
            -1.0,
            65504.0,
            65519.0,
            65520.0,
            1e5,
            -1e5,
            6e-8,
            3e-8,
            2.9802322e-08,
            5.96e-8,
            6.1e-5,
            6.09e-5,
            1e-40,
            3.4e38,
            float("inf"),
            float("-inf"),
            1.00390625,
            1.01171875,
            1.0009765625,
            1.0029296875,
            2.0**-24,
            2.0**-25,
            1.5 * 2.0**-24,
        ]
    )
    x = torch.cat(
        [
            specials,
            torch.randn(100003) * 10,
            torch.randn(5000) * 1e-6,
            (torch.rand(5000) - 0.5) * 1.4e5,
        ]
    )
    for dt in (torch.bfloat16, torch.float16):
        flat = torch.empty(x.numel(), dtype=dt)
        _C.flat_copy([x], flat, [0], True)
        want = x.to(dt)
        same = flat.view(torch.int16) == want.view(torch.int16)
        assert bool(same.all()), (
            f"{dt}: first mismatch at {(~same).nonzero()[:5].view(-1).tolist()}"
            f" value {x[~same][:5].tolist()}"
        )
        back = torch.empty_like(x)
        _C.flat_copy([back], flat, [0], False)
        assert torch.equal(back, want.float())
    nan = torch.tensor([float("nan")])
    for dt in (torch.bfloat16, torch.float16):
        out = torch.empty(1, dtype=dt)
        _C.flat_copy([nan], out, [0], True)
        assert out.float().isnan().all()


@needs_native
def test_flat_copy_many_tensors_round_trip():
    ts = [torch.randn(n) for n in (0, 1, 7, 1023, 70001, 5)]
    offsets, off = [], 3
    for t in ts:
        offsets.append(off)
        off += t.numel() + 2
    flat = torch.zeros(off + 1)
    _C.flat_copy(ts, flat, offsets, True)
    for t, o in zip(ts, offsets):
        assert torch.equal(flat[o : o + t.numel()], t)
    outs = [torch.empty_like(t) for t in ts]
    _C.flat_copy(outs, flat, offsets, False)
    assert all(torch.equal(a, b) for a, b in zip(outs, ts))
    with pytest.raises(RuntimeError, match="does not fit"):
        _C.flat_copy([torch.randn(10)], torch.zeros(5), [0], True)


def test_reference_is_the_documented_formula():
    # one element worked by hand, so the oracle itself is checked
    import math

    p, g, m, v = (torch.tensor([x]) for x in (1.0, 0.5, 0.1, 0.2))
    h = AdamHyper(
        lr=0.1,
        beta1=0.9,
        beta2=0.99,
        eps=1e-8,
        weight_decay=0.01,
        step=2,
        adamw=True,
        grad_scale=2.0,
    )
    reference.adam_step(p, g, m, v, h)
    gg = 1.0
    pp = 1.0 * (1 - 0.1 * 0.01)
    mm = 0.9 * 0.1 + 0.1 * gg
    vv = 0.99 * 0.2 + 0.01 * gg * gg
    pp -= (0.1 / (1 - 0.9**2)) * mm / (math.sqrt(vv) / math.sqrt(1 - 0.99**2) + 1e-8)
    assert abs(p.item() - pp) < 1e-6 and abs(m.item() - mm) < 1e-7 and abs(v.item() - vv) < 1e-7


@needs_native
@pytest.mark.parametrize("isa", cpu_isas(), indirect=True)
def test_stream_probe_variants_touch_every_element_once(isa):
    """Each variant of the probe (prefetch, streaming stores, threads), each pattern: one add per
    element of every stream, heads and tails included; a time comes back."""
    n = 3 * 64 * 7 + 45
    for mdt, vdt, view in (
        (torch.float32, torch.float32, torch.float32),
        (torch.bfloat16, torch.bfloat16, torch.int16),
        (torch.int8, torch.uint8, None),
    ):
        for pf, nt, threads in itertools.product((0, 512), (False, True), (0, 1, 2)):
            p, g = torch.zeros(n), torch.ones(n)
            m, v = torch.zeros(n, dtype=mdt), torch.zeros(n, dtype=vdt)
            t = _C.stream_probe_variant(p, g, m, v, prefetch=pf, nt=nt, threads=threads)
            assert isinstance(t, float) and t >= 0.0
            what = f"{isa} {mdt} pf={pf} nt={nt} threads={threads}"
            assert torch.equal(p, torch.ones(n)), what
            for x in (m, v):
                x = x.view(view) if view is not None else x
                assert torch.equal(x, torch.ones(n, dtype=x.dtype)), what
    with pytest.raises(RuntimeError, match="m, v must be"):
        _C.stream_probe_variant(p, g, torch.zeros(n, dtype=torch.int8), torch.zeros(n))


@needs_native
@pytest.mark.parametrize("isa", cpu_isas(), indirect=True)
def test_prefetch_distance_changes_no_result(isa):
    """Software prefetch is a hint: the fp32, bf16 and int8 steps are bitwise equal at distance
    0, the default and an odd one."""
    from zero_kernels.ops import lowbit

    assert _C.prefetch_distance() == _C.default_prefetch_distance()
    n = 70001
    h = hyper_for(True, False, False, 0.01)
    results = []
    try:
        for dist in (0, _C.default_prefetch_distance(), 1000):
            _C.set_prefetch_distance(dist)
            state = make_state(n, torch.float32, torch.float32, seed=3)
            out = [run("cpu", h, state, torch.bfloat16)]
            for fmt in ("bf16", "int8"):
                gen = torch.Generator().manual_seed(4)
                p, g = torch.randn(n, generator=gen), torch.randn(n, generator=gen) * 1e-2
                st = lowbit.new_state(n, fmt, 256, "cpu")
                for step in (1, 2):
                    lowbit.adam_step_lowbit(
                        p,
                        g,
                        st,
                        AdamHyper(1e-3, 0.9, 0.999, 1e-8, 0.01, step, True),
                        state_dtype=fmt,
                        backend="cpu",
                    )
                out.append((p, *st.values()))
            results.append(out)
    finally:
        _C.set_prefetch_distance(_C.default_prefetch_distance())
    for other in results[1:]:
        for a, b in zip(results[0], other):
            for x, y in zip(a, b):
                assert (x is None and y is None) or torch.equal(x, y)
    with pytest.raises(ValueError, match="elems must be >= 0"):
        _C.set_prefetch_distance(-1)


def _amd_family() -> int | None:
    """The CPU family /proc/cpuinfo reports for an AMD CPU (None: another vendor or unknown)."""
    try:
        text = open("/proc/cpuinfo").read()
    except OSError:
        return None
    fields = dict(
        (k.strip(), v.strip()) for k, _, v in (ln.partition(":") for ln in text.splitlines())
    )
    if fields.get("vendor_id") != "AuthenticAMD" or "cpu family" not in fields:
        return None
    return int(fields["cpu family"])


@needs_native
def test_default_prefetch_distance_is_the_one_measured_for_this_cpu_family():
    """128 elements on AMD family 0x19 (Zen 3/4: 512 ran 0.76-0.94x torch's fused step there),
    512 elsewhere; the cpuid reading in C++ agrees with /proc/cpuinfo's."""
    if not os.path.exists("/proc/cpuinfo"):
        pytest.skip("no /proc/cpuinfo to check the CPU family against")
    want = 128 if _amd_family() == 0x19 else 512
    assert _C.default_prefetch_distance() == want


@needs_native
def test_multi_tensor_bad_arguments_name_the_argument():
    """The native multi-tensor call checks in C++; on a failure the Python checks run for their
    messages (and nothing was written)."""
    ps = [torch.randn(n) for n in (5, 8)]
    gs = [torch.randn_like(p) for p in ps]
    ms = [torch.zeros_like(p) for p in ps]
    vs = [torch.zeros_like(p) for p in ps]
    before = [p.clone() for p in ps]
    h = hyper_for(True, False, False, 0.0)
    with pytest.raises(ValueError, match="grad.numel"):
        ops.adam_step_multi(ps, [gs[0], gs[1][:4]], ms, vs, h, backend="cpu")
    with pytest.raises(TypeError, match="exp_avg.dtype"):
        ops.adam_step_multi(ps, gs, [ms[0], ms[1].double()], vs, h, backend="cpu")
    with pytest.raises(ValueError, match="len\\(grads\\)"):
        ops.adam_step_multi(ps, gs[:1], ms, vs, h, backend="cpu")
    with pytest.raises(ValueError, match="found_inf"):
        ops.adam_step_multi(ps, gs, ms, vs, h, found_inf=torch.zeros(2), backend="cpu")
    assert all(torch.equal(a, b) for a, b in zip(ps, before))
    one = ops.adam_step_multi(ps[:1], gs[:1], ms[:1], vs[:1], h, backend="cpu")  # one tensor
    assert one is None and not torch.equal(ps[0], before[0])
