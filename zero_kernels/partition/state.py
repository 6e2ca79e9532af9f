"""Optimizer state between this rank's shard and torch's per-parameter format.

`consolidate` rebuilds, from every rank's shard state, the ``state_dict()`` the unsharded torch
optimizer would have (``state[index][key]`` shaped like the parameter, ``param_groups`` with
index lists); `shard_state` is the inverse: this rank's inner-optimizer state from such a dict,
at any world size.
"""

from __future__ import annotations

import torch

from ..layout import Layout

__all__ = ["consolidate", "local_payload", "shard_state"]

# Per-tensor scalars that torch optimizers keep as 0-dim tensors, never element-wise.
_SCALAR_KEYS = frozenset({"step", "mu_product", "eta", "mu"})


def _elementwise(key: str, v, numel: int, shape=None) -> bool:
    if not isinstance(v, torch.Tensor):
        return False
    if v.dim() == 0:
        return shape == () and key not in _SCALAR_KEYS
    return v.numel() == numel


def local_payload(layout: Layout, runner) -> list[dict]:
    """This rank's state per flat buffer: ``{key: value}`` (flat: element-wise values over the
    rank's whole shard of the buffer, the buckets' concatenated) or ``{index: {key: value}}``."""
    out = []
    for i, buf in enumerate(layout.buffers):
        if layout.mode == "flat":
            sts = [runner.inner.state.get(p, {}) for p in runner.inner_params[i]]
            d = {}
            if all(sts):
                for k, v in sts[0].items():
                    if _elementwise(k, v, buf.buckets[0].shard_numel):
                        d[k] = torch.cat([st[k].detach().reshape(-1) for st in sts])
                    else:
                        d[k] = v.detach().clone() if isinstance(v, torch.Tensor) else v
            out.append(d)
        else:
            d = {}
            for idx, p in zip(runner.owned[i], runner.inner_params[i]):
                st = runner.inner.state.get(p, {})
                if st:
                    d[idx] = {
                        k: (v.detach().clone() if isinstance(v, torch.Tensor) else v)
                        for k, v in st.items()
                    }
            out.append(d)
    return out


def consolidate(
    layout: Layout, payloads: list[list[dict]], groups: list[dict], group_indices: list[list[int]]
) -> dict:
    """torch's ``Optimizer.state_dict()`` format from every rank's `local_payload`."""
    n = layout.world_size
    state: dict[int, dict] = {}
    for i, buf in enumerate(layout.buffers):
        if layout.mode == "whole":
            for r in range(n):
                state.update(payloads[r][i])
            continue
        first = payloads[0][i]
        if not first:
            continue
        shard_numel = buf.shard_numel(n)
        full: dict[str, torch.Tensor] = {}
        for key, v in first.items():
            if _elementwise(key, v, shard_numel):
                t = torch.zeros(buf.numel, dtype=v.dtype, device=v.device)
                for r in range(n):
                    src = payloads[r][i][key]
                    for b in buf.buckets:
                        off = b.start // n
                        t[b.shard_start(r) : b.shard_start(r) + b.shard_numel] = src[
                            off : off + b.shard_numel
                        ]
                full[key] = t
        for slot in buf.slots:
            st = {}
            for key, v in first.items():
                if key in full:
                    st[key] = full[key][slot.start : slot.end].view(slot.shape).clone()
                else:
                    st[key] = v.clone() if isinstance(v, torch.Tensor) else v
            state[slot.index] = st
    param_groups = []
    for g, idx in zip(groups, group_indices):
        packed = {k: v for k, v in g.items() if k != "params"}
        packed["params"] = list(idx)
        param_groups.append(packed)
    return {"state": dict(sorted(state.items())), "param_groups": param_groups}


def shard_state(layout: Layout, runner, rank: int, full_state: dict) -> dict:
    """``inner.load_state_dict``'s ``state`` for this rank, from torch's per-parameter state."""
    n = layout.world_size
    out: dict[int, dict] = {}
    j = 0
    for i, buf in enumerate(layout.buffers):
        if layout.mode == "whole":
            for idx in runner.owned[i]:
                if idx in full_state:
                    out[j] = dict(full_state[idx])
                j += 1
            continue
        have = [s for s in buf.slots if s.index in full_state and full_state[s.index]]
        if have:
            st0 = full_state[have[0].index]
            shard = buf.shard_numel(n)
            st: dict = {}
            split = set()  # element-wise keys, cut per bucket below
            for key, v in st0.items():
                if _elementwise(key, v, have[0].numel, have[0].shape):
                    t = torch.zeros(shard, dtype=v.dtype, device=v.device)
                    for slot in have:
                        src = full_state[slot.index][key].reshape(-1)
                        b = buf.buckets[slot.bucket]
                        lo = max(slot.start, b.shard_start(rank))
                        hi = min(slot.end, b.shard_start(rank) + b.shard_numel)
                        if hi > lo:
                            off = b.start // n + lo - b.shard_start(rank)
                            t[off : off + hi - lo] = src[lo - slot.start : hi - slot.start]
                    st[key] = t
                    split.add(key)
                else:
                    st[key] = v
            # one entry per bucket: the inner params (see [Note: modes] in .runner)
            for b in buf.buckets:
                off = b.start // n
                out[j + b.index] = {
                    k: v[off : off + b.shard_numel].clone()
                    if k in split
                    else (v.clone() if isinstance(v, torch.Tensor) else v)
                    for k, v in st.items()
                }
        j += len(buf.buckets)
    return out
