"""Stage 3 in the scenarios of the peers' test suites that gave NaN or wrong numbers without an
error (issue 26): a module called alone with a backward of its own per call (a chunked loss
head), parameters used outside their unit's forward, a ModuleList given as a unit. Each
against the same model trained without ZeRO, its gradients averaged over the ranks by hand
(what DDP gives; DDP itself refuses several backwards per forward). Run on spawned gloo ranks
by tests/stage3/test_stage3_peer_scenarios.py."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from numerics import rel_err
from torch import nn
from zero_opt import zero_opt

V, D = 19, 8


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln = nn.LayerNorm(D)
        self.fc = nn.Linear(D, D)

    def forward(self, h):
        return h + torch.tanh(self.fc(self.ln(h)))


class Chunky(nn.Module):
    """A trunk whose output is the final norm's; the loss head is called alone, per chunk."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.norm = nn.LayerNorm(D)
        self.head = nn.Linear(D, V)

    def forward(self, x):
        h = self.emb(x)
        for b in self.blocks:
            h = b(h)
        return self.norm(h)


def _batch(rank: int, step: int):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randint(0, V, (4, 6), generator=g), torch.randint(0, V, (4, 6), generator=g)


def _ce(logits, y):
    return nn.functional.cross_entropy(logits.reshape(-1, V), y.reshape(-1))


def _average_grads(model: nn.Module, world: int) -> None:
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad)
            p.grad.div_(world)


def _compare(zo, m, ref, tol: float, what: str) -> None:
    with zo.gathered_params():
        for (n, a), (_, b) in zip(m.named_parameters(), ref.named_parameters()):
            assert not torch.isnan(a).any(), f"{what}: {n} is NaN"
            assert rel_err(a, b) <= tol, f"{what}: {n} off by {rel_err(a, b):.3g}"


def _train(rank, world, make, loss_fn, steps=3, tol=1e-5, what="", **zkw):
    """``steps`` AdamW steps of ``make()`` with ZeRO stage 3 and by hand; ``loss_fn(model, x,
    y)`` runs the forward and every backward of one step."""
    torch.manual_seed(0)
    base = make()
    m, ref = copy.deepcopy(base), copy.deepcopy(base)
    zo = zero_opt(m, torch.optim.AdamW, stage=3, lr=1e-2, weight_decay=0.1, timeout=60, **zkw)
    to = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    for step in range(steps):
        x, y = _batch(rank, step)
        zo.zero_grad()
        to.zero_grad()
        loss_fn(m, x, y)
        loss_fn(ref, x, y)
        _average_grads(ref, world)
        zo.step()
        to.step()
        assert not zo.parts.core.store.live, f"{what}: units left gathered after step {step}"
    _compare(zo, m, ref, tol, what)
    zo.close()


def _chunks_detached(m, x, y, n=2):
    """The chunked head on a detached trunk output, then the trunk's backward."""
    h = m(x)
    hd = h.detach().requires_grad_()
    for c in range(n):
        (_ce(m.head(hd[c::n]), y[c::n]) / n).backward()
    h.backward(hd.grad)


def _chunks_retained(m, x, y, n=2):
    """Each chunk's backward through the head and the whole trunk (retain_graph)."""
    h = m(x)
    for c in range(n):
        (_ce(m.head(h[c::n]), y[c::n]) / n).backward(retain_graph=True)


def check_chunked_head(rank: int, world: int) -> dict:
    out = {}
    for name, fn in (("detached", _chunks_detached), ("retained", _chunks_retained)):
        for kw in ({}, {"reshard_after_forward": False}, {"prefetch": 2}):
            what = f"chunked head {name} {kw}"
            _train(
                rank,
                world,
                Chunky,
                fn,
                what=what,
                units=lambda n, mod: isinstance(mod, Block) or n == "head",
                **kw,
            )
            out[what] = "ok"
    return out


class ExtRead(nn.Module):
    """``l1.weight`` read again in the model's forward after l1 and l2 ran (and resharded)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.l1 = nn.Linear(D, D)
        self.l2 = nn.Linear(D, D)
        self.head = nn.Linear(D, V)

    def forward(self, x):
        h = self.emb(x)
        a = torch.tanh(self.l1(h))
        b = self.l2(a)
        return self.head(b + a @ self.l1.weight.t() + self.l2.bias * 0.5)


class BiasOut(nn.Module):
    """A unit that returns its own bias (and, in a dict, a scale) for the caller to apply."""

    def __init__(self, as_dict: bool):
        super().__init__()
        self.fc = nn.Linear(D, D, bias=False)
        self.bias = nn.Parameter(torch.randn(D) * 0.1)
        self.scale = nn.Parameter(torch.ones(D) + 0.1 * torch.randn(D))
        self.as_dict = as_dict

    def forward(self, h):
        if self.as_dict:
            return {"out": self.fc(h), "extra": [self.bias, self.scale.view(1, 1, D)]}
        return self.fc(h), self.bias


class ReturnsParams(nn.Module):
    def __init__(self, as_dict: bool):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.blocks = nn.ModuleList(BiasOut(as_dict) for _ in range(3))
        self.head = nn.Linear(D, V)

    def forward(self, x):
        h = self.emb(x)
        for b in self.blocks:
            o = b(h)
            if isinstance(o, dict):  # the scale is saved for the backward (a product)
                bias, scale = o["extra"]
                h = h + torch.tanh(o["out"] + bias) * scale
            else:
                h = h + torch.tanh(o[0] + o[1])
        return self.head(h)


def _plain_loss(m, x, y):
    _ce(m(x), y).backward()


def check_external_params(rank: int, world: int) -> dict:
    out = {}
    for kw in ({}, {"reshard_after_forward": False}):
        what = f"param read after its unit resharded {kw}"
        _train(
            rank,
            world,
            ExtRead,
            _plain_loss,
            what=what,
            units=lambda n, mod: n in ("l1", "l2"),
            **kw,
        )
        out[what] = "ok"
        for as_dict in (False, True):
            what = f"unit returns its params (dict={as_dict}) {kw}"
            _train(
                rank,
                world,
                lambda as_dict=as_dict: ReturnsParams(as_dict),
                _plain_loss,
                what=what,
                **kw,
            )
            out[what] = "ok"
    return out


class Listed(nn.Module):
    """The model's ModuleList given as one unit: its forward is never called, its entries' are."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.linears = nn.ModuleList(Block() for _ in range(3))
        self.more = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(D, V)

    def forward(self, x):
        h = self.emb(x)
        for b in self.linears:
            h = b(h)
        for b in self.more:
            h = b(h)
        return self.head(h)


def check_module_list_unit(rank: int, world: int) -> dict:
    out = {}
    for kw in ({}, {"reshard_after_forward": False}, {"prefetch": 2}):
        what = f"ModuleList as a unit {kw}"

        def loss(m, x, y):
            _ce(m(x), y).backward()
            with torch.no_grad():  # a forward without backward gathers and frees too
                m(x)

        _train(
            rank,
            world,
            Listed,
            loss,
            what=what,
            units=lambda n, mod: n in ("linears", "more"),
            **kw,
        )
        out[what] = "ok"
    return out


def peers_all(rank: int, world: int) -> dict:
    out = {}
    for check in (check_chunked_head, check_external_params, check_module_list_unit):
        try:
            out.update(check(rank, world))
        except AssertionError as e:
            out[check.__name__] = f"FAILED: {e}"
    return out
