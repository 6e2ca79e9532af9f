"""The model's unsharded tensors against DDP ([Note: replicated module state]): frozen params
and buffers synchronised at construction, BatchNorm's buffers broadcast as DDP's
``broadcast_buffers`` (spawned gloo ranks; the checks in replicas_checks.py), and the digests
that find what differs (in-process)."""

import pytest
import replicas_checks
import torch
from dist_utils import SharedRun

from zero_kernels.optimizer.replicas import digests
from zero_kernels.policy import CommPolicy

REPLICAS = SharedRun(replicas_checks.replicas_all, timeout=400)
CHECKS = [
    "check_start_sync",
    "check_start_mismatch",
    "check_bn_like_ddp",
    "check_two_forwards",
    "check_join_buffers",
]


@pytest.mark.distributed
@pytest.mark.parametrize("world, check", [(w, c) for w in (2, 3) for c in CHECKS])
def test_replicas(world, check):
    REPLICAS.check(world, check)


def test_digests_tell_tensors_apart():
    """Any change of bytes changes a digest: one ulp, a swap of two elements, -0.0 for 0.0, a
    tail byte of an odd-sized tensor; equal bytes give equal digests on any layout and dtype."""
    g = torch.Generator().manual_seed(0)
    base = torch.randn(1001, generator=g)
    variants = {"same": base.clone()}
    ulp = base.clone()
    ulp[500] = torch.nextafter(ulp[500], torch.tensor(float("inf")))
    variants["ulp"] = ulp
    swap = base.clone()
    swap[[3, 4]] = swap[[4, 3]]
    variants["swap"] = swap
    d = digests([base, *variants.values()])
    assert torch.equal(d[0], d[1])
    for k in range(2, d.shape[0]):
        assert not torch.equal(d[0], d[k]), list(variants)[k - 1]
    z = torch.zeros(3)
    nz = -z  # -0.0: other bytes, an equal value
    assert torch.equal(z, nz) and nz.signbit().all()
    odd = torch.arange(13, dtype=torch.uint8)
    odd2 = odd.clone()
    odd2[12] += 1  # in the tail (13 bytes: one word and 5 more)
    d = digests([z, nz, odd, odd2, base.view(7, 143).t(), base.view(7, 143).t().contiguous()])
    assert not torch.equal(d[0], d[1]) and not torch.equal(d[2], d[3])
    assert torch.equal(d[4], d[5])  # the values, not the strides
    assert (d >= 0).all() and (d < 2**62).all()


def test_broadcast_buffers_is_checked():
    with pytest.raises(TypeError, match="broadcast_buffers=1"):
        CommPolicy(broadcast_buffers=1)
