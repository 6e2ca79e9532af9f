"""Quantized gradients in two hops across hosts (``quantize_grads`` on a flat group spanning
nodes; tests/topology/hier_quant_checks.py): the choice from the host layout (pure), then
spawned groups of 4 ranks (2 emulated nodes x 2) and 8 ranks (2 x 4), each concern its own test."""

import hier_quant_checks
import pytest
from dist_utils import SharedRun

RUN = SharedRun(hier_quant_checks.worker, timeout=300)
RUN_8 = SharedRun(hier_quant_checks.worker_8, timeout=300)


@pytest.mark.parametrize(
    "hosts, hops",
    [
        ([[0, 1, 2, 3]], 1),  # one host: nothing crosses
        ([[0], [1], [2]], 1),  # one rank per host: the two forms are one
        ([[0, 1, 2], [3]], 1),  # unequal nodes: the slices would not line up
        ([[0, 1], [2, 3]], 2),
        ([[0, 2], [1, 3]], 2),  # not node-major: still two hops
        ([list(range(8 * k, 8 * k + 8)) for k in range(8)], 2),
    ],
)
def test_plan_from_hosts(hosts, hops):
    from zero_kernels.comm.hier_quant import plan

    got, why = plan(hosts)
    assert got == hops, why
    if hops == 2:
        assert f"{len(hosts[0])}x fewer bytes" in why, why


@pytest.mark.distributed
@pytest.mark.parametrize("check", [c.__name__ for c in hier_quant_checks.CHECKS])
def test_hier_quant_grads(check):
    RUN.check(4, check)


@pytest.mark.slow  # 8 processes on 2 cores: ~45 s
@pytest.mark.distributed
@pytest.mark.parametrize("check", [c.__name__ for c in hier_quant_checks.CHECKS_8])
def test_hier_quant_grads_8_ranks(check):
    RUN_8.check(8, check)


def test_plan_setting(monkeypatch):
    """``ZERO_KERNELS_GRAD_HOPS``: 1 keeps one hop, 2 asks for two (an error without them),
    anything else is refused."""
    from zero_kernels.comm.hier_quant import ENV_HOPS, plan

    two = [[0, 1], [2, 3]]
    monkeypatch.setenv(ENV_HOPS, "1")
    assert plan(two)[0] == 1 and ENV_HOPS in plan(two)[1]
    monkeypatch.setenv(ENV_HOPS, "2")
    assert plan(two)[0] == 2
    with pytest.raises(ValueError, match="no two hops"):
        plan([[0, 1, 2, 3]])
    monkeypatch.setenv(ENV_HOPS, "3")
    with pytest.raises(ValueError, match="must be 1, 2 or auto"):
        plan(two)
    monkeypatch.delenv(ENV_HOPS)
    assert plan(two)[0] == 2 and plan(two, 1)[0] == 1
