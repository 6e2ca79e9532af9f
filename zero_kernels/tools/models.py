"""A small GPT (pre-norm, tied embeddings) and the byte-level corpus the demo trains it on.

The model is deliberately plain: it exists so `zero-kernels demo` has something real to shard, and
so `zero-kernels estimate --model zero_kernels.tools.models:gpt_small` can build it on the meta
device.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from importlib import resources

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

__all__ = ["GPTConfig", "GPT", "MODEL_SIZES", "build_gpt", "load_corpus", "get_batch"]


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 256  # byte-level tokens
    block_size: int = 64  # context length
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 64
    # recompute each block in backward instead of keeping its activations (torch.utils.checkpoint,
    # non-reentrant): less memory, one more forward of every block
    activation_checkpointing: bool = False


# Sizes a laptop CPU trains in seconds to minutes; the larger ones are for GPUs and the estimator.
MODEL_SIZES: dict[str, GPTConfig] = {
    "tiny": GPTConfig(n_layer=2, n_head=4, n_embd=64, block_size=64),  # ~0.12M params
    "small": GPTConfig(n_layer=4, n_head=4, n_embd=128, block_size=128),  # ~0.84M
    "medium": GPTConfig(n_layer=6, n_head=8, n_embd=256, block_size=256),  # ~4.9M
    "large": GPTConfig(n_layer=12, n_head=12, n_embd=768, block_size=512),  # ~86M
}


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.ln_1 = nn.LayerNorm(cfg.n_embd)
        self.attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.ln_2 = nn.LayerNorm(cfg.n_embd)
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.fc_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.attn(self.ln_1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.fc_proj(F.gelu(self.fc(self.ln_2(x))))


class GPT(nn.Module):
    """GPT-2 style decoder; the output head shares the token embedding (a tied parameter)."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.head.weight = self.wte.weight  # tied: one tensor, counted once
        if self.wte.weight.device.type != "meta":
            self.apply(self._init)
            for name, p in self.named_parameters():
                if name.endswith("proj.weight"):  # GPT-2's scaled init of residual projections
                    nn.init.normal_(p, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, std=0.02)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        t = idx.shape[1]
        pos = torch.arange(t, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        ckpt = self.cfg.activation_checkpointing and torch.is_grad_enabled()
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if ckpt else block(x)
        logits = self.head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.view(-1))


def build_gpt(size: str = "tiny") -> GPT:
    """A GPT of one of `MODEL_SIZES` (a factory usable as `zero_kernels.tools.models:build_gpt`)."""
    if size not in MODEL_SIZES:
        raise ValueError(f"size must be one of {sorted(MODEL_SIZES)}, got size={size!r}")
    return GPT(MODEL_SIZES[size])


def gpt_tiny() -> GPT:
    return build_gpt("tiny")


def gpt_small() -> GPT:
    return build_gpt("small")


def gpt_medium() -> GPT:
    return build_gpt("medium")


def gpt_large() -> GPT:
    return build_gpt("large")


def load_corpus() -> torch.Tensor:
    """The shipped public-domain corpus (data/kjv.txt) as a uint8 tensor of byte tokens."""
    data = resources.files("zero_kernels").joinpath("data/kjv.txt").read_bytes()
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def get_batch(
    data: torch.Tensor, batch_size: int, block_size: int, *, seed: int, step: int, rank: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Batch for (step, rank): a pure function of its arguments, so all stages see the same data."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step * 1009 + rank)
    ix = torch.randint(len(data) - block_size - 1, (batch_size,), generator=g)
    x = torch.stack([data[i : i + block_size] for i in ix.tolist()]).long()
    y = torch.stack([data[i + 1 : i + 1 + block_size] for i in ix.tolist()]).long()
    return x, y
