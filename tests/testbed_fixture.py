"""The `testbed` fixture: run a script on N namespace nodes x R ranks over a link of a given rate
and get each node's exit code, log and bytes over the link from tc's counters
(`zero_kernels.tools.testbed`, [Note: the testbed]). Skips, with the exact reason, where no testbed
can be made (not root, no ip/tc/unshare, the kernel refusing).

    def test_x(testbed):
        res = testbed("testbed_allreduce.py", "10", nodes=2, ranks_per_node=1, rate="1gbit")
        res.ok, res.exit_codes, res.nodes[0].bytes.sent, res.between("before", "after"), res.out_dir

A relative script name is looked up in tests/testbed_scripts/."""

from __future__ import annotations

import os

import pytest

from zero_kernels.tools import testbed as tb

SCRIPTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "testbed_scripts")


def script_path(name: str) -> str:
    return name if os.path.isabs(name) else os.path.join(SCRIPTS, name)


def leftovers(run_id: str) -> dict:
    """What runs left behind: the namespaces and the processes of every run whose id starts with
    ``run_id`` (a whole id, or ``f"{pid}-"`` for every run of the controller ``pid``)."""
    names = [n for n in tb.netns_names() if n.startswith(f"{tb.PREFIX}-{run_id}")]
    key = f"{tb.ENV_RUN}={run_id}".encode()
    pids = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = f.read().split(b"\0")
        except OSError:  # gone meanwhile
            continue
        if any(v.startswith(key) for v in env):
            pids.append(int(pid))
    return {"namespaces": names, "pids": pids}


@pytest.fixture(scope="session")
def testbed(tmp_path_factory):
    """A callable ``run(script, *args, nodes=2, ranks_per_node=1, rate="1gbit", timeout=120,
    env=None, grace_s=5.0, module=False) -> zero_kernels.tools.testbed.TestbedResult``."""
    why = tb.unavailable()
    if why is not None:
        pytest.skip(f"no multi-node testbed on this machine: {why}")
    tb.cleanup_stale()
    root = tmp_path_factory.mktemp("testbed")
    count = [0]

    def run(
        script: str,
        *args,
        nodes: int = 2,
        ranks_per_node: int = 1,
        rate="1gbit",
        timeout: float = 120.0,
        env: dict | None = None,
        grace_s: float | None = 5.0,
        module: bool = False,
    ) -> tb.TestbedResult:
        count[0] += 1
        return tb.run(
            script if module else script_path(script),
            args,
            nodes=nodes,
            ranks_per_node=ranks_per_node,
            rate=rate,
            timeout=timeout,
            module=module,
            env=env,
            workdir=str(root / f"testbed-{count[0]}"),
            grace_s=grace_s,
        )

    return run
