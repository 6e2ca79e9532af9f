"""Blockwise int8/int4 quantization: every backend against the pure-torch reference, byte for byte.

q bytes, scales, error-feedback residuals and dequantized values are compared exactly (their bits;
a NaN only as a NaN: torch's own fp32 -> bf16 cast writes another NaN pattern than the kernels),
at odd sizes, fp32/bf16/fp16 inputs, zero and non-finite blocks. The byte format and non-finite
rules under test: `zero_kernels.ops.quant` [Note: quantized bytes].
"""

from __future__ import annotations

import os

import pytest
import torch

from zero_kernels import native, ops
from zero_kernels.ops import quant, quant_reference

_C = native.load()
HAVE_NATIVE = _C is not None and hasattr(_C, "quantize_blockwise")
try:
    import triton  # noqa: F401

    HAVE_TRITON = os.environ.get("TRITON_INTERPRET") == "1" or torch.cuda.is_available()
except ImportError:
    HAVE_TRITON = False

# the Triton interpreter's numpy warns on the inf/NaN blocks' products; the results are checked
pytestmark = pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")
needs_native = pytest.mark.skipif(not HAVE_NATIVE, reason=f"native extension: {native.error()}")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# backends that run here; Triton through its interpreter on small sizes only
BACKENDS = (["cpu"] if HAVE_NATIVE else []) + (["triton"] if HAVE_TRITON else [])
ALL = ["reference", *BACKENDS]
BOUND = 0.5 + 2.0**-14  # |y - deq| <= scale * BOUND ([Note: quantized bytes])


def cpu_isas() -> list[str]:
    if not HAVE_NATIVE:
        return []
    order = ["scalar", "avx2", "avx512"]
    _C.set_cpu_isa("auto")
    return order[: order.index(_C.cpu_isa()) + 1]


@pytest.fixture
def isa(request):
    _C.set_cpu_isa(request.param)
    yield request.param
    _C.set_cpu_isa("auto")


def sizes(block: int) -> list[int]:
    return sorted({1, max(1, block - 1), block, block + 1, 3 * block + 7})


def sample(n: int, dtype=torch.float32, seed: int = 0, heavy: bool = False) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=gen)
    if heavy:  # Student-t (3 degrees of freedom): rare large values, as in gradients
        chi = torch.randn(n, 3, generator=gen).pow(2).sum(1)
        x = x / (chi / 3).sqrt()
    x[::29] = torch.arange(0, n, 29).remainder(9).sub(4).float() * 0.5  # exact halves, zeros
    return x.to(dtype)


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Elementwise: same bits, or both NaN."""
    a, b = a.reshape(-1), b.reshape(-1)
    same = a.view(torch.int16 if a.element_size() == 2 else torch.int32) == b.view(
        torch.int16 if b.element_size() == 2 else torch.int32
    )
    return same | (a.isnan() & b.isnan())


def assert_same(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype, f"{what}: {got.shape} {got.dtype}"
    ok = bits_equal(got, want) if got.is_floating_point() else got.reshape(-1) == want.reshape(-1)
    if not bool(ok.all()):
        idx = (~ok).nonzero().reshape(-1)[:6].tolist()
        rows = ", ".join(
            f"[{i}] {got.reshape(-1)[i].item()!r} vs {want.reshape(-1)[i].item()!r}" for i in idx
        )
        raise AssertionError(f"{what}: {int((~ok).sum())}/{ok.numel()} differ, first: {rows}")


def round_trip(backend, x, bits, block, error=None):
    """q, scales, residual, and the dequantized values as fp32, bf16, fp16 and accumulated."""
    e = None if error is None else error.clone()
    q, s = ops.quantize_blockwise(x, bits, block, error=e, backend=backend)
    n = x.numel()
    deq = {
        dt: ops.dequantize_blockwise(q, s, bits, block, n, dtype=dt, backend=backend)
        for dt in DTYPES
    }
    acc = torch.linspace(-1, 1, n).to(x.device)  # the same values on every device
    ops.dequantize_blockwise(q, s, bits, block, n, out=acc, accumulate=True, backend=backend)
    return q, s, e, deq, acc


def compare_backend(backend, x, bits, block, error=None, tag=""):
    got = round_trip(backend, x, bits, block, error)
    want = round_trip("reference", x, bits, block, error)
    tag = f"{backend} bits={bits} block={block} n={x.numel()} {x.dtype} {tag}"
    assert_same(got[0], want[0], f"{tag} q")
    assert_same(got[1], want[1], f"{tag} scales")
    if error is not None:
        assert_same(got[2], want[2], f"{tag} error")
    for dt in DTYPES:
        assert_same(got[3][dt], want[3][dt], f"{tag} deq {dt}")
    assert_same(got[4], want[4], f"{tag} accumulate")


# ---- every backend against the reference ----


@needs_native
@pytest.mark.parametrize("isa", cpu_isas(), indirect=True)
@pytest.mark.parametrize("bits", [8, 4])
def test_cpu_matches_reference(isa, bits):
    for block in (2, 32, 256, 4096):
        for n in sizes(block):
            for dtype in DTYPES:
                x = sample(n, dtype, seed=n + block)
                compare_backend("cpu", x, bits, block)
                err = sample(n, seed=n + 1) * 0.01
                compare_backend("cpu", x, bits, block, error=err, tag="with error")


@needs_native
@pytest.mark.parametrize("bits", [8, 4])
def test_cpu_large_and_threaded(bits):
    # 2^20 + 3 elements over torch's threads: block ranges split across tasks
    x = sample(2**20 + 3, torch.bfloat16, seed=3, heavy=True)
    err = sample(2**20 + 3, seed=4) * 1e-3
    compare_backend("cpu", x, bits, 256, error=err)


@pytest.mark.skipif(not HAVE_TRITON, reason="triton missing (tests set TRITON_INTERPRET=1)")
@pytest.mark.parametrize("bits", [8, 4])
def test_triton_matches_reference(bits):
    for block in (2, 30, 256):
        for n in sizes(block):
            for dtype in DTYPES:
                x = sample(n, dtype, seed=n + block)
                compare_backend("triton", x, bits, block)
    err = sample(3 * 256 + 7, seed=1) * 0.01
    compare_backend("triton", sample(3 * 256 + 7, seed=2), bits, 256, error=err, tag="error")
    # a block larger than one chunk of the kernel (loops over chunks)
    compare_backend("triton", sample(2 * 2500 + 1, seed=5), bits, 2500)


@pytest.mark.parametrize("backend", ALL)
def test_auto_and_empty(backend):
    x = sample(1000, seed=9)
    assert_same(ops.quantize_blockwise(x, backend="auto")[0], ops.quantize_blockwise(x)[0], "auto")
    q, s = ops.quantize_blockwise(torch.empty(0), 4, 8, backend=backend)
    assert q.numel() == 0 and s.numel() == 0
    assert ops.dequantize_blockwise(q, s, 4, 8, 0, backend=backend).numel() == 0
    assert ops.quantized_sizes(1001, 4, 256) == (501, 4)
    assert quant.DEFAULT_BLOCK == ops.DEFAULT_BLOCK


# ---- the format itself ----


def test_reference_formula_by_hand():
    # one int8 block worked with torch's own fp32 ops: scale = absmax / 127, q = rne(x * inv)
    x = torch.tensor([2.54, -2.54, 1.0, 0.0, -0.01, 0.03], dtype=torch.float32)
    q, s = ops.quantize_blockwise(x, 8, 6, backend="reference")
    scale = torch.tensor(2.54) / torch.tensor(127.0)
    inv = torch.tensor(127.0) / torch.tensor(2.54)
    want = torch.round(x * inv).to(torch.int8)
    assert s.item() == scale.item()
    assert torch.equal(q.view(torch.int8), want)
    assert q.view(torch.int8)[:2].tolist() == [127, -127]


@pytest.mark.parametrize("backend", ALL)
def test_int4_packing_and_odd_count(backend):
    # block scale 1 (absmax 7): q equals x; 7 elements: the last byte's high nibble is 0
    x = torch.tensor([7.0, -7.0, 1.0, -1.0, 0.0, 3.0, -6.0])
    q, s = ops.quantize_blockwise(x, 4, 8, backend=backend)
    assert s.tolist() == [1.0]
    assert q.tolist() == [0x97, 0xF1, 0x30, 0x0A], [hex(b) for b in q.tolist()]
    back = ops.dequantize_blockwise(q, s, 4, 8, 7, backend=backend)
    assert torch.equal(back, x)
    assert quant_reference.unpack(q, 4, 7).tolist() == [7, -7, 1, -1, 0, 3, -6]
    # int8: the bytes are the two's-complement values
    q8, _ = ops.quantize_blockwise(x, 8, 8, backend=backend)
    assert q8.view(torch.int8)[:2].tolist() == [127, -127]


@pytest.mark.parametrize("backend", ALL)
@pytest.mark.parametrize("bits", [8, 4])
def test_zero_blocks_are_exact_zeros(backend, bits):
    x = sample(5 * 64 + 3, seed=1)
    x[64:128] = 0.0
    x[70] = -0.0
    x[5 * 64 :] = 0.0  # the partial last block too
    q, s = ops.quantize_blockwise(x, bits, 64, backend=backend)
    assert s[1].item() == 0.0 and s[5].item() == 0.0
    d = ops.dequantize_blockwise(q, s, bits, 64, x.numel(), backend=backend)
    assert bool(d.isfinite().all())
    assert d[64:128].view(torch.int32).eq(0).all() and d[5 * 64 :].view(torch.int32).eq(0).all()


@pytest.mark.parametrize("backend", ALL)
@pytest.mark.parametrize("bits", [8, 4])
def test_non_finite_blocks_stay_non_finite(backend, bits):
    qmax = 127 if bits == 8 else 7
    block = 32
    x = sample(6 * block + 5, seed=2)
    x[block + 3] = float("nan")  # block 1: NaN
    x[2 * block + 9] = float("inf")  # block 2: +inf
    x[3 * block] = float("-inf")  # block 3: -inf
    x[4 * block + 1], x[4 * block + 2] = float("inf"), float("nan")  # block 4: both
    x[6 * block + 4] = float("-inf")  # the partial last block
    err = torch.full_like(x, 0.01)
    q, s = ops.quantize_blockwise(x, bits, block, error=err, backend=backend)
    d = ops.dequantize_blockwise(q, s, bits, block, x.numel(), backend=backend)
    blocks = d.view(-1)[: 6 * block].view(6, block)
    assert bool(blocks[0].isfinite().all()) and bool(blocks[5].isfinite().all())
    assert s[1].isnan() and s[4].isnan() and s[1].view(torch.int32).item() == 0x7FC00000
    assert bool(blocks[1].isnan().all()) and bool(blocks[4].isnan().all())
    assert s[2].item() == s[3].item() == s[6].item() == float("inf")
    assert d[2 * block + 9].item() == float("inf") and d[3 * block].item() == float("-inf")
    assert d[6 * block + 4].item() == float("-inf")
    ints = quant_reference.unpack(q, bits, x.numel())
    assert ints[2 * block + 9].item() == qmax and ints[3 * block].item() == -qmax
    finite_in_inf_block = torch.cat([blocks[2][:9], blocks[2][10:], blocks[3][1:]])
    assert bool(finite_in_inf_block.isnan().all())  # 0 * inf
    # residuals: reset in the non-finite blocks, kept elsewhere
    eb = err[: 6 * block].view(6, block)
    assert bool((eb[1:5] == 0).all()) and bool((err[6 * block :] == 0).all())
    assert bool(eb[0].ne(0).any())
    # the optimizer's overflow check still sees them, also after a two-hop fp32 sum
    total = torch.zeros_like(x)
    for _ in range(3):
        ops.dequantize_blockwise(q, s, bits, block, x.numel(), out=total, accumulate=True)
    assert not bool(total.isfinite().all())
    assert bool(total[block : 5 * block].isfinite().logical_not().all())
    if HAVE_NATIVE:
        assert not _C.all_finite(d, 1.0) and not _C.all_finite(total, 1.0)
        assert _C.all_finite(d[:block], 1.0)


# ---- accuracy, error feedback, two-hop sums ----


@pytest.mark.parametrize("backend", ALL)
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dtype", DTYPES)
def test_error_bound_half_a_step(backend, bits, dtype):
    block = 128
    n = 4 * block + 9 if backend == "triton" else 20 * block + 9
    for heavy in (False, True):
        x = (sample(n, seed=7, heavy=heavy) * (1e2 if heavy else 1e-3)).to(dtype)
        q, s = ops.quantize_blockwise(x, bits, block, backend=backend)
        d = ops.dequantize_blockwise(q, s, bits, block, n, backend=backend)
        step = s.repeat_interleave(block)[:n].double()
        err = (x.double() - d.double()).abs()
        assert bool((err <= step * BOUND).all()), f"max err/scale {(err / step).max().item()}"
    # blocks far below the normal range: no NaN, within 2 * absmax
    tiny = torch.full((block,), 3e-39) * torch.linspace(-1, 1, block)
    q, s = ops.quantize_blockwise(tiny, bits, block, backend=backend)
    d = ops.dequantize_blockwise(q, s, bits, block, block, backend=backend)
    assert bool(d.isfinite().all()) and bool(((tiny - d).abs() <= 2 * 3e-39).all())


@pytest.mark.parametrize("backend", ALL)
@pytest.mark.parametrize("bits", [8, 4])
def test_error_feedback_tracks_the_sum_of_inputs(backend, bits):
    # sum_t deq_t = sum_t x_t - e_T: the running sums differ by the last residual, at most half a
    # step, however many steps; without feedback the rounding of small values adds up
    block, n, steps = 64, 3 * 64 + 5, 40
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(n, generator=gen)
    base[::7] *= 30  # one large value per few: small ones round to 0 without feedback
    err = torch.zeros(n)
    sum_x = torch.zeros(n, dtype=torch.float64)
    sum_fb = torch.zeros(n, dtype=torch.float64)
    sum_plain = torch.zeros(n, dtype=torch.float64)
    for _ in range(steps):
        x = base + 0.1 * torch.randn(n, generator=gen)
        sum_x += x.double()
        q, s = ops.quantize_blockwise(x, bits, block, error=err, backend=backend)
        sum_fb += ops.dequantize_blockwise(q, s, bits, block, n, backend=backend).double()
        q, s = ops.quantize_blockwise(x, bits, block, backend=backend)
        sum_plain += ops.dequantize_blockwise(q, s, bits, block, n, backend=backend).double()
    step = s.repeat_interleave(block)[:n].double()
    drift = (sum_x - sum_fb).abs()
    assert bool((drift <= step * BOUND + 1e-4).all()), f"max drift/step {(drift / step).max()}"
    assert bool(((sum_x - sum_fb) - err.double()).abs().max() < 1e-4)  # the residual is the gap
    assert (sum_x - sum_plain).abs().max() > 3 * step.max()  # the test can fail


@pytest.mark.parametrize("backend", ALL)
@pytest.mark.parametrize("bits", [8, 4])
def test_two_hop_accumulate_sums_pieces_in_fp32(backend, bits):
    # four ranks' pieces summed into one fp32 buffer, as each hop of the reduce does
    n, block = 2 * 256 + 11, 256
    pieces = [sample(n, torch.bfloat16, seed=r, heavy=True) for r in range(4)]
    total = torch.zeros(n)
    want = torch.zeros(n)
    for x in pieces:
        q, s = ops.quantize_blockwise(x, bits, block, backend=backend)
        ops.dequantize_blockwise(q, s, bits, block, n, out=total, accumulate=True, backend=backend)
        want = want + ops.dequantize_blockwise(q, s, bits, block, n, backend="reference")
    assert_same(total, want, f"{backend} accumulate")
    exact = sum(x.double() for x in pieces)
    scale_sum = 4 * max(x.float().abs().max().item() for x in pieces) / (127 if bits == 8 else 7)
    assert (total.double() - exact).abs().max() <= scale_sum * BOUND


# ---- torch.compile sees one op ----


# test_schema is left out: it costs ~4 s here and checks what the schema strings already state
OPCHECK = ("test_faketensor", "test_autograd_registration", "test_aot_dispatch_dynamic")


def test_ops_registered_and_opcheck():
    x = sample(3 * 64 + 1, seed=1)
    q = torch.empty(3 * 64 + 1, dtype=torch.uint8)
    s = torch.empty(4)
    e = torch.zeros(3 * 64 + 1)
    torch.library.opcheck(
        quant.quantize_blockwise_,
        (x, q, s, e),
        {"bits": 8, "block": 64, "backend": "reference"},
        test_utils=OPCHECK,
    )
    out = torch.zeros(3 * 64 + 1)
    ops.quantize_blockwise(x, 8, 64, out=(q, s))
    torch.library.opcheck(
        quant.dequantize_blockwise_,
        (q, s, out),
        {"bits": 8, "block": 64, "accumulate": True, "backend": "reference"},
        test_utils=OPCHECK,
    )


def test_compiled_round_trip_is_one_graph():
    import torch._dynamo

    def f(x, e):
        q, s = ops.quantize_blockwise(x, 4, 64, error=e)
        return ops.dequantize_blockwise(q, s, 4, 64, x.numel()) * 2

    torch._dynamo.reset()
    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    x = sample(1001, seed=3)
    e1, e2 = torch.zeros(1001), torch.zeros(1001)
    assert_same(compiled(x, e1), f(x, e2), "compiled")
    assert_same(e1, e2, "compiled residual")
    torch._dynamo.reset()


# ---- argument checks ----


def test_bad_arguments_name_the_argument():
    x = sample(100)
    q, s = ops.quantize_blockwise(x, 8, 16)
    cases = [
        (ValueError, "bits=3", lambda: ops.quantize_blockwise(x, 3, 16)),
        (ValueError, "bits=True", lambda: ops.quantize_blockwise(x, True, 16)),
        (ValueError, "block=0", lambda: ops.quantize_blockwise(x, 8, 0)),
        (ValueError, "block=-4", lambda: ops.quantize_blockwise(x, 8, -4)),
        (ValueError, "block must be even, got block=15", lambda: ops.quantize_blockwise(x, 4, 15)),
        (TypeError, "x.dtype", lambda: ops.quantize_blockwise(x.double(), 8, 16)),
        (TypeError, "x.dtype", lambda: ops.quantize_blockwise(x.int(), 8, 16)),
        (ValueError, "x must be contiguous", lambda: ops.quantize_blockwise(x.view(10, 10).t())),
        (TypeError, "x must be a Tensor", lambda: ops.quantize_blockwise([1.0, 2.0])),
        (
            TypeError,
            "error.dtype",
            lambda: ops.quantize_blockwise(x, error=torch.zeros(100).half()),
        ),
        (ValueError, "error.numel", lambda: ops.quantize_blockwise(x, error=torch.zeros(99))),
        (
            ValueError,
            "error is on meta",
            lambda: ops.quantize_blockwise(x, error=torch.zeros(100, device="meta")),
        ),
        (ValueError, "q.numel", lambda: ops.quantize_blockwise(x, 8, 16, out=(q[:50], s))),
        (TypeError, "scales.dtype", lambda: ops.quantize_blockwise(x, 8, 16, out=(q, s.half()))),
        (TypeError, "(q, scales) pair", lambda: ops.quantize_blockwise(x, out=q)),
        (ValueError, "backend", lambda: ops.quantize_blockwise(x, backend="tpu")),
        (
            ValueError,
            "out.numel()=99, expected numel=100",
            lambda: ops.dequantize_blockwise(q, s, 8, 16, 100, out=torch.zeros(99)),
        ),
        (
            ValueError,
            "q.numel()=100, expected 101",
            lambda: ops.dequantize_blockwise(q, s, 8, 16, 101),
        ),
        (
            ValueError,
            "scales.numel()=7, expected 4",
            lambda: ops.dequantize_blockwise(q, s, 8, 32, 100),
        ),
        (TypeError, "q.dtype", lambda: ops.dequantize_blockwise(q.view(torch.int8), s, 8, 16, 100)),
        (
            ValueError,
            "scales is on meta",
            lambda: ops.dequantize_blockwise(q, torch.zeros(7, device="meta"), 8, 16, 100),
        ),
        (
            ValueError,
            "accumulate=True adds into out",
            lambda: ops.dequantize_blockwise(q, s, 8, 16, 100, accumulate=True),
        ),
        (
            TypeError,
            "out.dtype must be torch.float32",
            lambda: ops.dequantize_blockwise(
                q, s, 8, 16, 100, out=torch.zeros(100, dtype=torch.bfloat16), accumulate=True
            ),
        ),
        (
            ValueError,
            "differs from out.dtype",
            lambda: ops.dequantize_blockwise(
                q, s, 8, 16, 100, out=torch.zeros(100), dtype=torch.float16
            ),
        ),
        (
            TypeError,
            "dtype must be one of",
            lambda: ops.dequantize_blockwise(q, s, 8, 16, 100, dtype=torch.float64),
        ),
        (ValueError, "numel=-1", lambda: ops.dequantize_blockwise(q, s, 8, 16, -1)),
    ]
    for exc, text, call in cases:
        with pytest.raises(exc, match=None) as info:
            call()
        assert text in str(info.value), f"{text!r} not in {info.value!r}"


def test_without_extension_auto_uses_the_reference():
    from test_backends import run_py

    r = run_py(
        """
        import torch
        from zero_kernels import ops
        x = torch.randn(300)
        q, s = ops.quantize_blockwise(x, 4, 64)
        d = ops.dequantize_blockwise(q, s, 4, 64, 300)
        assert (x - d).abs().max() <= s.max() * 0.51
        try:
            ops.quantize_blockwise(x, backend="cpu")
        except RuntimeError as e:
            print("raised:", e)
        """
    )
    assert r.returncode == 0, r.stderr
    assert "raised:" in r.stdout and "simulated: extension not built" in r.stdout
    assert r.stderr.count("native extension not loaded") == 1, r.stderr


def test_extension_without_quant_kernels_falls_back_or_raises(monkeypatch):
    import types

    from zero_kernels.ops import backends

    old = types.SimpleNamespace(has_cuda=lambda: False)  # a _C built before issue 22
    monkeypatch.setattr(native, "load", lambda: old)
    monkeypatch.setattr(backends, "_said", set())
    x = sample(100)
    want = ops.quantize_blockwise(x, backend="reference")
    got = ops.quantize_blockwise(x)  # auto: one logged line, then the reference
    assert_same(got[0], want[0], "fallback q")
    with pytest.raises(RuntimeError, match="rebuild"):
        ops.quantize_blockwise(x, backend="cpu")


def test_explicit_cuda_backend_on_cpu_raises():
    with pytest.raises((RuntimeError, ValueError), match="cuda"):
        ops.quantize_blockwise(sample(10), backend="cuda")


@needs_native
def test_native_binding_checks_sizes():
    # the binding re-checks what could read or write outside a tensor
    x = sample(100)
    with pytest.raises(RuntimeError, match="q.numel"):
        _C.quantize_blockwise(x, None, torch.empty(99, dtype=torch.uint8), torch.empty(7), 8, 16)
    with pytest.raises(ValueError, match="bits"):
        _C.quantize_blockwise(x, None, torch.empty(100, dtype=torch.uint8), torch.empty(7), 5, 16)
