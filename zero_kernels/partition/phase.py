"""Where one optimizer's training loop is: idle, in a forward, in a backward or in a step.

[Note: phase]
One `PhaseTracker` per optimizer holds the phase; the parts move it, nothing guesses it:

    IDLE --root pre-forward--> FORWARD --root post-forward--> IDLE
    IDLE | FORWARD --first hook of a backward--> BACKWARD --end of that backward--> IDLE
    IDLE --step()--> STEP --its end (or its error)--> IDLE

The backward starts at its first hook that reaches us (stage 3: the hook on the model's output
or on a unit's output; every stage: a param's gradient hook). It ends when autograd's engine has
run the callbacks queued for that backward: `enter_backward` queues one that re-queues itself,
so it runs after the reducer's own end-of-backward callback (queued later, by a gradient hook),
and the phase covers the reduction too. Autograd runs no callback when a backward raises; such a
backward's phase is left behind, and the next forward (or ``now`` read outside the engine's
graph task it started in) finds it over: a phase is tied to the graph task it was entered in.

A forward while the phase is BACKWARD is a recomputation (activation checkpointing). A model
forward that starts inside autograd's engine before any hook of ours fired (the whole model
under a reentrant ``torch.utils.checkpoint``, whose first forward ran without grad) is one too:
`enter_forward` is the one place that asks the engine, and it moves the phase to BACKWARD, so
every unit's hooks after it read the phase alone. Stages 1 and 2 have no forward hooks (except
``overlap_param_gather``'s waits) and see only IDLE, BACKWARD and STEP.

[Note: nested backwards]
A re-entrant ``torch.utils.checkpoint`` runs a backward of its own (a nested graph task) inside
the outer backward's node, and autograd runs the callbacks queued inside it when that inner
backward ends. The reducer queued its end of backward (launch every bucket left, wait, publish
the gradients; stage 3: pass over units, compare the pass, free everything) at the first
gradient, which under transformers' checkpointing (it checkpoints each layer's ``forward``, the
module hooks outside) arrives inside the last layer's inner backward: so every checkpointed
layer's inner backward ended "the backward", and every bucket was reduce-scattered once per
layer (measured on a 2-layer PEFT Llama: 2x the reduce-scatters and order checks at stages
1-3; L layers, L times). Results stayed equal (later gradients were reduced again at the next
end), the communication did not. Now the phase knows the outer graph task (the first hook of
the backward: at stage 3 the hook on the model's outputs, at stages 1/2 one the optimizer adds
to the model's outputs when it has the model), and a callback asked for inside a nested task is
`defer`red to the end of the outer one. Stages 1/2 without the model (params only) keep the
per-inner-backward reduction.
"""

from __future__ import annotations

import enum

import torch
from torch.utils._pytree import tree_flatten

__all__ = ["Phase", "PhaseTracker", "backward_marker"]


class Phase(enum.Enum):
    IDLE = "idle"
    FORWARD = "forward"
    BACKWARD = "backward"
    STEP = "step"


@torch.compiler.disable
def _eager(fn) -> None:
    fn()


def _graph_task() -> int:
    """The id of the autograd graph task this thread runs (-1: none)."""
    return torch._C._current_graph_task_id()


class PhaseTracker:
    """The phase of one optimizer (see [Note: phase])."""

    def __init__(self) -> None:
        self._now = Phase.IDLE
        self._task = -1  # the graph task of the BACKWARD phase
        self.stale = 0  # backward phases found over without their end (a backward that raised)
        self._deferred: list = []  # callbacks for the end of the outer backward (`defer`)
        # (task, built) at the end of each graph task the phase entered its backward in, after
        # the reducer's end, if any (stage 3's `UnitScheduler.task_ended`); built: the task
        # runs with create_graph=True
        self.task_ended = None

    @property
    def now(self) -> Phase:
        if self._now is Phase.BACKWARD and _graph_task() == -1:  # over (it raised)
            self._lapse()
        return self._now

    @property
    def backward(self) -> bool:
        """In a backward (a forward now is a recomputation)."""
        return self.now is Phase.BACKWARD

    def _lapse(self) -> None:
        self.stale += 1
        self._now, self._task = Phase.IDLE, -1
        self._deferred = []

    # ---- forward (stage 3's root unit hooks)
    def enter_forward(self) -> bool:
        """The model's forward starts; True where it is a recomputation inside a backward."""
        task = _graph_task()
        if task != -1:  # inside autograd's engine
            self.enter_backward()
            return True
        if self._now is Phase.BACKWARD:  # a backward that raised: over
            self._lapse()
        if self._now is Phase.STEP:
            raise RuntimeError(
                "ZeroOptimizer: the model's forward ran inside step() (from a hook of the "
                "inner optimizer?); run forwards before step() or in its closure"
            )
        self._now = Phase.FORWARD
        return False

    def end_forward(self) -> None:
        if self._now is Phase.FORWARD:
            self._now = Phase.IDLE

    # ---- backward
    def enter_backward(self) -> None:
        """A hook of a backward fired (inside autograd's engine). Under compiled autograd the
        hooks are traced: this runs as plain Python at a graph break (`_eager`)."""
        _eager(self._enter_backward)

    def _enter_backward(self) -> None:
        task = _graph_task()
        if self.now is Phase.BACKWARD:  # (a nested graph task of it: reentrant checkpointing)
            return
        self._now, self._task = Phase.BACKWARD, task
        self._deferred = []
        if task != -1:
            built = torch.is_grad_enabled()  # in autograd's engine: create_graph
            torch.autograd.Variable._execution_engine.queue_callback(self._requeue(task, built))

    def nested(self) -> bool:
        """Inside a graph task nested in the backward's own (a re-entrant checkpoint's inner
        backward, see [Note: nested backwards])."""
        if self._now is not Phase.BACKWARD or self._task == -1:
            return False
        task = _graph_task()
        return task not in (-1, self._task)

    def defer(self, fn) -> None:
        """Run ``fn`` at the end of the backward's own graph task, not of the nested one this
        is called from ([Note: nested backwards])."""
        self._deferred.append(fn)

    def _requeue(self, task: int, built: bool):
        def first() -> None:  # the reducer's callback was queued after this one: go after it
            fns, self._deferred = self._deferred, []
            for fn in fns:  # deferred from nested graph tasks: before the phase ends
                torch.autograd.Variable._execution_engine.queue_callback(fn)
            torch.autograd.Variable._execution_engine.queue_callback(last)

        def last() -> None:
            if self._now is Phase.BACKWARD and self._task == task:
                self._now, self._task = Phase.IDLE, -1
            if self.task_ended is not None:
                self.task_ended(task, built)

        return first

    # ---- step
    def enter_step(self) -> None:
        now = self.now
        if now is Phase.BACKWARD:
            raise RuntimeError(
                "ZeroOptimizer.step() was called during a backward (from a gradient hook?): "
                "the gradients are reduced at the end of the backward, so a step now would use "
                "partial ones; call step() after backward() returns"
            )
        self._now = Phase.STEP

    def end_step(self) -> None:
        if self._now is Phase.STEP:
            self._now = Phase.IDLE


def backward_marker(get_phase):
    """Stages 1/2 with the model: a forward hook putting a hook on the model's outputs that
    enters the backward phase (``get_phase()``: the optimizer's tracker, None once closed)
    from the outer graph task ([Note: nested backwards]). Traced by torch.compile it does
    nothing (a disabled hook would break a fullgraph model)."""

    def enter(grad):
        phase = get_phase()
        if phase is not None:
            phase.enter_backward()

    def hook(module, args, output):
        if torch.compiler.is_compiling() or not torch.is_grad_enabled():
            return
        flat = tree_flatten(output)[0]
        ts = [t for t in flat if isinstance(t, torch.Tensor) and t.requires_grad]
        if ts:
            torch.autograd.graph.register_multi_grad_hook(ts, enter, mode="any")

    return hook
