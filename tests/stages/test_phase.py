"""The training phase is held, not guessed (issue 21, [Note: phase]): the parts move one
`PhaseTracker` through idle, forward, backward and step; a step inside a backward and a forward
inside a step raise; a backward that raises leaves no phase behind and training goes on to the
result plain torch gives. One rank, in-process."""

from __future__ import annotations

import pytest
import torch
import torch.utils.checkpoint as ckpt
from torch import nn
from zero_opt import zero_opt

from zero_kernels import ZeroOptimizer

X = torch.randn(3, 4, generator=torch.Generator().manual_seed(1))


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))


def _zero(model: nn.Module, stage: int, opt=torch.optim.SGD) -> ZeroOptimizer:
    kw = {"units": [nn.Linear]} if stage == 3 else {}
    return zero_opt(model, opt, stage=stage, lr=0.1, **kw)


def _reference(steps: int) -> nn.Module:
    ref = _net()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for _ in range(steps):
        ref(X).sum().backward()
        opt.step()
        opt.zero_grad()
    return ref


def _assert_equal(zo: ZeroOptimizer, model: nn.Module, ref: nn.Module) -> None:
    with zo.gathered_params():
        for (name, p), r in zip(model.named_parameters(), ref.parameters()):
            assert torch.equal(p, r), name


def _on_output(module: nn.Module, hook):
    """``hook(grad)`` on the module's output in each forward that builds a graph."""

    def fwd(mod, args, out):
        if out.requires_grad:
            out.register_hook(hook)

    return module.register_forward_hook(fwd)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_phase_sequence(stage):
    seen = []

    class Recording(torch.optim.SGD):
        def step(self, closure=None):
            seen.append(("inner step", zo.phase))
            return super().step(closure)

    model = _net()
    zo = _zero(model, stage, Recording)
    model[2].register_forward_hook(lambda *a: seen.append(("forward", zo.phase)))
    _on_output(model[2], lambda g: seen.append(("backward", zo.phase)))
    seen.append(("start", zo.phase))
    loss = model(X).sum()
    seen.append(("after forward", zo.phase))
    loss.backward()
    seen.append(("after backward", zo.phase))
    zo.step()
    seen.append(("after step", zo.phase))
    # stages 1 and 2 hook no forward: they see a forward as idle
    fwd = "forward" if stage == 3 else "idle"
    assert seen == [
        ("start", "idle"),
        ("forward", fwd),
        ("after forward", "idle"),
        ("backward", "backward"),  # model[4]'s grads came first: the backward has started
        ("after backward", "idle"),
        ("inner step", "step"),
        ("after step", "idle"),
    ], seen
    assert zo.parts.core.phase.stale == 0
    _assert_equal(zo, model, _reference(1))
    zo.close()


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_step_inside_backward_raises_and_training_goes_on(stage):
    model = _net()
    zo = _zero(model, stage)
    errors = []

    def step_now(grad):
        with pytest.raises(RuntimeError, match=r"step\(\) was called during a backward") as e:
            zo.step()
        errors.append(e)

    h = _on_output(model[2], step_now)
    model(X).sum().backward()
    h.remove()
    assert len(errors) == 1 and zo.phase == "idle"
    zo.step()  # the backward's gradients, whole: the same as plain torch's first step
    _assert_equal(zo, model, _reference(1))
    zo.close()


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_backward_that_raises_leaves_no_phase(stage):
    class Boom(Exception):
        pass

    def boom(grad):
        raise Boom

    model = _net()
    zo = _zero(model, stage)
    h = _on_output(model[2], boom)  # after model[4]'s grads reached the reducer
    with pytest.raises(Boom):
        model(X).sum().backward()
    h.remove()
    assert zo.phase == "idle" and zo.parts.core.phase.stale == 1
    zo.zero_grad()  # the partial gradients go
    for _ in range(2):
        model(X).sum().backward()
        zo.step()
        zo.zero_grad()
    _assert_equal(zo, model, _reference(2))
    zo.close()


def test_forward_inside_step_raises():
    model = _net()

    class ForwardInStep(torch.optim.SGD):
        def step(self, closure=None):
            model(X)

    zo = _zero(model, 3, ForwardInStep)
    model(X).sum().backward()
    with pytest.raises(RuntimeError, match=r"forward ran inside step\(\)"):
        zo.step()
    assert zo.phase == "idle"
    zo.close()


def test_whole_model_reentrant_checkpoint_is_a_recomputation():
    """The model's forward under a reentrant checkpoint starts inside autograd's engine before any
    hook of ours fired: the one engine probe (`enter_forward`) makes it a recomputation."""
    model = _net()
    zo = _zero(model, 3)
    seen = []
    model[2].register_forward_hook(lambda *a: seen.append(zo.phase))
    for _ in range(2):
        x = X.clone().requires_grad_()  # reentrant checkpointing needs an input that does
        ckpt.checkpoint(model, x, use_reentrant=True).sum().backward()
        zo.step()
        zo.zero_grad()
    assert seen == ["forward", "backward"] * 2, seen  # the first pass, then its recomputation
    assert zo.phase == "idle" and zo.parts.core.phase.stale == 0
    _assert_equal(zo, model, _reference(2))
    zo.close()


@pytest.mark.parametrize("reentrant", [False, True])
def test_per_block_checkpoint(reentrant):
    """Each block checkpointed (reentrant or not): its recomputation, after our first hook of
    the backward, reads the phase alone; the result is plain torch's."""

    def run(model, step, zero_grad):
        for _ in range(2):
            h = X.clone().requires_grad_()  # (reentrant checkpointing needs one)
            for i in range(0, 5, 2):
                layer = model[i]
                h = ckpt.checkpoint(layer, h, use_reentrant=reentrant) if i < 4 else layer(h)
                h = torch.tanh(h) if i < 4 else h
            loss = h.pow(2).sum()
            step(loss)
            zero_grad()

    ref = _net()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    run(ref, lambda loss: (loss.backward(), opt.step()), opt.zero_grad)
    model = _net()
    zo = _zero(model, 3)
    run(model, lambda loss: (loss.backward(), zo.step()), zo.zero_grad)
    assert zo.phase == "idle" and zo.parts.core.phase.stale == 0
    _assert_equal(zo, model, ref)
    zo.close()


class _SelfCheckpointed(nn.Module):
    """A block that checkpoints its own forward (as transformers' layers do): the module's
    hooks run outside the checkpoint, its recomputation and inner backward inside."""

    def __init__(self, reentrant: bool | None):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.reentrant = reentrant

    def _forward(self, h):
        return torch.tanh(self.fc(h))

    def forward(self, h):
        if self.reentrant is None:
            return self._forward(h)
        return ckpt.checkpoint(self._forward, h, use_reentrant=self.reentrant)


def _stack(reentrant: bool | None) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), *[_SelfCheckpointed(reentrant) for _ in range(3)])


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_nested_backwards_reduce_once(stage):
    """[Note: nested backwards]: with each block checkpointing its own forward (re-entrant:
    an inner backward per block), the reducer's end of backward runs once, at the end of the
    outer backward: the same reduce-scatters and checks per step as without checkpointing (it
    ran at the end of every inner backward: one reduction of every bucket per block), and
    the result plain torch's."""
    counts = {}
    for mode in (None, True, False):
        model = _stack(mode)
        kw = {"units": [_SelfCheckpointed]} if stage == 3 else {}
        zo = zero_opt(model, torch.optim.SGD, stage=stage, lr=0.1, **kw)
        ref = _stack(mode)
        opt = torch.optim.SGD(ref.parameters(), lr=0.1)
        for _ in range(2):
            x = X.clone().requires_grad_()  # re-entrant checkpointing needs an input that does
            model(x).pow(2).sum().backward()
            zo.step()
            zo.zero_grad()
            ref(x).pow(2).sum().backward()
            opt.step()
            opt.zero_grad()
        st = zo.comm_stats
        counts[mode] = (st["reduce_scatter_calls"], st["all_reduce_calls"])
        assert zo.phase == "idle" and zo.parts.core.phase.stale == 0
        _assert_equal(zo, model, ref)
        zo.close()
    assert counts[True] == counts[False] == counts[None], counts
