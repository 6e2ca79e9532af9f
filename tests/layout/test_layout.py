"""The layout is pure data: checked here with no process group."""

import os

import pytest

from zero_kernels.layout import Layout, ParamSpec, build_layout


def specs(shapes, groups=None, frozen=()):
    groups = groups or [0] * len(shapes)
    return [
        ParamSpec(i, g, "torch.float32", s, f"p{i}", i not in frozen)
        for i, (s, g) in enumerate(zip(shapes, groups))
    ]


SHAPES = [(7, 5), (13,), (0,), (33, 17), (1,), (5, 5, 3), (100,)]


def _covered_once(lay, world):
    for buf in lay.buffers:
        owned = {}
        for slot in buf.slots:
            shares = buf.owners(slot, world)
            assert sum(n for _, _, n in shares) == slot.numel
            owned[slot.index] = shares
            b = buf.buckets[slot.bucket]
            assert b.start <= slot.start and slot.end <= b.start + b.numel(world)
        # slots never overlap
        rng = sorted((s.start, s.end) for s in buf.slots if s.numel)
        assert all(a[1] <= b[0] for a, b in zip(rng, rng[1:]))
        # buckets tile the buffer; each splits into equal shards
        pos = 0
        for b in buf.buckets:
            assert b.start == pos and b.numel(world) % world == 0
            pos += b.numel(world)
        assert pos == buf.numel and buf.numel % world == 0
    return True


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("bucket", [1, 40, 10_000])
@pytest.mark.parametrize("mode", ["flat", "whole"])
def test_layout_invariants(world, bucket, mode):
    lay = build_layout(specs(SHAPES), world, bucket_numel=bucket, mode=mode, align=4)
    assert _covered_once(lay, world)
    slots = lay.buffers[0].slots
    # reverse registration order inside the buffer (flat mode: global; whole: within a rank)
    if mode == "flat":
        assert [s.index for s in slots] == list(reversed(range(len(SHAPES))))
        assert all(s.start % 4 == 0 for s in slots)
    else:  # whole: every param inside its owner's shard
        for s in slots:
            b = lay.buffers[0].buckets[s.bucket]
            lo = b.shard_start(s.owner)
            assert lo <= s.start and s.end <= lo + b.shard_numel
    assert Layout.from_dict(lay.to_dict()) == lay


def test_groups_frozen_and_balance():
    lay = build_layout(
        specs([(10,)] * 6, groups=[0, 0, 1, 1, 1, 0], frozen=(1,)), 2, bucket_numel=10**6
    )
    assert [b.group for b in lay.buffers] == [0, 1]
    assert [s.index for s in lay.buffers[0].slots] == [5, 0]
    assert lay.frozen == (1,)
    w = build_layout(specs([(8,)] * 8), 4, bucket_numel=10**6, mode="whole", align=8)
    owners = [s.owner for s in w.buffers[0].slots]
    assert sorted(owners) == [0, 0, 1, 1, 2, 2, 3, 3]  # balanced: two params per rank
    assert w.buffers[0].buckets[0].shard_numel == 16  # no padding needed


def test_bucket_sizes():
    lay = build_layout(specs([(100,)] * 10), 2, bucket_numel=250, align=1)
    assert [b.numel(2) for b in lay.buffers[0].buckets] == [300, 300, 300, 100]


def test_errors_name_the_argument():
    with pytest.raises(ValueError, match="world_size"):
        build_layout(specs(SHAPES), 0, bucket_numel=10)
    with pytest.raises(ValueError, match="mode"):
        build_layout(specs(SHAPES), 2, bucket_numel=10, mode="rows")


def test_stage2_pool_sizes_buffers_to_buckets():
    """Stage 2's bucket buffers: each sized to its bucket, reused best-fit, never more than
    ``max_inflight`` buffers or the ``max_inflight`` largest buckets together."""
    import torch

    from zero_kernels.buffers import GradStore

    lay = build_layout(specs([(100,), (100,), (40,), (10,)]), 2, bucket_numel=10, align=1)
    sizes = [bk.numel(2) for bk in lay.buffers[0].buckets]
    assert sorted(sizes) == [10, 40, 100, 100]
    g = GradStore(lay, 2, torch.device("cpu"), max_inflight=2)
    assert g.cap_numel == 200
    order = sorted(range(len(sizes)), key=lambda b: sizes[b])  # small first: forces regrowth
    for _ in range(2):
        for b in order + order[::-1]:
            assert g.fits(0, b) or len(g.live) == 0
            t = g.bucket(0, b)
            assert t.numel() == sizes[b]  # not zeroed: the reducer zeroes what gets no grad
            t.fill_(1.0)  # (reduced values left behind)
            assert g.comm_nbytes() <= 4 * g.cap_numel
            g.release(0, b)
    assert g.pooled_buffers() <= 2 and g.comm_peak_nbytes() <= 4 * 100
    # two live at once: the two buffers left serve both largest buckets exactly
    big = [b for b in range(4) if sizes[b] == 100]
    for b in big:
        g.bucket(0, b)
    assert not g.fits(0, order[0])  # count limit reached
    assert g.comm_nbytes() == 4 * 200
    g.drop_pool()
    assert g.comm_nbytes() == 4 * 200  # both in use


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs Linux /proc")
def test_gathered_memory_is_returned_at_free():
    """[Note: gathered memory]: a stage-3 bucket's mapping gives its pages back at release (the
    process's resident memory drops by the bucket) and keeps its storage (same pointer, reads
    as zeros until written again)."""
    import torch

    from zero_kernels.buffers import Mapped

    m = Mapped(16 << 20, torch.float32)  # 64 MiB
    ptr = m.tensor.data_ptr()
    before = _rss_bytes()
    m.tensor.fill_(1.5)
    filled = _rss_bytes()
    assert filled - before > 60 << 20, (before, filled)
    m.release()
    released = _rss_bytes()
    assert filled - released > 60 << 20, (filled, released)
    assert m.tensor.data_ptr() == ptr and m.tensor.numel() == 16 << 20
    assert float(m.tensor[:1000].abs().sum()) == 0.0
    m.tensor.fill_(2.0)
    assert float(m.tensor[-1]) == 2.0
    # a size that does not end on a 2 MiB boundary: the huge page holding its last bytes is
    # given back too (releasing only the tensor's range left its tail resident, up to 2 MiB
    # per bucket); several, so that a leak shows above the noise of the process's RSS
    maps = [Mapped(3_150_000 + 1000 * k, torch.float32) for k in range(8)]  # 12.6 MB each
    before = _rss_bytes()
    for mk in maps:
        mk.tensor.fill_(1.0)
    for mk in maps:
        mk.release()
    after = _rss_bytes()
    assert after - before < 2 << 20, (before, after)  # was ~8-16 MiB with the tails


def test_bucket_gaps_are_the_complement_of_the_params():
    """What the reducer zeroes besides unwritten params before reducing a pool buffer: every
    element of a bucket that is no param's (alignment and shard padding), and nothing else."""
    from zero_kernels.layout import bucket_gaps

    padded = 0
    for world, align in ((1, 1), (2, 4), (3, 4), (4, 16)):
        lay = build_layout(
            specs([(7,), (5, 3), (1,), (30,), (2, 2)]), world, bucket_numel=16, align=align
        )
        for buf in lay.buffers:
            for bk in buf.buckets:
                n = bk.numel(world)
                owned = [0] * n
                for k in bk.slots:
                    s = buf.slots[k]
                    for e in range(s.start - bk.start, s.end - bk.start):
                        owned[e] += 1
                gaps = bucket_gaps(buf, bk, world)
                in_gap = [0] * n
                for lo, hi in gaps:
                    assert 0 <= lo < hi <= n, (gaps, n)
                    for e in range(lo, hi):
                        in_gap[e] += 1
                assert all(o + g == 1 for o, g in zip(owned, in_gap)), (world, align, gaps)
                padded += sum(in_gap)
    assert padded > 0  # the layouts above do pad
