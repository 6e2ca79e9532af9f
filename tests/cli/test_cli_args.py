"""Bad arguments: one line on stderr naming the argument and the accepted values, exit 2."""

import ast
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from zero_kernels.cli.main import build_parser, main

ROOT = Path(__file__).resolve().parents[2]


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


def _setup_kwargs() -> dict:
    """The literal keyword arguments of setup.py's setup(...) call (read, not run)."""
    tree = ast.parse((ROOT / "setup.py").read_text())
    calls = [
        n
        for n in ast.walk(tree)
        if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "setup"
    ]
    assert len(calls) == 1
    out = {}
    for kw in calls[0].keywords:
        try:
            out[kw.arg] = ast.literal_eval(kw.value)
        except ValueError:
            pass
    return out


def _req_name(req: str) -> str:
    return req.split(";")[0].split("[")[0].strip().split("=")[0].split("<")[0].split(">")[0]


def test_matplotlib_is_an_install_requirement_torch_never():
    # the quickstart's first line (`pip install -e . && zero-kernels demo`) promises report.png
    kw = _setup_kwargs()
    names = [_req_name(r).lower() for r in kw["install_requires"]]
    assert "matplotlib" in names, kw["install_requires"]
    extras = [_req_name(r).lower() for reqs in kw.get("extras_require", {}).values() for r in reqs]
    assert "torch" not in names + extras  # pip must never replace the installed torch
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert "[project]" not in pyproject  # requirements live in setup.py only


def test_demo_output_dir_is_ignored_by_git():
    default = build_parser().parse_args(["demo"]).out
    assert default == "zero_kernels_demo"
    lines = (ROOT / ".gitignore").read_text().split()
    assert {default, default + "/", "/" + default, "/" + default + "/"} & set(lines), lines
    if shutil.which("git") and (ROOT / ".git").exists():
        r = subprocess.run(
            ["git", "check-ignore", "-q", f"{default}/report.png"], cwd=ROOT, timeout=60
        )
        assert r.returncode == 0


def test_progress_line_and_summary_say_which_loss(tmp_path, capsys):
    from zero_kernels.cli import demo
    from zero_kernels.cli.report import build_report, model_shapes, write_report

    # the progress line is rank 0's own loss ...
    assert "loss (rank 0) 3.142" in demo.progress_postfix(3.14159, 0.05)
    bar = demo.PlainBar(2, "stage 2 (ZeRO)")
    bar.set_postfix_str(demo.progress_postfix(3.14159, 0.05))
    bar.update(2)
    assert "stage 2 (ZeRO): 2/2 loss (rank 0) 3.142, 50 ms/step" in capsys.readouterr().err

    # ... the summary the mean over ranks (and report.png is drawn: matplotlib is installed)
    cfg = demo.DemoConfig(stage=1, model_size="tiny", out=str(tmp_path / "out"), steps=2)
    psi = sum(math.prod(s) for s in model_shapes("tiny"))

    def run(stage, losses):
        mem = {"params": 4 * psi, "grads": 4 * psi, "optim": 8 * psi, "comm_buffers": 0}
        comm = {
            "all_reduce_bytes": 4.0 * psi if stage == 0 else 0.0,
            "reduce_scatter_bytes": 0.0 if stage == 0 else 4.0 * psi,
            "all_gather_bytes": 0.0 if stage == 0 else 4.0 * psi,
            "exposed_comm_s": 0.0,
        }
        return {"stage": stage, "losses": losses, "step_time_s": 0.1, "memory": mem, "comm": comm}

    per_rank = [
        {0: run(0, [4.0, 3.0]), 1: run(1, [4.0, 3.0])},
        {0: run(0, [6.0, 5.0]), 1: run(1, [6.0, 5.0])},
    ]
    report = build_report(cfg, 2, torch.device("cpu"), per_rank)
    write_report(cfg, report)
    out = capsys.readouterr().out
    assert "mean loss over ranks: 5.0000 -> 4.0000" in out, out
    assert (tmp_path / "out" / "report.png").stat().st_size > 1000


_TRITON_ON_CPU = """
import torch, zero_kernels
from zero_kernels import ops
from zero_kernels.ops import AdamHyper
t = [torch.zeros(8) for _ in range(4)]
h = AdamHyper(1e-3, 0.9, 0.999, 1e-8, 0.0, step=1, adamw=True)
for call in (
    lambda: ops.adam_step(*t, h, backend="triton"),
    lambda: ops.resolve_backend("triton", torch.device("cpu")),
):
    try:
        call()
    except ValueError as e:
        print("ValueError:", e)
    else:
        print("no error")
p = torch.nn.Parameter(torch.zeros(8))
p.grad = torch.ones(8)
try:
    zero_kernels.FusedAdamW([p], backend="triton").step()
except ValueError as e:
    print("ValueError:", e)
"""


def test_triton_on_cpu_tensors_needs_its_interpreter():
    # conftest sets TRITON_INTERPRET=1 for this process: the check needs a clean one
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run(
        [sys.executable, "-c", _TRITON_ON_CPU],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    lines = r.stdout.strip().splitlines()
    assert len(lines) == 3, r.stdout
    for ln in lines:
        assert ln.startswith("ValueError: backend='triton'"), ln
        assert "TRITON_INTERPRET=1" in ln and "interpreter" in ln, ln
        assert "backend='cpu'" in ln and "'auto'" in ln, ln
