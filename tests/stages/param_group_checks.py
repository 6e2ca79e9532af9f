"""add_param_group at every stage (progressive unfreezing, issue 21): the params added later
train as torch's optimizer trains them after its own add_param_group, the params held before
keep their state exactly; against the same model trained without ZeRO, gradients averaged by
hand (DDP fixes its params at construction). Run on spawned gloo ranks by
tests/stages/test_add_param_group.py."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from numerics import rel_err
from torch import nn
from zero_opt import zero_opt


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(6, 6) for _ in range(2))
        self.head = nn.Linear(6, 3)

    def forward(self, x):
        for b in self.blocks:
            x = torch.tanh(b(x))
        return self.head(x)


def _body(m):
    return [p for n, p in m.named_parameters() if not n.startswith("head")]


def _step(m, opt, x, world, by_hand):
    opt.zero_grad()
    m(x).pow(2).mean().backward()
    if by_hand:
        for p in m.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad)
                p.grad.div_(world)
    opt.step()


def check_add_param_group(rank: int, world: int) -> dict:
    out = {}
    for stage in (1, 2, 3):
        for dtype in (torch.float32, torch.bfloat16):
            torch.manual_seed(0)
            base = Net().to(dtype)
            base.head.requires_grad_(False)
            m, ref = copy.deepcopy(base), copy.deepcopy(base)
            kw = dict(lr=1e-2, weight_decay=0.1)
            zo = zero_opt([{"params": _body(m)}], torch.optim.AdamW, stage=stage, module=m, **kw)
            to = torch.optim.AdamW([{"params": _body(ref)}], **kw)
            calls = []
            zo.register_step_post_hook(lambda o, a, k, calls=calls: calls.append(1))
            for s in range(4):
                x = torch.randn(4, 6, generator=torch.Generator().manual_seed(10 * s + rank))
                if s == 2:  # unfreeze the head: a group of its own, another lr
                    for mm, o in ((m, zo), (ref, to)):
                        mm.head.requires_grad_(True)
                        o.add_param_group({"params": mm.head.parameters(), "lr": 5e-3})
                    assert zo.param_groups[1]["lr"] == 5e-3 and len(zo.param_groups) == 2
                    assert zo.comm_stats["steps"] == 2 and zo.parts.core.steps.n == 2
                _step(m, zo, x.to(dtype), world, False)
                _step(ref, to, x.to(dtype), world, True)
            assert len(calls) == 4, "a step hook registered before add_param_group was lost"
            tol = 1e-6 if dtype == torch.float32 else 1e-2
            with zo.gathered_params():
                for (n, a), b in zip(m.named_parameters(), ref.parameters()):
                    assert rel_err(a, b) <= tol, f"stage {stage} {dtype}: {n} {rel_err(a, b):.3g}"
            w = m.blocks[0].weight
            st = zo.full_state(w)
            want = to.state[ref.blocks[0].weight]
            assert int(st["step"]) == 4 == int(want["step"])
            assert rel_err(st["exp_avg"], want["exp_avg"]) <= (
                1e-5 if dtype == torch.float32 else 2e-2
            )
            zo.close()
            out[f"stage {stage} {dtype}"] = "ok"
    return out
