"""python/train_example.py under torchrun at 2 ranks, as a user runs it: on CPUs it trains on
gloo at every stage with the same losses (bench/gpu_check.sh runs it on a GPU, where it must
train on the rank's GPU over NCCL)."""

import os
import socket
import subprocess
import sys

import pytest

pytestmark = pytest.mark.distributed

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(stage: int) -> list[str]:
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
        "--master-port", str(_free_port()),
        os.path.join(ROOT, "python", "train_example.py"), "--stage", str(stage), "--steps", "10",
    ]  # fmt: skip
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # the CPU path, whatever the machine
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-4000:]
    return r.stdout.strip().splitlines()


@pytest.mark.parametrize("stage", [0, 3])
def test_train_example_on_two_cpu_ranks(stage):
    out = _run(stage)
    assert out[0] == "device cpu, process group backend gloo", out
    losses = [float(line.split()[-1]) for line in out if line.startswith("step")]
    assert len(losses) == 2 and losses[1] < losses[0], out
