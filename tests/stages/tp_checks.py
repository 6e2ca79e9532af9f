"""Checks run in 4 spawned gloo ranks (dp 2 x tp 2) by tests/stages/test_tensor_parallel.py:
ZeroOptimizer over a model parallelized with ``parallelize_module`` on the tp dim of a 2-D
DeviceMesh ([Note: tensor parallelism] in zero_kernels/optimizer/tensor_parallel.py).

The reference is "the DDP of TP": the same TP model, its local gradients all-reduced over dp by
hand and averaged, stepped by torch's AdamW. Each check compares losses and params after a few
steps (gradient accumulation 2), norms against the float64 norm of the reference's whole
gradients (each element once: Shard-placed params summed over tp, Replicate ones and plain
ones once), and the refusals of what is not built."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from dist_utils import run_checks
from numerics import rel_err
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)

from zero_kernels import ZeroOptimizer
from zero_kernels.policy import ZeroPolicy

TOL = 1e-5  # relative, params and losses after the steps (fp32)
STEPS = 3
_MESH = {}


def mesh():
    if "m" not in _MESH:
        _MESH["m"] = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    return _MESH["m"]


class Block(nn.Module):
    """An MLP block with a norm: Colwise up, Rowwise down (its bias Replicate), a plain
    LayerNorm (replicated over tp, not a DTensor) and a plain head."""

    def __init__(self):
        super().__init__()
        self.up = nn.Linear(16, 48)
        self.down = nn.Linear(48, 16)
        self.norm = nn.LayerNorm(16)
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        return self.head(self.norm(x + self.down(torch.nn.functional.gelu(self.up(x)))))


def tp_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    m = Block()
    parallelize_module(m, mesh()["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
    return m


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def batches(step: int):
    """Two micro-batches of this dp rank (the same on both of its tp ranks)."""
    g = torch.Generator().manual_seed(1000 * step + mesh()["dp"].get_local_rank())
    return [(torch.randn(6, 16, generator=g), torch.randn(6, 4, generator=g)) for _ in range(2)]


def loss_of(m, x, y):
    return ((m(x) - y) ** 2).mean()


def ddp_of_tp_grads(m) -> None:
    """The reference's gradient reduction: each local gradient averaged over dp."""
    dp = mesh()["dp"].get_group()
    for p in m.parameters():
        g = local(p.grad)
        dist.all_reduce(g, group=dp)
        g.div_(dist.get_world_size(dp))


def whole_norm(m, norm_type: float = 2.0) -> float:
    """The float64 norm of the reference's whole gradients (DTensors gathered whole)."""
    parts = []
    for p in m.parameters():
        g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        parts.append(g.detach().double().reshape(-1))
    return float(torch.linalg.vector_norm(torch.cat(parts), norm_type))


def zero(m, stage: int, process_group=None, nonfinite=None, **fields):
    """Ours over ``m`` (dp: the mesh's dp group unless given); ``fields``: policy fields."""
    fields.setdefault("bucket_size_mb", 0.001)
    kw = {}
    if nonfinite is not None:
        try:
            pol = ZeroPolicy.resolve(stage=stage, nonfinite=nonfinite, **fields)
        except TypeError:  # a constructor keyword before the policies' migration
            pol, kw = ZeroPolicy.resolve(stage=stage, **fields), {"nonfinite": nonfinite}
    else:
        pol = ZeroPolicy.resolve(stage=stage, **fields)
    pg = mesh()["dp"].get_group() if process_group is None else process_group
    return ZeroOptimizer(m, torch.optim.AdamW, policy=pol, process_group=pg, lr=1e-2, **kw)


def train_both(stage: int, clip: float | None, process_group=None):
    """STEPS steps of ours and the reference (accumulation 2, optional clip); the worst
    relative errors of losses, params and clip norms."""
    ref, ours = tp_model(), tp_model()
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=False)
    opt = zero(ours, stage, process_group)
    worst = {"loss": 0.0, "param": 0.0, "norm": 0.0}
    for step in range(STEPS):
        mbs = batches(step)
        for x, y in mbs:
            loss_of(ref, x, y).backward()
        ddp_of_tp_grads(ref)
        rloss = float(loss_of(ref, *mbs[1]))
        if clip is not None:
            want = whole_norm(ref)
            coef = min(clip / (want + 1e-6), 1.0)  # torch's rule, by the whole norm
            for p in ref.parameters():
                local(p.grad).mul_(coef)
        ropt.step()
        ropt.zero_grad()
        with opt.no_sync():
            loss_of(ours, *mbs[0]).backward()
        loss = loss_of(ours, *mbs[1])
        loss.backward()
        worst["loss"] = max(worst["loss"], abs(float(loss) - rloss) / abs(rloss))
        if clip is not None:
            got = float(opt.clip_grad_norm_(clip))
            worst["norm"] = max(worst["norm"], abs(got - want) / want)
        opt.step()
        opt.zero_grad()
    for (n, a), (_, b) in zip(ours.named_parameters(), ref.named_parameters(), strict=True):
        assert type(a) is type(b), (n, type(a), type(b))
        worst["param"] = max(worst["param"], rel_err(local(a), local(b)))
    opt.close()
    return worst


def check_stages_match_ddp_of_tp(rank, world):
    """Stages 1 and 2 (and the 2-D mesh as process_group=) against the DDP of TP."""
    out = {}
    for stage, pg in ((1, None), (2, None), (2, "mesh")):
        w = train_both(stage, None, mesh() if pg == "mesh" else None)
        out[f"stage{stage}{'-mesh' if pg else ''}"] = w
        assert w["loss"] <= TOL and w["param"] <= TOL, (stage, pg, w)
    return out


def check_clip_whole_model(rank, world):
    """opt.clip_grad_norm_ is the norm of the whole model, each element once, and the clipped
    steps equal the reference clipped by torch (norms 1e-6: fp32 sums against float64)."""
    out = {}
    for stage in (1, 2):
        w = train_both(stage, 0.05)
        out[f"stage{stage}"] = w
        assert w["norm"] <= 1e-6 and w["param"] <= TOL, (stage, w)
    return out


def check_nonfinite_agrees(rank, world):
    """A NaN in one tp rank's slice only: every rank sees the non-finite step (skipped under
    nonfinite='skip'), so the replicas stay equal."""
    m = tp_model()
    opt = zero(m, 2, nonfinite="skip")
    x, y = batches(0)[0]
    tp_rank = mesh()["tp"].get_local_rank()
    loss_of(m, x, y).backward()
    opt.step()  # a finite step first: the params move
    opt.zero_grad()
    moved = [local(p).detach().clone() for p in m.parameters()]
    # a NaN gradient on tp rank 1's slice of up.weight alone (a hook on that rank)
    h = m.up.weight.register_hook(lambda g: g * (math.nan if tp_rank == 1 else 1.0))
    loss_of(m, x, y).backward()
    h.remove()
    opt.step()
    same = all(torch.equal(a, local(b).detach()) for a, b in zip(moved, m.parameters()))
    assert same, f"tp rank {tp_rank}: the step with a NaN on tp rank 1 moved the params"
    assert opt.skipped_steps == 1, opt.skipped_steps
    opt.close()
    return {"skipped": opt.skipped_steps}


CHECKS = [
    "check_stages_match_ddp_of_tp",
    "check_clip_whole_model",
    "check_nonfinite_agrees",
]


def tp_all(rank, world):
    return run_checks(rank, world, [globals()[c] for c in CHECKS])
