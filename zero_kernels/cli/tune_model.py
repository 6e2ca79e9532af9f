"""The model `zero-kernels tune` trains: built from ``--model-size`` or ``--model``, with its
inputs, its loss, and the facts the predictions need (parameters, buckets, stage-3 units).

[Note: inputs and loss]
A demo GPT (``--model-size``, or a GPT-2 style ``config.json``, built as
`zero_kernels.tools.models.GPT`
with the config's sizes) trains on the shipped corpus, as `zero-kernels demo` does. A factory
(``--model pkg.mod:factory``, called with no arguments) gets its batch from the model's own
``example_batch(batch_size)`` method when it has one (a tensor or a tuple of positional
arguments); otherwise from its first layer: an ``nn.Embedding`` gets token ids of shape
(batch, seq_len), an ``nn.Linear`` normal noise of shape (batch, in_features). The loss is the
output when that is a scalar, ``output.loss`` when it has one, else the mean square of the
(first) output: a stand-in with the real forward and backward, enough to time a step, not to
train anything. Batches are a pure function of (seed, step, rank) and are made before the memory
baseline of a trial, as a data loader would have them ready.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ..tools.models import MODEL_SIZES, GPTConfig, build_gpt, get_batch, load_corpus

__all__ = ["ModelFacts", "ModelSource", "build_model", "make_batches", "model_facts", "step_loss"]


@dataclass(frozen=True)
class ModelSource:
    """Where the model comes from: ``kind`` is "size" (a demo GPT), "config" (a GPT-2 style
    config.json) or "factory" (``pkg.mod:factory``)."""

    kind: str
    spec: str
    batch_size: int = 8
    seq_len: int | None = None  # None: the GPT's block size, 128 for inferred token inputs

    @property
    def label(self) -> str:
        return f"GPT '{self.spec}'" if self.kind == "size" else self.spec


def _gpt_config(path: str) -> GPTConfig:
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    try:
        cfg = json.loads(p.read_text())
    except OSError as e:
        raise ValueError(f"--model: cannot read {str(p)!r} ({e.strerror})") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"--model: {str(p)!r} is not valid JSON ({e})") from None
    if not isinstance(cfg, dict) or not ("n_embd" in cfg or cfg.get("model_type") == "gpt2"):
        raise ValueError(
            f"--model {path!r}: tune trains GPT-2 style configs (n_embd, n_layer, n_head) as "
            "zero_kernels.tools.models.GPT; for another architecture pass --model "
            "pkg.module:factory "
            "that builds it"
        )
    try:
        g = GPTConfig(
            vocab_size=int(cfg["vocab_size"]),
            block_size=int(cfg.get("n_positions") or cfg.get("n_ctx") or 1024),
            n_layer=int(cfg["n_layer"]),
            n_head=int(cfg["n_head"]),
            n_embd=int(cfg["n_embd"]),
        )
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"--model {path!r}: config.json lacks or mangles {e}") from None
    if g.n_embd % g.n_head:
        raise ValueError(f"--model {path!r}: n_embd={g.n_embd} is not a multiple of n_head")
    return g


def _factory(spec: str):
    import importlib

    mod_name, _, attr = spec.partition(":")
    obj = importlib.import_module(mod_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def build_model(src: ModelSource, device: str | torch.device = "cpu") -> nn.Module:
    """The model on ``device`` ("meta": shapes only). Factories were validated by
    `zero_kernels.tools.estimate.model_info` before (which names the problem on one line)."""
    from ..tools.models import GPT

    with torch.device(device):
        if src.kind == "size":
            return build_gpt(src.spec)
        if src.kind == "config":
            return GPT(_gpt_config(src.spec))
        model = _factory(src.spec)()
    if not isinstance(model, nn.Module):
        raise ValueError(f"--model {src.spec!r} returned {type(model).__name__}, not an nn.Module")
    return model


def _first_layer(model: nn.Module) -> nn.Module | None:
    for m in model.modules():
        if not list(m.children()) and any(True for _ in m.parameters(recurse=False)):
            return m
    return None


def _seq_len(model: nn.Module, src: ModelSource) -> int:
    block = getattr(getattr(model, "cfg", None), "block_size", None)
    if src.seq_len is not None:
        return min(src.seq_len, block) if block else src.seq_len
    return block or 128


def is_gpt(model: nn.Module) -> bool:
    return isinstance(getattr(model, "cfg", None), GPTConfig)


def describe_input(model: nn.Module, src: ModelSource) -> str:
    """What a batch is, in words; ValueError naming --model when tune cannot make one."""
    b = src.batch_size
    if is_gpt(model):
        return f"corpus tokens ({b}, {_seq_len(model, src)}), next-token loss"
    if callable(getattr(model, "example_batch", None)):
        return f"model.example_batch({b})"
    first = _first_layer(model)
    if isinstance(first, nn.Embedding):
        return (
            f"random token ids ({b}, {_seq_len(model, src)}) < {first.num_embeddings}, "
            "loss: mean square of the output"
        )
    if isinstance(first, nn.Linear):
        return f"normal noise ({b}, {first.in_features}), loss: mean square of the output"
    raise ValueError(
        f"--model {src.spec!r}: cannot make an input for it (first layer "
        f"{type(first).__name__}); give the model an example_batch(batch_size) method"
    )


def make_batches(
    model: nn.Module,
    src: ModelSource,
    *,
    steps: int,
    seed: int,
    rank: int,
    corpus: torch.Tensor | None = None,
) -> list[tuple]:
    """``steps`` batches (tuples of forward arguments), a pure function of (seed, step, rank);
    a GPT's come from ``corpus`` (default: `zero_kernels.tools.models.load_corpus()`)."""
    out = []
    b = src.batch_size
    if is_gpt(model):
        data = load_corpus() if corpus is None else corpus
        for step in range(steps):
            x, y = get_batch(data, b, _seq_len(model, src), seed=seed, step=step, rank=rank)
            out.append((x, y))
        return out
    first = _first_layer(model)
    for step in range(steps):
        g = torch.Generator().manual_seed(seed * 1_000_003 + step * 1009 + rank)
        if callable(getattr(model, "example_batch", None)):
            torch.manual_seed(g.initial_seed())
            batch = model.example_batch(b)
            out.append(batch if isinstance(batch, tuple) else (batch,))
        elif isinstance(first, nn.Embedding):
            n = first.num_embeddings
            out.append((torch.randint(n, (b, _seq_len(model, src)), generator=g),))
        else:
            out.append((torch.randn(b, first.in_features, generator=g),))
    return out


def step_loss(model: nn.Module, batch: tuple) -> torch.Tensor:
    """The loss of one forward (see [Note: inputs and loss])."""
    out = model(*batch)
    if isinstance(out, torch.Tensor) and out.dim() == 0:
        return out
    loss = getattr(out, "loss", None)
    if isinstance(loss, torch.Tensor) and loss.dim() == 0:
        return loss
    if isinstance(out, tuple | list):
        out = out[0]
    return out.float().square().mean()


# ---------------------------------------------------------------------------------------------
# What the predictions need, from the model built on the meta device
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelFacts:
    """Trainable parameters (tied ones once) and how ZeroOptimizer will cut them."""

    n_params: int
    shapes: tuple[tuple[int, ...], ...]  # trainable params in registration order
    unit_numels: tuple[int, ...]  # stage 3: params of each unit (its repeated blocks)
    root_numel: int  # stage 3: params of the root unit (the rest)
    input: str  # what a batch is

    def bucket_numels(self, world_size: int, bucket_mb: float) -> tuple[int, ...]:
        """Padded element counts of the stage 1/2 buckets, exactly as ZeroOptimizer lays them
        out (`zero_kernels.layout.build_layout`, fp32 params, one param group)."""
        from ..layout import ParamSpec, build_layout

        specs = [ParamSpec(i, 0, "torch.float32", s) for i, s in enumerate(self.shapes)]
        layout = build_layout(
            specs, world_size, bucket_numel=max(1, int(bucket_mb * 2**20) // 4), mode="flat"
        )
        return tuple(b.numel(world_size) for buf in layout.buffers for b in buf.buckets)


def model_facts(src: ModelSource) -> ModelFacts:
    """Build the model on the meta device and count what the predictions need."""
    from ..partition.units import find_units, unit_assignment

    model = build_model(src, "meta")
    what = describe_input(model, src)
    params: dict[int, nn.Parameter] = {}
    for p in model.parameters():  # parameters() yields a tied tensor once
        if p.requires_grad:
            params[len(params)] = p
    if not params:
        raise ValueError(f"--model {src.spec!r}: the model has no trainable parameters")
    shapes = tuple(tuple(p.shape) for p in params.values())
    units = find_units(model)
    where = unit_assignment(units, params)
    sizes = [0] * (len(units) + 1)
    for i, p in params.items():
        sizes[where[i]] += p.numel()
    return ModelFacts(
        n_params=sum(math.prod(s) for s in shapes),
        shapes=shapes,
        unit_numels=tuple(sizes[1:]),
        root_numel=sizes[0],
        input=what,
    )


def check_size(name: str) -> None:
    if name not in MODEL_SIZES:
        raise ValueError(f"--model-size must be one of {', '.join(MODEL_SIZES)}; got {name!r}")
