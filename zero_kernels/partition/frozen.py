"""Stage 3's frozen shards: when a unit holding frozen params may be freed in the backward
(`InputWatch`, one per unit scheduler).

[Note: frozen shards]
With ``shard_frozen=True`` the model's params that do not train (given to the optimizer with
``requires_grad=False``, or not given at all: a frozen base under LoRA adapters) are laid out
by unit as the trained ones are, in buffers of their own after the trained buffers
(`Core.store_layout`, the param store's; `Core.layout`, which the gradients, the reducer, the
step and the optimizer's state read, keeps the trained ones only). A unit's frozen buckets
(`Unit.frozen`) are gathered and freed with it: prefetch, the secondary shard, quantized
all-gathers and the exact gathers that hand params out all apply; they have no gradient,
reduce-scatter or optimizer state. Those that ``persist_below`` (or, under quantized
communication, the one-dimensional rule) keeps whole stay whole, unsharded.

The backward is the hard part. A unit of trained params is freed when every gradient of its
buckets arrived: every node that reads a trained weight also gives that weight's gradient, so
the weight's accumulation comes after its last read. A frozen weight gives no such signal. In a
LoRA linear, ``base(x) + B(A(x))`` as PEFT adds them, autograd runs the adapters' nodes (made
last) before the base's input-gradient node, which reads the frozen weight; freed at the
adapters' last gradient, that weight read as the NaN placeholder and every gradient below it
was NaN (tests/frozen_checks.check_parity fails so without the rule below). So a unit with
frozen buckets is freed in the backward when both (a) its trained buckets are done, as before,
and (b) the gradients of the inputs of each of its forwards that need one are computed: a
multi-grad hook (``mode="all"``) on its positional and keyword tensor arguments, armed in every
forward since the last backward ended (two forwards before one backward, two views of a
contrastive loss, arm two) and in a re-entrant checkpoint's recomputation (a non-re-entrant
one's recomputation keeps the forward's hook), each firing counted in this optimizer's
backward only (a gradient of a leaf input taken outside it, ``torch.autograd.grad``, counted
and freed the unit early in the next backward), and only once the unit's backward has begun on
this rank (a rank whose loss skips the unit must not free a prefetched gather the others still
wait on). The hooks are removed at the backward's end: a leaf input (a param passed to a unit as
it is) kept them, one more per step, and torch refuses ``torch.autograd.grad`` over a leaf with
one (tests/frozen_checks.check_leaf_input); a second backward of the same graph
(``retain_graph=True``) thus keeps such units gathered to its end. Measured before the counting:
two forwards then one backward read NaN, as the adapters-first order did. A node that reads a
frozen weight of the unit leads to the unit's inputs (covered by (b)) or to its trained params
(covered by (a)); not covered is a path to a tensor that reaches the unit another way than its
arguments (an attribute another module set, a closure), which does not occur in the transformer
stacks we test: there the backward reading a freed frozen param raises, naming it (the unit's
forward saves its frozen params through `zero_kernels.partition.recast`'s hooks, which check
at unpack that the unit is gathered; the gradient was silently wrong before, and NaN under
autocast; tests/frozen_checks.check_side_output_raises). Inputs that
need no gradient make (b) hold at once; a unit whose hooks did not fire is freed at the end of
the backward (later, never earlier). A unit of frozen params only whose inputs need no
gradient (blocks before the first adapter) runs no backward: freed after its forward. A unit
with frozen params that the forward read outside the unit ([Note: external params], the read
guard keeps it gathered) stays gathered to the end of the backward: the read's backward may
come after the unit's own, and a frozen param has no accumulation to wait for (freed at its
own backward, the read's gradient was NaN, or wrong where the storage was gathered again).

Checkpoints: `save_checkpoint` and `load_checkpoint` gather every unit holding frozen params
(`zero_kernels.optimizer.sharded_state.ShardedState.frozen_whole`): rank 0 writes them whole into
the
model file as before, a load writes them on every rank and takes the shards back, so a
checkpoint does not depend on ``shard_frozen``. Inside, every frozen param is whole on every
rank (``model.state_dict()`` at stage 3 holds every param whole too). Not built:
``offload_params="nvme"`` with frozen shards (a NotImplementedError); under autocast the casts
of frozen fp32 weights are recipes made again in the backward ([Note: frozen casts] in
recast.py). Construction
gives every rank rank 0's frozen values (the store's broadcast) without the warning that
`zero_kernels.optimizer.replicas.sync_at_start` gives for the frozen params kept whole.
Tested against DDP (tests/stage3/frozen_checks.py: plain, both checkpointings, a frozen unit called
twice, prefetch 2, no resharding after forward, host-memory shards, int8 weights, hpZ at 4
ranks, meta-device construction, two forwards before one backward, two backwards of one
forward, frozen params read outside their unit; memory held and freed; state dicts; a
checkpoint resumed into another base; ``close``; PEFT's LoRA over a Llama with and without
gradient checkpointing; ZeroTrainer in tests/integrations/transformers_checks.py).

`InputWatch` keeps the input hooks' counts; `UnitScheduler` (`zero_kernels.partition.units`) arms
them in a unit's forward pre-hook and asks `holds` before freeing a unit in the backward.
"""

from __future__ import annotations

import torch

__all__ = ["InputWatch"]


class InputWatch:
    """Per unit with frozen buckets: the input hooks armed by the forwards since the last
    backward ended (``armed``), those fired in this backward (``fired``); the unit's backward
    may read its frozen params until every one has ([Note: frozen shards])."""

    def __init__(self) -> None:
        self.armed: dict[int, int] = {}
        self.fired: dict[int, int] = {}
        self._handles: list = []  # the hooks' handles, removed at the backward's end
        self._unhooked = False  # armed, and the hooks removed (a second backward of a graph)
        self._ended = -1  # the graph task of the last backward's end
        self._keep_frozen = False  # see `task_ended`
        self._keep_all = False  # likewise

    def arm(self, k: int, ts: list, hook) -> None:
        """A forward of unit ``k`` whose inputs ``ts`` need a gradient: ``hook`` once all of
        theirs are computed."""
        self.armed[k] = self.armed.get(k, 0) + 1
        self._handles.append(torch.autograd.graph.register_multi_grad_hook(ts, hook, mode="all"))

    def fire(self, k: int, in_backward: bool) -> bool:
        """A hook of unit ``k`` fired; counted only in this optimizer's backward (a leaf
        input keeps its hooks: fired by another model's backward, or a ``torch.autograd.grad``
        of that input, it counts for nothing). Whether it counted."""
        if in_backward:
            self.fired[k] = self.fired.get(k, 0) + 1
        return in_backward

    def holds(self, u) -> bool:
        """Unit ``u`` must stay gathered in this backward: a graph of gradients is being built
        or was (`task_ended`), its inputs' gradients are not all computed, or no hook is left
        to say so (`unhook`; after a task that reduced nothing, `task_ended`)."""
        if self._keep_all or torch.is_grad_enabled():
            return True
        armed = self.armed.get(u.index, 0)
        if self.fired.get(u.index, 0) < armed or (self._unhooked and armed):
            return True
        return self._keep_frozen and bool(u.frozen)

    def unhook(self) -> None:
        """The input hooks off their tensors at the end of a backward: a leaf input (a param
        passed to a unit as it is) keeps its hooks past the backward, one more per step, all
        fired by each later backward, and torch refuses ``torch.autograd.grad`` over a leaf
        holding one. A second backward of the same graph (``retain_graph``) then has no input
        hooks to count: its units with frozen buckets stay gathered to its end."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._unhooked = bool(self.armed)

    def disarm(self) -> None:
        """The first forward after a backward: its own input hooks from here."""
        self.unhook()
        self.armed.clear()
        self._unhooked = False

    def backward_ended(self) -> None:
        """This optimizer's backward ended (inside its graph task)."""
        self._ended = torch._C._current_graph_task_id()
        self._keep_frozen = self._keep_all = False
        self.fired.clear()
        self.unhook()

    def task_ended(self, task: int, built: bool) -> bool:
        """A graph task through the model ended (``built``: with ``create_graph=True``). One
        that reduced nothing (a ``torch.autograd.grad`` of an input: a gradient penalty, a
        saliency map) fired the units' input hooks and began their backwards; counted into the
        next backward, they freed a unit with frozen buckets before that backward was done with
        its weights (NaN params). The counts are dropped (True: the caller drops which units'
        backwards began) and, until a backward's end, such units stay gathered. A task that
        built a graph freed no unit while it ran (`holds`), and until the next backward's end
        none is freed either: the gradient graph it built reads the params it saved, frozen and
        trained, in that backward, in no order the hooks can tell (freed, they read NaN)."""
        if self._ended == task:
            return False
        self.fired.clear()
        self._keep_frozen = True
        self._keep_all = self._keep_all or built
        return True
