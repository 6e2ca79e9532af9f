"""Collectives: the only module of zero_kernels that calls ``torch.distributed``.

Every asynchronous collective returns a `Handle` holding the work object *and* the tensors it
reads and writes, so a caller cannot free a buffer that is still being communicated.

[Note: averaging]
Gradients are averaged exactly once. Where the backend's reduce-scatter takes ``ReduceOp.AVG``
(NCCL; gloo in recent torch) the native algorithm uses that op; otherwise, and always for the
point-to-point algorithms, the sum is divided by the world size when the handle is waited for.
`avg_supported` probes this once per process group.

The package, lowest layer first (each module imports only those above it in this list):
`groups` (size, rank, state keys, backends, the collectives' device: [Note: the collectives'
device], [Note: group keys]), `objects` (object and broadcast collectives), `hosts` (which ranks
share a host, proven: [Note: hosts are proven]), `links` (bytes by link), `base` (handles,
counters, timeouts, the CUDA comm stream: [Note: CUDA streams]),
`p2p` (the point-to-point algorithms: [Note: algorithms]), `shm` (ranks of one host exchanging
through shared files: [Note: shared-memory collectives]), `choose` (which algorithm, and the
probe: [Note: choosing the algorithm]), `collectives` (the functions callers use), `hier`
(hierarchical sharding), `quant` (quantized collectives) and `hier_quant` (the quantized
gradients' two hops across hosts). This file only re-exports.
"""

from __future__ import annotations

from . import hier, hier_quant, quant  # noqa: F401 - hierarchy, quantized collectives
from .base import (
    CollectiveTimeout,
    CommLog,
    Handle,
    Watch,
    avg_supported,
    comm_stream,
)
from .choose import (
    ALGORITHMS,
    ENV_ALGO,
    choose_algorithm,
    class_label,
    probe_ahead,
    probe_results,
    register_twin,
    set_algorithm,
    size_class,
)
from .collectives import (
    all_gather,
    all_reduce,
    all_reduce_future,
    all_reduce_start,
    barrier,
    check_arrival,
    exit_process,
    init,
    join_notify,
    joined_here,
    kv_store,
    reduce_scatter,
    shutdown,
    side_group,
    twin_group,
)
from .groups import (
    backend_for,
    backends_of,
    choose_device,
    collective_device,
    group_key,
    group_or_world,
    group_ranks,
    is_fake,
    is_initialized,
    parse_backends,
    rank,
    world_size,
)
from .hosts import host_groups
from .links import learn as learn_hosts
from .objects import all_gather_object, broadcast, broadcast_object, gather_object
from .p2p import free_scratch, scratch_bytes

__all__ = [
    "ALGORITHMS",
    "all_gather",
    "all_gather_object",
    "all_reduce",
    "all_reduce_future",
    "all_reduce_start",
    "avg_supported",
    "backend_for",
    "backends_of",
    "barrier",
    "broadcast",
    "broadcast_object",
    "check_arrival",
    "choose_algorithm",
    "choose_device",
    "collective_device",
    "CollectiveTimeout",
    "comm_stream",
    "CommLog",
    "ENV_ALGO",
    "exit_process",
    "free_scratch",
    "gather_object",
    "group_key",
    "group_or_world",
    "group_ranks",
    "Handle",
    "host_groups",
    "init",
    "is_fake",
    "is_initialized",
    "join_notify",
    "joined_here",
    "kv_store",
    "learn_hosts",
    "parse_backends",
    "probe_ahead",
    "probe_results",
    "rank",
    "reduce_scatter",
    "register_twin",
    "scratch_bytes",
    "set_algorithm",
    "shutdown",
    "side_group",
    "twin_group",
    "Watch",
    "world_size",
]
__all__ += ["class_label", "size_class"]  # tests read the size classes
