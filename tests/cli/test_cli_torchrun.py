"""`zero-kernels demo` under torchrun, two "nodes" on 127.0.0.1 with one rank each."""

import json
import socket
import subprocess
import sys

import pytest

pytestmark = pytest.mark.distributed


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_node_torchrun(tmp_path):
    port = _free_port()
    out = tmp_path / "out"
    procs = []
    for node in (0, 1):
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes",
            "2",
            "--nproc-per-node",
            "1",
            "--node-rank",
            str(node),
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            str(port),
            "-m",
            "zero_kernels",
            "demo",
            "--steps",
            "3",
            "--model-size",
            "tiny",
            "--batch-size",
            "2",
            "--no-progress",
            "--out",
            str(out),
        ]
        procs.append(
            subprocess.Popen(
                cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path
            )
        )
    outputs = []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=240)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert [p.returncode for p in procs] == [0, 0], "\n".join(outputs)
    rep = json.loads((out / "report.json").read_text())
    assert rep["world_size"] == 2
    run = rep["runs"][str(rep["stage"])]
    assert len(run["loss"]) == 3 and len(run["memory_per_rank"]) == 2
    assert "zero-kernels demo: stage" in outputs[0]
