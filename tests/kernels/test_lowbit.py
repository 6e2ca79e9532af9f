"""Low-bit optimizer state (ops/lowbit.py [Note: low-bit state]): the format's round trip, the
native CPU step of every instruction set against the torch reference, the non-finite rules, the
argument errors, and FusedAdamW(state_dtype=...) as a drop-in optimizer."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from zero_kernels import FusedAdamW, native
from zero_kernels.ops import AdamHyper, lowbit

_C = native.load()
needs_native = pytest.mark.skipif(_C is None, reason="native extension not built")


def cpu_isas() -> list[str]:
    if _C is None:
        return []
    order = ["scalar", "avx2", "avx512"]
    _C.set_cpu_isa("auto")
    return order[: order.index(_C.cpu_isa()) + 1]


def hyper(step: int, **kw) -> AdamHyper:
    base = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, adamw=True)
    base.update(kw)
    return AdamHyper(step=step, **base)


def test_encode_decode_round_trip_error_bounds():
    torch.manual_seed(0)
    n, block = 5000, 256  # a partial last block
    m = torch.randn(n) * torch.logspace(-6, 0, n)[torch.randperm(n)]
    v = torch.rand(n) ** 4 * 1e-4
    v[:300] = 0.0  # v == 0 must stay 0; tiny v must not
    v[300] = 1e-30
    st = lowbit.new_state(n, "int8", block, "cpu")
    lowbit.encode_state(m, v, "int8", block, st)
    m2, v2 = lowbit.decode_state(st, "int8", block)
    pad = torch.nn.functional.pad(m, (0, -n % block))
    rows = pad.view(-1, block)
    amax = rows.abs().amax(1).repeat_interleave(block)[:n]
    # square-law codes: |m - m2| <= (2|q| + 1) / 2 * s  with s = amax / 127^2
    q = st["exp_avg"].float()
    assert bool(((m - m2).abs() <= (q.abs() + 0.5) * amax / 127**2 * 1.0001 + 1e-30).all())
    assert bool((torch.sign(m2) * torch.sign(m) >= 0).all()), "a code flipped a sign"
    assert bool((v2[:300] == 0).all())
    assert bool((v2[300:] > 0).all()), "a non-zero v decoded to 0 (the zero-point problem)"
    # the largest element of each block decodes exactly to its block max
    i = rows.abs().argmax(1)[0].item()
    assert m2[i].item() == pytest.approx(m[i].item(), rel=1e-6)
    # bf16: round to nearest
    sb = lowbit.new_state(n, "bf16", block, "cpu")
    lowbit.encode_state(m, v, "bf16", block, sb)
    assert torch.equal(sb["exp_avg"], m.bfloat16())


@needs_native
@pytest.mark.parametrize("fmt", ["bf16", "int8"])
def test_native_step_matches_reference_every_isa(fmt):
    """Five steps on 3 full blocks + a partial one, grads fp32 and bf16, bf16 copy-out, each
    instruction set against the reference: params within a fraction of one update, codes equal
    but for rounding-boundary neighbours (the kernels fuse a*b + c where torch rounds twice)."""
    n, block = 3 * 256 + 77, 256
    try:
        for isa in cpu_isas():
            _C.set_cpu_isa(isa)
            for gdt in (torch.float32, torch.bfloat16):
                gen = torch.Generator().manual_seed(1)
                p = torch.randn(n, generator=gen)
                st = lowbit.new_state(n, fmt, block, "cpu")
                p_ref, st_ref = p.clone(), {k: t.clone() for k, t in st.items()}
                out = torch.empty(n, dtype=torch.bfloat16)
                for step in range(1, 6):
                    g = (torch.randn(n, generator=gen) * 1e-2).to(gdt)
                    h = hyper(step, adamw=step % 2 == 1)  # Adam (L2) and AdamW
                    kw = dict(state_dtype=fmt, block=block)
                    lowbit.adam_step_lowbit(p, g, st, h, out_lowp=out, backend="cpu", **kw)
                    lowbit.adam_step_lowbit(p_ref, g, st_ref, h, backend="reference", **kw)
                what = f"{fmt}/{isa}/{gdt}"
                assert (p - p_ref).abs().max().item() < 1e-4, what  # updates are ~1e-3
                assert torch.equal(out, p.bfloat16()), what
                for k in lowbit.STATE_KEYS[fmt]:
                    a, e = st[k].float(), st_ref[k].float()
                    if k.endswith("_scale"):
                        assert torch.allclose(a, e, rtol=1e-4, atol=0), f"{what} {k}"
                    else:
                        d = (a - e).abs()
                        tol = 1.0 if fmt == "int8" else 2**-7 * e.abs().max().item()
                        assert d.max().item() <= tol, f"{what} {k}"
                        assert (d > 0).float().mean().item() < 0.01, f"{what} {k}"
    finally:
        _C.set_cpu_isa("auto")


@needs_native
def test_nonfinite_rules_and_skips():
    n, block = 512, 256
    p = torch.randn(n)
    g = torch.randn(n) * 1e-2
    st = lowbit.new_state(n, "int8", block, "cpu")
    lowbit.adam_step_lowbit(p, g, st, hyper(1), state_dtype="int8", backend="cpu")
    before = (p.clone(), {k: t.clone() for k, t in st.items()})
    bad = g.clone()
    bad[300] = float("nan")
    # check_finite: a NaN grad sets found_inf and nothing is written
    found = lowbit.adam_step_lowbit(
        p, bad, st, hyper(2), state_dtype="int8", check_finite=True, backend="cpu"
    )
    assert found.item() == 1.0
    assert torch.equal(p, before[0]) and all(torch.equal(st[k], before[1][k]) for k in st)
    # a found_inf already set (another rank overflowed) skips too
    lowbit.adam_step_lowbit(
        p, g, st, hyper(2), state_dtype="int8", found_inf=torch.ones(1), backend="cpu"
    )
    assert torch.equal(p, before[0])
    # without the check the NaN block's state stays non-finite (scale NaN, codes 0), as fp32
    # state would; the other block is untouched by it
    for backend in ("cpu", "reference"):
        p2, st2 = before[0].clone(), {k: t.clone() for k, t in before[1].items()}
        lowbit.adam_step_lowbit(p2, bad, st2, hyper(2), state_dtype="int8", backend=backend)
        assert math.isnan(st2["exp_avg_scale"][1].item()), backend
        assert math.isnan(st2["exp_avg_sq_scale"][1].item()), backend  # both, as one block
        assert math.isfinite(st2["exp_avg_scale"][0].item()), backend
        assert bool((st2["exp_avg"][256:] == 0).all()), backend
        m, _ = lowbit.decode_state(st2, "int8", block)
        assert bool(m[256:].isnan().all()) and bool(m[:256].isfinite().all()), backend


def test_errors_name_the_argument():
    p = torch.zeros(256)
    st = lowbit.new_state(256, "int8", 256, "cpu")
    with pytest.raises(ValueError, match="state_dtype must be one of"):
        lowbit.adam_step_lowbit(p, p, st, hyper(1), state_dtype="int4")
    with pytest.raises(ValueError, match="state_block must be a multiple of 64"):
        lowbit.adam_step_lowbit(p, p, st, hyper(1), state_dtype="int8", block=100)
    with pytest.raises(ValueError, match=r"state\['exp_avg_scale'\] must be 2 contiguous"):
        lowbit.adam_step_lowbit(p, p, st, hyper(1), state_dtype="int8", block=128)
    with pytest.raises(TypeError, match="fp32"):
        lowbit.adam_step_lowbit(p.bfloat16(), p, st, hyper(1), state_dtype="int8")
    with pytest.raises(ValueError, match="amsgrad"):
        lowbit.adam_step_lowbit(p, p, st, hyper(1, amsgrad=True), state_dtype="int8")
    with pytest.raises(ValueError, match="amsgrad"):
        FusedAdamW([torch.nn.Parameter(p)], amsgrad=True, state_dtype="bf16")
    with pytest.raises(ValueError, match="state_dtype must be one of"):
        FusedAdamW([torch.nn.Parameter(p)], state_dtype="fp8")


def _train(opt_fn, steps=60, seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.GELU(), torch.nn.Linear(128, 8))
    x, y = torch.randn(128, 32), torch.randint(0, 8, (128,))
    opt = opt_fn(model.parameters())
    losses = []
    for _ in range(steps):
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return model, opt, losses


def test_fused_adamw_state_dtype_trains_and_round_trips():
    """bf16 and int8 state train like fp32 state (small MLP, 60 steps); the state_dict loads
    back bit for bit and resumes identically; fp32_state_dict loads into torch's AdamW; a
    torch-format state loads into an int8 optimizer."""
    kw = dict(lr=3e-3, min_lowbit_numel=1024)
    _, _, ref = _train(lambda ps: torch.optim.AdamW(ps, lr=3e-3))
    for fmt in ("bf16", "int8"):
        model, opt, losses = _train(lambda ps, f=fmt: FusedAdamW(ps, state_dtype=f, **kw))
        assert all(math.isfinite(v) for v in losses)
        assert abs(losses[-1] - ref[-1]) <= 0.05 * ref[-1] + 1e-3, (fmt, losses[-1], ref[-1])
        big = [p for p in model.parameters() if p.numel() >= 1024]
        st = opt.state[big[0]]
        want = torch.bfloat16 if fmt == "bf16" else torch.int8
        assert st["exp_avg"].dtype == want, fmt
        small = [p for p in model.parameters() if p.numel() < 1024]
        assert opt.state[small[0]]["exp_avg"].dtype == torch.float32, "small tensors stay fp32"
        # round trip: a second optimizer resumes exactly where the first is
        m2 = copy.deepcopy(model)
        o2 = FusedAdamW(m2.parameters(), state_dtype=fmt, **kw)
        o2.load_state_dict(copy.deepcopy(opt.state_dict()))
        for p, q in zip(model.parameters(), m2.parameters()):
            for k, t in opt.state[p].items():
                if torch.is_tensor(t):
                    assert torch.equal(t, o2.state[q][k]), (fmt, k)
        x = torch.randn(4, 32)
        for mm, oo in ((model, opt), (m2, o2)):
            oo.zero_grad()
            mm(x).square().sum().backward()
            oo.step()
        for p, q in zip(model.parameters(), m2.parameters()):
            assert torch.equal(p, q), fmt
        # export for a plain torch optimizer, and import from one
        t_opt = torch.optim.AdamW(copy.deepcopy(model).parameters(), lr=3e-3)
        t_opt.load_state_dict(opt.fp32_state_dict())
        m_dec = next(iter(t_opt.state.values()))["exp_avg"]
        assert m_dec.dtype == torch.float32 and m_dec.shape == big[0].shape
        o3 = FusedAdamW(copy.deepcopy(model).parameters(), state_dtype="int8", **kw)
        o3.load_state_dict(t_opt.state_dict())
        st3 = next(s for s in o3.state.values() if s["exp_avg"].dtype == torch.int8)
        assert st3["exp_avg_scale"].numel() == math.ceil(big[0].numel() / 256)
        # into an optimizer that keeps fp32 state (state_dtype fp32): decoded, param-shaped
        o4 = FusedAdamW(copy.deepcopy(model).parameters(), lr=3e-3)
        o4.load_state_dict(copy.deepcopy(opt.state_dict()))
        st4 = next(iter(o4.state.values()))
        assert st4["exp_avg"].dtype == torch.float32 and st4["exp_avg"].shape == big[0].shape
        ref_m = next(iter(t_opt.state.values()))["exp_avg"]
        assert torch.equal(st4["exp_avg"], ref_m), fmt


def piece_blocks(sizes: list[int], block: int) -> tuple[torch.Tensor, dict]:
    """The block table of consecutive pieces of ``sizes`` (blocks from each piece's start, as
    a sharded step lays them) and zero int8 state over it."""
    starts = [0]
    for s in sizes:
        for off in range(0, s, block):
            starts.append(starts[-1] + min(block, s - off))
    starts = torch.tensor(starts, dtype=torch.int64)
    n, nb = sum(sizes), starts.numel() - 1
    st = {
        "exp_avg": torch.zeros(n, dtype=torch.int8),
        "exp_avg_sq": torch.zeros(n, dtype=torch.uint8),
        "exp_avg_scale": torch.zeros(nb),
        "exp_avg_sq_scale": torch.zeros(nb),
    }
    return starts, st


@needs_native
def test_block_starts_follow_pieces():
    """Blocks given by a table (a sharded step's pieces): the native step equals the reference
    on the same table, and each piece's codes and scales equal those of the piece stepped alone
    (blocks never span two pieces)."""
    sizes = [300, 64, 1000, 5]
    block = 256
    starts, st = piece_blocks(sizes, block)
    n = sum(sizes)
    gen = torch.Generator().manual_seed(3)
    p = torch.randn(n, generator=gen)
    p_ref, st_ref = p.clone(), {k: t.clone() for k, t in st.items()}
    alone = [
        (p[a : a + s].clone(), lowbit.new_state(s, "int8", block, "cpu"))
        for a, s in zip([0, 300, 364, 1364], sizes)
    ]
    for step in range(1, 4):
        g = torch.randn(n, generator=gen) * 1e-2
        kw = dict(state_dtype="int8", block=block, block_starts=starts)
        lowbit.adam_step_lowbit(p, g, st, hyper(step), backend="cpu", **kw)
        lowbit.adam_step_lowbit(p_ref, g, st_ref, hyper(step), backend="reference", **kw)
        a = 0
        for (pp, ss), s in zip(alone, sizes):
            lowbit.adam_step_lowbit(
                pp, g[a : a + s], ss, hyper(step), state_dtype="int8", backend="cpu"
            )
            a += s
    assert (p - p_ref).abs().max().item() < 1e-4
    assert torch.equal(torch.cat([pp for pp, _ in alone]), p)
    assert torch.equal(torch.cat([ss["exp_avg"] for _, ss in alone]), st["exp_avg"])
    assert torch.equal(
        torch.cat([ss["exp_avg_sq_scale"] for _, ss in alone]), st["exp_avg_sq_scale"]
    )
    with pytest.raises(ValueError, match="block_starts must be int64 from 0"):
        bad = starts.clone()
        bad[1] = 0
        lowbit.adam_step_lowbit(p, g, st, hyper(4), state_dtype="int8", block_starts=bad)
