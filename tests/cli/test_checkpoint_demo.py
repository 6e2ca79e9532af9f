"""`zero-kernels demo --checkpoint-dir DIR --checkpoint-every K`: a run stopped and started again
continues the uninterrupted loss curve (bitwise at the same world size), and resumes at another
world size (see [Note: resuming] in zero_kernels/cli/demo.py)."""

import json
import shutil

import pytest

from zero_kernels.cli.main import main

pytestmark = pytest.mark.distributed


def _losses(tmp_path, name, *args) -> list[float]:
    out = tmp_path / name
    rc = main(
        [
            "demo",
            "--model-size",
            "tiny",
            "--batch-size",
            "4",
            "--stage",
            "2",
            "--no-baseline",
            "--no-progress",
            "--out",
            str(out),
            *args,
        ]
    )
    assert rc == 0
    return json.loads((out / "report.json").read_text())["runs"]["2"]["loss"]


def test_demo_resumes_from_its_checkpoints(tmp_path):
    full = _losses(tmp_path, "a", "--nproc", "2", "--steps", "6")
    d = tmp_path / "ck"
    first = _losses(
        tmp_path,
        "b1",
        "--nproc",
        "2",
        "--steps",
        "4",
        "--checkpoint-dir",
        str(d),
        "--checkpoint-every",
        "2",
    )
    assert first == full[:4]
    shutil.copytree(d, tmp_path / "ck1")
    again = _losses(
        tmp_path,
        "b2",
        "--nproc",
        "2",
        "--steps",
        "6",
        "--checkpoint-dir",
        str(d),
        "--checkpoint-every",
        "2",
    )
    assert again == full, (again, full)  # resumed at step 4, same world size: the same bits
    # the same checkpoint at world size 1: resumes at step 4 and goes on
    one = _losses(
        tmp_path, "c", "--nproc", "1", "--steps", "6", "--checkpoint-dir", str(tmp_path / "ck1")
    )
    assert one[:4] == full[:4]
    assert all(abs(a - b) < 0.1 * b for a, b in zip(one[4:], full[4:])), (one, full)
