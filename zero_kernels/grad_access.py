"""`ZeroOptimizer`'s gradients as torch sees them (see [Note: gradients] in
`zero_kernels.partition.grads`) and its uneven-input support (``torch.distributed.algorithms
.Join``). A mixin of `zero_kernels.optimizer.ZeroOptimizer`."""

from __future__ import annotations

import torch
from torch.distributed.algorithms.join import JoinHook
from torch.utils._pytree import tree_flatten

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

    def post_hook(self, is_last_joiner: bool) -> None:
        self.opt._join_input = None  # the Join context ends on every rank
        self.opt._join_active = None


class GradAccess:
    """The gradient views' bookkeeping and Join (see the module doc)."""

    # ------------------------------------------------------------------ gradients
    def _on_backward_start(self) -> None:
        """First grad of a backward pass: take user changes, make the store accumulate in
        loss-scaled units, and take the views off the params so autograd writes fresh grads.
        Inside a ``Join`` context, a synchronising pass first tells it this rank still trains."""
        shard = self.policy.shard  # stage 3 tells Join in its forward (`_forward_start`)
        if shard.params and (self._reducer.sync or not shard.grads):
            self._join_active = comm.join_notify(self)
            if not self._reducer.sync:  # stage 2 reduces (and a joined rank steps) each time
                self._check_not_joined("gradient accumulation (no_sync)")
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

    def _reset_grads(self, keep: bool = False) -> None:
        """Zero the gradient store. ``keep`` (``zero_grad(set_to_none=False)``): the params
        with a gradient (the same on every rank) keep it, zero, and stay in the next step;
        else none has one (``p.grad = None``)."""
        if keep:
            self._sync_user_changes()  # a p.grad the user cleared or replaced since
        kept = set(self._views.active) if keep else set()
        self._reducer.zero_grad()
        self._views.active.clear()
        self._views.detach_all(self._trainable)
        if kept:
            self._views.active.update(kept)
            self._views.install(self._trainable)
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

    def _forward_start(self, args: tuple, kwargs: dict) -> None:
        """Stage 3, a forward begins: inside a ``Join`` context, tell it this rank still trains
        (before the forward's all-gathers, which a joined rank shadows after that all-reduce)
        and keep the inputs, which this rank's shadow iterations run again once it joins."""
        if self._shadowing:
            return
        if not torch.is_grad_enabled():  # its all-gathers have no partner on a joined rank
            self._check_not_joined("a forward without gradients at stage 3")
            return
        if self._join_config.enable:
            self._join_input = (args, kwargs)
        self._join_active = comm.join_notify(self)
        if not self._reducer.sync:  # a joined rank steps after each shadowed backward
            self._check_not_joined("gradient accumulation (no_sync)")

    def _shadow_iteration(self) -> None:
        self._reset_grads()
        if not self.policy.shard.params:
            self._shadow_stage3()
        else:
            self._reducer.finish()  # every bucket reduced with zeros; the gradient mask
        self.step()

    def _shadow_stage3(self) -> None:
        """Stage 3: a joined rank's part of the others' forward and backward: the model run
        again on this rank's last inputs, backward with zero output gradients (so its
        gradients count as zeros in the averages, DDP's default under Join), which launches the
        same all-gathers and reduce-scatters as a training forward and backward."""
        if self._join_input is None:
            raise RuntimeError(
                "ZeroOptimizer stage 3 under Join: this rank ran out of inputs before its first "
                "forward in the Join context, so it has no input to shadow the others' "
                "forwards with (their all-gathers need a partner); give every rank at least "
                "one batch"
            )
        args, kwargs = self._join_input
        # the shadow leaves no trace on this rank: buffers (BatchNorm's running statistics)
        # and random state are as before it, as on a joined DDP rank that runs no forward
        saved = [(b, b.detach().clone()) for b in self._module.buffers()]
        cuda = [self.device.index or 0] if self.device.type == "cuda" else []
        self._shadowing = True
        try:
            with torch.random.fork_rng(devices=cuda), torch.enable_grad():
                out = self._module(*args, **kwargs)
                ts = [
                    t
                    for t in tree_flatten(out)[0]
                    if isinstance(t, torch.Tensor) and t.requires_grad
                ]
                if ts:
                    torch.autograd.backward(ts, [torch.zeros_like(t) for t in ts])
        finally:
            self._shadowing = False
            with torch.no_grad():
                for b, v in saved:
                    b.copy_(v)

    def _check_not_joined(self, what: str) -> None:
        if self._join_active is not None and self._join_active < self.world_size:
            raise RuntimeError(
                f"{what} after a rank ran out of inputs under Join: the joined rank shadows only "
                "one forward (stage 3), one backward and one step per iteration, so this has no "
                "partner there or would step its shard more often than the others'; do it only "
                "while every rank has inputs (or pad the inputs to equal length)"
            )
