"""ZeroOptimizer under torch.compile. With compiled autograd (issue 10): stages 1 and 2 match
DDP with clipping, stage 3 raises (ours at the first forward with the config flag on; autograd's
own error when compiled autograd is on around backward only). Without it: every stage matches
DDP, with stage 3's and overlap_param_gather's forward hooks kept out of the graphs."""

import compiled_checks
import pytest
from dist_utils import run_workers
from zero_opt import zero_opt


@pytest.mark.distributed
def test_compiled_autograd():
    rep = run_workers(compiled_checks.check_compiled_autograd, 2, timeout=500)
    assert rep[0]["stage 1"] == rep[0]["stage 2"] == "ok", rep
    assert rep[0]["stage 3"] in ("refused", "autograd error"), rep


@pytest.mark.distributed
def test_compiled_forward_hooks():
    rep = run_workers(compiled_checks.check_compiled_forward_hooks, 2, timeout=500)[0]
    assert set(rep.values()) == {"ok"} and len(rep) == 9, rep


@pytest.mark.parametrize("stage", [1, 2])
def test_fullgraph_at_stages_1_and_2(stage):
    """torch.compile(model, fullgraph=True) at stages 1/2: the optimizer's own forward hooks
    stay out of the graph (the outputs' backward marker does nothing while traced; the buffer
    broadcast hook is there only for a model with buffers, and broadcast_buffers=False takes it
    off); the result is plain torch's. One rank, in-process."""
    import copy

    import torch
    from torch import nn

    def run(model, opt_step, zero_grad):
        g = torch.Generator().manual_seed(0)
        for _ in range(2):
            model(torch.randn(3, 4, generator=g)).pow(2).sum().backward()
            opt_step()
            zero_grad()

    for buffers in (False, True):
        torch.manual_seed(0)
        mods = [nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)]
        if buffers:
            mods.insert(1, nn.BatchNorm1d(8))
        m = nn.Sequential(*mods)
        ref = copy.deepcopy(m)
        zo = zero_opt(m, torch.optim.SGD, stage=stage, lr=0.1, broadcast_buffers=not buffers)
        run(torch.compile(m, backend="aot_eager", fullgraph=True), zo.step, zo.zero_grad)
        opt = torch.optim.SGD(ref.parameters(), lr=0.1)
        run(ref, opt.step, opt.zero_grad)
        for a, b in zip(m.state_dict().values(), ref.state_dict().values()):
            assert torch.allclose(a, b, atol=1e-6), (stage, buffers)
        zo.close()
