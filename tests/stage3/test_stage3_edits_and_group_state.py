"""Issue 26 (stage 3 where the peers' tests go): the four defects found there, each against the
expected numbers or DDP, on spawned gloo ranks at world sizes 2 and 3
(tests/stage3/stage3_edit_checks.py,
all checks in one process group per world size) and in-process where no rank is needed."""

import functools

import pytest
import stage3_edit_checks as pf
import torch
from dist_utils import run_workers
from torch import nn
from zero_opt import zero_opt

from zero_kernels.optimizer.materialize import init_module_


@functools.cache
def _results(world: int) -> list[dict]:
    return run_workers(pf.check_all, world, timeout=240)


def _part(world: int, name: str) -> list:
    reps = [r[name] for r in _results(world)]
    for rank, r in enumerate(reps):
        assert not (isinstance(r, dict) and "error" in r), f"rank {rank}:\n{r['error']}"
    return reps


# ---------------------------------------------------------------- 1. edits
@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 3])
def test_edits_of_persistent_and_gathered_units(world):
    for rank, rep in enumerate(_part(world, "edits")):
        assert rep == pf.EDITS_EXPECTED, (rank, rep)


def test_edits_in_process():
    assert pf.check_edits(0, 1) == pf.EDITS_EXPECTED


# ---------------------------------------------------------------- 2. zero_grad(set_to_none=False)
@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 3])
def test_zero_grad_set_to_none_false_matches_ddp(world):
    bad = []
    for rank, rep in enumerate(_part(world, "zero_grad")):
        for case in pf.ZERO_GRAD_CASES:
            r = rep[case]
            if r["rel"] > 1e-6:
                bad.append(f"rank {rank} stage={case[0]} {case[1]} set_to_none={case[2]}: {r}")
            # the case can fail: DDP moves the unused block only when its zero grads are kept
            assert (r["moved"] > 1e-4) == (not case[2]), (case, r)
    assert not bad, "\n".join(bad)


class Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.head = nn.Linear(5, 5), nn.Linear(5, 5), nn.Linear(5, 1)
        self.use_b = True

    def forward(self, x):
        h = torch.tanh(self.a(x))
        if self.use_b:
            h = h + self.b(h)
        return self.head(h).square().mean()


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("set_to_none", [False, True])
def test_zero_grad_set_to_none_in_process(stage, set_to_none):
    """World size 1: the plain torch optimizer is the reference; branch b unused after step 0."""
    m1, m2 = Branchy(), Branchy()
    kw = {"lr": 1e-2, "weight_decay": 0.1}
    zo = zero_opt(m1, torch.optim.AdamW, stage=stage, units=[m1.b] if stage == 3 else None, **kw)
    to = torch.optim.AdamW(m2.parameters(), **kw)
    g = torch.Generator().manual_seed(1)
    for step in range(3):
        x = torch.randn(4, 5, generator=g)
        zo.zero_grad(set_to_none=set_to_none)
        to.zero_grad(set_to_none=set_to_none)
        m1.use_b = m2.use_b = step == 0
        m1(x).backward()
        m2(x).backward()
        zo.step()
        to.step()
    with zo.gathered_params():
        for (n, a), (_, b) in zip(m1.named_parameters(), m2.named_parameters()):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7, msg=n)
    zo.close()


# ---------------------------------------------------------------- 3. meta buffers
@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 3])
def test_meta_buffers_match_init_module(world):
    ref = pf.noise_state(init_module_(pf.NoiseNet(), seed=pf.MB_SEED))
    assert any(k.startswith("buffer") for k in ref)
    for rank, rep in enumerate(_part(world, "meta")):
        for stage, r in rep.items():
            assert r["differ"] == [], (rank, stage, r["differ"])
            assert r["state"] == ref, (rank, stage)  # the same values at every world size


def test_meta_buffers_in_process():
    ref = pf.noise_state(init_module_(pf.NoiseNet(), seed=pf.MB_SEED))
    torch.manual_seed(123)  # the constructor's draws differ from the rule's
    plain = pf.noise_state(pf.NoiseNet())
    assert all(plain[k] != ref[k] for k in ref)
    rep = pf.check_meta_buffers(0, 1)
    for stage, r in rep.items():
        assert r["differ"] == [] and r["state"] == ref, (stage, r["differ"])


# ---------------------------------------------------------------- 4. per-group comm state
@pytest.mark.distributed
def test_group_state_not_inherited_by_a_reused_id():
    for rank, r in enumerate(_part(2, "reused id")):
        assert r["stale"] == [], (rank, r["stale"])


@pytest.mark.distributed
def test_groups_made_and_destroyed():
    assert [r["steps"] for r in _part(2, "churn")] == [10, 10]


@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 3])
def test_subgroup_then_world_group_in_one_process(world):
    for r in _part(world, "subgroup then world"):
        assert len(r["gaps"]) == 6 and max(r["gaps"]) < 1e-5, r
