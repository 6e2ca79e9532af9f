"""`ZeroOptimizer`'s state beyond the training loop: its checkpoint formats (the rank's shard,
torch's consolidated format) and collective access to whole params, grads and optimizer state
(as DeepSpeed's ``safe_get_full_fp32_param`` family). A mixin: it uses the optimizer's layout,
runner and gradient views and calls nothing but `zero_kernels.comm` for communication."""

from __future__ import annotations

import torch

from . import comm
from .layout import Layout
from .partition import MASTER_KEY, consolidate, local_payload, shard_state

__all__ = ["ShardStateAccess"]


class ShardStateAccess:
    """State dicts and full-state access of `ZeroOptimizer` (see the module docstring)."""

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        """This rank's shard: the inner optimizer's state plus the layout needed to check it."""
        return {
            "zero": {
                "stage": self.stage,
                "mode": self.mode,
                "rank": self.rank,
                "world_size": self.world_size,
                "layout": self.layout.to_dict(),
                "loss_scale": self.loss_scale,
                "growth_tracker": self._growth_tracker,
                # the fp32 masters of bf16/fp16 params (None per fp32/fp64 buffer)
                "masters": [None if m is None else m.clone() for m in self._runner.masters],
            },
            "inner": self._runner.inner.state_dict(),
            "param_groups": [
                {k: v for k, v in g.items() if k != "params"} for g in self.param_groups
            ],
        }

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a `state_dict` of this rank (same layout), or a full torch-format one
        (``consolidated_state_dict``, or a plain torch optimizer's) at any world size."""
        if not isinstance(state_dict, dict) or "param_groups" not in state_dict:
            raise ValueError(
                "load_state_dict: expected a dict with 'param_groups', got "
                f"{type(state_dict).__name__} with keys "
                f"{list(state_dict)[:5] if isinstance(state_dict, dict) else None}"
            )
        groups = state_dict["param_groups"]
        if len(groups) != len(self.param_groups):
            raise ValueError(
                f"load_state_dict: len(param_groups)={len(groups)} differs from "
                f"this optimizer's {len(self.param_groups)}"
            )
        inner = self._runner.inner
        if "zero" in state_dict:
            meta = state_dict["zero"]
            mine = Layout.from_dict(meta["layout"])
            if mine != self.layout or meta["rank"] != self.rank:
                raise ValueError(
                    "load_state_dict: shard saved at world_size="
                    f"{meta['world_size']} rank={meta['rank']} mode={meta['mode']} does not "
                    f"match this optimizer (world_size={self.world_size}, rank={self.rank}, "
                    f"mode={self.mode}); load a consolidated_state_dict() instead"
                )
            inner.load_state_dict(state_dict["inner"])
            self._runner.adopt_state()
            self.loss_scale = float(meta.get("loss_scale", self.loss_scale))
            self._growth_tracker = int(meta.get("growth_tracker", 0))
            saved = meta.get("masters")
            if saved is not None:
                with torch.no_grad():
                    for m, v in zip(self._runner.masters, saved):
                        if m is not None and v is not None:
                            m.copy_(v)
                self._refresh_params()
        else:
            for g, mine in zip(groups, self._group_indices):
                if len(g["params"]) != len(mine):
                    raise ValueError(
                        f"load_state_dict: a param group has {len(g['params'])} "
                        f"params, this optimizer's has {len(mine)}"
                    )
            remap = {
                old: new
                for g, mine in zip(groups, self._group_indices)
                for old, new in zip(g["params"], mine)
            }
            full = {remap[int(k)]: v for k, v in state_dict["state"].items()}
            st = shard_state(self.layout, self._runner, self.rank, full)
            inner_groups = []
            for i, buf in enumerate(self.layout.buffers):
                ig = {k: v for k, v in groups[buf.group].items() if k != "params"}
                ig["params"] = [id(p) for p in inner.param_groups[i]["params"]]
                inner_groups.append(ig)
            # inner indices: enumeration order of the inner params
            k = 0
            for ig in inner_groups:
                ig["params"] = list(range(k, k + len(ig["params"])))
                k += len(ig["params"])
            masters = {j: s.pop(MASTER_KEY) for j, s in st.items() if MASTER_KEY in s}
            inner.load_state_dict({"state": st, "param_groups": inner_groups})
            self._runner.adopt_state()
            if masters:  # saved by consolidated_state_dict for bf16/fp16 params
                with torch.no_grad():
                    for j, (i, _, _, p, _) in enumerate(self._runner.all_pieces()):
                        if j in masters and self._runner.masters[i] is not None:
                            p.copy_(masters[j].to(p.dtype))
                self._refresh_params()
        for g, saved in zip(self.param_groups, groups):
            for k, v in saved.items():
                if k != "params":
                    g[k] = v
        self._runner.sync_hyper(self.param_groups)

    def consolidated_state_dict(self, to: int = 0) -> dict | None:
        """On rank ``to``: the state dict of the unsharded ``optimizer_class`` (torch's format,
        loadable by it); None on the other ranks. Collective: call it on every rank."""
        if not 0 <= to < self.world_size:
            raise ValueError(f"to must be a rank in [0, {self.world_size}), got to={to!r}")
        self._check_open("consolidated_state_dict")
        comm.check_arrival(self._side, "ZeroOptimizer.consolidated_state_dict()", self.timeout)
        payload = local_payload(self.layout, self._runner, masters=True)
        got = comm.gather_object(payload, to, group=self.group)
        if self.rank != to:
            return None
        return consolidate(self.layout, got, self.param_groups, self._group_indices)

    @torch.no_grad()
    def _refresh_params(self) -> None:
        """After the stepped values (fp32 masters, or the params' own shard) were written from
        outside a step (checkpoint load, setters): copy them into the params' shards and, where
        params are whole (stages 1/2, or a stage-3 bucket gathered now), all-gather them.
        Collective."""
        self.wait_params()
        self._runner.write_params()
        handles = []
        for i, buf in enumerate(self.layout.buffers):
            for b in buf.buckets:
                if not self._store.sharded or (i, b.index) in self._store.live:
                    handles.append(self._runner.gather(i, b.index, self.comm_log, self.group))
        for h in handles:
            h.wait()

    # ------------------------------------------------------------------ full-state access
    def _index_of(self, param: torch.Tensor, what: str) -> int:
        for i, p in self._params.items():
            if p is param:
                if i not in self._trainable:
                    raise ValueError(f"{what}: param {self.layout_name(i)} is frozen")
                return i
        raise ValueError(
            f"{what}: the tensor of shape {tuple(param.shape)} is not a param of this optimizer"
        )

    def _gather_full(self, index: int, parts, dtype, what: str) -> torch.Tensor:
        """The whole tensor of param ``index`` from every rank's pieces ``parts`` (collective)."""
        comm.check_arrival(self._side, what, self.timeout)
        p = self._params[index]
        full = torch.zeros(p.numel(), dtype=dtype, device=self.device)
        for v, off in parts:
            full[off : off + v.numel()] = v.reshape(-1)
        comm.all_reduce(full, "sum", group=self.group)  # the pieces are disjoint
        return full.view(p.shape)

    def _piece_list(self, index: int, key: str | None):
        """``(tensor piece, offset)`` of this rank for param ``index``: the values stepped
        (key None) or the state entry ``key``."""
        out = []
        for _, _, pc, ip, _ in self._runner.all_pieces():
            if pc.index != index:
                continue
            if key is None:
                out.append((ip, pc.offset))
            else:
                st = self._runner.inner.state.get(ip, {})
                if key in st:
                    out.append((st[key], pc.offset))
        return out

    @torch.no_grad()
    def full_param(self, param: torch.Tensor) -> torch.Tensor:
        """The whole parameter at full precision: the fp32 master (bf16/fp16 params) or the
        param itself; a new tensor on every rank. Collective: call it on every rank."""
        self._check_open("full_param")
        i = self._index_of(param, "full_param")
        parts = self._piece_list(i, None)
        dt = torch.float64 if param.dtype == torch.float64 else torch.float32
        return self._gather_full(i, parts, dt, "ZeroOptimizer.full_param()")

    @torch.no_grad()
    def set_full_param(self, param: torch.Tensor, value: torch.Tensor) -> None:
        """Set the whole parameter (and its master) to ``value`` (the same on every rank)."""
        self._check_open("set_full_param")
        self.wait_params()
        i = self._index_of(param, "set_full_param")
        value = torch.as_tensor(value).to(self.device)
        if value.shape != param.shape:
            raise ValueError(f"set_full_param: {value.shape=} differs from {param.shape=}")
        flat = value.reshape(-1)
        for ip, off in self._piece_list(i, None):
            ip.copy_(flat[off : off + ip.numel()].view(ip.shape))
        self._runner.write_params()
        live = self._store.live
        if not self._store.sharded or any(  # whole here: stages 1/2, or gathered now
            (k, s.bucket) in live
            for k, b in enumerate(self.layout.buffers)
            for s in b.slots
            if s.index == i
        ):
            param.copy_(value)

    @torch.no_grad()
    def full_grad(self, param: torch.Tensor) -> torch.Tensor | None:
        """The whole averaged gradient (true units: loss scale removed, clipping applied), or
        None if the param has no gradient (on any rank). Collective: call it on every rank."""
        self._check_open("full_grad")
        i = self._index_of(param, "full_grad")
        self._finish_reduction()
        if i not in self._views.active:
            comm.check_arrival(self._side, "ZeroOptimizer.full_grad()", self.timeout)
            return None
        parts = [(v * self._grad_factor, off) for v, off in self._views.pieces_of(i)]
        buf = next(k for k, b in enumerate(self.layout.buffers) for s in b.slots if s.index == i)
        dt = self._grads.dtypes[buf]
        return self._gather_full(i, parts, dt, "ZeroOptimizer.full_grad()")

    @torch.no_grad()
    def set_full_grad(self, param: torch.Tensor, value: torch.Tensor | None) -> None:
        """Replace the param's gradient by ``value`` (the same on every rank), or drop it."""
        self._check_open("set_full_grad")
        self._index_of(param, "set_full_grad")
        self._finish_reduction()
        if value is not None and tuple(value.shape) != tuple(param.shape):
            raise ValueError(f"set_full_grad: {value.shape=} differs from {param.shape=}")
        param.grad = None if value is None else value.to(param.dtype)
        self._sync_user_changes()

    @torch.no_grad()
    def full_state(self, param: torch.Tensor) -> dict:
        """The param's optimizer state in the unsharded torch optimizer's format (element-wise
        entries whole, per-tensor ones as they are); {} before its first step. Collective."""
        self._check_open("full_state")
        i = self._index_of(param, "full_state")
        payload = [d for d in local_payload(self.layout, self._runner)]
        mine = [d.get(i) for d in payload if i in d]
        got = comm.all_gather_object(mine[0] if mine else None, group=self.group)
        parts = [g for g in got if g is not None]
        out: dict = {}
        if not parts:
            return out
        for key, v in parts[0]["elem"].items():
            full = torch.zeros(param.numel(), dtype=v.dtype, device=self.device)
            for part in parts:
                full[part["offset"] : part["offset"] + part["numel"]] = part["elem"][key]
            out[key] = full.view(param.shape)
        out.update(parts[0]["other"])
        return out

    @torch.no_grad()
    def set_full_state(self, param: torch.Tensor, key: str, value) -> None:
        """Set one entry of the param's optimizer state (after its first step); ``value`` is
        whole for element-wise entries (each rank keeps its piece), else set as is."""
        self._check_open("set_full_state")
        i = self._index_of(param, "set_full_state")
        found = False
        for _, _, pc, ip, _ in self._runner.all_pieces():
            if pc.index != i:
                continue
            st = self._runner.inner.state.get(ip)
            if not st or key not in st:
                raise KeyError(f"set_full_state: param has no state entry {key!r} yet")
            cur = st[key]
            if isinstance(cur, torch.Tensor) and tuple(cur.shape) == tuple(ip.shape):
                flat = torch.as_tensor(value).reshape(-1)
                cur.copy_(flat[pc.offset : pc.offset + pc.numel].view(cur.shape))
            elif isinstance(cur, torch.Tensor):
                cur.copy_(torch.as_tensor(value))
            else:
                st[key] = value
            found = True
        del found
