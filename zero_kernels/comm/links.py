"""Bytes by link: what each collective of a rank sends to ranks of its own host and to ranks of
other hosts.

[Note: bytes by link]
Across nodes the link between them decides a step's time, so `CommLog` counts, besides each
collective's full buffer, the payload bytes this rank *sends* to ranks of its own host
(``inside_node_bytes``: shared memory, loopback, NVLink) and to ranks of other hosts
(``cross_node_bytes``: the network). Hosts are the groups of `comm.host_groups` (ranks that see
one another's files in /dev/shm, proven: [Note: hosts are proven]), learned once per world by
`learn` (collective; `ZeroOptimizer` calls it at construction over its gloo side group, so an
NCCL run exchanges no objects on NCCL for it); a rank not in a learned group is a host of its
own, so its bytes count as crossing, the same conclusion the proof draws where /dev/shm
cannot be written.

What a rank sends follows from the algorithm that ran (group of N ranks, this rank at position
i, full buffer of M bytes, chunk c = M/N; ranks numbered as the group numbers them):

- ``ring`` (ours; gloo's all-gather and all-reduce): N - 1 chunks to rank i + 1; an
  all-reduce (``ring_all_reduce``) 2 (N - 1) chunks to it. NCCL's native collectives are
  counted as rings too: NCCL orders its rings by the topology, not by rank, and leaves each
  node once, so a node's sum holds (ranks numbered node by node) while the split between one
  node's ranks is the model's; its trees (some all-reduces) are not modelled.
- gloo's native reduce-scatter is an all-reduce whose result each rank cuts to its chunk, so
  it sends 2 (N - 1) chunks (measured on the testbed: 1.571 M per node at 2 x 2 ranks, against
  0.785 M for our ring; bench/bench_testbed.py [Note: the formula]).
- ``pairwise`` (ours) and the quantized reduce-scatter's all-to-all: one chunk to each other
  rank.
- ``shm``: N - 1 chunks, all inside the host (the algorithm runs only on ranks of one host).
- ``broadcast`` (the model's buffers, [Note: replicated module state] in
  `zero_kernels.optimizer.replicas`): counted as the source sending the whole buffer to each other
  rank
  (a tree would spread the sending over the ranks; the total is the same).

Counted at launch (a collective that later fails was counted). Payload only: a network adds
its headers (Ethernet/IP/TCP: about 4.7% at an MTU of 1500, measured by tc on the testbed) and
acknowledgements. The scalar all-reduces (gradient norms, non-finite flags) and the
construction's object exchanges are not counted (a few bytes each).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from . import hosts as _hosts
from .groups import backend_for, group_key, is_initialized, rank, world_size

__all__ = ["PATTERNS", "host_bytes", "learn", "pattern", "split"]

PATTERNS = ("ring", "ring_all_reduce", "pairwise", "all_to_all", "shm", "broadcast")
_host_of: dict[int, int] = {}  # global rank -> host index (from `learn`)
_plans: dict = {}  # group key -> (n, position, same-host flag of each group rank)
_next_host = [0]


def learn(group=None) -> list[list[int]]:
    """Learn which ranks of ``group`` share a host (`comm.host_groups`: collective, call it on
    every rank) for the counts of [Note: bytes by link]; returns the groups (group ranks)."""
    groups = _hosts.host_groups(group)  # looked up at the call: tests stand in for the proof
    glob = _global_ranks(group)
    for g in groups:  # a host already known (from another group) keeps its index
        hosts = {_host_of.get(glob[r]) for r in g} - {None}
        h = hosts.pop() if len(hosts) == 1 else None
        if h is None:
            h = _next_host[0]
            _next_host[0] += 1
        for r in g:
            _host_of[glob[r]] = h
    _plans.clear()
    return groups


def pattern(op: str, algo: str, group=None, device: torch.device | str = "cpu") -> str:
    """The send pattern of ``op`` ("reduce_scatter" or "all_gather") run by ``algo`` on
    tensors on ``device``."""
    if algo == "native":
        if op == "reduce_scatter" and backend_for(group, device) == "gloo":
            return "ring_all_reduce"  # gloo's reduce_scatter_tensor: an all-reduce, cut
        return "ring"
    if algo in ("pairwise", "ring", "shm"):
        return algo
    raise ValueError(f"no send pattern for {op} with algorithm {algo!r}")


def split(kind: str, nbytes: int, group=None) -> tuple[int, int]:
    """(inside, cross): the bytes this rank sends to ranks of its own host and of other hosts
    in a collective of send pattern ``kind`` over a full buffer of ``nbytes`` (an all-reduce's:
    its tensor) on ``group``."""
    n, me, same = _plan(group)
    if n == 1:
        return 0, 0
    c = nbytes // n
    if kind in ("ring", "ring_all_reduce"):
        sent = (n - 1) * c * (2 if kind == "ring_all_reduce" else 1)
        return (sent, 0) if same[(me + 1) % n] else (0, sent)
    if kind in ("pairwise", "all_to_all"):
        inside = sum(same) - 1  # others on this host
        return inside * c, (n - 1 - inside) * c
    if kind == "shm":
        return (n - 1) * c, 0
    if kind == "broadcast":  # from this rank, the source
        inside = sum(same) - 1
        return inside * nbytes, (n - 1 - inside) * nbytes
    raise ValueError(f"kind must be one of {PATTERNS}; got {kind!r}")


def host_bytes(kind: str, host_of) -> float:
    """The most that one host sends to other hosts, as a fraction of the full buffer, in a
    collective of send pattern ``kind`` over a group whose rank g is on host ``host_of[g]``
    (pure; [Note: bytes by link]'s model, summed over each host's ranks)."""
    n = len(host_of)
    if n == 1 or len(set(host_of)) == 1:
        return 0.0
    out: dict = {}
    for g, h in enumerate(host_of):
        if kind in ("ring", "ring_all_reduce"):  # n - 1 chunks to the next rank
            sent = (n - 1) / n * (2 if kind == "ring_all_reduce" else 1)
            sent = sent if host_of[(g + 1) % n] != h else 0.0
        elif kind in ("pairwise", "all_to_all"):  # one chunk to each rank of another host
            sent = sum(1 for q in host_of if q != h) / n
        elif kind == "shm":
            return float("inf")  # one host's only
        else:
            raise ValueError(f"kind must be one of {PATTERNS[:-1]}; got {kind!r}")
        out[h] = out.get(h, 0.0) + sent
    return max(out.values())


def _global_ranks(group) -> list[int]:
    if not is_initialized():
        return [0]
    if group is None or group is dist.group.WORLD:
        return list(range(dist.get_world_size()))
    return list(dist.get_process_group_ranks(group))


def _plan(group) -> tuple:
    key = group_key(group)
    got = _plans.get(key)
    if got is None:
        glob, me = _global_ranks(group), rank(group)

        def host(g: int) -> int:
            return _host_of.get(g, -1 - g)  # unknown: a host of its own

        mine = host(glob[me])
        got = _plans[key] = (world_size(group), me, tuple(host(g) == mine for g in glob))
    return got


def forget() -> None:
    _host_of.clear()
    _plans.clear()
