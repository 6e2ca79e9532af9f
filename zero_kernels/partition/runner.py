"""The optimizer over this rank's shard: fp32 master shards, the inner torch optimizer, the step.

[Note: modes]
What the optimizer steps: for fp32 params, the rank's shard of each bucket *inside the param
buffer* (no master copy: the step updates the params in place and the all-gather input is
already there); for other dtypes, a separate fp32 master shard per flat buffer (every bucket's
shard, concatenated), copied (cast) into the param buffer after the step. Gradients are views of
`GradStore.shard` (never copies).

- ``flat``: the inner torch optimizer has one param group per flat buffer, holding one tensor per
  bucket (the bucket's shard, as above; its ``.grad`` the reduced gradient of the bucket): right
  for element-wise optimizers only. Adam/AdamW skip the inner step and run
  `zero_kernels.ops.adam_step` bucket by bucket (grad scale, update, copy-out into the
  low-precision param shard in one pass); their state stays in the inner optimizer's ``state``
  in torch's format.
- ``whole``: every parameter lies wholly in its owner's shard (see [Note: layout]); the inner
  optimizer sees, per flat buffer, shaped views of the master shard for the owned parameters,
  so per-tensor optimizers (Adafactor, Muon, LAMB-like) compute exactly the unsharded result.

After the step each bucket's updated shard (copied or cast from the master where there is one)
is all-gathered from the rank's slice of the flat param buffer, in the params' dtype, in place.
"""

from __future__ import annotations

import torch

from .. import comm
from ..buffers import GradStore, shard_view
from ..layout import Layout
from ..ops import AdamHyper, adam_step

__all__ = ["ShardRunner", "FUSED_ADAM_CLASSES"]

FUSED_ADAM_CLASSES = (torch.optim.Adam, torch.optim.AdamW)


class ShardRunner:
    def __init__(
        self,
        layout: Layout,
        flats: list[torch.Tensor],
        grads: GradStore,
        rank: int,
        optimizer_class,
        group_opts: list[dict],
        defaults: dict,
        *,
        fused: bool,
        backend: str = "auto",
    ):
        self.layout, self.flats, self.grads, self.rank = layout, flats, grads, rank
        self.optimizer_class = optimizer_class
        n = layout.world_size
        # fp32 master shard per flat buffer; None for fp32 params (see [Note: modes])
        self.masters: list[torch.Tensor | None] = []
        for i, buf in enumerate(layout.buffers):
            if flats[i].dtype == torch.float32:
                self.masters.append(None)
                continue
            m = torch.empty(buf.shard_numel(n), dtype=torch.float32, device=flats[i].device)
            for b in buf.buckets:
                src, dst = shard_view(flats[i], layout, buf, rank, b.index)
                m[dst].copy_(src)
            self.masters.append(m)
        # inner params per flat buffer: one per bucket (flat) or owned shaped views (whole)
        self.inner_params: list[list[torch.Tensor]] = []
        self.owned: list[list[int]] = []  # whole mode: param indices in inner order, per buffer
        for i, buf in enumerate(layout.buffers):
            if layout.mode == "flat":
                ps = []
                for b in buf.buckets:
                    p = self.master_view(i, b.index)
                    p.grad = grads.shard(i, b.index)
                    ps.append(p)
                self.inner_params.append(ps)
                self.owned.append([])
                continue
            views, owned = [], []
            for slot in buf.slots:
                if slot.owner != rank:
                    continue
                lo = slot.start - buf.buckets[slot.bucket].shard_start(rank)
                v = self.master_view(i, slot.bucket)[lo : lo + slot.numel].view(slot.shape)
                v.grad = grads.shard(i, slot.bucket)[lo : lo + slot.numel].view(slot.shape)
                views.append(v)
                owned.append(slot.index)
            self.inner_params.append(views)
            self.owned.append(owned)
        groups = [
            {**group_opts[buf.group], "params": self.inner_params[i]}
            for i, buf in enumerate(layout.buffers)
        ]
        self.inner = optimizer_class(groups, **defaults)
        self.fused = fused and layout.mode == "flat"
        self.backend = backend

    def master_view(self, i: int, b: int) -> torch.Tensor:
        """The fp32 values the optimizer steps for this rank's shard of bucket ``b`` of buffer
        ``i``: a view of the master shard, or of the param buffer itself for fp32 params."""
        buf = self.layout.buffers[i]
        dst, sl = shard_view(self.flats[i], self.layout, buf, self.rank, b)
        m = self.masters[i]
        return dst if m is None else m[sl]

    # ---------------------------------------------------------------- step
    def sync_hyper(self, user_groups: list[dict]) -> None:
        """Copy hyper-parameters (lr schedules, ...) from the user's groups into the inner ones."""
        for i, buf in enumerate(self.layout.buffers):
            g = self.inner.param_groups[i]
            for k, v in user_groups[buf.group].items():
                if k != "params":
                    g[k] = v

    def step(self, grad_scale: float, log: comm.CommLog, group) -> list[comm.Handle]:
        """One optimizer step on the shard; returns the all-gather handles of the new params."""
        handles: list[comm.Handle] = []
        if not self.fused:
            if grad_scale != 1.0:
                for t in self.grads.shard_tensors():
                    t.mul_(grad_scale)
            self.inner.step()
        for i, buf in enumerate(self.layout.buffers):
            m = self.masters[i]
            lowp = self.flats[i].dtype in (torch.bfloat16, torch.float16)
            g = self.inner.param_groups[i]
            for b in buf.buckets:
                dst, sl = shard_view(self.flats[i], self.layout, buf, self.rank, b.index)
                if self.fused:
                    p = self.inner_params[i][b.index]
                    hyper, st = self._adam_hyper(g, p, grad_scale)
                    adam_step(
                        p,
                        p.grad,
                        st["exp_avg"],
                        st["exp_avg_sq"],
                        hyper,
                        max_exp_avg_sq=st["max_exp_avg_sq"] if hyper.amsgrad else None,
                        out_lowp=dst if lowp else None,
                        backend=self.backend,
                    )
                if m is not None and not (self.fused and lowp):
                    dst.copy_(m[sl])
                handles.append(self._gather(i, b.index, log, group))
        return handles

    def _gather(self, i: int, b: int, log, group) -> comm.Handle:
        buf = self.layout.buffers[i]
        bk = buf.buckets[b]
        n = self.layout.world_size
        out = self.flats[i][bk.start : bk.start + bk.numel(n)]
        inp = self.flats[i][bk.shard_start(self.rank) : bk.shard_start(self.rank) + bk.shard_numel]
        return comm.all_gather(out, inp, group=group, log=log)

    def _adam_hyper(self, g: dict, master: torch.Tensor, grad_scale: float):
        """Torch Adam's state for ``master`` (created as torch does) and this step's scalars."""
        st = self.inner.state[master]
        amsgrad = bool(g.get("amsgrad", False))
        if len(st) == 0:
            st["step"] = torch.tensor(0.0, dtype=torch.float32)
            st["exp_avg"] = torch.zeros_like(master, memory_format=torch.preserve_format)
            st["exp_avg_sq"] = torch.zeros_like(master, memory_format=torch.preserve_format)
            if amsgrad:
                st["max_exp_avg_sq"] = torch.zeros_like(master)
        st["step"] += 1
        b1, b2 = (float(x) for x in g["betas"])
        adamw = (
            bool(g.get("decoupled_weight_decay", False))
            or self.optimizer_class is torch.optim.AdamW
        )
        hyper = AdamHyper(
            lr=float(g["lr"]),
            beta1=b1,
            beta2=b2,
            eps=float(g["eps"]),
            weight_decay=float(g["weight_decay"]),
            step=int(st["step"].item()),
            adamw=adamw,
            amsgrad=amsgrad,
            maximize=bool(g.get("maximize", False)),
            grad_scale=grad_scale,
        )
        return hyper, st

    # ---------------------------------------------------------------- accounting
    def state_bytes(self) -> int:
        tot = 0
        for st in self.inner.state.values():
            for v in st.values():
                if isinstance(v, torch.Tensor):
                    tot += v.numel() * v.element_size()
        return tot

    def master_bytes(self) -> int:
        """Bytes of separate fp32 master shards (0 for fp32 params: they are stepped in place)."""
        return sum(m.numel() * m.element_size() for m in self.masters if m is not None)
