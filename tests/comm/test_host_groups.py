"""`zero_kernels.comm.host_groups`: ranks share a host only when each read a file another wrote in
/dev/shm ([Note: hosts are proven]). On one host every rank is in one group; ranks pointed at
different folders (what containers with a private /dev/shm each, or the testbed's nodes, see)
are apart, and then shm is neither probed nor allowed on their group."""

from __future__ import annotations

import os
import tempfile

import pytest
from dist_utils import SharedRun, run_checks

from zero_kernels.comm import hosts

WORLD = 3


def _one_host(rank, world):
    from zero_kernels import comm

    assert comm.host_groups() == [list(range(world))]
    real = hosts._prove
    hosts._prove = None  # cached: a second call proves nothing again (no collective)
    try:
        assert comm.host_groups() == [list(range(world))]
    finally:
        hosts._prove = real
    assert comm.shm.capable(None) is None
    assert not [f for f in os.listdir(comm.hosts.SHM_DIR) if f.startswith("zero_kernels-host-")]


def _private_shm(rank, world):
    """Ranks 0 and 2 on one "host", rank 1 on another: each pair of folders stands for a
    /dev/shm of its own (a torch.from_file there would create the missing file)."""
    import torch
    import torch.distributed as dist

    from zero_kernels import comm

    group = dist.new_group(list(range(world)), backend="gloo")
    base = os.environ["ZK_TEST_SHM_BASE"]
    comm.hosts.SHM_DIR = os.path.join(base, "b" if rank == 1 else "a")
    try:
        got = comm.host_groups(group)
        assert got == [[0, 2], [1]], (got, comm.hosts.SHM_DIR)
        why = comm.shm.capable(group)
        assert why is not None and "on 2 hosts" in why and "[[0, 2], [1]]" in why, why
        out, inp = torch.zeros(1 << 18), torch.ones(world << 18)  # 3 MiB: a probed class
        comm.reduce_scatter(out, inp, group=group).wait()
        assert bool((out == 1).all())
        probed = comm.probe_results(group)
        assert probed and all("shm" not in r["times_ms"] for r in probed.values()), probed
        comm.set_algorithm("all", "shm", group=group)
        with pytest.raises(ValueError, match="on 2 hosts"):
            comm.reduce_scatter(out, inp, group=group)
        comm.set_algorithm("all", None, group=group)
    finally:
        comm.hosts.SHM_DIR = "/dev/shm"


def _worker(rank, world):
    return run_checks(rank, world, [_one_host, _private_shm])


RUN = SharedRun(_worker, timeout=240)


@pytest.fixture(scope="module", autouse=True)
def _shm_base():
    with tempfile.TemporaryDirectory() as d:
        for sub in ("a", "b"):
            os.mkdir(os.path.join(d, sub))
        os.environ["ZK_TEST_SHM_BASE"] = d  # the spawned ranks inherit it
        yield
        os.environ.pop("ZK_TEST_SHM_BASE", None)


@pytest.mark.distributed
def test_one_host_is_one_group():
    RUN.check(WORLD, "_one_host")


@pytest.mark.distributed
def test_private_shm_is_another_host():
    RUN.check(WORLD, "_private_shm")


def test_grouping_needs_both_ways():
    t, f = True, False
    assert hosts.mutual_groups([[t, t, f], [t, t, f], [f, f, t]]) == ((0, 1), (2,))
    assert hosts.mutual_groups([[t, t, t], [f, t, t], [t, t, t]]) == (
        (0, 2),
        (1,),
    )  # 1 cannot read 0
    # 0-1 and 1-2 mutual but 0-2 not: 2 does not join 0's group
    assert hosts.mutual_groups([[t, t, f], [t, t, t], [f, t, t]]) == ((0, 1), (2,))
    assert hosts.mutual_groups([[t]]) == ((0,),)
