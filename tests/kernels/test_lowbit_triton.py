"""The Triton low-bit-state Adam step against the pure-torch reference.

On a CPU machine the kernels run under Triton's interpreter (conftest sets TRITON_INTERPRET=1) on
small sizes; with TRITON_INTERPRET=0 and a GPU (bench/gpu_check.sh) the same tests run the
compiled kernels on CUDA tensors. Each step starts both backends from the same state: after the
comparison the reference's params and state are copied into the Triton copies, so a code that
rounds the other way at a tie is seen once and does not compound. What is compared:

- params: fp32, within a few ulps (the backends may order or fuse an operation differently);
- codes: equal except +-1 on a tiny fraction (an m or u that lands within an ulp of a rounding
  boundary); scales within rtol 1e-5, NaN where the reference has NaN;
- bf16 moments: equal except one bf16 ulp on a tiny fraction.

The format under test: `zero_kernels.ops.lowbit` [Note: low-bit state].
"""

from __future__ import annotations

import os

import pytest
import torch

from zero_kernels.ops import lowbit
from zero_kernels.ops.hyper import AdamHyper

try:
    import triton  # noqa: F401

    from zero_kernels.ops import triton_lowbit  # noqa: F401

    TRITON_ERROR = None
except Exception as e:  # ImportError, or triton present but broken
    TRITON_ERROR = e

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRET else "cuda"

# the interpreter's numpy warns on the NaN block's products and the zero block's c^2 / 0
pytestmark = [
    pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning"),
    pytest.mark.skipif(TRITON_ERROR is not None, reason=f"triton does not import: {TRITON_ERROR}"),
    pytest.mark.skipif(
        not INTERPRET and not torch.cuda.is_available(),
        reason="Triton needs a GPU or TRITON_INTERPRET=1",
    ),
]

LR = 1e-2
# (adamw, weight_decay, maximize, grad_scale)
VARIANTS = [(True, 0.1, False, 1.0), (False, 0.01, False, 0.5), (True, 0.0, True, 1.0)]
CODE_FRACTION = 0.01  # codes (or bf16 moments) allowed one step apart


def hyper(step: int, adamw: bool, wd: float, maximize: bool, grad_scale: float) -> AdamHyper:
    return AdamHyper(
        lr=LR,
        beta1=0.9,
        beta2=0.999,
        eps=1e-8,
        weight_decay=wd,
        step=step,
        adamw=adamw,
        maximize=maximize,
        grad_scale=grad_scale,
    )


def make_grad(n: int, block: int, step: int, dtype, seed: int) -> torch.Tensor:
    """Heavy-tailed grads: magnitudes over six decades, so u spans ~1e9 within a block (small v
    codes round up to 1, never to 0); block 0 is all zero at step 1 (scale 0, codes 0)."""
    gen = torch.Generator().manual_seed(1000 * seed + step)
    g = torch.randn(n, generator=gen)
    g *= 10.0 ** torch.randint(-4, 3, (n,), generator=gen).float()
    if step == 1:
        g[:block] = 0.0
    return g.to(dtype)


def clone_state(state: dict, device) -> dict:
    return {k: t.detach().clone().to(device) for k, t in state.items()}


def assert_codes_close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    d = (got.to(torch.int32) - want.to(torch.int32)).abs()
    assert int(d.max()) <= 1, f"{what}: codes {int(d.max())} apart"
    off = int((d != 0).sum())
    assert off <= max(1, CODE_FRACTION * got.numel()), f"{what}: {off}/{got.numel()} codes differ"


def assert_scales_close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert torch.equal(got.isnan(), want.isnan()), f"{what}: NaN scales differ"
    torch.testing.assert_close(got, want, rtol=1e-5, atol=0.0, equal_nan=True, msg=what)


def assert_bf16_close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    g, w = got.float(), want.float()
    torch.testing.assert_close(g, w, rtol=2**-7, atol=0.0, equal_nan=True, msg=what)
    off = int(((g != w) & ~(g.isnan() & w.isnan())).sum())
    assert off <= max(1, CODE_FRACTION * g.numel()), f"{what}: {off}/{g.numel()} values differ"


def compare(got_p, got_s, want_p, want_s, state_dtype: str, what: str) -> None:
    torch.testing.assert_close(
        got_p.cpu(), want_p.cpu(), rtol=4e-6, atol=1e-5 * LR, equal_nan=True, msg=what
    )
    for k in lowbit.STATE_KEYS[state_dtype]:
        g, w = got_s[k].cpu(), want_s[k].cpu()
        assert g.dtype == w.dtype and g.shape == w.shape, f"{what} {k}"
        if k.endswith("_scale"):
            assert_scales_close(g, w, f"{what} {k}")
        elif state_dtype == "int8":
            assert_codes_close(g, w, f"{what} {k}")
        else:
            assert_bf16_close(g, w, f"{what} {k}")


def run_steps(
    backend: str,
    device,
    n: int,
    block: int,
    state_dtype: str,
    grad_dtype,
    out_dtype,
    variant,
    steps: int = 3,
    seed: int = 0,
    nan_at: int | None = None,
) -> None:
    """``steps`` steps of ``backend`` against the reference (CPU), compared after each."""
    gen = torch.Generator().manual_seed(seed)
    want_p = torch.randn(n, generator=gen)
    want_s = lowbit.new_state(n, state_dtype, block, "cpu")
    for step in range(1, steps + 1):
        h = hyper(step, *variant)
        g = make_grad(n, block, step, grad_dtype, seed)
        if nan_at is not None and step == steps:
            g[nan_at] = float("nan")
        got_p, got_s = want_p.clone().to(device), clone_state(want_s, device)
        want_out = None if out_dtype is None else torch.empty(n, dtype=out_dtype)
        got_out = None if out_dtype is None else torch.empty(n, dtype=out_dtype, device=device)
        kw = dict(state_dtype=state_dtype, block=block)
        lowbit.adam_step_lowbit(want_p, g, want_s, h, out_lowp=want_out, backend="reference", **kw)
        lowbit.adam_step_lowbit(
            got_p, g.to(device), got_s, h, out_lowp=got_out, backend=backend, **kw
        )
        what = f"{backend} {state_dtype} n={n} block={block} g={grad_dtype} {variant} step {step}"
        compare(got_p, got_s, want_p, want_s, state_dtype, what)
        if out_dtype is not None:
            torch.testing.assert_close(
                got_out.cpu().float(), want_out.float(), rtol=2**-7, atol=1e-6, msg=what
            )


@pytest.mark.parametrize("state_dtype", ["int8", "bf16"])
@pytest.mark.parametrize("block", [64, 128])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("out_dtype", [None, torch.bfloat16])
def test_triton_matches_reference(state_dtype, block, grad_dtype, out_dtype):
    n = 3 * block + block // 2 + 5  # three whole blocks and a partial one
    for i, variant in enumerate(VARIANTS):
        run_steps("triton", DEVICE, n, block, state_dtype, grad_dtype, out_dtype, variant, seed=i)


@pytest.mark.parametrize("state_dtype", ["int8", "bf16"])
def test_triton_fp16_grad_odd_block(state_dtype):
    # a block that is not a power of two (the program's lanes are masked), fp16 grad and out
    run_steps(
        "triton", DEVICE, 2 * 192 + 1, 192, state_dtype, torch.float16, torch.float16, VARIANTS[0]
    )


def test_triton_nan_grad_block_stores_nan_scale():
    block, n = 64, 4 * 64 + 9
    # without check_finite the NaN goes through: its block's scales NaN, codes 0, the others fine
    run_steps(
        "triton", DEVICE, n, block, "int8", torch.float32, None, VARIANTS[0], nan_at=block + 3
    )
    # and directly, so the rule is checked even if the reference were to change
    p = torch.randn(n, device=DEVICE)
    s = lowbit.new_state(n, "int8", block, DEVICE)
    g = torch.randn(n, device=DEVICE)
    g[block + 3] = float("nan")
    lowbit.adam_step_lowbit(
        p, g, s, hyper(1, *VARIANTS[0]), state_dtype="int8", block=block, backend="triton"
    )
    for k in ("exp_avg_scale", "exp_avg_sq_scale"):
        assert s[k].isnan().tolist() == [False, True, False, False, False], k
    assert (
        not s["exp_avg"][block : 2 * block].any() and not s["exp_avg_sq"][block : 2 * block].any()
    )
    assert (s["exp_avg_sq"][:block] > 0).all()  # v > 0 never stores code 0


def test_triton_check_finite_skips():
    block, n = 64, 3 * 64 + 1
    p = torch.randn(n, device=DEVICE)
    s = lowbit.new_state(n, "int8", block, DEVICE)
    p0, s0 = p.clone(), clone_state(s, DEVICE)
    g = torch.randn(n, device=DEVICE)
    g[-1] = float("inf")
    kw = dict(state_dtype="int8", block=block, backend="triton")
    found = lowbit.adam_step_lowbit(p, g, s, hyper(1, *VARIANTS[0]), check_finite=True, **kw)
    assert found.item() == 1.0
    # a set found_inf skips the next call too
    lowbit.adam_step_lowbit(p, g.nan_to_num(), s, hyper(1, *VARIANTS[0]), found_inf=found, **kw)
    assert torch.equal(p, p0) and all(torch.equal(s[k], s0[k]) for k in s)
