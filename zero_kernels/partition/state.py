"""Optimizer state between this rank's pieces and torch's per-parameter format.

The inner optimizer keeps torch's own state per piece (see [Note: modes] in `.runner`): a value
shaped like the piece is element-wise (``exp_avg``, momentum buffers) and is cut or joined by
element ranges; anything else (``step``, Adafactor's row and column factors of a whole parameter)
is per tensor and is the same on every piece of a parameter.

`consolidate` rebuilds, from every rank's `local_payload`, the ``state_dict()`` the unsharded torch
optimizer would have (``state[index][key]`` shaped like the parameter, only for parameters that
have state, ``param_groups`` with index lists); `shard_state` is the inverse: this rank's
inner-optimizer state from such a dict, at any world size and in either mode.

A consolidated dict of bf16/fp16 params also holds each param's fp32 master values, under
`MASTER_KEY` (``"fp32_master"``, shaped like the param): the ordinary resume (the model's
``state_dict()`` and the optimizer's, as HF Trainer and Lightning save them) would otherwise
continue from masters rounded to the params' precision (0.3% off the uninterrupted run after 3
steps). A plain torch optimizer loads such a dict too (the extra entry, cast to the param's
dtype, is unused by its step).
"""

from __future__ import annotations

import torch

from ..layout import Layout

__all__ = [
    "MASTER_KEY",
    "consolidate",
    "elementwise",
    "local_payload",
    "shard_state",
    "to_host",
]

MASTER_KEY = "fp32_master"

# Per-tensor scalars that torch optimizers keep as 0-dim tensors, never element-wise.
_SCALAR_KEYS = frozenset({"step", "mu_product", "eta", "mu"})


def elementwise(key: str, v, shape: tuple) -> bool:
    """Whether state value ``v`` of a tensor of ``shape`` holds one entry per element."""
    if not isinstance(v, torch.Tensor) or tuple(v.shape) != tuple(shape):
        return False
    return v.dim() > 0 or key not in _SCALAR_KEYS


def _copy(v):
    return v.detach().clone() if isinstance(v, torch.Tensor) else v


def to_host(v):
    """A host copy of tensor ``v`` (anything else as it is): what `local_payload` puts in the
    payload, which goes through an object collective (pickled: a CUDA tensor is unpickled
    onto the device index it had on the sending rank, so rank 0 would put every rank's state
    on those ranks' GPUs)."""
    return v.detach().to("cpu", copy=True) if isinstance(v, torch.Tensor) else v


def local_payload(layout: Layout, runner, masters: bool = False) -> list[dict]:
    """This rank's state per flat buffer: ``{index: {"offset", "numel", "elem", "other"}}``
    (element-wise values flattened over the piece, per-tensor values as they are), host copies
    (`to_host`: the payload goes through object collectives); with ``masters``, the fp32
    master values of low-precision params as element-wise entry `MASTER_KEY`."""
    out = [{} for _ in layout.buffers]
    with runner.resident():  # offloaded moments read in for the copy ([Note: offload])
        for i, _, pc, p, _ in runner.all_pieces():
            st = runner.inner.state.get(p, {})
            if not st:
                continue
            elem = {k: to_host(v.reshape(-1)) for k, v in st.items() if elementwise(k, v, p.shape)}
            if masters and runner.masters[i] is not None:  # p is the piece's master view
                elem[MASTER_KEY] = to_host(p.reshape(-1))
            other = {k: to_host(v) for k, v in st.items() if k not in elem}
            out[i][pc.index] = {
                "offset": pc.offset,
                "numel": pc.numel,
                "elem": elem,
                "other": other,
            }
    return out


def consolidate(
    layout: Layout, payloads: list[list[dict]], groups: list[dict], group_indices: list[list[int]]
) -> dict:
    """torch's ``Optimizer.state_dict()`` format from every rank's `local_payload`."""
    state: dict[int, dict] = {}
    for i, buf in enumerate(layout.buffers):
        for slot in buf.slots:
            parts = [pl[i][slot.index] for pl in payloads if slot.index in pl[i]]
            if not parts:
                continue  # never stepped: torch has no state for it either
            st: dict = {}
            for key, v in parts[0]["elem"].items():
                full = torch.zeros(slot.numel, dtype=v.dtype, device=v.device)
                for part in parts:
                    full[part["offset"] : part["offset"] + part["numel"]] = part["elem"][key]
                st[key] = full.view(slot.shape)
            for key, v in parts[0]["other"].items():
                st[key] = _copy(v)
            state[slot.index] = st
    param_groups = []
    for g, idx in zip(groups, group_indices):
        packed = {k: v for k, v in g.items() if k != "params"}
        packed["params"] = list(idx)
        param_groups.append(packed)
    return {"state": dict(sorted(state.items())), "param_groups": param_groups}


def shard_state(layout: Layout, runner, rank: int, full_state: dict) -> dict:
    """``inner.load_state_dict``'s ``state`` for this rank, from torch's per-parameter state."""
    del rank  # the runner's pieces are this rank's
    out: dict[int, dict] = {}
    for j, (i, _, pc, p, _) in enumerate(runner.all_pieces()):
        st = full_state.get(pc.index)
        if not st:
            continue
        shape = layout.buffers[i].slots[pc.slot].shape
        piece = {}
        for k, v in st.items():
            if elementwise(k, v, shape):
                piece[k] = v.reshape(-1)[pc.offset : pc.offset + pc.numel].view(p.shape).clone()
            else:
                piece[k] = _copy(v)
        out[j] = piece
    return out
