"""`Stepper`, a part of `ZeroOptimizer` ([Note: parts]): one optimizer step on this rank's
shard. The reduction is finished and checked (`GradContract`), a step with non-finite gradients
is skipped, raised or taken as the policy says, the inner optimizer (or the fused kernel) steps
the pieces, the new params are all-gathered (left in flight with ``overlap_param_gather``, for
the next forward to wait on) and the step counter advances."""

from __future__ import annotations

import logging

from ..ops.library import _bump
from .core import Core

__all__ = ["Stepper"]

log = logging.getLogger("zero_kernels")


class Stepper:
    """Owns ``skipped_steps`` (steps skipped for non-finite gradients on some rank)."""

    def __init__(self, core: Core, grads, params, scaler, nonfinite: str):
        self.core, self.grads, self.params, self.scaler = core, grads, params, scaler
        self.nonfinite = nonfinite
        self.skipped_steps = 0

    def step(self, param_groups: list[dict], kwargs: dict) -> None:
        """The step after the closure ran (see `ZeroOptimizer.step`)."""
        core, g = self.core, self.grads
        g.finish_reduction()
        if g.overflow:
            self.skipped_steps += 1
            core.reducer.clear_errors()  # non-finite now ([Note: error feedback])
            if not self.scaler.active and self.nonfinite == "raise":
                g.overflow = None
                core.comm_log.mark_step(core.steps.n, "raised")
                raise FloatingPointError(
                    f"ZeroOptimizer.step {core.steps.n}: non-finite gradients on at least one "
                    "rank (nonfinite='raise'); nothing was updated"
                )
            self.scaler.overflow()
            g.nonfinite_host += 1
            log.info(
                "ZeroOptimizer: non-finite gradients, step skipped on every rank; "
                "loss scale now %g",
                self.scaler.scale,
            )
        else:
            if g.local_nonfinite:
                g.nonfinite_host += 1
                if not g.said_nonfinite:
                    g.log_nonfinite(core.steps.n)
            for step, bad in g.deferred.ready():  # flags of earlier steps, now known
                if bad and not g.said_nonfinite:
                    g.log_nonfinite(step)
            runner = core.runner
            hyper = runner.sync_hyper(param_groups)
            if not runner.scales_in_kernel:
                g.apply_factor()
            handles = runner.step(g.views.active, g.factor, core.comm_log, core.shard_group, kwargs)
            g.views.changed()  # an inner optimizer may write gradients ([Note: one collective
            # per clip] in zero_kernels/partition/grads.py)
            # the stepped params changed, as torch's in-place step changes them: a graph saved
            # before the step and backwarded after it raises torch's in-place error (it
            # computed with the stepped values, silently); params without a gradient, and a
            # skipped step, change nothing, as in torch
            _bump([core.trainable[i] for i in g.views.active])
            runner.take_group_keys(param_groups, hyper)
            if core.units is not None:  # stage 3: params kept whole are gathered now
                with runner.exact():  # kept whole between steps: the model's values
                    handles += core.units.refresh_persistent()
            core.kept.launched(handles)  # [Note: kept whole]
            if not core.policy.gather.overlap_param_gather:  # else the next forward waits
                core.kept.wait_all()
            self.scaler.finite_step()
        # [Note: the step ledger] in zero_kernels.comm.base
        core.comm_log.mark_step(core.steps.n, "skipped" if g.overflow else "stepped")
        core.steps.n += 1
        g.overflow = None
        g.local_nonfinite = False
