"""Stage 3 with ``shard_frozen=True`` (spawned gloo ranks): a LoRA-shaped model whose frozen base
is sharded with its units, against DDP on the same model ([Note: frozen shards] in
zero_kernels/partition/frozen.py)."""

from __future__ import annotations

import contextlib
import copy
import os
import tempfile

import torch
import torch.distributed as dist
import torch.utils.checkpoint as ckpt
from dist_utils import run_checks
from numerics import rel_err
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from zero_opt import zero_opt

from zero_kernels import ZeroOptimizer, load_checkpoint, save_checkpoint

V, D, R = 19, 16, 4


class Lora(nn.Module):
    """A frozen linear plus a trainable low-rank update (its output added after the base's,
    as PEFT does: the adapters' gradients come before the base's input gradient)."""

    def __init__(self, d_in: int, d_out: int, adapted: bool = True):
        super().__init__()
        self.base = nn.Linear(d_in, d_out)
        self.base.requires_grad_(False)
        self.A = nn.Linear(d_in, R, bias=False) if adapted else None
        self.B = nn.Linear(R, d_out, bias=False) if adapted else None
        if adapted:
            nn.init.normal_(self.B.weight, std=0.1)

    def forward(self, x):
        y = self.base(x)
        return y if self.A is None else y + self.B(self.A(x))


class Block(nn.Module):
    def __init__(self, adapted: bool):
        super().__init__()
        self.ln = nn.LayerNorm(D)
        self.ln.requires_grad_(False)
        self.up = Lora(D, 2 * D, adapted)
        self.down = Lora(2 * D, D, adapted)

    def forward(self, h):
        return h + self.down(torch.tanh(self.up(self.ln(h))))


class LoraNet(nn.Module):
    """Frozen embedding and final norm (root unit), blocks 0 and 2 frozen whole (block 0 before
    anything trains: no backward; block 2 between adapted blocks: a backward for its input
    gradient only), blocks 1 and 3 with adapters, a trainable head."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.emb.requires_grad_(False)
        self.blocks = nn.ModuleList(Block(adapted=k % 2 == 1) for k in range(4))
        self.norm = nn.LayerNorm(D)
        self.norm.requires_grad_(False)
        self.head = nn.Linear(D, V)
        self.ckpt = None  # None | "reentrant" | "plain"
        self.reuse = False  # block 2 (frozen whole) runs twice
        self.cast = False  # the blocks under bf16 autocast (its cache off)

    def forward(self, x):
        if self.cast:
            with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):
                return self._forward(x).float()
        return self._forward(x)

    def _forward(self, x):
        h = self.emb(x)
        for k, b in enumerate(self.blocks):
            if self.ckpt is not None and k > 0:
                h = ckpt.checkpoint(b, h, use_reentrant=self.ckpt == "reentrant")
            else:
                h = b(h)
            if self.reuse and k == 2:
                h = b(h)
        return self.head(self.norm(h))


def _batch(rank: int, step: int):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randint(0, V, (3, 6), generator=g), torch.randint(0, V, (3, 6), generator=g)


def _loss(model, x, y):
    return nn.functional.cross_entropy(model(x).reshape(-1, V), y.reshape(-1))


def _frozen_bytes(m: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in m.parameters() if not p.requires_grad)


def _zero(model: nn.Module, **kw) -> ZeroOptimizer:
    """Stage 3 AdamW over ``model``'s trained params, its frozen ones sharded unless ``kw``
    says otherwise."""
    kw = {"shard_frozen": True, "lr": 1e-2, **kw}
    trained = [p for p in model.parameters() if p.requires_grad]
    return zero_opt(trained, torch.optim.AdamW, stage=3, module=model, **kw)


def _adamw(model: nn.Module) -> torch.optim.AdamW:
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)


def _pair(setup=None, make=LoraNet, **kw):
    """``make()`` twice from one seed: one under `_zero` (``kw``), one under DDP with AdamW."""
    torch.manual_seed(0)
    base = make()
    if setup:
        setup(base)
    m1, m2 = copy.deepcopy(base), copy.deepcopy(base)
    static = m2.ckpt == "reentrant"  # DDP needs a static graph for re-entrant checkpointing
    return _zero(m1, **kw), m1, DDP(m2, static_graph=static), _adamw(m2)


def _plain_pair(make):
    """``make()`` twice from one seed: one under `_zero`, one plain with AdamW (a reference fed
    every rank's batches, where DDP cannot run the pattern)."""
    torch.manual_seed(0)
    base = make()
    m1, ref = copy.deepcopy(base), copy.deepcopy(base)
    return _zero(m1), m1, ref, _adamw(ref)


def _train_plain(rank, world, zo, m1, ref, to, loss_of, backward=torch.Tensor.backward, steps=3):
    """``steps`` steps of `_plain_pair`'s two: ``zo`` over this rank's ``loss_of(m1, rank,
    step)``, the plain twin over the mean of every rank's, each loss through ``backward``."""
    for step in range(steps):
        zo.zero_grad()
        to.zero_grad()
        backward(loss_of(m1, rank, step))
        backward(sum(loss_of(ref, r, step) for r in range(world)).div(world))
        zo.step()
        to.step()


def _train(rank, zo, m1, ddp, to, steps, start=0, peak=None):
    losses = []
    for step in range(start, start + steps):
        x, y = _batch(rank, step)
        zo.zero_grad()
        to.zero_grad()
        l1 = _loss(m1, x, y)
        l1.backward()
        if peak is not None:
            peak.append(zo.parts.core.store.peak_gathered)
        l2 = _loss(ddp, x, y)
        l2.backward()
        zo.step()
        to.step()
        kept = zo.parts.core.units.persistent  # vectors kept whole (quantize_weights)
        left = zo.parts.core.store.live - set(kept.buckets if kept is not None else ())
        assert not left, f"left gathered: {left}"
        losses.append((float(l1), float(l2)))
    return losses


def _same_params(zo, m1, m2, tol, what):
    with zo.gathered_params():
        for (n, a), (_, b) in zip(m1.named_parameters(), m2.named_parameters()):
            assert rel_err(a, b) <= tol, f"{what}: {n} {rel_err(a, b):.3g}"


def check_parity(rank: int, world: int) -> dict:
    """Losses and every param (frozen ones included) as DDP's over 4 steps: plain, with
    re-entrant and non-re-entrant activation checkpointing, a frozen block run twice, prefetch
    2, no resharding after forward, the shards in host memory (offload_params="cpu"), and under
    bf16 autocast (the frozen weights' casts made again in the backward), with and without
    checkpointing."""
    cases = {
        "plain": (None, {}),
        "checkpoint reentrant": (lambda m: setattr(m, "ckpt", "reentrant"), {}),
        "checkpoint plain": (lambda m: setattr(m, "ckpt", "plain"), {}),
        "frozen block twice": (lambda m: setattr(m, "reuse", True), {}),
        "prefetch 2": (None, {"prefetch": 2}),
        "no reshard after forward": (None, {"reshard_after_forward": False}),
        "host tier": (None, {"offload_optimizer": "cpu", "offload_params": "cpu"}),
        # [Note: frozen casts]: the frozen weights' casts are made again in the backward
        "autocast": (lambda m: setattr(m, "cast", True), {}),
        "autocast, checkpoint reentrant": (
            lambda m: (setattr(m, "cast", True), setattr(m, "ckpt", "reentrant")),
            {},
        ),
    }
    out = {}
    for name, (setup, kw) in cases.items():
        zo, m1, ddp, to = _pair(setup, **kw)
        losses = _train(rank, zo, m1, ddp, to, 4)
        worst = max(abs(a - b) / abs(b) for a, b in losses)
        assert worst <= 1e-5, f"{name}: losses {losses}"
        _same_params(zo, m1, ddp.module, 1e-5, name)
        out[name] = worst
        zo.close()
    return out


def check_sharded(rank: int, world: int) -> dict:
    """The frozen params are sharded: a rank's store holds 1/N of them (padding aside), they
    read NaN between steps, the peak gathered in a step is below the whole model (units are
    freed in the backward, the frozen-only one once its input gradient is computed), and
    ``gathered_params``, ``model.state_dict()`` and ``close()`` give them whole."""
    zo, m1, ddp, to = _pair()
    core = zo.parts.core
    frozen = _frozen_bytes(m1)
    assert core.frozen, "no frozen param was sharded"
    names = {n for n, p in m1.named_parameters() if not p.requires_grad}
    sharded = {n for n, p in m1.named_parameters() if any(p is q for q in core.frozen.values())}
    assert sharded == names, sorted(names - sharded)
    held = core.store.nbytes()
    trained = sum(p.numel() * 4 for p in m1.parameters() if p.requires_grad)
    # 1/N of everything, plus at most one alignment block (16 elements) per bucket and rank
    buckets = sum(len(b.buckets) for b in core.store_layout.buffers)
    assert held <= (frozen + trained) / world + buckets * 16 * 4, (held, frozen, trained)
    # block 2 (frozen whole) is freed once its input gradient is computed: before block 1's
    # adapters get theirs
    seen = []
    m1.blocks[1].up.A.weight.register_hook(
        lambda g: seen.append(
            next(u.state for u in zo.units() if u.module is m1.blocks[2]) != "sharded"
        )
    )
    peaks: list[int] = []
    _train(rank, zo, m1, ddp, to, 2, peak=peaks)
    assert seen == [False, False], f"block 2 still gathered in block 1's backward: {seen}"
    whole = sum(b.numel(world) * 4 for buf in core.store_layout.buffers for b in buf.buckets)
    assert 0 < peaks[-1] < whole, (peaks, whole)
    w = m1.blocks[2].up.base.weight
    assert torch.isnan(w).all(), "a frozen param between steps should read NaN"
    with zo.gathered_params(m1.blocks[2]):
        assert torch.equal(w, ddp.module.blocks[2].up.base.weight)
    sd1, sd2 = m1.state_dict(), ddp.module.state_dict()
    assert sd1.keys() == sd2.keys()
    for k in sd1:
        assert rel_err(sd1[k], sd2[k]) <= 1e-5, k
        assert "base" not in k or torch.equal(sd1[k], sd2[k]), k
    zo.close()
    for (n, a), (_, b) in zip(m1.named_parameters(), ddp.module.named_parameters()):
        assert rel_err(a, b) <= 1e-5 and not torch.isnan(a).any(), f"after close: {n}"
        assert "base" not in n or torch.equal(a, b), f"after close: {n}"
    return {"held": held, "frozen": frozen, "peak": peaks[-1], "whole": whole}


def check_checkpoint(rank: int, world: int) -> dict:
    """save_checkpoint / load_checkpoint with sharded frozen params: the model file holds them
    whole, and a fresh model (another frozen base) loads them and resumes as the uninterrupted
    run."""
    zo, m1, ddp, to = _pair()
    _train(rank, zo, m1, ddp, to, 2)
    d = [tempfile.mkdtemp() if rank == 0 else None]
    dist.broadcast_object_list(d, 0)
    save_checkpoint(d[0], m1, zo)
    after = _train(rank, zo, m1, ddp, to, 2, start=2)
    torch.manual_seed(1)  # another base: the load must bring the saved one
    m3 = LoraNet()
    zo3 = _zero(m3)
    load_checkpoint(d[0], m3, zo3)
    resumed = []
    for step in range(2, 4):
        x, y = _batch(rank, step)
        zo3.zero_grad()
        loss = _loss(m3, x, y)
        loss.backward()
        zo3.step()
        resumed.append(float(loss))
    assert resumed == [a for a, _ in after], (resumed, after)
    with zo.gathered_params(), zo3.gathered_params():
        for (n, a), (_, b) in zip(m1.named_parameters(), m3.named_parameters()):
            assert torch.equal(a, b), n
    zo.close()
    zo3.close()
    if rank == 0:
        files = os.listdir(d[0])
        assert files, "nothing saved"
    return {"resumed": resumed}


def check_quantized(rank: int, world: int) -> dict:
    """quantize_weights="int8" reaches the frozen params' all-gathers too (ZeRO++'s qwZ
    quantizes every weight it gathers): the losses stay finite and near DDP's exact ones;
    ``gathered_params`` hands the frozen params out exact."""
    zo, m1, ddp, to = _pair(quantize_weights="int8")
    losses = _train(rank, zo, m1, ddp, to, 3)
    worst = max(abs(a - b) / abs(b) for a, b in losses)
    assert all(torch.isfinite(torch.tensor(a)) for a, _ in losses) and worst < 5e-2, losses
    with zo.gathered_params():
        for (n, a), (_, b) in zip(m1.named_parameters(), ddp.module.named_parameters()):
            assert "base" not in n or torch.equal(a, b), n
    zo.close()
    return {"worst": worst}


def check_meta(rank: int, world: int) -> dict:
    """A model built on the meta device: the frozen params are materialised unit by unit into
    their buckets (never whole), with the values the frozen-kept-whole construction gives."""
    got = []
    for shard in (False, True):
        with torch.device("meta"):
            m = LoraNet()
        zo = _zero(m, shard_frozen=shard, seed=3)
        assert bool(zo.parts.core.frozen) == shard
        assert not any(p.is_meta for p in m.parameters())
        with zo.gathered_params():
            got.append({n: p.detach().clone() for n, p in m.named_parameters()})
        zo.close()
    for n, t in got[0].items():
        assert torch.equal(t, got[1][n]), n
    return {"params": len(got[0])}


def frozen_all(rank: int, world: int) -> dict:
    checks = [check_parity, check_sharded, check_checkpoint, check_quantized, check_peft_llama]
    checks += [check_meta, check_two_forwards_and_double_backward, check_external_read]
    checks += [check_whole_frozen_warned, check_leaf_input, check_side_output_raises]
    checks.append(check_input_gradients)
    return run_checks(rank, world, checks)


def _peft_llama(seed: int = 0):
    """The tests' small Llama (transformers_checks.other_arch: grouped-query attention, tied
    embeddings) under PEFT's LoRA on q_proj, v_proj and down_proj: every other weight frozen."""
    from peft import LoraConfig, get_peft_model
    from transformers_checks import other_arch

    model = other_arch("llama", seed)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"])
    model = get_peft_model(model, lora)
    for n, p in model.named_parameters():  # B starts at zero in PEFT: A would get no gradient
        if "lora_B" in n:
            nn.init.normal_(p, std=0.05, generator=torch.Generator().manual_seed(len(n)))
    return model


def check_peft_llama(rank: int, world: int) -> dict:
    """PEFT LoRA on a Llama: stage 3 with shard_frozen against DDP, without and with the
    model's own gradient checkpointing (re-entrant, with PEFT's input-require-grads hook, and
    not): losses and every param over 3 steps."""
    out = {}
    for gc in (None, True, False):
        base = _peft_llama()
        if gc is not None:
            base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": gc})
            base.enable_input_require_grads()
        m1, m2 = copy.deepcopy(base), copy.deepcopy(base)
        m1.train()
        m2.train()
        zo = _zero(m1)
        assert len(zo.parts.core.frozen) > 10, len(zo.parts.core.frozen)
        ddp, to = DDP(m2, static_graph=gc is True), _adamw(m2)
        worst = 0.0
        for step in range(3):
            x, _ = _batch(rank, step)
            zo.zero_grad()
            to.zero_grad()
            l1 = m1(input_ids=x, labels=x).loss
            l1.backward()
            l2 = ddp(input_ids=x, labels=x).loss
            l2.backward()
            zo.step()
            to.step()
            worst = max(worst, abs(float(l1) - float(l2)) / abs(float(l2)))
            assert torch.isfinite(l1), (gc, step, float(l1))
        assert worst <= 1e-5, (gc, worst)
        _same_params(zo, m1, m2, 1e-5, f"gradient checkpointing {gc}")
        zo.close()
        out[str(gc)] = worst
    return out


def check_two_forwards_and_double_backward(rank: int, world: int) -> dict:
    """The same units run twice before one backward (two views through one model, a contrastive
    loss), and one forward with two backwards (``retain_graph=True``): a unit holding frozen
    params is freed only once every use of them in the backward is done. Against plain torch
    on every rank's batches (the ranks' average gradient)."""
    out = {}
    for mode in ("two forwards", "two backwards"):
        zo, m1, ref, to = _plain_pair(LoraNet)

        def loss_of(model, r, step, mode=mode):
            x, y = _batch(r, step)
            if mode == "two forwards":
                return _loss(model, x, y) + _loss(model, y, x)
            return _loss(model, x, y)

        def twice(loss):  # one forward, two backwards
            loss.backward(retain_graph=True)
            loss.mul(0.5).backward()

        backward = twice if mode == "two backwards" else torch.Tensor.backward
        _train_plain(rank, world, zo, m1, ref, to, loss_of, backward)
        _same_params(zo, m1, ref, 1e-5, mode)
        zo.close()
        out[mode] = "ok"
    return out


def check_secondary(rank: int, world: int) -> dict:
    """secondary_shard=2 (hpZ) keeps a slice of the frozen buckets too between a unit's forward
    and its backward, whose all-gathers then stay inside blocks of 2 ranks: DDP's losses and
    params."""
    assert world % 2 == 0 and world > 2, f"needs an even world of 4 or more, got {world}"
    zo, m1, ddp, to = _pair(secondary_shard=2)
    losses = _train(rank, zo, m1, ddp, to, 3)
    worst = max(abs(a - b) / abs(b) for a, b in losses)
    assert worst <= 1e-5, losses
    _same_params(zo, m1, ddp.module, 1e-5, "secondary_shard=2")
    sec = zo.comm_stats["secondary_all_gather_calls"]
    assert sec > 0, zo.comm_stats
    zo.close()
    return {"worst": worst, "secondary_all_gathers": sec}


def frozen_secondary(rank: int, world: int) -> dict:
    return run_checks(rank, world, [check_secondary])


class _ExternalRead(LoraNet):
    """The forward reads frozen params of later units outside them ([Note: external params]):
    a norm's gain before the blocks and between them, a frozen weight through F.linear."""

    def __init__(self, where: str):
        super().__init__()
        self.where = where
        self.scale = nn.Parameter(torch.full((D,), 1.1))  # trained, in the root unit

    def forward(self, x):
        h = self.emb(x) * self.scale
        if self.where == "before":
            h = h * self.blocks[3].ln.weight
            w = self.blocks[2].up.base.weight
            h = h + 0.1 * nn.functional.linear(h, w)[..., :D]
        for k, b in enumerate(self.blocks):
            if self.where == "between" and k == 2:
                h = h * self.blocks[3].ln.weight
            h = b(h)
        return self.head(self.norm(h))


def check_external_read(rank: int, world: int) -> dict:
    """A frozen param read outside its unit, whose read's backward runs after the unit's own:
    the unit stays gathered to the end of the backward (freed at its own backward, the read's
    gradient was NaN from the second step, or wrong where the storage was gathered again)."""
    out = {}
    for where in ("before", "between"):
        zo, m1, ddp, to = _pair(make=lambda where=where: _ExternalRead(where))
        losses = _train(rank, zo, m1, ddp, to, 3)
        worst = max(abs(a - b) / abs(b) for a, b in losses)
        assert worst <= 1e-5, (where, losses)
        _same_params(zo, m1, ddp.module, 1e-5, where)
        zo.close()
        out[where] = worst
    return out


class _LeafInput(nn.Module):
    """A frozen-only block whose input is a trained param itself (a leaf: autograd keeps the
    input hooks of every forward on it), then an adapted block."""

    def __init__(self):
        super().__init__()
        self.prompt = nn.Parameter(torch.randn(6, D))
        self.emb = nn.Embedding(V, D)
        self.emb.requires_grad_(False)
        self.blocks = nn.ModuleList([Block(adapted=False), Block(adapted=True)])
        self.head = nn.Linear(D, V)
        self.ckpt = None

    def forward(self, x):
        h = self.emb(x) + self.blocks[0](self.prompt)
        return self.head(self.blocks[1](h))


def check_leaf_input(rank: int, world: int) -> dict:
    """A unit's input that is a leaf (a trained param passed as it is) keeps the unit's input
    hooks past the backward: they are removed at the next forward (one per step had piled up
    on the param), and one fired by a gradient of that param outside the model's backward
    (``torch.autograd.grad`` between steps) counts for nothing (it counted, and the next
    backward freed the frozen block before its backward read its weights)."""
    zo, m1, ddp, to = _pair(make=_LeafInput)
    hooks = []
    losses = []
    for step in range(4):
        losses += _train(rank, zo, m1, ddp, to, 1, start=step)
        for m in (m1, ddp.module):  # a gradient of the leaf alone, outside the model
            torch.autograd.grad(m.prompt.pow(2).sum(), m.prompt)
        hooks.append(len(m1.prompt._backward_hooks or {}))
    worst = max(abs(a - b) / abs(b) for a, b in losses)
    assert worst <= 1e-5, losses
    _same_params(zo, m1, ddp.module, 1e-5, "leaf input")
    assert max(hooks) <= 1, f"input hooks on the leaf per step: {hooks}"
    zo.close()
    return {"worst": worst, "hooks": hooks}


class _FromEmbeddings(LoraNet):
    """LoraNet fed embeddings (an input that needs a gradient) instead of token ids."""

    def forward(self, e):
        h = e
        for b in self.blocks:
            h = b(h)
        return self.head(self.norm(h))


def check_input_gradients(rank: int, world: int) -> dict:
    """``torch.autograd.grad`` of the loss over the model's input before the backward: a
    gradient penalty (``create_graph=True``, the penalty's graph reads the params again in the
    backward) and a saliency map (``retain_graph=True``, then the loss's backward). The grad
    call's input hooks counted into the next backward and freed units early (NaN params); a
    unit freed while the penalty's graph was built left that graph reading NaN. Against plain
    torch over every rank's batches."""
    out = {}
    for mode in ("penalty", "saliency"):
        zo, m1, ref, to = _plain_pair(_FromEmbeddings)

        def total(model, r, step, mode=mode):
            _, y = _batch(r, step)
            g = torch.Generator().manual_seed(1000 * step + r)
            e = torch.randn(3, 6, D, generator=g).requires_grad_() * 1.0
            loss = nn.functional.cross_entropy(model(e).reshape(-1, V), y.reshape(-1))
            if mode == "penalty":
                (ge,) = torch.autograd.grad(loss, e, create_graph=True)
                return loss + 10 * ge.pow(2).sum()
            torch.autograd.grad(loss, e, retain_graph=True)
            return loss

        _train_plain(rank, world, zo, m1, ref, to, total)
        _same_params(zo, m1, ref, 1e-5, mode)
        zo.close()
        out[mode] = "ok"
    return out


class _SideBlock(Block):
    """A frozen-only block that also reads a trained tensor through an attribute (``ctx``),
    not an argument, for a side output."""

    def forward(self, h):
        self.aux = self.up.base(self.ctx).pow(2).mean()
        return super().forward(h)


class _SideOutput(nn.Module):
    """`_SideBlock` first, its inputs needing no gradient: no backward of the unit is expected,
    yet one reads its frozen weight (found by a helper's probe)."""

    def __init__(self, cast: bool):
        super().__init__()
        self.pre = nn.Parameter(torch.randn(D))
        self.emb = nn.Embedding(V, D)
        self.emb.requires_grad_(False)
        self.blocks = nn.ModuleList([_SideBlock(adapted=False), Block(adapted=True)])
        self.head = nn.Linear(D, V)
        self.cast = cast
        self.ckpt = None

    def forward(self, x):
        ctx = torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False)
        with ctx if self.cast else contextlib.nullcontext():
            self.blocks[0].ctx = self.pre * 1.0
            h = self.blocks[1](self.blocks[0](self.emb(x)))
            return self.head(h).float() * (1 + self.blocks[0].aux.float())  # (a sum: no grad)


def check_side_output_raises(rank: int, world: int) -> dict:
    """[Note: frozen casts]: the backward reading a frozen weight of a unit that no backward
    was expected for (freed after its forward) raises, naming the param, in fp32 (the weight
    saved as it is: the gradient was silently wrong) and under autocast (its cast made again:
    NaN); with shard_frozen=False the gradients are DDP's."""
    out = {}
    for cast in (False, True):
        zo, m1, ddp, to = _pair(make=lambda cast=cast: _SideOutput(cast))
        x, y = _batch(rank, 0)
        loss = _loss(m1, x, y)
        try:
            loss.backward()
        except RuntimeError as e:
            msg = str(e)
        else:
            msg = ""
        assert "blocks.0.up.base.weight" in msg and "was freed" in msg, (cast, msg)
        zo.close()
        zo, m1, ddp, to = _pair(make=lambda cast=cast: _SideOutput(cast), shard_frozen=False)
        losses = _train(rank, zo, m1, ddp, to, 2)
        # bf16: 1.1e-4 on an adapter after 2 AdamW steps, the same with the recipes off
        _same_params(zo, m1, ddp.module, 1e-3 if cast else 1e-5, f"whole, cast={cast}")
        zo.close()
        out[f"cast={cast}"] = max(abs(a - b) / abs(b) for a, b in losses)
    return out


def check_whole_frozen_warned(rank: int, world: int) -> dict:
    """Stage 3 keeping a frozen base whole that outweighs the trained params warns, naming
    shard_frozen; with it, or with a model whose frozen params are few, nothing is said."""
    import warnings

    got = {}
    for name, shard, freeze_all in (
        ("whole", False, True),
        ("sharded", True, True),
        ("few frozen", False, False),
    ):
        torch.manual_seed(0)
        m = LoraNet()
        if not freeze_all:
            for p in m.parameters():
                p.requires_grad_(True)
            m.norm.requires_grad_(False)
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            zo = _zero(m, shard_frozen=shard)
        said = [str(x.message) for x in w if "shard_frozen=True" in str(x.message)]
        got[name] = len(said)
        zo.close()
    assert got == {"whole": 1, "sharded": 0, "few frozen": 0}, got
    return got
