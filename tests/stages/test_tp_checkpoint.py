"""Checkpoints of a tensor-parallel model at another tp size: the mapping of a param's saved
columns onto the loading rank's local tensor (no process group: every placement, size and
element range against torch.chunk), its refusals, and, in one spawned group of 4 gloo ranks
(tests/stages/tp_ckpt_checks.py), loads at tp 4, tp 1 and from a save without tp continuing as
the saving run, and consolidated_state_dict under tp."""

import pytest
import torch
import tp_ckpt_checks
from dist_utils import SharedRun

from zero_kernels.checkpoint import CheckpointError
from zero_kernels.checkpoint.redistribution import param_map, read_piece

TPC = SharedRun(tp_ckpt_checks.tp_ckpt_all, timeout=240)


@pytest.mark.distributed
@pytest.mark.parametrize("check", tp_ckpt_checks.CHECKS)
def test_tp_checkpoint(check):
    TPC.check(4, check)


SHAPE = (6, 8)
LAYOUTS = [  # (placements, tp size); None: a plain param
    (None, 1),
    (["Replicate()"], 2),
    (["Shard(dim=0)"], 2),
    (["Shard(dim=1)"], 2),
    (["Shard(dim=0)"], 3),
    (["Shard(dim=-1)"], 4),
]


def _columns(whole, placements, n):
    if placements is None or placements[0] == "Replicate()":
        return [whole.clone() for _ in range(n)]
    k = int(placements[0][len("Shard(dim=") : -1])
    return [c.contiguous() for c in torch.chunk(whole, n, dim=k)]


@pytest.mark.parametrize("saved", LAYOUTS, ids=lambda x: f"{x[0]}x{x[1]}")
def test_read_piece_every_layout(saved):
    """Every element range of every loading rank's local tensor, for every pair of saved and
    loading layouts: the elements torch.chunk gives that rank, read from the saved columns."""
    whole = torch.randn(SHAPE, generator=torch.Generator().manual_seed(0))
    cols = _columns(whole, *saved)

    def read_flat(c, a, k):
        return cols[c].reshape(-1)[a : a + k].clone()

    checked = 0
    for placements, m in LAYOUTS:
        for q in range(m):
            mine = _columns(whole, placements, m)[q].reshape(-1)
            local = tuple(_columns(whole, placements, m)[q].shape)
            pm = param_map(
                "w", saved[0], [list(c.shape) for c in cols], list(range(saved[1])),
                placements, m, q, SHAPE, local, "meta.json",
            )  # fmt: skip
            for lo in range(mine.numel()):
                for k in {1, 5, mine.numel() - lo}:
                    k = min(k, mine.numel() - lo)
                    out = torch.empty(k)
                    read_piece(pm, read_flat, lo, k, out)
                    assert torch.equal(out, mine[lo : lo + k]), (placements, m, q, lo, k)
                    checked += 1
    assert checked > 900


def _refused(*words, **kw):
    args = dict(
        name="up.weight", saved_placements=["Shard(dim=0)"], shapes=[[3, 16], [3, 16]],
        index=[0, 0], placements=["Shard(dim=0)"], size=4, rank=0, shape=(6, 16),
        local=(2, 16), where="meta.json",
    )  # fmt: skip
    args.update(kw)
    with pytest.raises(CheckpointError) as e:
        param_map(**args)
    for w in words:
        assert w in str(e.value), (w, str(e.value))


def test_refusals_name_param_and_both_sides():
    """Uneven shards on either side, placements other than Shard/Replicate, and whole shapes
    that differ: a CheckpointError naming the param, the saved placements and tp size, and the
    loading ones."""
    both = ("up.weight", "Shard(dim=0)", "at tp size 2", "at tp size 4")
    _refused(*both, "evenly")  # 6 rows over tp 4: torch's chunks 2, 2, 2, 0
    _refused(*both[:3], "uneven", shapes=[[4, 16], [2, 16]], local=(3, 16), size=2)
    _refused("_StridedShard", "up.weight", saved_placements=["_StridedShard(dim=0, sf=2)"])
    _refused("Partial(sum)", "at tp size 4", placements=["Partial(sum)"])
    _refused(
        *both[:3], "Shard(dim=1)", "(6, 16)", "(3, 32)",
        placements=["Shard(dim=1)"], shape=(3, 32), local=(3, 8),
    )  # fmt: skip
