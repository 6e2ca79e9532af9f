"""The layout is pure data: checked here with no process group."""

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
