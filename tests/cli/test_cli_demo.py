"""`zero-kernels demo` end to end on gloo: the report, the loss against DDP, the measured bytes
against the estimator's formula, and a failing rank."""

import json
import multiprocessing

import pytest

from zero_kernels.cli.demo import available_stages
from zero_kernels.cli.main import main

pytestmark = pytest.mark.distributed

ZERO_STAGES = [s for s in available_stages() if s in (1, 2)]
TOP = max(available_stages())


def _demo(tmp_path, *args) -> dict:
    out = tmp_path / "out"
    rc = main(
        [
            "demo",
            "--model-size",
            "tiny",
            "--batch-size",
            "4",
            "--no-progress",
            "--out",
            str(out),
            *args,
        ]
    )
    assert rc == 0
    return json.loads((out / "report.json").read_text())


def test_demo_two_ranks_report(tmp_path, capfd):
    rep = _demo(tmp_path, "--stage", str(TOP), "--nproc", "2", "--steps", "6")
    printed = capfd.readouterr().out
    assert "largest difference to DDP" in printed or TOP == 0
    assert rep["world_size"] == 2 and rep["stage"] == TOP
    assert (tmp_path / "out" / "report.png").stat().st_size > 1000
    run = rep["runs"][str(TOP)]
    assert len(run["loss"]) == 6 and all(2.0 < x < 7.0 for x in run["loss"])
    assert run["loss"][-1] < run["loss"][0]
    assert 0 < run["step_time_s"] < 10
    assert len(run["memory_per_rank"]) == 2
    psi = rep["n_params"]
    held = 4 * psi / (2 if TOP == 3 else 1)  # stage 3 holds its shard of the params
    assert run["memory_per_rank"][0]["params"] == pytest.approx(held, rel=0.03)
    c = run["comm_per_step"]
    if TOP == 0:
        assert c["all_reduce_bytes"] == pytest.approx(4 * psi, rel=0.03)
    else:
        # one reduce-scatter of the fp32 grads per step; one all-gather of the params (stage 3:
        # each block twice, before its forward and its backward, the root unit once)
        assert c["reduce_scatter_bytes"] == pytest.approx(4 * psi, rel=0.03)
        if TOP == 3:
            assert 4 * psi * 1.03 < c["all_gather_bytes"] < 8 * psi
            live = run["memory_per_rank"][0]["live"]
            assert live == pytest.approx(run["memory_formula"]["live"], rel=0.03), live
        else:
            assert c["all_gather_bytes"] == pytest.approx(4 * psi, rel=0.03)
        assert rep["loss_max_abs_diff_vs_ddp"] < 1e-3
    assert c["exposed_comm_s"] >= 0
    assert len(rep["estimate"]) == 4


def _check_memory_vs_formula(run: dict, stage: int) -> None:
    """Model-state bytes of every rank within 3% of the formula (padding included), each part
    too; comm buffers beside them: none for DDP and stage 1, at most 2 buckets for stage 2."""
    f = run["memory_formula"]
    errors = {k: round(v, 4) for k, v in run["memory_rel_error"].items()}
    for total in run["memory_total_per_rank"]:
        assert total == pytest.approx(f["total"], rel=0.03), (stage, errors)
    for m in run["memory_per_rank"]:
        for k in ("params", "grads", "optim"):
            assert m[k] == pytest.approx(f[k], rel=0.03), (stage, k, errors)
    bufs = run["comm_buffers_per_rank"]
    if stage in (0, 1):
        assert bufs == [0] * len(bufs) and f["comm_buffers"] == 0
    else:
        assert f["comm_buffers"] > 0
        assert all(0 < b <= 1.1 * f["comm_buffers"] for b in bufs), (bufs, f["comm_buffers"])


@pytest.mark.parametrize("stage", sorted({0, *ZERO_STAGES} - {0}) or [0])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_estimate_matches_measured(tmp_path, world, stage):
    """Measured bytes against the estimator at world sizes 1-4 for DDP and stages 1 and 2 (the
    stage-1 run also trains the DDP baseline, so each world size spawns two demos)."""
    extra = [] if stage in (0, 1) else ["--no-baseline"]
    rep = _demo(tmp_path, "--stage", str(stage), "--nproc", str(world), "--steps", "2", *extra)
    assert set(rep["runs"]) == ({"0", str(stage)} if not extra else {str(stage)})
    for s, run in rep["runs"].items():
        _check_memory_vs_formula(run, int(s))


def test_failing_rank_fails_the_command(tmp_path, capfd, monkeypatch):
    monkeypatch.setenv("ZERO_KERNELS_DEMO_FAIL_RANK", "1")
    rc = main(
        [
            "demo",
            "--stage",
            "0",
            "--nproc",
            "2",
            "--steps",
            "5",
            "--model-size",
            "tiny",
            "--no-progress",
            "--out",
            str(tmp_path / "out"),
            "--timeout",
            "120",
        ]
    )
    err = capfd.readouterr().err
    assert rc == 1
    assert "rank 1 failed: RuntimeError: injected failure on rank 1" in err, err
    assert multiprocessing.active_children() == []  # nothing left behind
    assert not (tmp_path / "out" / "report.json").exists()
