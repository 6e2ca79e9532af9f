"""comm's reduce-scatter and all-gather algorithms (native, pairwise, ring, shm) on spawned gloo
ranks.

Against the backend's own collective and a reference sum in the documented order ([Note:
algorithms] in comm.py): all-gather bitwise; p2p reduce-scatter bitwise equal to the reference
(and so to each other), and to native bitwise at 2 ranks (one addition), within the summation
error bound 2(N-1) eps sum|x| at 3 and 4 ranks (gloo sums in another order). Also in-place use,
avg and sum, handles waited in a different order on each rank, the probe's agreement across ranks,
the env override and `set_algorithm`, and the counters. One spawned group per world size.
"""

import logging
import os
import time

import pytest
import torch
from dist_utils import run_workers

from zero_kernels import comm

pytestmark = pytest.mark.distributed

ALGOS = ("native", "pairwise", "ring", "shm")  # native first: the others are compared with it
DTYPES = (torch.float32, torch.bfloat16, torch.float64)
SHARDS = (1, 7, 1023, 65537)


def _inputs(n: int, s: int, dtype: torch.dtype, seed: int) -> list[torch.Tensor]:
    """Every rank's reduce-scatter input (n*s values each), the same on every rank. Magnitudes
    spread over 6 decades, so that the summation order shows in the last bits."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        mag = 10.0 ** torch.randint(-3, 4, (n * s,), generator=g, dtype=torch.float64)
        out.append((torch.randn(n * s, generator=g, dtype=torch.float64) * mag).to(dtype))
    return out


def _chunk(t: torch.Tensor, c: int, s: int) -> torch.Tensor:
    return t[c * s : (c + 1) * s]


def _ref_sum(xs: list[torch.Tensor], c: int, s: int, order: list[int]) -> torch.Tensor:
    acc = _chunk(xs[order[0]], c, s).clone()
    for k in order[1:]:
        acc += _chunk(xs[k], c, s)  # one rounding per addition, in the dtype
    return acc


def _ring_order(c: int, n: int) -> list[int]:
    return [(c + j) % n for j in range(1, n + 1)]  # c+1, c+2, ..., c


def _assert_equal(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    if not torch.equal(got, want):
        bad = (got != want).nonzero().flatten()[:5].tolist()
        raise AssertionError(
            f"{what}: {int((got != want).sum())} of {got.numel()} differ; first at {bad}: "
            f"got {got[bad].tolist()}, want {want[bad].tolist()}"
        )


def _assert_close(got, want, bound, what: str) -> None:
    err = (got.double() - want.double()).abs()
    if not bool((err <= bound).all()):
        i = int((err - bound).argmax())
        raise AssertionError(
            f"{what}: error {err[i].item():.3g} > bound {bound[i].item():.3g} at {i} "
            f"(got {got[i].item()}, want {want[i].item()})"
        )


def _reduce_checks(r: int, n: int) -> dict:
    """Every algorithm, dtype, odd shard size, avg and sum, out of place and in place."""
    checked = 0
    order_matters = False
    for di, dtype in enumerate(DTYPES):
        eps = torch.finfo(dtype).eps
        for s in SHARDS:
            xs = _inputs(n, s, dtype, seed=100 * di + s)
            mine = xs[r]
            ref = _ref_sum(xs, r, s, _ring_order(r, n))
            if n >= 3 and s >= 1023 and dtype != torch.float64:  # the bitwise check has teeth
                own_first = [(r + j) % n for j in range(n)]
                order_matters |= not torch.equal(ref, _ref_sum(xs, r, s, own_first))
            abs_sum = sum(_chunk(x, r, s).double().abs() for x in xs)
            native: dict[bool, torch.Tensor] = {}
            for algo in ALGOS:
                comm.set_algorithm("all", algo)
                chosen = comm.choose_algorithm("reduce_scatter", n * s * mine.element_size())
                assert chosen == ("copy" if n == 1 else algo), chosen
                for avg in (False, True):
                    what = f"reduce_scatter {algo} {dtype} shard={s} avg={avg} rank={r}/{n}"
                    inp = mine.clone()
                    out = torch.full((s,), float("nan"), dtype=dtype)
                    comm.reduce_scatter(out, inp, avg=avg).wait()
                    inp2 = mine.clone()
                    own = _chunk(inp2, r, s)  # stage 1: output is the rank's slice of input
                    comm.reduce_scatter(own, inp2, avg=avg).wait()
                    _assert_equal(own, out, what + " in place vs out of place")
                    if algo == "native":
                        native[avg] = out
                        continue
                    _assert_equal(inp, mine, what + ": input modified")
                    inp2[r * s : (r + 1) * s] = mine[r * s : (r + 1) * s]
                    _assert_equal(inp2, mine, what + " in place: other chunks modified")
                    want = ref / n if avg else ref  # sum, then divide once
                    _assert_equal(out, want, what + " vs reference in the documented order")
                    if n == 2:
                        _assert_equal(out, native[avg], what + " vs native")
                    else:
                        bound = 2 * (n - 1) * eps * abs_sum / (n if avg else 1)
                        bound = bound + eps * want.double().abs()  # the division's rounding
                        _assert_close(out, native[avg], bound, what + " vs native")
                    checked += 1
            # all-gather: bitwise, out of place and in place
            want = torch.cat([_chunk(xs[k], k, s) for k in range(n)])
            for algo in ALGOS:
                comm.set_algorithm("all", algo)
                what = f"all_gather {algo} {dtype} shard={s} rank={r}/{n}"
                out = torch.full((n * s,), float("nan"), dtype=dtype)
                comm.all_gather(out, _chunk(xs[r], r, s).clone()).wait()
                _assert_equal(out, want, what)
                buf = torch.full((n * s,), float("nan"), dtype=dtype)
                buf[r * s : (r + 1) * s] = _chunk(xs[r], r, s)
                comm.all_gather(buf, _chunk(buf, r, s)).wait()
                _assert_equal(buf, want, what + " in place")
                checked += 1
    comm.set_algorithm("all", None)
    if n >= 3:
        assert order_matters, "test inputs too tame: summation order never changed a bit"
    return {"checked": checked}


def _out_of_order_checks(r: int, n: int) -> None:
    """Several collectives in flight, waited in a different order on each rank."""
    s = 4099
    xs = _inputs(n, s, torch.float32, seed=7)
    ys = _inputs(n, 2 * s, torch.float32, seed=8)
    for algos in (
        ("pairwise",) * 3,
        ("ring",) * 3,
        ("shm",) * 3,
        ("ring", "pairwise", "native"),
        ("shm", "native", "shm"),
    ):
        comm.set_algorithm("all", algos[0])
        a_out = torch.empty(s)
        a = comm.reduce_scatter(a_out, xs[r].clone(), avg=True)
        comm.set_algorithm("all", algos[1])
        b_out = torch.empty(n * s)
        b = comm.all_gather(b_out, _chunk(xs[r], r, s).clone())
        comm.set_algorithm("all", algos[2])
        c_in = ys[r].clone()
        c = comm.reduce_scatter(_chunk(c_in, r, 2 * s), c_in, avg=False)
        handles = [a, b, c]
        for i in ([2, 0, 1], [1, 2, 0], [0, 2, 1])[r % 3]:
            handles[i].wait()
        assert all(h.done for h in handles)
        assert all(h.work.is_completed() for h in handles if type(h.work).__name__ != "Work")
        what = f"out of order {algos} rank={r}/{n}"
        if algos[0] != "native":
            _assert_equal(a_out, _ref_sum(xs, r, s, _ring_order(r, n)) / n, what + " (a)")
        _assert_equal(b_out, torch.cat([_chunk(xs[k], k, s) for k in range(n)]), what + " (b)")
        if algos[2] != "native":
            want = _ref_sum(ys, r, 2 * s, _ring_order(r, n))
            _assert_equal(_chunk(c_in, r, 2 * s), want, what + " (c)")
    comm.set_algorithm("all", None)


def _shm_checks(r: int, n: int) -> None:
    """shm: more collectives in flight than slots, waited in a different order on each rank; a
    slot that grows; no file left in /dev/shm; a bounded wait given up and resumed; ranks that
    launch different collectives all get the same error at once."""
    from zero_kernels.comm import shm

    comm.set_algorithm("all", "shm")
    piece = shm.SLOT_BYTES
    # 70001 replaces every slot's file by a larger one; 4 KiB pieces make each collective many
    # (a launch then waits for the other ranks' launch: more pieces in flight than slots)
    for s, shm.SLOT_BYTES in ((513, piece), (70001, piece), (70001, 4096 * n)):
        xs = _inputs(n, s, torch.float32, seed=11 + s)
        hs, outs = [], []
        for i in range(2 * shm.SLOTS + 1):
            if i % 2:
                outs.append(torch.full((n * s,), float("nan")))
                hs.append(comm.all_gather(outs[-1], _chunk(xs[r], r, s).clone()))
            else:
                outs.append(torch.full((s,), float("nan")))
                hs.append(comm.reduce_scatter(outs[-1], xs[r].clone(), avg=i == 2))
        for i in [[4, 3, 2, 1, 0], [2, 0, 4, 1, 3], [1, 4, 0, 3, 2], [0, 1, 2, 3, 4]][r]:
            hs[i].wait()
        for i, out in enumerate(outs):
            if i % 2:
                want = torch.cat([_chunk(xs[k], k, s) for k in range(n)])
            else:
                want = _ref_sum(xs, r, s, _ring_order(r, n)) / (n if i == 2 else 1)
            _assert_equal(out, want, f"shm in flight #{i} shard={s} rank={r}/{n}")
    shm.SLOT_BYTES = piece
    ch = shm.CHANNELS[shm.channel_key(None)]
    comm.barrier()  # every rank has mapped every file: each was unlinked by the last to map it
    prefix = os.path.basename(ch.base)
    assert not [f for f in os.listdir(comm.hosts.SHM_DIR) if f.startswith(prefix)], prefix
    # a wait bounded by a timeout is given up and resumed (gloo's cannot be)
    g = torch.distributed.new_group(backend="gloo")
    assert shm.capable(g) is None  # the group's first shm use sets its channel up: collective
    out = torch.full((4 * n,), float("nan"))
    if r == 0:
        h = comm.all_gather(out, torch.full((4,), 0.0), group=g)
        with pytest.raises(comm.CollectiveTimeout, match="within 0.3 s"):
            h.wait(timeout_s=0.3)
    comm.barrier()
    if r != 0:
        h = comm.all_gather(out, torch.full((4,), float(r)), group=g)
    h.wait(timeout_s=30)
    assert torch.equal(out, torch.arange(n, dtype=torch.float32).repeat_interleave(4)), out
    # ranks that launch different collectives: a ValueError on every rank, at once
    numel = 8 if r == 0 else 16
    with pytest.raises(ValueError, match="launched different collectives"):
        comm.all_gather(torch.empty(numel * n), torch.ones(numel), group=g).wait(timeout_s=30)
    # a rank whose process ends while another waits for it: the waiter raises within a few
    # slices (its lock on the control file goes with the process; closing the channel drops it
    # the same way), not at the group's timeout
    g3 = torch.distributed.new_group(backend="gloo")
    assert shm.capable(g3) is None
    comm.barrier()
    if r == n - 1:
        shm.CHANNELS[shm.channel_key(g3)].close()
    comm.barrier()
    if r != n - 1:
        t0 = time.monotonic()
        h = comm.all_gather(torch.empty(4 * n), torch.ones(4), group=g3)
        with pytest.raises(comm.CollectiveTimeout, match=f"rank {n - 1} of the group ended"):
            h.wait(timeout_s=60, what="all-gather for the test")
        assert time.monotonic() - t0 < 5, time.monotonic() - t0
    comm.barrier()
    # no room in /dev/shm for the slots (here: pieces too large for it): not offered, and the
    # same answer on every rank; forcing it is a clear error, the probe leaves it out
    g2 = torch.distributed.new_group(backend="gloo")
    shm.SLOT_BYTES = 1 << 50
    why = shm.capable(g2)
    shm.SLOT_BYTES = piece
    assert why is not None and "MiB free" in why, why
    with pytest.raises(ValueError, match="cannot run on this group: .*MiB free"):
        comm.all_gather(torch.empty(4 * n), torch.ones(4), group=g2)
    comm.set_algorithm("all", None)
    assert comm.choose_algorithm("all_gather", 1 << 10, group=g2) != "shm"
    assert all("shm" not in v["times_ms"] for v in comm.probe_results(g2).values())


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def _probe_checks(r: int, n: int, sizes: tuple[int, ...]) -> dict:
    """The probe, lazily per (op, size class), agreed by every rank, logged once per choice."""
    os.environ.pop(comm.ENV_ALGO, None)
    logger = logging.getLogger("zero_kernels")
    rec = _Records()
    logger.addHandler(rec)
    logger.setLevel(logging.INFO)
    try:
        picks = [
            comm.choose_algorithm(op, b) for b in sizes for op in ("reduce_scatter", "all_gather")
        ]
        results = comm.probe_results()
        n_lines = len(rec.lines)
        again = [
            comm.choose_algorithm(op, b) for b in sizes for op in ("reduce_scatter", "all_gather")
        ]
        assert again == picks and len(comm.probe_results()) == len(results)
        assert len(rec.lines) == n_lines, rec.lines[n_lines:]  # logged once per choice
        if n > 1:
            assert len(results) == 2 * len({comm.size_class(b) for b in sizes})
            assert n_lines == len(results), rec.lines
        # a collective of a probed class uses the probe's choice, and is correct
        s = sizes[-1] // 4 // n
        xs = _inputs(n, s, torch.float32, seed=9)
        out = torch.empty(s)
        comm.reduce_scatter(out, xs[r].clone(), avg=False).wait()
        ref = _ref_sum(xs, r, s, _ring_order(r, n))
        if picks[-2] != "native" and n > 1:
            _assert_equal(out, ref, "probe's choice")
        else:  # gloo sums in another order
            bound = 2 * max(n - 1, 0) * torch.finfo(torch.float32).eps
            bound = bound * sum(_chunk(x, r, s).double().abs() for x in xs)
            _assert_close(out, ref, bound, "probe's choice (native)")
    finally:
        logger.removeHandler(rec)
    agreed = {k: (v["algorithm"], v["times_ms"]) for k, v in results.items()}
    seconds = sum(v["seconds"] for v in results.values())
    return {"picks": picks, "agreed": agreed, "probe_s": seconds, "log": rec.lines}


def _override_checks(r: int, n: int) -> None:
    big = 64 << 20  # a class never probed here: overrides must not probe
    before = len(comm.probe_results())
    os.environ[comm.ENV_ALGO] = "ring"
    try:
        want = "copy" if n == 1 else "ring"
        assert comm.choose_algorithm("reduce_scatter", big) == want
        assert comm.choose_algorithm("all_gather", big) == want
        comm.set_algorithm("reduce_scatter", "pairwise")  # set_algorithm wins over the env
        assert comm.choose_algorithm("reduce_scatter", big) == ("copy" if n == 1 else "pairwise")
        assert comm.choose_algorithm("all_gather", big) == want
        comm.set_algorithm("reduce_scatter", None)
        assert comm.choose_algorithm("reduce_scatter", big) == want
        s = 1000
        xs = _inputs(n, s, torch.float32, seed=10)
        out = torch.empty(s)
        comm.reduce_scatter(out, xs[r].clone(), avg=True).wait()
        _assert_equal(out, _ref_sum(xs, r, s, _ring_order(r, n)) / n, "env ring")
        os.environ[comm.ENV_ALGO] = "bogus"
        if n > 1:
            with pytest.raises(ValueError, match="ZERO_KERNELS_COMM_ALGO"):
                comm.choose_algorithm("reduce_scatter", big)
    finally:
        os.environ.pop(comm.ENV_ALGO, None)
    assert len(comm.probe_results()) == before
    with pytest.raises(ValueError, match="algo"):
        comm.set_algorithm("reduce_scatter", "tree")
    with pytest.raises(ValueError, match="op"):
        comm.set_algorithm("all_reduce", "ring")
    with pytest.raises(ValueError, match=r"output.numel\(\) \* world_size"):
        comm.reduce_scatter(torch.empty(3), torch.empty(3 * n + 1))
    if n > 1:  # in place only as the rank's own chunk
        comm.set_algorithm("all", "pairwise")
        x = torch.zeros(3 * n)
        other = (r + 1) % n
        with pytest.raises(ValueError, match="not this rank's chunk"):
            comm.reduce_scatter(x[other * 3 : other * 3 + 3], x)
        with pytest.raises(ValueError, match="not this rank's chunk"):
            comm.all_gather(x, x[other * 3 : other * 3 + 3])
        comm.set_algorithm("all", None)


def _counter_checks(r: int, n: int) -> None:
    """One call is one collective in the CommLog, whatever the algorithm."""
    log = comm.CommLog()
    for algo in ALGOS:
        comm.set_algorithm("all", algo)
        comm.reduce_scatter(torch.empty(5), torch.ones(5 * n), log=log).wait()
        comm.all_gather(torch.empty(5 * n), torch.ones(5), log=log).wait()
    # receive buffers: N-1 shards in place, N-2 out of place (one peer's chunk lands in output)
    comm.set_algorithm("all", "pairwise")
    s = 1000
    x = torch.ones(n * s)
    comm.free_scratch()
    h1 = comm.reduce_scatter(x[r * s : (r + 1) * s], x, log=log)
    h2 = comm.reduce_scatter(torch.empty(s), torch.ones(n * s), log=log)
    assert comm.scratch_bytes()["in_use"] == (max(n - 1, 0) + max(n - 2, 0)) * s * 4
    h2.wait()
    h1.wait()
    assert comm.scratch_bytes() == {"in_use": 0, "cached": (max(n - 1, 0) + max(n - 2, 0)) * s * 4}
    comm.reduce_scatter(torch.empty(s), torch.ones(n * s), log=log).wait()  # reuses, no growth
    assert comm.scratch_bytes()["cached"] == (max(n - 1, 0) + max(n - 2, 0)) * s * 4
    assert torch.equal(x[r * s : (r + 1) * s], torch.ones(s))  # avg of ones
    comm.set_algorithm("all", None)
    log.reduce_scatter_calls -= 3
    log.reduce_scatter_bytes -= 3 * n * s * 4
    a = len(ALGOS)
    assert log.reduce_scatter_calls == a and log.all_gather_calls == a, log.as_dict()
    assert log.reduce_scatter_bytes == a * 20 * n and log.all_gather_bytes == a * 20 * n


def checks(rank: int, world: int) -> dict:
    probe_sizes = (1 << 10, 512 << 10, 4 << 20) if world == 2 else (1 << 10, 512 << 10)
    out = _probe_checks(rank, world, probe_sizes)  # first: nothing chosen yet
    _override_checks(rank, world)
    out.update(_reduce_checks(rank, world))
    if world > 1:
        _out_of_order_checks(rank, world)
        _shm_checks(rank, world)
    _counter_checks(rank, world)
    return out


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_comm_algorithms(world):
    res = run_workers(checks, world, timeout=150)
    for r in res[1:]:  # the probe's numbers and choices are the same on every rank
        assert r["picks"] == res[0]["picks"] and r["agreed"] == res[0]["agreed"], res
    if world == 1:
        assert set(res[0]["picks"]) == {"copy"} and not res[0]["agreed"]
    else:
        assert set(res[0]["picks"]) <= set(ALGOS)
        print(f"world {world}: probe {res[0]['agreed']}, {max(r['probe_s'] for r in res):.3f} s")
    if world == 2:  # every class of both ops probed costs well under a second
        assert max(r["probe_s"] for r in res) < 1.0, [r["probe_s"] for r in res]


def test_size_classes():
    cases = {0: 0, (64 << 10) - 1: 0, 64 << 10: 1, 1 << 20: 3, (4 << 20) - 1: 3, 4 << 20: 4}
    cases.update({(16 << 20) - 1: 4, 16 << 20: 5, 76 << 20: 5})
    for nbytes, c in cases.items():
        assert comm.size_class(nbytes) == c, (nbytes, c)
    labels = [comm.class_label(c) for c in range(6)]
    assert labels == [
        "< 64 KiB",
        "[64 KiB, 256 KiB)",
        "[256 KiB, 1 MiB)",
        "[1 MiB, 4 MiB)",
        "[4 MiB, 16 MiB)",
        ">= 16 MiB",
    ]


def test_exit_process_runs_exit_handlers_and_flushes(tmp_path):
    """[Note: leaving a rank]: exit_process runs the exit handlers (the shm files' unlink lives
    there), flushes what is buffered, exits with the code given, and skips the interpreter's
    finalization (an object's __del__, which finalization would run, does not)."""
    import subprocess
    import sys

    mark = tmp_path / "handler_ran"
    fin = tmp_path / "finalizer_ran"
    code = (
        "import atexit, sys\n"
        "from zero_kernels import comm\n"
        "assert not comm.joined_here()\n"
        f"atexit.register(lambda: open({str(mark)!r}, 'w').write('ok'))\n"
        "class K:\n"
        f"    def __del__(self, _open=open): _open({str(fin)!r}, 'w').write('x')\n"
        "k = K()\n"
        "sys.stdout.write('buffered, no newline')\n"
        "comm.exit_process(3)\n"
        "print('not reached')\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 3, r.stderr
    assert r.stdout == "buffered, no newline"
    assert mark.read_text() == "ok"
    assert not fin.exists()
