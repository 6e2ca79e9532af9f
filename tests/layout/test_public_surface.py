"""Tests and benchmarks read the package through its public names: no private module, function or
attribute of `zero_kernels` is reached from tests/ or bench/ (the debug view ``opt.parts`` and the
public ``opt.units()`` are the documented introspection surface). A standing check: it parses every
file, so a new reach into a private name fails here, naming the file and the line."""

import ast
import pathlib
from multiprocessing import forkserver

import torch
from torch import nn

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "zero_kernels"


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _package_privates() -> set[str]:
    """Private names the package defines: functions, classes, module globals, attributes set."""
    out = set()
    for f in PACKAGE.rglob("*.py"):
        for n in ast.walk(ast.parse(f.read_text())):
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                out.add(n.name)
            elif isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store):
                out.add(n.attr)
            elif isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
                out.add(n.id)
    # names torch itself has (torch._dynamo, Tensor._foreach..., Module._forward_hooks) are
    # torch's, whatever the package also calls a local; so are the stdlib forkserver's the
    # tests' ranks fork from (tests/dist_utils.py stops it)
    theirs = set(dir(torch)) | set(dir(torch.Tensor)) | set(dir(nn.Module)) | set(dir(nn))
    theirs |= set(dir(forkserver)) | set(dir(forkserver.ForkServer))
    return {n for n in out if _private(n) and n not in theirs}


def _reaches(path: pathlib.Path, ours: set[str]) -> list[str]:
    tree = ast.parse(path.read_text())
    own = set()  # names the file defines itself (its helpers, attributes of its own classes)
    for n in ast.walk(tree):
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            own.add(n.name)
        elif isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store):
            own.add(n.attr)
    bad = []
    for n in ast.walk(tree):
        if isinstance(n, ast.ImportFrom) and (n.module or "").startswith("zero_kernels"):
            parts = n.module.split(".")
            bad += [f"{n.lineno}: module {n.module}" for p in parts if _private(p)]
            bad += [f"{n.lineno}: import {a.name}" for a in n.names if _private(a.name)]
        elif isinstance(n, ast.Import):
            for a in n.names:
                if a.name.startswith("zero_kernels") and any(map(_private, a.name.split("."))):
                    bad.append(f"{n.lineno}: import {a.name}")
        elif isinstance(n, ast.Attribute) and n.attr in ours and n.attr not in own:
            bad.append(f"{n.lineno}: .{n.attr}")
    where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
    return [f"{where}:{b}" for b in bad]


def test_no_private_name_of_the_package_is_reached_from_tests_or_bench():
    ours = _package_privates()
    assert "_core" in ours and "_closed" in ours  # the scan sees the package's own privates
    found = []
    for folder in ("tests", "bench", "python"):
        for f in sorted((ROOT / folder).rglob("*.py")):
            found += _reaches(f, ours)
    assert not found, "\n".join(found)


def test_the_scan_finds_a_reach(tmp_path):
    f = tmp_path / "t.py"
    f.write_text(
        "from zero_kernels.comm.quant import _packed\n"
        "import zero_kernels.native\n"
        "def t(zo):\n"
        "    return zo._core\n"
    )
    got = _reaches(f, {"_core", "_packed"})
    assert any("import _packed" in g for g in got) and any("._core" in g for g in got), got
