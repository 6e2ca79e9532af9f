"""Checkpoints in one process: the API's errors, keep_last/latest, and `zero-kernels checkpoint
inspect|verify|export` (the export loads with safetensors and equals the model)."""

import json
import os

import checkpoint_checks as cc
import pytest
import torch
from safetensors.torch import load_file
from torch import nn
from zero_opt import zero_opt

import zero_kernels as zk
from zero_kernels.checkpoint import format as fmt
from zero_kernels.cli.main import main


def _trained(c=("adamw", 1, "flat", "bf16"), steps=2):
    wrapped, m, o, sched = cc.build(c)
    cc.train(c, wrapped, o, sched, 0, 1, range(steps))
    return wrapped, m, o, sched


@pytest.fixture
def saved(tmp_path):
    wrapped, m, o, sched = _trained()
    path = zk.save_checkpoint(tmp_path / "ck", wrapped, o, scheduler=sched, extra={"step": 2})
    yield path, m, o
    o.close()


# ---------------------------------------------------------------------------- API
def test_keep_last_and_latest(tmp_path):
    m, o = cc.small_pair(stepped=True)
    root = tmp_path / "r"
    for s in range(5):
        with torch.no_grad():
            m.weight.fill_(s)
        zk.save_checkpoint(root, m, o, extra={"step": s}, keep_last=2)
    names = sorted(n for n in os.listdir(root) if n.startswith("step-"))
    assert names == ["step-00000003", "step-00000004"], names
    assert fmt.read_latest(str(root)) == "step-00000004"
    m2, o2 = cc.small_pair()
    assert zk.load_checkpoint(root, m2, o2) == {"step": 4}
    assert zk.load_checkpoint(root / "step-00000003", m2, o2) == {"step": 3}
    assert bool((m2.weight == 3).all())
    # the same step again: a new name, latest follows
    zk.save_checkpoint(root, m, o, extra={"step": 4})
    assert fmt.read_latest(str(root)) == "step-00000004-2"


def test_errors_name_the_file(saved, tmp_path):
    path, _, _ = saved
    root = os.path.dirname(path)

    def load(p, model=None):
        w, m, o, s = cc.build(("adamw", 0, "flat", "fp32"), seed=1)
        return zk.load_checkpoint(p, model or w, o, scheduler=s)

    with pytest.raises(zk.CheckpointError, match="missing"):
        load(tmp_path / "nothing")
    os.makedirs(tmp_path / "empty")
    with pytest.raises(zk.CheckpointError, match="latest: missing"):
        load(tmp_path / "empty")
    # incompatible model: another shape, a param the checkpoint lacks
    w, m, o, s = cc.build(("adamw", 0, "flat", "fp32"), seed=1)
    m.l3 = nn.Linear(17, 6)
    o = torch.optim.AdamW(cc.groups_of(m), lr=1e-2)
    with pytest.raises(zk.CheckpointError, match=r"meta.json: incompatible model: param l3.weight"):
        zk.load_checkpoint(root, m, o)
    m.l3 = nn.Linear(17, 5)
    m.extra_layer = nn.Linear(2, 2)
    o = torch.optim.AdamW(cc.groups_of(m) + [{"params": m.extra_layer.parameters()}], lr=1e-2)
    with pytest.raises(zk.CheckpointError, match="incompatible optimizer: 2 param groups saved"):
        zk.load_checkpoint(root, m, o)
    o = torch.optim.AdamW(list(m.parameters()), lr=1e-2)
    with pytest.raises(zk.CheckpointError, match="incompatible"):
        zk.load_checkpoint(root, m, o)
    # a missing file, a truncated file
    rank0 = os.path.join(path, "rank-00000.safetensors")
    data = open(rank0, "rb").read()
    os.unlink(rank0)
    with pytest.raises(zk.CheckpointError, match="rank-00000.safetensors: missing"):
        load(root)
    with open(rank0, "wb") as f:
        f.write(data[:-100])
    with pytest.raises(zk.CheckpointError, match="rank-00000.safetensors: partial"):
        load(root)
    with open(rank0, "wb") as f:
        f.write(data)
    load(root)
    # a newer format version is refused, not misread
    meta = fmt.read_meta(path)
    meta["format_version"] = fmt.FORMAT_VERSION + 1
    fmt.write_meta(path, meta)
    with pytest.raises(zk.CheckpointError, match=f"format_version={fmt.FORMAT_VERSION + 1}"):
        load(root)


def test_bad_arguments_fail_before_writing(tmp_path):
    m, o = cc.small_pair(stepped=True)
    with pytest.raises(ValueError, match="keep_last"):
        zk.save_checkpoint(tmp_path / "a", m, o, keep_last=0)
    with pytest.raises(TypeError, match=r"extra\['f'\]: a function"):
        zk.save_checkpoint(tmp_path / "a", m, o, extra={"f": lambda: 0})
    assert not os.path.exists(tmp_path / "a")
    with pytest.raises(ValueError, match="not a parameter of the model"):
        zk.save_checkpoint(tmp_path / "a", nn.Linear(2, 2), o)


def test_json_values_round_trip():
    v = {
        "t": (1, 2.5, None),
        3: "int key",
        "inf": float("-inf"),
        "dt": torch.bfloat16,
        "x": torch.arange(4, dtype=torch.int32),
        "__tricky": [1],
    }
    back = fmt.decode(json.loads(json.dumps(fmt.encode(v))))
    assert back.keys() == v.keys()
    assert back["t"] == (1, 2.5, None) and back[3] == "int key" and back["inf"] == float("-inf")
    assert back["dt"] is torch.bfloat16 and back["__tricky"] == [1]
    assert torch.equal(back["x"], v["x"]) and back["x"].dtype == torch.int32


# ---------------------------------------------------------------------------- CLI
def test_cli_inspect(saved, capsys):
    path, _, _ = saved
    assert main(["checkpoint", "inspect", os.path.dirname(path)]) == 0
    out = capsys.readouterr().out
    for want in ("world size         1", "stage              1, flat partition", "steps"):
        assert want in out, out
    assert main(["checkpoint", "inspect", path, "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["world_size"] == 1 and info["stage"] == 1 and info["extra"] == {"step": 2}
    assert info["params"] == 6 and info["param_dtypes"] == ["bfloat16"]
    assert "exp_avg" in info["state_keys"] and info["files"]["rank-00000.safetensors"] > 0


def test_cli_verify(saved, capsys):
    path, _, _ = saved
    assert main(["checkpoint", "verify", path]) == 0
    assert "ok:" in capsys.readouterr().out
    f = os.path.join(path, "model.safetensors")
    with open(f, "r+b") as fh:
        fh.seek(-1, 2)
        b = fh.read(1)
        fh.seek(-1, 2)
        fh.write(bytes([b[0] ^ 1]))
    assert main(["checkpoint", "verify", path]) == 1
    err = capsys.readouterr().err
    assert "model.safetensors: checksum mismatch" in err, err
    assert main(["checkpoint", "verify", str(path) + "-nope"]) == 1


def test_cli_export(saved, tmp_path, capsys):
    path, m, o = saved
    out = tmp_path / "model.safetensors"
    assert main(["checkpoint", "export", path, "--to", str(out)]) == 0
    got = load_file(out)
    want = dict(m.state_dict())
    assert set(got) == set(want), (set(got), set(want))
    for n, v in want.items():  # the bf16 params: the fp32 masters rounded, as the model holds
        assert got[n].dtype == v.dtype and torch.equal(got[n], v), n
    assert main(["checkpoint", "export", path, "--to", str(out), "--dtype", "fp32"]) == 0
    got = load_file(out)
    for n, p in m.named_parameters():
        want = o.full_param(p) if p.requires_grad else p.float()
        assert got[n].dtype == torch.float32 and torch.equal(got[n], want), n
    assert got["calls"].dtype == torch.float32  # a float buffer follows --dtype too
    assert "wrote" in capsys.readouterr().out
    assert main(["checkpoint", "export", path]) == 2  # --to is required


def test_params_frozen_or_unfrozen_between_save_and_load(tmp_path):
    """A param trained then and frozen now gets its values from the saved pieces; one frozen
    then and trained now gets them from the model file (and no state)."""
    torch.manual_seed(0)
    m = cc.Net(0)
    m.l1.requires_grad_(False)
    o = zero_opt(m, torch.optim.AdamW, stage=2, bucket_size_mb=0.0004, lr=1e-2)
    cc.train(
        ("adamw", 2, "flat", "fp32"), m, o, torch.optim.lr_scheduler.StepLR(o, 9), 0, 1, range(2)
    )
    zk.save_checkpoint(tmp_path, m, o)
    m2 = cc.Net(1)
    m2.l2.requires_grad_(False)
    o2 = torch.optim.AdamW([p for p in m2.parameters() if p.requires_grad], lr=1e-2)
    zk.load_checkpoint(tmp_path, m2, o2)
    for (n, a), b in zip(m.named_parameters(), m2.parameters()):
        assert torch.equal(a, b), n
    names = {id(p): n for n, p in m2.named_parameters()}
    have = {names[id(p)] for p in o2.state}
    assert have == {"l3.weight", "l3.bias"}, have  # l1 was frozen: no state to load
    o.close()


def test_export_loads_with_dcp(saved, tmp_path):
    """The consolidated export is what DCP's HuggingFaceStorageReader reads (the interop of
    [Note: why not torch.distributed.checkpoint])."""
    import warnings

    import torch.distributed.checkpoint as dcp

    path, m, _ = saved
    os.makedirs(tmp_path / "hf")
    assert (
        main(["checkpoint", "export", path, "--to", str(tmp_path / "hf" / "model.safetensors")])
        == 0
    )
    fresh = cc.Net(1).to(torch.bfloat16)
    sd = fresh.state_dict()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(sd, storage_reader=dcp.HuggingFaceStorageReader(str(tmp_path / "hf")))
    fresh.load_state_dict(sd)
    for (n, a), b in zip(m.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(a, b), n
