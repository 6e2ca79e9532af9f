"""DeepSpeed checkpoints (zero_kernels.checkpoint.deepspeed) written by real DeepSpeed 0.19.8 (CPU
accelerator, gloo, 2 ranks; tests/checkpoints/fixtures/make_deepspeed_fixtures.py) at stages
1-3, fp32 and bf16, loaded at world size 1 into every stage, at 2 into the saved stage and at 3
into another (at 4 into the third: test_migration_world4.py): the loaded fp32 masters and Adam
moments equal DeepSpeed's own at the save bit for bit, and the next 3 steps equal DeepSpeed's
own resumed run (losses, learning rates, masters, moments, step count): fp32 within 1e-6
(measured 1.2e-7); bf16 within 5e-4 on the state and 2e-3 on the loss (DeepSpeed reduces bf16
gradients in bf16, we in fp32: measured 7.3e-5 on the masters, 9.2e-5 at world size 4). A
hostile pickle and a truncated file raise CheckpointError naming the file, and nothing runs. The
conversion to our format, inspect and the CLI. DeepSpeed is not needed (the fixture test
regenerates the fixtures where it is installed)."""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import os
import shutil
import subprocess
import sys

import pytest
import torch

from zero_kernels import ZeroOptimizer
from zero_kernels.checkpoint import CheckpointError, load_checkpoint
from zero_kernels.checkpoint.deepspeed import load_deepspeed_checkpoint, read_deepspeed_checkpoint
from zero_kernels.checkpoint.deepspeed_convert import convert_deepspeed_checkpoint
from zero_kernels.integrations.ds_config import map_deepspeed_config

HERE = os.path.dirname(os.path.abspath(__file__))
FIX = os.path.join(HERE, "fixtures")
DS = os.path.join(FIX, "deepspeed")
# the fixture script by its path (its folder on sys.path would make fixtures/deepspeed a
# namespace package named deepspeed)
_spec = importlib.util.spec_from_file_location(
    "make_deepspeed_fixtures", os.path.join(FIX, "make_deepspeed_fixtures.py")
)
_fixtures = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_fixtures)
tiny_model = _fixtures.tiny_model

CASES = [f"stage{s}_{d}" for s in (1, 2, 3) for d in ("fp32", "bf16")]
TOL = {"fp32": 1e-6, "bf16": 5e-4}
LOSS_TOL = {"fp32": 1e-6, "bf16": 2e-3}


def _full(opt, p) -> dict:
    st = opt.full_state(p)
    fp32 = opt.full_param(p)  # the fp32 master of bf16 params
    return {
        "fp32": fp32.float(),
        "exp_avg": st["exp_avg"].float(),
        "exp_avg_sq": st["exp_avg_sq"].float(),
        "step": st["step"],
    }


def _err(model, opt, ref: dict) -> float:
    e = 0.0
    for n, p in model.named_parameters():
        got = _full(opt, p)
        for k in ("fp32", "exp_avg", "exp_avg_sq"):
            e = max(e, (got[k].reshape(-1) - ref[n][k].reshape(-1)).abs().max().item())
    return e


def resume(
    case: str, stage: int, rank: int, world: int, path: str | None = None, probe=None
) -> dict:
    """Load fixture ``case`` into a fresh model at ``stage``, compare with DeepSpeed's state
    at the save, take 3 steps of this rank's rows of the global batches; the errors.
    ``probe(model, opt, at_save)``, called right after the load: its result is ``"probe"``."""
    import torch.distributed as dist

    d = path or os.path.join(DS, case)
    ref = torch.load(os.path.join(DS, case, "reference.pt"), weights_only=True)
    ck = read_deepspeed_checkpoint(d)
    m = map_deepspeed_config(ck.ds_config)
    torch.manual_seed(123)  # other values than DeepSpeed's: the load must replace them
    model = tiny_model()
    if m.dtype is not None:
        model.to(m.dtype)
    opt = ZeroOptimizer(model, m.optimizer_class, stage=stage, **m.optimizer_kwargs)
    sched = m.scheduler(opt)
    info = load_deepspeed_checkpoint(d, model, opt, scheduler=sched)
    out = {"at_save": _err(model, opt, ref["at_save"]), "global_steps": info["global_steps"]}
    if probe is not None:
        out["probe"] = probe(model, opt, ref["at_save"])
    rows = 12 // world
    losses, lrs = [], []
    for x, y in ref["batches"]:
        x, y = x[rank * rows : (rank + 1) * rows], y[rank * rows : (rank + 1) * rows]
        lrs.append(opt.param_groups[0]["lr"])
        opt.zero_grad()
        loss = (model(x.to(m.dtype or torch.float32)).float() * model.scale - y).pow(2).mean()
        loss.backward()
        opt.clip_grad_norm_(m.clip_grad_norm)
        opt.step()
        sched.step()
        t = loss.detach().clone()
        if world > 1:
            dist.all_reduce(t)
        losses.append(t.item() / world)
    out["after"] = _err(model, opt, ref["after"])
    out["loss"] = max(abs(a - b) for a, b in zip(losses, ref["losses"]))
    out["lr"] = max(abs(a - b) for a, b in zip(lrs, ref["lrs"]))
    out["step"] = float(_full(opt, next(model.parameters()))["step"])
    out["step_ref"] = ref["step_after"]
    opt.close()
    return out


def stages_at(world: int, case: str) -> tuple[int, ...]:
    """The stages each fixture is loaded into: every one at world size 1, the saved one at 2
    (a plain resume), another at 3 (so each fixture meets every stage at a new world size)."""
    s = int(case[5])
    return {1: (1, 2, 3), 2: (s,), 3: (s % 3 + 1,)}[world]


def _worker(rank: int, world: int) -> dict:
    return {(c, s): resume(c, s, rank, world) for c in CASES for s in stages_at(world, c)}


@functools.cache
def _results(world: int) -> list[dict]:
    if world == 1:
        return [_worker(0, 1)]
    from dist_utils import run_workers

    return run_workers(_worker, world, timeout=240)


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("case", CASES)
def test_resume_equals_deepspeeds_own(case, world):
    dt = case.split("_")[1]
    for rank, res in enumerate(_results(world)):
        for stage in stages_at(world, case):
            r = res[(case, stage)]
            where = f"{case} -> stage {stage}, world {world}, rank {rank}: {r}"
            assert r["at_save"] == 0.0, where  # the saved fp32 values, bit for bit
            assert r["global_steps"] == 3, where
            assert r["after"] <= TOL[dt], where
            assert r["loss"] <= LOSS_TOL[dt], where
            assert r["lr"] <= 1e-15, where
            assert r["step"] == r["step_ref"] == 6, where


# ---------------------------------------------------------------------------- hostile, broken
class _Evil:
    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _copy(tmp_path, case="stage2_fp32") -> str:
    dst = tmp_path / case
    shutil.copytree(os.path.join(DS, case), dst)
    return str(dst / "global_step3")


@pytest.mark.parametrize("which", ["optim", "model"])
def test_hostile_pickle_refused_and_not_run(tmp_path, which):
    d = _copy(tmp_path)
    marker = tmp_path / "pwned"
    name = (
        "zero_pp_rank_1_mp_rank_00_optim_states.pt"
        if which == "optim"
        else ("mp_rank_00_model_states.pt")
    )
    f = os.path.join(d, name)
    if which == "model":
        obj = {"module": {}, "param_shapes": [_Evil(str(marker))]}
    else:
        obj = {"optimizer_state_dict": {"zero_stage": 2, "x": _Evil(str(marker))}}
    torch.save(obj, f)
    model = tiny_model()
    opt = ZeroOptimizer(model, torch.optim.AdamW, stage=1, lr=0.01)
    with pytest.raises(CheckpointError, match=name) as e:
        load_deepspeed_checkpoint(os.path.dirname(d), model, opt)
    assert "posix.system" in str(e.value) or "system" in str(e.value), str(e.value)
    assert not marker.exists()
    opt.close()


def test_truncated_file_named(tmp_path):
    d = _copy(tmp_path, "stage3_bf16")
    f = os.path.join(d, "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt")
    with open(f, "r+b") as fh:
        fh.truncate(os.path.getsize(f) // 2)
    with pytest.raises(
        CheckpointError,
        match="bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt.*truncated or corrupt",
    ):
        read_deepspeed_checkpoint(d)
    model = tiny_model().to(torch.bfloat16)
    opt = ZeroOptimizer(model, torch.optim.AdamW, stage=3, lr=0.01)
    with pytest.raises(CheckpointError, match="rank_1_mp_rank_00_optim_states.pt"):
        load_deepspeed_checkpoint(d, model, opt)
    opt.close()


def test_other_model_refused_by_name():
    model = torch.nn.Sequential(torch.nn.Linear(12, 24))
    opt = ZeroOptimizer(model, torch.optim.AdamW, stage=2, lr=0.01)
    with pytest.raises(CheckpointError, match="incompatible model"):
        load_deepspeed_checkpoint(os.path.join(DS, "stage1_fp32"), model, opt)
    opt.close()


# ---------------------------------------------------------------------------- convert, inspect
@pytest.mark.parametrize("case", ["stage1_bf16", "stage3_fp32"])
def test_convert_then_load_ours(tmp_path, case):
    out = convert_deepspeed_checkpoint(os.path.join(DS, case), tmp_path / "ours")
    ref = torch.load(os.path.join(DS, case, "reference.pt"), weights_only=True)
    ck = read_deepspeed_checkpoint(os.path.join(DS, case))
    m = map_deepspeed_config(ck.ds_config)
    model = tiny_model()
    if m.dtype is not None:
        model.to(m.dtype)
    opt = ZeroOptimizer(model, m.optimizer_class, stage=2, **m.optimizer_kwargs)
    sched = m.scheduler(opt)
    extra = load_checkpoint(out, model, opt, scheduler=sched)
    assert extra["step"] == 3 and opt.param_groups[0]["lr"] == pytest.approx(ref["lrs"][0])
    assert _err(model, opt, ref["at_save"]) == 0.0
    assert sched.last_epoch == 3
    opt.close()


def test_cli_convert_and_inspect(tmp_path):
    src = os.path.join(DS, "stage2_bf16")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    run = functools.partial(subprocess.run, capture_output=True, text=True, env=env, timeout=120)
    r = run([sys.executable, "-m", "zero_kernels", "checkpoint", "inspect", src])
    assert r.returncode == 0, r.stderr
    assert "DeepSpeed" in r.stdout and "stage 2" in r.stdout and "world size 2" in r.stdout
    r = run(
        [
            sys.executable,
            "-m",
            "zero_kernels",
            "checkpoint",
            "convert",
            "--from",
            "deepspeed",
            src,
            str(tmp_path / "out"),
        ]
    )
    assert r.returncode == 0, r.stderr
    r = run([sys.executable, "-m", "zero_kernels", "checkpoint", "verify", str(tmp_path / "out")])
    assert r.returncode == 0, r.stdout + r.stderr


def _has_deepspeed() -> bool:
    try:
        importlib.metadata.version("deepspeed")
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


@pytest.mark.skipif(not _has_deepspeed(), reason="needs deepspeed")
def test_fixtures_regenerate(tmp_path):  # pragma: no cover - where DeepSpeed is installed
    script = os.path.join(FIX, "make_deepspeed_fixtures.py")
    env = {**os.environ, "DS_ACCELERATOR": "cpu"}
    r = subprocess.run([sys.executable, script, str(tmp_path)], env=env, timeout=900)
    assert r.returncode == 0
    for case in CASES:
        new = torch.load(tmp_path / case / "reference.pt", weights_only=True)
        old = torch.load(os.path.join(DS, case, "reference.pt"), weights_only=True)
        assert new["losses"] == pytest.approx(old["losses"], abs=1e-6)


def test_convert_memory_is_one_param_not_the_checkpoint(tmp_path):
    """A synthetic DeepSpeed checkpoint of 92 MiB of state: the converter's peak anonymous
    memory is its two buffers of one param (2 x 1.9 MiB), not the state (measured 15.5 MiB for
    366 MiB of 7.6 MiB params: bench/bench_deepspeed_convert.py); the output verifies."""
    bench = os.path.join(HERE, "..", "..", "bench", "bench_deepspeed_convert.py")
    spec = importlib.util.spec_from_file_location("bench_deepspeed_convert", bench)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    r = mod.measure(params=16, numel=500_000, world=2, tmp=str(tmp_path))
    assert r["state_bytes"] == 16 * 500_000 * 12
    assert r["peak_anon_above_start"] < 2 * r["param_bytes"] + (6 << 20), r
    from zero_kernels.checkpoint import verify_checkpoint

    src = tmp_path / "ds"
    os.makedirs(src)
    mod.make_synthetic(str(src), 3, 1000, 3)
    out = convert_deepspeed_checkpoint(src, tmp_path / "ours")
    assert verify_checkpoint(out) == []
    ck = read_deepspeed_checkpoint(src)
    from safetensors.torch import load_file

    saved = load_file(os.path.join(out, "rank-00000.safetensors"))
    for s, p in enumerate(ck.params):
        assert torch.equal(saved[f"p/{s}/0"], ck.read(p, "fp32", 0, p.numel))
        assert torch.equal(saved[f"s/{s}/0/exp_avg_sq"], ck.read(p, "exp_avg_sq", 0, p.numel))


def test_fp16_dynamic_loss_scale_restored(tmp_path, monkeypatch):
    """A DeepSpeed fp16 run's DynamicLossScaler (written here under DeepSpeed's class name, as
    DeepSpeed pickles it; DeepSpeed's CPU accelerator trains no fp16) gives our dynamic scaler
    its scale and the finite steps since its last change."""
    import types

    bench = os.path.join(HERE, "..", "..", "bench", "bench_deepspeed_convert.py")
    spec = importlib.util.spec_from_file_location("bench_deepspeed_convert", bench)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    src = tmp_path / "ds"
    os.makedirs(src)
    mod.make_synthetic(str(src), 2, 8, 2)

    class DynamicLossScaler:
        pass

    fake = types.ModuleType("deepspeed.runtime.fp16.loss_scaler")
    DynamicLossScaler.__module__ = fake.__name__
    DynamicLossScaler.__qualname__ = "DynamicLossScaler"
    fake.DynamicLossScaler = DynamicLossScaler
    for name in ("deepspeed", "deepspeed.runtime", "deepspeed.runtime.fp16"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, fake.__name__, fake)
    s = DynamicLossScaler()
    s.__dict__.update(
        cur_scale=1024.0,
        dynamic=True,
        cur_iter=10,
        last_overflow_iter=5,
        scale_window=1000,
        scale_factor=2.0,
        min_scale=1,
    )
    for r in range(2):
        f = src / "global_step7" / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt"
        d = torch.load(f, weights_only=True)
        d["optimizer_state_dict"]["loss_scaler"] = s
        torch.save(d, f)
    for name in ("deepspeed", "deepspeed.runtime", "deepspeed.runtime.fp16", fake.__name__):
        monkeypatch.delitem(sys.modules, name)
    model = torch.nn.Module()
    for i in range(2):
        layer = torch.nn.Module()
        layer.weight = torch.nn.Parameter(torch.zeros(8, dtype=torch.float16))
        setattr(model, f"layer{i}", layer)
    opt = ZeroOptimizer(model, torch.optim.AdamW, stage=2, lr=1e-3)
    load_deepspeed_checkpoint(src, model, opt)
    assert opt.loss_scale == 1024.0
    assert opt.scaler.state_dict() == {"loss_scale": 1024.0, "growth_tracker": 4, "dynamic": True}
    ck = read_deepspeed_checkpoint(src)
    assert torch.equal(opt.full_param(model.layer1.weight), ck.read(ck.params[1], "fp32", 0, 8))
    opt.close()


@pytest.mark.parametrize(("case", "stage"), [("stage2_bf16", 3), ("stage3_fp32", 1)])
def test_universal_layout_resumes_too(case, stage):
    """DeepSpeed's own ds_to_universal output of the same checkpoint: the same state."""
    path = os.path.join(DS, case, "global_step3_universal")
    assert read_deepspeed_checkpoint(path).universal
    r = resume(case, stage, 0, 1, path=path)
    dt = case.split("_")[1]
    assert r["at_save"] == 0.0 and r["global_steps"] == 3, r
    assert r["after"] <= TOL[dt] and r["loss"] <= LOSS_TOL[dt] and r["lr"] <= 1e-15, r
    assert r["step"] == 6, r
