"""Offload tiers behind the shard store: host memory and NVMe.

`aio` is the NVMe tier's asynchronous I/O engine: files opened with ``O_DIRECT`` (so offloaded
bytes do not sit in the page cache, memory a run would use without counting it), requests split
into chunks issued in parallel, a native engine (``zero_kernels._C``: io_uring or a thread pool)
with a pure-Python fallback. `swap.StateSwapper` keeps the fused Adam step's moments in such a
file and streams them bucket by bucket through the step (``offload_optimizer="nvme"``,
[Note: offload]); `params.ParamSwapper` keeps stage 3's param shards (and the fp32 masters of
bf16/fp16 params) in another between their uses (``offload_params="nvme"``, [Note: param
offload]).
"""

from zero_kernels.offload.aio import ALIGN, AioFile, Handle, aligned_empty, probe_disk

__all__ = ["ALIGN", "AioFile", "Handle", "aligned_empty", "probe_disk"]
