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
launched (padding stays zero: nothing writes it but reduce-scatters of zeros).

Stage 2 holds at most ``max_inflight`` bucket buffers (filling or being reduced), each sized to
its bucket, together at most the ``max_inflight`` largest buckets: when a bucket needs one and a
limit would be passed, the oldest reduce-scatter is waited for and its buffer reused (or, too
small, replaced by one of the right size; see [Note: gradient storage] in `zero_kernels.buffers`).

    autograd   | fill b0 | fill b1 | wait RS b0, fill b2 | wait RS b1, fill b3 |
    buffers      A         A B       B A (reused)          A B (reused)
"""

from __future__ import annotations

import weakref

import torch

from .. import comm
from ..buffers import GradStore
from ..layout import Layout

__all__ = ["Reducer"]


class Reducer:
    def __init__(
        self,
        layout: Layout,
        params: dict[int, torch.Tensor],
        grads: GradStore,
        rank: int,
        group,
        log: comm.CommLog,
    ):
        self.layout, self.grads, self.rank, self.group, self.log = layout, grads, rank, group, log
        self.stage = grads.stage
        self.sync = True  # False inside no_sync()
        self.overlap = True  # False: launch every bucket at the end of backward instead
        self.max_inflight = grads.max_inflight  # stage 2: bucket buffers held at once
        # Global launch order over (buffer, bucket): by the smallest param index inside,
        # descending, i.e. the order in which autograd usually finishes the buckets (a bucket is
        # finished by its earliest-registered param: stage 3's root unit holds the embedding,
        # whose gradient comes last, beside the final norm, whose gradient comes first).
        order = []
        for i, buf in enumerate(layout.buffers):
            for b in buf.buckets:
                key = min((buf.slots[s].index for s in b.slots), default=-1)
                order.append((-key, i, b.index))
        self.order = [(i, b) for _, i, b in sorted(order)]
        self.need = {
            (i, b.index): len(b.slots) for i, buf in enumerate(layout.buffers) for b in buf.buckets
        }
        self.fresh = {k: True for k in self.need}  # stage 2: next reduce overwrites the shard
        self.reduced = {k: False for k in self.need}  # stage 1: reduced in place, not rebased
        # stage 1: slot positions written since zero_grad, per bucket (the rest is stale)
        self.written: dict[tuple[int, int], set[int]] = {k: set() for k in self.need}
        self._reset_pass()
        self.handles: list[tuple[int, int, comm.Handle, torch.Tensor | None]] = []
        self.dirty = False  # grads accumulated locally and not yet reduced
        self.got: set[int] = set()  # params that got a local grad since the last `on_reduced`
        # callbacks of the owner: the first grad hook of a backward pass, the end of a reduction
        self.on_backward_start = None
        self.on_reduced = None
        self.on_bucket_ready = None  # stage 3: every grad of a bucket arrived (free its params)
        self._hooks = []
        self._hook_cache: dict = {}
        me = weakref.ref(self)  # hooks must not keep the reducer (and its optimizer) alive
        for i, buf in enumerate(layout.buffers):
            for pos, slot in enumerate(buf.slots):
                p = params[slot.index]
                self._hooks.append(p.register_hook(_pre_hook(me)))
                self._hooks.append(p.register_post_accumulate_grad_hook(_post_hook(me, i, pos)))

    def handles_to_remove(self) -> list:
        """The hook handles (removed by ``remove_hooks`` or a finalizer of the owner)."""
        return self._hooks

    def _reset_pass(self) -> None:
        self.arrived = {k: 0 for k in self.need}
        self.launched: set[tuple[int, int]] = set()
        self.next = 0
        self.callback_queued = False
        self.pass_started = False

    def before_grad(self) -> None:
        """A grad is about to be accumulated into a param: tell the owner once per pass."""
        if not self.pass_started:
            self.pass_started = True
            if self.on_backward_start is not None:
                self.on_backward_start()

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
        b = slot.bucket
        off = slot.start - buf.buckets[b].start

        def hook(p: torch.Tensor) -> None:
            g = p.grad
            p.grad = None
            if g is None:
                return
            if g.layout != torch.strided:
                raise NotImplementedError(
                    f"param {slot.name or slot.index} got a {g.layout} gradient: ZeroOptimizer "
                    "takes dense gradients only (e.g. nn.Embedding(sparse=False))"
                )
            self.got.add(slot.index)
            syncing = self.sync or self.stage == 2
            if syncing and not self.callback_queued:
                self.callback_queued = True
                torch.autograd.Variable._execution_engine.queue_callback(self.finish)
            if (i, b) in self.launched:  # a second grad for it in this pass (retain_graph)
                self.wait_all()
                self.launched.discard((i, b))
                self.arrived[(i, b)] = 0
            dst = self._bucket(i, b)[off : off + slot.numel]
            if self.stage == 1 and pos not in self.written[(i, b)]:
                dst.copy_(g.reshape(-1))
                self.written[(i, b)].add(pos)
            else:
                dst.add_(g.reshape(-1))
            self.dirty = True
            if syncing:
                self.arrived[(i, b)] += 1
                if self.arrived[(i, b)] == self.need[(i, b)] and self.on_bucket_ready:
                    self.on_bucket_ready(i, b)
                if self.overlap:
                    self._launch_ready()

        return hook

    def _launch_ready(self) -> None:
        while self.next < len(self.order):
            k = self.order[self.next]
            if k not in self.launched and self.arrived[k] < self.need[k]:
                return
            if k not in self.launched:
                self._launch(*k)
            self.next += 1

    def _bucket(self, i: int, b: int) -> torch.Tensor:
        """The bucket's local grad storage, ready to accumulate into."""
        if self.stage == 1:
            if self.reduced[(i, b)]:
                self._rebase(i, b)
        elif (i, b) not in self.grads.live:
            # bound the buffers: wait for the oldest reduce-scatters until one is free
            while self.handles and not self.grads.fits(i, b):
                self._finalize(*self.handles.pop(0))
        return self.grads.bucket(i, b)

    def _rebase(self, i: int, b: int) -> None:
        """Stage 1: make a reduced-in-place bucket accumulate again (see [Note: overlap])."""
        bk = self.layout.buffers[i].buckets[b]
        n = self.layout.world_size
        t = self.grads.bucket(i, b)
        lo = bk.shard_start(self.rank) - bk.start
        t[:lo].zero_()
        t[lo + bk.shard_numel :].zero_()
        if n > 1:
            t[lo : lo + bk.shard_numel].mul_(n)
        self.reduced[(i, b)] = False

    def _zero_unwritten(self, i: int, b: int) -> None:
        """Stage 1: zero the ranges of bucket ``b`` that got no grad since zero_grad."""
        buf = self.layout.buffers[i]
        bk = buf.buckets[b]
        done = self.written[(i, b)]
        if len(done) < len(bk.slots):
            full = self.grads.full[i]
            for pos in bk.slots:
                if pos not in done:
                    slot = buf.slots[pos]
                    full[slot.start : slot.end].zero_()
            done.update(bk.slots)

    def _launch(self, i: int, b: int) -> None:
        inp = self._bucket(i, b)
        tmp = None
        if self.stage == 1:
            self._zero_unwritten(i, b)
            out = self.grads.shard(i, b)  # in place: the rank's slice of ``inp``
            self.reduced[(i, b)] = True
        elif not self.fresh[(i, b)]:
            tmp = out = torch.empty_like(self.grads.shard(i, b))  # added to the shard after
        else:
            out = self.grads.shard(i, b)
        self.fresh[(i, b)] = False
        h = comm.reduce_scatter(out, inp, group=self.group, avg=True, log=self.log)
        self.handles.append((i, b, h, tmp))
        self.launched.add((i, b))
        if self.stage == 2:  # release the buffers of finished reduce-scatters early
            while self.handles and _completed(self.handles[0][2]):
                self._finalize(*self.handles.pop(0))

    def _finalize(self, i: int, b: int, h: comm.Handle, tmp: torch.Tensor | None) -> None:
        h.wait()
        if tmp is not None:
            self.grads.shard(i, b).add_(tmp)
        if self.stage == 2:
            self.grads.release(i, b)

    def wait_all(self) -> None:
        for item in self.handles:
            self._finalize(*item)
        self.handles.clear()

    def finish(self) -> None:
        """End of a synchronising backward: launch what is left, in order, and wait for all."""
        for k in self.order:
            if k not in self.launched:
                self._launch(*k)
        self.wait_all()
        self._reset_pass()
        self.dirty = False
        if self.on_reduced is not None:
            self.on_reduced()

    def flush(self) -> None:
        """Before the step: reduce whatever was accumulated but not reduced (e.g. after no_sync)."""
        if self.dirty or self.handles:
            self.finish()
        if self.stage == 1:  # buckets not reduced since zero_grad: zero grads
            for k, done in self.reduced.items():
                if not done:
                    self._zero_unwritten(*k)
                    self.grads.shard(*k).zero_()

    def zero_grad(self) -> None:
        self.flush_pending_waits()
        for k in list(self.grads.live):
            self.grads.release(*k)
        self.grads.zero()
        for k in self.fresh:
            self.fresh[k] = True
            self.reduced[k] = False
            self.written[k].clear()
        self._reset_pass()
        self.dirty = False

    def flush_pending_waits(self) -> None:
        if self.handles:
            self.wait_all()


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


def _completed(h: comm.Handle) -> bool:
    return h.work is None or h.work.is_completed()
