"""Stage 3's gathered memory is bounded by the scheduler's window, not by how far the host runs
ahead of the GPU ([Note: gathered memory on CUDA] in zero_kernels/buffers.py): the units
gathered at once, read through ``memory_report()``, at world size 8 on torch's fake group (on a
GPU, bench/gpu_check.sh measures the reserved memory against the same bound)."""

import functools

import pytest
from fake_group import run_fake_many

WINDOW = """
from torch import nn
from zero_kernels import ZeroOptimizer, ZeroPolicy

class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.a, self.b = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.b(torch.relu(self.a(x)))

class Net(nn.Module):
    def __init__(self, n, d=32):
        super().__init__()
        self.emb = nn.Embedding(64, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(n))
        self.head = nn.Linear(d, 8)

    def forward(self, idx):
        x = self.emb(idx)
        for blk in self.blocks:
            x = blk(x)
        return self.head(x)

torch.manual_seed(0)
m = Net({n})
pol = ZeroPolicy.resolve(stage=3, prefetch={prefetch}, bucket_size_mb=0.01)
zo = ZeroOptimizer(m, torch.optim.AdamW, policy=pol, lr=1e-3)
unit = sum(p.numel() * 4 for p in m.blocks[0].parameters())
root = sum(p.numel() * 4 for n_, p in m.named_parameters() if not n_.startswith("blocks"))
for _ in range(2):
    m(torch.randint(0, 64, (4, 8))).float().pow(2).mean().backward()
    zo.step()
    zo.zero_grad()
r = zo.memory_report()
print(json.dumps(dict(units=r["gathered_units_peak"], peak=r["gathered_param_peak_bytes"],
                      unit=unit, root=root, gathers=zo.comm_stats["all_gather_calls"])))
"""


@pytest.mark.parametrize("prefetch", [1, 2])
def test_gathered_units_stay_in_the_window(prefetch):
    n = N_BLOCKS
    r = _windows()[prefetch]
    assert r["gathers"] >= 2 * 2 * n  # every block gathered in forward and backward, 2 steps
    # the unit in use, its prefetched successors and, in backward, the one still reducing
    assert 1 <= r["units"] <= prefetch + 2, r
    # padding to the 8 ranks: a few elements per bucket
    slack = 4096
    assert r["peak"] <= r["root"] + (prefetch + 2) * r["unit"] + slack, r


N_BLOCKS = 12


@functools.cache
def _windows() -> dict:
    """Both prefetch settings in one process on the fake group (`run_fake_many`)."""
    got = run_fake_many([WINDOW.format(n=N_BLOCKS, prefetch=p) for p in (1, 2)])
    return dict(zip((1, 2), got, strict=True))
