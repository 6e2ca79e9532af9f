"""The migration fixtures at world size 4: every DeepSpeed checkpoint (stages 1-3, fp32 and bf16,
written by DeepSpeed at world size 2) and the FSDP2 one (DCP, world size 2) loaded by 4 ranks,
in one spawned group, and resumed for the 3 steps their writers took after the save.

Each DeepSpeed fixture meets the stage it has not met at a new world size yet (saved at s; world
3 loads it into s % 3 + 1 in tests/checkpoints/test_deepspeed_migration.py; here the third one),
the FSDP2 fixture every stage. What is checked, per rank:

- the state at the save, whole (``opt.full_param``/``full_state``), equals the writer's bit for
  bit, and so do this rank's own pieces (``opt.sharded_state.pieces()``) at their offsets;
- the load really sharded over 4 ranks: the 4 ranks' pieces cover every param exactly once, and
  none of them is what a rank of 2 holds (the same optimizer built over a subgroup of 2 ranks of
  the same group: its pieces);
- the next 3 steps equal the writer's own resumed run: losses, learning rates, masters and Adam
  moments, within 1e-6 at fp32 and within the bf16 tolerances of the world 1-3 tests (DeepSpeed
  reduces bf16 gradients in bf16, we in fp32).

The global batch of 12 rows splits into 3 rows per rank; the reference losses are the mean over
the writer's ranks of each rank's mean over its rows (equal counts), which is the mean over the 12
rows, and so is the mean over 4 ranks of 3: the comparison stays exact.
"""

from __future__ import annotations

import functools

import pytest
import test_dcp_migration as dcpm
import test_deepspeed_migration as dsm
import torch

WORLD = 4
DS_STAGE = {1: 3, 2: 1, 3: 2}  # saved stage -> the one it meets here (2: saved, 3: s % 3 + 1)

pytestmark = pytest.mark.distributed


def ds_stage(case: str) -> int:
    return DS_STAGE[int(case[5])]


def _probe(model, opt, at_save: dict) -> dict:
    """This rank's pieces after the load: ``(name, offset, numel)`` each, and the largest
    difference of their values and moments from the writer's at the save."""
    ss = opt.sharded_state
    names = {id(p): n for n, p in model.named_parameters()}
    params = ss.params()
    pieces, err = [], 0.0
    for pc in ss.pieces():
        name = names[id(params[pc.index])]
        pieces.append((name, pc.offset, pc.numel))
        if pc.numel == 0:
            continue
        lo, hi = pc.offset, pc.offset + pc.numel
        for key, got in (
            ("fp32", pc.values),
            ("exp_avg", pc.state["exp_avg"]),
            ("exp_avg_sq", pc.state["exp_avg_sq"]),
        ):
            want = at_save[name][key].reshape(-1)[lo:hi]
            err = max(err, (got.detach().float().reshape(-1) - want).abs().max().item())
    return {"world": ss.world_size, "pieces": sorted(pieces), "err": err}


def _pieces_at_2(group, build) -> list:
    """This rank's pieces of the optimizer ``build(group)`` over a subgroup of 2 ranks."""
    model, opt = build(group)
    names = {id(p): n for n, p in model.named_parameters()}
    params = opt.sharded_state.params()
    out = sorted(
        (names[id(params[pc.index])], pc.offset, pc.numel) for pc in opt.sharded_state.pieces()
    )
    opt.close()
    return out


def _ds_build(case: str, stage: int):
    def build(group):
        from zero_kernels import ZeroOptimizer
        from zero_kernels.checkpoint.deepspeed import read_deepspeed_checkpoint
        from zero_kernels.integrations.ds_config import map_deepspeed_config

        m = map_deepspeed_config(read_deepspeed_checkpoint(f"{dsm.DS}/{case}").ds_config)
        model = dsm.tiny_model()
        if m.dtype is not None:
            model.to(m.dtype)
        kw = m.optimizer_kwargs
        return model, ZeroOptimizer(
            model, m.optimizer_class, stage=stage, process_group=group, **kw
        )

    return build


def _dcp_build(stage: int):
    def build(group):
        from zero_kernels import ZeroOptimizer

        model = dsm.tiny_model()
        return model, ZeroOptimizer(
            model, torch.optim.AdamW, stage=stage, process_group=group, lr=1e-2
        )

    return build


def _worker(rank: int, world: int) -> dict:
    import torch.distributed as dist

    out = {}
    for case in dsm.CASES:
        out[("ds", case)] = dsm.resume(case, ds_stage(case), rank, world, probe=_probe)
    for stage in (1, 2, 3):
        out[("dcp", stage)] = dcpm.resume(stage, rank, world, probe=_probe)
    # the same optimizers over 2 ranks: ranks {0, 1} and {2, 3} (every rank makes both groups)
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    pair = pairs[rank // 2]
    for case in dsm.CASES:
        out[("ds2", case)] = _pieces_at_2(pair, _ds_build(case, ds_stage(case)))
    for stage in (1, 2, 3):
        out[("dcp2", stage)] = _pieces_at_2(pair, _dcp_build(stage))
    return out


@functools.cache
def _results() -> list[dict]:
    from dist_utils import run_workers

    return run_workers(_worker, WORLD, timeout=240)


def _check_sharding(kind: str, key, numel: dict) -> None:
    """The 4 ranks' pieces cover each param exactly once, none as a rank of 2 holds them."""
    res = _results()
    probes = [r[(kind, key)]["probe"] for r in res]
    at2 = [r[(kind + "2", key)] for r in res]
    assert all(p["world"] == WORLD for p in probes), [p["world"] for p in probes]
    covered: dict[str, list] = {}
    for rank, p in enumerate(probes):
        assert p["pieces"], f"{kind} {key}: rank {rank} holds nothing"
        for name, off, n in p["pieces"]:
            covered.setdefault(name, []).append((off, n))
    for name, total in numel.items():
        spans = sorted(s for s in covered.get(name, []) if s[1] > 0)
        at = 0
        for off, n in spans:
            assert off == at, f"{kind} {key}: {name} pieces {spans} leave a gap or overlap"
            at += n
        assert at == total, f"{kind} {key}: {name} covered {at} of {total} ({spans})"
    for rank, p in enumerate(probes):
        mine = [s for s in p["pieces"] if s[2] > 0]
        for q, other in enumerate(at2):
            assert mine != [s for s in other if s[2] > 0], (
                f"{kind} {key}: rank {rank} of 4 holds what rank {q % 2} of 2 holds: {mine}"
            )
        held, held2 = sum(s[2] for s in mine), sum(s[2] for s in at2[rank])
        assert held < held2, f"{kind} {key}: rank {rank} holds {held}, a rank of 2 {held2}"


def _numel() -> dict:
    return {n: p.numel() for n, p in dsm.tiny_model().named_parameters()}


@pytest.mark.parametrize("case", dsm.CASES)
def test_deepspeed_fixture_resumes_at_world_4(case):
    dt = case.split("_")[1]
    for rank, res in enumerate(_results()):
        r = res[("ds", case)]
        where = f"{case} -> stage {ds_stage(case)}, world 4, rank {rank}: {r}"
        assert r["at_save"] == 0.0 and r["probe"]["err"] == 0.0, where
        assert r["global_steps"] == 3, where
        assert r["after"] <= dsm.TOL[dt], where
        assert r["loss"] <= dsm.LOSS_TOL[dt], where
        assert r["lr"] <= 1e-15, where
        assert r["step"] == r["step_ref"] == 6, where
    _check_sharding("ds", case, _numel())


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_fsdp2_fixture_resumes_at_world_4(stage):
    for rank, res in enumerate(_results()):
        r = res[("dcp", stage)]
        where = f"stage {stage}, world 4, rank {rank}: {r}"
        assert r["at_save"] == 0.0 and r["probe"]["err"] == 0.0, where
        assert r["after"] <= 1e-6 and r["loss"] <= 1e-6 and r["lr"] <= 1e-15, where
        assert r["step"] == 6.0, where
        assert r["info"]["params_with_state"] == r["info"]["params"] == 8
    _check_sharding("dcp", stage, _numel())
