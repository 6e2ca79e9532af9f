"""FSDP2 checkpoints (torch.distributed.checkpoint of get_state_dict, 2 gloo ranks on the CPU,
fp32 AdamW; tests/checkpoints/fixtures/make_fsdp2_fixtures.py) loaded by
zero_kernels.checkpoint.dcp at world sizes 1, 2 and 3 into every stage (world size 4:
test_migration_world4.py): the loaded params and moments equal FSDP2's own at the save bit for
bit, and the next 3 steps equal FSDP2's own run within 1e-6 (measured 6e-8). Entries are found
by the model's names whatever the top level (``optim``, torchtitan's ``optimizer``, flat keys);
a hostile ``.metadata`` and a truncated item raise CheckpointError naming the file, and nothing
runs."""

from __future__ import annotations

import functools
import importlib.util
import os
import shutil

import pytest
import torch

from zero_kernels import ZeroOptimizer
from zero_kernels.checkpoint import CheckpointError
from zero_kernels.checkpoint.dcp import load_dcp_checkpoint

HERE = os.path.dirname(os.path.abspath(__file__))
FIX = os.path.join(HERE, "fixtures")
CK = os.path.join(FIX, "fsdp2", "step3")
_spec = importlib.util.spec_from_file_location(
    "make_deepspeed_fixtures", os.path.join(FIX, "make_deepspeed_fixtures.py")
)
_fixtures = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_fixtures)
tiny_model = _fixtures.tiny_model


def _ref() -> dict:
    return torch.load(os.path.join(FIX, "fsdp2", "reference.pt"), weights_only=True)


def _new(stage: int):
    torch.manual_seed(7)  # other values than FSDP2's: the load must replace them
    model = tiny_model()
    opt = ZeroOptimizer(
        model, torch.optim.AdamW, stage=stage, lr=1e-2, betas=(0.9, 0.99), weight_decay=0.01
    )
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda e: min(1.0, (e + 1) / 5))
    return model, opt, sched


def _err(model, opt, ref: dict) -> float:
    e = 0.0
    for n, p in model.named_parameters():
        st = opt.full_state(p)
        for k, got in (
            ("fp32", opt.full_param(p)),
            ("exp_avg", st["exp_avg"]),
            ("exp_avg_sq", st["exp_avg_sq"]),
        ):
            e = max(e, (got.float() - ref[n][k]).abs().max().item())
    return e


def resume(stage: int, rank: int, world: int, path: str = CK, probe=None) -> dict:
    """Load the fixture into a fresh model at ``stage``, compare with FSDP2's state at the
    save, take 3 steps of this rank's rows of the global batches; the errors.
    ``probe(model, opt, at_save)``, called right after the load: its result is ``"probe"``."""
    import torch.distributed as dist

    ref = _ref()
    model, opt, sched = _new(stage)
    info = load_dcp_checkpoint(path, model, opt)
    sched.last_epoch = 3  # the run's own step: get_state_dict holds no scheduler
    out = {"at_save": _err(model, opt, ref["at_save"]), "info": info}
    if probe is not None:
        out["probe"] = probe(model, opt, ref["at_save"])
    rows = 12 // world
    losses, lrs = [], []
    for x, y in ref["batches"]:
        x, y = x[rank * rows : (rank + 1) * rows], y[rank * rows : (rank + 1) * rows]
        lrs.append(opt.param_groups[0]["lr"])
        opt.zero_grad()
        loss = (model(x) * model.scale - y).pow(2).mean()
        loss.backward()
        opt.clip_grad_norm_(1.0)
        opt.step()
        sched.step()
        t = loss.detach().clone()
        if world > 1:
            dist.all_reduce(t)
        losses.append(t.item() / world)
    out["after"] = _err(model, opt, ref["after"])
    out["loss"] = max(abs(a - b) for a, b in zip(losses, ref["losses"]))
    out["lr"] = max(abs(a - b) for a, b in zip(lrs, ref["lrs"]))
    out["step"] = float(opt.full_state(next(model.parameters()))["step"])
    opt.close()
    return out


def _worker(rank: int, world: int) -> dict:
    return {s: resume(s, rank, world) for s in (1, 2, 3)}


@functools.cache
def _results(world: int) -> list[dict]:
    if world == 1:
        return [_worker(0, 1)]
    from dist_utils import run_workers

    return run_workers(_worker, world, timeout=240)


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_resume_equals_fsdp2s_own(stage, world):
    for rank, res in enumerate(_results(world)):
        r = res[stage]
        where = f"stage {stage}, world {world}, rank {rank}: {r}"
        assert r["at_save"] == 0.0, where
        assert r["after"] <= 1e-6 and r["loss"] <= 1e-6 and r["lr"] <= 1e-15, where
        assert r["step"] == 6.0, where
        info = r["info"]
        assert info["model_prefix"] == ["model"] and info["optimizer_prefix"] == ["optim"]
        assert info["params_with_state"] == info["params"] == 8 and info["steps"] == 3
        assert "optim.param_groups.0.maximize" in info["unused_keys"]


def test_found_by_names_whatever_the_top_level(tmp_path):
    """torchtitan's "optimizer", the model's values as flat keys at the top level."""
    import torch.distributed.checkpoint as dcp

    from zero_kernels.checkpoint.dcp import read_dcp_checkpoint

    ck = read_dcp_checkpoint(CK)
    flat = {}
    for key in ck.keys:
        v = ck.get(key)
        if key.startswith("model."):
            flat[key.removeprefix("model.")] = v
        elif key.startswith("optim.state."):
            flat.setdefault("optimizer", {}).setdefault("state", {})
            name, k = key.removeprefix("optim.state.").rsplit(".", 1)
            flat["optimizer"]["state"].setdefault(name, {})[k] = v
    flat["optimizer"]["param_groups"] = [
        {
            "lr": ck.get("optim.param_groups.0.lr"),
            "betas": (0.9, 0.99),
            "eps": 1e-8,
            "weight_decay": 0.01,
            "params": [n for n in flat["optimizer"]["state"]],
        }
    ]
    dcp.save(flat, checkpoint_id=str(tmp_path / "flat"), no_dist=True)
    r = resume(2, 0, 1, path=str(tmp_path / "flat"))
    assert r["at_save"] == 0.0 and r["after"] <= 1e-6, r
    assert r["info"]["model_prefix"] == [""] and r["info"]["optimizer_prefix"] == ["optimizer"]


def _copy(tmp_path) -> str:
    dst = tmp_path / "step3"
    shutil.copytree(CK, dst)
    return str(dst)


def test_hostile_metadata_refused_and_not_run(tmp_path):
    d = _copy(tmp_path)
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    import pickle

    with open(os.path.join(d, ".metadata"), "wb") as f:
        pickle.dump(Evil(), f)
    model, opt, _ = _new(2)
    with pytest.raises(CheckpointError, match=r"\.metadata: refused: .*posix\.system"):
        load_dcp_checkpoint(d, model, opt)
    assert not marker.exists()
    opt.close()


def test_truncated_item_named(tmp_path):
    d = _copy(tmp_path)
    f = os.path.join(d, "__1_0.distcp")
    with open(f, "r+b") as fh:
        fh.truncate(os.path.getsize(f) // 2)
    model, opt, _ = _new(3)
    with pytest.raises(CheckpointError, match="__1_0.distcp"):
        load_dcp_checkpoint(d, model, opt)
    opt.close()


def test_missing_param_said(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(12, 24), torch.nn.Linear(24, 2))
    opt = ZeroOptimizer(model, torch.optim.AdamW, stage=1, lr=1e-2)
    with pytest.raises(CheckpointError, match="incompatible model: 1.weight"):
        load_dcp_checkpoint(CK, model, opt)
    opt.close()


# ---------------------------------------------------------------------------- the way back
def _way_back(rank: int, world: int, out: str) -> dict:
    """Ours (loaded from the FSDP2 fixture, stage 3) saved for FSDP2; FSDP2 loads it with its
    own dcp.load + set_state_dict and resumes: equal to its own run."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from zero_kernels.checkpoint.dcp import save_dcp_checkpoint

    model, opt, _ = _new(3)
    load_dcp_checkpoint(CK, model, opt)
    save_dcp_checkpoint(out, model, opt)
    opt.close()
    ref = _ref()
    torch.manual_seed(11)
    fm = tiny_model()
    for m in (fm[0], fm[3]):
        fully_shard(m)
    fully_shard(fm)
    fo = torch.optim.AdamW(fm.parameters(), lr=1e-2, betas=(0.9, 0.99), weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(fo, lambda e: min(1.0, (e + 1) / 5))
    msd, osd = get_state_dict(fm, fo)
    sd = {"model": msd, "optim": osd}
    dcp.load(sd, checkpoint_id=out)
    set_state_dict(fm, fo, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    lr = fo.param_groups[0]["lr"]  # the saved lr (set_state_dict took our groups)
    sched.last_epoch = 3  # the scheduler is the script's own (not in get_state_dict)

    def whole(t):
        return t.full_tensor() if isinstance(t, DTensor) else t

    def err(r):
        e = 0.0
        for n, p in fm.named_parameters():
            st = fo.state[p]
            for k, got in (
                ("fp32", p),
                ("exp_avg", st["exp_avg"]),
                ("exp_avg_sq", st["exp_avg_sq"]),
            ):
                e = max(e, (whole(got).detach() - r[n][k]).abs().max().item())
        return e

    out_err = {"at_save": err(ref["at_save"]), "lr": lr - ref["lr_at_save"]}
    for x, y in ref["batches"]:
        x, y = x[rank * 6 : (rank + 1) * 6], y[rank * 6 : (rank + 1) * 6]
        fo.zero_grad()
        (fm(x) * fm.scale - y).pow(2).mean().backward()
        torch.nn.utils.clip_grad_norm_(fm.parameters(), 1.0)
        fo.step()
        sched.step()
    out_err["after"] = err(ref["after"])
    return out_err


def test_fsdp2_resumes_from_ours(tmp_path):
    from dist_utils import run_workers

    for r in run_workers(_way_back, 2, str(tmp_path / "ours_dcp"), timeout=240):
        assert r["at_save"] == 0.0 and r["lr"] == 0.0 and r["after"] <= 1e-6, r
