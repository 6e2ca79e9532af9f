"""The optimizer over this rank's shard: fp32 master shards, the inner torch optimizer, the step.

[Note: modes]
What the optimizer steps: for fp32 (and float64) params, the rank's shard of each bucket *inside
the param buffer* (no master copy: the step updates the params in place and the all-gather input
is already there); for bf16/fp16, a separate fp32 master shard per flat buffer (every bucket's
shard, concatenated), copied (cast) into the param buffer after the step. float64 params are
stepped in float64, with float64 gradients: never through a lower precision.

The inner torch optimizer sees one tensor per *piece* (see `zero_kernels.layout.Piece`): the part
of a parameter inside this rank's shard, a view of the master shard (shaped like the parameter
when the piece is the whole parameter), its ``.grad`` a view of the reduced gradient shard. So:

- torch's own per-parameter rules hold: a parameter left out of a step (no gradient on any rank,
  see [Note: gradients] in `zero_kernels.partition.grads`) has ``.grad = None`` on every piece and
  the inner optimizer skips it (no weight decay, no momentum, its state neither created nor
  advanced); each parameter keeps its own ``step``;
- ``flat`` mode (element-wise optimizers): a piece is the intersection of a parameter with the
  shard; ``whole`` mode: every parameter lies wholly in its owner's shard (see [Note: layout]),
  so per-tensor optimizers (Adafactor, Muon, LAMB-like) compute exactly the unsharded result.

Adam/AdamW in flat mode skip the inner step and run `zero_kernels.ops.adam_step` on the bucket's
whole shard in one call (grad scale, update, copy-out into the low-precision param shard in one
pass). Their per-piece state lives in torch's format in the inner optimizer's ``state``, as views
of one flat ``exp_avg``/``exp_avg_sq`` per bucket; when the bucket's pieces disagree (one left out
of the step, or a different ``step`` count), the kernel runs once per run of consecutive pieces
that agree.

After the step each bucket's updated shard (copied or cast from the master where there is one)
is all-gathered from the rank's slice of the flat param buffer, in the params' dtype, in place.
"""

from __future__ import annotations

import contextlib

import torch

from .. import comm
from ..buffers import GradStore, ParamStore, dtype_of
from ..layout import Layout, Piece, pieces
from ..ops import AdamHyper, adam_step
from ..ops.lowbit import DEFAULT_STATE_BLOCK, adam_step_lowbit
from ..ops.sr import sr_key, stochastic_round_bf16_
from .lowbit_state import INT8_KEYS, Int8ShardState
from .residency import ADAM_KEYS as _ADAM_KEYS
from .residency import Residency

__all__ = ["ShardRunner", "FUSED_ADAM_CLASSES"]

FUSED_ADAM_CLASSES = (torch.optim.Adam, torch.optim.AdamW)
_FUSED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class ShardRunner(Residency):
    def __init__(
        self,
        layout: Layout,
        store: ParamStore,
        grads: GradStore,
        rank: int,
        optimizer_class,
        group_opts: list[dict],
        defaults: dict,
        *,
        fused: bool,
        backend: str = "auto",
        state_dtype: str = "fp32",
        state_block: int = DEFAULT_STATE_BLOCK,
        stochastic_round: bool = False,
        state_device: torch.device | None = None,
    ):
        self.layout, self.store, self.grads, self.rank = layout, store, grads, rank
        dtypes = [dtype_of(b.dtype) for b in layout.buffers]
        # where the masters and the moments live: the params' device, or the host with
        # offload_optimizer="cpu" ([Note: host tier] in zero_kernels.offload.host)
        dev = store.device if state_device is None else torch.device(state_device)
        self.state_device = dev
        self.optimizer_class = optimizer_class
        n = layout.world_size
        # fused Adam per buffer: flat mode, a dtype the kernel takes
        self.fused = [
            fused and layout.mode == "flat" and dtypes[i] in _FUSED_DTYPES
            for i in range(len(layout.buffers))
        ]
        # bf16_stochastic_round: bf16 buffers stepped on an fp32 copy, no master (the check
        # that they are all fused is build's); [Note: stochastic rounding] in zero_kernels.ops.sr
        self.sr = [
            stochastic_round and self.fused[i] and dtypes[i] == torch.bfloat16
            for i in range(len(layout.buffers))
        ]
        # fp32 master shard per flat buffer; None for fp32/fp64 params (see [Note: modes])
        self.masters: list[torch.Tensor | None] = []
        tier = store.tier  # offload_params: masters in its mappings ([Note: param offload])
        for i, buf in enumerate(layout.buffers):
            if dtypes[i] in (torch.float32, torch.float64) or self.sr[i]:
                self.masters.append(None)
            elif tier is not None and i in tier.masters:
                self.masters.append(tier.masters[i])
            else:
                self.masters.append(
                    torch.empty(buf.shard_numel(n), dtype=torch.float32, device=dev)
                )
        self.load_masters(keep=False)
        self.pieces: tuple[tuple[Piece, ...], ...] = pieces(layout, rank)
        # per buffer: the inner params (one per piece) and their gradient views
        self.inner_params: list[list[torch.Tensor]] = []
        self.grad_views: list[list[torch.Tensor]] = []
        for i, buf in enumerate(layout.buffers):
            ps, gs = [], []
            for pc in self.pieces[i]:
                b = buf.buckets[pc.bucket]
                lo = pc.start - b.shard_start(rank)
                shape = buf.slots[pc.slot].shape if pc.whole else (pc.numel,)
                ps.append(self.master_view(i, pc.bucket)[lo : lo + pc.numel].view(shape))
                gs.append(grads.shard(i, pc.bucket)[lo : lo + pc.numel].view(shape))
            self.inner_params.append(ps)
            self.grad_views.append(gs)
        groups = [
            {**group_opts[buf.group], "params": self.inner_params[i]}
            for i, buf in enumerate(layout.buffers)
        ]
        self.inner = optimizer_class(groups, **defaults)
        self.quantize: tuple[int, int] | None = None  # (bits, block) of quantize_weights
        self.own_exact = True  # False with a secondary shard: the own chunk dequantized too
        self._exact = False
        self.backend = backend
        self.state_dtype = state_dtype  # the fused step's moments ([Note: low-bit state])
        self.flat_state: dict[tuple[int, int], dict[str, torch.Tensor]] = {}  # fused: per bucket
        # fused: per (buffer, state name), the whole shard's state; `flat_state` holds views
        self._state_whole: dict[tuple[int, str], torch.Tensor] = {}
        self.swap = None  # zero_kernels.offload.StateSwapper: the moments on disk ([Note: offload])
        # zero_kernels.offload.HostTier: masters and moments in host memory, the step on the
        # CPU for params on a GPU ([Note: host tier])
        self.host = None
        self._resident = 0  # depth of `resident` (the moments read into RAM)
        # `window`: the buckets whose moments are in RAM now, (i, b) -> name -> tensor
        self._window: dict[tuple[int, int], dict[str, torch.Tensor]] | None = None
        self.window_peak_bytes = 0  # the most bytes of moments one window held
        # state_dtype="int8": codes and scales on piece-aligned blocks ([Note: int8 shard state])
        self.int8 = None
        if state_dtype == "int8":
            self.int8 = Int8ShardState(layout, rank, self.pieces, self.fused, state_block, dev)
        self._decoded = 0  # depth of `resident` for int8 state (decoded to fp32 meanwhile)

    def _slice(self, i: int, b: int) -> slice:
        """Bucket ``b``'s shard inside the rank's shard of buffer ``i``."""
        bk = self.layout.buffers[i].buckets[b]
        off = bk.start // self.layout.world_size
        return slice(off, off + bk.shard_numel)

    def load_masters(self, keep: bool = True) -> None:
        """fp32 masters from the params' shards (construction, or params set from outside).
        ``keep``: a master that rounds to its param's value now is kept, so that loading a
        model's own low-precision values (``model.load_state_dict`` after or before
        ``opt.load_state_dict`` restored the masters, an edit of other elements) does not round
        the masters of the values it did not change."""
        for i, buf in enumerate(self.layout.buffers):
            if self.masters[i] is not None:
                for b in buf.buckets:
                    # offloaded: the shard read, the master read (or, new, written) and back
                    with (
                        self.store.using(i, b.index),
                        self._master_using(i, b.index, dirty=True, fresh=not keep),
                    ):
                        m = self.masters[i][self._slice(i, b.index)]
                        s = self.store.shard(i, b.index).to(m.device)  # host tier: a copy
                        if keep:
                            m.copy_(torch.where(m.to(s.dtype) == s, m, s.to(m.dtype)))
                        else:
                            m.copy_(s)

    def _master_using(self, i: int, b: int, dirty: bool = False, fresh: bool = False):
        """A context in which bucket ``b``'s fp32 master holds its values (offloaded with the
        params: [Note: param offload]; else nothing to do)."""
        t = self.store.tier
        if t is None or (i, b, "master") not in t:
            return contextlib.nullcontext()
        return t.using((i, b, "master"), dirty=dirty, fresh=fresh)

    def master_view(self, i: int, b: int) -> torch.Tensor:
        """The values the optimizer steps for this rank's shard of bucket ``b`` of buffer ``i``:
        a view of the fp32 master shard, or of the param shard itself for fp32/fp64 params."""
        m = self.masters[i]
        return self.store.shard(i, b) if m is None else m[self._slice(i, b)]

    def write_params(self) -> None:
        """Cast the masters into the params' shards (values set from outside a step)."""
        for i, buf in enumerate(self.layout.buffers):
            if self.masters[i] is not None:
                for b in buf.buckets:
                    with (
                        self._master_using(i, b.index),
                        self.store.using(i, b.index, dirty=True, fresh=True),
                    ):
                        self.store.shard(i, b.index).copy_(self.masters[i][self._slice(i, b.index)])

    def all_pieces(self):
        """``(buffer, position, piece, inner param, grad view)`` for every piece of this rank."""
        for i, ps in enumerate(self.pieces):
            for k, pc in enumerate(ps):
                yield i, k, pc, self.inner_params[i][k], self.grad_views[i][k]

    # ---------------------------------------------------------------- step
    def sync_hyper(self, user_groups: list[dict]) -> list[dict]:
        """Copy hyper-parameters (lr schedules, ...) from the user's groups into the inner ones;
        returns what the inner groups hold then (for `take_group_keys` after the step)."""
        for i, buf in enumerate(self.layout.buffers):
            g = self.inner.param_groups[i]
            for k, v in user_groups[buf.group].items():
                if k != "params":
                    g[k] = v
        return [{k: v for k, v in g.items() if k != "params"} for g in self.inner.param_groups]

    def take_group_keys(self, user_groups: list[dict], before: list[dict]) -> None:
        """The other direction, after a step: keys the inner optimizer's step added to its
        param groups, or set to another value, go into the user's groups (as torch's
        ZeroRedundancyOptimizer copies its inner groups back), so ``opt.param_groups`` shows
        what the unsharded optimizer's groups would. Several inner groups of one user group
        (one per flat buffer): the last one's value."""
        for i, buf in enumerate(self.layout.buffers):
            was = before[i]
            for k, v in self.inner.param_groups[i].items():
                if k != "params" and (k not in was or was[k] is not v):
                    user_groups[buf.group][k] = v

    @property
    def scales_in_kernel(self) -> bool:
        """Whether every buffer's step takes a gradient scale (else grads must be scaled first)."""
        return all(self.fused)

    def step(
        self,
        active: set[int],
        grad_scale: float,
        log: comm.CommLog,
        group,
        step_kwargs: dict | None = None,
    ) -> list[tuple[tuple[int, int], comm.Handle]]:
        """One optimizer step on the shard for the params in ``active`` (indices; the others are
        left out, as torch does for ``grad=None``); returns ``((buffer, bucket), handle)`` of the
        all-gathers of the new params (stages 1/2). ``grad_scale`` multiplies the reduced
        gradients (1/loss scale, clipping) inside the fused kernel; it must be 1 unless
        `scales_in_kernel`. ``step_kwargs`` go to the inner optimizer's ``step`` (see
        `zero_kernels.optimizer.validate.check_step_kwargs`)."""
        for i, _k, pc, p, g in self.all_pieces():
            p.grad = g if pc.index in active and not self.fused[i] else None
        if not all(self.fused):
            assert grad_scale == 1.0, "unfused steps take gradients already scaled"
            with self.store.resident():  # offloaded param shards: all in RAM for torch's step
                self.inner.step(**(step_kwargs or {}))
        else:
            assert not step_kwargs, "the fused kernel takes no step keywords"
        handles: list[tuple[tuple[int, int], comm.Handle]] = []
        # last bucket first: it holds the first params of the forward (reverse layout), so its
        # all-gather is the first one the next forward needs
        order = [
            (i, b.index) for i, buf in enumerate(self.layout.buffers) for b in reversed(buf.buckets)
        ]
        src = None
        if self.swap is not None and not self._resident:  # moments streamed ([Note: offload])
            src = self.swap.stream([(i, b) for i, b in order if self.fused[i]])
        if self.host is not None:  # every bucket's gradient (and param) copies queued
            self.host.begin(order)
        try:
            for i, b in order:
                # offloaded: the shard and its master read (ahead), written back behind
                with self.store.using(i, b, dirty=True), self._master_using(i, b, dirty=True):
                    self._step_bucket(i, b, active, grad_scale, src, log, group, handles)
            if src is not None:
                next(src, None)  # the last bucket's write, then every write finished
        finally:
            if src is not None:
                src.close()
            if self.store.tier is not None:
                self.store.tier.end_step()  # writes finished; the order to read ahead by
        for _, _, _, p, _ in self.all_pieces():
            p.grad = None
        return handles

    def _step_bucket(self, i, b, active, grad_scale, src, log, group, handles) -> None:
        """`step` of bucket ``b`` of buffer ``i`` (``src``: the moments' stream, or None)."""
        m = self.masters[i]
        lowp = m is not None
        dst = self.store.shard(i, b)
        host = self.host
        if host is not None:  # the step on host copies ([Note: host tier])
            dst, grad = host.arrived(i, b)
            master = None if lowp else dst  # fp32: the host copy of the param shard
            if self.sr[i]:
                self._sr_bucket(i, b, active, grad_scale, None, dst, grad=grad)
            else:
                self._fused_bucket(
                    i, b, active, grad_scale, dst if lowp else None, master=master, grad=grad
                )
            host.send(i, b)  # the new shard back to the device, before its all-gather
        elif self.sr[i]:
            self._sr_bucket(i, b, active, grad_scale, src, dst)
        elif self.fused[i] and src is None:
            self._fused_bucket(i, b, active, grad_scale, dst if lowp else None)
        elif self.fused[i]:  # chunk by chunk through the staging buffers
            plan = self._bucket_runs(i, b, active)
            for lo, hi in self.swap.chunks(i, b):
                key, span, flat, done = next(src)
                assert key == (i, b) and span == (lo, hi), (key, span, i, b, lo, hi)
                stepped = plan is not None and self._adam_runs(
                    i, b, plan, grad_scale, dst if lowp else None, flat, lo, hi
                )
                done(stepped)
        if m is not None and not (self.fused[i] and lowp):
            dst.copy_(m[self._slice(i, b)])
        if not self.store.sharded:  # stage 3 gathers at the next use instead
            handles.append(((i, b), self.gather(i, b, log, group)))

    def _sr_bucket(self, i, b, active, grad_scale, src, dst, grad=None) -> None:
        """bf16_stochastic_round: the step on an fp32 copy of the bucket's bf16 shard, each
        stepped piece rounded back with the key of its param and step ([Note: stochastic
        rounding] in `zero_kernels.ops.sr`)."""
        x = dst.float()
        plan = self._bucket_runs(i, b, active)
        if src is None:
            if plan is not None:
                flat = self._flat_state(i, b, plan[0])
                self._adam_runs(
                    i, b, plan, grad_scale, None, flat, 0, dst.numel(), master=x, grad=grad
                )
        else:  # the moments chunk by chunk through the staging buffers
            for lo, hi in self.swap.chunks(i, b):
                key, span, flat, done = next(src)
                assert key == (i, b) and span == (lo, hi), (key, span, i, b, lo, hi)
                done(
                    plan is not None
                    and self._adam_runs(i, b, plan, grad_scale, None, flat, lo, hi, master=x)
                )
        if plan is None:
            return
        lo0 = self.layout.buffers[i].buckets[b].shard_start(self.rank)
        for pc, s in plan[2]:
            lo = pc.start - lo0
            key = sr_key(s, pc.index)
            stochastic_round_bf16_(
                dst[lo : lo + pc.numel], x[lo : lo + pc.numel], key, pc.offset, self.backend
            )

    def _fused_bucket(
        self, i: int, b: int, active, grad_scale: float, out_lowp, master=None, grad=None
    ) -> bool:
        """Adam/AdamW on bucket ``b``'s shard: one kernel call when its pieces agree, else one
        per run of consecutive active pieces with the same ``step`` (see [Note: modes]).
        ``master``, ``grad``: what is stepped and its gradient, if not the runner's own (the
        host tier's copies). Returns whether anything was stepped."""
        plan = self._bucket_runs(i, b, active)
        if plan is None:
            return False
        flat = self._flat_state(i, b, plan[0])
        n = self.layout.buffers[i].buckets[b].shard_numel
        return self._adam_runs(i, b, plan, grad_scale, out_lowp, flat, 0, n, master, grad)

    def _bucket_runs(self, i: int, b: int, active):
        """Advance the ``step`` of the bucket's active pieces; ``(group, runs, stepped)`` with
        runs ``(first element, end, step)`` inside the bucket's shard and stepped the active
        pieces' ``(piece, step)``, or None without pieces."""
        ks = [k for k, pc in enumerate(self.pieces[i]) if pc.bucket == b]
        if not ks:
            return None
        g = self.inner.param_groups[i]
        if self.swap is None or self._resident:
            flat = self._flat_state(i, b, g)
        else:
            flat = {}  # offloaded: the pieces' state holds ``step`` only
        bk = self.layout.buffers[i].buckets[b]
        lo0 = bk.shard_start(self.rank)
        runs: list[tuple[int, int, int]] = []  # (first element, end, step) inside the shard
        stepped = []
        joined = False  # whether the next active piece may extend the last run
        for k in ks:
            pc = self.pieces[i][k]
            if pc.index not in active:
                joined = False  # a left-out piece ends the run: it must not be stepped
                continue
            st = self._piece_state(i, k, flat, g)
            st["step"] += 1
            s = int(st["step"].item())
            stepped.append((pc, s))
            lo, hi = pc.start - lo0, pc.start - lo0 + pc.numel
            if joined and runs[-1][2] == s:
                runs[-1] = (runs[-1][0], hi, s)
            else:
                runs.append((lo, hi, s))
            joined = True
        if len(runs) == 1 and all(self.pieces[i][k].index in active for k in ks):
            runs = [(0, bk.shard_numel, runs[0][2])]  # the whole shard, padding included
        return g, runs, stepped

    def _adam_runs(
        self, i, b, plan, grad_scale, out_lowp, flat, clo, chi, master=None, grad=None
    ) -> bool:
        """The kernel on ``plan``'s runs cut to ``[clo, chi)`` of the bucket's shard; ``flat``:
        the moments of that range (the whole bucket's, or a staging chunk's: [Note: offload]);
        ``master``: what is stepped (default the master or the param shard); ``grad``: its
        gradient (default the reduced gradient shard).
        Returns whether anything was stepped."""
        g, runs = plan[0], plan[1]
        master = self.master_view(i, b) if master is None else master
        grad = self.grads.shard(i, b) if grad is None else grad
        stepped = False
        for lo, hi, s in runs:
            lo, hi = max(lo, clo), min(hi, chi)
            if hi <= lo:
                continue
            stepped = True
            hyper = self._adam_hyper(g, s, grad_scale)
            if hyper.amsgrad and "max_exp_avg_sq" not in flat:
                raise ValueError(
                    "amsgrad=True set after the ZeroOptimizer was built with "
                    "offload_optimizer='nvme': the offload file has no max_exp_avg_sq; set "
                    "amsgrad at construction"
                )
            a, z = lo - clo, hi - clo
            if self.int8 is not None:
                assert not self._decoded, "a step inside ShardRunner.resident()"
                out = None if out_lowp is None else out_lowp[lo:hi]
                staged = (flat, clo) if self.swap is not None and not self._resident else None
                self.int8.step(
                    i, b, lo, hi, master[lo:hi], grad[lo:hi], hyper, out, self.backend, staged
                )
                continue
            if self.state_dtype != "fp32":
                st = {"exp_avg": flat["exp_avg"][a:z], "exp_avg_sq": flat["exp_avg_sq"][a:z]}
                out = None if out_lowp is None else out_lowp[lo:hi]
                adam_step_lowbit(
                    master[lo:hi],
                    grad[lo:hi],
                    st,
                    hyper,
                    state_dtype=self.state_dtype,
                    out_lowp=out,
                    backend=self.backend,
                )
                continue
            adam_step(
                master[lo:hi],
                grad[lo:hi],
                flat["exp_avg"][a:z],
                flat["exp_avg_sq"][a:z],
                hyper,
                max_exp_avg_sq=flat["max_exp_avg_sq"][a:z] if hyper.amsgrad else None,
                out_lowp=None if out_lowp is None else out_lowp[lo:hi],
                backend=self.backend,
            )
        return stepped

    def _flat_state(self, i: int, b: int, g: dict) -> dict[str, torch.Tensor]:
        """The bucket's flat Adam state (created at its first step, zeros, as torch does)."""
        if self.swap is not None and not self._resident:
            raise RuntimeError(
                "the Adam moments are offloaded (offload_optimizer='nvme'): read them inside "
                "ShardRunner.resident()"
            )
        key = (i, b)
        if key not in self.flat_state:
            names = _ADAM_KEYS if g.get("amsgrad", False) else _ADAM_KEYS[:2]
            if self.int8 is not None and not self._decoded:
                names = INT8_KEYS
            self.flat_state[key] = {k: self._state_view(i, b, k) for k in names}
        return self.flat_state[key]

    def _state_view(self, i: int, b: int, name: str) -> torch.Tensor:
        """Bucket ``b``'s range of buffer ``i``'s contiguous Adam state ``name``, the whole
        buffer's tensor allocated (zeros) at the first use of any of its buckets.

        One tensor per buffer and name, not one per bucket: the state lives as long as the
        optimizer, and per-bucket tensors of a few MB, allocated at the first step while the
        heap is full of the step's transients, land in glibc's heap among them (its mmap
        threshold has risen by then) and pin the holes between them for the run (68-block GPT,
        4 ranks: an 813 MiB arena with 289 MiB free; CHANGELOG.md, "Benchmarks history (moved
        from docs/benchmarks.md)"). A tensor
        the size of the rank's shard is above any threshold glibc sets, so it is a mapping of
        its own, and its zero pages are touched only when stepped."""
        if self.int8 is not None:
            if self._decoded:
                return self.int8.decoded_view(i, b, name)
            return self.int8.view(i, b, name)
        if self._window is not None:
            if (i, b) not in self._window:
                raise RuntimeError(
                    f"the offloaded moments of bucket {b} of buffer {i} were read outside the "
                    "ShardRunner.window holding them"
                )
            if name not in self._window[(i, b)]:
                self._refuse_names({name})
            return self._window[(i, b)][name]
        key = (i, name)
        whole = self._state_whole.get(key)
        if whole is None:
            n = self.layout.buffers[i].shard_numel(self.layout.world_size)
            dt = torch.bfloat16 if self.state_dtype == "bf16" else torch.float32
            whole = torch.zeros(n, dtype=dt, device=self.state_device)
            self._state_whole[key] = whole
        return whole[self._slice(i, b)]

    def _piece_state(self, i: int, k: int, flat: dict, g: dict) -> dict:
        """Torch Adam's state for piece ``k`` of buffer ``i``: views of the bucket's flat state."""
        p = self.inner_params[i][k]
        st = self.inner.state[p]
        if len(st) == 0:
            pc = self.pieces[i][k]
            lo = pc.start - self.layout.buffers[i].buckets[pc.bucket].shard_start(self.rank)
            st["step"] = torch.tensor(0.0, dtype=torch.float32)
            if self.int8 is not None and not self._decoded:
                if self.swap is None or self._resident:  # offloaded: views only while resident
                    st.update(self.int8.piece_views(i, k, pc, lo))
            elif self.swap is None or self._resident:  # offloaded: views only while resident
                for name, t in flat.items():
                    st[name] = t[lo : lo + pc.numel].view(p.shape)
        return st

    def piece_flat_state(self, i: int, k: int) -> dict[str, torch.Tensor]:
        """Fused Adam buffers only: piece ``k`` of buffer ``i``'s ranges of its bucket's flat
        state (``exp_avg``, ``exp_avg_sq``, ``max_exp_avg_sq`` with amsgrad), 1-D views to read
        or write in place (checkpoint loads); created (zeros) if the bucket has none yet."""
        assert self.fused[i], f"buffer {i} is not stepped by the fused Adam kernel"
        assert self.int8 is None or self._decoded, "int8 state: element-wise only while resident"
        pc = self.pieces[i][k]
        flat = self._flat_state(i, pc.bucket, self.inner.param_groups[i])
        lo = pc.start - self.layout.buffers[i].buckets[pc.bucket].shard_start(self.rank)
        return {name: t[lo : lo + pc.numel] for name, t in flat.items()}

    def restart_piece(self, i: int, k: int) -> None:
        """Piece ``k`` of buffer ``i`` was loaded without state: where its bucket's fused
        moments exist (in RAM, or read in: `resident`, `window`), its range restarts at 0."""
        pc = self.pieces[i][k]
        if not self.fused[i]:
            return
        if self.swap is not None and self._resident:
            flat = self._flat_state(i, pc.bucket, self.inner.param_groups[i])
        else:
            flat = self.flat_state.get((i, pc.bucket))
        if flat:
            lo = pc.start - self.layout.buffers[i].buckets[pc.bucket].shard_start(self.rank)
            for t in flat.values():
                t[lo : lo + pc.numel].zero_()

    def adopt_state(self, only=None) -> None:
        """After the inner optimizer's state was loaded (new tensors): move fused buffers' Adam
        state back into the per-bucket flat tensors, the pieces' entries becoming views (of
        the buckets ``only``, a set of (i, b), if given)."""
        for i, ps in enumerate(self.pieces):
            if not self.fused[i]:
                continue
            g = self.inner.param_groups[i]
            for k, pc in enumerate(ps):
                if only is not None and (i, pc.bucket) not in only:
                    continue
                p = self.inner_params[i][k]
                st = self.inner.state.get(p)
                if not st:
                    continue
                flat = self._flat_state(i, pc.bucket, g)
                if "max_exp_avg_sq" in st and "max_exp_avg_sq" not in flat:
                    flat["max_exp_avg_sq"] = self._state_view(i, pc.bucket, "max_exp_avg_sq")
                lo = pc.start - self.layout.buffers[i].buckets[pc.bucket].shard_start(self.rank)
                for name, t in flat.items():
                    view = t[lo : lo + pc.numel].view(p.shape)
                    if name in st:
                        view.copy_(st[name])
                    st[name] = view
                st["step"] = torch.as_tensor(st["step"], dtype=torch.float32).clone()

    def gather(self, i: int, b: int, log, group, **bound) -> comm.Handle:
        """Start the all-gather of bucket ``b`` of buffer ``i`` from every rank's param shard
        (stage 3: the bucket must be allocated); ``bound``: `comm.all_gather`'s launch bounds.
        With ``quantize`` set (stage 3's quantize_weights) and outside `exact`, the other
        ranks' chunks come quantized ([Note: quantized all-gather])."""
        self.store.acquire_shard(i, b)  # offloaded: in RAM until the all-gather is waited for
        full, shard = self.store.full(i, b), self.store.gather_input(i, b)
        if self.quantize is not None and not self._exact:
            bits, block = self.quantize
            h = comm.quant.all_gather_quantized(
                full,
                shard,
                bits=bits,
                block=block,
                group=group,
                log=log,
                own_exact=self.own_exact,
                **bound,
            )
        else:
            h = comm.all_gather(full, shard, group=group, log=log, **bound)
        return self.store.release_after(i, b, h)

    @property
    def exact_now(self) -> bool:
        """Whether gathers now hand params out (inside `exact`)."""
        return self._exact

    @contextlib.contextmanager
    def exact(self):
        """Gathers inside are exact (params handed out: state dicts, gathered_params, close)."""
        old, self._exact = self._exact, True
        try:
            yield
        finally:
            self._exact = old

    def _adam_hyper(self, g: dict, step: int, grad_scale: float) -> AdamHyper:
        """This step's scalars for torch Adam/AdamW's param group ``g``."""
        b1, b2 = (float(x) for x in g["betas"])
        adamw = (
            bool(g.get("decoupled_weight_decay", False))
            or self.optimizer_class is torch.optim.AdamW
        )
        return AdamHyper(
            lr=float(g["lr"]),
            beta1=b1,
            beta2=b2,
            eps=float(g["eps"]),
            weight_decay=float(g["weight_decay"]),
            step=step,
            adamw=adamw,
            amsgrad=bool(g.get("amsgrad", False)),
            maximize=bool(g.get("maximize", False)),
            grad_scale=grad_scale,
        )

    # ---------------------------------------------------------------- accounting
    def state_bytes(self) -> int:
        """Bytes of optimizer state, each storage once (fused state: views of flat tensors)."""
        seen: dict[int, int] = {}
        for st in self.inner.state.values():
            for v in st.values():
                if isinstance(v, torch.Tensor):
                    s = v.untyped_storage()
                    seen[s.data_ptr()] = s.nbytes()
        for flat in self.flat_state.values():
            for v in flat.values():
                seen[v.untyped_storage().data_ptr()] = v.untyped_storage().nbytes()
        return sum(seen.values())

    def master_bytes(self) -> int:
        """Bytes of separate fp32 master shards (0 for fp32 params: they are stepped in place)."""
        t = self.store.tier
        off = t.ram_bytes(master=True) if t is not None and t.masters else 0  # in RAM now
        return off + sum(
            m.numel() * m.element_size()
            for i, m in enumerate(self.masters)
            if m is not None and (t is None or i not in t.masters)
        )
