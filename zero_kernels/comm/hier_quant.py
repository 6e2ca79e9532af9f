"""The quantized gradient reduce-scatter in two hops for a flat group that spans hosts: exact
inside each node, quantized across the nodes on the node's reduced slice (ZeRO++'s qgZ shape).

[Note: two-hop quantized reduce-scatter]
A flat shard group of N = n x L ranks (n hosts of L ranks each, `comm.host_groups`) reduces a
gradient bucket of N chunks of c elements; rank r keeps chunk r. The one-hop form ([Note:
quantized reduce-scatter] in quant.py) sends every other rank its chunk quantized: each node
puts L (N - L) chunks on its link, L (n - 1) / n of the bucket. Here:

    1. every rank copies its bucket into node order: slice l (one per local index l of the
       node's L ranks) holds, in the cross group's rank order, the chunks of the n ranks with
       local index l (one per host); the copy is the bucket's size, made at launch;
    2. exact reduce-scatter (averaged) over the node's L ranks (whichever algorithm the probe
       chose there: shm, ring, ...): local rank l holds the node's mean of slice l, n chunks;
    3. quantized reduce-scatter (`reduce_scatter_quantized`, averaged) over the n ranks of local
       index l, one per host: rank (h, l) ends with the mean over all N ranks of its own chunk.

          node 0: r0 r1   node 1: r2 r3        chunks 0 1 2 3 -> slices (0 2) (1 3)
          hop 1 (exact, in node):  r0: node-0 sum of (0 2)   r1: node-0 sum of (1 3) ...
          hop 2 (int8, across):    r0 <-> r2 on (0 2): r0 gets 0, r2 gets 2; r1 <-> r3: 1, 3

A node sends (n - 1) / n of the bucket across, quantized: 1/L of the one-hop form's bytes, and
each rank's contribution passes the quantizer once (its node's sum does), as in one hop.
Error feedback ([Note: error feedback] in quant.py) keeps, per bucket, what the second hop's
quantization of the node's sum drops (n chunks, fp32); non-finite values pass both hops.
Extra cost: the copy in node order and the hop-1 output (n chunks) per bucket in flight, and the
fp32 hop inside the node ((L - 1) / L of the bucket per rank on the fast link).

`plan` chooses from the host layout (a pure function): the two hops where the group spans
several hosts of L >= 2 ranks each (their bytes across are 1/L of one hop's: half at L = 2);
one hop on one host (nothing crosses), with one rank per host (the two forms are the same) and
with hosts of unequal rank counts (the slices would not line up). ``ZERO_KERNELS_GRAD_HOPS=1``
keeps one hop (where the hop inside the node costs more than the bytes saved across: ranks
sharing a few cores), ``2`` asks for two (an error where the layout has none), ``auto`` or
unset: `plan`; the same on every rank. The choice and its reason are logged and kept in the
optimizer's ``comm_stats["choices"]["quantize_grads"]``.

The second hops of one cross group start in launch order on every rank (polled like the
hierarchical all-reduce's, [Note: hierarchy] in hier.py), so ranks never pair different buckets.
"""

from __future__ import annotations

import dataclasses
import logging
import os

import torch
import torch.distributed as dist

from .base import CommLog, Watch, rank, world_size
from .collectives import reduce_scatter

__all__ = ["ENV_HOPS", "NodeSplit", "node_split", "plan"]

_logger = logging.getLogger("zero_kernels")
ENV_HOPS = "ZERO_KERNELS_GRAD_HOPS"


def plan(hosts: list[list[int]], hops: int | str | None = None) -> tuple[int, str]:
    """(hops, why): 2 for the two-hop form, 1 for one hop, from the group's hosts (lists of
    group ranks, `comm.host_groups`) and ``hops`` (1, 2, "auto" or None: ``ZERO_KERNELS_GRAD_HOPS``
    where set, else "auto"); pure but for that variable ([Note: two-hop quantized
    reduce-scatter]). Two hops asked for where the layout has none: a ValueError saying why."""
    if hops is None:
        hops = os.environ.get(ENV_HOPS, "auto").strip().lower() or "auto"
    if str(hops) not in ("1", "2", "auto"):
        raise ValueError(f"{ENV_HOPS} (grad hops) must be 1, 2 or auto; got {hops!r}")
    auto, why = _plan(hosts)
    if str(hops) == "1":
        return 1, f"{ENV_HOPS}=1 (else: {why})"
    if str(hops) == "2" and auto != 2:
        raise ValueError(f"{ENV_HOPS}=2: the group's hosts {hosts} have no two hops ({why})")
    return auto, why


def _plan(hosts: list[list[int]]) -> tuple[int, str]:
    n = len(hosts)
    sizes = sorted({len(h) for h in hosts})
    if n <= 1:
        return 1, "one host: no bytes cross a host link"
    if len(sizes) != 1:
        return 1, f"hosts of unequal rank counts {[len(h) for h in hosts]}: one hop"
    per = sizes[0]
    if per == 1:
        return 1, "one rank per host: one hop is the two-hop form"
    return 2, (
        f"{n} hosts x {per} ranks: each node sends {(n - 1) / n:.3g} of a bucket across "
        f"instead of one hop's {per * (n - 1) / n:.3g} ({per}x fewer bytes)"
    )


@dataclasses.dataclass(eq=False)
class NodeSplit:
    """The groups of the two-hop form over a flat group of ``nodes`` x ``per_node`` ranks:
    ``node`` (this rank's host), ``cross`` (the ranks of this rank's local index, one per
    host), ``order`` (the bucket's chunks in node order: step 1 of the Note) and the queue of
    handles whose second hop has not started."""

    node: object
    cross: object
    order: torch.Tensor
    nodes: int
    per_node: int
    why: str
    pending: list = dataclasses.field(default_factory=list)
    _orders: dict = dataclasses.field(default_factory=dict)  # device -> ``order`` there

    def reduce_scatter(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        *,
        bits: int,
        block: int,
        log: CommLog | None = None,
        timeout_s: float | None = None,
        what: str = "",
        watch: Watch | None = None,
        errors: dict | None = None,
    ):
        """Start ``output`` = the mean over the group of ``input``, this rank's chunk; the
        cross-host hop quantized ([Note: two-hop quantized reduce-scatter]). ``output`` may be
        this rank's chunk of ``input``."""
        n_all = self.nodes * self.per_node
        c = output.numel()
        if c * n_all != input.numel():
            raise ValueError(
                f"two-hop reduce-scatter: output.numel() * world_size must equal input.numel(); "
                f"got {c} * {n_all} != {input.numel()}"
            )
        order = self._orders.get(input.device)
        if order is None:
            order = self._orders[input.device] = self.order.to(input.device)
        staged = input.reshape(n_all, c).index_select(0, order)
        mid = torch.empty(self.nodes * c, dtype=input.dtype, device=input.device)
        first = reduce_scatter(
            mid, staged.view(-1), group=self.node, avg=True, log=log, kind=None,
            timeout_s=timeout_s, what=what + " (inside the node)", watch=watch,
        )  # fmt: skip
        if log is not None:
            log._add("node_reduce_scatter", staged)
        h = _TwoHopQuant(
            self, first, staged, mid, output, bits, block, log, errors, timeout_s, what
        )
        self.pending.append(h)
        return h


class _TwoHopQuant:
    """Hop 1 (exact, inside the node), then hop 2 (quantized, across) of one bucket."""

    __slots__ = (
        "split", "first", "second", "staged", "mid", "out", "bits", "block", "log", "errors",
        "timeout_s", "what", "done",
    )  # fmt: skip

    def __init__(self, split, first, staged, mid, out, bits, block, log, errors, timeout_s, what):
        self.split, self.first, self.second = split, first, None
        self.staged, self.mid, self.out = staged, mid, out
        self.bits, self.block, self.log, self.errors = bits, block, log, errors
        self.timeout_s, self.what, self.done = timeout_s, what, False

    def _start_second(self, watch=None) -> None:
        """Start the second hop of this handle and of every earlier one (launch order)."""
        from .quant import reduce_scatter_quantized

        q = self.split.pending
        while self.second is None and q:
            h = q.pop(0)
            h.first.wait(h.timeout_s, h.what + " (inside the node)", watch)
            h.staged = None
            h.second = reduce_scatter_quantized(
                h.out, h.mid, bits=h.bits, block=h.block, group=h.split.cross, avg=True,
                log=h.log, errors=h.errors,
            )  # fmt: skip

    def is_completed(self) -> bool:
        if self.done:
            return True
        if self.second is None:
            if not self.first.is_completed():
                return False
            q = self.split.pending
            if q and q[0] is not self:  # an earlier bucket's second hop goes first
                return False
            self._start_second()
        return self.second.is_completed()

    def wait(self, timeout_s: float | None = None, what: str = "", watch: Watch | None = None):
        if self.done:
            return self.out
        self._start_second(watch)
        self.second.wait(timeout_s, (what or self.what) + " (across the nodes)", watch)
        self.done, self.mid = True, None
        return self.out


def node_split(group, hosts: list[list[int]], hops: int | str | None = None) -> NodeSplit | None:
    """The `NodeSplit` of ``group`` whose ranks share hosts as ``hosts`` says (group ranks,
    `comm.host_groups`), or None where `plan` keeps one hop. Collective over the default group
    where it makes groups (every rank calls it alike, as `hier.split`)."""
    hops, why = plan(hosts, hops)
    me, n_all = rank(group), world_size(group)
    if sorted(r for h in hosts for r in h) != list(range(n_all)):
        raise ValueError(f"node_split: hosts {hosts} are not the group's ranks 0..{n_all - 1}")
    if hops == 1:
        _logger.info("comm: quantized gradients on %d ranks: one hop (%s)", n_all, why)
        return None
    glob = dist.get_process_group_ranks(group) if group is not None else list(range(n_all))
    hosts = [sorted(h) for h in hosts]
    per = len(hosts[0])
    node = cross = None
    for h in hosts:
        pg = dist.new_group(ranks=[glob[r] for r in h])
        if me in h:
            node = pg
    crosses = []
    for lo in range(per):
        members = sorted(h[lo] for h in hosts)  # a new group numbers its ranks in this order
        crosses.append(members)
        pg = dist.new_group(ranks=[glob[r] for r in members])
        if me in members:
            cross = pg
    order = torch.tensor([r for members in crosses for r in members], dtype=torch.long)
    _logger.info("comm: quantized gradients on %d ranks: two hops (%s)", n_all, why)
    return NodeSplit(node, cross, order, len(hosts), per, why)
