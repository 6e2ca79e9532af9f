"""`ZeroOptimizer`: ZeRO stage 1 / 2 over any torch optimizer. What users touch.

    opt = ZeroOptimizer(model, torch.optim.AdamW, stage=2, lr=1e-3)   # was: AdamW(model..., lr=)
    for x, y in data:
        opt.zero_grad()
        loss_fn(model(x), y).backward()        # buckets reduce-scatter during backward
        opt.clip_grad_norm_(1.0)               # optional; global norm over all shards
        opt.step()                             # shard step, then all-gather of the new params

Layers below: `layout` (where params live), `buffers` (flat tensors), `partition` (hooks,
reduce, sharded step, state conversion), `comm` (every collective). See [Note: overlap] in
`zero_kernels.partition.reducer` for the timeline and [Note: layout] for the bucket/shard ranges.
The model is not wrapped: do not also wrap it in DDP. Parameters become views into flat buffers
(``param.data`` is replaced, the Parameter objects stay the same); ``param.grad`` is always None
after backward: the reduced gradient lives in this rank's shard.

A trainable parameter that gets no gradient in a backward pass counts as a zero gradient (as in
DeepSpeed): the bucket still fires, ranks never hang, and optimizers with momentum or weight
decay still update it.
"""

from __future__ import annotations

import contextlib
import logging
import math
import zlib

import torch
from torch import nn

from . import comm
from .buffers import GradStore, flatten_params
from .layout import Layout, ParamSpec, build_layout
from .partition import (
    FUSED_ADAM_CLASSES,
    Reducer,
    ShardRunner,
    choose_mode,
    consolidate,
    local_payload,
    shard_state,
)

__all__ = ["ZeroOptimizer"]

log = logging.getLogger("zero_kernels")

_UNFUSABLE = ("differentiable", "capturable")


class ZeroOptimizer(torch.optim.Optimizer):
    """Shards ``optimizer_class``'s state (stage 1) and the gradients too (stage 2).

    Args:
        params: an ``nn.Module`` (names then appear in errors and layouts), or what torch
            optimizers take: an iterable of tensors or of param-group dicts.
        optimizer_class: a ``torch.optim.Optimizer`` subclass (not LBFGS).
        stage: 1 or 2.
        process_group: the data-parallel group (default: the world).
        bucket_size_mb: target size of a gradient bucket in MiB (at 4 bytes per element).
        overlap_comm: reduce buckets during backward (True) or all at the end (False).
        partition: "auto" (element-wise optimizers get flat shards, the rest whole params),
            "flat" or "whole" to force.
        fused_adam: use `zero_kernels.ops.adam_step` for torch Adam/AdamW (flat mode).
        kernel_backend: the ``backend`` of `zero_kernels.ops.adam_step` ("auto", "reference"...).
        loss_scale: None, a float (static) or "dynamic"; default "dynamic" with fp16 params.
        max_inflight_buckets: stage 2: most bucket buffers held at once (being filled or
            reduce-scattered); when a bucket needs one beyond it, the oldest reduce-scatter is
            waited for and its buffer reused. Bounds stage 2's communication buffers to this
            many buckets of ``bucket_size_mb``; 1 disables overlap. Default 2.
        **defaults: passed to ``optimizer_class``.

    Memory: with fp32 params there is no master copy: the optimizer steps the rank's shard of
    the param buffer in place. Stage 1 holds one full-size gradient buffer (the reduced shard
    is a view of it), stage 2 the reduced shard plus at most ``max_inflight_buckets`` bucket
    buffers (see [Note: gradient storage] in `zero_kernels.buffers`).

    Telemetry:
        ``memory_report() -> dict(param_bytes=, grad_bytes=, master_bytes=, optim_state_bytes=,
        model_state_bytes=, comm_buffer_bytes=, comm_buffer_peak_bytes=, grad_peak_bytes=,
        total_bytes=)``: this rank's bytes counted from its tensors. Model states (what the
        ZeRO formula counts) are params + grads + master + optimizer state
        (``optim_state_bytes`` excludes the fp32 master shard); ``comm_buffer_bytes`` are the
        stage-2 bucket buffers held now (kept between steps), ``comm_buffer_peak_bytes`` the
        most of them in use at once, ``grad_peak_bytes`` = grads + that peak;
        ``total_bytes`` = model states + comm buffers.
        ``comm_stats -> dict(reduce_scatter_bytes=, all_gather_bytes=, reduce_scatter_calls=,
        all_gather_calls=, all_reduce_calls=, exposed_comm_s=, steps=)``: cumulative since
        construction or ``reset_comm_stats()``; bytes are full bucket sizes per collective,
        ``exposed_comm_s`` is time spent waiting on collectives (after backward, after step).
    """

    def __init__(
        self,
        params,
        optimizer_class,
        *,
        stage: int = 2,
        process_group=None,
        bucket_size_mb: float = 25.0,
        overlap_comm: bool = True,
        partition: str = "auto",
        fused_adam: bool = True,
        loss_scale: float | str | None = "auto",
        kernel_backend: str = "auto",
        max_inflight_buckets: int = 2,
        **defaults,
    ):
        if stage not in (1, 2):
            raise ValueError(f"stage must be 1 or 2, got stage={stage!r}")
        if not bucket_size_mb > 0:
            raise ValueError(f"bucket_size_mb must be > 0, got bucket_size_mb={bucket_size_mb!r}")
        if not (isinstance(max_inflight_buckets, int) and max_inflight_buckets >= 1):
            raise ValueError(
                "max_inflight_buckets must be an int >= 1, got "
                f"max_inflight_buckets={max_inflight_buckets!r}"
            )
        self.mode, why = choose_mode(optimizer_class, partition)
        self.stage, self.group, self.overlap_comm = stage, process_group, overlap_comm
        self.optimizer_class = optimizer_class
        self.world_size = comm.world_size(process_group)
        self.rank = comm.rank(process_group)
        user_groups, names = _param_groups(params)
        # ---- layout (pure data), identical on every rank or an error on every rank
        specs, index_of, self._group_indices = [], {}, []
        for gi, g in enumerate(user_groups):
            idx = []
            for p in g["params"]:
                index_of[id(p)] = len(specs)
                idx.append(len(specs))
                specs.append(
                    ParamSpec(
                        len(specs),
                        gi,
                        str(p.dtype),
                        tuple(p.shape),
                        names.get(id(p), ""),
                        p.requires_grad,
                    )
                )
            self._group_indices.append(idx)
        self._params = {index_of[id(p)]: p for g in user_groups for p in g["params"]}
        if not any(s.requires_grad for s in specs):
            raise ValueError("ZeroOptimizer: no parameter has requires_grad=True")
        devices = {p.device for p in self._params.values()}
        if len(devices) != 1:
            raise ValueError(f"ZeroOptimizer: all params must be on one device, got {devices}")
        self.device = devices.pop()
        self.layout: Layout = build_layout(
            specs,
            self.world_size,
            bucket_numel=max(1, int(bucket_size_mb * 2**20) // 4),
            mode=self.mode,
        )
        self._check_same_layout(specs)
        log.info(
            "ZeroOptimizer: stage %d, %s mode (%s), %d flat buffer(s), %d bucket(s), world size %d",
            stage,
            self.mode,
            why,
            len(self.layout.buffers),
            sum(len(b.buckets) for b in self.layout.buffers),
            self.world_size,
        )
        # ---- buffers: params become views; rank 0's values win (as DDP does)
        self._flats = [flatten_params(b, self._params, self.device) for b in self.layout.buffers]
        for f in self._flats:
            comm.broadcast(f, 0, group=process_group)
        self.comm_log = comm.CommLog()
        self._steps = 0
        self._grads = GradStore(
            self.layout, stage, self.device, rank=self.rank, max_inflight=max_inflight_buckets
        )
        self._reducer = Reducer(
            self.layout, self._params, self._grads, self.rank, process_group, self.comm_log
        )
        self._reducer.overlap = bool(overlap_comm)
        # ---- the inner optimizer over this rank's master shard
        group_opts = [{k: v for k, v in g.items() if k != "params"} for g in user_groups]
        fusable = (
            optimizer_class in FUSED_ADAM_CLASSES
            and fused_adam
            and not any(g.get(k) or defaults.get(k) for g in group_opts for k in _UNFUSABLE)
        )
        self._runner = ShardRunner(
            self.layout,
            self._flats,
            self._grads,
            self.rank,
            optimizer_class,
            group_opts,
            defaults,
            fused=fusable,
            backend=kernel_backend,
        )
        super().__init__(user_groups, dict(self._runner.inner.defaults))
        # ---- loss scaling
        has_fp16 = any(p.dtype == torch.float16 and p.requires_grad for p in self._params.values())
        if loss_scale == "auto":
            loss_scale = "dynamic" if has_fp16 else None
        self._dynamic = loss_scale == "dynamic"
        if (
            loss_scale is not None
            and not self._dynamic
            and not (isinstance(loss_scale, (int, float)) and loss_scale > 0)
        ):
            raise ValueError(
                "loss_scale must be None, 'auto', 'dynamic' or a positive number, "
                f"got loss_scale={loss_scale!r}"
            )
        self.loss_scale = 2.0**16 if self._dynamic else float(loss_scale or 1.0)
        self._growth_tracker = 0
        self.growth_interval = 2000
        self._grad_factor = 1.0  # multiplies the reduced grads at the step: 1/loss scale * clip
        self._overflow: bool | None = None
        self.skipped_steps = 0

    # ------------------------------------------------------------------ checks
    def _check_same_layout(self, specs: list[ParamSpec]) -> None:
        key = repr([(s.group, s.dtype, s.shape, s.requires_grad) for s in specs])
        h = zlib.crc32(key.encode()) + 1
        t = torch.tensor([h, -h], dtype=torch.int64, device=self.device)
        comm.all_reduce(t, "max", group=self.group)
        if int(t[0]) != h or int(t[1]) != -h:
            raise ValueError(
                "ZeroOptimizer: ranks were given different parameters (shapes, "
                f"dtypes, groups or requires_grad differ); rank {self.rank} has "
                f"{len(specs)} params"
            )

    # ------------------------------------------------------------------ training loop API
    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients over micro-batches without reducing them (stage 1); stage 2
        still reduces every micro-batch to keep gradient memory sharded (same result)."""
        old = self._reducer.sync
        self._reducer.sync = False
        try:
            yield
        finally:
            self._reducer.sync = old

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss * loss_scale`` (fp16 dynamic loss scaling: call backward on this)."""
        return loss * self.loss_scale if self.loss_scale != 1.0 else loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._reducer.zero_grad()
        for p in self._params.values():
            p.grad = None
        self._grad_factor = 1.0 / self.loss_scale
        self._overflow = None

    def _finish_reduction(self) -> None:
        self._reducer.flush()
        if self._overflow is None:
            self._grad_factor = 1.0 / self.loss_scale
            if self.loss_scale != 1.0 or self._dynamic:
                bad = torch.zeros(1, device=self.device)
                for g in self._grads.shard_tensors():
                    if not bool(torch.isfinite(g).all()):
                        bad.fill_(1.0)
                        break
                comm.all_reduce(bad, "max", group=self.group, log=self.comm_log)
                self._overflow = bool(bad.item() != 0)
            else:
                self._overflow = False

    @torch.no_grad()
    def clip_grad_norm_(
        self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False
    ) -> torch.Tensor:
        """Clip the (reduced, unscaled) gradients to ``max_norm``; returns the global norm,
        exactly as ``torch.nn.utils.clip_grad_norm_`` on the unsharded model."""
        norm_type = float(norm_type)
        if norm_type < 0 or math.isnan(norm_type):
            raise ValueError(f"norm_type must be >= 0 or inf, got norm_type={norm_type!r}")
        self._finish_reduction()
        shards = self._grads.shard_tensors()
        if math.isinf(norm_type):
            local = max((float(g.abs().max()) for g in shards if g.numel()), default=0.0)
            t = torch.tensor([local], dtype=torch.float64, device=self.device)
            comm.all_reduce(t, "max", group=self.group, log=self.comm_log)
            total = float(t.item())
        else:
            s = sum(
                float(torch.linalg.vector_norm(g, norm_type).double() ** norm_type)
                if norm_type != 0
                else float((g != 0).sum())
                for g in shards
            )
            t = torch.tensor([s], dtype=torch.float64, device=self.device)
            comm.all_reduce(t, "sum", group=self.group, log=self.comm_log)
            total = float(t.item()) if norm_type == 0 else float(t.item()) ** (1.0 / norm_type)
        total *= abs(self._grad_factor)
        if error_if_nonfinite and not math.isfinite(total):
            raise RuntimeError(
                f"clip_grad_norm_: the total norm of order {norm_type} is "
                f"non-finite ({total}), error_if_nonfinite=True"
            )
        out = torch.tensor(total, dtype=torch.float32)
        coef = float(max_norm) / (float(out) + 1e-6)
        self._grad_factor *= min(coef, 1.0) if math.isfinite(coef) else coef
        return out

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._finish_reduction()
        if self._overflow:
            self.skipped_steps += 1
            if self._dynamic:
                self.loss_scale = max(self.loss_scale / 2.0, 1.0)
                self._growth_tracker = 0
            log.info(
                "ZeroOptimizer: non-finite gradients, step skipped on every rank; "
                "loss scale now %g",
                self.loss_scale,
            )
        else:
            self._runner.sync_hyper(self.param_groups)
            handles = self._runner.step(self._grad_factor, self.comm_log, self.group)
            for h in handles:
                h.wait()
            if self._dynamic:
                self._growth_tracker += 1
                if self._growth_tracker >= self.growth_interval:
                    self.loss_scale *= 2.0
                    self._growth_tracker = 0
        self._steps += 1
        self._overflow = None
        self._grad_factor = 1.0 / self.loss_scale
        return loss

    # ------------------------------------------------------------------ telemetry
    def memory_report(self) -> dict:
        """This rank's bytes of params, grads, master, optimizer state and comm buffers."""
        seen, pb = set(), 0
        for f in self._flats:
            pb += f.numel() * f.element_size()
        for i in self.layout.frozen:
            p = self._params[i]
            if id(p) not in seen:
                seen.add(id(p))
                pb += p.numel() * p.element_size()
        g = self._grads
        grad = g.nbytes()
        state = self._runner.state_bytes()
        master = self._runner.master_bytes()
        model = pb + grad + master + state
        comm_now = g.comm_nbytes()
        return dict(
            param_bytes=pb,
            grad_bytes=grad,
            master_bytes=master,
            optim_state_bytes=state,
            model_state_bytes=model,
            comm_buffer_bytes=comm_now,
            comm_buffer_peak_bytes=g.comm_peak_nbytes(),
            grad_peak_bytes=grad + g.comm_peak_nbytes(),
            total_bytes=model + comm_now,
        )

    @property
    def comm_stats(self) -> dict:
        return {**self.comm_log.as_dict(), "steps": self._steps}

    def reset_comm_stats(self) -> None:
        self.comm_log.reset()
        self._steps = 0

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        """This rank's shard: the inner optimizer's state plus the layout needed to check it."""
        return {
            "zero": {
                "stage": self.stage,
                "mode": self.mode,
                "rank": self.rank,
                "world_size": self.world_size,
                "layout": self.layout.to_dict(),
                "loss_scale": self.loss_scale,
                "growth_tracker": self._growth_tracker,
            },
            "inner": self._runner.inner.state_dict(),
            "param_groups": [
                {k: v for k, v in g.items() if k != "params"} for g in self.param_groups
            ],
        }

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a `state_dict` of this rank (same layout), or a full torch-format one
        (``consolidated_state_dict``, or a plain torch optimizer's) at any world size."""
        if not isinstance(state_dict, dict) or "param_groups" not in state_dict:
            raise ValueError(
                "load_state_dict: expected a dict with 'param_groups', got "
                f"{type(state_dict).__name__} with keys "
                f"{list(state_dict)[:5] if isinstance(state_dict, dict) else None}"
            )
        groups = state_dict["param_groups"]
        if len(groups) != len(self.param_groups):
            raise ValueError(
                f"load_state_dict: len(param_groups)={len(groups)} differs from "
                f"this optimizer's {len(self.param_groups)}"
            )
        inner = self._runner.inner
        if "zero" in state_dict:
            meta = state_dict["zero"]
            mine = Layout.from_dict(meta["layout"])
            if mine != self.layout or meta["rank"] != self.rank:
                raise ValueError(
                    "load_state_dict: shard saved at world_size="
                    f"{meta['world_size']} rank={meta['rank']} mode={meta['mode']} does not "
                    f"match this optimizer (world_size={self.world_size}, rank={self.rank}, "
                    f"mode={self.mode}); load a consolidated_state_dict() instead"
                )
            inner.load_state_dict(state_dict["inner"])
            self.loss_scale = float(meta.get("loss_scale", self.loss_scale))
            self._growth_tracker = int(meta.get("growth_tracker", 0))
        else:
            for g, mine in zip(groups, self._group_indices):
                if len(g["params"]) != len(mine):
                    raise ValueError(
                        f"load_state_dict: a param group has {len(g['params'])} "
                        f"params, this optimizer's has {len(mine)}"
                    )
            remap = {
                old: new
                for g, mine in zip(groups, self._group_indices)
                for old, new in zip(g["params"], mine)
            }
            full = {remap[int(k)]: v for k, v in state_dict["state"].items()}
            st = shard_state(self.layout, self._runner, self.rank, full)
            inner_groups = []
            for i, buf in enumerate(self.layout.buffers):
                ig = {k: v for k, v in groups[buf.group].items() if k != "params"}
                ig["params"] = [id(p) for p in inner.param_groups[i]["params"]]
                inner_groups.append(ig)
            # inner indices: enumeration order of the inner params
            k = 0
            for ig in inner_groups:
                ig["params"] = list(range(k, k + len(ig["params"])))
                k += len(ig["params"])
            inner.load_state_dict({"state": st, "param_groups": inner_groups})
        for g, saved in zip(self.param_groups, groups):
            for k, v in saved.items():
                if k != "params":
                    g[k] = v
        self._runner.sync_hyper(self.param_groups)

    def consolidated_state_dict(self, to: int = 0) -> dict | None:
        """On rank ``to``: the state dict of the unsharded ``optimizer_class`` (torch's format,
        loadable by it); None on the other ranks. Collective: call it on every rank."""
        if not 0 <= to < self.world_size:
            raise ValueError(f"to must be a rank in [0, {self.world_size}), got to={to!r}")
        payload = local_payload(self.layout, self._runner)
        got = comm.gather_object(payload, to, group=self.group)
        if self.rank != to:
            return None
        return consolidate(self.layout, got, self.param_groups, self._group_indices)

    def __repr__(self) -> str:
        return (
            f"ZeroOptimizer(stage={self.stage}, mode={self.mode!r}, "
            f"optimizer_class={self.optimizer_class.__name__}, "
            f"world_size={self.world_size}, rank={self.rank})"
        )


def _param_groups(params) -> tuple[list[dict], dict[int, str]]:
    """Normalise ``params`` to a list of group dicts (tied params once) and names by id."""
    names: dict[int, str] = {}
    if isinstance(params, nn.Module):
        for n, p in params.named_parameters():  # deduplicates tied parameters
            names.setdefault(id(p), n)
        params = list(params.parameters())
    if isinstance(params, torch.Tensor):
        raise TypeError(
            "params must be an iterable of tensors or dicts, or an nn.Module, got a single Tensor"
        )
    params = list(params)
    if not params:
        raise ValueError("ZeroOptimizer got an empty parameter list")
    groups = [dict(g) for g in params] if isinstance(params[0], dict) else [{"params": params}]
    seen: dict[int, int] = {}
    for gi, g in enumerate(groups):
        ps = g["params"]
        ps = [ps] if isinstance(ps, torch.Tensor) else list(ps)
        uniq = []
        for p in ps:
            if isinstance(p, tuple) and len(p) == 2:  # (name, param) pairs
                names.setdefault(id(p[1]), p[0])
                p = p[1]
            if not isinstance(p, torch.Tensor):
                raise TypeError(f"param group {gi}: params must be tensors, got {type(p).__name__}")
            if id(p) in seen:
                if seen[id(p)] != gi:
                    raise ValueError(
                        f"param {names.get(id(p), tuple(p.shape))} appears in "
                        f"param groups {seen[id(p)]} and {gi}"
                    )
                continue  # tied: counted once
            seen[id(p)] = gi
            uniq.append(p)
        g["params"] = uniq
    return groups, names
