"""``ZeroOptimizer.step(closure=None, **kwargs)`` (issue 21): keywords reach the inner optimizer's
step and the keys it adds to its param groups reach ``opt.param_groups``, flat and whole mode,
against the same optimizer unsharded under DDP; an unknown keyword is a TypeError naming it. A
step changes the params' versions as torch's in-place step does (in-process, stages 1-3)."""

import pytest
import step_api_checks
from dist_utils import run_workers


@pytest.mark.distributed
def test_step_kwargs():
    rep = run_workers(step_api_checks.check_step_kwargs, 2, timeout=400)
    assert rep[0] == {
        "ScaledMomentum stage 2": "ok",
        "ScaledMomentum stage 3": "ok",
        "ScaledNormalized stage 1": "ok",
        "ScaledNormalized stage 3": "ok",
        "AdamW fused=True": "ok",
        "AdamW fused=False": "ok",
    }, rep


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_graph_from_before_a_step_backwarded_after_it_raises(stage):
    """The step changes the params as torch's in-place step does: a graph saved before it and
    backwarded after it raises torch's in-place error, at every stage, as under plain torch
    (it computed with the stepped values, silently). A graph of a param the step left alone
    (no gradient) still backwards, as in torch. Graphs made after the step backward."""
    import torch
    from torch import nn

    from zero_kernels import ZeroOptimizer

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 2), nn.Linear(2, 2)

        def forward(self, x, spare=False):
            return self.c(self.c(x[:, :2])) if spare else self.b(torch.tanh(self.a(x)))

    for plain in (True, False):
        torch.manual_seed(0)
        m = Net()
        if plain:
            opt = torch.optim.SGD(m.parameters(), lr=0.1)
        else:
            opt = ZeroOptimizer(m, torch.optim.SGD, stage=stage, lr=0.1)
        x = torch.randn(4, 8)
        m(x).pow(2).sum().backward()  # c gets no gradient: not stepped
        early = m(x).pow(2).mean()  # saved before the step
        spare = m(x, spare=True).pow(2).sum()  # reads only c, which the step leaves alone
        opt.step()
        opt.zero_grad()
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            early.backward()
        spare.backward()  # as in torch: that param did not change
        opt.zero_grad()
        opt.zero_grad()
        m(x).pow(2).sum().backward()  # after the step: trains on
        opt.step()
        if not plain:
            opt.close()
