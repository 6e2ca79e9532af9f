"""Checks of the model's unsharded tensors against DDP ([Note: replicated module state] in
zero_kernels/optimizer/replicas.py), run in one spawned gloo group per world size
(tests/stages/test_replicas.py):
frozen params and buffers that differ across ranks at construction take rank 0's values, and
BatchNorm's running statistics follow DDP's ``broadcast_buffers`` at stages 1-3, through
gradient accumulation, an evaluation forward and uneven inputs under Join."""

from __future__ import annotations

import contextlib
import warnings

import torch
import torch.distributed as dist
from dist_utils import run_checks
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from zero_opt import zero_opt

from zero_kernels import ZeroOptimizer

STAGES = (1, 2, 3)


def _gathered(zo, stage):
    return zo.gathered_params() if stage == 3 else contextlib.nullcontext()


def _rank0(t: torch.Tensor) -> torch.Tensor:
    ref = t.detach().clone()
    dist.broadcast(ref, 0)
    return ref


class _Frozen(nn.Module):
    """A frozen layer and a random buffer between two trained layers."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.frozen = nn.Linear(16, 16)
        self.frozen.requires_grad_(False)
        self.register_buffer("noise", torch.randn(16))
        self.b = nn.Linear(16, 4)

    def forward(self, x):
        return self.b(torch.relu(self.frozen(torch.tanh(self.a(x))) + self.noise))


def _x(rank: int, step: int, n: int = 16) -> torch.Tensor:
    return torch.randn(n, 8, generator=torch.Generator().manual_seed(1000 * step + rank))


def check_start_sync(rank: int, world: int) -> dict:
    """Each rank builds the model from a seed of its own (no common seed): DDP's result, as
    DDP broadcasts rank 0's params and buffers at construction. Before the fix the frozen layer
    and the buffer stayed each rank's, and rank 1's loss was 40% from DDP's at step 1."""
    out = {}
    for stage in STAGES:
        torch.manual_seed(100 + rank)
        m1 = _Frozen()
        torch.manual_seed(100 + rank)
        m2 = _Frozen()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            zo = ZeroOptimizer(m1, torch.optim.AdamW, stage=stage, lr=1e-2)
        said = [str(w.message) for w in caught if "differed across ranks" in str(w.message)]
        assert len(said) == 1, (stage, said)
        assert "'frozen.weight'" in said[0] and "'noise'" in said[0] and "3 frozen" in said[0]
        for name in ("frozen.weight", "frozen.bias", "noise"):
            t = m1.get_buffer(name) if name == "noise" else m1.get_parameter(name)
            assert torch.equal(t, _rank0(t)), (stage, name, "not rank 0's")
        ddp = DDP(m2)
        to = torch.optim.AdamW([p for p in m2.parameters() if p.requires_grad], lr=1e-2, fused=True)
        for step in range(3):
            zo.zero_grad()
            to.zero_grad()
            l1 = m1(_x(rank, step)).pow(2).mean()
            l2 = ddp(_x(rank, step)).pow(2).mean()
            l1.backward()
            l2.backward()
            zo.step()
            to.step()
            assert abs(l1.item() - l2.item()) <= 1e-6 * abs(l2.item()), (stage, step, l1, l2)
        with _gathered(zo, stage):
            for (n, p1), p2 in zip(m1.named_parameters(), m2.parameters()):
                torch.testing.assert_close(p1, p2, rtol=0, atol=1e-6, msg=f"{stage} {n}")
        zo.close()
        out[f"stage {stage} loss"] = l1.item()
    # a model equal on every rank: nothing to say, nothing changed
    torch.manual_seed(5)
    m = _Frozen()
    before = [t.detach().clone() for t in [*m.parameters(), *m.buffers()]]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        zo = ZeroOptimizer(m, torch.optim.AdamW, stage=2, lr=1e-2)
    assert not [w for w in caught if "differed across ranks" in str(w.message)]
    for t, b in zip([*m.parameters(), *m.buffers()], before):
        assert torch.equal(t, b)
    zo.close()
    return out


def check_start_mismatch(rank: int, world: int) -> dict:
    """Models whose buffers differ in number or size across ranks: a ValueError on every rank
    naming the difference (not a gloo size error or a hang in the broadcast)."""
    out = {}
    for what in ("count", "size"):
        torch.manual_seed(0)
        m = _Frozen()
        if what == "count" and rank == world - 1:
            m.register_buffer("extra", torch.zeros(3))
        if what == "size":
            m.register_buffer("extra", torch.zeros(3 + rank))
        try:
            ZeroOptimizer(m, torch.optim.AdamW, stage=2, lr=1e-2)
        except ValueError as e:
            assert "every rank must build the same model" in str(e), e
            assert what == "count" or "'extra'" in str(e), e
            out[what] = str(e)[:80]
        else:
            raise AssertionError(f"buffers of another {what} on some rank: no error")
    return out


class _BN(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 16, bias=False)  # a bias before BatchNorm gets only rounding noise
        self.bn = nn.BatchNorm1d(16)
        self.b = nn.Linear(16, 4)

    def forward(self, x):
        return self.b(torch.relu(self.bn(self.a(x))))


def _bn_pair(stage: int, **zkw):
    torch.manual_seed(7)
    m1, m2 = _BN(), _BN()
    m2.load_state_dict(m1.state_dict())
    zo = zero_opt(m1, torch.optim.AdamW, stage=stage, lr=1e-2, **zkw)
    ddp = DDP(m2)
    to = torch.optim.AdamW(m2.parameters(), lr=1e-2, fused=True)
    return m1, m2, zo, ddp, to


def _bn_state(m: nn.Module) -> dict:
    return {k: v.detach().clone() for k, v in m.bn.state_dict().items()}


def _close_states(a: dict, b: dict, what: str, tol: float = 1e-5) -> float:
    worst = 0.0
    for k in a:
        if not a[k].is_floating_point():  # num_batches_tracked
            assert torch.equal(a[k], b[k]), (what, k, a[k], b[k])
            continue
        worst = max(worst, (a[k].double() - b[k].double()).abs().max().item())
    assert worst <= tol, (what, worst)
    return worst


def _bn_run(stage: int, rank: int, zkw: dict) -> tuple:
    """Step 0; step 1 in two micro-batches (the first under no_sync); an evaluation forward
    without gradients; step 2. ZeRO's and DDP's BatchNorm state after each, and the eval
    outputs."""
    m1, m2, zo, ddp, to = _bn_pair(stage, **zkw)
    states, evals = [], []

    def both(fn):
        fn(m1, zo, m1, contextlib.nullcontext)
        fn(m2, to, ddp, ddp.no_sync)

    def step(step_i, micro):
        def run(m, opt, fwd, no_sync_ddp):
            opt.zero_grad()
            for k in range(micro):
                last = k == micro - 1
                ctx = contextlib.nullcontext() if last else _no_sync(opt, no_sync_ddp)
                with ctx:
                    fwd(_x(rank, 10 * step_i + k)).pow(2).mean().backward()
            opt.step()

        both(run)
        states.append((_bn_state(m1), _bn_state(m2)))

    def evaluate(m, opt, fwd, _):
        m.eval()
        with torch.no_grad():
            evals.append(fwd(_x(rank, 99, 4)))
        m.train()

    step(0, 1)
    step(1, 2)
    both(evaluate)
    states.append((_bn_state(m1), _bn_state(m2)))
    step(2, 1)
    stats = zo.comm_stats
    zo.close()
    return states, evals, stats


def _no_sync(opt, no_sync_ddp):
    return opt.no_sync() if isinstance(opt, ZeroOptimizer) else no_sync_ddp()


def check_bn_like_ddp(rank: int, world: int) -> dict:
    """BatchNorm's running statistics and an evaluation forward on every rank: DDP's (rank 0's
    buffers broadcast before a forward that follows a training forward), at stages 1-3; the
    broadcasts counted. With broadcast_buffers=False ranks other than 0 keep their own (the
    control: this check would fail without the broadcast)."""
    out = {}
    nbytes = 16 * 4 * 2 + 8  # running mean and var (fp32), num_batches_tracked (int64)
    for stage in STAGES:
        states, evals, stats = _bn_run(stage, rank, {})
        worst = max(_close_states(a, b, f"stage {stage}") for a, b in states)
        torch.testing.assert_close(evals[0], evals[1], rtol=0, atol=1e-5)
        # forwards: step 0 (first), step 1's first micro-batch (after a training forward), not
        # its second (after no_sync), the eval (after a training forward), not step 2's
        assert stats["broadcast_calls"] == 3, stats["broadcast_calls"]
        assert stats["broadcast_bytes"] == 3 * nbytes, stats["broadcast_bytes"]
        out[f"stage {stage} worst"] = worst
    states, evals, stats = _bn_run(2, rank, {"broadcast_buffers": False})
    assert stats["broadcast_calls"] == 0 and stats["broadcast_bytes"] == 0, stats
    far = max((a["running_mean"] - b["running_mean"]).abs().max().item() for a, b in states)
    if rank > 0:  # rank 0 is the source: its own are DDP's
        assert far > 1e-3, far
    out["broadcast_buffers=False apart"] = far
    return out


def check_two_forwards(rank: int, world: int) -> dict:
    """Two forwards before one backward (a siamese loss) with BatchNorm: the second forward's
    broadcast writes the running statistics the first forward's autograd node saved, so a write
    that moved their version counter failed the backward ("modified by an inplace operation")
    where DDP runs; now DDP's params and buffers at stages 2 and 3, with the comparison before
    each write (the CPU's way) and without it (a GPU's way)."""
    out = {}
    for stage in (2, 3):
        for compare in (True, False):
            m1, m2, zo, ddp, to = _bn_pair(stage)
            if not compare:
                zo.parts.replicas.compare_on = {}
            for step in range(3):
                for opt, fwd in ((zo, m1), (to, ddp)):
                    opt.zero_grad()
                    a, b = fwd(_x(rank, 2 * step)), fwd(_x(rank, 2 * step + 1))
                    (a - b).pow(2).mean().backward()
                    opt.step()
            worst = _close_states(_bn_state(m1), _bn_state(m2), f"two forwards stage {stage}")
            with _gathered(zo, stage):
                for p1, p2 in zip(m1.parameters(), m2.parameters()):
                    torch.testing.assert_close(p1, p2, rtol=0, atol=1e-5)
            out[f"stage {stage} compare={compare}"] = worst
            zo.close()
    return out


def check_join_buffers(rank: int, world: int) -> dict:
    """Uneven inputs under Join with BatchNorm (rank r has 2 + world - 1 - r batches: the
    highest rank still training, the broadcasts' source, changes as ranks join, and rank 0
    joins last): the buffers of every rank after the context are DDP-under-Join's (the last
    joiner's), the params of the rank that stepped every iteration too, at stages 2 and 3; the
    ranks' params equal."""
    from torch.distributed.algorithms.join import Join

    out = {}
    for stage in (2, 3):
        m1, m2, zo, ddp, to = _bn_pair(stage)
        n = 2 + world - 1 - rank
        with Join([zo]):
            for step in range(n):
                zo.zero_grad()
                m1(_x(rank, step)).pow(2).mean().backward()
                zo.step()
        with Join([ddp]):
            for step in range(n):
                to.zero_grad()
                ddp(_x(rank, step)).pow(2).mean().backward()
                to.step()
        out[f"stage {stage} worst"] = _close_states(
            _bn_state(m1), _bn_state(m2), f"Join stage {stage}"
        )
        with _gathered(zo, stage):
            for p1, p2 in zip(m1.parameters(), m2.parameters()):
                assert torch.equal(p1, _rank0(p1)), "ranks differ after Join"
                if rank == 0:
                    torch.testing.assert_close(p1, p2, rtol=0, atol=1e-6)
        zo.close()
    return out


def replicas_all(rank: int, world: int) -> dict:
    checks = [
        check_start_sync,
        check_start_mismatch,
        check_bn_like_ddp,
        check_two_forwards,
        check_join_buffers,
    ]
    return run_checks(rank, world, checks)
