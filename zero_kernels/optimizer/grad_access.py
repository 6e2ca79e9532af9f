"""`GradContract`, a part of `ZeroOptimizer` ([Note: parts]): its gradients as torch sees
them (``p.grad`` a `ShardedGrad`, see [Note: gradients] in `zero_kernels.partition.grads`), the
factor between the gradient store and the true gradients (loss scale, clipping), and the checks
of the reduced gradients before a step: non-finite values and the global norm
(`clip_grad_norm_`), host-side on the CPU, device-side elsewhere ([Note: no host sync])."""

from __future__ import annotations

import logging
import math

import torch

from ..partition.grads import GradViews
from ..partition.syncfree import (
    Deferred,
    any_nonfinite,
    clip_coefficient,
    nonfinite_flag,
    norm_on_device,
)
from .core import Core

__all__ = ["GradContract"]

log = logging.getLogger("zero_kernels")


class GradContract:
    """The gradient contract with torch over the `Core` (see the module doc).

    Owns: ``views`` (the `GradViews`: which params have a gradient, their `ShardedGrad`s),
    ``factor`` (the store times it is the true gradient), ``overflow`` (this step's verdict on
    non-finite gradients: None until checked), ``local_nonfinite`` (this rank saw inf/NaN,
    nonfinite="step") and the non-finite counters. Reads the loss ``scaler`` and asks ``join``
    (`zero_kernels.optimizer.join.JoinState`) whether a rank has run out of inputs."""

    def __init__(self, core: Core, scaler, join, nonfinite: str):
        self.core, self.scaler, self.join, self.nonfinite = core, scaler, join, nonfinite
        self.views = GradViews(self, core.device, core.shard_group, core.comm_log)
        if core.tp is not None:  # close(): no DTensor .grad over a closed optimizer's views
            self.views.on_close = core.tp.drop_grads
        for _i, _, pc, _, g in core.runner.all_pieces():
            self.views.by_index.setdefault(pc.index, []).append((g.reshape(-1), pc.offset))
        self.factor = 1.0 / scaler.scale
        self.overflow: bool | None = None
        self.local_nonfinite = False
        self.nonfinite_host = 0
        self._nonfinite_dev: torch.Tensor | None = None  # device counter (sync-free mode)
        self.deferred = Deferred()  # per-step non-finite flags, read when ready
        self.said_nonfinite = False

    @property
    def sync_free(self) -> bool:
        return self.core.sync_free

    def check_not_joined(self, what: str) -> None:
        self.join.check_not_joined(what)

    # ------------------------------------------------------------------ gradients
    def on_backward_start(self) -> None:
        """First grad of a backward pass: take user changes, make the store accumulate in
        loss-scaled units, and take the views off the params so autograd writes fresh grads.
        Inside a ``Join`` context, a synchronising pass first tells it this rank still trains."""
        self.core.phase.enter_backward()
        self.views.changed()  # the store accumulates: [Note: one collective per clip]
        shard = self.core.policy.shard  # stage 3: Join is told in the forward
        if shard.params and (self.core.reducer.sync or not shard.grads):
            self.join.notify_backward()
            if not self.core.reducer.sync:  # stage 2 reduces (and a joined rank steps) each time
                self.join.check_not_joined("gradient accumulation (no_sync)")
        self.sync_user_changes()
        ls = 1.0 / self.scaler.scale
        if self.views.active and self.factor != ls:
            self.scale_store(self.factor * self.scaler.scale)
        self.factor = ls
        self._detach_all()

    def publish(self) -> None:
        """End of a reduction: which params have a gradient on any rank, and their views."""
        if self.core.units is not None:  # stage 3: units of the forward left behind
            self.core.units.finish_backward()
        if self.core.units is not None and self.core.units.check is not None:
            # stage 3: every rank launched the same collectives in this backward, checked
            # before anything else goes through the main group (a difference may have left
            # it out of step)
            self.core.units.check.end_pass("backward")
        idx = sorted(self.core.trainable)
        pos = {k: j for j, k in enumerate(idx)}
        local = self.views.active | self.core.reducer.got
        on_host = (
            self.core.sync_free and self.core.side is not None
        )  # host knowledge, reduced there
        mask = torch.zeros(
            len(idx), dtype=torch.uint8, device="cpu" if on_host else self.core.device
        )
        if local:
            mask[[pos[k] for k in local]] = 1
        what = "backward: which params have gradients"
        self.core.all_reduce(mask, "max", what, group=self.core.side if on_host else None)
        self.views.active = {idx[j] for j in mask.nonzero().flatten().tolist()}
        self.views.changed()  # new gradients: [Note: one collective per clip]
        self.core.reducer.got.clear()
        self._install()
        if self.core.units is not None:
            self.core.units.end_backward()

    def sync_user_changes(self, of: int | None = None) -> None:
        """Apply what the user did to ``p.grad`` since the views were installed. ``of``: for an
        operation on the ShardedGrad of param ``of``, which needs only its own: where that one
        is in place, the others' changes wait for the next full call (backward, step,
        zero_grad, a norm computed anew); checking every param at every such operation made
        torch's clip cost O(params**2) on the host."""
        if of is not None and self.views.in_place(of):
            return
        if self.core.tp is not None:  # the DTensor params' .grad into their local ones
            self.core.tp.take_user_grads()
        cleared, replaced = self.views.user_changes(self.core.trainable)
        if not cleared and not replaced:
            return
        views = self.views
        views.changed()  # the user's gradients: [Note: one collective per clip]
        if cleared and cleared >= views.active and not replaced:
            self.reset()  # model.zero_grad(): the same as ours
            return
        for i in cleared:
            for v, _ in views.pieces_of(i):
                v.zero_()
            views.active.discard(i)
        for i, g in replaced.items():
            flat = g.detach().reshape(-1)
            for v, off in views.pieces_of(i):
                v.copy_(flat[off : off + v.numel()].to(v.dtype) / self.factor)
            views.active.add(i)
        self._install()

    def _install(self) -> None:
        """The views on the params (``p.grad``); a DTensor param's wraps its local one's."""
        self.views.install(self.core.trainable)
        if self.core.tp is not None:
            self.core.tp.publish_grads()

    def _detach_all(self) -> None:
        self.views.detach_all(self.core.trainable)
        if self.core.tp is not None:
            self.core.tp.drop_grads()

    def scale_store(self, c: float) -> None:
        if c != 1.0:
            for t in self.core.grads.shard_tensors():
                t.mul_(c)

    def apply_factor(self, of: int | None = None) -> None:
        """Make the reduced store hold true gradients (what ``p.grad`` shows); ``of``: see
        `sync_user_changes`."""
        self.finish_reduction(of)
        self.scale_store(self.factor)
        self.factor = 1.0

    def reset(self, keep: bool = False) -> None:
        """Zero the gradient store. ``keep`` (``zero_grad(set_to_none=False)``): the params
        with a gradient (the same on every rank) keep it, zero, and stay in the next step;
        else none has one (``p.grad = None``)."""
        if keep:
            self.sync_user_changes()  # a p.grad the user cleared or replaced since
        kept = set(self.views.active) if keep else set()
        self.views.changed()  # [Note: one collective per clip]
        self.core.reducer.zero_grad()
        self.views.active.clear()
        self._detach_all()
        if kept:
            self.views.active.update(kept)
            self._install()
        self.factor = 1.0 / self.scaler.scale
        self.overflow = None

    def finish_reduction(self, of: int | None = None) -> None:
        self.core.reducer.flush()
        self.sync_user_changes(of)
        if self.overflow is not None:
            return
        scaled = self.scaler.active
        if scaled or self.nonfinite != "step":
            # the verdict on the device, agreed by every rank, read once: the step's one host
            # read ([Note: no host sync]; a read per shard synchronised once per shard)
            bad = any_nonfinite(self.core.grads.shard_tensors(), self.core.device).reshape(1)
            self.core.all_reduce(bad, "max", "step: non-finite check")
            if self.core.tp is not None:  # a tp rank's slice: every rank skips alike
                self.core.tp.reduce(bad, "max")
            self.overflow = bool(bad.item() != 0)
        elif self.core.sync_free:  # counted on the device, logged once the value is ready
            self.overflow = False
            flag = nonfinite_flag(self.core.grads.shard_tensors(), self.core.device)
            if self._nonfinite_dev is None:
                self._nonfinite_dev = torch.zeros((), dtype=torch.float32, device=self.core.device)
            self._nonfinite_dev.add_(flag)
            if not self.said_nonfinite:
                self.deferred.put(self.core.steps.n, flag)
        else:  # torch's behaviour: step anyway; `step` counts it (one cheap pass per shard)
            self.overflow = False
            self.local_nonfinite = not all(
                bool(torch.isfinite(g.sum())) for g in self.core.grads.shard_tensors()
            )

    @torch.no_grad()
    def clip_grad_norm_(
        self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False
    ) -> torch.Tensor:
        """Clip the (reduced, unscaled) gradients to ``max_norm``; returns the global norm,
        exactly as ``torch.nn.utils.clip_grad_norm_`` on the unsharded model."""
        self.join.check_not_joined("clip_grad_norm_")
        self.views.changed()  # its factor or in-place scaling: [Note: one collective per clip]
        norm_type = float(norm_type)
        if norm_type < 0 or math.isnan(norm_type):
            raise ValueError(f"norm_type must be >= 0 or inf, got norm_type={norm_type!r}")
        self.finish_reduction()
        shards = self.core.grads.shard_tensors()
        if self.core.sync_free:
            return self._clip_on_device(shards, float(max_norm), norm_type, error_if_nonfinite)
        t = self._reduce_norm(
            norm_on_device(self._counted(shards), norm_type, self.core.device), norm_type
        )
        total = float(t.item())
        if norm_type != 0 and not math.isinf(norm_type):
            total **= 1.0 / norm_type
        total *= abs(self.factor)
        if error_if_nonfinite and not math.isfinite(total):
            raise RuntimeError(
                f"clip_grad_norm_: the total norm of order {norm_type} is "
                f"non-finite ({total}), error_if_nonfinite=True"
            )
        out = torch.tensor(total, dtype=torch.float32)
        coef = float(max_norm) / (float(out) + 1e-6)
        self.factor *= coef if math.isnan(coef) else min(coef, 1.0)  # torch: clamp(coef, max=1)
        return out

    def _reduce_norm(self, t: torch.Tensor, norm_type: float) -> torch.Tensor:
        """This rank's part ``t`` of the global norm (`norm_on_device`) combined over the shard
        group by one all-reduce, on the device. The inf-norm's max all-reduce can drop a NaN
        (gloo's max keeps a finite value met first), so NaNs travel as a flag beside the max and
        come back as NaN on every rank, as DDP's norm of those gradients is."""
        tp = self.core.tp
        if not math.isinf(norm_type):
            self.core.all_reduce(t, "sum", "clip_grad_norm_", group=self.core.shard_group)
            return t if tp is None else tp.reduce_norm(t, norm_type)
        nan = t.isnan()
        both = torch.cat([t.masked_fill(nan, -math.inf), nan.to(t.dtype)])
        self.core.all_reduce(both, "max", "clip_grad_norm_", group=self.core.shard_group)
        t = both[:1].masked_fill(both[1:] > 0, math.nan)
        return t if tp is None else tp.reduce_norm(t, norm_type)

    def _counted(self, shards: list[torch.Tensor]) -> list[torch.Tensor]:
        """What this rank adds to a norm of the whole model: its shards, or with tensor
        parallelism each element once across tp ([Note: tensor parallelism])."""
        tp = self.core.tp
        if tp is None:
            return shards
        mine = tp.norm_inputs(self.core.layout, self.core.rank, self.core.grads)
        return shards if mine is None else mine

    def _clip_on_device(self, shards, max_norm: float, norm_type: float, error_if_nonfinite):
        """`clip_grad_norm_` without a host read ([Note: no host sync])."""
        t = self._reduce_norm(
            norm_on_device(self._counted(shards), norm_type, self.core.device), norm_type
        )
        if norm_type not in (0.0, 1.0) and not math.isinf(norm_type):
            t = t ** (1.0 / norm_type)
        total = (t * abs(self.factor)).reshape(())
        if error_if_nonfinite and not bool(torch.isfinite(total)):  # a host read, as torch's
            raise RuntimeError(
                f"clip_grad_norm_: the total norm of order {norm_type} is "
                f"non-finite ({float(total)}), error_if_nonfinite=True"
            )
        coef = clip_coefficient(total, max_norm)
        by_dtype: dict = {}
        for g in shards:
            by_dtype.setdefault(g.dtype, []).append(g)
        for dt, gs in by_dtype.items():  # float64 params have float64 grads
            torch._foreach_mul_(gs, coef.to(dt))
        return total.float()

    def log_nonfinite(self, step: int) -> None:
        self.said_nonfinite = True
        log.warning(
            "ZeroOptimizer: rank %d has non-finite gradients at step %d; stepping anyway "
            "(nonfinite='step', as torch does); nonfinite='skip' or 'raise' stops it",
            self.core.dp_rank,
            step,
        )

    @property
    def nonfinite_steps(self) -> int:
        """Steps with inf/NaN gradients (on this rank, with nonfinite="step"); reading it off
        the CPU waits for the device (telemetry, never read by the step)."""
        dev = self._nonfinite_dev
        return self.nonfinite_host + (int(dev.item()) if dev is not None else 0)

    @nonfinite_steps.setter
    def nonfinite_steps(self, value: int) -> None:
        self.nonfinite_host = int(value)
        self._nonfinite_dev = None
