"""Bad arguments: one line on stderr naming the argument and the accepted values, exit 2."""

import subprocess
import sys

import pytest

from zero_kernels.cli.main import main


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["demo", "--stage", "9"], "--stage"),
        (["demo", "--stage", "x"], "--stage"),
        (["demo", "--optimizer", "rmsprop2"], "--optimizer"),
        (["demo", "--precision", "fp8"], "--precision"),
        (["demo", "--model-size", "huge"], "--model-size"),
        (["demo", "--steps", "0"], "--steps"),
        (["demo", "--nproc", "0"], "--nproc"),
        (["demo", "--bucket-mb", "-1"], "--bucket-mb"),
        (["demo", "--nnodes", "2"], "--master-port"),
        (["demo", "--nnodes", "2", "--node-rank", "2", "--master-port", "1"], "--node-rank"),
        (["bench", "--bench-dir", "/nonexistent/bench"], "--bench-dir"),
        (["frobnicate"], "frobnicate"),
        (["demo", "--no-such-flag"], "--no-such-flag"),
    ],
)
def test_bad_arguments_one_line_exit_2(argv, needle, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith("zero-kernels: error:") and needle in err[0], err


def test_accepted_values_are_named(capsys):
    assert main(["demo", "--optimizer", "nope"]) == 2
    err = capsys.readouterr().err
    assert "adamw" in err and "sgd" in err and "muon" in err


def test_module_entry_point_no_traceback():
    r = subprocess.run(
        [sys.executable, "-m", "zero_kernels", "demo", "--stage", "9"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2
    assert "Traceback" not in r.stderr and r.stderr.count("\n") == 1, r.stderr


def test_version(capsys):
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.startswith("zero_kernels ")
