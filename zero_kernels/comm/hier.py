"""Hierarchical sharding's groups and its two-hop gradient reduction.

[Note: hierarchy]
With ``shard_group`` other than "world", the data-parallel group of W ranks is split into W/K
shard groups of K ranks (default: the ranks of one node) and K replica groups of W/K ranks (the
ranks with the same index inside their shard group). The state is sharded inside each shard
group, as if it were the world, and replicated across them (MiCS, FSDP2's HSDP):

- the all-gathers of params stay inside the shard group (the fast links of one node);
- a gradient bucket is reduce-scattered (averaged) inside the shard group, then its shard is
  all-reduced (averaged) across the replica group: the bytes crossing nodes are one shard per
  bucket and rank, not the bucket. The mean of the K-means is the mean over all W ranks since
  every shard group has K ranks (sizes are checked equal);
- every rank then steps the same shard as its replicas, with the same gradient: the replicas
  stay equal without any further exchange.

`split` makes the groups (collective: every rank of the group calls it with the same layout);
`Mesh.reduce_scatter` starts both hops and returns one handle. The cross-node all-reduce of a
bucket starts when its reduce-scatter has finished, found by polling (``is_completed``) or by the
wait; the all-reduces of one replica group are started in launch order on every rank, so ranks
never pair different buckets. Where a torch ``DeviceMesh`` is given (replicate x shard, as FSDP2
takes it), its groups are used as they are.
"""

from __future__ import annotations

import dataclasses
import os

import torch
import torch.distributed as dist

from .base import (
    CommLog,
    Handle,
    Watch,
    _nbytes,
    backend_for,
    collective_device,
    rank,
    world_size,
)
from .choose import register_twin
from .collectives import reduce_scatter, twin_group

__all__ = ["Mesh", "Secondary", "resolve_shard_group", "secondary_groups", "split"]


@dataclasses.dataclass(eq=False)
class Mesh:
    """``world``: the data-parallel group; ``shard``: this rank's shard group (the state is
    sharded over it); ``replicas``: this rank's replica group (None with one shard group);
    ``shard_ranks``: every shard group's ranks (of ``world``), for reports and checks."""

    world: object
    shard: object
    replicas: object
    shard_ranks: tuple

    @property
    def shard_size(self) -> int:
        return len(self.shard_ranks[0])

    @property
    def n_replicas(self) -> int:
        return len(self.shard_ranks)

    @property
    def replica_index(self) -> int:
        """Which shard group this rank is in (0: the first)."""
        me = rank(self.world)
        return next(k for k, rs in enumerate(self.shard_ranks) if me in rs)

    def reduce_scatter(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        *,
        log: CommLog | None = None,
        timeout_s: float | None = None,
        what: str = "",
        watch: Watch | None = None,
        first=None,
        quantize: tuple[int, int] | None = None,
        errors: dict | None = None,
    ):
        """``output`` = the average over every rank of ``input``, this rank's chunk of it (its
        index in the shard group); two hops ([Note: hierarchy]). ``first``: the group of the
        first hop (a twin of ``shard``; default ``shard``). ``quantize`` (bits, block): the
        second hop, across the replica groups, quantized ([Note: quantized two-hop]), with
        error feedback where ``errors`` is given ([Note: error feedback])."""
        h = reduce_scatter(
            output,
            input,
            group=self.shard if first is None else first,
            avg=True,
            log=log,
            timeout_s=timeout_s,
            what=what,
            watch=watch,
        )
        if self.replicas is None:
            return h
        return _TwoHop(h, output, self, log, timeout_s, what, quantize, errors)


class _TwoHop:
    """A reduce-scatter inside the shard group, then the all-reduce of its output across the
    replica group; both in one handle (what the reducer waits for)."""

    __slots__ = (
        "first", "second", "out", "mesh", "log", "timeout_s", "what", "done", "quantize",
        "errors",
    )  # fmt: skip
    _queues: dict = {}  # id(replica group) -> handles whose all-reduce is not started, in order

    def __init__(
        self, first: Handle, out, mesh: Mesh, log, timeout_s, what, quantize=None, errors=None
    ):
        self.first, self.second, self.out, self.mesh = first, None, out, mesh
        self.log, self.timeout_s, self.what, self.done = log, timeout_s, what, False
        self.quantize, self.errors = quantize, errors
        _TwoHop._queues.setdefault(id(mesh.replicas), []).append(self)

    def _start_second(self, watch=None) -> None:
        """Start the all-reduces of this handle and of every earlier one of the same replica
        group (launch order: the same on every rank)."""
        q = _TwoHop._queues.get(id(self.mesh.replicas), [])
        while self.second is None and q:
            h = q.pop(0)
            h.first.wait(h.timeout_s, h.what, watch)
            if h.quantize is not None:
                h.second = _QuantAllReduce(h.out, h.mesh.replicas, *h.quantize, h.log, h.errors)
                continue
            if h.log is not None:
                h.log._add("replica_all_reduce", h.out)
                h.log._sent("ring_all_reduce", _nbytes(h.out), h.mesh.replicas)
            n = world_size(h.mesh.replicas)
            work = dist.all_reduce(
                h.out, op=dist.ReduceOp.SUM, group=h.mesh.replicas, async_op=True
            )
            h.second = Handle(work, (h.out,), float(n), h.log)

    def is_completed(self) -> bool:
        if self.done:
            return True
        if self.second is None:
            if not self.first.is_completed():
                return False
            q = _TwoHop._queues.get(id(self.mesh.replicas), [])
            if q and q[0] is not self:  # an earlier bucket's all-reduce goes first
                return False
            self._start_second()
        return self.second.is_completed()

    def wait(self, timeout_s: float | None = None, what: str = "", watch: Watch | None = None):
        if self.done:
            return self.out
        self._start_second(watch)
        self.second.wait(timeout_s, (what or self.what) + " (all-reduce across replicas)", watch)
        self.done = True
        return self.out


class _QuantAllReduce:
    """[Note: quantized two-hop]
    ``quantize_grads`` with hierarchical sharding: the first hop (the reduce-scatter inside the
    shard group, the fast links of a node) stays exact; the second, the all-reduce of the shard
    across the R replica groups (the bytes that cross the nodes), runs as a quantized
    reduce-scatter over the replicas (each sends the other R-1 chunks quantized, sums the R
    contributions in fp32, averages) and a quantized all-gather of the averaged chunks in
    which every replica dequantizes its own chunk too (``own_exact=False``): every replica ends
    with the same gradient, bit for bit, so the replicas step the same shard and stay equal.
    The shard is padded to a multiple of R with zeros. Bytes across nodes: about
    2 (R-1)/R x (1 + 4/block) bytes per element at int8 against 2 (R-1)/R x 4 in fp32
    (``replica_all_reduce_bytes`` counts the packed bytes of the shard, as it counts an
    all-reduce's payload once in fp32). A non-finite
    gradient stays non-finite through both hops (the quantizer's scales never hide it)."""

    __slots__ = ("out", "group", "bits", "block", "buf", "chunk", "rs", "ag", "errors", "log")

    def __init__(self, out: torch.Tensor, group, bits: int, block: int, log, errors=None):
        from .quant import packed_sizes, reduce_scatter_quantized

        n, c = world_size(group), out.numel()
        per = -(-c // n)
        self.out, self.group, self.bits, self.block = out, group, bits, block
        self.buf = torch.zeros(per * n, dtype=torch.float32, device=out.device)
        self.buf[:c].copy_(out.view(-1))
        self.chunk = torch.empty(per, dtype=torch.float32, device=out.device)
        self.errors = errors
        self.rs = reduce_scatter_quantized(
            self.chunk, self.buf, bits=bits, block=block, group=group, avg=True, errors=errors,
            log=log, kind=None,
        )  # fmt: skip
        self.ag = None
        self.log = log
        if log is not None:
            log._add_bytes("replica_all_reduce", n * packed_sizes(per, bits, block)[2])

    def _second(self, timeout_s=None, what="", watch=None) -> None:
        from .quant import all_gather_quantized

        if self.ag is None:
            self.rs.wait(timeout_s, what, watch)
            self.ag = all_gather_quantized(
                self.buf, self.chunk, bits=self.bits, block=self.block, group=self.group,
                own_exact=False, errors=self.errors, log=self.log, kind=None,
            )  # fmt: skip

    def is_completed(self) -> bool:
        if self.ag is None:
            if not self.rs.is_completed():
                return False
            self._second()
        return self.ag.is_completed()

    def wait(self, timeout_s: float | None = None, what: str = "", watch: Watch | None = None):
        self._second(timeout_s, what, watch)
        self.ag.wait(timeout_s, what, watch)
        self.out.view(-1).copy_(self.buf[: self.out.numel()])
        return self.out


def twin_of_shard(mesh: Mesh, device: torch.device | str | None = None):
    """A second group over this rank's shard group for tensors on ``device``
    (`zero_kernels.comm.twin_group`: stage 3's reduce-scatters form a sequence of their own).
    With several shard groups every rank makes the twin of each (a new group is collective over
    the whole group) and keeps its own."""
    if mesh.replicas is None:
        return twin_group(mesh.shard, device)
    dev = collective_device(mesh.shard) if device is None else torch.device(device)
    if backend_for(mesh.shard, dev) != "gloo":
        return mesh.shard
    glob = (
        dist.get_process_group_ranks(mesh.world)
        if mesh.world is not None
        else list(range(world_size()))
    )
    me, mine = rank(mesh.world), None
    for g in mesh.shard_ranks:
        pg = dist.new_group(ranks=[glob[r] for r in g], backend="gloo")
        if me in g:
            mine = pg
    register_twin(mine, mesh.shard)
    return mine


def resolve_shard_group(spec, group=None) -> tuple[list[list[int]], object]:
    """The shard groups (lists of ranks of ``group``, each sorted, all of one size) that
    ``spec`` names, and the DeviceMesh where one was given (else None). Collective for "node".

    ``spec``: "world" (one group of all), "node" (the ranks of each host, proven by a file in
    /dev/shm that they all see: `zero_kernels.comm.host_groups`; checked against torchrun's
    ``LOCAL_WORLD_SIZE`` where set), an
    int K (consecutive blocks of K ranks, as torchrun numbers the ranks of a node), or a torch
    ``DeviceMesh`` of 2 dims (replicate, shard) or 1 dim (shard)."""
    n = world_size(group)
    if spec == "world":
        return [list(range(n))], None
    if _is_device_mesh(spec):
        return _mesh_groups(spec, group), spec
    if spec == "node":
        from .hosts import host_groups

        groups = host_groups(group)  # proven: the ranks that share one /dev/shm
        sizes = sorted({len(g) for g in groups})
        if len(sizes) != 1:
            raise ValueError(
                "shard_group='node': the nodes have different numbers of ranks "
                f"({groups}); every shard group must have the same size: give "
                "shard_group=K or run equal ranks per node"
            )
        lws = os.environ.get("LOCAL_WORLD_SIZE")
        if lws is not None and lws.isdigit() and int(lws) != sizes[0]:
            raise ValueError(
                f"shard_group='node': LOCAL_WORLD_SIZE={lws} but {sizes[0]} ranks share this "
                "host's /dev/shm (comm.host_groups); give shard_group=K"
            )
        return groups, None
    if isinstance(spec, bool) or not isinstance(spec, int):
        raise TypeError(
            "shard_group must be 'world', 'node', an int or a torch DeviceMesh, got "
            f"shard_group={spec!r}"
        )
    if spec < 1 or n % spec:
        raise ValueError(
            f"shard_group={spec}: must divide the world size {n} (shard groups of equal size)"
        )
    return [list(range(s, s + spec)) for s in range(0, n, spec)], None


def _is_device_mesh(spec) -> bool:
    return type(spec).__name__ == "DeviceMesh" and hasattr(spec, "get_group")


def _mesh_groups(mesh, group) -> list[list[int]]:
    if mesh.ndim not in (1, 2):
        raise ValueError(f"shard_group: a DeviceMesh of 1 or 2 dims, got mesh.ndim={mesh.ndim}")
    grid = mesh.mesh.reshape(-1, mesh.mesh.shape[-1]).tolist()  # rows: shard groups
    wr = dist.get_process_group_ranks(group) if group is not None else list(range(world_size()))
    if sorted(r for row in grid for r in row) != sorted(wr):
        raise ValueError(
            f"shard_group: the DeviceMesh's ranks {sorted(r for row in grid for r in row)} are "
            f"not the process group's {sorted(wr)}"
        )
    pos = {g: k for k, g in enumerate(wr)}
    return [sorted(pos[r] for r in row) for row in grid]


def split(group, shard_ranks: list[list[int]], device_mesh=None) -> Mesh:
    """The `Mesh` of ``group`` with these shard groups (ranks of ``group``). Collective: every
    rank of ``group`` calls it alike (each subgroup is made by every rank, in one order)."""
    n = world_size(group)
    if len(shard_ranks) == 1:
        return Mesh(group, group, None, (tuple(range(n)),))
    if device_mesh is not None:
        shard = device_mesh.get_group(device_mesh.ndim - 1)
        replicas = device_mesh.get_group(0)
        return Mesh(group, shard, replicas, tuple(tuple(g) for g in shard_ranks))
    glob = dist.get_process_group_ranks(group) if group is not None else list(range(n))
    me = rank(group)
    shard = replicas = None
    for g in shard_ranks:
        pg = dist.new_group(ranks=[glob[r] for r in g])
        if me in g:
            shard = pg
    k = len(shard_ranks[0])
    for j in range(k):
        ranks = [g[j] for g in shard_ranks]
        pg = dist.new_group(ranks=[glob[r] for r in ranks])
        if me in ranks:
            replicas = pg
    return Mesh(group, shard, replicas, tuple(tuple(g) for g in shard_ranks))


@dataclasses.dataclass(eq=False)
class Secondary:
    """Stage 3's secondary shard groups (hpZ, [Note: secondary shard]): ``group`` holds this
    rank and the ``size - 1`` others of its block (ranks of one node, consecutive in the shard
    group), ``index`` is this rank's place in it."""

    group: object
    size: int
    index: int


def secondary_groups(mesh: Mesh, spec) -> Secondary | None:
    """The secondary shard groups ``spec`` ("node" or an int K) names inside each shard group
    of ``mesh``; None where they would be the whole shard group or single ranks (nothing to
    gain: the backward's gathers are then those without it). Collective over ``mesh.world``."""
    n = mesh.shard_size
    if spec == "node":
        from .hosts import host_groups

        host_of = {r: h for h, g in enumerate(host_groups(mesh.world)) for r in g}
        blocks, split_host = [], False
        for sg in mesh.shard_ranks:  # world ranks, in shard-group order
            runs: list[list[int]] = []  # positions in the shard group, by runs of one host
            for p, r in enumerate(sg):
                if runs and host_of[sg[runs[-1][0]]] == host_of[r]:
                    runs[-1].append(p)
                else:
                    runs.append([p])
            split_host |= len(runs) != len({host_of[r] for r in sg})
            blocks += runs
        sizes = sorted({len(b) for b in blocks})
        if split_host or len(sizes) != 1:
            raise ValueError(
                "secondary_shard='node': the ranks of each node must be consecutive in the "
                f"shard group and equal in number (shard groups {list(mesh.shard_ranks)}, "
                f"runs of one node {blocks}); give secondary_shard=K"
            )
        size = sizes[0]
    else:
        if spec < 1 or n % spec:
            raise ValueError(f"secondary_shard={spec}: must divide the shard group's size {n}")
        size = spec
    if size in (1, n):
        return None
    glob = (
        dist.get_process_group_ranks(mesh.world)
        if mesh.world is not None
        else list(range(world_size()))
    )
    me, mine, index = rank(mesh.world), None, 0
    blocks = tuple(tuple(range(s, s + size)) for s in range(0, n, size))
    for sg in mesh.shard_ranks:
        for b in blocks:
            ranks = [sg[p] for p in b]
            pg = dist.new_group(ranks=[glob[r] for r in ranks])
            if me in ranks:
                mine, index = pg, ranks.index(me)
    return Secondary(mine, size, index)
