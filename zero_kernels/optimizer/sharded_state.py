"""`ShardedState`: one public interface to a `ZeroOptimizer`'s sharded state, for checkpoints.

What a checkpoint reads and writes of an optimizer, and nothing else: the layout, this rank's
pieces (each param's element range here, the values the optimizer steps, the fp32 master where
the params are lower, and its optimizer state), the param groups, the step counter and the loss
scaler. `zero_kernels.checkpoint` goes through it (``opt.sharded_state``), never through the
optimizer's or its runner's private attributes, so a change to how the runner keeps its state
(fused Adam's flat per-bucket tensors, an offload tier) changes this file and not the checkpoint
format. The optimizer's own ``state_dict()`` and ``load_state_dict()`` are this interface's
`state_dict` and `load_state_dict`. Where the fused kernel keeps a piece's state as views of
one flat tensor per bucket, loaded values go straight into those views (`state_target`), and
`install` makes the runner adopt what was loaded.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from ..layout import Layout
from ..partition import MASTER_KEY, shard_state
from ..partition.lowbit_state import INT8_KEYS
from .validate import agree_or_raise

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
        """``opt``: an open `ZeroOptimizer`; read through its public parts (``opt.parts``,
        ``opt.scaler``, ``opt.param_groups``, ``opt.optimizer_class``)."""
        parts = opt.parts
        self._core, self._full, self._scaler = parts.core, parts.full, opt.scaler
        self._groups, self.optimizer_class = opt.param_groups, opt.optimizer_class
        self._runner = self._core.runner
        self._entries = list(self._runner.all_pieces())

    # ---- what the state is laid out over
    @property
    def layout(self):
        return self._core.layout

    @property
    def rank(self) -> int:
        return self._core.rank

    @property
    def world_size(self) -> int:
        return self._core.world_size

    @property
    def stage(self) -> int:
        return self._core.policy.stage

    @property
    def mode(self) -> str:
        return self._core.mode

    @property
    def group(self):
        return self._core.group

    @property
    def replica_index(self) -> int:
        """Which copy this rank holds (0: the first shard group, the one checkpoints write)."""
        return self._core.mesh.replica_index

    @property
    def n_replicas(self) -> int:
        """Copies of this state across shard groups (1 unless hierarchical)."""
        return self._core.mesh.n_replicas

    def params(self) -> dict[int, torch.Tensor]:
        """Every param by its layout index (frozen ones too)."""
        return dict(self._core.params)

    def trainable(self) -> list[int]:
        return sorted(self._core.trainable)

    def leaves(self) -> dict[int, torch.Tensor]:
        """Index -> the model's param (a tensor-parallel DTensor where ``params()`` holds its
        local tensor: [Note: tensor parallelism] in zero_kernels/optimizer/tensor_parallel.py)."""
        tp = self._core.tp
        return dict(self._core.params) if tp is None else tp.leaves(self._core.params)

    @property
    def tensor_parallel(self) -> dict | None:
        """With tensor parallelism: ``{"size", "rank", "placements": index -> [str]}`` (the tp
        mesh's size, this rank's place in it, each DTensor param's placements); else None."""
        tp = self._core.tp
        if tp is None:
            return None
        return {
            "size": tp.size,
            "rank": tp.rank,
            "placements": {i: [repr(x) for x in t.placements] for i, t in tp.by_index.items()},
        }

    def group_indices(self) -> list[list[int]]:
        """The layout indices of each param group's params."""
        return [list(x) for x in self._core.group_indices]

    @property
    def param_groups(self) -> list[dict]:
        return self._groups

    # ---- this rank's pieces
    def pieces(self, which=None) -> Iterator[Piece]:
        """Every piece of this rank, or those of indices ``which`` (in this order's numbering)."""
        for j in range(len(self._entries)) if which is None else which:
            _i, _k, pc, ip, _g = self._entries[j]
            st = self._runner.inner.state.get(ip) or {}
            yield Piece(pc.index, pc.offset, pc.numel, ip.detach().view(-1), tuple(ip.shape), st)

    def windows(self, read: bool = True, write: bool = True) -> list[tuple[list[int], object]]:
        """The pieces in groups, each ``(indices, context)``: inside ``context()`` that group's
        state is in RAM. Offloaded state comes one bucket per group, read in (``read``) and
        written back after (``write``), so that a reader streams it ([Note: streamed
        checkpoints] in `zero_kernels.checkpoint.save`); int8 moments read only (a save) as
        their codes and scales, never decoded (what a save writes). Else one group of every
        piece: under `ShardRunner.codes_resident` for an int8 save, `resident` otherwise (int8
        moments kept in RAM and written: decoded whole)."""
        r = self._runner
        if not r.streams(write):
            whole = r.codes_resident if r.int8 is not None and not write else self.resident
            return [(list(range(len(self._entries))), whole)]
        groups: dict[tuple[int, int], list[int]] = {}
        for j, (i, _k, pc, _ip, _g) in enumerate(self._entries):
            groups.setdefault((i, pc.bucket), []).append(j)
        return [(js, functools.partial(r.window, [key], read, write)) for key, js in groups.items()]

    def lowbit_format(self, j: int) -> dict | None:
        """How piece ``j``'s moments are stored where not fp32/bf16: ``{"dtype": "int8", "block":
        B, "origin": "piece"}`` (blocks of B from the piece's own first element, [Note: int8
        shard state]); None otherwise. The checkpoint's schema of low-bit state."""
        q, i = self._runner.int8, self._entries[j][0]
        if q is None or not self._runner.fused[i]:
            return None
        return {"dtype": "int8", "block": q.block, "origin": "piece"}

    def piece_codes(self) -> list[dict | None]:
        """Inside `resident`, int8 state: per piece (in `pieces` order) its codes and block
        scales (``exp_avg``, ``exp_avg_sq``, ``exp_avg_scale``, ``exp_avg_sq_scale``: views),
        every change to the decoded moments encoded first; None where a piece has no state or
        other moments."""
        r = self._runner
        if r.int8 is None:
            return [None] * len(self._entries)
        r.int8.flush()
        out = []
        for j, (i, k, pc, ip, _g) in enumerate(self._entries):
            st = r.inner.state.get(ip)
            if not st or "exp_avg" not in st or self.lowbit_format(j) is None:
                out.append(None)
                continue
            views = r.int8.piece_views(i, k, pc, self._lo(i, pc))
            out.append({n: views[n] for n in INT8_KEYS})
        return out

    def _lo(self, i: int, pc) -> int:
        return pc.start - self.layout.buffers[i].buckets[pc.bucket].shard_start(self.rank)

    def stochastic_round(self, j: int) -> bool:
        """Whether piece ``j``'s bf16 params are stepped without a master (fp32 state)."""
        return self._runner.sr[self._entries[j][0]]

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
        if r.fused[i] and key in _FUSED_KEYS:
            views = r.piece_flat_state(i, k)
            if key in views and views[key].dtype == dtype:  # else read, then cast in install
                return views[key]
        return torch.empty(pc.numel, dtype=dtype)

    def install(self, states: list, groups: list[dict], steps: int, scaler: dict) -> None:
        """Per piece (in `pieces` order) its loaded state ``{"elem": {key: flat}, "other":
        {...}}`` (int8 on this piece's blocks: also ``"codes"``, the saved codes and scales,
        ``elem`` their decode) or None (no state: it restarts), the param groups'
        hyper-parameters, the step counter and the scaler's saved state; then the params are
        made whole from the loaded values (collective). Inside `resident`; a streamed load
        calls `install_pieces` inside each of `windows` and `finish_install` after."""
        self.install_pieces(range(len(self._entries)), states)
        self.finish_install(groups, steps, scaler)

    @torch.no_grad()
    def install_pieces(self, which, states: list) -> None:
        """The loaded state of pieces ``which`` (see `install`), inside the window (or the
        `resident` context) holding them."""
        r = self._runner
        which = list(which)
        assert len(which) == len(states)
        buckets = set()
        for j, st in zip(which, states):
            i, k, pc, ip, _g = self._entries[j]
            buckets.add((i, pc.bucket))
            if st is not None and "codes" in st:  # int8 on the same blocks: taken as saved
                r.int8.take_piece(i, k, pc, self._lo(i, pc), st["codes"])
            if st is not None:
                r.inner.state[ip] = {
                    **{k: v.view(ip.shape) for k, v in st["elem"].items()},
                    **st["other"],
                }
                continue
            r.inner.state.pop(ip, None)
            r.restart_piece(i, k)
        r.adopt_state(buckets)

    def finish_install(self, groups: list[dict], steps: int, scaler: dict) -> None:
        """After every piece's `install_pieces`: the groups, the scaler, the step counter, and
        the params made whole from the loaded values (collective)."""
        c = self._core
        self._take_groups(groups)
        self._scaler.load_state_dict(scaler)
        c.steps.n = int(steps)
        self._full.refresh_params()

    def _take_groups(self, groups: list[dict]) -> None:
        for g, saved in zip(self._groups, groups):
            for k, v in saved.items():
                if k != "params":
                    g[k] = v
        self._runner.sync_hyper(self._groups)

    # ---- counters
    @property
    def steps(self) -> int:
        """The optimizer's step counter (names checkpoint folders; restored on resume)."""
        return int(self._core.steps.n)

    def scaler_state(self) -> dict:
        return self._scaler.state_dict()

    @contextlib.contextmanager
    def frozen_whole(self, write: bool = False):
        """shard_frozen ([Note: frozen shards]): inside, the frozen params sharded with their
        units are whole (the units holding them gathered, exact), for a checkpoint to read or
        write them as the module's own tensors; ``write``: their values taken back into the
        shards after (every rank wrote the same). Collective over the shard group; nothing
        without frozen shards. Holds every frozen param whole while inside."""
        c = self._core
        units = [u for u in c.units.all_units if u.frozen] if c.units is not None else []
        mine = []
        try:
            for u in units:
                if u.sharded:
                    mine.append(u)
                with c.runner.exact():
                    c.units.wait(u)
            yield
            if write and units:
                with c.runner.resident():
                    for u in units:
                        for i, b in sorted(u.frozen):
                            c.store.take_shard(i, b)
        finally:
            for u in mine:
                c.units.free(u)

    # ---- the optimizer's state_dict() and load_state_dict()
    def resident(self):
        """A context in which the optimizer state is in RAM (offloaded state read in, written
        back after; [Note: offload]): every read or write of `pieces`/`state_target`/`install`
        runs inside one."""
        return self._runner.resident()

    def state_dict(self) -> dict:
        """This rank's shard: the inner optimizer's state plus the layout needed to check it."""
        with self.resident():
            return self._state_dict()

    def _state_dict(self) -> dict:
        return {
            "zero": {
                "stage": self.stage,
                "mode": self.mode,
                "rank": self.rank,
                "world_size": self.world_size,
                "layout": self.layout.to_dict(),
                "loss_scale": self._scaler.scale,
                "growth_tracker": self._scaler.growth_tracker,
                # the fp32 masters of bf16/fp16 params (None per fp32/fp64 buffer)
                "masters": [None if m is None else m.clone() for m in self._runner.masters],
            },
            "inner": _own_entries(self._runner.inner.state_dict()),
            "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in self._groups],
        }

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a `state_dict` of this rank (same layout), or a full torch-format one
        (``consolidated_state_dict``, or a plain torch optimizer's) at any world size."""
        with self.resident():
            self._load_state_dict(state_dict)

    def _load_state_dict(self, state_dict: dict) -> None:
        # Every check that can fail on one rank alone (rank 0's shard loaded everywhere, the
        # DDP idiom) runs before any collective, and the ranks agree on the outcome: every rank
        # raises the same error at once instead of one raising while the others wait in the
        # params' all-gather for the timeout.
        try:
            apply, problem = self._plan_load(state_dict), None
        except Exception as e:  # any of them: the other ranks must hear of it
            apply, problem = None, f"{type(e).__name__}: {e}"
        agree_or_raise(problem, self._core.group, "load_state_dict")
        apply()

    def _plan_load(self, state_dict: dict):
        """Check ``state_dict`` against this rank's layout and build what loading it writes,
        touching nothing; returns the function that loads it (collective: the params are made
        whole from the loaded values). Raises on this rank alone: see `_load_state_dict`."""
        if not isinstance(state_dict, dict) or "param_groups" not in state_dict:
            raise ValueError(
                "load_state_dict: expected a dict with 'param_groups', got "
                f"{type(state_dict).__name__} with keys "
                f"{list(state_dict)[:5] if isinstance(state_dict, dict) else None}"
            )
        groups = state_dict["param_groups"]
        if len(groups) != len(self._groups):
            raise ValueError(
                f"load_state_dict: len(param_groups)={len(groups)} differs from "
                f"this optimizer's {len(self._groups)}"
            )
        inner = self._runner.inner
        if "zero" in state_dict:
            meta = state_dict["zero"]
            mine = Layout.from_dict(meta["layout"])
            if mine != self.layout or meta["rank"] != self.rank:
                what = (
                    layout_difference(mine, self.layout)
                    if mine != self.layout
                    else f"it is rank {meta['rank']}'s shard, this is rank {self.rank}"
                )
                raise ValueError(
                    "load_state_dict: shard saved at world_size="
                    f"{meta['world_size']} rank={meta['rank']} mode={meta['mode']} does not "
                    f"match this optimizer (world_size={self.world_size}, rank={self.rank}, "
                    f"mode={self.mode}): {what}; each rank loads the state_dict() it saved "
                    "itself: save with opt.consolidated_state_dict() (one file, any world "
                    "size) or zero_kernels.save_checkpoint (any layout) instead"
                )

            def apply() -> None:
                inner.load_state_dict(state_dict["inner"])
                self._runner.adopt_state()
                self._scaler.scale = float(meta.get("loss_scale", self._scaler.scale))
                self._scaler.growth_tracker = int(meta.get("growth_tracker", 0))
                saved = meta.get("masters")
                if saved is not None:
                    with torch.no_grad():
                        for m, v in zip(self._runner.masters, saved):
                            if m is not None and v is not None:
                                m.copy_(v)
                    self._full.refresh_params()
                self._take_groups(groups)

            return apply
        for g, mine in zip(groups, self._core.group_indices):
            if len(g["params"]) != len(mine):
                raise ValueError(
                    f"load_state_dict: a param group has {len(g['params'])} "
                    f"params, this optimizer's has {len(mine)}"
                )
        remap = {
            old: new
            for g, mine in zip(groups, self._core.group_indices)
            for old, new in zip(g["params"], mine)
        }
        full = {remap[int(k)]: v for k, v in state_dict["state"].items()}
        if self._core.tp is not None:  # whole tensors: this tp rank's part of each
            full = self._core.tp.local_state(full)
        st = shard_state(self.layout, self._runner, self.rank, full)
        inner_groups = []
        k = 0  # inner indices: enumeration order of the inner params
        for i, buf in enumerate(self.layout.buffers):
            ig = {key: v for key, v in groups[buf.group].items() if key != "params"}
            n = len(inner.param_groups[i]["params"])
            ig["params"] = list(range(k, k + n))
            k += n
            inner_groups.append(ig)
        masters = {j: s.pop(MASTER_KEY) for j, s in st.items() if MASTER_KEY in s}

        def apply() -> None:
            inner.load_state_dict({"state": st, "param_groups": inner_groups})
            self._runner.adopt_state()
            if masters:  # saved by consolidated_state_dict for bf16/fp16 params
                with torch.no_grad():
                    for j, (i, _, _, p, _) in enumerate(self._runner.all_pieces()):
                        if j in masters and self._runner.masters[i] is not None:
                            p.copy_(masters[j].to(p.dtype))
                self._full.refresh_params()
            self._take_groups(groups)

        return apply


def _own_entries(sd: dict) -> dict:
    """torch's ``state_dict()`` shares each param's state dict with the optimizer; offloaded
    moments are removed from those when `resident` ends, so the state dict gets its own."""
    sd["state"] = {k: dict(v) for k, v in sd["state"].items()}
    return sd


def layout_difference(saved: Layout, here: Layout) -> str:
    """What differs between a saved shard's layout and this optimizer's, in a few words."""
    if saved.world_size != here.world_size or saved.mode != here.mode:
        return "another world size or partition mode"
    if saved.frozen != here.frozen:
        return f"frozen params {list(saved.frozen)[:6]} saved, here {list(here.frozen)[:6]}"
    if len(saved.buffers) != len(here.buffers):
        return (
            f"{len(saved.buffers)} flat buffers saved, {len(here.buffers)} here (the param "
            "groups or the params' dtypes differ)"
        )
    for i, (a, b) in enumerate(zip(saved.buffers, here.buffers)):
        if (a.group, a.dtype) != (b.group, b.dtype):
            return (
                f"buffer {i} holds group {a.group} {a.dtype} saved, group {b.group} {b.dtype} here"
            )
        if [s.index for s in a.slots] != [s.index for s in b.slots]:
            return f"buffer {i} holds other params (the param groups or requires_grad differ)"
        if len(a.buckets) != len(b.buckets) or a.numel != b.numel:
            return (
                f"buffer {i} is cut in {len(a.buckets)} buckets of {a.numel} elements in all "
                f"saved, {len(b.buckets)} of {b.numel} here (a different bucket_size_mb, "
                "quantize_grads or align)"
            )
    if saved.align != here.align:
        return f"align {saved.align} saved, here {here.align}"
    return "the params' places in the buffers differ"
