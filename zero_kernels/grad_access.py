"""`ZeroOptimizer`'s gradients as torch sees them (see [Note: gradients] in
`zero_kernels.partition.grads`) and its uneven-input support (``torch.distributed.algorithms
.Join``). A mixin of `zero_kernels.optimizer.ZeroOptimizer`."""

from __future__ import annotations

import torch
from torch.distributed.algorithms.join import JoinHook

from . import comm

__all__ = ["GradAccess"]


class _JoinHook(JoinHook):
    """What a rank that ran out of inputs does while the others still train: it contributes
    zero gradients to their reductions and steps its shard with the average, so its collectives
    match theirs (one synchronising backward and one step per iteration)."""

    def __init__(self, opt):
        self.opt = opt

    def main_hook(self) -> None:
        self.opt._shadow_iteration()


class GradAccess:
    """The gradient views' bookkeeping and Join (see the module doc)."""

    # ------------------------------------------------------------------ gradients
    def _on_backward_start(self) -> None:
        """First grad of a backward pass: take user changes, make the store accumulate in
        loss-scaled units, and take the views off the params so autograd writes fresh grads.
        Inside a ``Join`` context, a synchronising pass first tells it this rank still trains."""
        if self._reducer.sync or self.stage == 2:
            self._join_active = comm.join_notify(self)
        self._sync_user_changes()
        ls = 1.0 / self.loss_scale
        if self._views.active and self._grad_factor != ls:
            self._scale_store(self._grad_factor * self.loss_scale)
        self._grad_factor = ls
        self._views.detach_all(self._trainable)

    def _publish(self) -> None:
        """End of a reduction: which params have a gradient on any rank, and their views."""
        if self._scheduler is not None:  # stage 3: units of the forward left behind
            self._scheduler.finish_backward()
        if self._scheduler is not None and self._scheduler.check is not None:
            # stage 3: every rank launched the same collectives in this backward, checked
            # before anything else goes through the main group (a difference may have left
            # it out of step)
            self._scheduler.check.end_pass("backward")
        idx = sorted(self._trainable)
        pos = {k: j for j, k in enumerate(idx)}
        local = self._views.active | self._reducer.got
        on_host = self._sync_free and self._side is not None  # host knowledge, reduced there
        mask = torch.zeros(len(idx), dtype=torch.uint8, device="cpu" if on_host else self.device)
        if local:
            mask[[pos[k] for k in local]] = 1
        what = "backward: which params have gradients"
        self._all_reduce(mask, "max", what, group=self._side if on_host else None)
        self._views.active = {idx[j] for j in mask.nonzero().flatten().tolist()}
        self._reducer.got.clear()
        self._views.install(self._trainable)
        if self._scheduler is not None:
            self._scheduler.end_backward()

    def _sync_user_changes(self) -> None:
        """Apply what the user did to ``p.grad`` since the views were installed."""
        cleared, replaced = self._views.user_changes(self._trainable)
        if not cleared and not replaced:
            return
        views = self._views
        if cleared and cleared >= views.active and not replaced:
            self._reset_grads()  # model.zero_grad(): the same as ours
            return
        for i in cleared:
            for v, _ in views.pieces_of(i):
                v.zero_()
            views.active.discard(i)
        for i, g in replaced.items():
            flat = g.detach().reshape(-1)
            for v, off in views.pieces_of(i):
                v.copy_(flat[off : off + v.numel()].to(v.dtype) / self._grad_factor)
            views.active.add(i)
        views.install(self._trainable)

    def _scale_store(self, c: float) -> None:
        if c != 1.0:
            for t in self._grads.shard_tensors():
                t.mul_(c)

    def _apply_grad_factor(self) -> None:
        """Make the reduced store hold true gradients (what ``p.grad`` shows)."""
        self._finish_reduction()
        self._scale_store(self._grad_factor)
        self._grad_factor = 1.0

    def _reset_grads(self) -> None:
        self._reducer.zero_grad()
        self._views.active.clear()
        self._views.detach_all(self._trainable)
        self._grad_factor = 1.0 / self.loss_scale
        self._overflow = None

    # ------------------------------------------------------------------ uneven inputs (Join)
    def join_hook(self, **kwargs) -> JoinHook:
        """For ``torch.distributed.algorithms.Join([opt])`` (as ZeroRedundancyOptimizer): a rank
        out of inputs shadows the others' iterations, each one synchronising backward and one
        ``step``; gradient averages count it as zeros (DDP's default under Join)."""
        return _JoinHook(self)

    @property
    def join_device(self) -> torch.device:
        return self.device

    @property
    def join_process_group(self):
        return comm.group_or_world(self.group)

    def _shadow_iteration(self) -> None:
        self._reset_grads()
        self._reducer.finish()  # every bucket reduced with zeros; the gradient mask
        self.step()

    def _check_not_joined(self, what: str) -> None:
        if self._join_active is not None and self._join_active < self.world_size:
            raise RuntimeError(
                f"{what} after a rank ran out of inputs under Join: the joined rank shadows only "
                "one backward and one step per iteration, so this collective has no partner; "
                "clip only while every rank has inputs (or pad the inputs to equal length)"
            )
