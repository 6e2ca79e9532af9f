"""Checks run in spawned gloo ranks by tests/stages/test_clip_norm.py:
``ZeroOptimizer.clip_grad_norm_``
returns the float64 norm of DDP's full gradients to ~1e-8 relative, host and sync-free paths,
stages 1-3, p = 2, 1 and 3, on a model whose shards hold a million elements each, where torch's
reduction of one long fp32 tensor is off by ~1e-5 ([Note: accurate norms] in
zero_kernels/partition/syncfree.py); and the clipped step equals DDP's clipped by that exact
norm."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from dist_utils import run_checks
from numerics import assert_params_close, rel_err
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from zero_opt import zero_opt

from zero_kernels import ZeroOptimizer

CASES = [  # (stage, norm_type, sync_free)
    (1, 2.0, False),
    (2, 2.0, False),
    (3, 2.0, False),
    (2, 2.0, True),
    (3, 2.0, True),
    (2, 1.0, False),
    (3, 3.0, True),
]
NORM_TOL = 1.5e-7  # ours (an fp32 number) against float64: 6e-8 is fp32's own rounding


def _model() -> nn.Module:
    torch.manual_seed(0)
    # 2.1M params: at 2 ranks each shard holds about a million elements
    return nn.Sequential(nn.Linear(64, 2048), nn.Tanh(), nn.Linear(2048, 1024), nn.Linear(1024, 8))


def _x(rank: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * step + rank)
    # rows of very different scales: gradients whose magnitudes span decades
    return torch.randn(16, 64, generator=g) * torch.logspace(-3, 1, 16).unsqueeze(1)


def _exact_norm(ps, p: float) -> float:
    return float(sum(q.grad.double().abs().pow(p).sum() for q in ps)) ** (1.0 / p)


def check_clip_norms(rank: int, world: int) -> dict:
    out = {}
    for stage, p, sync_free in CASES:
        key = f"stage {stage} p={p} sync_free={sync_free}"
        base = _model()
        m1, m2 = copy.deepcopy(base), copy.deepcopy(base)
        kw = {"lr": 1e-3, "weight_decay": 0.01}
        zo = zero_opt(m1, torch.optim.AdamW, stage=stage, **kw)
        zo.parts.core.sync_free = sync_free
        ddp = DDP(m2)
        to = torch.optim.AdamW(m2.parameters(), **kw)
        worst = 0.0
        for step in range(2):
            zo.zero_grad()
            to.zero_grad()
            m1(_x(rank, step)).pow(2).mean().backward()
            ddp(_x(rank, step)).pow(2).mean().backward()
            exact = _exact_norm(list(m2.parameters()), p)
            # ours against the float64 norm of its own full gradients (after the first step the
            # two models' gradients differ by the last bits of their params)
            own = float(sum(zo.full_grad(q).double().abs().pow(p).sum() for q in m1.parameters()))
            own **= 1.0 / p
            n1 = zo.clip_grad_norm_(0.05, p)
            err = abs(float(n1) - own) / own
            worst = max(worst, err)
            assert err <= NORM_TOL, (key, step, float(n1), own, err)
            assert abs(own - exact) <= 1e-6 * exact, (key, step, own, exact)
            # DDP's gradients clipped by the exact norm (torch's own clip would use its
            # per-param fp32 norms, themselves ~1e-5 off on a 2M-element weight)
            coef = min(1.0, 0.05 / (exact + 1e-6))
            for q in m2.parameters():
                q.grad.mul_(coef)
            zo.step()
            to.step()
        if stage == 3:
            with zo.gathered_params(m1):
                errs = [rel_err(a, b) for a, b in zip(m1.parameters(), m2.parameters())]
        else:
            errs = [rel_err(a, b) for a, b in zip(m1.parameters(), m2.parameters())]
        assert max(errs) <= 1e-6, (key, errs)
        zo.close()
        out[key] = worst
    return out


def _hwm() -> int:
    with open("/proc/self/status") as f:
        return next(int(ln.split()[1]) * 1024 for ln in f if ln.startswith("VmHWM"))


def check_sharded_grad_norm_memory(rank: int, world: int) -> dict:
    """torch's own clip_grad_norm_ on the ShardedGrads of a 16.8M-element weight: the norm takes
    no copy of the gradient (it took 5x its bytes through float64 copies: 1345 MB over a 268 MB
    gradient), and is float64-accurate."""
    torch.manual_seed(0)
    m = nn.Linear(4096, 4096)
    opt = ZeroOptimizer(m, torch.optim.SGD, stage=2, lr=0.1)
    m(torch.randn(4, 4096)).pow(2).mean().backward()
    exact = float(sum(opt.full_grad(q).double().pow(2).sum() for q in m.parameters())) ** 0.5
    grad_bytes = m.weight.numel() * 4
    with open("/proc/self/clear_refs", "w") as f:  # reset VmHWM to the current RSS
        f.write("5")
    base = _hwm()
    n = torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
    peak = _hwm() - base
    opt.close()
    assert abs(float(n) - exact) <= NORM_TOL * exact, (float(n), exact)
    assert peak <= grad_bytes // 4, f"norm of ShardedGrads: peak +{peak} B over {grad_bytes} B"
    return {"peak_bytes": peak, "grad_bytes": grad_bytes}


# ---------------------------------------------------------- torch's clip: one collective, DDP's
# [Note: one collective per clip] in zero_kernels/partition/grads.py: torch's clip_grad_norm_
# over a ZeroOptimizer's ShardedGrads all-reduces once, and its norms follow every change of the
# gradients (a stale norm would be a silent wrong result).


class _Net(nn.Module):
    """20 trained params in two dtypes (a float64 block: torch's clip takes two dtype groups) and
    a frozen layer."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.body = nn.ModuleList(nn.Linear(16, 16) for _ in range(7))
        self.wide = nn.Linear(16, 16).double()
        self.frozen = nn.Linear(16, 16).requires_grad_(False)
        self.out = nn.Linear(16, 3)

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        for layer in self.body:
            h = torch.tanh(layer(h))
        h = torch.tanh(self.wide(h.double())).float()
        return self.out(self.frozen(h))


def _net_pair(stage: int, rank: int, cls=torch.optim.AdamW):
    """Ours (two param groups) and DDP's, from one init, after one backward each."""
    torch.manual_seed(1)
    base = _Net()
    m1, m2 = copy.deepcopy(base), copy.deepcopy(base)

    def groups(m):
        return [
            {"params": [*m.inp.parameters(), *m.body.parameters()]},
            {"params": [*m.wide.parameters(), *m.out.parameters()], "weight_decay": 0.0},
        ]

    zo = zero_opt(groups(m1), cls, stage=stage, module=m1, bucket_size_mb=0.001, lr=1e-2)
    ddp = DDP(m2)
    to = cls(groups(m2), lr=1e-2)
    _backward(m1, ddp, rank, 0)
    return m1, m2, zo, ddp, to


def _backward(m1, ddp, rank: int, step: int) -> None:
    x = torch.randn(6, 8, generator=torch.Generator().manual_seed(10 * step + rank))
    m1(x).pow(2).mean().backward()
    ddp(x).pow(2).mean().backward()


def _collectives(*opts) -> int:
    """Collectives the optimizers issued so far (every ``*_calls`` counter of comm_stats)."""
    return sum(v for o in opts for k, v in o.comm_stats.items() if k.endswith("_calls"))


def _same_norm(a: torch.Tensor, b: torch.Tensor, what) -> None:
    fa, fb = float(a), float(b)
    assert a.dtype == b.dtype, (what, a.dtype, b.dtype)
    assert abs(fa - fb) <= 1e-5 * abs(fb) + 1e-12, (what, fa, fb)


def _same_norms(m1, m2, what) -> None:
    """Each param's norm read as a user would (``p.grad.norm().item()``): DDP's, the global
    value (p = 2 and inf)."""
    for (n, a), b in zip(m1.named_parameters(), m2.parameters()):
        assert (a.grad is None) == (b.grad is None), (what, n)
        if b.grad is not None:
            for p in (2.0, float("inf")):
                na, nb = a.grad.norm(p).item(), b.grad.norm(p).item()
                assert abs(na - nb) <= 1e-5 * nb + 1e-12, (what, n, p, na, nb)


def _same_grads(zo, m1, m2, what) -> None:
    """Ours (gathered) equal DDP's, and each param's own norm too."""
    _same_norms(m1, m2, what)
    for (n, a), b in zip(m1.named_parameters(), m2.parameters()):
        if b.grad is not None:
            assert rel_err(zo.full_grad(a), b.grad) <= 1e-5, (what, n)


def _clip_both(m1, m2, zo, what, *args, calls: int = 1, **kw) -> torch.Tensor:
    """torch's clip on ours and on DDP's: the same norm, the same grads; ``calls`` collectives
    (one, none where the norms of that order were read since the gradients changed)."""
    before = _collectives(zo)
    n1 = torch.nn.utils.clip_grad_norm_(m1.parameters(), *args, **kw)
    got = _collectives(zo) - before
    n2 = torch.nn.utils.clip_grad_norm_(m2.parameters(), *args, **kw)
    assert got == calls, f"{what}: torch's clip issued {got} collectives, not {calls}"
    _same_norm(n1, n2, what)
    _same_grads(zo, m1, m2, what)
    return n1


def check_torch_clip_one_collective(rank: int, world: int) -> dict:
    """torch.nn.utils.clip_grad_norm_ over model.parameters() (two dtypes, two param groups, a
    frozen layer) at stages 1-3: DDP's total norm and clipped grads with one collective, for
    p = 2 and inf, foreach None, True and False, two steps each."""
    out = {}
    for stage in (1, 2, 3):
        for p, foreach in ((2.0, None), (float("inf"), True), (2.0, True), (1.0, False)):
            what = f"stage {stage} p={p} foreach={foreach}"
            m1, m2, zo, ddp, to = _net_pair(stage, rank)
            for step in range(2):
                if step:
                    zo.zero_grad()
                    to.zero_grad()
                    _backward(m1, ddp, rank, step)
                _clip_both(m1, m2, zo, f"{what} step {step}", 0.05, p, foreach=foreach)
                zo.step()
                to.step()
            with zo.gathered_params(m1):
                assert_params_close(m1, m2, 1e-5, what)
            zo.close()
            out[what] = "one collective"
    return out


def check_torch_clip_cases(rank: int, world: int) -> dict:
    """torch's clip on a subset of the params (DDP's norm of that subset, the rest untouched),
    over the params of two optimizers (right, one collective each), and on non-finite grads
    (DDP's nan; error_if_nonfinite=True raises on every rank)."""
    m1, m2, zo, ddp, to = _net_pair(2, rank)
    sub1, sub2 = list(m1.body[2].parameters()), list(m2.body[2].parameters())
    before = _collectives(zo)
    n1 = torch.nn.utils.clip_grad_norm_(sub1, 1e-3)
    assert _collectives(zo) - before == 1
    n2 = torch.nn.utils.clip_grad_norm_(sub2, 1e-3)
    _same_norm(n1, n2, "subset")
    _same_grads(zo, m1, m2, "subset")
    # non-finite: DDP's nan; error_if_nonfinite raises here (every rank runs this check). The
    # NaN in the last element only (a later rank's piece: a max all-reduce may drop it)
    bad = torch.ones(16, 16)
    bad[-1, -1] = float("nan")
    for m in (m1, m2):
        m.body[0].weight.grad.copy_(bad)
        for p in (float("inf"), 2.0):
            assert m.body[0].weight.grad.norm(p).isnan(), p
            try:
                torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0, p, error_if_nonfinite=True)
                raise AssertionError(f"error_if_nonfinite=True did not raise, p={p}")
            except RuntimeError as e:
                assert "non-finite" in str(e), (p, e)
        assert torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0, float("inf")).isnan()
    # the optimizer's own clip: a NaN in the last rank's piece only (gloo's max all-reduce kept
    # rank 0's finite value and dropped it) is NaN on every rank, every order
    for q in m1.parameters():
        if q.grad is not None:
            q.grad.copy_(torch.ones_like(q))
    mine = [(pc.index, pc.offset, pc.numel) for pc in zo.sharded_state.pieces() if pc.numel]
    every = [None] * world
    dist.all_gather_object(every, mine)
    idx, off, n = every[-1][0]
    q = zo.sharded_state.params()[idx]
    g = torch.ones(q.numel())
    g[off : off + n] = float("nan")
    q.grad.copy_(g.view(q.shape))
    for p in (float("inf"), 2.0, 1.0):
        assert zo.clip_grad_norm_(1.0, p).isnan(), p
        try:
            zo.clip_grad_norm_(1.0, p, error_if_nonfinite=True)
            raise AssertionError(f"opt.clip_grad_norm_ error_if_nonfinite=True: no error, p={p}")
        except RuntimeError as e:
            assert "non-finite" in str(e), (p, e)
    zo.close()

    # two optimizers over one model, both in one call of torch's clip
    torch.manual_seed(1)
    base = _Net()
    m1, m2 = copy.deepcopy(base), copy.deepcopy(base)
    half = [*m1.inp.parameters(), *m1.body[:3].parameters()]
    ids = {id(q) for q in half}
    za = zero_opt(half, torch.optim.SGD, stage=2, bucket_size_mb=0.001, lr=0.1)
    rest = [q for q in m1.parameters() if q.requires_grad and id(q) not in ids]
    zb = zero_opt(rest, torch.optim.SGD, stage=1, bucket_size_mb=0.001, lr=0.1)
    ddp = DDP(m2)
    _backward(m1, ddp, rank, 0)
    for p, foreach in ((2.0, None), (float("inf"), True)):
        before = _collectives(za, zb)
        n1 = torch.nn.utils.clip_grad_norm_(m1.parameters(), 0.05, p, foreach=foreach)
        calls = _collectives(za, zb) - before
        n2 = torch.nn.utils.clip_grad_norm_(m2.parameters(), 0.05, p, foreach=foreach)
        assert calls == 2, f"two optimizers p={p}: {calls} collectives"
        _same_norm(n1, n2, f"two optimizers p={p}")
        for (n, a), b in zip(m1.named_parameters(), m2.parameters()):
            if b.grad is not None:
                z = za if id(a) in ids else zb
                assert rel_err(z.full_grad(a), b.grad) <= 1e-5, ("two optimizers", n)
    za.close()
    zb.close()
    return {}


class _HalvingSGD(torch.optim.SGD):
    """An optimizer that writes its gradients: it halves them as it steps."""

    @torch.no_grad()
    def step(self, closure=None):
        out = super().step(closure)
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.grad.mul_(0.5)
        return out


EDITS = [  # in-place changes of p.grad, the same on ours and DDP's
    ("mul_", lambda m: m.body[1].weight.grad.mul_(0.5)),
    ("div_ by a tensor", lambda m: m.out.bias.grad.div_(torch.tensor(4.0))),
    ("_foreach_mul_", lambda m: torch._foreach_mul_([m.inp.weight.grad], 3.0)),
    ("copy_", lambda m: m.body[3].bias.grad.copy_(torch.linspace(-1, 1, 16))),
    ("add_", lambda m: m.body[3].weight.grad.add_(torch.ones(16, 16), alpha=0.01)),
    ("zero_", lambda m: m.body[4].weight.grad.zero_()),
    ("clip_grad_value_", lambda m: torch.nn.utils.clip_grad_value_(m.parameters(), 0.3)),
]


def check_norms_follow_grads(rank: int, world: int) -> dict:
    """Norms read after each change of the gradients are the new ones (no stale norm): in-place
    ops on p.grad, opt.clip_grad_norm_, assignments, a second backward (accumulating),
    zero_grad both ways, clip_grad_value_, a step; reading every param's norm costs one
    collective per norm order, reading them again none."""
    out = {}
    for stage in (1, 2, 3):
        m1, m2, zo, ddp, to = _net_pair(stage, rank)
        _clip_both(m1, m2, zo, f"stage {stage}: first", 1e6)
        for m in (m1, m2):
            m.body[1].bias.grad.mul_(2.0)
        # every param's norm of orders 2 and inf, read twice: one collective per order
        before = _collectives(zo)
        for _ in range(2):
            _same_norms(m1, m2, f"stage {stage}: read")
        assert _collectives(zo) - before == 2, _collectives(zo) - before
        for what, edit in EDITS:
            edit(m1)
            edit(m2)
            _same_grads(zo, m1, m2, f"stage {stage}: {what}")  # the new norms, read
            _clip_both(m1, m2, zo, f"stage {stage}: clip after {what}", 1e6, calls=0)
        for m in (m1, m2):  # then a clip that scales it (a plain tensor: torch's norm of it,
            m.body[5].bias.grad = torch.full((16,), 0.25)  # the others' are known)
        _clip_both(m1, m2, zo, f"stage {stage}: clip after p.grad = tensor", 0.1, calls=0)
        for m in (m1, m2):  # then the norms, read
            m.body[6].bias.grad = torch.full((16,), -0.5)
        _same_grads(zo, m1, m2, f"stage {stage}: p.grad = tensor")  # full_grad takes it in
        _clip_both(m1, m2, zo, f"stage {stage}: clip after the assignment taken in", 1e6)
        # opt.clip_grad_norm_ on ours, DDP's clipped by torch's clip to the same max norm
        zo.clip_grad_norm_(0.02)
        torch.nn.utils.clip_grad_norm_(m2.parameters(), 0.02)
        _same_grads(zo, m1, m2, f"stage {stage}: opt.clip_grad_norm_")
        # the gradients after a step (an inner optimizer may write them): right
        zo.step()
        to.step()
        _same_grads(zo, m1, m2, f"stage {stage}: after step")
        # a second backward adds to the gradients
        _backward(m1, ddp, rank, 1)
        _same_grads(zo, m1, m2, f"stage {stage}: second backward")
        _clip_both(m1, m2, zo, f"stage {stage}: clip after a second backward", 0.05, calls=0)
        # p.grad = None on one param: left out of the clip
        for m in (m1, m2):
            m.body[0].weight.grad = None
        # (the others' norms were read since the last change: known)
        _clip_both(m1, m2, zo, f"stage {stage}: clip after p.grad = None", 0.04, calls=0)
        # zero_grad(set_to_none=False): zero norms; then a backward: its norms
        for o in (zo, to):
            o.zero_grad(set_to_none=False)
        _same_grads(zo, m1, m2, f"stage {stage}: zero_grad(set_to_none=False)")
        assert all(float(q.grad.norm()) == 0.0 for q in m1.parameters() if q.grad is not None)
        _backward(m1, ddp, rank, 2)
        _clip_both(m1, m2, zo, f"stage {stage}: clip after zero_grad + backward", 0.05)
        for o in (zo, to):
            o.zero_grad()
        _backward(m1, ddp, rank, 3)
        _clip_both(m1, m2, zo, f"stage {stage}: clip after zero_grad() + backward", 0.05)
        zo.close()
        # an inner optimizer that writes its gradients as it steps: the norms after its step
        m1, m2, zo, ddp, to = _net_pair(stage, rank, _HalvingSGD)
        _same_norms(m1, m2, f"stage {stage}: before a step that writes gradients")
        zo.step()
        to.step()
        _same_grads(zo, m1, m2, f"stage {stage}: after a step that writes gradients")
        zo.close()
        out[f"stage {stage}"] = "fresh"
    return out


def check_max_norm_inf(rank: int, world: int) -> dict:
    """``max_norm=inf`` reads the norm and leaves the gradients as they are (torch clamps the
    coefficient at 1), for the optimizer's own clip and torch's, repeated, at stages 1-3:
    DDP's norm and grads each time (the host path multiplied them by inf)."""
    for stage in (1, 2, 3):
        m1, m2, zo, ddp, _ = _net_pair(stage, rank)
        inf = float("inf")
        for i in range(2):
            ours = float(zo.clip_grad_norm_(inf))  # fp32; torch's: the grads' widest dtype
            want = float(torch.nn.utils.clip_grad_norm_(m2.parameters(), inf))
            assert abs(ours - want) <= 1e-5 * want, (stage, i, ours, want)
            _same_grads(zo, m1, m2, ("opt.clip_grad_norm_(inf)", stage, i))
            n1 = torch.nn.utils.clip_grad_norm_(m1.parameters(), inf)
            _same_norm(n1, torch.nn.utils.clip_grad_norm_(m2.parameters(), inf), (stage, i))
            _same_grads(zo, m1, m2, ("torch clip_grad_norm_(inf)", stage, i))
        zo.close()
    return {}


def clip_checks(world: int) -> tuple:
    """The checks `clip_all` runs at ``world`` ranks, in order (the float64 one at 2 only)."""
    extra = (check_clip_norms,) if world == 2 else ()
    return (
        *extra,
        check_torch_clip_one_collective,
        check_torch_clip_cases,
        check_norms_follow_grads,
        check_max_norm_inf,
    )


def clip_all(rank: int, world: int) -> dict:
    return run_checks(rank, world, clip_checks(world))
