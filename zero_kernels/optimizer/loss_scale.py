"""The loss scaler of fp16 training: static or dynamic, one small object the optimizer owns.

A dynamic scale starts at 2**16, halves (never below 1) on a step whose gradients were not
finite on some rank (the step is skipped on every rank), and doubles after ``growth_interval``
finite steps in a row, as ``torch.amp.GradScaler`` does. ``scale`` 1.0 with ``dynamic`` False is
no scaling at all. The optimizer multiplies the loss by ``scale`` (``scale_loss``) and divides
the gradients by it before the step.
"""

from __future__ import annotations

__all__ = ["LossScaler"]


class LossScaler:
    def __init__(self, loss_scale: float | str | None, has_fp16: bool):
        """``loss_scale``: None (no scaling), a positive number (static), "dynamic", or "auto"
        (dynamic where the trained params include fp16 ones, else none); checked by
        `zero_kernels.policy.PrecisionPolicy`."""
        if loss_scale == "auto":
            loss_scale = "dynamic" if has_fp16 else None
        self.dynamic = loss_scale == "dynamic"
        self.scale = 2.0**16 if self.dynamic else float(loss_scale or 1.0)
        self.growth_interval = 2000
        self.growth_tracker = 0  # finite steps since the last change of a dynamic scale

    @property
    def active(self) -> bool:
        """Whether gradients are scaled (so their units must be tracked)."""
        return self.scale != 1.0 or self.dynamic

    def overflow(self) -> None:
        """A step skipped for non-finite gradients: a dynamic scale halves."""
        if self.dynamic:
            self.scale = max(self.scale / 2.0, 1.0)
            self.growth_tracker = 0

    def finite_step(self) -> None:
        """A step taken: a dynamic scale doubles after ``growth_interval`` of them in a row."""
        if self.dynamic:
            self.growth_tracker += 1
            if self.growth_tracker >= self.growth_interval:
                self.scale *= 2.0
                self.growth_tracker = 0

    def state_dict(self) -> dict:
        return {
            "loss_scale": float(self.scale),
            "growth_tracker": int(self.growth_tracker),
            "dynamic": bool(self.dynamic),
        }

    def load_state_dict(self, state: dict) -> None:
        """Take a `state_dict` of a scaler of the same kind (a dynamic one's into a static one
        changes nothing: the kind is the optimizer's setting)."""
        if bool(state.get("dynamic")) == self.dynamic and "loss_scale" in state:
            self.scale = float(state["loss_scale"])
            self.growth_tracker = int(state.get("growth_tracker", 0))

    def __repr__(self) -> str:
        kind = "dynamic" if self.dynamic else "static"
        return f"LossScaler({kind}, scale={self.scale:g}, growth_tracker={self.growth_tracker})"
