"""`zero-kernels checkpoint inspect|verify|export DIR` where DIR holds no checkpoint of its own but
checkpoints one level down (issue 24): ``zero-kernels demo --checkpoint-dir DIR`` writes one per
run, DIR/stage0 and DIR/stage<s>. inspect names and shows each, verify and export refuse naming
them, and the demo prints the exact inspect command of each checkpoint it wrote."""

import json
import os
import shlex

import pytest
import torch
from torch import nn

import zero_kernels as zk
from zero_kernels.cli.main import main


def _pair(fill: float):
    m = nn.Linear(8, 4)
    with torch.no_grad():
        for p in m.parameters():
            p.fill_(fill)
    o = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    for p in m.parameters():
        p.grad = torch.ones_like(p)
    o.step()
    return m, o


@pytest.fixture
def nested(tmp_path):
    """DIR with checkpoints in DIR/a and DIR/b (and an empty folder, not one of them)."""
    root = tmp_path / "DIR"
    for name, fill in (("a", 1.0), ("b", 2.0)):
        m, o = _pair(fill)
        zk.save_checkpoint(root / name, m, o, extra={"run": name})
    os.makedirs(root / "notes")
    return root


def test_inspect_shows_each_checkpoint_below(nested, capsys):
    assert main(["checkpoint", "inspect", str(nested)]) == 0
    out = capsys.readouterr().out
    a, b = str(nested / "a"), str(nested / "b")
    assert "no checkpoint of its own" in out and a in out and b in out, out
    assert str(nested / "notes") not in out, out
    assert out.count("world size") == 2 and '{"run": "a"}' in out and '{"run": "b"}' in out, out
    assert main(["checkpoint", "inspect", str(nested), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["path"] == str(nested)
    assert [c["extra"] for c in info["checkpoints"]] == [{"run": "a"}, {"run": "b"}], info
    assert all(c["path"].startswith((a, b)) for c in info["checkpoints"]), info


@pytest.mark.parametrize("action", ["verify", "export"])
def test_verify_and_export_ask_for_one(nested, tmp_path, capsys, action):
    extra = ["--to", str(tmp_path / "m.safetensors")] if action == "export" else []
    assert main(["checkpoint", action, str(nested), *extra]) == 2
    err = capsys.readouterr().err
    assert str(nested / "a") in err and str(nested / "b") in err, err
    assert f"zero-kernels checkpoint {action} {shlex.quote(str(nested / 'a'))}" in err, err
    assert not (tmp_path / "m.safetensors").exists()
    assert main(["checkpoint", action, str(nested / "b"), *extra]) == 0


def test_load_names_the_checkpoints_below(nested):
    m, o = _pair(0.0)
    with pytest.raises(zk.CheckpointError, match="one level down") as e:
        zk.load_checkpoint(nested, m, o)
    assert str(nested / "a") in str(e.value) and str(nested / "b") in str(e.value)


@pytest.mark.distributed
def test_demo_prints_the_inspect_command(tmp_path, capfd):
    d = tmp_path / "ck"
    args = ["demo", "--model-size", "tiny", "--batch-size", "4", "--stage", "2", "--nproc", "2"]
    args += ["--steps", "2", "--no-progress", "--out", str(tmp_path / "out")]
    args += ["--checkpoint-dir", str(d), "--checkpoint-every", "2"]
    assert main(args) == 0
    printed = capfd.readouterr()
    text = printed.out + printed.err
    cmds = [
        f"zero-kernels checkpoint inspect {shlex.quote(str(d / s))}" for s in ("stage0", "stage2")
    ]
    for c in cmds:
        assert c in text, text
    # the printed commands work, and so does the folder the demo was given
    for c in cmds:
        assert main(shlex.split(c)[1:]) == 0
    assert main(["checkpoint", "inspect", str(d)]) == 0
    out = capfd.readouterr().out
    assert str(d / "stage0") in out and str(d / "stage2") in out, out
