"""`JoinState`, a part of `ZeroOptimizer` ([Note: parts]): uneven inputs under
``torch.distributed.algorithms.Join([opt])``, as torch's ZeroRedundancyOptimizer supports them.

A rank out of inputs shadows the others' iterations, each one synchronising backward (stage 3:
also a forward, run again on this rank's last inputs) and one ``step``; gradient averages count
it as zeros (DDP's default under Join). The optimizer is the `Joinable` torch's Join talks to;
this part holds what the context needs between calls and reaches the optimizer only through a
weak reference and its public methods (``zero_grad``, ``step``)."""

from __future__ import annotations

import weakref

import torch
from torch.distributed.algorithms.join import JoinHook
from torch.utils._pytree import tree_flatten

from .. import comm
from .core import Core

__all__ = ["JoinState"]


class _JoinHook(JoinHook):
    """What a rank that ran out of inputs does while the others still train: it contributes
    zero gradients to their reductions and steps its shard with the average, so its collectives
    match theirs (one synchronising backward and one step per iteration)."""

    def __init__(self, state: JoinState):
        self.state = state

    def main_hook(self) -> None:
        self.state.shadow_iteration()

    def post_hook(self, is_last_joiner: bool) -> None:
        self.state.input = None  # the Join context ends on every rank
        self.state.active = None
        self.state.told = False
        if self.state.final_sync is not None:  # the buffers: the last joiner's, as DDP's
            self.state.final_sync(is_last_joiner)


class JoinState:
    """``active``: ranks still training, inside a Join context (None outside one); ``input``:
    stage 3, the last forward's inputs (shadowed once this rank joins); ``shadowing``: a shadow
    forward and backward runs."""

    def __init__(self, core: Core, joinable):
        self.core = core
        self._joinable = weakref.ref(joinable)  # the ZeroOptimizer
        self.active: int | None = None
        self.input = None
        self.shadowing = False
        # stages 1/2 with the buffers' broadcast: Join was told in the forward, not again in
        # the backward ([Note: replicated module state] in zero_kernels.optimizer.replicas)
        self.told = False
        self.shadow_forward = (
            None  # that broadcast's part on a joined rank (Replicas.before_forward)
        )
        self.final_sync = None  # at the context's end (Replicas.after_join)

    def hook(self) -> JoinHook:
        return _JoinHook(self)

    def _opt(self):
        o = self._joinable()
        if o is None:
            raise RuntimeError("the ZeroOptimizer of this Join state was collected")
        return o

    def notify(self) -> None:
        """A synchronising pass begins: tell the Join context (if any) this rank still trains."""
        self.active = comm.join_notify(self._opt())

    def in_context(self) -> bool:
        """Whether a ``Join`` context over this optimizer is active."""
        cfg = getattr(self._opt(), "_join_config", None)
        return bool(cfg is not None and cfg.enable)

    def notify_forward(self) -> None:
        """Stages 1/2, a forward that broadcasts the buffers begins inside a Join context: tell
        it now (the joined ranks shadow the broadcast), and not again at backward's start."""
        self.notify()
        self.told = True

    def notify_backward(self) -> None:
        """Stages 1/2, a synchronising backward begins: tell Join unless the forward did."""
        if self.told:
            self.told = False
        else:
            self.notify()

    def forward_start(self, args: tuple, kwargs: dict) -> None:
        """Stage 3, a forward begins: inside a ``Join`` context, tell it this rank still trains
        (before the forward's all-gathers, which a joined rank shadows after that all-reduce)
        and keep the inputs, which this rank's shadow iterations run again once it joins."""
        if self.shadowing:
            return
        if not torch.is_grad_enabled():  # its all-gathers have no partner on a joined rank
            self.check_not_joined("a forward without gradients at stage 3")
            return
        opt = self._opt()
        if opt._join_config.enable:  # torch's Joinable attribute, set by the Join context
            self.input = (args, kwargs)
        self.active = comm.join_notify(opt)
        if not self.core.reducer.sync:  # a joined rank steps after each shadowed backward
            self.check_not_joined("gradient accumulation (no_sync)")

    def shadow_iteration(self) -> None:
        opt = self._opt()
        opt.zero_grad(set_to_none=True)
        if self.core.units is not None:
            self._shadow_forward_backward()
        else:
            if self.shadow_forward is not None:  # the buffers' broadcast of the forward
                self.shadowing = True
                try:
                    self.shadow_forward()
                finally:
                    self.shadowing = False
            self.core.reducer.finish()  # every bucket reduced with zeros; the gradient mask
        opt.step()

    def _shadow_forward_backward(self) -> None:
        """Where params are resharded: a joined rank's part of the others' forward and
        backward: the model run again on this rank's last inputs, backward with zero output
        gradients (so its gradients count as zeros in the averages, DDP's default under Join),
        which launches the same all-gathers and reduce-scatters as a training forward and
        backward."""
        if self.input is None:
            raise RuntimeError(
                "ZeroOptimizer stage 3 under Join: this rank ran out of inputs before its first "
                "forward in the Join context, so it has no input to shadow the others' "
                "forwards with (their all-gathers need a partner); give every rank at least "
                "one batch"
            )
        args, kwargs = self.input
        module, device = self.core.module, self.core.device
        # the shadow leaves no trace on this rank: buffers (BatchNorm's running statistics)
        # and random state are as before it, as on a joined DDP rank that runs no forward
        saved = [(b, b.detach().clone()) for b in module.buffers()]
        cuda = [device.index or 0] if device.type == "cuda" else []
        self.shadowing = True
        try:
            with torch.random.fork_rng(devices=cuda), torch.enable_grad():
                out = module(*args, **kwargs)
                ts = [
                    t
                    for t in tree_flatten(out)[0]
                    if isinstance(t, torch.Tensor) and t.requires_grad
                ]
                if ts:
                    torch.autograd.backward(ts, [torch.zeros_like(t) for t in ts])
        finally:
            self.shadowing = False
            with torch.no_grad():
                for b, v in saved:
                    b.copy_(v)

    def check_not_joined(self, what: str) -> None:
        if self.active is not None and self.active < self.core.dp_size:
            raise RuntimeError(
                f"{what} after a rank ran out of inputs under Join: the joined rank shadows only "
                "one forward (stage 3), one backward and one step per iteration, so this has no "
                "partner there or would step its shard more often than the others'; do it only "
                "while every rank has inputs (or pad the inputs to equal length)"
            )
