"""Checks run inside 2 gloo workers for tests/offload/test_offload.py: offload_optimizer="nvme"
against
the same run without offload (bitwise), its I/O per step, checkpoints both ways, memory counts,
the file's lifetime and the refusals."""

from __future__ import annotations

import contextlib
import gc
import os
import tempfile

import torch
from dist_utils import run_checks
from lowbit_checks import _no_decode
from torch import nn
from zero_opt import zero_opt

import zero_kernels

DIR = os.environ.get("ZK_TEST_OFFLOAD_DIR") or tempfile.gettempdir()


def model(dtype=torch.float32, width=48):
    torch.manual_seed(0)
    layers = [nn.Linear(48, width), nn.Linear(width, width), nn.Linear(width, 48)]
    return nn.Sequential(*layers, nn.Linear(48, 48)).to(dtype)


def build(m, stage, off, bucket_mb=0.004, **kw):
    """``bucket_mb=0.1`` and width 128 with the 0.1 MiB of staging: several chunks per
    bucket, whose bounds cut params (runs of pieces cut at chunk bounds)."""
    extra = {}
    if off:
        extra = {"offload_optimizer": "nvme", "offload_dir": DIR, "offload_staging_mb": 0.1}
    return zero_opt(
        m,
        torch.optim.AdamW,
        stage=stage,
        lr=1e-2,
        weight_decay=0.1,
        bucket_size_mb=bucket_mb,
        **(extra | kw),
    )


def train(m, opt, steps, rank, start=0):
    for s in range(start, start + steps):
        g = torch.Generator().manual_seed(100 * s + rank)
        x = torch.randn(6, 48, generator=g).to(next(m.parameters()).dtype)
        opt.zero_grad()
        m(x).float().square().mean().backward()
        opt.clip_grad_norm_(0.05)  # clipping on: every step is clipped here
        opt.step()


def snapshot(m, opt):
    w = {k: v.detach().clone() for k, v in m.state_dict().items()}
    st = [opt.full_state(p) for p in m.parameters()]
    return w, st


def same(a, b) -> bool:
    (wa, sa), (wb, sb) = a, b
    return all(torch.equal(wa[k], wb[k]) for k in wa) and all(
        x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x) for x, y in zip(sa, sb)
    )


def _bitwise(stage, dtype, width=None, **kw):
    def check(rank, world):
        runs = []
        for off in (False, True):
            m = model(dtype, width or (128 if kw.get("bucket_mb") else 48))
            opt = build(m, stage, off, **kw)
            train(m, opt, 4, rank)
            runs.append(snapshot(m, opt))
            if off and kw.get("bucket_mb"):
                sw = opt.parts.core.runner.swap
                assert max(len(r) for r in sw.records.values()) >= 2, sw.records
            opt.close()
        assert same(*runs), f"stage {stage} {dtype}: offloaded run differs"
        return {}

    tags = "".join(f"_{k}" for k in kw)
    check.__name__ = f"bitwise_stage{stage}_{str(dtype)[6:]}{tags}"
    return check


def io_per_step(rank, world):
    """Each step reads and writes every bucket's record once: the moments, nothing more."""
    m = model()
    opt = build(m, 2, True)
    sw = opt.parts.core.runner.swap
    record, need = sw.record_bytes(), sw.moment_bytes()
    train(m, opt, 3, rank)
    rd, wr = sw.bytes_read, sw.bytes_written
    assert rd == wr == 3 * record, (rd, wr, record)
    pads = sum(len(sw.names[i]) * len(rs) for (i, _), rs in sw.records.items())  # 4 KiB each
    assert need <= record < need + 4096 * pads, (record, need, pads)
    rep = opt.memory_report()
    steps = 4 * len(list(opt.parts.core.runner.all_pieces()))  # each piece's 0-dim step
    assert rep["optim_state_bytes"] <= steps, rep  # nothing of the moments stays in RAM
    assert rep["offload_disk_bytes"] == sw.nbytes >= need
    assert rep["offload_staging_bytes"] == sw.staging_bytes > 0
    assert rep["offload_read_bytes"] == rd
    direct = sw.file.direct
    opt.close()
    return {"record_bytes": record, "needed_bytes": need, "o_direct": direct}


def lowbit_moments(rank, world):
    """state_dtype="bf16" / "int8" with offload: the file holds bf16 moments (half fp32's
    bytes) or int8 codes with their blocks' scales (a quarter, + 8 bytes per block), each step
    reads and writes them once."""
    got = {}
    for sd in ("fp32", "bf16", "int8"):
        m = model(width=384)  # buckets of ~0.1M elements: the records' padding is small
        opt = build(
            m, 2, True, bucket_mb=1.0, offload_staging_mb=4.0, state_dtype=sd, state_block=64
        )
        sw = opt.parts.core.runner.swap
        train(m, opt, 2, rank)
        got[sd] = (sw.moment_bytes(), sw.bytes_read, sw.record_bytes())
        assert sw.bytes_read == sw.bytes_written == 2 * sw.record_bytes(), (sd, got[sd])
        opt.close()
    n = got["fp32"][0] // 8  # elements of this rank's shards
    assert 2 * got["bf16"][0] == got["fp32"][0], got
    assert 2 * n <= got["int8"][0] <= (2 + 8 / 64) * n + 8 * 64, (got, n)
    assert 3.5 * got["int8"][1] < got["fp32"][1] and 1.9 * got["bf16"][1] < got["fp32"][1], got
    return {"bytes_read": {k: v[1] for k, v in got.items()}}


def checkpoints(rank, world):
    """Saved with offload at stage 3, loaded without it at stage 2 and the other way round:
    the next steps equal an uninterrupted run's; with int8 moments offloaded (saved as codes),
    too."""
    m0 = model()
    o0 = build(m0, 2, False)
    train(m0, o0, 5, rank)
    want = snapshot(m0, o0)
    o0.close()
    d = os.path.join(DIR, f"zk-offload-ckpt-{os.getppid()}")
    for first, second in (((3, True), (2, False)), ((2, False), (3, True))):
        m = model()
        o = build(m, first[0], first[1])
        train(m, o, 3, rank)
        path = zero_kernels.save_checkpoint(d, m, o, extra={"step": 3})
        o.close()
        m2 = model()
        with torch.no_grad():
            for p in m2.parameters():
                p.zero_()
        o2 = build(m2, second[0], second[1])
        zero_kernels.load_checkpoint(path, m2, o2)
        train(m2, o2, 2, rank, start=3)
        got = snapshot(m2, o2)
        o2.close()
        assert same(got, want), f"saved {first}, loaded {second}: differs"
    # int8 moments offloaded: saved as codes and scales, resumed on the same blocks bitwise
    kw = {"state_dtype": "int8", "state_block": 64}
    runs = []
    for steps in (5, 3):
        m = model()
        o = build(m, 3, True, **kw)
        train(m, o, steps, rank)
        runs.append(snapshot(m, o) if steps == 5 else None)
        if steps == 3:
            with _held(o) as most, _no_decode(o) as decoded:
                path = zero_kernels.save_checkpoint(d + "-int8", m, o, extra={"step": 3})
            assert decoded == [], "the save of offloaded int8 codes decoded them"
            buckets = len(o.parts.core.runner.swap.records)
            # each bucket held twice (the header's blank pass, the data's), one at a time
            assert len(most) == 2 * buckets > 2 and max(most) == (1, 0), (most, buckets)
        o.close()
    m2 = model()
    o2 = build(m2, 3, True, **kw)
    with _held(o2) as most:  # a bucket's codes and their decode at a time, never the whole
        zero_kernels.load_checkpoint(path, m2, o2)
    assert len(most) == buckets and max(most) == (1, 0), (most, buckets)
    train(m2, o2, 2, rank, start=3)
    got = snapshot(m2, o2)
    o2.close()
    assert same(got, runs[0]), "int8 offloaded: the resume differs"
    # into another layout (stage 2, other buckets: decoded and re-encoded on its blocks), with
    # offload (a bucket at a time) and without it (the whole shard): the same state and steps
    other = []
    for off in (True, False):
        m3 = model()
        o3 = build(m3, 2, off, bucket_mb=0.002, **kw)
        zero_kernels.load_checkpoint(path, m3, o3)
        other.append(snapshot(m3, o3))
        train(m3, o3, 2, rank, start=3)
        other.append(snapshot(m3, o3))
        o3.close()
    assert same(other[0], other[2]) and same(other[1], other[3]), "re-encoded: offload differs"
    torch.distributed.barrier()
    if rank == 0:
        import shutil

        shutil.rmtree(d, ignore_errors=True)
        shutil.rmtree(d + "-int8", ignore_errors=True)
    return {}


@contextlib.contextmanager
def _held(opt):
    """Inside: per `Int8ShardState.hold` of ``opt``, (buckets held with it, whole buffers
    decoded) in the list."""
    int8, most = opt.parts.core.runner.int8, []
    real = int8.hold

    def hold(i, b):
        most.append((len(int8.held) + 1, len(int8.decoded)))
        return real(i, b)

    int8.hold = hold
    try:
        yield most
    finally:
        del int8.hold


def _streams(rank, dtype):
    """Both offloads at stage 3, several buckets: a save holds one bucket's offloaded state in
    RAM at a time (never all of it: `resident` is not entered), and the checkpoint loads into
    a stage-2 optimizer without offload and into one with both offloads (streamed too) to the
    same state and the same next steps ([Note: streamed checkpoints])."""
    m = model(dtype)  # four units of the same size
    o = build(m, 3, True, offload_params="nvme", persist_below=0)
    train(m, o, 3, rank)
    runner = o.parts.core.runner
    sw, tier = runner.swap, o.parts.core.store.tier
    buckets = {k: sum(r[3] for r in v) for k, v in sw.records.items()}
    assert len(buckets) >= 4, buckets
    full = runner.resident

    def refused():
        raise AssertionError("save entered resident(): all of the offloaded state in RAM")

    runner.resident, runner.window_peak_bytes = refused, 0
    base = tier.peak_ram = tier.ram_bytes()
    d = os.path.join(DIR, f"zk-offload-stream-{os.getppid()}-{dtype}")
    try:
        path = zero_kernels.save_checkpoint(d, m, o, extra={"step": 3})
    finally:
        runner.resident = full
    moments = sw.moment_bytes()
    per_bucket: dict = {}  # a bucket's shard and master pages
    for k, r in tier.records.items():
        if not r.pinned:
            per_bucket[k[:2]] = per_bucket.get(k[:2], 0) + r.nbytes
    assert 0 < runner.window_peak_bytes <= 1.01 * max(buckets.values()), (
        runner.window_peak_bytes,
        buckets,
    )
    assert runner.window_peak_bytes < moments / 3, (runner.window_peak_bytes, moments)
    assert len(per_bucket) >= 4, per_bucket
    assert 0 < tier.peak_ram - base <= max(per_bucket.values()), (tier.peak_ram, base, per_bucket)
    want_state = snapshot(m, o)
    train(m, o, 2, rank, start=3)
    want = snapshot(m, o)
    o.close()
    m2 = model(dtype)
    o2 = build(m2, 2, False)
    zero_kernels.load_checkpoint(path, m2, o2)
    assert same(snapshot(m2, o2), want_state), "the streamed save lost or changed state"
    train(m2, o2, 2, rank, start=3)
    assert same(snapshot(m2, o2), want), "the resume from a streamed save differs"
    o2.close()
    # loaded into both offloads: streamed in the same way, the same next steps
    m3 = model(dtype)
    o3 = build(m3, 3, True, offload_params="nvme", persist_below=0)
    r3 = o3.parts.core.runner
    full3, r3.resident = r3.resident, refused
    try:
        zero_kernels.load_checkpoint(path, m3, o3)
    finally:
        r3.resident = full3
    assert 0 < r3.window_peak_bytes <= 1.01 * max(buckets.values()), r3.window_peak_bytes
    assert same(snapshot(m3, o3), want_state), "a streamed load lost or changed state"
    train(m3, o3, 2, rank, start=3)
    assert same(snapshot(m3, o3), want), "the resume from a streamed load differs"
    o3.close()
    torch.distributed.barrier()
    if rank == 0:
        import shutil

        shutil.rmtree(d, ignore_errors=True)
    return {
        "window_peak_bytes": runner.window_peak_bytes,
        "moment_bytes": moments,
        "buckets": len(buckets),
    }


def checkpoint_streams(rank, world):
    """Both offloads at stage 3, several buckets: a save holds one bucket's offloaded state in
    RAM at a time (never all of it: `resident` is not entered), and the checkpoint loads into
    a stage-2 optimizer without offload and into one with both offloads (streamed too) to the
    same state and the same next steps ([Note: streamed checkpoints]); fp32 and bf16 params
    (their fp32 masters offloaded too)."""
    return {str(dt): _streams(rank, dt) for dt in (torch.float32, torch.bfloat16)}


def state_dict_round_trip(rank, world):
    m = model(torch.bfloat16)
    o = build(m, 1, True)
    train(m, o, 2, rank)
    sd = o.state_dict()
    keys = {k for st in sd["inner"]["state"].values() for k in st}
    assert {"exp_avg", "exp_avg_sq", "step"} <= keys, keys
    m2 = model(torch.bfloat16)
    o2 = build(m2, 1, True)
    m2.load_state_dict(m.state_dict())
    o2.load_state_dict(sd)
    train(m, o, 2, rank, start=2)
    train(m2, o2, 2, rank, start=2)
    assert same(snapshot(m, o), snapshot(m2, o2))
    o.close()
    o2.close()
    return {}


def file_lifetime(rank, world):
    m = model()
    o = build(m, 2, True)
    path = o.parts.core.runner.swap.path
    assert os.path.exists(path) and os.path.basename(path).startswith("zero_kernels-optstate-")
    o.close()
    assert not os.path.exists(path), path
    o = build(model(), 2, True)
    path = o.parts.core.runner.swap.path
    del o
    gc.collect()
    assert not os.path.exists(path), f"{path} outlived its optimizer"
    return {}


def refusals(rank, world):
    msgs = {}
    cases = [
        ("missing dir", dict(offload_optimizer="nvme", offload_dir=DIR + "/no/such"), ValueError),
        ("no dir", dict(offload_optimizer="nvme"), ValueError),
        ("params cpu tier alone", dict(offload_params="cpu"), ValueError),
    ]
    for what, kw, err in cases:
        try:
            zero_opt(model(), torch.optim.AdamW, stage=3, lr=1e-3, **kw)
            raise AssertionError(f"{what}: accepted")
        except err as e:
            assert "offload" in str(e), e
            msgs[what] = "raised"
    try:
        zero_opt(
            model(), torch.optim.SGD, stage=2, lr=1e-3, offload_optimizer="nvme", offload_dir=DIR
        )
        raise AssertionError("SGD: accepted")
    except NotImplementedError as e:
        assert "fused Adam" in str(e), e
        msgs["sgd"] = "raised"
    return msgs


def own_dir_per_rank(rank, world):
    """Each rank's moments in a folder of its own (one NVMe drive per rank): bitwise the run
    without offload; what changes the collectives must still agree (offload on one rank only
    is refused on every rank)."""
    mine = os.path.join(DIR, f"zk-own-dir-rank{rank}")
    os.makedirs(mine, exist_ok=True)
    runs = []
    for off in (False, True):
        m = model()
        opt = build(m, 2, off, **({"offload_dir": mine} if off else {}))
        if off:
            assert os.path.dirname(opt.parts.core.runner.swap.path) == mine
        train(m, opt, 3, rank)
        runs.append(snapshot(m, opt))
        opt.close()
    assert same(*runs), "offloaded run with a folder per rank differs"
    kw = {"offload_optimizer": "nvme", "offload_dir": mine} if rank == 0 else {}
    try:
        zero_opt(model(), torch.optim.AdamW, stage=2, lr=1e-3, **kw)
        raise AssertionError("offload on rank 0 only: accepted")
    except ValueError as e:
        assert "offload.offload_optimizer" in str(e) and "different settings" in str(e), e
    os.rmdir(mine)
    return {}


CHECKS = [
    _bitwise(1, torch.float32),
    _bitwise(2, torch.bfloat16),
    _bitwise(3, torch.float32),
    _bitwise(3, torch.bfloat16, bucket_mb=0.1),
    _bitwise(2, torch.float32, amsgrad=True, bucket_mb=0.1),
    _bitwise(3, torch.float32, state_dtype="bf16", bucket_mb=0.1),
    # int8 records are a quarter of fp32's: a wider model for several chunks per unit
    _bitwise(3, torch.float32, width=384, state_dtype="int8", state_block=64, bucket_mb=0.1),
    _bitwise(2, torch.bfloat16, state_dtype="int8", state_block=64),
    io_per_step,
    lowbit_moments,
    checkpoints,
    checkpoint_streams,
    state_dict_round_trip,
    file_lifetime,
    refusals,
    own_dir_per_rank,
]


def worker(rank, world):
    return run_checks(rank, world, CHECKS)
