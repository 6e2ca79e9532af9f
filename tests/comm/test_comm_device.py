"""Which device a process group's collectives run on ([Note: the collectives' device] in
zero_kernels/comm/base.py): from the params, checked against the group's backend per device
type, never guessed from the backend's name; for a meta-built model from the group's backends.

The decision itself (`comm.choose_device`, `comm.parse_backends`) is pure and tested with
stand-in backends; the rest on torch's fake process group at world size 8 in a subprocess (the
pytest process keeps no process group), under backend strings the fake group takes
("fake", "cpu:fake", "cuda:fake", "cpu:fake,cuda:fake"). CUDA is never used here: where a
decision depends on it, ``torch.cuda.is_available`` and ``current_device`` are stand-ins.
"""

import json
import subprocess
import sys
import textwrap

import pytest
import torch

from zero_kernels import comm

CPU, CUDA = torch.device("cpu"), torch.device("cuda", 0)


@pytest.mark.parametrize(
    "config, want",
    [
        ("cpu:gloo,cuda:nccl", {"cpu": "gloo", "cuda": "nccl"}),
        ("cuda:nccl,cpu:gloo", {"cpu": "gloo", "cuda": "nccl"}),
        ("nccl", {"cuda": "nccl"}),
        ("gloo", {"cpu": "gloo", "cuda": "gloo"}),
        ("cpu:fake", {"cpu": "fake"}),
        ("undefined", {}),
    ],
)
def test_parse_backends(config, want):
    assert comm.parse_backends(config) == want


def test_params_device_wins_where_the_group_serves_it():
    both = {"cpu": "gloo", "cuda": "nccl"}
    assert comm.choose_device(both, "cuda:1", cuda_available=True) == torch.device("cuda", 1)
    assert comm.choose_device(both, CPU, cuda_available=True) == CPU
    assert comm.choose_device({"cuda": "nccl"}, CUDA, cuda_available=True) == CUDA
    assert comm.choose_device({}, CUDA, cuda_available=True) == CUDA  # no process group


@pytest.mark.parametrize(
    "backends, params, names",
    [
        ({"cpu": "gloo"}, "cuda:0", ("cuda:0", "cpu:gloo", "nccl")),
        ({"cuda": "nccl"}, "cpu", ("cpu", "cuda:nccl", "gloo")),
    ],
)
def test_a_group_without_a_backend_for_the_params_device_is_refused(backends, params, names):
    with pytest.raises(ValueError) as e:
        comm.choose_device(backends, params, cuda_available=True)
    for name in names:
        assert name in str(e.value), (name, str(e.value))


def test_meta_built_models_go_where_the_group_and_the_machine_allow():
    both = {"cpu": "gloo", "cuda": "nccl"}  # init_process_group() without a backend, on GPUs
    kw = dict(cuda_available=True, current_cuda=3)
    assert comm.choose_device(both, None, **kw) == torch.device("cuda", 3)
    assert comm.choose_device(both, None, cuda_available=False) == CPU
    assert comm.choose_device({"cpu": "gloo"}, None, **kw) == CPU
    assert comm.choose_device({}, None, **kw) == CPU  # no process group
    with pytest.raises(ValueError, match="cuda:nccl"):
        comm.choose_device({"cuda": "nccl"}, None, cuda_available=False)


PRELUDE = """
import json, torch, torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
torch.set_num_threads(1)
dist.init_process_group({backend!r}, store=FakeStore(), rank=0, world_size=8)
from zero_kernels import comm
"""


def _fake(backend: str, code: str) -> dict:
    """Run ``code`` as rank 0 of 8 on the fake group of ``backend``; its last line of output
    (JSON) is returned."""
    src = PRELUDE.format(backend=backend) + textwrap.dedent(code)
    r = subprocess.run([sys.executable, "-c", src], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-4000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


DECIDE = """
def dev(*a):
    try:
        return str(comm.collective_device(*a))
    except ValueError as e:
        return "ValueError: " + str(e)

out = {"cpu only": dev(), "backends": comm.backends_of(), "cpu params": dev(None, "cpu")}
torch.cuda.is_available = lambda: True  # a GPU node, as far as the decision goes
torch.cuda.current_device = lambda: 5
out["on a GPU node"] = dev()
print(json.dumps(out))
"""


@pytest.mark.parametrize(
    "backend, cpu_only, gpu_node, cpu_params",
    [
        ("fake", "cpu", "cuda:5", "cpu"),
        ("cpu:fake,cuda:fake", "cpu", "cuda:5", "cpu"),  # as init_process_group() on GPUs
        ("cpu:fake", "cpu", "cpu", "cpu"),
        ("cuda:fake", "ValueError", "cuda:5", "ValueError"),
    ],
)
def test_the_device_comes_from_the_groups_backends(backend, cpu_only, gpu_node, cpu_params):
    """Before, only a group named "nccl" gave CUDA: a meta-built stage-3 model under
    ``init_process_group()`` without a backend (named "undefined") went to the CPU."""
    got = _fake(backend, DECIDE)
    assert got["cpu only"].startswith(cpu_only), got
    assert got["on a GPU node"] == gpu_node, got
    assert got["cpu params"].startswith(cpu_params), got
    if cpu_params == "ValueError":  # names the device and the group's backends
        assert "cuda:fake" in got["cpu params"] and "cpu" in got["cpu params"], got


@pytest.mark.parametrize("backend", ["fake", "cpu:fake"])
def test_meta_built_stage3_on_the_fake_group_and_a_refused_mismatch(backend):
    """ZeroOptimizer over a meta-built stage-3 model takes the group's device (the CPU here);
    CPU params with a group that serves CUDA only are refused at construction, naming both."""
    got = _fake(
        backend,
        """
        import zero_kernels
        from torch import nn
        with torch.device("meta"):
            m = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16))
        zo = zero_kernels.ZeroOptimizer(m, torch.optim.AdamW, stage=3, lr=1e-3)
        out = {"device": str(zo.device), "param": str(next(m.parameters()).device)}
        zo.close()
        cuda_only = dist.new_group(backend="cuda:fake")
        try:
            zero_kernels.ZeroOptimizer(
                nn.Linear(4, 4), torch.optim.AdamW, stage=2, lr=1e-3, process_group=cuda_only
            )
        except ValueError as e:
            out["mismatch"] = str(e)
        print(json.dumps(out))
        """,
    )
    assert got["device"] == "cpu" and got["param"] == "cpu", got
    assert "cpu" in got["mismatch"] and "cuda:fake" in got["mismatch"], got


def test_gloo_paths_serve_only_the_device_gloo_serves():
    """On "cuda:nccl,cpu:gloo" (its config stood in for on the fake group): CUDA tensors get no
    gloo twin for stage 3's reduce-scatters (before, the name holding "gloo" made one, which
    fails on CUDA tensors), use the native algorithm, and count NCCL's ring; CPU tensors are
    gloo's."""
    got = _fake(
        "fake",
        """
        dist.get_backend_config = lambda group=None: "cuda:nccl,cpu:gloo"
        world = dist.group.WORLD
        out = {
            "backend for cuda": comm.backend_for(None, "cuda"),
            "backend for cpu": comm.backend_for(None, "cpu"),
            "twin for cuda is the group": comm.twin_group(world, "cuda") is world,
            "algorithm for cuda": comm.choose_algorithm(
                "reduce_scatter", 1 << 20, group=world, device="cuda"
            ),
            "cuda pattern": comm.links.pattern("reduce_scatter", "native", world, "cuda"),
            "cpu pattern": comm.links.pattern("reduce_scatter", "native", world, "cpu"),
        }
        print(json.dumps(out))
        """,
    )
    assert got == {
        "backend for cuda": "nccl",
        "backend for cpu": "gloo",
        "twin for cuda is the group": True,
        "algorithm for cuda": "native",
        "cuda pattern": "ring",
        "cpu pattern": "ring_all_reduce",
    }, got
