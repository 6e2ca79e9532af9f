"""Gradient reduction: post-accumulate-grad hooks fill buckets and fire their reduce-scatters.

[Note: overlap]
Each trainable parameter has a post-accumulate-grad hook. The hook adds the fresh ``.grad`` into
the parameter's range of its bucket (then drops ``.grad``), and when a bucket has every grad it
waits for, its reduce-scatter starts at once, asynchronously, while autograd keeps computing the
grads of earlier layers. Buckets are launched in one fixed order, the same on every rank (by
the expected arrival order, from the layout), so that ranks never issue collectives in different
orders: a bucket that is ready before its predecessor waits for it. At the end of the backward
pass (an autograd engine callback) any bucket still not launched, because some parameter got no
grad in this pass, is launched with zeros for the missing grads, and all are waited for.

    autograd   | grads L3 | grads L2 | grads L1 | grads L0 |end|
    comm                  | RS bkt0  ...| RS bkt1 ...| RS bkt2 ...| RS b3|
    step                                                             wait|opt step + AG|
                                                              exposed ^^^^

Only the tail after the end of backward ("exposed") costs time; `CommLog.exposed_comm_s`
measures it. Stage 1 under ``no_sync`` only accumulates into its full-size buffer and reduces at
the next synchronising backward; stage 2 has no full-size buffer, so it reduces every micro-batch
and accumulates the reduced shards (the same sum, see [Note: averaging] in `zero_kernels.comm`).

Stage 1 reduce-scatters in place (see [Note: gradient storage] in `zero_kernels.buffers`): after
it, the rank's slice of the bucket holds the average R and the other slices stale local values.
Before more grads are added to such a bucket (accumulation across synchronising backwards, or a
bucket re-reduced), it is *rebased*: its own slice is multiplied by N and the rest zeroed, so the
next averaged reduce-scatter yields (N R + sum of new local grads) / N = R + their average.

Stage 1 never zeroes its full buffer: since `zero_grad` the first grad of a parameter is copied
into its range, later ones added; a bucket's ranges that got no grad are zeroed when it is
launched (padding stays zero: nothing writes it but reduce-scatters of zeros). Stage 1 keeps at
most ``max_inflight`` reduce-scatters in flight (launching one more first waits for the oldest):
each p2p reduce-scatter holds up to N-1 receive buffers of a shard, so with every bucket in
flight at once the comm scratch reached 0.75x the gradient bytes at N = 4.

Stage 2 holds at most ``max_inflight`` bucket buffers (filling or being reduced), each sized to
its bucket, together at most the ``max_inflight`` largest buckets: when a bucket needs one and a
limit would be passed, the oldest reduce-scatter is waited for and its buffer reused (or, too
small, replaced by one of the right size; see [Note: gradient storage] in `zero_kernels.buffers`).

    autograd   | fill b0 | fill b1 | wait RS b0, fill b2 | wait RS b1, fill b3 |
    buffers      A         A B       B A (reused)          A B (reused)
"""

from __future__ import annotations

import enum
import weakref

import torch

from .. import comm
from ..buffers import GradStore
from ..layout import Layout, bucket_gaps

__all__ = ["BucketState", "GradBucket", "Reducer"]

# Under compiled autograd the hooks are traced; raising inside the trace makes dynamo break the
# graph there and run the hook eagerly (stages 1/2 then give DDP's result, tested); only a
# fullgraph=True compiled autograd shows this message.
_COMPILED_AUTOGRAD = (
    "ZeroOptimizer's gradient hooks cannot be traced into a compiled-autograd graph (they "
    "launch collectives and keep per-bucket state in Python): they run eagerly at a graph "
    "break, so use compiled autograd without fullgraph=True, or turn it off"
)


class BucketState(enum.Enum):
    """Where a bucket's gradient is (asserted at each transition, see `GradBucket.move`)."""

    CLEAN = "clean"  # nothing accumulated locally since zero_grad or its last reduction
    FILLING = "filling"  # local grads accumulating, not reduced yet
    REDUCING = "reducing"  # its reduce-scatter is in flight
    REDUCED = "reduced"  # this rank's shard holds the average (stage 1: in place, see Note)


_MOVES = {
    BucketState.CLEAN: (BucketState.FILLING, BucketState.REDUCING),
    BucketState.FILLING: (BucketState.REDUCING, BucketState.CLEAN),
    BucketState.REDUCING: (BucketState.REDUCED,),
    BucketState.REDUCED: (BucketState.FILLING, BucketState.REDUCING, BucketState.CLEAN),
}


class GradBucket:
    """One bucket's reduction: its state, this pass's arrivals, its collective in flight."""

    __slots__ = (
        "key",
        "need",
        "state",
        "arrived",
        "launched",
        "skipped",
        "fresh",
        "overwrite",
        "written",
        "handle",
        "tmp",
        "partial",
        "summing",
    )

    def __init__(self, i: int, b: int, need: int):
        self.key = (i, b)
        self.need = need  # grads that complete it in one pass (its params)
        self.state = BucketState.CLEAN
        self.arrived = 0  # grads arrived in this pass
        self.launched = False  # reduce-scatter issued in this pass
        self.skipped = 0  # stage 3: grads that will not come in this pass (`Reducer.give_up`)
        self.fresh = True  # stage 2: the next reduction overwrites the shard (else adds to it)
        self.overwrite = False  # the reduction in flight overwrites the shard
        self.written: set[int] = set()  # slots written: stage 1 since zero_grad, else since
        # the bucket took its buffer
        self.handle: comm.Handle | None = None
        self.tmp: torch.Tensor | None = None  # stage 2: reduced values added to the shard after
        # tensor parallelism, stages 2/3: slots holding parts of a sum over tp, summed before
        # the reduction ([Note: deferred tp sums] in zero_kernels/optimizer/tp_grads.py)
        self.partial: dict[int, torch.dtype] = {}  # slot -> its gradients' dtype
        self.summing = None  # their tp sum in flight (a PendingSum), before the launch

    def move(self, to: BucketState) -> None:
        assert to in _MOVES[self.state], f"bucket {self.key}: {self.state} -> {to}"
        self.state = to


class Reducer:
    def __init__(
        self,
        layout: Layout,
        params: dict[int, torch.Tensor],
        grads: GradStore,
        rank: int,
        group,
        log: comm.CommLog,
        mesh=None,
        leaves: dict[int, torch.Tensor] | None = None,
        local_grad=None,
        partial_sums=None,
    ):
        self.layout, self.grads, self.rank, self.group, self.log = layout, grads, rank, group, log
        # hierarchical sharding: each bucket's shard is then all-reduced across the replica
        # groups ([Note: hierarchy] in zero_kernels.comm.hier)
        self.mesh = mesh if mesh is not None and mesh.replicas is not None else None
        self.quantize: tuple[int, int] | None = None  # (bits, block) of quantize_grads
        self.exact_buckets: set = set()  # (buffer, bucket) never quantized (params of 1 dim)
        self.error_feedback = False  # grad_error_feedback ([Note: error feedback])
        self.errors: dict[tuple[int, int], dict] = {}  # bucket -> its feedback buffers
        # quantize_grads on a flat group across hosts: the two-hop form ([Note: two-hop
        # quantized reduce-scatter] in zero_kernels.comm.hier_quant); None: one hop
        self.two_hop = None
        # whole gradients (stage 1): a full-size buffer reduced in place; else (stages 2 and 3)
        # bucket buffers reduced into the shards and given back (see [Note: overlap])
        self.whole = grads.whole
        self.sync = True  # False inside no_sync()
        self.overlap = True  # False: launch every bucket at the end of backward instead
        self.max_inflight = grads.max_inflight  # stage 2: bucket buffers held at once
        self.check = None  # stage 3: a SequenceCheck called before each launch
        self.buckets = {
            (i, b.index): GradBucket(i, b.index, len(b.slots))
            for i, buf in enumerate(layout.buffers)
            for b in buf.buckets
        }
        # Global launch order: by the smallest param index inside, descending, i.e. the order in
        # which autograd usually finishes the buckets (a bucket is finished by its
        # earliest-registered param: stage 3's root unit holds the embedding, whose gradient
        # comes last, beside the final norm, whose gradient comes first).
        order = []
        for i, buf in enumerate(layout.buffers):
            for b in buf.buckets:
                key = min((buf.slots[s].index for s in b.slots), default=-1)
                order.append((-key, i, b.index))
        self.order = [self.buckets[(i, b)] for _, i, b in sorted(order)]
        self.inflight: list[GradBucket] = []  # REDUCING, in launch order
        self._reset_pass()
        self.dirty = False  # grads accumulated locally and not yet reduced
        self.got: set[int] = set()  # params that got a local grad since the last `on_reduced`
        # callbacks of the owner: the first grad hook of a backward pass, the end of a reduction
        self.on_backward_start = None
        self.on_reduced = None
        self.on_bucket_ready = None  # stage 3: every grad of a bucket arrived (free its params)
        self.timeout: float | None = None  # bound on each wait (the optimizer's ``timeout``)
        self.describe = lambda: ""  # where we are, for a timeout's message ("step 3")
        self.phase = None  # the optimizer's PhaseTracker ([Note: nested backwards])
        self._hooks = []
        self._hook_cache: dict = {}
        self._gap_cache: dict = {}
        self._params = params
        self._bucket_of = {  # param index -> its bucket's key
            s.index: (i, s.bucket) for i, buf in enumerate(layout.buffers) for s in buf.slots
        }
        # tensor parallelism: the hooks sit on the autograd leaf (the DTensor) of a param laid
        # out by its local tensor, and take the local tensor of its gradient ([Note: tensor
        # parallelism] in zero_kernels/optimizer/tensor_parallel.py)
        self._local_grad = local_grad
        # stages 2/3: Partial gradients summed over tp per bucket, not per param ([Note:
        # deferred tp sums] in zero_kernels/optimizer/tp_grads.py); stage 1 redistributes each
        self._partial = partial_sums if not self.whole else None
        me = weakref.ref(self)  # hooks must not keep the reducer (and its optimizer) alive
        for i, buf in enumerate(layout.buffers):
            for pos, slot in enumerate(buf.slots):
                p = (leaves or params)[slot.index]
                self._hooks.append(p.register_hook(_pre_hook(me)))
                self._hooks.append(p.register_post_accumulate_grad_hook(_post_hook(me, i, pos)))

    def handles_to_remove(self) -> list:
        """The hook handles (removed by ``remove_hooks`` or a finalizer of the owner)."""
        return self._hooks

    def _reset_pass(self) -> None:
        for bk in self.buckets.values():
            bk.arrived = 0
            bk.launched = False
            bk.skipped = 0
        self.next = 0
        self._gave_up: set[int] = set()  # params counted by `give_up` in this pass
        self.callback_queued = False
        self.pass_started = False

    def before_grad(self) -> None:
        """A grad is about to be accumulated into a param: tell the owner once per pass."""
        if not self.pass_started:
            self.pass_started = True
            if self.on_backward_start is not None:
                self.on_backward_start()

    def clear_errors(self) -> None:
        """grad_error_feedback: every bucket's buffers back to zero (a skipped step's made them
        non-finite)."""
        for d in self.errors.values():
            for t in d.values():
                t.zero_()

    @property
    def error_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for d in self.errors.values() for t in d.values())

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    def _hook_for(self, i: int, pos: int):
        f = self._hook_cache.get((i, pos))
        if f is None:
            f = self._hook_cache[(i, pos)] = self._make_hook(i, pos)
        return f

    def _make_hook(self, i: int, pos: int):
        buf = self.layout.buffers[i]
        slot = buf.slots[pos]
        bk = self.buckets[(i, slot.bucket)]
        off = slot.start - buf.buckets[slot.bucket].start
        # stage 1: the full gradient buffer never moves, so the param's range of it is fixed
        # (two tensor slicings per grad saved: ~1% of a small model's step)
        static = None
        if self.grads.full is not None:
            at = buf.buckets[slot.bucket].start + off
            static = self.grads.full[i][at : at + slot.numel]

        def hook(p: torch.Tensor) -> None:
            if torch.compiler.is_compiling():  # traced by compiled autograd
                raise RuntimeError(_COMPILED_AUTOGRAD)
            g = p.grad
            p.grad = None
            if g is None:
                return
            part = False
            if self._partial is not None:
                g, part = self._partial.split(slot.index, g)
            elif self._local_grad is not None:
                g = self._local_grad(slot.index, g)
            if g.layout != torch.strided:
                raise NotImplementedError(
                    f"param {slot.name or slot.index} got a {g.layout} gradient: ZeroOptimizer "
                    "takes dense gradients only (e.g. nn.Embedding(sparse=False))"
                )
            self.got.add(slot.index)
            syncing = self.sync or not self.whole
            if syncing and not self.callback_queued:
                self.callback_queued = True
                if self.phase is not None and self.phase.nested():  # [Note: nested backwards]
                    self.phase.defer(self.finish)
                else:
                    torch.autograd.Variable._execution_engine.queue_callback(self.finish)
            if bk.summing is not None:  # a grad after its tp sum started (retain_graph)
                self._finish_sum(bk)
            if bk.launched:  # a second grad for it in this pass (retain_graph)
                self.wait_all()
                bk.launched = False
                bk.arrived = 0
            if static is None:
                dst = self._accumulator(bk)[off : off + slot.numel]
            else:
                self._ready(bk)
                dst = static
            if part != (pos in bk.partial):  # parts and a whole grad in one range
                g = self._as_part(bk, pos, dst, g, part)
            if pos not in bk.written:  # copy, not add: a mixed-dtype add (fp32 grad into a
                # bf16 bucket) costs 5-8x a converting copy (docs/benchmarks.md, bf16 reduction)
                if g is None:
                    dst.zero_()
                else:
                    dst.copy_(g.reshape(-1))
                bk.written.add(pos)
            elif g is not None:
                dst.add_(g.reshape(-1))
            self.dirty = True
            if syncing:
                bk.arrived += 1
                if bk.arrived == bk.need and self.on_bucket_ready:
                    self.on_bucket_ready(*bk.key)
                if self.overlap:
                    self._launch_ready()

        return hook

    def _as_part(self, bk: GradBucket, pos: int, dst, g, part: bool):
        """A range that holds parts of a sum over tp takes a whole gradient as a part: on tp
        rank 0 only (None elsewhere: nothing to add); a range that held whole values becomes
        one of parts, its values kept on tp rank 0 ([Note: deferred tp sums])."""
        if part:
            if pos in bk.written and self._partial.rank != 0:
                dst.zero_()
            bk.partial[pos] = g.dtype
            return g
        return g if self._partial.rank == 0 else None

    def _start_sum(self, bk: GradBucket) -> None:
        """Start the tp sum of the ranges of ``bk`` holding parts (one all-reduce)."""
        i, b = bk.key
        buf = self.layout.buffers[i]
        base = buf.buckets[b].start
        spans = sorted(
            (buf.slots[pos].start - base, buf.slots[pos].end - base, dt)
            for pos, dt in bk.partial.items()
        )
        t = self.grads.bucket(i, b)
        parts = [t[lo:hi] for lo, hi, _ in spans]
        bk.summing = self._partial.start(parts, [dt for _, _, dt in spans])
        bk.partial.clear()

    def _finish_sum(self, bk: GradBucket) -> None:
        bk.summing.finish(
            self.timeout,
            f"{self.describe()}, backward: the tp sum of bucket {bk.key[1]} of buffer {bk.key[0]}",
        )
        bk.summing = None

    def _launch_ready(self) -> None:
        while self.next < len(self.order):
            bk = self.order[self.next]
            if not bk.launched and bk.arrived + bk.skipped < bk.need:
                return
            if not bk.launched:
                if bk.partial:  # its tp sum first, in flight while autograd goes on; the
                    self._start_sum(bk)  # reduce-scatter at the next call (the next grad,
                    return  # or the end of backward): a point every rank reaches alike
                self._launch(bk)
            self.next += 1

    def give_up(self, indices) -> None:
        """Stage 3: this rank's backward skipped a unit holding params ``indices`` (its output
        took no part in this rank's loss). Those whose gradient will not come in this backward
        (autograd's engine will not run their accumulation: a param tied into a unit that runs
        still gets one) are counted as arrived, so that their buckets are reduced at their turn
        in the fixed order, with zeros for them, not at the end of backward (see [Note: backward
        gathers] in `zero_kernels.partition.units`)."""
        for idx in indices:
            key = self._bucket_of.get(idx)
            if key is None or idx in self._gave_up or _grad_will_come(self._params[idx]):
                continue
            self._gave_up.add(idx)
            self.buckets[key].skipped += 1
        if self.overlap and self.callback_queued:  # (else: at the next grad, or the end)
            self._launch_ready()

    def _accumulator(self, bk: GradBucket) -> torch.Tensor:
        """The bucket's local grad storage, ready to accumulate into (FILLING)."""
        self._ready(bk)
        return self.grads.bucket(*bk.key)

    def _ready(self, bk: GradBucket) -> None:
        """The bucket made ready to accumulate into (FILLING)."""
        if bk.state is BucketState.REDUCING:
            self.wait_all()
        if self.whole:
            if bk.state is BucketState.REDUCED:
                self._rebase(bk)
        elif bk.key not in self.grads.live:
            # bound the buffers: wait for the oldest reduce-scatters until one is free
            while self.inflight and not self.grads.fits(*bk.key):
                self._finalize(self.inflight.pop(0))
        if not self.whole and bk.key not in self.grads.live:
            bk.partial.clear()
            bk.written.clear()  # a fresh buffer: each slot's first grad is copied in (and what
            # gets none is zeroed before the reduction, `_zero_unwritten`)
        if bk.state is not BucketState.FILLING:
            bk.move(BucketState.FILLING)

    def _rebase(self, bk: GradBucket) -> None:
        """Stage 1: make a reduced-in-place bucket accumulate again (see [Note: overlap])."""
        i, b = bk.key
        lay = self.layout.buffers[i].buckets[b]
        n = self.layout.world_size
        t = self.grads.bucket(i, b)
        lo = lay.shard_start(self.rank) - lay.start
        t[:lo].zero_()
        t[lo + lay.shard_numel :].zero_()
        if n > 1:
            t[lo : lo + lay.shard_numel].mul_(n)

    def _zero_unwritten(self, bk: GradBucket) -> None:
        """Before a reduction, zero what no grad was written into: the slots that got none
        (stage 1: since zero_grad; stages 2/3: since the bucket took its buffer) and, stages 2/3,
        the padding between and after them (a pool buffer is not zeroed when taken: whatever
        the first grads overwrite would be zeroed for nothing)."""
        i, b = bk.key
        buf = self.layout.buffers[i]
        lay = buf.buckets[b]
        t = self.grads.bucket(i, b)
        if not self.whole:
            for lo, hi in self._gaps(i, b):
                t[lo:hi].zero_()
        if len(bk.written) < len(lay.slots):
            for pos in lay.slots:
                if pos not in bk.written:
                    slot = buf.slots[pos]
                    t[slot.start - lay.start : slot.end - lay.start].zero_()
            bk.written.update(lay.slots)

    def _gaps(self, i: int, b: int) -> list[tuple[int, int]]:
        g = self._gap_cache.get((i, b))
        if g is None:
            buf = self.layout.buffers[i]
            g = self._gap_cache[(i, b)] = bucket_gaps(buf, buf.buckets[b], self.layout.world_size)
        return g

    def _launch(self, bk: GradBucket) -> None:
        if self.whole and bk.state is BucketState.REDUCED:
            self._rebase(bk)  # reduced before, nothing added since: reduce it again as is
        inp = self.grads.bucket(*bk.key) if self.whole else self._accumulator(bk)
        tmp = None
        shard = self.grads.shard(*bk.key)
        self._zero_unwritten(bk)
        if bk.partial:  # launched without a head start (the end of backward)
            self._start_sum(bk)
        if bk.summing is not None:
            self._finish_sum(bk)
        if self.whole:
            out = shard  # in place: the rank's slice of ``inp``
        elif not bk.fresh or inp.dtype != shard.dtype:  # added (or cast) into the shard after
            tmp = out = torch.empty(shard.shape, dtype=inp.dtype, device=shard.device)
        else:
            out = shard
        bk.overwrite = bk.fresh
        bk.fresh = False
        if self.whole:  # bound the comm scratch (p2p receive buffers): see [Note: overlap]
            while len(self.inflight) >= self.max_inflight:
                self._finalize(self.inflight.pop(0))
        if self.check is not None:  # stage 3: every rank launches this one (SequenceCheck)
            self.check("reduce_scatter", *bk.key)
        bound = dict(
            log=self.log,
            timeout_s=self.timeout,
            what=f"{self.describe()}, backward: reduce-scatter of bucket {bk.key[1]} of buffer "
            f"{bk.key[0]}",
            watch=self.check.watch if self.check is not None else None,
        )
        quantize = None if bk.key in self.exact_buckets else self.quantize
        errors = self.errors.setdefault(bk.key, {}) if self.error_feedback and quantize else None
        if self.mesh is not None:  # hierarchical: quantized across the nodes only
            bk.handle = self.mesh.reduce_scatter(
                out, inp, first=self.group, quantize=quantize, errors=errors, **bound
            )
        elif quantize is not None and self.two_hop is not None:
            bits, block = quantize
            bk.handle = self.two_hop.reduce_scatter(
                out, inp, bits=bits, block=block, errors=errors, **bound
            )
        elif quantize is not None:
            bits, block = quantize
            bk.handle = comm.quant.reduce_scatter_quantized(
                out, inp, bits=bits, block=block, group=self.group, errors=errors, **bound
            )
        else:
            bk.handle = comm.reduce_scatter(out, inp, group=self.group, avg=True, **bound)
        bk.tmp = tmp
        bk.move(BucketState.REDUCING)
        bk.launched = True
        self.inflight.append(bk)
        if not self.whole:  # release the buffers of finished reduce-scatters early
            while self.inflight and self.inflight[0].handle.is_completed():
                self._finalize(self.inflight.pop(0))

    def _finalize(self, bk: GradBucket) -> None:
        i, b = bk.key
        bk.handle.wait(
            self.timeout,
            f"{self.describe()}, backward: reduce-scatter of bucket {b} of buffer {i}",
            self.check.watch if self.check is not None else None,
        )
        if bk.tmp is not None:
            shard = self.grads.shard(*bk.key)
            if bk.overwrite:
                shard.copy_(bk.tmp)
            else:
                shard.add_(bk.tmp)
        bk.handle, bk.tmp = None, None
        bk.move(BucketState.REDUCED)
        if not self.whole:
            self.grads.release(*bk.key)

    def wait_all(self) -> None:
        for bk in self.inflight:
            self._finalize(bk)
        self.inflight.clear()

    def finish(self) -> None:
        """End of a synchronising backward: launch what is left, in order, and wait for all."""
        for bk in self.order:
            if not bk.launched:
                self._launch(bk)
        self.wait_all()
        self._reset_pass()
        self.dirty = False
        if self.on_reduced is not None:
            self.on_reduced()

    def flush(self) -> None:
        """Before the step: reduce whatever was accumulated but not reduced (e.g. after no_sync)."""
        if self.dirty or self.inflight:
            self.finish()
        if self.whole:  # buckets not reduced since zero_grad: zero grads
            for bk in self.buckets.values():
                if bk.state is not BucketState.REDUCED:
                    self._zero_unwritten(bk)
                    self.grads.shard(*bk.key).zero_()

    def zero_grad(self) -> None:
        self.flush_pending_waits()
        for k in list(self.grads.live):
            self.grads.release(*k)
        self.grads.zero()
        for bk in self.buckets.values():
            if bk.state is not BucketState.CLEAN:
                bk.move(BucketState.CLEAN)
            bk.fresh = True
            bk.written.clear()
            bk.partial.clear()
            bk.summing = None
        self._reset_pass()
        self.dirty = False

    def flush_pending_waits(self) -> None:
        if self.inflight:
            self.wait_all()


def _grad_will_come(p: torch.Tensor) -> bool:
    """Inside backward: whether autograd's engine will accumulate a gradient into leaf ``p`` in
    the backward now running (its accumulation node is part of it)."""
    edge = getattr(torch.autograd.graph, "get_gradient_edge", None)
    if edge is not None:
        node = edge(p).node
    else:  # torch < 2.2: the node a view's graph leads to
        with torch.enable_grad():
            node = p.view_as(p).grad_fn.next_functions[0][0]
    return bool(torch._C._will_engine_execute_node(node))


def _pre_hook(me):
    def hook(grad):
        r = me()
        if r is not None:
            r.before_grad()

    return hook


def _post_hook(me, i: int, pos: int):
    def hook(p):
        r = me()
        if r is not None:
            r._hook_for(i, pos)(p)

    return hook
