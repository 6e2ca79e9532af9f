"""The step's bookkeeping kept on the device, so that ``step()`` never waits for the GPU.

[Note: no host sync]
A host read of a CUDA tensor (``.item()``, ``bool()``, ``float()``, ``.tolist()``) waits until
the GPU has finished everything queued before it, so the host can no longer run ahead and queue
the next kernels: on a GPU the whole of the step's launch overhead becomes exposed. On the CPU a
read costs nothing, so ZeroOptimizer uses these device-side forms where its tensors are not on
the CPU (``ZeroOptimizer._sync_free``; the tests switch it on for CPU tensors, where they count
every host read made inside ``step()``):

- nonfinite="step" (torch's default behaviour, no loss scaling): the per-step "this rank saw
  inf/NaN" flag is computed on the device and added to a device counter; the host learns of it
  later, through `Deferred` (an event-guarded copy read only once the GPU has passed it), and
  logs the first occurrence then. ``comm_stats["nonfinite_steps"]`` reads the counter (that read
  synchronises; it is telemetry, outside the step).
- ``clip_grad_norm_``: the global norm stays a device tensor (the all-reduce runs on the device)
  and the clipping coefficient ``min(1, max_norm / (norm + 1e-6))`` multiplies the gradient shards
  in place, as ``torch.nn.utils.clip_grad_norm_`` does, instead of being folded into the kernel's
  host-side grad scale. ``error_if_nonfinite=True`` needs the value on the host and reads it
  (torch does the same). ``torch.nn.utils.clip_grad_norm_`` on the `ShardedGrad`s is sync-free
  in this mode too: their norms are device tensors and ``mul_`` by the coefficient tensor reads
  nothing (see [Note: gradients] in `zero_kernels.partition.grads`).
- Which params got a gradient (the one-byte-per-param mask at the end of backward) is host
  knowledge: it is all-reduced on the optimizer's gloo side group on the CPU, never on the GPU.

Loss scaling and nonfinite="skip"/"raise" decide on the host whether to step, so they read one
flag per step (one synchronisation, as ``torch.amp.GradScaler`` does with optimizers that do not
take ``found_inf``).
"""

from __future__ import annotations

import logging
import math

import torch

__all__ = [
    "Deferred",
    "GradChecks",
    "clip_coefficient",
    "host_read",
    "nonfinite_flag",
    "norm_on_device",
]


def host_read(t: torch.Tensor) -> float:
    """The value of a one-element tensor on the host (the only host read this module makes:
    `Deferred` calls it once the value is known to be ready)."""
    return float(t.item())


def nonfinite_flag(shards: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """1.0 (fp32, 0-dim, on ``device``) when any element of ``shards`` is inf or NaN, else 0.0:
    one reduction per shard (a sum is non-finite iff an element is, or the sum overflows, which
    torch's own check counts as non-finite too), no host read."""
    sums = [g.sum(dtype=torch.float32) for g in shards if g.numel()]
    if not sums:
        return torch.zeros((), dtype=torch.float32, device=device)
    return (~torch.isfinite(torch.stack(sums))).any().to(torch.float32)


def norm_on_device(shards: list[torch.Tensor], norm_type: float, device) -> torch.Tensor:
    """This rank's part of the global norm as a float64 device tensor of one element: the max
    of |g| for the inf-norm, else the sum of |g|^p (the count of non-zeros for p = 0)."""
    live = [g for g in shards if g.numel()]
    if not live:
        return torch.zeros(1, dtype=torch.float64, device=device)
    if norm_type == float("inf"):
        parts = torch.stack([g.abs().max().double() for g in live])
        return parts.max().reshape(1)
    if norm_type == 0:
        return torch.stack([(g != 0).sum().double() for g in live]).sum().reshape(1)
    parts = [torch.linalg.vector_norm(g, norm_type).double() ** norm_type for g in live]
    return torch.stack(parts).sum().reshape(1)


def clip_coefficient(total: torch.Tensor, max_norm: float) -> torch.Tensor:
    """``min(1, max_norm / (total + 1e-6))`` on the device, as fp32 (torch's formula)."""
    return torch.clamp(float(max_norm) / (total.float() + 1e-6), max=1.0)


class Deferred:
    """Values the host wants from the device without waiting for them: ``put`` queues a copy
    (non-blocking, to pinned memory, with an event on CUDA); ``ready`` returns those whose event
    has passed, without ever blocking."""

    def __init__(self):
        self.queue: list[tuple[object, torch.Tensor, object]] = []

    def put(self, key, t: torch.Tensor) -> None:
        if t.is_cuda:
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            host.copy_(t, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(torch.cuda.current_stream(t.device))
            self.queue.append((key, host, ev))
        else:
            self.queue.append((key, t.detach().clone(), None))

    def ready(self) -> list[tuple[object, float]]:
        out, keep = [], []
        for key, host, ev in self.queue:
            if ev is None or ev.query():
                out.append((key, host_read(host)))
            else:
                keep.append((key, host, ev))
        self.queue = keep
        return out


log = logging.getLogger("zero_kernels")


class GradChecks:
    """ZeroOptimizer's checks of the reduced gradients before a step: non-finite values and
    the global norm (`clip_grad_norm_`), host-side on the CPU, device-side elsewhere."""

    def _finish_reduction(self) -> None:
        self._reducer.flush()
        self._sync_user_changes()
        if self._overflow is not None:
            return
        scaled = self.scaler.active
        if scaled or self.nonfinite != "step":
            bad = torch.zeros(1, device=self.device)
            for g in self._grads.shard_tensors():
                if not bool(torch.isfinite(g).all()):
                    bad.fill_(1.0)
                    break
            self._all_reduce(bad, "max", "step: non-finite check")
            self._overflow = bool(bad.item() != 0)
        elif self._sync_free:  # counted on the device, logged once the value is ready
            self._overflow = False
            flag = nonfinite_flag(self._grads.shard_tensors(), self.device)
            if self._nonfinite_dev is None:
                self._nonfinite_dev = torch.zeros((), dtype=torch.float32, device=self.device)
            self._nonfinite_dev.add_(flag)
            if not self._said_nonfinite:
                self._deferred.put(self._steps, flag)
        else:  # torch's behaviour: step anyway; `step` counts it (one cheap pass per shard)
            self._overflow = False
            self._local_nonfinite = not all(
                bool(torch.isfinite(g.sum())) for g in self._grads.shard_tensors()
            )

    @torch.no_grad()
    def clip_grad_norm_(
        self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False
    ) -> torch.Tensor:
        """Clip the (reduced, unscaled) gradients to ``max_norm``; returns the global norm,
        exactly as ``torch.nn.utils.clip_grad_norm_`` on the unsharded model."""
        self._check_open("clip_grad_norm_")
        self._check_not_joined("clip_grad_norm_")
        norm_type = float(norm_type)
        if norm_type < 0 or math.isnan(norm_type):
            raise ValueError(f"norm_type must be >= 0 or inf, got norm_type={norm_type!r}")
        self._finish_reduction()
        shards = self._grads.shard_tensors()
        if self._sync_free:
            return self._clip_on_device(shards, float(max_norm), norm_type, error_if_nonfinite)
        if math.isinf(norm_type):
            local = max((float(g.abs().max()) for g in shards if g.numel()), default=0.0)
            t = torch.tensor([local], dtype=torch.float64, device=self.device)
            self._all_reduce(t, "max", "clip_grad_norm_")
            total = float(t.item())
        else:
            s = sum(
                float(torch.linalg.vector_norm(g, norm_type).double() ** norm_type)
                if norm_type != 0
                else float((g != 0).sum())
                for g in shards
            )
            t = torch.tensor([s], dtype=torch.float64, device=self.device)
            self._all_reduce(t, "sum", "clip_grad_norm_")
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

    def _clip_on_device(self, shards, max_norm: float, norm_type: float, error_if_nonfinite):
        """`clip_grad_norm_` without a host read ([Note: no host sync])."""
        t = norm_on_device(shards, norm_type, self.device)
        self._all_reduce(t, "max" if math.isinf(norm_type) else "sum", "clip_grad_norm_")
        if norm_type not in (0.0, 1.0) and not math.isinf(norm_type):
            t = t ** (1.0 / norm_type)
        total = (t * abs(self._grad_factor)).reshape(())
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

    def _log_nonfinite(self, step: int) -> None:
        self._said_nonfinite = True
        log.warning(
            "ZeroOptimizer: rank %d has non-finite gradients at step %d; stepping anyway "
            "(nonfinite='step', as torch does); nonfinite='skip' or 'raise' stops it",
            self.rank,
            step,
        )

    @property
    def nonfinite_steps(self) -> int:
        """Steps with inf/NaN gradients (on this rank, with nonfinite="step"); reading it off
        the CPU waits for the device (telemetry, never read by the step)."""
        dev = self._nonfinite_dev
        return self._nonfinite_host + (int(dev.item()) if dev is not None else 0)

    @nonfinite_steps.setter
    def nonfinite_steps(self, value: int) -> None:
        self._nonfinite_host = int(value)
        self._nonfinite_dev = None
