"""Issue 26 (stage 3 where the peers' tests go), on spawned gloo ranks: edits to params kept
whole (``persist_below``) or already gathered, ``zero_grad(set_to_none=False)`` against DDP at
every stage, meta-device buffers against `init_module_`, and per-group comm state across
process groups made and destroyed. Each check returns numbers; the tests compare them."""

from __future__ import annotations

import builtins
import copy
import gc
import importlib
from datetime import timedelta

import stage3_checks as s3
import torch
import torch.distributed as dist
from numerics import rel_err
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from zero_opt import zero_opt

from zero_kernels import comm
from zero_kernels.comm import base as cbase
from zero_kernels.comm import p2p
from zero_kernels.optimizer.materialize import init_module_

O = torch.optim


def _values(t: torch.Tensor) -> list[float]:
    """The distinct values of ``t`` (an edited param holds one)."""
    return sorted(set(t.detach().flatten().tolist()))


# ---------------------------------------------------------------- 1. edits taken at every state
class EditNet(nn.Module):
    """Two units (the blocks) and a one-element param kept whole with ``persist_below=2``; for
    x = ones(1, 8) the loss is 6 * scale + sum(W0 x) + sum(W1 x): every gradient is exact (6 for
    scale, 1 for every weight element)."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(8, 8, bias=False) for _ in range(2))
        self.scale = nn.Parameter(torch.zeros(1))

    def forward(self, x):
        out = 6.0 * self.scale.sum()
        for b in self.blocks:
            out = out + b(x).sum()
        return out


def check_edits(rank: int, world: int) -> dict:
    """Edits inside ``gathered_params(modifier_rank=0)`` of a persistent param, of a unit
    sharded at entry and of a unit already gathered by an outer ``gathered_params``: rank 0's
    values everywhere (other ranks write other values), in the next forward and in the shards
    the next SGD step (lr 1) starts from."""
    torch.manual_seed(0)
    m = EditNet()
    zo = zero_opt(m, O.SGD, stage=3, persist_below=2, lr=1.0, timeout=60)
    out = {
        "persistent": bool(
            zo.parts.core.units.persistent and zo.parts.core.units.persistent.buckets
        )
    }
    mine = rank == 0
    with zo.gathered_params(modifier_rank=0):
        with torch.no_grad():
            m.scale.fill_(1.0 if mine else 50.0 + rank)  # the persistent unit (always gathered)
            m.blocks[0].weight.fill_(2.0 if mine else 40.0 + rank)  # a unit sharded at entry
    with zo.gathered_params(m.blocks[1]):  # gathered for another reason at the inner entry
        with zo.gathered_params(m.blocks[1], modifier_rank=0):
            with torch.no_grad():
                m.blocks[1].weight.fill_(3.0 if mine else 30.0 + rank)
        out["inner exit, still gathered"] = _values(m.blocks[1].weight)
    out["scale between uses"] = _values(m.scale)  # persistent: whole between uses
    out["full before step"] = [_values(zo.full_param(p)) for p in (m.scale, *m.blocks.parameters())]
    zo.zero_grad()
    loss = m(torch.ones(1, 8))
    out["loss"] = float(loss.detach())
    loss.backward()
    zo.step()
    out["scale after step"] = _values(m.scale)
    with zo.gathered_params():
        out["after step"] = [_values(p) for p in (m.scale, *m.blocks.parameters())]
    zo.close()
    return out


EDITS_EXPECTED = {
    "persistent": True,
    "inner exit, still gathered": [3.0],
    "scale between uses": [1.0],
    "full before step": [[1.0], [2.0], [3.0]],
    "loss": 6.0 * 1 + 8 * 8 * 2.0 + 8 * 8 * 3.0,
    "scale after step": [-5.0],
    "after step": [[-5.0], [1.0], [2.0]],
}


# ---------------------------------------------------------------- 2. zero_grad(set_to_none=False)
def _zero_grad_run(rank: int, stage: int, cls, kw: dict, set_to_none: bool) -> dict:
    """Net3 trained 3 steps, its last block unused from the second step on, zero_grad with
    ``set_to_none`` between steps; ours against DDP + the same torch optimizer."""
    torch.manual_seed(0)
    base = s3.Net3()
    m1, m2 = copy.deepcopy(base), copy.deepcopy(base)
    zo = zero_opt(m1, cls, stage=stage, timeout=60, **kw)
    ddp = DDP(m2, find_unused_parameters=True)
    to = cls(m2.parameters(), **kw)
    for step in range(3):
        m1.skip_last = m2.skip_last = step > 0
        zo.zero_grad(set_to_none=set_to_none)
        to.zero_grad(set_to_none=set_to_none)
        x, y = s3._batch(rank, step)
        s3._loss(m1(x), y).backward()
        s3._loss(ddp(x), y).backward()
        zo.step()
        to.step()
        if step == 0:
            first = [p.detach().clone() for p in m2.blocks[-1].parameters()]
    with zo.gathered_params():
        rel = max(rel_err(a, b) for a, b in zip(m1.parameters(), m2.parameters()))
    zo.close()
    # how far DDP moved the unused block after its only step with a gradient (step 0): 0 when
    # set_to_none leaves it out, > 0 when its zero gradients keep it in (momentum)
    last = [p.detach() for p in m2.blocks[-1].parameters()]
    moved = max(float((a - b).abs().max()) for a, b in zip(first, last))
    return {"rel": rel, "moved": moved}


ZERO_GRAD_CASES = [
    (stage, name, set_to_none)
    for stage in (1, 2, 3)
    for name in ("AdamW", "SGD")
    for set_to_none in (False, True)
]
_ZG_OPT = {
    "AdamW": (O.AdamW, {"lr": 1e-2, "weight_decay": 0.1}),
    "SGD": (O.SGD, {"lr": 0.1, "momentum": 0.9}),
}


def check_zero_grad(rank: int, world: int) -> dict:
    out = {}
    for stage, name, set_to_none in ZERO_GRAD_CASES:
        cls, kw = _ZG_OPT[name]
        out[(stage, name, set_to_none)] = _zero_grad_run(rank, stage, cls, kw, set_to_none)
    return out


# ---------------------------------------------------------------- 3. meta buffers = init_module_
MB_D = 8


class Noise(nn.Module):
    """No params, a random buffer drawn by ``reset_parameters()`` (also called by __init__)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("r", torch.empty(MB_D))
        self.reset_parameters()

    def reset_parameters(self):
        with torch.no_grad():
            self.r.normal_()

    def forward(self, h):
        return h + self.r


class NoiseBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(MB_D, MB_D)
        self.noise = Noise()

    def forward(self, h):
        return h + torch.tanh(self.fc(self.noise(h)))


class NoiseNet(nn.Module):
    """Buffer-only modules inside the units (the blocks) and in the root unit."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(NoiseBlock() for _ in range(3))
        self.noise = Noise()
        self.head = nn.Linear(MB_D, 4)

    def forward(self, h):
        for b in self.blocks:
            h = b(h)
        return self.head(self.noise(h))


MB_SEED = 7


def noise_state(m: nn.Module) -> dict:
    """Every param and buffer of ``m`` as lists (exact values)."""
    out = {f"param {n}": p.detach().flatten().tolist() for n, p in m.named_parameters()}
    out.update({f"buffer {n}": b.detach().flatten().tolist() for n, b in m.named_buffers()})
    return out


def check_meta_buffers(rank: int, world: int) -> dict:
    """NoiseNet built on meta (stages 3 and 2) against one built normally + init_module_."""
    out = {}
    ref = noise_state(init_module_(NoiseNet(), seed=MB_SEED))
    for stage in (3, 2):
        with torch.device("meta"):
            m = NoiseNet()
        zo = zero_opt(m, O.AdamW, stage=stage, lr=1e-2, seed=MB_SEED, timeout=60)
        with zo.gathered_params():
            got = noise_state(m)
        zo.close()
        out[stage] = {
            "differ": sorted(k for k in ref if got.get(k) != ref[k]),
            "state": got,
        }
    return out


# ---------------------------------------------------------------- 4. per-group comm state
def _tiny():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 6), nn.Linear(6, 2))


_COMM_MODULES = ("groups", "base", "p2p", "choose", "shm")


class ReusedIds:
    """Inside it, ``id`` in the comm modules reports, for the group objects in ``alias``, the id
    of a group destroyed before them: what CPython does once a group object is freed and its
    address taken by the next one, too rarely for a test to wait for it (here about one new
    group in 20 to 50 reused an id, at 0.1-0.2 s per group)."""

    def __init__(self):
        self.alias: list[tuple[object, int]] = []  # (group object, the id it reports)

    def __call__(self, obj) -> int:
        for o, i in self.alias:
            if o is obj:
                return i
        return builtins.id(obj)

    def __enter__(self) -> ReusedIds:
        for name in _COMM_MODULES:
            importlib.import_module(f"zero_kernels.comm.{name}").id = self
        return self

    def __exit__(self, *exc) -> None:
        for name in _COMM_MODULES:
            mod = importlib.import_module(f"zero_kernels.comm.{name}")
            if getattr(mod, "id", None) is self:
                delattr(mod, "id")


def _new_group():
    return dist.new_group(backend="gloo", timeout=timedelta(seconds=20))


def _destroy(g) -> None:
    dist.barrier(group=g)  # gloo: a group destroyed while a peer still connects breaks its mesh
    dist.destroy_process_group(g)


def check_reused_id(rank: int, world: int) -> dict:
    """New groups at the ids of destroyed ones (`ReusedIds`) see none of their state: not a
    group's algorithm (``set_algorithm``), not a twin's link to its parent, not a probe's
    results, not a p2p tag counter, not the AVG check. Observed without collectives where a
    stale entry would skip one: a global override ("native") stands for "nothing of its own"."""
    stale = []
    with ReusedIds() as ids:
        g, g2 = _new_group(), _new_group()
        twin = comm.twin_group(g)
        comm.set_algorithm("all", "pairwise", group=g)
        comm.choose_algorithm("all_gather", 1 << 16, group=g2)  # probed (collective)
        comm.avg_supported(g)
        for _ in range(5):
            p2p.next_tag(g)
            p2p.next_tag(twin)
        olds = {"group": g, "twin": twin, "probed group": g2}
        assert comm.probe_results(g2), "the probe left no results"
        for o in olds.values():
            _destroy(o)
        news = {}
        for name, o in olds.items():
            news[name] = _new_group()
            ids.alias.append((news[name], builtins.id(o)))
        comm.set_algorithm("all", "native")  # every group without an algorithm of its own
        try:
            for name, h in news.items():
                algo = comm.choose_algorithm("all_gather", 1 << 16, group=h)
                if algo != "native":
                    stale.append(f"{name}: algorithm {algo}")
                if comm.probe_results(h):
                    stale.append(f"{name}: probe results {comm.probe_results(h)}")
                tag = p2p.next_tag(h) - p2p.TAG_BASE
                if tag != 0:
                    stale.append(f"{name}: p2p tag {tag}")
            # a new group's AVG check is a collective on it, not the old group's answer
            calls = []
            real = cbase._reduce_scatter
            cbase._reduce_scatter = lambda *a, **k: calls.append(1) or real(*a, **k)
            try:
                comm.avg_supported(news["group"])
            finally:
                cbase._reduce_scatter = real
            if not calls:
                stale.append("group: the AVG check answered from the old group's entry")
        finally:
            comm.set_algorithm("all", None)
        for h in news.values():
            _destroy(h)
    return {"stale": stale}


def check_group_churn(rank: int, world: int, rounds: int = 10) -> dict:
    """Process groups made and destroyed over and over, a ZeroOptimizer (stages 2 and 3)
    built and stepped on each; every other group gets an algorithm of its own
    (``set_algorithm``: no probe), the others are probed. On rank 0 every new group reports the
    id of the one destroyed before it (`ReusedIds`), on rank 1 its own: state found by id on
    rank 0 only skips the probe there, and its collectives meet others (a hang, bounded here by
    the groups' and the optimizer's 20 s timeouts)."""
    out = {"steps": 0}
    with ReusedIds() as ids:
        prev = None
        for k in range(rounds):
            g = _new_group()
            if rank == 0 and prev is not None:
                ids.alias.append((g, prev))
            prev = ids(g)
            if k % 2 == 0:
                comm.set_algorithm("all", "pairwise", group=g)
            m = _tiny()
            zo = zero_opt(
                m,
                O.AdamW,
                stage=2 + k % 2,
                process_group=g,
                lr=1e-2,
                timeout=20,
                bucket_size_mb=1e-4,
            )
            x = torch.randn(3, 6, generator=torch.Generator().manual_seed(rank))
            zo.zero_grad()
            m(x).sum().backward()
            zo.step()
            zo.close()
            out["steps"] += 1
            _destroy(g)
            del g, zo, m
            gc.collect()
    return out


def check_subgroup_then_world(rank: int, world: int, rounds: int = 6) -> dict:
    """ZeroOptimizers in one process over a new group, then over the world group, in turn
    (torch's ZeroRedundancyOptimizer test of a non-default group, followed by the default one):
    each run gives DDP's params after 3 steps, whatever the earlier optimizers left (probes,
    shared-memory channels, twin groups are per group)."""
    gaps = []
    for k in range(rounds):
        torch.manual_seed(k)
        base = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Linear(16, 2))
        m, ref = copy.deepcopy(base), copy.deepcopy(base)
        g = _new_group() if k % 2 == 0 else None
        zo = zero_opt(m, O.AdamW, stage=1 + k % 3, process_group=g, lr=1e-2, bucket_size_mb=1e-4)
        ddp = nn.parallel.DistributedDataParallel(ref)
        to = O.AdamW(ref.parameters(), lr=1e-2)
        for s in range(3):
            x = torch.randn(4, 6, generator=torch.Generator().manual_seed(10 * s + rank))
            zo.zero_grad()
            to.zero_grad()
            m(x).square().mean().backward()
            ddp(x).square().mean().backward()
            zo.step()
            to.step()
        gaps.append(
            max(
                (zo.full_param(p) - q).abs().max().item()
                for p, q in zip(m.parameters(), ref.parameters())
            )
        )
        zo.close()
        if g is not None:
            _destroy(g)
    return {"gaps": gaps}


# ---------------------------------------------------------------- one process group per world
def check_all(rank: int, world: int) -> dict:
    """Every check above in one process group (world 2 adds the group churn, last: a hang
    there leaves the others' results standing). A check that raises reports its traceback."""
    import traceback

    checks = {
        "edits": check_edits,
        "zero_grad": check_zero_grad,
        "meta": check_meta_buffers,
        "subgroup then world": check_subgroup_then_world,
    }
    if world == 2:
        checks.update({"reused id": check_reused_id, "churn": check_group_churn})
    out = {}
    for name, fn in checks.items():
        try:
            out[name] = fn(rank, world)
        except Exception:
            out[name] = {"error": traceback.format_exc()}
    return out
