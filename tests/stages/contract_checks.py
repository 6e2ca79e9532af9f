"""Checks of the script contract (issue 8): an ordinary training script gets DDP's result or a
clear error. Run on spawned gloo ranks by tests/stages/test_script_contract.py: each ``check_*``
function
is one concern, `contract_all` runs them all in one spawned group (dist_utils.run_checks)."""

from __future__ import annotations

import contextlib
import copy
import gc
import time

import torch
import torch.distributed as dist
from dist_utils import run_checks
from numerics import assert_params_close, rel_err
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from zero_opt import zero_opt

from zero_kernels import ZeroOptimizer
from zero_kernels.partition.grads import ShardedGrad, ShardedGradError

O = torch.optim


def _model(seed: int = 0, dtype=torch.float32) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(8, 24), nn.Tanh(), nn.Linear(24, 24), nn.Tanh(), nn.Linear(24, 3)
    ).to(dtype)


def _x(rank: int, step: int, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(6, 8, generator=torch.Generator().manual_seed(1000 * step + rank)).to(dtype)


def _pair(stage, cls=O.AdamW, dtype=torch.float32, zkw=None, **kw):
    base = _model(dtype=dtype)
    m1, m2 = copy.deepcopy(base), copy.deepcopy(base)
    kw = kw or {"lr": 1e-2, "weight_decay": 0.1}
    zo = zero_opt(m1, cls, stage=stage, bucket_size_mb=0.001, **(zkw or {}), **kw)
    ddp = DDP(m2, find_unused_parameters=True)
    to = cls(m2.parameters(), **kw)
    return m1, m2, zo, ddp, to


# ------------------------------------------------------------------ torch's tools on sharded grads


def check_torch_clip_and_zero_grad(rank: int, world: int) -> dict:
    """torch.nn.utils.clip_grad_norm_ over model.parameters() (p = 2, inf, 1) and
    model.zero_grad() (both ways): DDP's norms and result."""
    for stage in (1, 2):
        for norm_type, set_to_none in ((2.0, True), (float("inf"), False), (1.0, True)):
            m1, m2, zo, ddp, to = _pair(stage)
            for step in range(4):
                m1.zero_grad(set_to_none=set_to_none)
                m2.zero_grad(set_to_none=set_to_none)
                m1(_x(rank, step)).pow(2).mean().backward()
                ddp(_x(rank, step)).pow(2).mean().backward()
                n1 = torch.nn.utils.clip_grad_norm_(m1.parameters(), 0.02, norm_type)
                n2 = torch.nn.utils.clip_grad_norm_(m2.parameters(), 0.02, norm_type)
                assert abs(float(n1) - float(n2)) <= 1e-5 * float(n2), (norm_type, n1, n2)
                assert float(n1) > 0
                zo.step()
                to.step()
            assert_params_close(m1, m2, 1e-6, f"clip_grad_norm_ p={norm_type} stage={stage}")
            zo.close()
    return {}


def check_clip_value_and_detach(rank: int, world: int) -> dict:
    """torch.nn.utils.clip_grad_value_ (foreach and per tensor) and norms of p.grad.detach() /
    p.grad.data (Lightning's grad_norm reads them): DDP's values and result. Before, clamp_ was
    refused and detach raised "Boolean value of Tensor with more than one value is
    ambiguous"."""
    out = {}
    for stage in (1, 2):
        for foreach in (True, False):
            m1, m2, zo, ddp, to = _pair(stage)
            for step in range(3):
                for m in (m1, m2):
                    m.zero_grad()
                m1(_x(rank, step)).pow(2).mean().backward()
                ddp(_x(rank, step)).pow(2).mean().backward()
                for (n, p), q in zip(m1.named_parameters(), m2.parameters()):
                    for a, b in ((p.grad.detach(), q.grad.detach()), (p.grad.data, q.grad.data)):
                        na, nb = float(a.norm()), float(b.norm())
                        assert abs(na - nb) <= 1e-5 * nb + 1e-12, (stage, n, na, nb)
                torch.nn.utils.clip_grad_value_(m1.parameters(), 2e-3, foreach=foreach)
                torch.nn.utils.clip_grad_value_(m2.parameters(), 2e-3, foreach=foreach)
                for p, q in zip(m1.parameters(), m2.parameters()):
                    assert torch.allclose(zo.full_grad(p), q.grad, rtol=1e-5, atol=5e-8)
                top = max(float(q.grad.abs().max()) for q in m2.parameters())
                assert abs(top - 2e-3) < 1e-9, top  # the clip acted
                zo.step()
                to.step()
            assert_params_close(m1, m2, 1e-6, f"clip_grad_value_ stage={stage} foreach={foreach}")
            zo.close()
            out[f"stage {stage} foreach={foreach}"] = "DDP's"
    return out


def _one_backward(stage, rank):
    m1, m2, zo, ddp, to = _pair(stage)
    m1(_x(rank, 0)).pow(2).mean().backward()
    ddp(_x(rank, 0)).pow(2).mean().backward()
    return m1, m2, zo, ddp, to


def check_read_grads(rank: int, world: int) -> dict:
    """Reading p.grad: a ShardedGrad of the param's shape and dtype, its norm and full_grad
    DDP's, also after opt.clip_grad_norm_; an op that cannot be exact raises naming the way
    that works."""
    for stage in (1, 2):
        m1, m2, zo, ddp, to = _one_backward(stage, rank)
        for a, b in zip(m1.parameters(), m2.parameters()):
            assert isinstance(a.grad, ShardedGrad)
            assert a.grad.shape == b.grad.shape and a.grad.dtype == b.grad.dtype
            assert abs(float(a.grad.norm()) - float(b.grad.norm())) <= 1e-6 * float(b.grad.norm())
            assert rel_err(zo.full_grad(a), b.grad) <= 1e-6
        zo.clip_grad_norm_(1e-3)
        torch.nn.utils.clip_grad_norm_(m2.parameters(), 1e-3)
        for a, b in zip(m1.parameters(), m2.parameters()):
            assert rel_err(zo.full_grad(a), b.grad) <= 1e-5
        try:
            _ = m1[0].weight.grad + 1
            raise AssertionError("an unsupported op on a sharded grad did not raise")
        except ShardedGradError as e:
            assert "full_grad" in str(e), e
        zo.close()
    return {}


def check_edit_grads(rank: int, world: int) -> dict:
    """Scaling, replacing and dropping grads before the step: DDP's result, a dropped param
    neither stepped nor given state; grads stay after step until zero_grad; a step with no
    backward since zero_grad changes nothing."""
    for stage in (1, 2):
        m1, m2, zo, ddp, to = _one_backward(stage, rank)
        zo.clip_grad_norm_(1e-3)
        torch.nn.utils.clip_grad_norm_(m2.parameters(), 1e-3)
        m1[0].weight.grad.mul_(0.5)
        m2[0].weight.grad.mul_(0.5)
        g = torch.full_like(m2[2].weight, 0.01)
        m1[2].weight.grad = g.clone()
        m2[2].weight.grad = g.clone()
        m1[4].bias.grad = None  # left out of this step, as torch does
        m2[4].bias.grad = None
        before = m1[4].bias.detach().clone()
        zo.step()
        to.step()
        assert torch.equal(m1[4].bias, before), "a param with grad None was stepped"
        assert not zo.full_state(m1[4].bias), "state created for a param never stepped"
        assert_params_close(m1, m2, 1e-6, f"scaled/replaced/dropped grads stage={stage}")
        # grads stay after step (torch's rule) until zero_grad
        assert rel_err(zo.full_grad(m1[2].weight), m2[2].weight.grad) <= 1e-6
        zo.zero_grad()
        assert all(p.grad is None for p in m1.parameters())
        # -- step with no backward since zero_grad changes nothing
        snap = [p.detach().clone() for p in m1.parameters()]
        zo.step()
        assert all(torch.equal(a, b) for a, b in zip(snap, m1.parameters()))
        zo.close()
    return {}


def check_grad_scaler(rank: int, world: int) -> dict:
    """torch.amp.GradScaler (its unscale_ and inf check run on the sharded grads): DDP's
    scales and result, one rank's overflow skipping the step on every rank."""
    for stage in (1, 2):
        m1, m2, zo, ddp, to = _pair(stage)
        s1 = torch.amp.GradScaler("cpu", init_scale=1024.0)
        s2 = torch.amp.GradScaler("cpu", init_scale=1024.0)
        for step in range(4):
            for m, s, o, fwd in ((m1, s1, zo, m1), (m2, s2, to, ddp)):
                o.zero_grad()
                loss = fwd(_x(rank, step)).pow(2).mean()
                if step == 2 and rank == world - 1:
                    loss = loss * float("inf")  # one rank overflows: every rank skips
                s.scale(loss).backward()
                s.unscale_(o)
                torch.nn.utils.clip_grad_norm_(m.parameters(), 0.05)
                s.step(o)
                s.update()
            assert s1.get_scale() == s2.get_scale(), (s1.get_scale(), s2.get_scale())
        assert_params_close(m1, m2, 1e-6, f"GradScaler stage={stage}")
        zo.close()
    return {}


# ------------------------------------------------------------------ torch's per-param semantics


class Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.some = nn.Linear(16, 16)  # used on rank 0 only
        self.never = nn.Linear(16, 16)  # used on no rank in some steps
        self.b = nn.Linear(16, 3)
        self.use_some = self.use_never = True

    def forward(self, x):
        h = torch.tanh(self.a(x))
        if self.use_some:
            h = h + self.some(h)
        if self.use_never:
            h = h + self.never(h)
        return self.b(h)


def check_unused_params(rank: int, world: int) -> dict:
    """Params used on some ranks only, or on none in some steps: DDP's grads None, result and
    optimizer state."""
    for stage in (1, 2):
        for cls, kw in (
            (O.AdamW, {"lr": 1e-2, "weight_decay": 0.1}),
            (O.SGD, {"lr": 0.1, "momentum": 0.9}),
        ):
            torch.manual_seed(0)
            base = Branchy()
            m1, m2 = copy.deepcopy(base), copy.deepcopy(base)
            zo = zero_opt(m1, cls, stage=stage, bucket_size_mb=0.001, **kw)
            ddp = DDP(m2, find_unused_parameters=True)
            to = cls(m2.parameters(), **kw)
            for step in range(6):
                for m in (m1, m2):
                    m.use_some = rank == 0
                    m.use_never = step % 3 == 0
                zo.zero_grad()
                to.zero_grad()
                m1(_x(rank, step)).pow(2).mean().backward()
                ddp(_x(rank, step)).pow(2).mean().backward()
                for (n, a), (_, b) in zip(m1.named_parameters(), m2.named_parameters()):
                    assert (a.grad is None) == (b.grad is None), (n, step)
                zo.step()
                to.step()
            assert_params_close(m1, m2, 1e-6, f"unused params {cls.__name__} stage={stage}")
            ref = to.state_dict()["state"]
            full = zo.consolidated_state_dict()
            if rank == 0:
                assert sorted(full["state"]) == sorted(ref), (sorted(full["state"]), sorted(ref))
                for k, st in ref.items():
                    for key, v in st.items():
                        assert rel_err(full["state"][k][key], v) <= 1e-5, (k, key)
            zo.close()
    return {}


def check_requires_grad_toggled(rank: int, world: int) -> dict:
    """requires_grad toggled between steps: left out while off, as torch does."""
    for stage in (1, 2):
        m1, m2, zo, ddp, to = _pair(stage)
        for step in range(4):
            off = step in (1, 2)
            for m in (m1, m2):
                m[2].weight.requires_grad_(not off)
            zo.zero_grad()
            to.zero_grad()
            m1(_x(rank, step)).pow(2).mean().backward()
            ddp(_x(rank, step)).pow(2).mean().backward()
            zo.step()
            to.step()
        assert_params_close(m1, m2, 1e-6, f"requires_grad toggled stage={stage}")
        zo.close()
    return {}


def check_float64(rank: int, world: int) -> dict:
    """float64 params are stepped in float64 (DDP's result to 1e-13), no fp32 master."""
    for stage in (1, 2):
        for cls, kw in (
            (O.AdamW, {"lr": 1e-2, "weight_decay": 0.1}),
            (O.SGD, {"lr": 0.1, "momentum": 0.9}),
        ):
            m1, m2, zo, ddp, to = _pair(stage, cls, torch.float64, **kw)
            for step in range(4):
                zo.zero_grad()
                to.zero_grad()
                m1(_x(rank, step, torch.float64)).pow(2).mean().backward()
                ddp(_x(rank, step, torch.float64)).pow(2).mean().backward()
                zo.step()
                to.step()
            assert_params_close(m1, m2, 1e-13, f"float64 {cls.__name__} stage={stage}")
            assert zo.memory_report()["master_bytes"] == 0
            assert all(t.dtype == torch.float64 for t in zo.parts.core.grads.shard_tensors())
            zo.close()
    return {}


def check_full_state_access(rank: int, world: int) -> dict:
    """full_param / full_state (collective) against the DDP side's torch optimizer; the
    setters set_full_param / set_full_state / set_full_grad give the result of the same edits
    made to the unsharded model."""
    for stage in (1, 2):
        m1, m2, zo, ddp, to = _pair(stage)
        for step in range(2):
            zo.zero_grad()
            to.zero_grad()
            m1(_x(rank, step)).pow(2).mean().backward()
            ddp(_x(rank, step)).pow(2).mean().backward()
            zo.step()
            to.step()
        for a, b in zip(m1.parameters(), m2.parameters()):
            assert rel_err(zo.full_param(a), b) <= 1e-6
            st, ref = zo.full_state(a), to.state[b]
            assert sorted(st) == sorted(ref), (sorted(st), sorted(ref))
            for key in ref:
                assert rel_err(st[key], ref[key]) <= 1e-5, (key, rel_err(st[key], ref[key]))
        w1, w2 = m1[0].weight, m2[0].weight
        new = torch.linspace(-1, 1, w1.numel()).view(w1.shape)
        zo.set_full_param(w1, new)
        with torch.no_grad():
            w2.copy_(new)
        zo.set_full_state(w1, "exp_avg", to.state[w2]["exp_avg"] * 2)
        to.state[w2]["exp_avg"].mul_(2)
        zo.zero_grad()
        to.zero_grad()
        m1(_x(rank, 7)).pow(2).mean().backward()
        ddp(_x(rank, 7)).pow(2).mean().backward()
        zo.set_full_grad(m1[4].weight, torch.ones_like(m1[4].weight))
        m2[4].weight.grad = torch.ones_like(m2[4].weight)
        zo.step()
        to.step()
        assert_params_close(m1, m2, 1e-6, f"full-state setters stage={stage}")
        zo.close()
    return {}


# ------------------------------------------------------------------ lifecycle


def _plain_grads(m, rank, step, what) -> None:
    """A backward on ``m`` leaves plain tensors in p.grad (no hook of ours ran); cleared."""
    m(_x(rank, step)).sum().backward()
    assert all(type(p.grad) is torch.Tensor for p in m.parameters()), what
    m.zero_grad()


def check_close(rank: int, world: int) -> dict:
    """A second optimizer over params held by a live one is refused; close() gives the params
    back as plain tensors (not views of the flat buffers), grads None, no hook left."""
    m = _model()
    zo = zero_opt(m, O.SGD, stage=2, bucket_size_mb=0.001, lr=0.1)
    flats = [f.untyped_storage().data_ptr() for f in zo.parts.core.store.flats]
    try:
        ZeroOptimizer(m, O.SGD, stage=1, lr=0.1)
        raise AssertionError("a second optimizer over held params was accepted")
    except ValueError as e:
        assert "another live ZeroOptimizer" in str(e), e
    m(_x(rank, 0)).sum().backward()
    zo.step()
    zo.close()
    assert all(p.untyped_storage().data_ptr() not in flats for p in m.parameters())
    assert all(p.grad is None for p in m.parameters())
    _plain_grads(m, rank, 1, "a hook survived close()")
    return {}


def check_second_optimizer(rank: int, world: int) -> dict:
    """A second optimizer on the same model, the first one closed, trains (DDP parity); the
    with-block closes it."""
    m = _model()
    zo = zero_opt(m, O.SGD, stage=2, bucket_size_mb=0.001, lr=0.1)
    m(_x(rank, 0)).sum().backward()
    zo.step()
    zo.close()
    base = copy.deepcopy(m)
    with zero_opt(m, O.SGD, stage=1, bucket_size_mb=0.001, lr=0.1) as z2:
        d = DDP(base)
        so = O.SGD(base.parameters(), lr=0.1)
        for step in range(2):
            z2.zero_grad()
            so.zero_grad()
            m(_x(rank, step)).pow(2).mean().backward()
            d(_x(rank, step)).pow(2).mean().backward()
            z2.step()
            so.step()
        assert_params_close(m, base, 1e-6, "second optimizer")
    assert z2.closed
    return {}


def check_collected_optimizer(rank: int, world: int) -> dict:
    """A collected optimizer leaves no hooks."""
    m = _model()
    z3 = zero_opt(m, O.SGD, stage=2, bucket_size_mb=0.001, lr=0.1)
    m(_x(rank, 2)).sum().backward()
    del z3
    gc.collect()
    for p in m.parameters():
        p.grad = None
    _plain_grads(m, rank, 3, "hooks outlived the optimizer")
    return {}


def check_failed_constructor(rank: int, world: int) -> dict:
    """A constructor that fails (the inner optimizer rejects lr) leaves nothing behind: no
    hooks, the params free for the next optimizer."""
    m = _model()
    try:
        ZeroOptimizer(m, O.SGD, stage=2, lr=-1.0)
        raise AssertionError("lr=-1 accepted")
    except ValueError as e:
        assert "learning rate" in str(e).lower(), e
    _plain_grads(m, rank, 4, "a failed build left hooks")
    ZeroOptimizer(m, O.SGD, stage=2, lr=0.1).close()  # the params are free again
    return {}


def check_replaced_params(rank: int, world: int) -> dict:
    """Replaced param data (.data =, module.to()): a clear error at the next step, never a
    model that stops training; load_state_dict(assign=True): refused at the load itself
    ([Note: module state dicts]), the params left as they were."""
    m = _model()
    for how in ("data", "to", "assign"):
        z4 = ZeroOptimizer(m, O.SGD, stage=2, lr=0.1)
        if how == "data":
            m[0].weight.data = m[0].weight.data.clone()
        elif how == "to":
            m.to(torch.float64)
        else:
            before = [p for p in m.parameters()]
            try:
                m.load_state_dict({k: v.clone() for k, v in m.state_dict().items()}, assign=True)
                raise AssertionError("load_state_dict(assign=True) accepted")
            except RuntimeError as e:
                assert "assign=True" in str(e), e
            assert all(p is q for p, q in zip(m.parameters(), before))
            z4.close()
            continue
        m(_x(rank, 5, next(m.parameters()).dtype)).sum().backward()
        try:
            z4.step()
            raise AssertionError(f"replaced params ({how}) not noticed")
        except RuntimeError as e:
            assert "replaced" in str(e), e
        m.zero_grad()
        m.to(torch.float32)
        z4.close()
    return {}


# ------------------------------------------------------------------ ranks that disagree


def check_disagree_options(rank: int, world: int) -> dict:
    """Ranks built with different hyper-parameters or bucket_size_mb: a ValueError on every
    rank naming what and where."""
    for what, kw in (
        ("hyper-parameters", {"lr": 0.1 if rank == 0 else 0.2}),
        ("bucket_size_mb", {"lr": 0.1, "bucket_size_mb": 1.0 if rank == 0 else 2.0}),
    ):
        try:
            zero_opt(_model(), O.SGD, stage=2, **kw)
            raise AssertionError(f"different {what} accepted")
        except ValueError as e:
            assert what in str(e) and f"rank {world - 1}" in str(e), e
    return {}


def check_disagree_params(rank: int, world: int) -> dict:
    """Ranks with params of different shapes: a ValueError on every rank."""
    m = _model() if rank == 0 else nn.Sequential(nn.Linear(8, 5))
    try:
        ZeroOptimizer(m, O.SGD, stage=2, lr=0.1)
        raise AssertionError("different params accepted")
    except ValueError as e:
        assert "params" in str(e), e
    return {}


def check_lone_collective(rank: int, world: int) -> dict:
    """A collective-only call made on one rank: an error there within the timeout, no hang."""
    out = {}
    zo = zero_opt(_model(), O.SGD, stage=2, lr=0.1, timeout=3)
    t0 = time.monotonic()
    if rank == 0:
        try:
            zo.consolidated_state_dict()
            raise AssertionError("consolidated_state_dict on one rank returned")
        except RuntimeError as e:
            assert "collective" in str(e), e
        out["lone call s"] = time.monotonic() - t0
        assert out["lone call s"] < 30
    dist.barrier()
    zo.close()
    return out


# ------------------------------------------------------------------ non-finite gradients


def _nonfinite(rank: int, world: int, mode: str) -> dict:
    """nonfinite=``mode`` with a NaN on the last rank only (its loss times NaN: every gradient
    of that rank NaN, so every rank's reduced shard holds NaN)."""
    m = _model()
    zo = zero_opt(m, O.SGD, stage=2, lr=0.1, nonfinite=mode)
    before = [p.detach().clone() for p in m.parameters()]
    loss = m(_x(rank, 0)).pow(2).mean()
    if rank == world - 1:
        loss = loss * float("nan")
    loss.backward()
    if mode == "raise":
        try:
            zo.step()
            raise AssertionError("nonfinite='raise' did not raise")
        except FloatingPointError:
            pass
    else:
        zo.step()
    same = all(torch.equal(a, b) for a, b in zip(before, m.parameters()))
    assert same == (mode != "step"), (mode, same)
    stats = zo.comm_stats["nonfinite_steps"]
    zo.close()
    return {"nonfinite_steps": stats}


def check_nonfinite_skip(rank: int, world: int) -> dict:
    """nonfinite='skip': every rank skips the step and counts it."""
    out = _nonfinite(rank, world, "skip")
    assert out["nonfinite_steps"] == 1, out
    return out


def check_nonfinite_raise(rank: int, world: int) -> dict:
    """nonfinite='raise': a FloatingPointError on every rank, nothing updated."""
    return _nonfinite(rank, world, "raise")


def check_nonfinite_step(rank: int, world: int) -> dict:
    """nonfinite='step' (torch's behaviour): every rank steps, and counts the step, since its
    shard of the reduced gradients holds the NaN."""
    out = _nonfinite(rank, world, "step")
    assert out["nonfinite_steps"] == 1, out
    return out


# ------------------------------------------------------------------ overlapped param gathers


def check_overlap_gather(rank: int, world: int) -> dict:
    """overlap_param_gather: DDP's result; all-gathers still in flight after step() are waited
    for by the forward (or wait_params); state_dict sees finished values."""
    for stage in (1, 2):
        m1, m2, zo, ddp, to = _pair(stage, zkw={"overlap_param_gather": True})
        for step in range(4):
            zo.zero_grad()
            to.zero_grad()
            m1(_x(rank, step)).pow(2).mean().backward()
            ddp(_x(rank, step)).pow(2).mean().backward()
            zo.step()
            to.step()
            pending = zo.parts.params.in_flight  # one kept unit per bucket
            assert pending == sum(len(b.buckets) for b in zo.layout.buffers), pending
            if step == 2:
                sd = m1.state_dict()  # waits for every gather first
                assert not zo.parts.params.in_flight
                for k, v in m2.state_dict().items():
                    assert rel_err(sd[k.removeprefix("module.")], v) <= 1e-6, k
        zo.wait_params()
        assert_params_close(m1, m2, 1e-6, f"overlap_param_gather stage={stage}")
        zo.close()
    return {}


# ------------------------------------------------------------------ uneven inputs (Join)


class _Calls(nn.Module):
    """Identity that counts its forwards in a buffer and draws once from torch's generator
    (state a shadow forward must leave as it was)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("calls", torch.zeros((), dtype=torch.int64))

    def forward(self, x):
        self.calls += 1
        torch.rand(())
        return x


def check_join(rank: int, world: int) -> dict:
    """Uneven inputs through torch's Join: the ranks with more batches get DDP-under-Join's
    result (the joined ranks count as zero gradients), every rank ends with the same params."""
    from torch.distributed.algorithms.join import Join

    for stage in (1, 2, 3):
        n_batches = 2 + rank  # the last rank has the most
        # the buffer counts this rank's own forwards (a stage-3 shadow adds none), so it is
        # not broadcast (tests/stages/test_replicas.py checks buffers under Join against DDP's)
        m1, m2, zo, ddp, to = _pair(stage, zkw={"broadcast_buffers": False})
        m1.append(_Calls())
        rng = torch.get_rng_state()
        with Join([zo]):
            for step in range(n_batches):
                zo.zero_grad()
                m1(_x(rank, step)).pow(2).mean().backward()
                zo.step()
        with Join([ddp]):
            for step in range(n_batches):
                to.zero_grad()
                ddp(_x(rank, step)).pow(2).mean().backward()
                to.step()
        zo.clip_grad_norm_(1e9)  # after the Join context: every rank trains again
        assert int(m1[-1].calls) == n_batches, (stage, int(m1[-1].calls), n_batches)
        now = torch.get_rng_state()
        torch.set_rng_state(rng)
        torch.rand(n_batches)  # this rank's own forwards' draws, nothing more
        assert torch.equal(torch.get_rng_state(), now), "a shadow iteration used the RNG"
        with zo.gathered_params() if stage == 3 else contextlib.nullcontext():
            if rank == world - 1:  # stepped in every iteration under DDP too
                assert_params_close(m1, m2, 1e-6, f"Join stage={stage}")
            for p in m1.parameters():
                ref = p.detach().clone()
                dist.broadcast(ref, 0)
                assert torch.equal(ref, p.detach()), "ranks differ after Join"
        zo.close()
    return {}


def check_join_clip(rank: int, world: int) -> dict:
    """Clipping once a rank joined: a clear error on the ranks still training, no hang. It
    ends the group's use (the joined rank waits in a collective that never comes), so it runs
    last."""
    from torch.distributed.algorithms.join import Join

    out = {}
    m1, m2, zo, ddp, to = _pair(2)
    try:
        with Join([zo]):
            for step in range(1 + rank):
                zo.zero_grad()
                m1(_x(rank, step)).pow(2).mean().backward()
                zo.clip_grad_norm_(1.0)
                zo.step()
        raise AssertionError("clip_grad_norm_ after a rank joined did not raise")
    except RuntimeError as e:
        if rank > 0:  # the joined rank 0 sees its partners leave
            assert "Join" in str(e), e
            out["join clip error"] = str(e)[:60]
    return out


def check_join_refusals(rank: int, world: int, what: str) -> dict:
    """Once a rank joined (Join), what its shadow iterations cannot match is a clear error on
    the ranks still training: at stage 3 an evaluation forward (``what="eval"``: its
    all-gathers would have no partner) or gradient accumulation (``"accumulate"``: the joined
    rank would step after each micro-batch; ``"accumulate2"``: the same at stage 2, which reduces
    each micro-batch). The group is unusable after (the joined rank
    waits in a collective that never comes, until it sees its partners leave), so each case
    runs in processes of its own."""
    from torch.distributed.algorithms.join import Join

    m1 = _model()
    zo = ZeroOptimizer(m1, O.AdamW, stage=2 if what == "accumulate2" else 3, lr=1e-2)
    try:
        with Join([zo]):
            for step in range(1 + rank):
                zo.zero_grad()
                if what.startswith("accumulate"):
                    with zo.no_sync():
                        m1(_x(rank, 2 * step)).pow(2).mean().backward()
                m1(_x(rank, step)).pow(2).mean().backward()
                zo.step()
                if what == "eval":
                    with torch.no_grad():
                        m1(_x(rank, step))
        assert rank == 0, f"{what} after a rank joined did not raise"
    except RuntimeError as e:
        if rank == 0:  # joined: it sees its partner leave
            return {}
        words = "forward without gradients" if what == "eval" else "accumulation (no_sync)"
        assert words in str(e) and "Join" in str(e), e
        return {what: "ok"}
    return {}


# ------------------------------------------------------------------ the spawned group


def contract_checks(world: int) -> tuple:
    """The concerns `contract_all` runs at ``world`` ranks, in order."""
    many = world > 1  # ranks that disagree, a lone rank, a rank that joined: two ranks at least
    return (
        check_torch_clip_and_zero_grad,
        check_clip_value_and_detach,
        check_read_grads,
        check_edit_grads,
        check_grad_scaler,
        check_unused_params,
        check_requires_grad_toggled,
        check_float64,
        check_full_state_access,
        check_close,
        check_second_optimizer,
        check_collected_optimizer,
        check_failed_constructor,
        check_replaced_params,
        check_nonfinite_skip,
        check_nonfinite_raise,
        check_nonfinite_step,
        check_overlap_gather,
        *((check_disagree_options, check_disagree_params, check_lone_collective) if many else ()),
        check_join,
        *((check_join_clip,) if many else ()),  # last: it leaves the group unusable
    )


def contract_all(rank: int, world: int) -> dict:
    return run_checks(rank, world, contract_checks(world))
