"""The step's bookkeeping kept on the device, so that ``step()`` never waits for the GPU.

[Note: no host sync]
A host read of a CUDA tensor (``.item()``, ``bool()``, ``float()``, ``.tolist()``) waits until
the GPU has finished everything queued before it, so the host can no longer run ahead and queue
the next kernels: on a GPU the whole of the step's launch overhead becomes exposed. On the CPU a
read costs nothing, so ZeroOptimizer uses these device-side forms where its tensors are not on
the CPU (``Core.sync_free``; the tests switch it on for CPU tensors, where they count
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
take ``found_inf``): the shards' checks are combined on the device (`any_nonfinite`) and agreed
by one all-reduce of the flag before the read. ``torch.amp.GradScaler``'s check-and-unscale on
the `ShardedGrad`s reads nothing either: its ``found_inf`` is combined and all-reduced on the
device, and the one read per step is GradScaler's own in ``scaler.step``.

[Note: accurate norms]
The gradient norm of ``clip_grad_norm_`` is taken over this rank's flat shards, each of which
can hold the whole model's gradient (stage 1-2 at world size 1: millions of elements in one
tensor), where torch's tool takes one norm per param. On the CPU, torch's reduction of one long
fp32 tensor loses accuracy with its length: against a float64 reference, 1.4e-7 relative at 1e5
elements, 9.9e-6 at 1e6, 9.1e-5 at 4e6 (torch 2.13 on the Xeon, Gaussian data). A per-param
norm of torch's is short enough not to show it; a whole-shard norm was, and the clipping
coefficient, hence every param's update, differed from DDP's by ~1e-5 relative (2e-5 on the
0.8M-param demo GPT; under bf16 autocast the next forward's weight casts grow such a last-bit
difference to ~1e-2 in six steps: bench/gpu_zero_check.py). So `pow_sum` reduces rows of
`NORM_ROW` elements (each row's norm in fp32, accurate at that length, for
bf16/fp16 gradients too, whose own norm torch would round to their dtype) and sums the rows'
p-th powers in float64. On 4M heavy-tailed elements (scales over four decades) that is 2e-9
(p=2) to 1.4e-7 (p=3) relative, where torch's whole-tensor reduction is 4e-4 to 3e-3 off; rows
of 4096 were already 6e-7 off on the demo GPT's shard, rows of 256 2e-8. It is no slower: 5.8
ms against 7.9 for one flat norm of 3e7 elements on 2 threads (the rows reduce in parallel).
A bf16/fp16 shard's rows come `NORM_PASS` elements per call, which bounds the fp32 copy
they may need; fp32 rows reduce in place, in one call (a few kernels per shard on a GPU).
The ShardedGrad norms (`zero_kernels.partition.grads`: torch's own ``clip_grad_norm_``) go
through `pow_sum` too, piece by piece; they used to be exact by copying each piece to float64,
which took 5x a large gradient's bytes while the norm was taken (+1345 MB over one 268 MB
gradient; now +1 MB: tests/stages/test_clip_norm.py checks it).
tests/stages/test_clip_norm.py holds both to float64 (the old whole-shard sum fails it by 2.8e-5).
"""

from __future__ import annotations

import torch

__all__ = [
    "Deferred",
    "any_nonfinite",
    "clip_coefficient",
    "host_read",
    "nonfinite_flag",
    "norm_on_device",
    "pow_sum",
]

NORM_ROW = 256  # elements per row: each row's norm in fp32, the rows summed in float64
NORM_PASS = 1 << 24  # elements per call: bounds the fp32 copy of a bf16/fp16 shard (64 MB)


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


def any_nonfinite(tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """1.0 (fp32, 0-dim, on ``device``) when any element of ``tensors`` is inf or NaN, else
    0.0: exact (element by element, as ``torch.amp.GradScaler``'s check), one small reduction
    per tensor, no host read."""
    flags = [torch.isfinite(t).all() for t in tensors if t.numel()]
    if not flags:
        return torch.zeros((), dtype=torch.float32, device=device)
    return (~torch.stack(flags).all()).to(torch.float32)


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
    return torch.stack([pow_sum(g, norm_type) for g in live]).sum().reshape(1)


def pow_sum(g: torch.Tensor, p: float) -> torch.Tensor:
    """``sum(|g| ** p)`` over one gradient shard (p finite, non-zero), a float64 0-dim tensor on its
    device, accurate whatever its length ([Note: accurate norms]); no host read."""
    flat = g.reshape(-1)
    acc = torch.float64 if flat.dtype == torch.float64 else torch.float32
    total = torch.zeros((), dtype=torch.float64, device=flat.device)
    n = flat.numel()
    full = n - n % NORM_ROW
    # fp32/fp64 rows reduce in place, all in one call; bf16/fp16 ones NORM_PASS at a time
    step = max(full, 1) if flat.dtype == acc else NORM_PASS
    for start in range(0, full, step):
        rows = flat[start : min(start + step, full)].view(-1, NORM_ROW)
        r = torch.linalg.vector_norm(rows, p, dim=1, dtype=acc).double()
        total += r.pow(p).sum()
    if full < n:
        total += torch.linalg.vector_norm(flat[full:], p, dtype=acc).double() ** p
    return total


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
