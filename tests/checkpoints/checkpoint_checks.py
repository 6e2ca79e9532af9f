"""Checkpoint checks that run inside spawned gloo workers (see dist_utils.run_workers).

[Note: the round-trip matrix]
A *config* is (optimizer, stage, mode, precision): stages 0 (DDP + the torch optimizer), 1, 2, 3,
flat and whole partitions, fp32 and bf16 params (bf16 with fp32 masters under ZeRO; a bf16 model
with bf16 state under DDP), AdamW (the fused kernel in flat mode, torch's per piece in whole mode)
and Adafactor (per-tensor state, whole only). One spawned world of size W runs `check_matrix`:

1. every config trains K steps from one init, saves to ``root/w<W>-<config>`` (the state it saved
   goes next to it as ``ref.pt``), then trains M more steps without interruption: the reference
   ``ref[config]`` of this world size;
2. every checkpoint saved by the previous world size is loaded into another config of this world
   (``rotate``: another stage, the other partition mode), and so is every checkpoint of this world
   (``rotate_back``, the opposite direction) and, for the bitwise check, into its own config;
3. after each load, the loaded state equals the saved one (params at full precision, every state
   entry, hyper-parameters; exactly, after a cast to the loading side's dtype), ``extra`` comes
   back, and the next M steps equal ``ref`` of the loading config: bitwise when the config and the
   world size are the same, else within 1e-6 relative (fp32: each rank takes its share of one
   global batch; bf16: every rank the same batch, so the reduced gradient does not depend on the
   world size). A bf16 DDP run (bf16 state) and a bf16 ZeRO run (fp32 masters) compute different
   things: between them only the state is compared, and so between bf16 DDP runs of different
   world sizes (DDP reduces bf16 gradients in bf16).

The test runs worlds 1, 2, 3, 4, 1 in turn: every world size is saved and loaded at another one.
The load side's model is built from another seed, so everything must come from the checkpoint:
trainable params, the frozen param, the buffer (a call counter the forward uses), the scheduler.
"""

from __future__ import annotations

import os
import random

import torch
import torch.distributed as dist
from numerics import rel_err
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from zero_opt import zero_opt

import zero_kernels as zk
from zero_kernels import ZeroOptimizer

K, M = 3, 3  # steps before the save, steps after it
GLOBAL_BATCH = 12  # divisible by 1, 2, 3 and 4


class Net(nn.Module):
    """Odd sizes, a frozen param, a buffer the forward reads and updates."""

    def __init__(self, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.l1 = nn.Linear(12, 33)
        self.l2 = nn.Linear(33, 17)
        self.l3 = nn.Linear(17, 5)
        self.frozen = nn.Parameter(torch.randn(5), requires_grad=False)
        self.register_buffer("calls", torch.zeros((), dtype=torch.float32))

    def forward(self, x):
        self.calls += 1
        h = torch.tanh(self.l2(torch.tanh(self.l1(x))))
        return self.l3(h) * (1 + 0.01 * self.calls) + self.frozen


def groups_of(m: Net) -> list[dict]:
    return [
        {"params": list(m.l1.parameters()), "lr": 2e-2, "weight_decay": 0.0},
        {"params": list(m.l2.parameters()) + list(m.l3.parameters()), "weight_decay": 0.1},
    ]


CONFIGS = [
    (opt, stage, mode, prec)
    for prec in ("fp32", "bf16")
    for opt, stage, mode in (
        ("adamw", 0, "flat"),
        ("adamw", 1, "flat"),
        ("adamw", 1, "whole"),
        ("adamw", 2, "flat"),
        ("adamw", 2, "whole"),
        ("adamw", 3, "flat"),
        ("adamw", 3, "whole"),
    )
] + [
    ("adafactor", 0, "whole", "fp32"),
    ("adafactor", 1, "whole", "fp32"),
    ("adafactor", 2, "whole", "fp32"),
]

_CYCLE = {
    "adamw": [
        (0, "flat"),
        (1, "whole"),
        (2, "flat"),
        (3, "whole"),
        (1, "flat"),
        (2, "whole"),
        (3, "flat"),
    ],
    "adafactor": [(0, "whole"), (2, "whole"), (1, "whole")],
}


def rotate(c, by: int = 1):
    opt, stage, mode, prec = c
    cyc = _CYCLE[opt]
    s, m = cyc[(cyc.index((stage, mode)) + by) % len(cyc)]
    return (opt, s, m, prec)


def label(c) -> str:
    opt, stage, mode, prec = c
    return f"{opt}-s{stage}-{mode}-{prec}"


def build(c, seed: int = 0):
    opt, stage, mode, prec = c
    m = Net(seed)
    if prec == "bf16":
        m = m.to(torch.bfloat16)
    cls, kw = (
        (torch.optim.AdamW, dict(lr=1e-2))
        if opt == "adamw"
        else (torch.optim.Adafactor, dict(lr=1e-2))
    )
    if stage == 0:
        wrapped = DDP(m) if dist.is_initialized() else m
        o = cls(groups_of(m), **kw)
        # DDP re-orders its bucket after the first backward (and so the order of the sums at
        # world size >= 3): one backward first, so a resumed run and the uninterrupted one reduce
        # alike
        x = torch.zeros(1, 12, dtype=next(m.parameters()).dtype)
        wrapped(x).float().sum().backward()
        o.zero_grad()
        m.calls.zero_()
    else:
        wrapped = m
        o = zero_opt(
            groups_of(m),
            cls,
            stage=stage,
            partition=mode,
            bucket_size_mb=0.0004,
            module=m if stage == 3 else None,
            **kw,
        )
    sched = torch.optim.lr_scheduler.StepLR(o, 2, gamma=0.5)
    return wrapped, m, o, sched


def batch(c, rank: int, world: int, step: int):
    g = torch.Generator().manual_seed(step)
    x = torch.randn(GLOBAL_BATCH, 12, generator=g)
    y = torch.randn(GLOBAL_BATCH, 5, generator=g)
    if c[3] == "bf16":  # every rank the same batch (see [Note: the round-trip matrix])
        return x.bfloat16(), y.bfloat16()
    n = GLOBAL_BATCH // world
    return x[rank * n : (rank + 1) * n], y[rank * n : (rank + 1) * n]


def train(c, wrapped, o, sched, rank, world, steps) -> None:
    for step in steps:
        x, y = batch(c, rank, world, step)
        o.zero_grad()
        ((wrapped(x) - y) ** 2).float().mean().backward()
        o.step()
        sched.step()


def snapshot(m: Net, o) -> dict:
    """Name -> the params at full precision (fp32 masters under ZeRO), on every rank."""
    out = {}
    for n, p in m.named_parameters():
        if not p.requires_grad:
            out[n] = p.detach().clone()
        elif isinstance(o, ZeroOptimizer):
            out[n] = o.full_param(p)
        else:
            out[n] = p.detach().clone()
    out["calls"] = m.calls.clone()
    return out


def full_state(m: Net, o) -> dict | None:
    """On rank 0: {"state": name -> {key: value}, "groups": [...]}; None elsewhere."""
    names = {id(p): n for n, p in m.named_parameters()}
    if isinstance(o, ZeroOptimizer):
        sd = o.consolidated_state_dict(to=0)
        if sd is None:
            return None
        by_index = {i: names[id(p)] for i, p in o.parts.core.params.items()}
    else:
        if dist.is_initialized() and dist.get_rank() != 0:
            return None
        sd = o.state_dict()
        ps = [p for g in o.param_groups for p in g["params"]]
        by_index = {i: names[id(p)] for i, p in enumerate(ps)}
    # the fp32 masters a ZeroOptimizer's consolidated dict carries for bf16/fp16 params
    # ("fp32_master", see zero_kernels/partition/state.py) are the params' values, which the
    # checks compare apart (a plain torch optimizer has none)
    state = {
        by_index[int(i)]: {k: v for k, v in st.items() if k != "fp32_master"}
        for i, st in sd["state"].items()
    }
    groups = [
        {k: v for k, v in g.items() if k not in ("params", "param_names")}
        for g in sd["param_groups"]
    ]
    return {"state": state, "groups": groups}


def assert_same_state(got: dict, want: dict, what: str) -> None:
    """``got`` (loaded) equals ``want`` (saved), exactly after casting to ``got``'s dtypes."""
    assert set(got["state"]) == set(want["state"]), (what, set(got["state"]), set(want["state"]))
    for n, st in want["state"].items():
        mine = got["state"][n]
        assert set(mine) == set(st), (what, n, set(mine), set(st))
        for k, v in st.items():
            w = mine[k]
            if isinstance(v, torch.Tensor):
                assert w.shape == v.shape, (what, n, k, w.shape, v.shape)
                assert torch.equal(w, v.to(w.dtype)), f"{what}: state {n}[{k}] differs"
            else:
                assert w == v, (what, n, k, w, v)
    for g1, g2 in zip(got["groups"], want["groups"]):
        for k, v in g2.items():
            if k in ("foreach", "fused", "differentiable", "capturable", "maximize"):
                continue
            assert g1.get(k) == v, f"{what}: param group {k} = {g1.get(k)!r}, saved {v!r}"


def _same_family(a, b, world_a: int, world_b: int) -> bool:
    """Whether runs of configs a and b compute the same thing (see the Note)."""
    if a[3] == "fp32":
        return True
    if (a[1] == 0) != (b[1] == 0):
        return False
    return a[1] != 0 or world_a == world_b


def _compare(got: dict, ref: dict, bitwise: bool, what: str) -> float:
    worst = 0.0
    for n, want in ref.items():
        g = got[n]
        if bitwise:
            assert torch.equal(g, want), f"{what}: {n} not bitwise equal ({rel_err(g, want):.3g})"
        e = rel_err(g, want)
        worst = max(worst, e)
        assert e <= 1e-6, f"{what}: {n} rel err {e:.3g} > 1e-6"
    return worst


def _save_one(c, rank, world, root) -> dict:
    wrapped, m, o, sched = build(c)
    train(c, wrapped, o, sched, rank, world, range(K))
    d = os.path.join(root, f"w{world}-{label(c)}")
    torch.manual_seed(1000 + rank)  # each rank's generator differs
    zk.save_checkpoint(d, wrapped, o, scheduler=sched, extra={"step": K, "pos": (K, c[0])})
    ref_rng = torch.rand(3)  # what this rank draws next after a restore
    st = full_state(m, o)
    params = snapshot(m, o)
    if rank == 0:
        torch.save({"state": st, "params": params}, os.path.join(d, "ref.pt"))
    train(c, wrapped, o, sched, rank, world, range(K, K + M))
    ref = snapshot(m, o)
    if isinstance(o, ZeroOptimizer):
        o.close()
    return {"ref": ref, "rng": ref_rng}


def _load_one(c_saved, world_saved, c, rank, world, root, refs, rng_after: torch.Tensor | None):
    what = f"{label(c_saved)} w{world_saved} -> {label(c)} w{world}"
    wrapped, m, o, sched = build(c, seed=1)
    d = os.path.join(root, f"w{world_saved}-{label(c_saved)}")
    torch.manual_seed(7)  # scrambled: the load restores the saved rank's generator
    extra = zk.load_checkpoint(d, wrapped, o, scheduler=sched)
    assert extra == {"step": K, "pos": (K, c_saved[0])}, (what, extra)
    if rng_after is not None:
        assert torch.equal(torch.rand(3), rng_after), f"{what}: RNG state not restored"
    got = full_state(m, o)
    snap = snapshot(m, o)
    if rank == 0:
        saved = torch.load(os.path.join(d, "ref.pt"), weights_only=False)
        assert_same_state(got, saved["state"], what)
        for n, v in saved["params"].items():
            assert torch.equal(snap[n], v.to(snap[n].dtype)), f"{what}: param {n} differs"
    assert sched.last_epoch == K, (what, sched.last_epoch)
    train(c, wrapped, o, sched, rank, world, range(K, K + M))
    out = {"what": what, "continued": False, "bitwise": False, "err": None}
    if _same_family(c_saved, c, world_saved, world):
        bitwise = c == c_saved and world == world_saved
        out["err"] = _compare(snapshot(m, o), refs[c]["ref"], bitwise, what)
        out["continued"], out["bitwise"] = True, bitwise
    if isinstance(o, ZeroOptimizer):
        o.close()
    return out


def check_matrix(rank: int, world: int, root: str, prev_world: int | None) -> list[dict]:
    """See [Note: the round-trip matrix]."""
    refs = {c: _save_one(c, rank, world, root) for c in CONFIGS}
    dist.barrier()
    done = []
    for c in CONFIGS:
        if prev_world is not None:
            done.append(_load_one(c, prev_world, rotate(c), rank, world, root, refs, None))
        done.append(_load_one(c, world, rotate(c, -1), rank, world, root, refs, refs[c]["rng"]))
        done.append(_load_one(c, world, c, rank, world, root, refs, refs[c]["rng"]))
    return done


# ---------------------------------------------------------------------------- single process
def save_loop(root: str, start: int) -> None:
    """Save forever (the kill test): checkpoint s holds params all equal to s."""
    torch.set_num_threads(1)
    random.seed(0)
    m, o = small_pair(stepped=True)
    s = start
    while True:
        with torch.no_grad():
            for p in m.parameters():
                p.fill_(s)
        zk.save_checkpoint(root, m, o, extra={"step": s}, keep_last=2)
        s += 1


def save_crashing(root: str, start: int, crash_at: int) -> None:
    """Save step ``start`` completely, then save ``start + 1`` and die (SIGKILL) at its
    ``crash_at``-th durable file operation (fsync, rename, directory removal)."""
    import shutil
    import signal

    torch.set_num_threads(1)
    m, o = small_pair(stepped=True)
    count = [0]

    def deadly(fn):
        def f(*a, **k):
            count[0] += 1
            if count[0] == crash_at:
                os.kill(os.getpid(), signal.SIGKILL)
            return fn(*a, **k)

        return f

    for s in (start, start + 1):
        with torch.no_grad():
            for p in m.parameters():
                p.fill_(s)
        if s == start + 1:
            os.fsync, os.replace, shutil.rmtree = (
                deadly(os.fsync),
                deadly(os.replace),
                deadly(shutil.rmtree),
            )
        zk.save_checkpoint(root, m, o, extra={"step": s}, keep_last=2)


def small_pair(stepped: bool = False):
    """A Linear(64, 64) with SGD + momentum; ``stepped``: after one step (momentum state)."""
    m = nn.Linear(64, 64)
    with torch.no_grad():
        for p in m.parameters():
            p.fill_(-1.0)
    o = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    if stepped:
        for p in m.parameters():
            p.grad = torch.ones_like(p)
        o.step()
    return m, o


# ---------------------------------------------------------------------------- lost ranks
def check_lost_rank(rank: int, world: int, root: str, how: str) -> dict:
    """Rank 1 stalls (SIGSTOP) before the save, or stalls inside it after writing nothing, or
    raises before it: every other rank's save raises a CheckpointError within the optimizer's
    timeout naming the step and the phase. Rank 0 wakes rank 1 up (SIGCONT) afterwards."""
    import signal
    import time

    from zero_kernels.checkpoint import save as save_mod

    c = ("adamw", 2, "flat", "fp32")
    m = Net(0)
    o = zero_opt(m, torch.optim.AdamW, stage=2, bucket_size_mb=0.0004, lr=1e-2, timeout=2)
    sched = torch.optim.lr_scheduler.StepLR(o, 2)
    train(c, m, o, sched, rank, world, range(2))
    zk.save_checkpoint(root, m, o)  # every rank there: the control group is made
    pids = [None] * world
    dist.all_gather_object(pids, os.getpid())
    if rank == 1:
        if how == "sigstop":
            os.kill(os.getpid(), signal.SIGSTOP)  # rank 0 sends SIGCONT once it has raised
            return {"rank": 1}
        if how == "raise":
            return {"rank": 1}  # "raised and caught": never reaches the save
        if how == "stall_in_save":
            real = save_mod._write_rank

            def slow(ad, tmp):
                time.sleep(8)
                return real(ad, tmp)

            save_mod._write_rank = slow
            try:
                zk.save_checkpoint(root, m, o)
            except zk.CheckpointError as e:
                return {"rank": 1, "late": str(e)}
            return {"rank": 1}
    t0 = time.monotonic()
    try:
        zk.save_checkpoint(root, m, o, extra={"step": 7})
        raise AssertionError("save_checkpoint returned with a rank missing")
    except zk.CheckpointError as e:
        msg, dt = str(e), time.monotonic() - t0
    finally:
        if how == "sigstop":
            os.kill(pids[1], signal.SIGCONT)
    assert "save at step 7" in msg, msg
    # the previous checkpoint is still the latest and loads (on this rank alone)
    from zero_kernels.checkpoint import format as fmt

    assert fmt.read_latest(root) == "step-00000002", os.listdir(root)
    return {"rank": rank, "seconds": dt, "error": msg}
