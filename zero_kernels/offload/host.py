"""`HostTier`: the optimizer's state in host memory and the step on the CPU, for params on a GPU
(``offload_optimizer="cpu"``).

[Note: host tier]
ZeRO-Offload's split: the params and their gradients stay on the device, where the forward and
the backward need them; the fp32 masters and the Adam moments (12-16 bytes per param of the
shard, the bulk of the model states) live in host memory and the step runs on the host, in the
native CPU kernel (the one `FusedAdamW` runs on CPU tensors). What crosses the bus per step is
the reduced gradient shard (device to host) and the new param shard (host to device), in the
params' dtype for bf16/fp16 params (whose masters stay on the host) and as fp32 for fp32 params
(which have no master: their shard is copied to the host, stepped there and copied back, so the
device's values are the ones stepped, whatever edited them between steps).

- the runner's masters and moments are allocated on the host (`ShardRunner.state_device`); they
  never cross the bus, so they are ordinary pageable memory. The copies go through *pinned*
  staging, one whole-shard buffer per flat buffer for the gradient and one for the params (the
  params' dtype), each bucket a slice of them: 6 bytes per param of the shard for bf16/fp16
  params with fp32 gradients, 8 for fp32 (`staging_bytes`);
- `begin` (the start of ``step()``) makes a side stream wait for the compute stream (the
  backward, clipping and any other gradient edit before the step), then queues on it, bucket by
  bucket in the step's order, the copies of the gradient shards (and, for fp32 and stochastically
  rounded bf16 params, the param shards) to the host, each bucket with an event;
- `arrived` waits for one bucket's event only (never the whole device), so the CPU steps bucket
  k while the bus is still copying k+1, k+2, ...; `send` queues the new shard's copy back on the
  side stream and makes the compute stream wait for it, so the bucket's all-gather (queued right
  after it) reads the new values, while the CPU steps the next bucket: the step is pipelined
  bucket by bucket, the device's copies overlapping the host's arithmetic both ways;
- on CPU params (no device: the copies are plain host copies, no stream, no event) the same code
  runs, and the results are bitwise those of the run without the tier
  (tests/offload/test_offload_host.py,
  on every CI run); on a GPU they are those of the CPU kernel, which computes the same formulas
  as the CUDA kernel ([Note: fused step]) but may round a last bit differently where the
  compilers contract differently (bench/gpu_offload_check.py measures the difference);
- ``offload_params="cpu"`` (stage 3, with this tier): the param shards themselves live in pinned
  host memory (`ParamStore.shard_device`), so the step writes them in place (no staging, no
  copy back); each all-gather copies the bucket's shard into its own chunk of the gathered
  tensor on the current stream and gathers in place (`ParamStore.gather_input`): the shard
  crosses the bus once per all-gather (the forward's and the backward's), and the device
  holds no param bytes between uses. A copy reads pinned memory while the host goes on, so
  whatever writes a host shard first waits for the copies in flight (`ParamStore.settle`,
  called by `using` and `resident`: the step, loads, edits). Not with ``quantize_weights``
  (its quantizer would read the shard in host memory: refused);
- the host kernel runs on torch's intra-op threads (``torch.set_num_threads``); torchrun starts
  each rank with OMP_NUM_THREADS=1, so a GPU rank would step on one core: the construction
  warns then, naming the count to set (the node's cores over its ranks);
- the step waits for the copies by design (the host computes on them): ``step()`` is not
  sync-free with this tier ([Note: no host sync]); clipping, the non-finite check and the loss
  scale run on the device before the step as without it, and reach the host kernel as its
  gradient scale or as already-scaled gradients.

Not done during backward: the gradient copies are queued at ``step()``, not as each bucket's
reduce-scatter ends. With gradient accumulation, every backward before the step would copy its
partial sums (one extra copy per micro-batch). Anything that edits the gradient between
backward and step would have to invalidate copies made early: clipping in place (the sync-free
path on a GPU), ``grad`` writes, and collectives that write without bumping a version counter.
And little is left to gain. The copies of later buckets already overlap the host's step of
earlier ones, so only the first bucket's copy is exposed. The step itself is bound by the
host: it moves about 30 bytes per param of the shard through host memory (fp32 master, p, m,
v read and written, the gradient read, the bf16 copy-out) at tens of GB/s, while the bus
carries 2 bytes per param (a bf16 gradient) at about 25 GB/s. So the copies are on the order
of 1/20 of the step, and that bounds what an overlap with backward could save. Measuring it
on a GPU is left to bench/gpu_offload_check.py ("cpu_kernel_fp32_grads_s" against
"d2h_bf16_shard_s").
"""

from __future__ import annotations

import contextlib

import torch

__all__ = ["HostTier"]


class HostTier:
    """Pinned staging and the copies of the host tier for ``runner`` (a `ShardRunner` built with
    ``state_device="cpu"``) over ``store``/``grads`` on ``device`` (see [Note: host tier])."""

    def __init__(self, runner, device: torch.device):
        self.runner, self.device = runner, torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None
        layout = runner.layout
        n = layout.world_size
        # per flat buffer: the params' staging (their dtype) and the gradients' (allocated at
        # the first step: the gradient shard's dtype is known then)
        self._param: list[torch.Tensor | None] = []
        self._grad: list[torch.Tensor | None] = [None] * len(layout.buffers)
        # offload_params="cpu": the shards live on the host already; the step writes them
        # in place and the next all-gather copies them to the device (ParamStore.gather_input)
        self.params_on_host = runner.store.host_shards
        for i, buf in enumerate(layout.buffers):
            dt = runner.store.shard(i, buf.buckets[0].index).dtype
            stage = None if self.params_on_host else self._empty(buf.shard_numel(n), dt)
            self._param.append(stage)
        # fp32 params (stepped in place: the host copy is what steps) and stochastically
        # rounded bf16 params (stepped on an fp32 copy of their values) need their shard's
        # values on the host; bf16/fp16 with a master only send theirs back
        self._fetch_params = [m is None and not self.params_on_host for m in runner.masters]
        self._events: dict[tuple[int, int], object] = {}
        self._sent: list = []  # events of the copies back, waited for at the next begin
        self.bytes_to_host = 0
        self.bytes_to_device = 0

    def _empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype, pin_memory=self.cuda)

    @property
    def staging_bytes(self) -> int:
        """Bytes of pinned staging held now."""
        ts = [t for t in self._param + self._grad if t is not None]
        return sum(t.numel() * t.element_size() for t in ts)

    def _ctx(self):
        return torch.cuda.stream(self.stream) if self.cuda else contextlib.nullcontext()

    def _grad_host(self, i: int, dtype: torch.dtype) -> torch.Tensor:
        g = self._grad[i]
        if g is None or g.dtype != dtype:
            n = self.runner.layout.buffers[i].shard_numel(self.runner.layout.world_size)
            g = self._grad[i] = self._empty(n, dtype)
        return g

    def begin(self, order: list[tuple[int, int]]) -> None:
        """Queue every bucket's copies to the host, in the step's ``order``."""
        r = self.runner
        for ev in self._sent:  # last step's copies back are long done; the staging is reused
            ev.synchronize()
        self._sent.clear()
        self._events.clear()
        if self.cuda:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with self._ctx():
            for i, b in order:
                sl = r._slice(i, b)
                g = r.grads.shard(i, b)
                self._grad_host(i, g.dtype)[sl].copy_(g, non_blocking=self.cuda)
                self.bytes_to_host += g.numel() * g.element_size()
                if self._fetch_params[i]:
                    s = r.store.shard(i, b)
                    self._param[i][sl].copy_(s, non_blocking=self.cuda)
                    self.bytes_to_host += s.numel() * s.element_size()
                if self.cuda:
                    ev = torch.cuda.Event()
                    ev.record(self.stream)
                    self._events[(i, b)] = ev

    def arrived(self, i: int, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Wait for bucket ``b`` of buffer ``i``'s copies; its host (param staging, gradient)."""
        ev = self._events.pop((i, b), None)
        if ev is not None:
            ev.synchronize()
        sl = self.runner._slice(i, b)
        if self.params_on_host:
            return self.runner.store.shard(i, b), self._grad[i][sl]
        return self._param[i][sl], self._grad[i][sl]

    def send(self, i: int, b: int) -> None:
        """Queue the stepped shard's copy back to the device; the compute stream waits for it."""
        r = self.runner
        if self.params_on_host:  # stepped in place; the next all-gather copies it over
            return
        dst = r.store.shard(i, b)
        src = self._param[i][r._slice(i, b)]
        with self._ctx():
            dst.copy_(src, non_blocking=self.cuda)
        self.bytes_to_device += dst.numel() * dst.element_size()
        if self.cuda:
            ev = torch.cuda.Event()
            ev.record(self.stream)
            torch.cuda.current_stream(self.device).wait_event(ev)
            self._sent.append(ev)

    def close(self) -> None:
        for ev in self._sent:
            ev.synchronize()
        self._sent.clear()
        self._events.clear()
