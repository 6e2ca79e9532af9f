"""`zero_kernels.integrations.lightning.ZeroStrategy` (issue 24): Lightning's loop against its
own ``strategy="ddp"`` at 2 gloo ranks (tests/integrations/lightning_checks.py: one spawned group,
a test per
concern), and what is checked without a process group (constructor, registry, imports)."""

import os
import subprocess
import sys

import pytest

pytest.importorskip("lightning")

import lightning_checks  # noqa: E402
from dist_utils import FAILED, run_workers  # noqa: E402


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("lightning"))
    try:
        return run_workers(lightning_checks.worker, 2, d, timeout=400)
    except AssertionError as e:
        return e


def _check(reports, name):
    if isinstance(reports, AssertionError):
        raise AssertionError(f"the spawned group failed:\n{reports}")
    bad = [f"rank {r}: {rep.get(name)}" for r, rep in enumerate(reports) if name not in rep]
    bad += [
        f"rank {r}: {rep[name]}"
        for r, rep in enumerate(reports)
        if isinstance(rep.get(name), str) and rep[name].startswith(FAILED)
    ]
    assert not bad, f"{name}:\n" + "\n".join(bad)
    return [rep[name] for rep in reports]


@pytest.mark.distributed
def test_stages_match_ddp_with_clipping_and_accumulation(reports):
    for rep in _check(reports, "check_stages_match_ddp"):
        assert all(v < 1e-5 for v in rep.values()), rep


@pytest.mark.distributed
def test_fp16_mixed_with_grad_scaler(reports):
    _check(reports, "check_fp16_loss_scaler")


@pytest.mark.distributed
def test_resume_repeats_the_uninterrupted_run_fp32(reports):
    for rep in _check(reports, "check_resume_fp32"):
        assert rep["gap"] < 1e-6, rep


@pytest.mark.distributed
def test_resume_repeats_the_uninterrupted_run_bf16_params(reports):
    for rep in _check(reports, "check_resume_bf16_params"):
        assert rep["gap"] < 1e-6, rep


@pytest.mark.distributed
def test_after_fit_test_validate_and_a_second_trainer(reports):
    _check(reports, "check_after_fit")


@pytest.mark.distributed
def test_manual_optimization_matches_ddp(reports):
    for rep in _check(reports, "check_manual_optimization"):
        assert len(rep) == 5 and all(v < 1e-5 for v in rep.values()), rep


@pytest.mark.distributed
def test_unsupported_settings_raise_at_fit(reports):
    _check(reports, "check_errors_at_fit")


@pytest.mark.distributed
def test_pytorch_lightning_package(reports):
    _check(reports, "check_pytorch_lightning")


# ---------------------------------------------------------------------------- no process group
def test_registered_names_and_constructor_errors():
    import lightning.pytorch as L
    from lightning.pytorch.strategies import StrategyRegistry

    from zero_kernels.integrations.lightning import ZeroStrategy
    from zero_kernels.policy import CommPolicy, ShardPolicy, ZeroPolicy

    for stage in (1, 2, 3):
        entry = StrategyRegistry[f"zero_kernels_stage_{stage}"]
        assert entry["strategy"] is ZeroStrategy and entry["init_params"] == {"stage": stage}
    trainer = L.Trainer(strategy="zero_kernels_stage_3", accelerator="cpu", devices=2, logger=False)
    assert isinstance(trainer.strategy, ZeroStrategy) and trainer.strategy.stage == 3
    assert ZeroStrategy().stage == 2
    s = ZeroStrategy(stage=1, comm=CommPolicy(bucket_size_mb=1.0))
    assert s.zero_options == {"stage": 1, "comm": CommPolicy(bucket_size_mb=1.0)}
    with pytest.raises(TypeError, match="bucket_size_mb is a field of CommPolicy. Pass comm="):
        ZeroStrategy(stage=1, bucket_size_mb=1.0)
    for bad in (0, 4, True, "3"):
        with pytest.raises(ValueError, match=f"stage={bad!r}"):
            ZeroStrategy(stage=bad)
    with pytest.raises(TypeError, match="bucket_size"):
        ZeroStrategy(stage=2, bucket_size=1)
    with pytest.raises(ValueError, match="module"):
        ZeroStrategy(stage=2, module=None)
    with pytest.raises(ValueError, match="not both"):
        ZeroStrategy(stage=3, policy=ZeroPolicy(shard=ShardPolicy.of_stage(3)))
    with pytest.raises(TypeError, match="process_group_backend"):
        ZeroStrategy(process_group_backend=1)


_IMPORT = """
import zero_kernels.integrations.lightning as zl
print(zl.ZeroStrategy.__mro__[1].__module__, zl.PyTorchLightningZeroStrategy is zl.ZeroStrategy)
"""


def _without(blocked: list[str], root) -> str:
    """A copy of site-packages (links) without the packages ``blocked``, for ``python -S``:
    the packages are not installed there (their metadata gone too), as on a user's machine."""
    import site

    out = root / "site"
    out.mkdir()
    norm = {b.replace("-", "_").lower() for b in blocked}
    for sp in site.getsitepackages():
        for name in os.listdir(sp):
            key = name.split("-")[0].split(".")[0].lower()
            if key in norm or name.endswith(".pth") or (out / name).exists():
                continue
            (out / name).symlink_to(os.path.join(sp, name))
    return str(out)


@pytest.mark.parametrize(
    "blocked, base",
    [  # no transformers/accelerate either (the module needs neither)
        (["pytorch_lightning", "transformers", "accelerate"], "lightning.pytorch"),
        (["lightning", "transformers", "accelerate"], "pytorch_lightning"),
    ],
)
def test_imports_with_one_framework(blocked, base, tmp_path):
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([repo, _without(blocked, tmp_path)])}
    out = subprocess.run(
        [sys.executable, "-S", "-c", _IMPORT],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    # one class, on the framework there is
    assert out.stdout.split() == [f"{base}.strategies.parallel", "True"], out.stdout


def test_fit_with_only_pytorch_lightning(tmp_path):
    """A user with ``pytorch-lightning`` and not ``lightning`` (most tutorials' package) fits at
    stages 1-3 with DDPStrategy's losses, and stage 3 refuses that framework's own
    weight-averaging callback (tests/integrations/pl_only_fit.py, in a site-packages without
    ``lightning``)."""
    import json

    from dist_utils import free_port

    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([repo, _without(["lightning"], tmp_path)])}
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "pl_only_fit.py")
    out = subprocess.run(
        [sys.executable, "-S", script, str(free_port())],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    for stage in (1, 2, 3):
        assert got[f"stage{stage}"] < 1e-6, got
    assert "StochasticWeightAveraging" in got["swa"] and "stage 3" in got["swa"], got
