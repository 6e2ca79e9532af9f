"""`zero-kernels tune` across nodes: run under torchrun, every rank of the job is a rank of the
probe and of every trial.

[Note: tune across nodes]
On one host tune starts its own ranks, a fresh set of processes per job (`zero_kernels.cli.
tune._Launcher`). Ranks on other machines it cannot start, so across nodes tune runs as the
job itself: ``torchrun --nnodes K --nproc-per-node R ... -m zero_kernels tune ...`` on every
node, and `InJob` takes the launcher's place:

- the ranks join one gloo process group (torchrun's variables); which ranks share a node is
  proven (`zero_kernels.comm.host_groups`: files in /dev/shm, never the hostname);
- the probe measures three links: the world (every rank), inside each node (its ranks, every
  node at once) and across the nodes (one rank of each: the ranks with the same place in
  their node, every such group at once), each per algorithm and size as on one host; the
  prediction reads the node and cross tables for the hierarchical configurations ([Note: the
  prediction] in tune_plan.py);
- with equal ranks per node, numbered node by node (as torchrun numbers them), the grid adds
  every ZeRO configuration with ``shard_group="node"`` and stage 3's with
  ``secondary_shard="node"``; `recommend` takes them only where they measured faster, like
  any other trial;
- each trial runs in these processes, one after another: every rank builds, trains and closes
  it, then collects its garbage and gives freed memory back to the system (``malloc_trim``)
  before the next; its peak memory is the high-water mark reset at the trial's start (as
  on one host, [Note: peak memory] in tune_worker.py), above the memory held then. Memory a
  trial's allocator kept and the next one reuses is not seen again, so across nodes the peak
  is a lower bound of a fresh process's;
- every decision (run the next trial or not: --max-trials, --time-budget) is rank 0's,
  broadcast, so the ranks never part ways; rank 0 prints the table and writes the files, every
  rank exits with its exit code;
- a trial that fails on every rank alike (an error at construction) is reported as failed
  and the next one runs; one that fails on some ranks only leaves the others in a collective:
  the group's timeout (``--trial-timeout``) ends them, and the tune ends with the error.
"""

from __future__ import annotations

import ctypes
import gc
import os
import traceback

from .. import comm

__all__ = ["InJob", "JobFailed"]


class JobFailed(RuntimeError):
    """A tune job failed on every rank (its first error)."""


class InJob:
    """The launcher of tune's jobs under torchrun: each runs here, on every rank."""

    def __init__(self, cfg) -> None:
        import torch

        torch.set_num_threads(cfg.threads)
        self.rank = int(os.environ["RANK"])
        self.world = int(os.environ["WORLD_SIZE"])
        comm.init("gloo", self.rank, self.world, timeout_s=cfg.trial_timeout_s)
        self.is_root = self.rank == 0
        self.hosts = comm.host_groups()
        sizes = {len(h) for h in self.hosts}
        node_major = all(h == list(range(h[0], h[0] + len(h))) for h in self.hosts)
        self.nodes = len(self.hosts)
        self.ranks_per_node = sizes.pop() if len(sizes) == 1 and node_major else 0
        self.why_flat = None
        if self.nodes > 1 and not self.ranks_per_node:
            self.why_flat = (
                f"the nodes' ranks {self.hosts} are not equal in number and numbered node by "
                "node: no shard_group='node' trials"
            )
        self.links = {}
        if self.nodes > 1 and self.ranks_per_node > 1:
            self.links = self._link_groups()

    def _link_groups(self) -> dict:
        """This rank's group of its node's ranks and its group across the nodes (every rank
        makes every group, in one order: new_group is collective)."""
        import torch.distributed as dist

        node = cross = None
        for h in self.hosts:
            g = dist.new_group(ranks=h)
            if self.rank in h:
                node = g
        for j in range(self.ranks_per_node):
            ranks = [h[j] for h in self.hosts]
            g = dist.new_group(ranks=ranks)
            if self.rank in ranks:
                cross = g
        return {"node": node, "cross": cross}

    def agree(self, value):
        """Rank 0's ``value``, on every rank."""
        return comm.broadcast_object(value, 0)

    def run(self, job: dict) -> list:
        """Run ``job`` here on every rank; the ranks' results (a list by rank) on every rank,
        or `JobFailed` on every rank where it failed on every rank."""
        from .tune_worker import probe, trial

        err = None
        try:
            if job["kind"] == "probe":
                res = probe(job, self.rank, self.world, self.links)
            else:
                res = trial(job, self.rank, self.world)
        except Exception as e:  # noqa: BLE001 (every rank reports; see the note)
            why = str(e).strip().splitlines()[0] if str(e).strip() else ""
            err, res = f"rank {self.rank} failed: {type(e).__name__}: {why}", None
            if os.environ.get("ZERO_KERNELS_TRACEBACK"):
                traceback.print_exc()
        finally:
            gc.collect()
            _trim()
        every = comm.all_gather_object((err, res))
        errors = [e for e, _ in every if e is not None]
        if errors:
            raise JobFailed(errors[0])
        return [r for _, r in every]

    def close(self) -> None:
        try:  # after a failed collective the group may be gone: leave all the same
            comm.barrier()
        except Exception:  # noqa: BLE001
            pass
        comm.shutdown()


def _trim() -> None:
    """Give the heap's free memory back to the system (glibc), so the next trial's peak starts
    from what is held."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
