"""offload_params="nvme" (issue 23): stage 3's param shards in a file between uses; at 2 ranks,
bitwise the run without offload (fp32, bf16, clipping, with offload_optimizer, prefetch and
resharding on and off, params kept whole), reads ahead taken, checkpoints across offload and
stage, whole-param access, memory counts, the file's lifetime, refusals. One spawned group
(tests/offload/offload_params_checks.py)."""

import os

import offload_params_checks
import pytest
from dist_utils import SharedRun

RUN = SharedRun(offload_params_checks.worker, timeout=400)


pytestmark = pytest.mark.usefixtures("offload_dir")  # tests/conftest.py


@pytest.mark.distributed
@pytest.mark.parametrize("check", [c.__name__ for c in offload_params_checks.CHECKS])
def test_offload_params(check):
    RUN.check(2, check)


def _swapper(tmp_path, dtype="torch.float32"):
    """Four units of one bucket each (8192 elements: 32 KiB fp32 shards at world size 1) and a
    unit kept whole (pinned)."""
    from zero_kernels.layout import ParamSpec, build_layout
    from zero_kernels.offload.params import ParamSwapper

    specs = [ParamSpec(u, 0, dtype, (8192,), f"p{u}", unit=u) for u in range(4)]
    specs.append(ParamSpec(4, 0, dtype, (8,), "small", unit=4))
    layout = build_layout(specs, 1, bucket_numel=1 << 20, by_unit=True)
    keys = {s.index: (0, s.bucket) for s in layout.buffers[0].slots}  # index == unit here
    masters = {0} if dtype != "torch.float32" else set()
    sw = ParamSwapper(layout, 0, [[keys[u]] for u in range(4)], {keys[4]}, str(tmp_path), masters)
    return sw, [keys[u] for u in range(4)], keys[4]


def test_swapper_round_trip_and_read_ahead(tmp_path):
    """Values survive eviction; a clean release evicts at once, a dirty one after its write;
    the second pass in the same order finds each next shard read ahead; pinned shards stay."""
    import torch

    sw, keys, pin = _swapper(tmp_path)
    for n, k in enumerate(keys):
        with sw.using(k, dirty=True, fresh=True) as t:
            t.fill_(n + 1)
    sw.flush()
    assert sw.ram_bytes() == 4096  # the pinned shard's page only
    for _ in range(2):  # the first pass learns the order, the second reads ahead
        for n, k in enumerate(keys):
            sw.acquire(k)
            assert torch.equal(sw.tensor(k), torch.full((8192,), n + 1.0)), k
            sw.release(k)
            assert not sw.records[k].resident or k == keys[0]  # the first: kept for the next
        sw.end_step()
    assert sw.ahead_hits == 3, sw.ahead_hits  # every shard but the first of the pass
    assert sw.ram_bytes() <= sw.ahead_bytes + 4096
    sw.acquire(pin)  # pinned: nothing read, nothing evicted
    sw.release(pin, dirty=True)
    assert sw.records[pin].resident and sw.records[pin].write is None
    path = sw.path
    sw.close()
    assert not os.path.exists(path)


def test_swapper_masters_pages(tmp_path):
    """bf16 buckets' fp32 masters: each bucket's whole pages a record; evicted and read back."""
    import torch

    sw, keys, _ = _swapper(tmp_path, "torch.bfloat16")
    whole = sw.masters[0]
    moved = [k for k, r in sw.records.items() if r.master and not r.pinned]
    assert len(moved) == 4 and sw.fixed_bytes < whole.numel() * 4 // 2, sw.fixed_bytes
    with sw.resident():
        whole.copy_(torch.arange(whole.numel(), dtype=torch.float32))
    assert sw.ram_bytes(master=True) == sw.fixed_bytes
    with sw.resident():
        assert torch.equal(whole, torch.arange(whole.numel(), dtype=torch.float32))
    sw.close()
