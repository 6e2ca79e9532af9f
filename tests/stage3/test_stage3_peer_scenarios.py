"""Stage 3 where the peers' test suites go (issue 26): each case gives the result of training
without ZeRO (gradients averaged by hand, as DDP), at world sizes 2 and 3."""

import copy

import pytest
import stage3_scenario_checks
import torch
from dist_utils import run_workers
from zero_opt import zero_opt

import zero_kernels.partition.units as units_mod


@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 3])
def test_stage3_peer_cases(world):
    reps = run_workers(stage3_scenario_checks.peers_all, world, timeout=600)
    for rank, rep in enumerate(reps):
        bad = {k: v for k, v in rep.items() if v != "ok"}
        assert not bad, f"rank {rank}: {bad}"
        assert len(rep) == 15, rep


def _pair(make, **kw):
    torch.manual_seed(0)
    m = make()
    ref = copy.deepcopy(m)
    zo = zero_opt(m, torch.optim.SGD, stage=3, lr=0.1, **kw)
    return zo, m, ref


def test_returned_params_kept_without_the_read_guard(monkeypatch):
    """A unit returning its own params is kept gathered by its post-forward alone (the read
    guard is off where dynamo runs the forward)."""
    monkeypatch.setattr(units_mod, "under_dynamo", lambda: True)
    for as_dict in (False, True):
        zo, m, ref = _pair(lambda as_dict=as_dict: stage3_scenario_checks.ReturnsParams(as_dict))
        x, y = stage3_scenario_checks._batch(0, 0)
        assert torch._C._len_torch_function_stack() == 0
        out = m(x)
        torch.testing.assert_close(out, ref(x))
        stage3_scenario_checks._ce(out, y).backward()
        stage3_scenario_checks._ce(ref(x), y).backward()
        zo.step()
        for (n, p), q in zip(m.named_parameters(), ref.parameters()):
            torch.testing.assert_close(zo.full_grad(p), q.grad, msg=n)
        assert not zo.parts.core.store.live
        zo.close()


def test_read_guard_only_where_needed():
    """Metadata reads gather nothing; a read of a sharded param gathers its unit once; a forward
    that raised leaves no mode on the stack."""
    zo, m, ref = _pair(stage3_scenario_checks.ExtRead, units=lambda n, mod: n in ("l1", "l2"))
    sched = zo.parts.core.units
    gathers = []
    real = sched.gather
    sched.gather = lambda u: (
        gathers.append(u.name) if u.state.value == "sharded" else None,
        real(u),
    )[1]
    x, _ = stage3_scenario_checks._batch(0, 0)
    with torch.no_grad():
        torch.testing.assert_close(m(x), ref(x))
    # each: its own forward, then the model's read of l1.weight / l2.bias after it resharded
    assert gathers == ["<root>", "l1", "l2", "l1", "l2"], gathers
    assert not zo.parts.core.store.live and torch._C._len_torch_function_stack() == 0

    def shapes_only(module, args):
        assert (
            module.l1.weight.shape == (stage3_scenario_checks.D,) * 2
            and module.l1.weight.dim() == 2
        )

    h = m.register_forward_pre_hook(shapes_only)
    gathers.clear()
    with torch.no_grad():
        m(x)
    assert gathers == ["<root>", "l1", "l2", "l1", "l2"], gathers  # the shapes gathered nothing
    h.remove()

    def boom(module, args, out):
        raise RuntimeError("boom")

    h = m.l2.register_forward_hook(boom)
    with pytest.raises(RuntimeError, match="boom"):
        m(x)
    assert torch._C._len_torch_function_stack() == 0
    h.remove()
    with torch.no_grad():
        torch.testing.assert_close(m(x), ref(x))
    zo.close()
