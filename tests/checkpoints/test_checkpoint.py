"""Checkpoints: round trips across world sizes, stages, modes and precisions (spawned gloo
ranks), crash safety, corruption, the kept old-version file, the API's errors."""

import os
import random
import shutil
import signal
import time

import checkpoint_checks as cc
import pytest
from dist_utils import run_workers

import zero_kernels as zk
from zero_kernels.checkpoint import verify_checkpoint

FIXTURE = os.path.join(os.path.dirname(os.path.dirname(__file__)), "data", "checkpoint_v1")

pytestmark = pytest.mark.distributed


def test_roundtrip_matrix(tmp_path):
    """See [Note: the round-trip matrix] in checkpoint_checks."""
    prev = None
    results = []
    for world in (1, 2, 3, 4, 1):
        reports = run_workers(cc.check_matrix, world, str(tmp_path / "m"), prev, timeout=400)
        results += reports[0]
        prev = world
    loads = len(results)
    continued = sum(r["continued"] for r in results)
    bitwise = sum(r["bitwise"] for r in results)
    assert loads == 5 * 2 * len(cc.CONFIGS) + 4 * len(cc.CONFIGS), loads
    assert bitwise == 5 * len(cc.CONFIGS), bitwise
    assert continued >= loads * 3 // 4, (continued, loads)


# ---------------------------------------------------------------------------- crash safety


def _fork(fn, *args) -> int:
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 0
        try:
            fn(*args)
        except BaseException:
            code = 3
        os._exit(code)
    return pid


def _check_root(root: str) -> int | None:
    """The latest checkpoint loads and holds what its step says; every other complete one
    loads; every partial one is refused. Returns the latest step (None: nothing saved yet)."""
    m, o = cc.small_pair()
    try:
        extra = zk.load_checkpoint(root, m, o)
    except zk.CheckpointError as e:
        assert not os.path.isdir(root) or not any(
            n.startswith("step-") for n in os.listdir(root)
        ), e
        return None
    s = extra["step"]
    assert all(bool((p == s).all()) for p in m.parameters()), s
    assert o.state_dict()["state"], "momentum state lost"
    for n in os.listdir(root):
        full = os.path.join(root, n)
        if n.startswith("step-"):
            m, o = cc.small_pair()
            s2 = zk.load_checkpoint(full, m, o)["step"]
            assert all(bool((p == s2).all()) for p in m.parameters())
        elif n.startswith(".tmp-") and os.path.isdir(full):
            with pytest.raises(zk.CheckpointError, match="partial"):
                zk.load_checkpoint(full, *cc.small_pair())
    return s


def test_killed_at_random_points_during_save(tmp_path):
    """20 saving processes killed (SIGKILL) at random times: the latest always loads."""
    root = str(tmp_path / "k")
    rnd = random.Random(0)
    start, loaded = 0, 0
    for _ in range(20):
        pid = _fork(cc.save_loop, root, start)
        time.sleep(rnd.uniform(0.0, 0.15))
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        s = _check_root(root)
        if s is not None:
            assert s >= start - 1, (s, start)
            start, loaded = s + 1, loaded + 1
    assert loaded >= 15 and start > 20, (loaded, start)


def test_killed_at_every_file_operation(tmp_path):
    """A save killed at its n-th fsync/rename/removal, for every n: step s or s + 1 loads."""
    n = 0
    while True:
        n += 1
        root = str(tmp_path / f"c{n}")
        pid = _fork(cc.save_crashing, root, 10, n)
        _, status = os.waitpid(pid, 0)
        s = _check_root(root)
        if os.WIFEXITED(status):  # the save finished before its n-th operation
            assert os.WEXITSTATUS(status) == 0 and s == 11, (n, status, s)
            break
        assert os.WTERMSIG(status) == signal.SIGKILL, status
        assert s in (10, 11), (n, s)
    assert n > 8, n  # the save has that many durable steps


# ---------------------------------------------------------------------------- corruption
def _flip(path: str, pos: int) -> bytes:
    with open(path, "r+b") as f:
        f.seek(pos)
        b = f.read(1)
        f.seek(pos)
        f.write(bytes([b[0] ^ 0x01]))
    return b


def test_one_flipped_byte_in_any_file(tmp_path):
    root = str(tmp_path / "c")
    shutil.copytree(FIXTURE, root)
    files = [os.path.join(root, "latest")]
    d = os.path.join(root, "step-00000003")
    files += sorted(os.path.join(d, n) for n in os.listdir(d))
    assert len(files) == 5, files
    checked = 0
    for path in files:
        size = os.path.getsize(path)
        for pos in sorted({0, 5, 9, size // 3, size // 2, size - 2, size - 1}):
            old = _flip(path, pos)
            wrapped, m, o, sched = cc.build(("adamw", 0, "flat", "fp32"))
            with pytest.raises(zk.CheckpointError) as e:
                zk.load_checkpoint(root, wrapped, o, scheduler=sched)
            assert os.path.basename(path) in str(e.value), (path, pos, str(e.value))
            assert any(os.path.basename(path) in p for p in verify_checkpoint(root)), (path, pos)
            with open(path, "r+b") as f:
                f.seek(pos)
                f.write(old)
            checked += 1
    assert verify_checkpoint(root) == []
    assert checked >= 30


# ---------------------------------------------------------------------------- old version
def test_old_version_file_loads():
    """tests/data/checkpoint_v1 (format 1, ZeRO stage 2 at world size 2) loads at world size 1
    into a plain optimizer and into ZeRO stage 1, equal to training here without a save."""
    ref_c = ("adamw", 0, "flat", "fp32")
    wrapped, m, o, sched = cc.build(ref_c)
    cc.train(ref_c, wrapped, o, sched, 0, 1, range(cc.K))
    want = cc.full_state(m, o)
    want_p = cc.snapshot(m, o)
    for c in (ref_c, ("adamw", 1, "whole", "fp32")):
        wrapped, m, o, sched = cc.build(c, seed=1)
        extra = zk.load_checkpoint(FIXTURE, wrapped, o, scheduler=sched)
        assert extra == {"step": cc.K, "note": "v1"}
        got = cc.full_state(m, o)
        for n, v in cc.snapshot(m, o).items():
            assert cc.rel_err(v, want_p[n]) <= 1e-6, (c, n)
        for n, st in want["state"].items():
            for k, v in st.items():
                assert cc.rel_err(got["state"][n][k], v) <= 1e-6, (c, n, k)
        assert [g["lr"] for g in got["groups"]] == [g["lr"] for g in want["groups"]]
        assert sched.last_epoch == cc.K
        if isinstance(o, zk.ZeroOptimizer):
            o.close()


# ---------------------------------------------------------------------------- lost ranks
@pytest.mark.parametrize("how", ["sigstop", "raise", "stall_in_save"])
def test_lost_rank_fails_the_save_within_the_timeout(tmp_path, how):
    """See [Note: checkpoint timeouts]: ZeroOptimizer(timeout=2)."""
    out = run_workers(cc.check_lost_rank, 2, str(tmp_path / "r"), how, timeout=120)
    r0 = out[0]
    assert r0["seconds"] < 2 + 5, r0  # the timeout plus the machine's slack
    assert "save at step 7" in r0["error"] and "not every rank took part" in r0["error"], r0
