"""Checks that run inside spawned gloo workers (see dist_utils.run_workers): ZeroOptimizer
against DDP + the same torch optimizer, step by step. Each ``check_*`` function is one concern
(a dict of details, or an AssertionError naming the optimizer, stage and world); `parity_all`
and `features_all` run many of them in one spawned group (dist_utils.run_checks)."""

from __future__ import annotations

import copy
import math

import torch
import torch.distributed as dist
from dist_utils import run_checks
from numerics import assert_params_close, rel_err
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from zero_opt import zero_opt

from zero_kernels import ZeroOptimizer

# ------------------------------------------------------------------ models


class MLP(nn.Module):
    def __init__(self, bias: bool = True):
        super().__init__()
        self.l1 = nn.Linear(12, 33, bias=bias)  # odd sizes: nothing divides by 2, 3 or 4
        self.l2 = nn.Linear(33, 17, bias=bias)
        self.l3 = nn.Linear(17, 5, bias=bias)

    def forward(self, x):
        return self.l3(torch.tanh(self.l2(torch.tanh(self.l1(x)))))


class TinyLM(nn.Module):
    """A one-layer transformer with tied input/output embeddings."""

    def __init__(self, vocab: int = 29, d: int = 16):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.block = nn.TransformerEncoderLayer(
            d, 2, dim_feedforward=24, dropout=0.0, batch_first=True, bias=False
        )
        # no attention biases: the key bias gets an exactly-zero gradient (softmax shift
        # invariance), i.e. pure rounding noise that Adam-like optimizers blow up to +-lr
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x):
        return self.head(self.norm(self.block(self.emb(x))))


def make_model(kind: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    if kind == "mlp":
        return MLP()
    if kind == "mlp_nobias":
        return MLP(bias=False)
    if kind == "lm":
        return TinyLM()
    raise ValueError(kind)


def batch(kind: str, rank: int, step: int, n: int = 4):
    g = torch.Generator().manual_seed(1000 * step + rank)
    if kind.startswith("mlp"):
        return torch.randn(n, 12, generator=g), torch.randn(n, 5, generator=g)
    x = torch.randint(0, 29, (n, 6), generator=g)
    return x, torch.randint(0, 29, (n, 6), generator=g)


def loss_fn(kind: str, out, y):
    if kind.startswith("mlp"):
        return ((out - y) ** 2).mean()
    return nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


# ------------------------------------------------------------------ user optimizers


class Lamb(torch.optim.Optimizer):
    """LAMB-like: Adam direction scaled per tensor by ||p|| / ||update|| (needs whole tensors)."""

    def __init__(self, params, lr=1e-2, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.01):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        for g in self.param_groups:
            b1, b2 = g["betas"]
            for p in g["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if not st:
                    st["step"] = 0
                    st["m"] = torch.zeros_like(p)
                    st["v"] = torch.zeros_like(p)
                st["step"] += 1
                st["m"].mul_(b1).add_(p.grad, alpha=1 - b1)
                st["v"].mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
                u = st["m"] / (st["v"].sqrt() + g["eps"]) + g["weight_decay"] * p
                pn, un = p.norm(), u.norm()
                trust = float(pn / un) if pn > 0 and un > 0 else 1.0
                p.add_(u, alpha=-g["lr"] * trust)


class SignSGD(torch.optim.Optimizer):
    """A user optimizer declared element-wise: it gets flat shards."""

    zero_elementwise = True

    def __init__(self, params, lr=1e-2):
        super().__init__(params, dict(lr=lr))

    @torch.no_grad()
    def step(self, closure=None):
        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is not None:
                    p.add_(torch.sign(p.grad), alpha=-g["lr"])


O = torch.optim
OPTIMIZERS = [
    (O.SGD, dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01)),
    (O.Adam, dict(lr=1e-2, weight_decay=0.01)),
    (O.AdamW, dict(lr=1e-2, weight_decay=0.1, amsgrad=True)),
    (O.Adamax, dict(lr=1e-2)),
    (O.NAdam, dict(lr=1e-2)),
    (O.RAdam, dict(lr=1e-2)),
    (O.Adagrad, dict(lr=5e-2)),
    (O.Adadelta, dict(lr=1.0)),
    (O.RMSprop, dict(lr=1e-2, momentum=0.5)),
    (O.Rprop, dict(lr=1e-2)),
    (O.ASGD, dict(lr=1e-2, t0=3)),
    (SignSGD, dict(lr=1e-3)),
    (O.Adafactor, dict(lr=1e-2)),
    (Lamb, dict(lr=1e-2)),
    (O.Muon, dict(lr=1e-2)),
]


# ------------------------------------------------------------------ training side by side


def train_pair(
    kind: str,
    cls,
    kw: dict,
    stage: int,
    rank: int,
    steps: int = 10,
    zkw: dict | None = None,
    clip: float | None = None,
    norm_type: float = 2.0,
    sched: bool = False,
    groups=None,
):
    """Train a ZeroOptimizer model and a DDP model side by side; returns both and the worst error
    seen. ``groups(model)`` builds param groups."""
    base = make_model(kind)
    m_z, m_d = copy.deepcopy(base), copy.deepcopy(base)
    zo = zero_opt(
        groups(m_z) if groups else m_z,
        cls,
        stage=stage,
        bucket_size_mb=(zkw or {}).pop("bucket_size_mb", 0.002),
        **(zkw or {}),
        **kw,
    )
    ddp = DDP(m_d)
    to = cls(groups(m_d) if groups else m_d.parameters(), **kw)
    s_z = torch.optim.lr_scheduler.StepLR(zo, 3, gamma=0.5) if sched else None
    s_d = torch.optim.lr_scheduler.StepLR(to, 3, gamma=0.5) if sched else None
    norms = []
    for step in range(steps):
        x, y = batch(kind, rank, step)
        zo.zero_grad()
        to.zero_grad()
        loss_fn(kind, m_z(x), y).backward()
        loss_fn(kind, ddp(x), y).backward()
        if clip is not None:
            nz = zo.clip_grad_norm_(clip, norm_type)
            nd = torch.nn.utils.clip_grad_norm_(m_d.parameters(), clip, norm_type)
            norms.append((float(nz), float(nd)))
        zo.step()
        to.step()
        if sched:
            s_z.step()
            s_d.step()
    to.ddp = ddp  # the DDP wrapper, to continue training
    return m_z, m_d, zo, to, norms


def tol_for(zo) -> float:
    # fp32: 1e-6 relative, for every kernel backend (the native kernel forms 1 - beta in double
    # and rounds once, as torch does)
    return 1e-6


def _bitwise(m1, m2) -> bool:
    return all(torch.equal(a, b) for a, b in zip(m1.parameters(), m2.parameters()))


# ------------------------------------------------------------------ parity
# (test_parity_with_ddp.py)


def check_parity(rank: int, world: int, kinds=("mlp", "lm"), stages=(1, 2)) -> dict:
    """Every optimizer, both stages, MLP and tied-embedding transformer: 10 steps == DDP. Every
    case runs; the failure lists each case that differs."""
    report, bad = {}, []
    for cls, kw in OPTIMIZERS:
        for kind in kinds if cls is not O.Muon else ("mlp_nobias",):  # Muon: 2-D params only
            for stage in stages:
                what = f"{cls.__name__} {kind} stage={stage} world={world}"
                zkw = {}  # Adam/AdamW: the default kernel (native when built)
                if cls is O.AdamW and kind == "mlp" and stage == 2:
                    zkw = {"kernel_backend": "reference"}  # the pure-torch fallback too
                m_z, m_d, zo, _, _ = train_pair(kind, cls, dict(kw), stage, rank, zkw=zkw)
                with zo.gathered_params():  # whole params at stage 3 too
                    try:
                        worst = assert_params_close(m_z, m_d, tol_for(zo), what)
                    except AssertionError as e:
                        bad.append(str(e))
                        continue
                    report[what] = (worst, _bitwise(m_z, m_d), zo.mode)
    assert not bad, "\n".join(bad)
    return report


class PlainSignSGD(SignSGD):
    """SignSGD without the ``zero_elementwise`` declaration: auto gives it whole params."""

    zero_elementwise = None


def _forced(partition, cls, kw, kinds, rank, world):
    """``partition`` forced at stages 1-3 on the models of ``kinds``: that mode, == DDP."""
    for stage in (1, 2, 3):
        for kind in kinds:
            what = f"partition={partition!r} {cls.__name__} {kind} stage={stage} world={world}"
            zkw = {"partition": partition}
            m_z, m_d, zo, _, _ = train_pair(kind, cls, dict(kw), stage, rank, zkw=zkw)
            assert zo.mode == partition, f"{what}: mode {zo.mode!r}"
            with zo.gathered_params():
                assert_params_close(m_z, m_d, 1e-6, what)
            zo.close()


def check_partition_flat(rank: int, world: int) -> dict:
    """partition="flat" forced on an element-wise optimizer that auto gives whole params (a
    user optimizer without ``zero_elementwise``) and on one it would shard anyway: == DDP."""
    auto = ZeroOptimizer(make_model("mlp"), PlainSignSGD, stage=1, lr=1e-3)
    assert auto.mode == "whole", auto.mode  # so "flat" below is the forced path
    auto.close()
    _forced("flat", PlainSignSGD, dict(lr=1e-3), ("mlp", "lm"), rank, world)
    _forced("flat", O.Adam, dict(lr=1e-2), ("lm",), rank, world)
    return {}


def check_partition_whole(rank: int, world: int) -> dict:
    """partition="whole" forced on element-wise optimizers (auto: flat) at stages 1-3 == DDP
    (Adam at stage 2 is in check_forced_modes, at every world size)."""
    _forced("whole", O.AdamW, dict(lr=1e-2, weight_decay=0.1), ("mlp", "lm"), rank, world)
    _forced("whole", O.SGD, dict(lr=0.05, momentum=0.9), ("mlp",), rank, world)
    return {}


class Wide(nn.Module):
    """A 1.2 MB weight (and its gradient): blocks the host block cache would serve (>= 1 MiB)."""

    def __init__(self):
        super().__init__()
        self.l1 = nn.Linear(12, 520)
        self.l2 = nn.Linear(520, 600)
        self.l3 = nn.Linear(600, 5)

    def forward(self, x):
        return self.l3(torch.tanh(self.l2(torch.tanh(self.l1(x)))))


def check_host_cache_off(rank: int, world: int) -> dict:
    """host_cache=False at stages 1-3 == DDP, with blocks above the cache's 1 MiB from glibc:
    the cache is never installed (first in its process: nothing installed it before)."""
    from zero_kernels import hostmem

    assert not hostmem.installed(), "the host block cache was installed before this check"
    for stage in (1, 2, 3):
        torch.manual_seed(0)
        base = Wide()
        m_z, m_d = copy.deepcopy(base), copy.deepcopy(base)
        zo = zero_opt(m_z, O.AdamW, stage=stage, host_cache=False, lr=1e-3)
        ddp = DDP(m_d)
        to = O.AdamW(m_d.parameters(), lr=1e-3)
        for step in range(4):
            x, y = batch("mlp", rank, step)
            zo.zero_grad()
            to.zero_grad()
            loss_fn("mlp", m_z(x), y).backward()
            loss_fn("mlp", ddp(x), y).backward()
            zo.step()
            to.step()
        assert zo.host_cache is False and not hostmem.installed(), f"stage={stage}: installed"
        with zo.gathered_params():
            assert not any(hostmem.owns(p) for p in m_z.parameters()), f"stage={stage}"
            assert_params_close(m_z, m_d, 1e-6, f"host_cache=False stage={stage} world={world}")
        zo.close()
    return {}


# the option variants of the parity run, one optimizer each (the sweep is check_parity's), and
# the world sizes each runs at (3: shards that do not divide the sizes); host_cache=False first,
# before any optimizer of the process installs the cache
PARITY_VARIANTS = {
    check_host_cache_off: (2,),
    check_partition_flat: (2, 3),
    check_partition_whole: (2,),
}


def parity_all(rank: int, world: int) -> dict:
    """test_parity_with_ddp.py: the sweep at every world size (both models at 1-3 ranks, the
    tied-embedding transformer at 4: the MLP adds no case there, only time), the option
    variants at theirs."""
    variants = [c for c, worlds in PARITY_VARIANTS.items() if world in worlds]

    def check_parity_here(rank, world):
        return check_parity(rank, world, kinds=("lm",) if world >= 4 else ("mlp", "lm"))

    check_parity_here.__name__ = "check_parity"
    return run_checks(rank, world, (*variants, check_parity_here))


# ------------------------------------------------------------------ features
# (test_training_features)


def check_clip(rank: int, world: int) -> dict:
    """opt.clip_grad_norm_: the returned norm and the update equal torch's on the unsharded
    model, for p = 2, inf, 1, 3."""
    for stage in (1, 2):
        for p in (2.0, math.inf, 1.0, 3.0):
            m_z, m_d, _, _, norms = train_pair(
                "mlp",
                O.SGD,
                dict(lr=0.1, momentum=0.9),
                stage,
                rank,
                steps=4,
                clip=0.05,
                norm_type=p,
            )
            for nz, nd in norms:
                assert abs(nz - nd) <= 1e-5 * abs(nd), f"clip p={p} stage={stage}: {nz} vs {nd}"
            assert_params_close(m_z, m_d, 1e-6, f"clip p={p} stage={stage}")
    return {}


def _groups(m):
    return [
        {"params": list(m.l1.parameters()), "lr": 0.02, "weight_decay": 0.0},
        {"params": list(m.l2.parameters()) + list(m.l3.parameters()), "weight_decay": 0.3},
    ]


def _train_groups(stage, rank):
    """AdamW over two param groups with their own lr / weight decay, StepLR on both: 7 steps."""
    return train_pair(
        "mlp", O.AdamW, dict(lr=1e-2), stage, rank, steps=7, sched=True, groups=_groups, zkw={}
    )


def check_groups_scheduler(rank: int, world: int) -> dict:
    """Several groups with their own lr / weight decay and StepLR: == DDP, the same lrs."""
    for stage in (1, 2):
        m_z, m_d, zo, to, _ = _train_groups(stage, rank)
        assert_params_close(m_z, m_d, 1e-6, f"groups+StepLR stage={stage}")
        assert [g["lr"] for g in zo.param_groups] == [g["lr"] for g in to.param_groups]
    return {}


def check_consolidated_state(rank: int, world: int) -> dict:
    """consolidated_state_dict == the DDP-side torch optimizer's state_dict (AdamW over groups
    at stages 1 and 2, SGD and Adafactor on the LM at stage 2), loadable by torch."""
    for stage in (1, 2):
        m_z, m_d, zo, to, _ = _train_groups(stage, rank)
        full = zo.consolidated_state_dict(to=world - 1)
        if rank == world - 1:
            ref = to.state_dict()
            _assert_state_close(full, ref, f"consolidated AdamW stage={stage}")
            fresh = O.AdamW(_groups(copy.deepcopy(m_d)), lr=1e-2)
            fresh.load_state_dict(full)
        else:
            assert full is None
    for cls, kw in ((O.SGD, dict(lr=0.1, momentum=0.9)), (O.Adafactor, dict(lr=1e-2))):
        m_z, m_d, zo, to, _ = train_pair("lm", cls, kw, 2, rank, steps=4)
        full = zo.consolidated_state_dict(to=0)
        if rank == 0:
            _assert_state_close(full, to.state_dict(), f"consolidated {cls.__name__}")
            cls(copy.deepcopy(m_d).parameters(), **kw).load_state_dict(full)
    return {}


def check_resume(rank: int, world: int) -> dict:
    """A local shard state_dict round-trips, a consolidated one reloads at this world size, and
    training continues as DDP's."""
    for stage in (1, 2):
        m_z, m_d, zo, to, _ = _train_groups(stage, rank)
        sd = zo.state_dict()
        zo.load_state_dict(sd)
        full0 = zo.consolidated_state_dict(to=0)
        full0 = _broadcast(full0, rank)
        zo.load_state_dict(full0)
        for step in range(7, 10):  # continue both: still equal
            x, y = batch("mlp", rank, step)
            zo.zero_grad()
            to.zero_grad()
            loss_fn("mlp", m_z(x), y).backward()
            loss_fn("mlp", to.ddp(x), y).backward()
            zo.step()
            to.step()
        assert_params_close(m_z, m_d, 1e-6, f"resume from consolidated stage={stage}")
    return {}


def check_forced_modes(rank: int, world: int) -> dict:
    """partition="whole" on Adam == DDP; LBFGS (closure-only) refused, naming it."""
    m_z, m_d, zo, _, _ = train_pair(
        "mlp", O.Adam, dict(lr=1e-2), 2, rank, steps=5, zkw={"partition": "whole"}
    )
    assert zo.mode == "whole"
    assert_params_close(m_z, m_d, 1e-6, "Adam forced whole")
    try:
        ZeroOptimizer(make_model("mlp"), O.LBFGS, stage=1)
        raise AssertionError("LBFGS accepted")
    except NotImplementedError as e:
        assert "LBFGS" in str(e)
    return {}


def _broadcast(obj, rank):
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _assert_state_close(full: dict, ref: dict, what: str) -> None:
    assert set(full["state"]) == set(ref["state"]), (what, set(full["state"]), set(ref["state"]))
    for k, st in ref["state"].items():
        mine = full["state"][k]
        assert set(mine) == set(st), (what, k, set(mine), set(st))
        for key, v in st.items():
            w = mine[key]
            if isinstance(v, torch.Tensor):
                assert w.shape == v.shape, (what, k, key, w.shape, v.shape)
                e = rel_err(w, v)
                assert e <= 1e-5, f"{what}: state[{k}][{key}] rel err {e}"
            else:
                assert w == v, (what, k, key, w, v)
    for g1, g2 in zip(full["param_groups"], ref["param_groups"]):
        assert g1["params"] == g2["params"], (what, g1["params"], g2["params"])
        for key in g2:
            assert key in g1 and g1[key] == g2[key], (what, key, g1.get(key), g2[key])


class OddNet(nn.Module):
    """Frozen, zero-size, tied and sometimes-unused parameters."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(7, 13)
        self.frozen = nn.Linear(13, 13)
        self.frozen.requires_grad_(False)
        self.empty = nn.Parameter(torch.zeros(0))
        self.branch = nn.Linear(13, 13)  # used on even steps only
        self.b = nn.Linear(13, 7, bias=False)
        self.c = nn.Linear(7, 13, bias=False)
        self.c.weight = nn.Parameter(self.b.weight.t().contiguous())
        self.tied = nn.Linear(13, 13, bias=False)
        self.tied2 = self.tied  # the same module twice: tied parameter
        self.use_branch = True

    def forward(self, x):
        h = torch.tanh(self.frozen(self.a(x))) + self.empty.sum()
        if self.use_branch:
            h = h + self.branch(h)
        h = self.tied2(self.tied(h))
        return self.b(h)


def check_odd_params(rank: int, world: int) -> dict:
    """Frozen, zero-size, tied and sometimes-unused params, overlap on and off: == DDP, the
    same grads None, frozen params untouched, ties kept."""
    for stage in (1, 2):
        for overlap in (True, False):
            torch.manual_seed(0)
            base = OddNet()
            m_z, m_d = copy.deepcopy(base), copy.deepcopy(base)
            zo = zero_opt(
                m_z,
                O.AdamW,
                stage=stage,
                bucket_size_mb=0.0004,
                overlap_comm=overlap,
                lr=1e-2,
                weight_decay=0.1,
            )
            ddp = DDP(m_d, find_unused_parameters=True)
            to = O.AdamW(m_d.parameters(), lr=1e-2, weight_decay=0.1)
            frozen_before = m_z.frozen.weight.detach().clone()
            for step in range(6):
                m_z.use_branch = m_d.use_branch = step % 2 == 0
                g = torch.Generator().manual_seed(step * 10 + rank)
                x = torch.randn(5, 7, generator=g)
                zo.zero_grad()
                to.zero_grad()
                m_z(x).pow(2).mean().backward()
                ddp(x).pow(2).mean().backward()
                # a param unused on every rank has grad None under DDP and is left out of the
                # step by torch's AdamW (no weight decay): ZeroOptimizer does the same
                for n, p in m_z.named_parameters():
                    want = dict(m_d.named_parameters())[n].grad
                    assert (p.grad is None) == (want is None), (n, step)
                zo.step()
                to.step()
            what = f"odd params stage={stage} overlap={overlap}"
            assert_params_close(m_z, m_d, 1e-6, what)
            assert torch.equal(m_z.frozen.weight, frozen_before), what
            assert m_z.tied.weight is m_z.tied2.weight
    return {}


def _accumulate(stage, rank, k=3):
    """k micro-batches under no_sync per step against DDP on one k-times larger batch."""
    base = make_model("mlp")
    m_z, m_d = copy.deepcopy(base), copy.deepcopy(base)
    zo = zero_opt(m_z, O.SGD, stage=stage, bucket_size_mb=0.002, lr=0.1, momentum=0.9)
    ddp = DDP(m_d)
    to = O.SGD(m_d.parameters(), lr=0.1, momentum=0.9)
    for step in range(4):
        xs, ys = zip(*(batch("mlp", rank, step * k + j) for j in range(k)))
        zo.zero_grad()
        for j in range(k):
            ctx = zo.no_sync() if j < k - 1 else _null()
            with ctx:
                (loss_fn("mlp", m_z(xs[j]), ys[j]) / k).backward()
        to.zero_grad()
        loss_fn("mlp", ddp(torch.cat(xs)), torch.cat(ys)).backward()
        zo.step()
        to.step()
    return m_z, m_d, zo


def check_accumulation(rank: int, world: int) -> dict:
    """k micro-batches under no_sync == one k-times larger batch."""
    for stage in (1, 2):
        m_z, m_d, _ = _accumulate(stage, rank)
        assert_params_close(m_z, m_d, 1e-6, f"accumulation stage={stage}")
    return {}


def check_collectives(rank: int, world: int) -> dict:
    """One training step's collectives: one reduce-scatter and one all-gather per bucket, of
    bucket size, no all-reduce of gradients; one mask byte per trainable param."""
    out = {}
    for stage in (1, 2):
        m_z, _, zo = _accumulate(stage, rank)
        calls = _trace_collectives(zo, m_z, rank, stage)
        nb = sum(len(b.buckets) for b in zo.layout.buffers)
        sizes = sorted(b.numel(world) for buf in zo.layout.buffers for b in buf.buckets)
        rs = [c for c in calls if c[0] == "reduce_scatter"]
        ag = [c for c in calls if c[0] == "all_gather"]
        ar = [c for c in calls if c[0] == "all_reduce"]
        if world == 1:  # nothing to communicate: comm copies locally
            sizes, nb = [], 0
        assert sorted(n for _, n in rs) == sizes and len(rs) == nb, (stage, rs, sizes)
        assert sorted(n for _, n in ag) == sizes and len(ag) == nb, (stage, ag, sizes)
        assert all(n <= 2 for _, n in ar), (stage, ar)
        # which params have a gradient on any rank: one byte per trainable param per backward
        masks = [n for kind, n in calls if kind == "mask"]
        n_train = sum(1 for p in m_z.parameters() if p.requires_grad)
        assert masks == ([] if world == 1 else [n_train]), (stage, masks, n_train)
        out[f"stage={stage} calls"] = calls
    return out


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def _trace_collectives(zo, model, rank, stage) -> list:
    """Collectives issued during one training step: the optimizer's logical reduce-scatters and
    all-gathers (whatever algorithm comm picks for them) and every all-reduce/reduce that
    reaches torch.distributed."""
    calls = []
    orig = (dist.all_reduce, dist.reduce)

    def ar(t, *a, **k):
        calls.append(("all_reduce", t.numel()) if t.dtype != torch.uint8 else ("mask", t.numel()))
        return orig[0](t, *a, **k)

    def red(t, *a, **k):
        calls.append(("reduce", t.numel()))
        return orig[1](t, *a, **k)

    dist.all_reduce, dist.reduce = ar, red
    zo.comm_log.trace = True
    zo.comm_log.sizes.clear()
    try:
        x, y = batch("mlp", rank, 99)
        zo.zero_grad()
        loss_fn("mlp", model(x), y).backward()
        zo.step()
    finally:
        dist.all_reduce, dist.reduce = orig
        zo.comm_log.trace = False
    if zo.world_size > 1:
        calls += [(kind, n) for kind, n, _ in zo.comm_log.sizes]
    return calls


def check_bf16_masters(rank: int, world: int) -> dict:
    """bf16 params with fp32 masters: the params are exactly the masters rounded, close to
    fp32 training, the same on every rank."""
    for stage in (1, 2):
        base = make_model("mlp")
        m_lp, m_32 = copy.deepcopy(base).to(torch.bfloat16), copy.deepcopy(base)
        z_lp = zero_opt(m_lp, O.AdamW, stage=stage, bucket_size_mb=0.002, lr=1e-2)
        z_32 = zero_opt(m_32, O.AdamW, stage=stage, bucket_size_mb=0.002, lr=1e-2)
        for step in range(5):
            x, y = batch("mlp", rank, step)
            for z, m in ((z_lp, m_lp), (z_32, m_32)):
                z.zero_grad()
                loss_fn("mlp", m(x.to(next(m.parameters()).dtype)), y).float().backward()
                z.step()
        # the bf16 params are exactly the fp32 masters rounded; close to fp32 training
        r = z_lp.parts.core.runner
        for i, buf in enumerate(z_lp.layout.buffers):
            for b in buf.buckets:
                lo = b.shard_start(rank)
                off = b.start // world
                got = z_lp.parts.core.store.flats[i][lo : lo + b.shard_numel]
                want = r.masters[i][off : off + b.shard_numel].to(torch.bfloat16)
                assert torch.equal(got, want), f"bf16 copy-out stage={stage}"
            assert r.masters[i].dtype == torch.float32
        assert_params_close(m_lp, m_32, 3e-2, f"bf16 vs fp32 stage={stage}")
        # every rank holds the same full params
        for p in m_lp.parameters():
            ref = p.detach().float().clone()
            dist.broadcast(ref, 0)
            assert torch.equal(ref, p.detach().float())
    return {}


def check_fp16_overflow_skip(rank: int, world: int) -> dict:
    """fp16 params: dynamic loss scaling by default (2**16); an overflow on one rank skips the
    step on every rank and halves the scale."""
    for stage in (1, 2):
        base = make_model("mlp")
        m16 = copy.deepcopy(base).to(torch.float16)
        z16 = zero_opt(m16, O.Adam, stage=stage, bucket_size_mb=0.002, lr=1e-3)
        assert z16.loss_scale == 2.0**16
        z16.loss_scale = 2.0**8  # 2**16 overflows this model's fp16 grads for real
        for step in range(3):
            x, y = batch("mlp", rank, step)
            before = [p.detach().clone() for p in m16.parameters()]
            z16.zero_grad()
            loss = loss_fn("mlp", m16(x.half()), y.half()).float()
            if step == 1 and rank == world - 1:
                loss = loss * float("inf")
            z16.scale_loss(loss).backward()
            z16.step()
            same = all(torch.equal(a, b) for a, b in zip(before, m16.parameters()))
            assert same == (step == 1), f"fp16 step {step} stage={stage}: unchanged={same}"
        assert z16.skipped_steps == 1 and z16.loss_scale == 2.0**7, (z16.loss_scale,)
    return {}


def _scaled_against_ddp(stage, rank, world, dtype, zkw, scale=None, growth=None, steps=6):
    """Train a ZeroOptimizer model of ``dtype`` with loss scaling (``zkw``: its loss_scale=)
    and an fp32 DDP model (no scaling) side by side; at step 2 the last rank's loss is
    infinite: ZeroOptimizer must skip that step on every rank, so the DDP side skips it too.
    Returns both models, the optimizer, the loss scale after each step and whether each step
    left the params unchanged."""
    base = make_model("mlp")
    m_z, m_d = copy.deepcopy(base).to(dtype), copy.deepcopy(base)
    # SGD, not Adam: Adam's update does not change with the gradient's scale, so a loss scale
    # left in the gradients would go unseen
    kw = dict(lr=0.05, momentum=0.9)
    zo = zero_opt(m_z, O.SGD, stage=stage, bucket_size_mb=0.002, **kw, **zkw)
    ddp = DDP(m_d)
    to = O.SGD(m_d.parameters(), **kw)
    ls = zkw.get("loss_scale", "dynamic" if dtype == torch.float16 else None)  # the default
    if ls == "dynamic":
        assert zo.scaler.dynamic and zo.loss_scale == 2.0**16, (zkw, dtype, zo.loss_scale)
    if scale is not None:
        zo.loss_scale = scale
    if growth is not None:
        zo.growth_interval = growth
    scales, unchanged = [], []
    for step in range(steps):
        x, y = batch("mlp", rank, step)
        with zo.gathered_params():
            before = [p.detach().clone() for p in m_z.parameters()]
        zo.zero_grad()
        to.zero_grad()
        loss = loss_fn("mlp", m_z(x.to(dtype)), y.to(dtype)).float()
        if step == 2 and rank == world - 1:
            loss = loss * float("inf")
        zo.scale_loss(loss).backward()
        loss_fn("mlp", ddp(x), y).backward()
        zo.step()
        if step != 2:
            to.step()
        scales.append(zo.loss_scale)
        with zo.gathered_params():
            unchanged.append(all(torch.equal(a, b) for a, b in zip(before, m_z.parameters())))
    return m_z, m_d, zo, scales, unchanged


def _moved(m_d, base_kind="mlp") -> float:
    """How far DDP training moved the params (relative): an error must stay far below it."""
    base = make_model(base_kind)
    return max(rel_err(a, b) for a, b in zip(m_d.parameters(), base.parameters()))


# fp16 params (SGD on fp32 masters, fp16 forward and gradients) against fp32 DDP after the 5
# steps of _scaled_against_ddp: measured 3.3e-4 to 4.2e-4 relative at 1-4 ranks, stages 1-3 (the
# fp16 forward's rounding, ~2**-11 per op; the same with a static or a dynamic scale). 2e-3 is
# 5x that; DDP moves the params by 0.26-0.51 relative in those steps (_moved, asserted > 0.1),
# so a step lost, applied twice or left scaled is far beyond it
FP16_TOL = 2e-3


def check_loss_scale_static(rank: int, world: int) -> dict:
    """loss_scale=1024.0: fp32 params == DDP without scaling (a power of two: scaling is
    exact) at stages 1-3, fp16 params within FP16_TOL of it (stage 2); an overflow on one rank
    skips the step on every rank and the scale stays."""
    for dtype, stage in (
        (torch.float32, 1),
        (torch.float32, 2),
        (torch.float32, 3),
        (torch.float16, 2),
    ):
        what = f"static loss scale {dtype} stage={stage}"
        zkw = {"loss_scale": 1024.0}
        m_z, m_d, zo, scales, unchanged = _scaled_against_ddp(stage, rank, world, dtype, zkw)
        assert zo.scaler.dynamic is False and scales == [1024.0] * 6, (what, scales)
        assert unchanged == [False, False, True, False, False, False], (what, unchanged)
        assert zo.skipped_steps == 1, (what, zo.skipped_steps)
        tol = 1e-6 if dtype == torch.float32 else FP16_TOL
        assert _moved(m_d) > 50 * FP16_TOL, (what, _moved(m_d))
        with zo.gathered_params():
            assert_params_close(m_z, m_d, tol, what)
        zo.close()
    return {}


def check_loss_scale_dynamic(rank: int, world: int) -> dict:
    """loss_scale="dynamic" with fp32 params (stage 2, == DDP) and the default with fp16 params
    (stages 1 and 3, within FP16_TOL): 2**16 to start, an overflow on one rank skips the step on
    every rank and halves the scale, growth_interval clean steps double it."""
    # growth_interval=2 from 2**8: steps 0, 1 clean (grow after 1), 2 overflows (halve), 3, 4
    # clean (grow after 4), 5 clean
    want = [2.0**8, 2.0**9, 2.0**8, 2.0**8, 2.0**9, 2.0**9]
    for dtype, stage in ((torch.float32, 2), (torch.float16, 1), (torch.float16, 3)):
        zkw = {"loss_scale": "dynamic"} if dtype == torch.float32 else {}
        what = f"dynamic loss scale {dtype} stage={stage}"
        # from 2**8, so that the one overflow is the injected one
        m_z, m_d, zo, scales, unchanged = _scaled_against_ddp(
            stage, rank, world, dtype, zkw, scale=2.0**8, growth=2
        )
        assert zo.skipped_steps == 1, (what, zo.skipped_steps)
        assert scales == want, (what, scales)
        assert unchanged == [False, False, True, False, False, False], (what, unchanged)
        tol = 1e-6 if dtype == torch.float32 else FP16_TOL
        assert _moved(m_d) > 50 * FP16_TOL, (what, _moved(m_d))
        with zo.gathered_params():
            assert_params_close(m_z, m_d, tol, what)
        zo.close()
    return {}


def check_memory(rank: int, world: int) -> dict:
    """Per-rank bytes from the tensors against the DESIGN.md formula (fp32 params, Adam): no
    master copy of fp32 params, stage 1 = one full grad buffer and no separate shard, stage 2 =
    the grad shard + at most ``max_inflight_buckets`` bucket buffers."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(8)])
    psi = sum(p.numel() for p in model.parameters())
    rep = {}
    for stage in (1, 2):
        m = copy.deepcopy(model)
        bucket_mb = 0.005
        zo = zero_opt(m, O.Adam, stage=stage, bucket_size_mb=bucket_mb, lr=1e-3)
        for _ in range(2):
            x = torch.randn(4, 64)
            zo.zero_grad()
            m(x).pow(2).mean().backward()
            zo.step()
        r = zo.memory_report()
        pad = sum(len(b.buckets) for b in zo.layout.buffers) * world * 16 + 16 * len(
            list(model.parameters())
        )
        assert 4 * psi <= r["param_bytes"] <= 4 * (psi + pad)
        assert 8 * psi / world <= r["optim_state_bytes"] <= 8 * (psi + pad) / world + 64 * 8
        # fp32 params: the optimizer steps views of the param buffer, no master copy
        assert r["master_bytes"] == 0, r
        flat_ptrs = [
            (f.untyped_storage().data_ptr(), f.untyped_storage().nbytes())
            for f in zo.parts.core.store.flats
        ]
        for g in zo.parts.core.runner.inner.param_groups:
            for p in g["params"]:
                ptr = p.untyped_storage().data_ptr()
                assert any(ptr == fp for fp, _ in flat_ptrs), "inner param is not a view"
        grads = zo.parts.core.grads
        full_bucket = 4 * grads.bucket_numel
        if stage == 1:
            # the full buffer only; the reduced shard is a view of it
            assert 4 * psi <= r["grad_bytes"] <= 4 * (psi + pad), (r, psi)
            assert grads.shards is None
            full_ptrs = {t.untyped_storage().data_ptr() for t in grads.full}
            assert all(t.untyped_storage().data_ptr() in full_ptrs for t in grads.shard_tensors())
            assert r["comm_buffer_bytes"] == 0, r
        else:
            shard = 4 * psi / world
            assert shard <= r["grad_bytes"] <= 4 * (psi + pad) / world, r
            # the bucket pool: at most max_inflight_buckets (2) buffers, kept between steps
            assert r["comm_buffer_bytes"] <= 2 * full_bucket, (r, full_bucket)
            assert r["comm_buffer_peak_bytes"] <= 2 * full_bucket, (r, full_bucket)
            # each buffer sized to its bucket: never more than the 2 largest buckets together
            assert r["comm_buffer_bytes"] <= 4 * grads.cap_numel, (r, grads.cap_numel)
            assert r["grad_peak_bytes"] <= r["grad_bytes"] + 2 * full_bucket, r
            if world > 1:
                assert r["grad_peak_bytes"] < 4 * psi, r  # never a full-size grad buffer
        assert r["model_state_bytes"] == (
            r["param_bytes"] + r["grad_bytes"] + r["master_bytes"] + r["optim_state_bytes"]
        )
        assert r["total_bytes"] == r["model_state_bytes"] + r["comm_buffer_bytes"]
        rep[f"stage={stage}"] = {"psi": psi, **r}
    return rep


def check_sync_accumulation(rank: int, world: int) -> dict:
    """Two synchronising backwards before a step sum like DDP's (stage 1 reduces in place and
    rebases, stage 2 adds reduced shards); after zero_grad with no backward the grads are 0."""
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(8, 32), nn.Linear(32, 4))
    for stage in (1, 2):
        m1, m2 = copy.deepcopy(base), copy.deepcopy(base)
        zo = zero_opt(m1, O.SGD, stage=stage, bucket_size_mb=0.0005, lr=0.1, momentum=0.9)
        d = DDP(m2)
        so = O.SGD(m2.parameters(), lr=0.1, momentum=0.9)
        for step in range(3):
            zo.zero_grad()
            so.zero_grad()
            for mb in range(2):
                g = torch.Generator().manual_seed(100 * step + 10 * mb + rank)
                x = torch.randn(5, 8, generator=g)
                m1(x).pow(2).mean().backward()
                d(x).pow(2).mean().backward()
            zo.step()
            so.step()
        assert_params_close(m1, m2, 1e-6, f"sync accumulation stage={stage}")
        zo.zero_grad()
        zo.parts.grads.finish_reduction()
        assert all(bool((t == 0).all()) for t in zo.parts.core.grads.shard_tensors()), "stale grads"
    return {}


FEATURE_CHECKS = (
    check_clip,
    check_groups_scheduler,
    check_consolidated_state,
    check_resume,
    check_forced_modes,
    check_odd_params,
    check_accumulation,
    check_collectives,
    check_bf16_masters,
    check_fp16_overflow_skip,
    check_loss_scale_static,
    check_loss_scale_dynamic,
    check_memory,
    check_sync_accumulation,
)


def features_all(rank: int, world: int) -> dict:
    return run_checks(rank, world, FEATURE_CHECKS)
