"""`ZeroOptimizer.memory_report()`: what a rank holds, by kind, and what the offload tiers hold
and move."""

from __future__ import annotations

__all__ = ["memory_report"]


def memory_report(core) -> dict:
    """A ZeroOptimizer's `memory_report()`: this rank's bytes of params, grads, master,
    optimizer state and comm buffers; with offload, the staging buffers (RAM), the offload file
    (disk) and the host tier's host memory and copies."""
    seen, pb = set(), 0
    pb += core.store.nbytes()
    for i in core.layout.frozen:
        p = core.params[i]
        if id(p) not in seen and i not in core.frozen:  # shard_frozen: in the store's bytes
            seen.add(id(p))
            pb += p.numel() * p.element_size()
    g = core.grads
    grad = g.nbytes()
    state = core.runner.state_bytes()  # in RAM: offloaded moments count on disk
    master = core.runner.master_bytes()
    sw, tier, host = core.runner.swap, core.store.tier, core.runner.host
    staging = sw.staging_bytes if sw is not None else 0
    host_staging = host.staging_bytes if host is not None else 0
    staging += host_staging
    model = pb + grad + master + state + staging
    comm_now = g.comm_nbytes() + core.reducer.error_bytes  # error feedback's buffers too
    sharded = core.store.sharded
    sec = core.units.secondary if core.units is not None else None
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
        gathered_param_bytes=core.store.gathered_nbytes() if sharded else 0,
        gathered_param_peak_bytes=core.store.peak_gathered if sharded else 0,
        # stage 3: most units (beside the root and the kept-whole params) gathered or being
        # gathered at once, what bounds the gathered memory on a GPU too ([Note: gathered
        # memory on CUDA] in zero_kernels.buffers)
        gathered_units_peak=core.units.peak_units if core.units is not None else 0,
        # secondary_shard: the slices kept from units' forwards for their backwards
        secondary_shard_bytes=sec.nbytes if sec is not None else 0,
        secondary_shard_peak_bytes=sec.peak if sec is not None else 0,
        # grad_error_feedback: its per-bucket buffers (in comm_buffer_bytes too)
        comm_error_feedback_bytes=core.reducer.error_bytes,
        # offload_optimizer="nvme": the staging buffers (RAM, in model_state_bytes) and
        # the file (disk), bytes moved since construction
        offload_staging_bytes=staging,
        offload_disk_bytes=sw.nbytes if sw is not None else 0,
        offload_read_bytes=sw.bytes_read if sw is not None else 0,
        offload_written_bytes=sw.bytes_written if sw is not None else 0,
        # offload_params="nvme": the shards' bytes on disk, in RAM now (in param_bytes:
        # acquired, read ahead, written behind, pinned) and at most, bytes moved
        offload_param_disk_bytes=tier.nbytes if tier is not None else 0,
        offload_param_ram_bytes=tier.ram_bytes() if tier is not None else 0,
        offload_param_ram_peak_bytes=tier.peak_ram if tier is not None else 0,
        offload_param_read_bytes=tier.bytes_read if tier is not None else 0,
        offload_param_written_bytes=tier.bytes_written if tier is not None else 0,
        # offload_optimizer="cpu": what the host holds (masters, moments: in master_bytes
        # and optim_state_bytes; the pinned staging: in offload_staging_bytes too), bytes
        # copied each way since construction ([Note: host tier])
        offload_host_bytes=(
            master + state + host_staging + (core.store.nbytes() if core.store.host_shards else 0)
            if host is not None
            else 0
        ),
        # offload_params="cpu": the param shards in host memory (in param_bytes too)
        offload_param_host_bytes=core.store.nbytes() if core.store.host_shards else 0,
        offload_host_staging_bytes=host_staging,
        offload_to_host_bytes=host.bytes_to_host if host is not None else 0,
        offload_to_device_bytes=(
            host.bytes_to_device + core.store.bytes_to_device if host is not None else 0
        ),
    )
