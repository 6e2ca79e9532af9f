"""Checks of the quantized all-gather (issue 22, qwZ), run by tests/topology/test_quant_comm.py on
3 gloo
ranks: the collective itself at odd sizes and dtypes (own chunk exact, the others exactly the
kernel's round trip), and stage 3 with ``quantize_weights`` against the same run unquantized:
close, not equal (the quantizer is on the path), a quarter of the bytes, state dicts exact; the
quantized reduce-scatter (``quantize_grads``) the same way, and inf gradients still seen."""

from __future__ import annotations

import pytest
import torch
from dist_utils import run_checks
from numerics import rel_err
from torch import nn
from zero_opt import zero_opt


def check_all_gather_quantized(rank, world):
    from zero_kernels import comm
    from zero_kernels.ops import dequantize_blockwise, quantize_blockwise

    out = {}
    for c, dt, bits in ((1, torch.float32, 8), (257, torch.bfloat16, 8), (1000, torch.float32, 4)):
        chunks = [
            torch.randn(c, generator=torch.Generator().manual_seed(k)).to(dt) for k in range(world)
        ]
        full = torch.full((c * world,), float("nan"), dtype=dt)
        mine = full[rank * c : (rank + 1) * c]
        mine.copy_(chunks[rank])
        log = comm.CommLog()
        h = comm.quant.all_gather_quantized(full, mine, bits=bits, block=256, log=log)
        h.wait()
        for k in range(world):
            got = full[k * c : (k + 1) * c]
            if k == rank:
                assert torch.equal(got, chunks[k]), "own chunk not exact"
                continue
            q, s = quantize_blockwise(chunks[k].contiguous(), bits, 256)
            want = dequantize_blockwise(q, s, bits, 256, c, dtype=dt)
            assert torch.equal(got, want), (c, dt, bits, k)
        qb, ns = (c * bits + 7) // 8, (c + 255) // 256
        nq = (qb + 3) // 4 * 4  # the bytes, padded to 4, then the fp32 scales
        assert log.all_gather_calls == 1 and log.all_gather_bytes == world * (nq + 4 * ns), (
            log.all_gather_bytes
        )
        out[f"{c} {dt} int{bits}"] = log.all_gather_bytes
    return out


def _model():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 4)
    )


def _run(rank, dtype, **kw):
    m = _model().to(dtype)
    zo = zero_opt(m, torch.optim.AdamW, stage=3, units=[m[0], m[2], m[4]], lr=1e-2, **kw)
    losses = []
    for s in range(4):
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(10 * s + rank)).to(dtype)
        zo.zero_grad()
        loss = m(x).float().pow(2).mean()
        loss.backward()
        zo.step()
        losses.append(loss.item())
    return zo, m, losses


def check_stage3_int8_close_not_equal(rank, world):
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        za, ma, la = _run(rank, dtype)
        zb, mb, lb = _run(rank, dtype, quantize_weights="int8")
        d = max(
            rel_err(zb.full_param(p), za.full_param(q))
            for p, q in zip(mb.parameters(), ma.parameters())
        )
        # int8 blocks of 256: about 0.7% per element per gather; 4 AdamW steps (normalised
        # updates) measured 1.3e-2 (fp32) and 2.1e-2 (bf16) from the unquantized run
        assert 0 < d <= 4e-2, f"{dtype}: params {d:.3g} from the unquantized run"
        assert all(abs(a - b) <= 2e-2 * abs(a) for a, b in zip(la, lb)), (la, lb)
        ratio = zb.comm_stats["all_gather_bytes"] / za.comm_stats["all_gather_bytes"]
        per = 4 if dtype == torch.float32 else 2  # bytes per element unquantized
        # the biases, kept whole, are gathered exact once a step: at most their share more
        vec = sum(p.numel() for p in mb.parameters() if p.dim() == 1)
        share = vec / sum(p.numel() for p in mb.parameters())
        bound = (1 + 4 / 256 + 0.02) / per + share
        assert ratio <= bound, f"{dtype}: all-gather bytes {ratio:.3f}x > {bound:.3f}x"
        out[str(dtype)] = {"param_rel": d, "bytes_ratio": ratio}
        za.close()
        zb.close()
    return out


def check_vectors_kept_exact(rank, world):
    """quantize_weights: the forward sees the biases (1-D) exact, kept whole on every rank (the
    persistent unit), and the weight matrices quantized."""

    for dtype in (torch.float32, torch.bfloat16):
        m = _model().to(dtype)
        zo = zero_opt(
            m, torch.optim.AdamW, stage=3, units=[m[0], m[2], m[4]], lr=1e-2,
            quantize_weights="int8",
        )  # fmt: skip
        kept = zo.parts.core.units.persistent
        held = {id(p) for i, b in kept.buckets for p, _, _ in zo.parts.core.store.members[(i, b)]}
        assert held == {id(m[k].bias) for k in (0, 2, 4)}, "the biases, and only them"
        seen = {}
        m[2].register_forward_pre_hook(
            lambda mod, a, seen=seen: seen.update(
                w=mod.weight.detach().clone(), b=mod.bias.detach().clone()
            )
        )
        for s in range(3):
            x = torch.randn(8, 16, generator=torch.Generator().manual_seed(s + rank)).to(dtype)
            zo.zero_grad()
            m(x).float().pow(2).mean().backward()
            zo.step()
        m(x)  # the stepped values, as the forward sees them
        # (bf16 params: full_param is the fp32 master, the param its rounding)
        b = zo.full_param(m[2].bias).to(dtype)
        assert torch.equal(seen["b"], b), f"{dtype}: bias quantized"
        w = zo.full_param(m[2].weight).to(dtype)
        assert not torch.equal(seen["w"], w), f"{dtype}: weight not quantized"
        assert rel_err(seen["w"], w) <= 1e-2, f"{dtype}: weight {rel_err(seen['w'], w):.3g}"
        zo.close()
    return {}


def check_state_dict_exact(rank, world):
    """model.state_dict() and gathered_params hold the stepped values exactly."""
    zo, m, _ = _run(rank, torch.float32, quantize_weights="int8")
    sd = m.state_dict()
    names = dict(m.named_parameters())
    for k, p in names.items():
        assert torch.equal(sd[k], zo.full_param(p)), k
    with zo.gathered_params():
        for p in m.parameters():
            assert torch.equal(p.detach(), zo.full_param(p))
    zo.close()  # the params handed back exact too
    assert all(torch.equal(sd[k], p.detach()) for k, p in m.named_parameters())


def check_reduce_scatter_quantized(rank, world):
    """Each rank's output: its own chunk exact plus every other rank's chunk through the
    kernel's round trip, summed in fp32, averaged; odd sizes, bf16 input, int4."""
    from zero_kernels import comm
    from zero_kernels.ops import dequantize_blockwise, quantize_blockwise

    def data(k, c, dt):  # rank k's input
        return torch.randn(c * world, generator=torch.Generator().manual_seed(7 + k)).to(dt)

    for c, dt, bits in ((1, torch.float32, 8), (300, torch.bfloat16, 8), (513, torch.float32, 4)):
        inp = data(rank, c, dt)
        out = torch.empty(c, dtype=dt)
        log = comm.CommLog()
        comm.quant.reduce_scatter_quantized(out, inp, bits=bits, block=256, log=log).wait()
        # in the implementation's order: the own chunk, then the others by rank
        want = data(rank, c, dt)[rank * c : (rank + 1) * c].float()
        for k in range(world):
            if k != rank:
                piece = data(k, c, dt)[rank * c : (rank + 1) * c]
                q, s = quantize_blockwise(piece.contiguous(), bits, 256)
                want += dequantize_blockwise(q, s, bits, 256, c)
        assert torch.equal(out, (want / world).to(dt)), (c, dt, bits)
        assert log.reduce_scatter_calls == 1 and log.reduce_scatter_bytes < 4 * c * world + 64
    inplace = data(rank, 8, torch.float32)  # output = this rank's own chunk of the input
    own = inplace[rank * 8 : (rank + 1) * 8]
    comm.quant.reduce_scatter_quantized(own, inplace, bits=8, block=256).wait()
    assert torch.isfinite(own).all()


def check_vector_grads_exact(rank, world):
    """quantize_grads: the params of one dimension (the biases here) sit in buckets of their
    own, reduced exact: their gradients equal the unquantized run's to fp32 rounding, the
    weights' do not (stages 2 and 3)."""

    for stage in (2, 3):
        grads = []
        for qg in (None, "int4"):
            m = _model()
            kw = {"units": [m[0], m[2], m[4]]} if stage == 3 else {"bucket_size_mb": 0.005}
            zo = zero_opt(m, torch.optim.AdamW, stage=stage, quantize_grads=qg, **kw)
            if qg is not None:  # int4 gradients: one scale per 32 elements
                assert zo.parts.core.reducer.quantize == (4, 32), zo.parts.core.reducer.quantize
            x = torch.randn(8, 16, generator=torch.Generator().manual_seed(3 + rank))
            m(x).pow(2).mean().backward()
            grads.append({n: zo.full_grad(p).clone() for n, p in m.named_parameters()})
            if qg is not None:
                exact = zo.parts.core.reducer.exact_buckets
                assert exact, f"stage {stage}: no bucket left exact"
            zo.close()
        for n in grads[0]:  # (another bucket: perhaps another sum order, so not bitwise)
            d = rel_err(grads[1][n], grads[0][n])
            assert (d <= 1e-6) == n.endswith("bias"), f"stage {stage}: {n} rel. error {d:.3g}"
    # stage 3 with a small matrix kept whole beside the vectors (persist_below): that bucket is
    # reduced exact too, so the vectors never meet the quantizer
    grads = []
    for qg in (None, "int4"):
        m = _model()
        zo = zero_opt(
            m, torch.optim.AdamW, stage=3, units=[m[0], m[2], m[4]], persist_below=300,
            quantize_grads=qg,
        )  # fmt: skip
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(3 + rank))
        m(x).pow(2).mean().backward()
        grads.append({n: zo.full_grad(p).clone() for n, p in m.named_parameters()})
        zo.close()
    for n in grads[0]:  # 4.weight: 256 elements, below 300
        d = rel_err(grads[1][n], grads[0][n])
        want = n.endswith("bias") or n == "4.weight"
        assert (d <= 1e-6) == want, f"persist_below: {n} rel. error {d:.3g}"
    return {}


def _run2(rank, **kw):
    m = _model()
    zo = zero_opt(m, torch.optim.AdamW, stage=2, lr=1e-2, bucket_size_mb=0.005, **kw)
    for s in range(4):
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(10 * s + rank))
        zo.zero_grad()
        m(x).pow(2).mean().backward()
        zo.step()
    return zo, m


def check_quantized_grads_train(rank, world):
    """Stages 1 and 2 with quantize_grads="int8": close to the unquantized run, not equal; a
    quarter of the reduce-scatter bytes; an inf gradient on one rank still skips the step."""

    out = {}
    za, ma = _run2(rank)
    zb, mb = _run2(rank, quantize_grads="int8")
    d = max(
        rel_err(zb.full_param(p), za.full_param(q))
        for p, q in zip(mb.parameters(), ma.parameters())
    )
    assert 0 < d <= 4e-2, f"params {d:.3g} from the unquantized run"
    ratio = zb.comm_stats["reduce_scatter_bytes"] / za.comm_stats["reduce_scatter_bytes"]
    assert ratio <= 0.30, ratio
    out["stage 2"] = {"param_rel": d, "bytes_ratio": ratio}
    za.close()
    zb.close()
    m = _model()
    zo = zero_opt(m, torch.optim.AdamW, stage=1, quantize_grads="int8", nonfinite="skip", lr=1e-2)
    _inf_skips(zo, m, rank, world, "the quantizer")
    return out


def _inf_skips(zo, m, rank, world, what) -> None:
    """An inf gradient on the last rank: the step is skipped everywhere, nothing changes."""
    before = [p.detach().clone() for p in m.parameters()]
    loss = m(torch.randn(8, 16)).pow(2).mean() * (float("inf") if rank == world - 1 else 1.0)
    loss.backward()
    zo.step()
    assert zo.skipped_steps == 1, f"an inf gradient was hidden by {what}"
    assert all(torch.equal(a, p.detach()) for a, p in zip(before, m.parameters()))
    zo.close()


def check_bad_values(rank, world):
    with pytest.raises(ValueError, match="quantize_weights='int8' is a stage-3 option"):
        zero_opt(_model(), torch.optim.AdamW, stage=2, quantize_weights="int8", lr=1e-3)
    with pytest.raises(ValueError, match="quantize_weights='int3'"):
        zero_opt(_model(), torch.optim.AdamW, stage=3, quantize_weights="int3", lr=1e-3)
    with pytest.raises(ValueError, match="quantize_grads='int2'"):
        zero_opt(_model(), torch.optim.AdamW, stage=3, quantize_grads="int2", lr=1e-3)


def check_two_hop_quantized(rank, world):
    """quantize_grads with hierarchical sharding ([Note: quantized two-hop]): shard groups of
    1 rank, so every rank is a replica and the whole reduction is the quantized hop across the
    replicas. Every rank ends with the same params (the replicas stay equal, bit for bit),
    close to the unquantized hierarchical run and not equal to it; the replica all-reduce's
    bytes about a quarter of fp32's (int8); an inf gradient on one rank still skips the step."""
    import torch.distributed as dist

    out = {}
    for stage in (1, 2):
        runs = {}
        for q in (None, "int8"):
            m = _model()
            zo = zero_opt(
                m, torch.optim.AdamW, stage=stage, lr=1e-2, bucket_size_mb=0.005,
                shard_group=1, quantize_grads=q,
            )  # fmt: skip
            for s in range(4):
                x = torch.randn(8, 16, generator=torch.Generator().manual_seed(10 * s + rank))
                zo.zero_grad()
                m(x).pow(2).mean().backward()
                zo.step()
            flat = torch.cat([zo.full_param(p).reshape(-1) for p in m.parameters()])
            got = [torch.empty_like(flat) for _ in range(world)]
            dist.all_gather(got, flat)
            assert all(torch.equal(g, got[0]) for g in got), f"stage {stage} q={q}: replicas differ"
            runs[q] = (flat, zo.comm_stats["replica_all_reduce_bytes"])
            zo.close()
        d = rel_err(runs["int8"][0], runs[None][0])
        assert 0 < d <= 4e-2, f"stage {stage}: {d:.3g} from the unquantized run"
        ratio = runs["int8"][1] / runs[None][1]
        assert 0.2 <= ratio <= 0.3, ratio
        out[f"stage {stage}"] = {"param_rel": d, "replica_bytes_ratio": ratio}
    m = _model()
    zo = zero_opt(
        m, torch.optim.AdamW, stage=2, shard_group=1, quantize_grads="int4",
        nonfinite="skip", lr=1e-2,
    )  # fmt: skip
    _inf_skips(zo, m, rank, world, "the two-hop quantizer")
    return out


def check_error_feedback(rank, world):
    """grad_error_feedback ([Note: error feedback]): the same gradient reduced T times through
    int4, with feedback the mean of the T results is within about 1/T of one result's error of
    the exact mean (without it, every result has the same error, so their mean too); through
    ZeroOptimizer (one hop and two-hop) the replicas stay equal, the buffers are counted and a
    skipped step zeroes them; without quantize_grads it is refused."""
    import torch.distributed as dist

    from zero_kernels import comm

    c, T = 1000, 16
    inp = torch.randn(c * world, generator=torch.Generator().manual_seed(3 + rank))
    exact = inp.clone()
    dist.all_reduce(exact)
    exact = exact[rank * c : (rank + 1) * c] / world
    errs = {}
    for fb in (False, True):
        errors = {} if fb else None
        acc, outs = torch.zeros(c), []
        for _ in range(T):
            out = torch.empty(c)
            comm.quant.reduce_scatter_quantized(out, inp, bits=4, block=256, errors=errors).wait()
            acc += out
            outs.append(out)
        first = outs[0]
        errs[fb] = ((acc / T - exact).norm() / exact.norm()).item()
        errs[f"{fb} one"] = ((first - exact).norm() / exact.norm()).item()
    assert errs["False one"] > 1e-3 and errs[False] == pytest.approx(errs["False one"], rel=1e-5)
    assert errs[True] <= 3 * errs["True one"] / T, errs
    for sg in ("world", 1):
        m = _model()
        zo = zero_opt(
            m, torch.optim.AdamW, stage=2, lr=1e-2, bucket_size_mb=0.005, shard_group=sg,
            quantize_grads="int8", grad_error_feedback=True, nonfinite="skip",
        )  # fmt: skip
        for s in range(3):
            x = torch.randn(8, 16, generator=torch.Generator().manual_seed(10 * s + rank))
            zo.zero_grad()
            m(x).pow(2).mean().backward()
            zo.step()
        rep = zo.memory_report()
        assert rep["comm_error_feedback_bytes"] > 0, rep
        bufs = [t for d in zo.parts.core.reducer.errors.values() for t in d.values()]
        assert any(t.abs().sum() > 0 for t in bufs)
        if sg == 1:  # replicas: every rank the same params
            flat = torch.cat([zo.full_param(p).reshape(-1) for p in m.parameters()])
            got = [torch.empty_like(flat) for _ in range(world)]
            dist.all_gather(got, flat)
            assert all(torch.equal(g, got[0]) for g in got), "replicas differ with feedback"
        zo.zero_grad()
        loss = m(torch.randn(8, 16)).pow(2).mean()
        (loss * (float("inf") if rank == 0 else 1.0)).backward()
        zo.step()
        assert zo.skipped_steps == 1 and all(t.abs().sum() == 0 for t in bufs)
        zo.close()
    with pytest.raises(ValueError, match="grad_error_feedback=True keeps what quantize_grads"):
        zero_opt(_model(), torch.optim.AdamW, stage=2, grad_error_feedback=True, lr=1e-3)
    return {"mean_err_no_feedback": errs[False], "mean_err_feedback": errs[True]}


CHECKS = [
    check_all_gather_quantized,
    check_stage3_int8_close_not_equal,
    check_state_dict_exact,
    check_vectors_kept_exact,
    check_reduce_scatter_quantized,
    check_vector_grads_exact,
    check_quantized_grads_train,
    check_two_hop_quantized,
    check_error_feedback,
    check_bad_values,
]


def worker(rank, world):
    return run_checks(rank, world, CHECKS)
