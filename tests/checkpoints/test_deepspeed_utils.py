"""DeepSpeed's safe_get_full_* / safe_set_full_* helpers over ZeroOptimizer (issue 21), against
the unsharded torch optimizer; in-process (world size 1), stages 1-3, bf16 params too."""

import copy

import pytest
import torch
from torch import nn

from zero_kernels import ZeroOptimizer
from zero_kernels.utils import (
    safe_get_full_fp32_param,
    safe_get_full_grad,
    safe_get_full_optimizer_state,
    safe_set_full_fp32_param,
    safe_set_full_optimizer_state,
)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_safe_full_helpers(stage):
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))
    m, r = copy.deepcopy(base), copy.deepcopy(base)
    zo = ZeroOptimizer(m, torch.optim.AdamW, stage=stage, lr=1e-2)
    to = torch.optim.AdamW(r.parameters(), lr=1e-2)
    w = m[2].weight
    assert safe_get_full_grad(w) is None and safe_get_full_optimizer_state(w, "exp_avg") is None
    x = torch.randn(5, 4)
    m(x).pow(2).mean().backward()
    r(x).pow(2).mean().backward()
    torch.testing.assert_close(safe_get_full_grad(w), r[2].weight.grad)
    zo.step()
    to.step()
    torch.testing.assert_close(safe_get_full_fp32_param(w), r[2].weight)
    torch.testing.assert_close(
        safe_get_full_optimizer_state(w, "exp_avg_sq"), to.state[r[2].weight]["exp_avg_sq"]
    )
    safe_set_full_fp32_param(w, torch.ones(3, 6))
    assert torch.equal(safe_get_full_fp32_param(w), torch.ones(3, 6))
    safe_set_full_optimizer_state(w, torch.zeros(3, 6), "exp_avg")
    assert torch.equal(safe_get_full_optimizer_state(w, "exp_avg"), torch.zeros(3, 6))
    zo.close()
    with pytest.raises(ValueError, match="not held by a live ZeroOptimizer"):
        safe_get_full_fp32_param(w)


def test_safe_full_fp32_param_is_the_master():
    torch.manual_seed(0)
    m = nn.Linear(4, 3).bfloat16()
    zo = ZeroOptimizer(m, torch.optim.AdamW, stage=2, lr=1e-3)
    m(torch.randn(2, 4).bfloat16()).float().pow(2).mean().backward()
    zo.step()
    full = safe_get_full_fp32_param(m.weight)
    assert full.dtype == torch.float32 and not torch.equal(full, m.weight.float())
    torch.testing.assert_close(full.bfloat16(), m.weight.detach(), rtol=0, atol=0)
    zo.close()


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_safe_getters_over_every_named_param_with_a_frozen_layer(stage):
    """DeepSpeed's tensor-fragment loop: every named param of a model whose first layer is
    frozen; the getters give None where DeepSpeed's do (frozen; no gradient yet; no state yet,
    or an unknown key) and the values elsewhere; the setters refuse a frozen param."""
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))
    base[0].requires_grad_(False)
    m, r = copy.deepcopy(base), copy.deepcopy(base)
    zo = ZeroOptimizer(m, torch.optim.AdamW, stage=stage, lr=1e-2)
    to = torch.optim.AdamW([p for p in r.parameters() if p.requires_grad], lr=1e-2)
    for _, p in m.named_parameters():  # before any backward
        assert safe_get_full_grad(p) is None
        assert safe_get_full_optimizer_state(p, "exp_avg") is None
        if not p.requires_grad:
            assert safe_get_full_fp32_param(p) is None
    x = torch.randn(5, 4)
    m(x).pow(2).mean().backward()
    r(x).pow(2).mean().backward()
    zo.step()
    to.step()
    for (name, p), q in zip(m.named_parameters(), r.parameters()):
        w, g = safe_get_full_fp32_param(p), safe_get_full_grad(p)
        s = safe_get_full_optimizer_state(p, "exp_avg")
        if name.startswith("0."):
            assert w is None and g is None and s is None, name
            with pytest.raises(ValueError, match="frozen"):
                safe_set_full_fp32_param(p, torch.zeros_like(q))
        else:
            torch.testing.assert_close(w, q.detach())
            torch.testing.assert_close(g, q.grad)
            torch.testing.assert_close(s, to.state[q]["exp_avg"])
            assert safe_get_full_optimizer_state(p, "no_such_key") is None
    zo.close()
