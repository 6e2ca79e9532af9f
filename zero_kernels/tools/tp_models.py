"""A GPT written for tensor parallelism, and its plan (`parallelize_gpt`).

The demo's GPT (`zero_kernels.tools.models`) projects q, k and v with one fused Linear and
reshapes by the global width; a column-wise split of the fused weight hands a tp rank parts of
q and k, and its reshape breaks on the local width. Here q, k and v are separate Linears (no
bias on k: a key bias gets no gradient through a softmax, only rounding noise that Adam
amplifies) and the reshapes take the head count from the local width, so Colwise/Rowwise
splits heads across tp ranks. `parallelize_gpt` is the Megatron-style plan with sequence
parallelism: embeddings and norms on sequence shards (``SequenceParallel``), attention and MLP
column-wise in, row-wise out, the head column-wise with a replicated output.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .models import GPTConfig

__all__ = ["TPGPT", "parallelize_gpt"]


class _Attention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.head_dim = cfg.n_embd // cfg.n_head
        self.q = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.k = nn.Linear(cfg.n_embd, cfg.n_embd, bias=False)
        self.v = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.o = nn.Linear(cfg.n_embd, cfg.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (
            f(x).view(b, t, -1, self.head_dim).transpose(1, 2) for f in (self.q, self.k, self.v)
        )
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, t, -1))


class _Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd)
        self.attn = _Attention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd)
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.fc_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.fc_proj(F.gelu(self.fc(self.ln_2(x))))


class TPGPT(nn.Module):
    """A pre-norm GPT (learned positions, untied head) that `parallelize_gpt` splits."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.blocks = nn.ModuleList(_Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), targets.reshape(-1))


def parallelize_gpt(model: TPGPT, tp_mesh, sequence_parallel: bool = True) -> TPGPT:
    """``model`` split over the 1-D ``tp_mesh`` in place (``parallelize_module``): q/k/v and
    fc column-wise, o and fc_proj row-wise, the head column-wise with a replicated output; with
    ``sequence_parallel`` the norms and the residual stream on sequence shards (``Shard(1)``),
    else replicated. The head count must divide by the tp size."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    tp = tp_mesh.size()
    if model.cfg.n_head % tp:
        raise ValueError(f"n_head={model.cfg.n_head} must divide by the tp size {tp}")
    seq = Shard(1) if sequence_parallel else Replicate()
    top = {"head": ColwiseParallel(input_layouts=seq, output_layouts=Replicate())}
    if sequence_parallel:
        top["ln_f"] = SequenceParallel()
    parallelize_module(model, tp_mesh, top)
    for block in model.blocks:
        plan = {
            "attn.q": ColwiseParallel(),
            "attn.k": ColwiseParallel(),
            "attn.v": ColwiseParallel(),
            "attn.o": RowwiseParallel(output_layouts=seq),
            "fc": ColwiseParallel(),
            "fc_proj": RowwiseParallel(output_layouts=seq),
        }
        if sequence_parallel:
            plan["ln_1"] = SequenceParallel()
            plan["ln_2"] = SequenceParallel()
            plan["attn"] = PrepareModuleInput(
                input_layouts=(seq,), desired_input_layouts=(Replicate(),)
            )
            plan["fc"] = ColwiseParallel(input_layouts=seq)
        parallelize_module(block, tp_mesh, plan)
    if sequence_parallel:  # the residual stream enters the blocks as sequence shards
        parallelize_module(
            model.blocks[0],
            tp_mesh,
            PrepareModuleInput(
                input_layouts=(Replicate(),), desired_input_layouts=(seq,), use_local_output=True
            ),
        )
    return model
