"""`FullState`, a part of `ZeroOptimizer` ([Note: parts]): collective access to whole params,
grads and optimizer state (as DeepSpeed's ``safe_get_full_fp32_param`` family), torch's
consolidated state dict, and the refresh of the params from the stepped values after they were
written from outside a step. It reads the `Core`'s layout and runner, the gradient part's views
and calls nothing but `zero_kernels.comm` for communication."""

from __future__ import annotations

import torch

from .. import comm
from ..partition import consolidate, local_payload
from .core import Core

__all__ = ["FullState"]


class FullState:
    """Whole-tensor access over the `Core`, the gradient part ``grads``
    (`zero_kernels.optimizer.grad_access.GradContract`) and the param part ``params``
    (`zero_kernels.optimizer.param_access.ParamAccess`); ``param_groups`` returns the
    optimizer's."""

    def __init__(self, core: Core, grads, params, param_groups):
        self.core, self.grads, self.params, self.param_groups = core, grads, params, param_groups

    def consolidated_state_dict(self, to: int = 0) -> dict | None:
        """On rank ``to``: the state dict of the unsharded ``optimizer_class`` (torch's format,
        loadable by it; its tensors on the host: every rank's pieces travel as host copies,
        `zero_kernels.partition.state.to_host`); None on the other ranks. Collective: call it
        on every rank. With tensor parallelism: on every rank whose dp rank is ``to`` (one per
        tp rank), each entry of a DTensor param gathered over dp and then over tp to its whole
        shape (the param's global one, as `full_state` gives it)."""
        core = self.core
        if not 0 <= to < core.dp_size:
            raise ValueError(f"to must be a rank in [0, {core.dp_size}), got to={to!r}")
        comm.check_arrival(core.side, "ZeroOptimizer.consolidated_state_dict()", core.timeout)
        mesh = core.mesh
        # the pieces of one shard group make the whole state: that of rank ``to``
        holders = next(rs for rs in mesh.shard_ranks if to in rs)
        out = None
        if core.dp_rank in holders:
            payload = local_payload(core.layout, core.runner, masters=True)
            got = comm.gather_object(payload, holders.index(to), group=core.shard_group)
            if core.dp_rank == to:
                out = consolidate(core.layout, got, self.param_groups(), core.group_indices)
        # tensor parallelism: the local tensors' entries made whole over tp (collective)
        return out if core.tp is None else core.tp.whole_state(out)

    @torch.no_grad()
    def refresh_params(self) -> None:
        """After the stepped values (fp32 masters, or the params' own shard) were written from
        outside a step (checkpoint load, setters): copy them into the params' shards and, where
        params are whole (stages 1/2, or a stage-3 bucket gathered now), all-gather them.
        Collective."""
        self.params.wait()
        self.core.runner.write_params()
        handles, c = [], self.core
        with c.runner.exact():  # whole params handed back: never quantized
            for i, buf in enumerate(c.layout.buffers):
                for b in buf.buckets:
                    if not c.store.sharded or (i, b.index) in c.store.live:
                        handles.append(c.runner.gather(i, b.index, c.comm_log, c.shard_group))
        for h in handles:
            h.wait()

    # ------------------------------------------------------------------ full-state access
    def _gather_full(self, index: int, parts, dtype, what: str) -> torch.Tensor:
        """The whole tensor of param ``index`` from every rank's pieces ``parts`` (collective)."""
        comm.check_arrival(self.core.side, what, self.core.timeout)
        p = self.core.params[index]
        full = torch.zeros(p.numel(), dtype=dtype, device=self.core.device)
        for v, off in parts:
            full[off : off + v.numel()] = v.reshape(-1)
        comm.all_reduce(full, "sum", group=self.core.shard_group)  # the pieces are disjoint
        return full.view(p.shape)

    def _piece_list(self, index: int, key: str | None):
        """``(tensor piece, offset)`` of this rank for param ``index``: the values stepped
        (key None) or the state entry ``key``."""
        out = []
        for _, _, pc, ip, _ in self.core.runner.all_pieces():
            if pc.index != index:
                continue
            if key is None:
                out.append((ip, pc.offset))
            else:
                st = self.core.runner.inner.state.get(ip, {})
                if key in st:
                    out.append((st[key], pc.offset))
        return out

    @torch.no_grad()
    def full_param(self, param: torch.Tensor) -> torch.Tensor:
        """The whole parameter at full precision: the fp32 master (bf16/fp16 params) or the
        param itself; a new tensor on every rank. Collective: call it on every rank."""
        i = self.core.index_of(param, "full_param")
        dt = torch.float64 if param.dtype == torch.float64 else torch.float32
        with self.core.runner.resident():  # offloaded param shards: read in
            parts = self._piece_list(i, None)
            return self._whole(i, self._gather_full(i, parts, dt, "ZeroOptimizer.full_param()"))

    def _whole(self, index: int, t: torch.Tensor) -> torch.Tensor:
        """Tensor parallelism: ``t`` (param ``index``'s local shape) whole over tp too."""
        return t if self.core.tp is None else self.core.tp.whole(index, t)

    @torch.no_grad()
    def set_full_param(self, param: torch.Tensor, value: torch.Tensor) -> None:
        """Set the whole parameter (and its master) to ``value`` (the same on every rank)."""
        self.params.wait()
        i = self.core.index_of(param, "set_full_param")
        value = torch.as_tensor(value).to(self.core.device)
        if value.shape != param.shape:
            raise ValueError(f"set_full_param: {value.shape=} differs from {param.shape=}")
        if self.core.tp is not None:  # a DTensor param: its local tensor takes its part
            value = self.core.tp.local_part(i, value)
            param = self.core.params[i]
        flat = value.reshape(-1)
        with self.core.runner.resident():  # offloaded param shards: read in, written back
            for ip, off in self._piece_list(i, None):
                ip.copy_(flat[off : off + ip.numel()].view(ip.shape))
            self.core.runner.write_params()
        live = self.core.store.live
        if not self.core.store.sharded or any(  # whole here: stages 1/2, or gathered now
            (k, s.bucket) in live
            for k, b in enumerate(self.core.layout.buffers)
            for s in b.slots
            if s.index == i
        ):
            param.copy_(value)

    @torch.no_grad()
    def full_grad(self, param: torch.Tensor) -> torch.Tensor | None:
        """The whole averaged gradient (true units: loss scale removed, clipping applied), or
        None if the param has no gradient (on any rank). Collective: call it on every rank."""
        i = self.core.index_of(param, "full_grad")
        self.grads.finish_reduction()
        if i not in self.grads.views.active:
            comm.check_arrival(self.core.side, "ZeroOptimizer.full_grad()", self.core.timeout)
            return None
        parts = [(v * self.grads.factor, off) for v, off in self.grads.views.pieces_of(i)]
        buf = next(
            k for k, b in enumerate(self.core.layout.buffers) for s in b.slots if s.index == i
        )
        dt = self.core.grads.dtypes[buf]
        return self._whole(i, self._gather_full(i, parts, dt, "ZeroOptimizer.full_grad()"))

    @torch.no_grad()
    def set_full_grad(self, param: torch.Tensor, value: torch.Tensor | None) -> None:
        """Replace the param's gradient by ``value`` (the same on every rank), or drop it."""
        i = self.core.index_of(param, "set_full_grad")
        self.grads.finish_reduction()
        if value is not None and tuple(value.shape) != tuple(param.shape):
            raise ValueError(f"set_full_grad: {value.shape=} differs from {param.shape=}")
        if value is not None and self.core.tp is not None:  # a DTensor param: its part
            value = self.core.tp.as_grad(i, self.core.tp.local_part(i, value.to(param.dtype)))
        param.grad = None if value is None else value.to(param.dtype)
        self.grads.sync_user_changes()

    @torch.no_grad()
    def full_state(self, param: torch.Tensor) -> dict:
        """The param's optimizer state in the unsharded torch optimizer's format (element-wise
        entries whole, per-tensor ones as they are); {} before its first step. Collective."""
        i = self.core.index_of(param, "full_state")
        payload = [d for d in local_payload(self.core.layout, self.core.runner)]
        mine = [d.get(i) for d in payload if i in d]
        got = comm.all_gather_object(mine[0] if mine else None, group=self.core.shard_group)
        parts = [g for g in got if g is not None]
        out: dict = {}
        if not parts:
            return out
        local = self.core.params[i]  # tensor parallelism: the local tensor, made whole after
        for key, v in parts[0]["elem"].items():
            full = torch.zeros(local.numel(), dtype=v.dtype, device=self.core.device)
            for part in parts:
                full[part["offset"] : part["offset"] + part["numel"]] = part["elem"][key]
            out[key] = self._whole(i, full.view(local.shape))
        out.update(parts[0]["other"])
        return out

    @torch.no_grad()
    def set_full_state(self, param: torch.Tensor, key: str, value) -> None:
        """Set one entry of the param's optimizer state (after its first step); ``value`` is
        whole for element-wise entries (each rank keeps its piece), else set as is."""
        i = self.core.index_of(param, "set_full_state")
        found = False
        with self.core.runner.resident():  # offloaded moments: read in, written back
            for _, _, pc, ip, _ in self.core.runner.all_pieces():
                if pc.index != i:
                    continue
                st = self.core.runner.inner.state.get(ip)
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
