"""Checks run in 4 spawned gloo ranks by tests/stages/test_tp_checkpoint.py: a checkpoint of a
tensor-parallel model loaded at another tp size ([Note: redistributing across tp sizes] in
zero_kernels/checkpoint/redistribution.py), and consolidated_state_dict under tp.

Every run trains tp_checks.Block on one global batch per step, each dp rank its contiguous
rows (the mean over dp of the local losses is the loss of the whole batch, whatever the dp
size). The reference is the saving run itself: after the save it goes on for two steps; every
load at another tp size (and dp size, stage, or a plain model) takes the same two steps, and
their global losses and whole params must equal the reference's (fp32: the sums run in
another order, so within 1e-6 relative, not bitwise)."""

from __future__ import annotations

import dataclasses
import glob
import os
import shutil

import torch
import torch.distributed as dist
from numerics import rel_err
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from tp_checks import Block, _ckpt_dir, _raises, loss_of

from zero_kernels import ZeroOptimizer
from zero_kernels.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from zero_kernels.policy import ZeroPolicy

TOL = 1e-6  # relative: losses and whole params after the steps that follow a load
ROWS = 8  # rows of the global batch (divisible by every dp size here: 1, 2, 4)
LR = 1e-2
PLAN = {"up": ColwiseParallel(), "down": RowwiseParallel()}
_MESHES: dict = {}


def mesh(dp: int, tp: int):
    """A (dp, tp) mesh over the 4 ranks, made once (every rank makes them in one order)."""
    if (dp, tp) not in _MESHES:
        _MESHES[dp, tp] = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    return _MESHES[dp, tp]


@dataclasses.dataclass
class Run:
    model: nn.Module
    opt: torch.optim.Optimizer
    dp_group: object  # None: the world (or no dp at all: dp_size 1)
    dp_size: int
    dp_rank: int


def build(tp: int, stage: int | None, seed: int, model=Block, plan=None) -> Run:
    """``model`` at tp size ``tp`` (1: a plain model, not parallelized) under a ZeroOptimizer
    at ``stage`` over dp = 4 / tp ranks; ``stage`` None: torch's AdamW, the whole batch on
    every rank (no dp)."""
    torch.manual_seed(seed)
    m = model()
    world = dist.get_world_size()
    if tp == 1:
        group, size, rank = None, world, dist.get_rank()
    else:
        mm = mesh(world // tp, tp)
        parallelize_module(m, mm["tp"], plan or PLAN)
        group, size, rank = mm["dp"].get_group(), world // tp, mm["dp"].get_local_rank()
    if stage is None:
        return Run(m, torch.optim.AdamW(m.parameters(), lr=LR, foreach=False), None, 1, 0)
    pol = ZeroPolicy.resolve(stage=stage, bucket_size_mb=0.001)
    opt = ZeroOptimizer(m, torch.optim.AdamW, policy=pol, process_group=group, lr=LR)
    return Run(m, opt, group, size, rank)


def step(run: Run, s: int) -> float:
    """One step on global batch ``s`` (this dp rank's rows); the loss of the whole batch."""
    g = torch.Generator().manual_seed(100 + s)
    x, y = torch.randn(ROWS, 16, generator=g), torch.randn(ROWS, 4, generator=g)
    n = ROWS // run.dp_size
    rows = slice(run.dp_rank * n, (run.dp_rank + 1) * n)
    loss = loss_of(run.model, x[rows], y[rows])
    loss.backward()
    run.opt.step()
    run.opt.zero_grad()
    total = loss.detach().clone()
    if run.dp_size > 1:
        dist.all_reduce(total, group=run.dp_group)
    return float(total) / run.dp_size


def whole(run: Run) -> dict[str, torch.Tensor]:
    """Every param whole (its global shape), at full precision."""
    if isinstance(run.opt, ZeroOptimizer):
        return {n: run.opt.full_param(p) for n, p in run.model.named_parameters()}
    return {n: p.detach().clone() for n, p in run.model.named_parameters()}


def close(run: Run) -> None:
    if isinstance(run.opt, ZeroOptimizer):
        run.opt.close()


def continuation(run: Run, steps) -> tuple[list[float], dict]:
    losses = [step(run, s) for s in steps]
    return losses, whole(run)


def worst(got, want) -> tuple[float, float, float]:
    """``(worst, losses', params')``: the worst relative errors of ``got = (losses, whole
    params)`` against ``want``, to 2 significant digits."""
    (gl, gp), (wl, wp) = got, want
    assert gp.keys() == wp.keys(), (sorted(gp), sorted(wp))
    loss = max(abs(a - b) / abs(b) for a, b in zip(gl, wl, strict=True))
    param = max(rel_err(gp[n], wp[n]) for n in wp)
    return float(f"{max(loss, param):.2g}"), float(f"{loss:.2g}"), float(f"{param:.2g}")


def _saved_run(root: str, tp: int, stage: int) -> tuple:
    """The reference: two steps at tp ``tp`` and ``stage``, saved under ``root``, then two
    more (their losses and whole params returned)."""
    ref = build(tp, stage, seed=0)
    for s in range(2):
        step(ref, s)
    save_checkpoint(root, ref.model, ref.opt)
    want = continuation(ref, (2, 3))
    close(ref)
    return want


def _rmtree(root: str) -> None:
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(root, ignore_errors=True)


def check_tp2_to_other_sizes(rank, world):
    """Saved at tp 2 x dp 2, stage 2; loaded at tp 4 x dp 1 (stage 3), into the plain model
    (tp 1) at dp 4 (stage 1) and under torch's AdamW (no ZeRO, no dp): the next two steps'
    losses and whole params equal the saving run's."""
    root = _ckpt_dir()
    want = _saved_run(root, 2, 2)
    out = {}
    for label, tp, stage in (("tp4-stage3", 4, 3), ("tp1-stage1", 1, 1), ("tp1-adamw", 1, None)):
        run = build(tp, stage, seed=7)
        load_checkpoint(root, run.model, run.opt)
        out[label] = worst(continuation(run, (2, 3)), want)
        close(run)
    _rmtree(root)
    assert all(v[0] <= TOL for v in out.values()), out
    return out


def check_no_tp_to_tp(rank, world):
    """Saved without tp (the plain model at dp 4, stage 3; and under torch's AdamW, no ZeRO);
    loaded at tp 2 x dp 2 (stage 2) and at tp 4 x dp 1 (stage 1): the next two steps equal
    the saving run's."""
    out = {}
    for saved, loads in (
        ("stage3", (("tp2-stage2", 2, 2), ("tp4-stage1", 4, 1))),
        ("adamw", (("tp2-stage2", 2, 2),)),
    ):
        root = _ckpt_dir()
        want = _saved_run(root, 1, 3 if saved == "stage3" else None)
        for label, tp, stage in loads:
            run = build(tp, stage, seed=7)
            load_checkpoint(root, run.model, run.opt)
            out[f"{saved}->{label}"] = worst(continuation(run, (2, 3)), want)
            close(run)
        _rmtree(root)
    assert all(v[0] <= TOL for v in out.values()), out
    return out


def check_consolidated_state_dict(rank, world):
    """consolidated_state_dict() at tp 2 x dp 2, stage 3: on the ranks of dp rank 0 (both tp
    ranks), torch's format with whole tensors, equal to full_state's; None elsewhere. It
    loads into a ZeroOptimizer at tp 4 (load_state_dict cuts each tp rank's part) and into
    torch's AdamW over the plain model, and both continue as the saving run does."""
    ref = build(2, 3, seed=0)
    for s in range(2):
        step(ref, s)
    sd = ref.opt.consolidated_state_dict()
    full = {n: ref.opt.full_state(p) for n, p in ref.model.named_parameters()}
    params = whole(ref)
    out = {"holds": sd is not None}
    assert (sd is not None) == (ref.dp_rank == 0), (rank, ref.dp_rank, sd is None)
    if sd is not None:
        names = [n for n, _ in ref.model.named_parameters()]
        assert sd["param_groups"][0]["params"] == list(range(len(names))), sd["param_groups"]
        for i, n in enumerate(names):
            st = sd["state"][i]
            assert set(st) == set(full[n]), (n, set(st), set(full[n]))
            for k, v in full[n].items():
                assert st[k].shape == v.shape and torch.equal(st[k], v), (n, k)
            assert st["exp_avg"].shape == params[n].shape, (n, st["exp_avg"].shape)
        out["entries"] = len(names)
    # every rank gets the dict of its dp rank 0 (its tp row)
    box = [sd]
    dist.broadcast_object_list(box, src=dist.get_global_rank(ref.dp_group, 0), group=ref.dp_group)
    sd = box[0]
    want = continuation(ref, (2, 3))
    close(ref)
    for label, tp, stage in (("tp4-stage2", 4, 2), ("tp1-adamw", 1, None)):
        run = build(tp, stage, seed=7)
        for n, p in run.model.named_parameters():
            if isinstance(run.opt, ZeroOptimizer):
                run.opt.set_full_param(p, params[n])
            else:
                with torch.no_grad():
                    p.copy_(params[n])
        run.opt.load_state_dict(sd)
        out[label] = worst(continuation(run, (2, 3)), want)
        close(run)
    assert all(v[0] <= TOL for k, v in out.items() if k.startswith("tp")), out
    return out


class Odd(nn.Module):
    """A dim of 6: even over tp 2, uneven over tp 4 (torch's chunks 2, 2, 2, 0)."""

    def __init__(self):
        super().__init__()
        self.up = nn.Linear(16, 6)
        self.down = nn.Linear(6, 16)
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        return self.head(x + self.down(torch.relu(self.up(x))))


def check_refusals_and_other_placements(rank, world):
    """A dim that tp 4 does not divide (saved at tp 2) raises a CheckpointError on every rank,
    naming the param, the saved placements and tp size and the loading ones. Placements that
    differ but map (up.weight saved Shard(dim=0) at tp 2, loaded Shard(dim=1) at tp 4: the
    plan's Colwise and Rowwise swapped; saved at stage 3) load: the whole params are the saved
    ones."""
    root = _ckpt_dir()
    ref = build(2, 2, seed=0, model=Odd)
    step(ref, 0)
    save_checkpoint(root, ref.model, ref.opt)
    close(ref)
    out = {}
    run = build(4, 2, seed=1, model=Odd)
    out["uneven"] = _raises(
        lambda: load_checkpoint(root, run.model, run.opt),
        CheckpointError,
        "param up.weight",
        "Shard(dim=0)",
        "at tp size 2",
        "at tp size 4",
        "evenly",
    )
    close(run)
    _rmtree(root)
    root = _ckpt_dir()
    ref = build(2, 3, seed=0)  # saved at stage 3
    step(ref, 0)
    save_checkpoint(root, ref.model, ref.opt)
    want = whole(ref)
    close(ref)
    swapped = {"up": RowwiseParallel(), "down": ColwiseParallel()}
    run = build(4, 3, seed=1, plan=swapped)
    assert run.model.up.weight.placements[0].dim == 1, run.model.up.weight.placements
    load_checkpoint(root, run.model, run.opt)
    got = whole(run)
    out["swapped"] = max(rel_err(got[n], want[n]) for n in want)
    # one flipped byte in column 1's rank-1 file: found by the one rank that verifies it,
    # raised on every rank (agreed over dp, then tp), nothing installed
    dist.barrier()
    if rank == 0:
        (d,) = glob.glob(os.path.join(root, "tp1-of-2", "step-*", "rank-00001.safetensors"))
        with open(d, "r+b") as f:
            f.seek(-1, os.SEEK_END)
            b = f.read(1)
            f.seek(-1, os.SEEK_END)
            f.write(bytes([b[0] ^ 1]))
    dist.barrier()
    out["corrupt"] = _raises(
        lambda: load_checkpoint(root, run.model, run.opt), CheckpointError, "sha256"
    )
    assert max(rel_err(whole(run)[n], want[n]) for n in want) == 0.0
    close(run)
    _rmtree(root)
    assert out["swapped"] == 0.0, out
    return out


def _zero_run(tp: int, seed: int, optimizer=torch.optim.AdamW, **fields) -> Run:
    """Block at tp ``tp`` x dp 4 / tp under a ZeroOptimizer of ``optimizer`` at stage 2 and
    policy ``fields``."""
    torch.manual_seed(seed)
    m = Block()
    mm = mesh(dist.get_world_size() // tp, tp)
    parallelize_module(m, mm["tp"], PLAN)
    pol = ZeroPolicy.resolve(stage=2, bucket_size_mb=0.001, **fields)
    opt = ZeroOptimizer(m, optimizer, policy=pol, process_group=mm["dp"].get_group(), lr=LR)
    return Run(m, opt, mm["dp"].get_group(), mm["dp"].size(), mm["dp"].get_local_rank())


def check_int8_moments_and_per_tensor_state(rank, world):
    """int8 moments (state_dtype="int8") saved at tp 2 load at tp 4: decoded from the saved
    blocks and encoded again on the loading rank's (one more rounding: within 1.5e-2 of the
    saved moments, where misplaced elements would be O(1) off). Adafactor's row/column factors
    are per tensor (of a local slice): at another tp size they are refused, naming the entry."""
    out = {}
    root = _ckpt_dir()
    ref = _zero_run(2, 0, state_dtype="int8")
    for s in range(2):
        step(ref, s)
    save_checkpoint(root, ref.model, ref.opt)
    saved = {n: ref.opt.full_state(p) for n, p in ref.model.named_parameters()}
    close(ref)
    run = _zero_run(4, 7, state_dtype="int8")
    load_checkpoint(root, run.model, run.opt)
    got = {n: run.opt.full_state(p) for n, p in run.model.named_parameters()}
    out["int8"] = max(
        rel_err(got[n][k], saved[n][k]) for n in saved for k in ("exp_avg", "exp_avg_sq")
    )
    assert all(int(got[n]["step"]) == 2 for n in got), {n: got[n]["step"] for n in got}
    close(run)
    _rmtree(root)
    root = _ckpt_dir()
    ref = _zero_run(2, 0, torch.optim.Adafactor)
    step(ref, 0)
    save_checkpoint(root, ref.model, ref.opt)
    close(ref)
    run = _zero_run(4, 1, torch.optim.Adafactor)
    out["adafactor"] = _raises(
        lambda: load_checkpoint(root, run.model, run.opt),
        CheckpointError,
        "param up.weight",
        "per tensor",
        "at tp size 2",
        "at tp size 4",
    )
    close(run)
    _rmtree(root)
    assert out["int8"] <= 1.5e-2, out
    return out


CHECKS = [
    "check_tp2_to_other_sizes",
    "check_no_tp_to_tp",
    "check_consolidated_state_dict",
    "check_refusals_and_other_placements",
    "check_int8_moments_and_per_tensor_state",
]


def tp_ckpt_all(rank, world):
    from dist_utils import run_checks

    return run_checks(rank, world, [globals()[c] for c in CHECKS])
