"""`ShardedState`: one public interface to a `ZeroOptimizer`'s sharded state, for checkpoints.

What a checkpoint reads and writes of an optimizer, and nothing else: the layout, this rank's
pieces (each param's element range here, the values the optimizer steps, the fp32 master where
the params are lower, and its optimizer state), the param groups, the step counter and the loss
scaler. `zero_kernels.checkpoint` goes through it (``opt.sharded_state``), never through the
optimizer's or its runner's private attributes, so a change to how the runner keeps its state
(fused Adam's flat per-bucket tensors, an offload tier) changes this file and not the checkpoint
format. Where the fused kernel keeps a piece's state as views of one flat tensor per bucket,
loaded values go straight into those views (`state_target`), and `install` makes the runner
adopt what was loaded.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

__all__ = ["Piece", "ShardedState"]

_FUSED_KEYS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")  # fused Adam's flat state


@dataclass
class Piece:
    """This rank's range of one param: ``index`` (the param's), ``offset`` and ``numel`` in the
    flattened param, ``values`` (the stepped values: the fp32 master or the param's own shard,
    flat, a view to write into), ``shape`` of the piece as the optimizer sees it, and ``state``
    (the optimizer's entries for it; element-wise ones shaped like the piece)."""

    index: int
    offset: int
    numel: int
    values: torch.Tensor
    shape: tuple
    state: dict


class ShardedState:
    """The sharded state of one open `ZeroOptimizer` (see the module docstring)."""

    def __init__(self, opt):
        opt._check_open("sharded_state")
        self._opt = opt
        self._runner = opt._runner
        self._entries = list(self._runner.all_pieces())

    # ---- what the state is laid out over
    @property
    def layout(self):
        return self._opt.layout

    @property
    def rank(self) -> int:
        return self._opt.rank

    @property
    def world_size(self) -> int:
        return self._opt.world_size

    @property
    def stage(self) -> int:
        return self._opt.stage

    @property
    def mode(self) -> str:
        return self._opt.mode

    @property
    def group(self):
        return self._opt.group

    @property
    def optimizer_class(self):
        return self._opt.optimizer_class

    def params(self) -> dict[int, torch.Tensor]:
        """Every param by its layout index (frozen ones too)."""
        return dict(self._opt._params)

    def trainable(self) -> list[int]:
        return sorted(self._opt._trainable)

    def group_indices(self) -> list[list[int]]:
        """The layout indices of each param group's params."""
        return [list(x) for x in self._opt._group_indices]

    @property
    def param_groups(self) -> list[dict]:
        return self._opt.param_groups

    # ---- this rank's pieces
    def pieces(self) -> Iterator[Piece]:
        for _i, _k, pc, ip, _g in self._entries:
            st = self._runner.inner.state.get(ip) or {}
            yield Piece(pc.index, pc.offset, pc.numel, ip.detach().view(-1), tuple(ip.shape), st)

    def state_target(self, j: int, key: str, dtype: torch.dtype) -> torch.Tensor:
        """Where piece ``j``'s state entry ``key`` (``dtype``, flat) is best loaded: the entry
        itself where it exists with that dtype and size, fused Adam's view of its bucket's flat
        state, else a new tensor (which `install` then places)."""
        r = self._runner
        i, k, pc, ip, _g = self._entries[j]
        v = (r.inner.state.get(ip) or {}).get(key)
        if (
            isinstance(v, torch.Tensor)
            and v.dtype == dtype
            and v.numel() == pc.numel
            and v.is_contiguous()
            and v.device.type == "cpu"
        ):
            return v.detach().view(-1)
        if r.fused[i] and dtype == torch.float32 and key in _FUSED_KEYS:
            views = r.piece_flat_state(i, k)
            if key in views:
                return views[key]
        return torch.empty(pc.numel, dtype=dtype)

    @torch.no_grad()
    def install(self, states: list, groups: list[dict], steps: int, scaler: dict) -> None:
        """Per piece (in `pieces` order) its loaded state ``{"elem": {key: flat}, "other":
        {...}}`` or None (no state: it restarts), the param groups' hyper-parameters, the step
        counter and the scaler's saved state; then the params are made whole from the loaded
        values (collective)."""
        o, r = self._opt, self._runner
        assert len(self._entries) == len(states)
        for (i, _k, pc, ip, _g), st in zip(self._entries, states):
            if st is not None:
                r.inner.state[ip] = {
                    **{k: v.view(ip.shape) for k, v in st["elem"].items()},
                    **st["other"],
                }
                continue
            r.inner.state.pop(ip, None)
            flat = r.flat_state.get((i, pc.bucket)) if r.fused[i] else None
            if flat:  # fused Adam: the piece's range of the bucket's state restarts at 0
                b = o.layout.buffers[i].buckets[pc.bucket]
                lo = pc.start - b.shard_start(o.rank)
                for t in flat.values():
                    t[lo : lo + pc.numel].zero_()
        r.adopt_state()
        for g, saved in zip(o.param_groups, groups):
            for k, v in saved.items():
                if k != "params":
                    g[k] = v
        r.sync_hyper(o.param_groups)
        if "loss_scale" in scaler and scaler.get("dynamic") == o.scaler.dynamic:
            o.scaler.scale = float(scaler["loss_scale"])
            o.scaler.growth_tracker = int(scaler.get("growth_tracker", 0))
        o._steps = int(steps)
        o._refresh_params()

    # ---- counters
    @property
    def steps(self) -> int:
        """The optimizer's step counter (names checkpoint folders; restored on resume)."""
        return int(self._opt._steps)

    def scaler_state(self) -> dict:
        return self._opt.scaler.state_dict()
