"""The bytes per node per step that cross the nodes' links, for each of a set of configurations
(hierarchical sharding, quantized weights and gradients, the secondary shard): the
`zero-kernels estimate --nodes` table. The per-rank memory and communication of one stage are
`zero_kernels.tools.estimate`'s."""

from __future__ import annotations

from ..comm.choose import link_bytes, link_candidates
from ..comm.hier_quant import plan as grad_hops_plan
from .estimate import GRAD_REDUCE_BYTES, precision_of

__all__ = ["CROSS_NODE_CONFIGS", "cross_node"]

# the configurations `cross_node` prices:
# (label, stage, shard_group, quantize_weights, quantize_grads, secondary_shard)
CROSS_NODE_CONFIGS = (
    ("DDP", 0, "world", None, None, None),
    ("stage 1", 1, "world", None, None, None),
    ("stage 2", 2, "world", None, None, None),
    ("stage 2, int8 grads", 2, "world", None, "int8", None),
    ("stage 3", 3, "world", None, None, None),
    ("stage 3, int8 weights", 3, "world", "int8", None, None),
    ("stage 3, int8 weights + int8 grads", 3, "world", "int8", "int8", None),
    ("stage 3, int8 weights + int4 grads", 3, "world", "int8", "int4", None),
    ("stage 3, secondary_shard=node", 3, "world", None, None, "node"),
    (
        "stage 3, secondary_shard=node + int8 weights + int8 grads",
        3,
        "world",
        "int8",
        "int8",
        "node",
    ),
    (
        "stage 3, secondary_shard=node + int8 weights + int4 grads",
        3,
        "world",
        "int8",
        "int4",
        "node",
    ),
    ("stage 1-3, shard_group=node", 2, "node", None, None, None),
)
_QUANT_BYTES = {"int8": 1 + 4 / 256, "int4": 0.5 + 4 / 256}  # per element, with the scales
_GRAD_QUANT_BYTES = {"int8": 1 + 4 / 256, "int4": 0.5 + 4 / 32}  # comm.quant.GRAD_BLOCK


def cross_node(
    n_params: int,
    nodes: int,
    ranks_per_node: int,
    *,
    precision: str = "fp32",
    reshard_after_forward: bool = True,
    grad_hops: int | str = "auto",
    tp: int = 1,
) -> list[dict]:
    """Bytes per node per step that cross the nodes' links, for each of `CROSS_NODE_CONFIGS`:
    ring collectives over ranks numbered node-major (a ring leaves each node once, so a node
    sends (N-1)/N of a reduce-scatter's or all-gather's payload and 2 (N-1)/N of an
    all-reduce's), gradients reduced in fp32 as ZeroOptimizer does. The reduce-scatters' and
    all-gathers' algorithm is the one a run on gloo chooses across hosts, by its bytes on the
    host link (`comm.choose.link_candidates`, [Note: link-aware choice]; the most of those it
    keeps): the ring for reduce-scatters (gloo's native one is an all-reduce, 2x), the ring or
    gloo's native (a ring too) for all-gathers. With ``shard_group="node"``
    (any stage) only the gradient shards' all-reduce across the nodes crosses: 2 (n-1)/n of the
    gradients per node ([Note: hierarchy] in `zero_kernels.comm.hier`). Quantized weights: the
    gathers' packed bytes (1 + 4/256 per element at int8); quantized gradients: in two hops
    where `comm.hier_quant.plan` takes them (several nodes of R >= 2 ranks: the node's exact
    reduce-scatter, then the packed exchange across, (n-1)/n of the gradients per node; [Note:
    two-hop quantized reduce-scatter]), else in one (an all-to-all of packed chunks, of which
    each rank sends the ones for the ranks of other nodes, R (N - R) / N of the gradients per
    node). With ``secondary_shard="node"`` (hpZ) the backward's all-gathers stay inside the
    nodes: only the forward's gathers cross. The bench (bench/bench_testbed.py) measured these
    on its testbed within the 4.7-5.0% of headers. Each row also names the algorithms
    (``algorithms``) and the gradients' hops (``grad_hops``; the argument: 1, 2 or "auto", as
    ``ZERO_KERNELS_GRAD_HOPS``).

    ``tp``: tensor parallelism of that size inside each node beside the dp ranks (dp outer,
    tp inner, as ``init_device_mesh(..., (dp, tp), ("dp", "tp"))`` over node-major ranks):
    ``n_params`` is then one rank's local elements (params / tp, the replicated ones whole)
    and ``ranks_per_node`` one dp group's ranks on a node; a node holds tp such ranks, each in
    a dp group of its own, and sends tp times their bytes (tp's own collectives stay inside
    the node: bench/bench_testbed_tp.py measures both). Of the rows, ZeroOptimizer builds the
    plain stages under tp (docs/tensor_parallel.md, "Not built")."""
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ValueError(f"--tp must be an int >= 1, got {tp!r}")
    if nodes < 1 or ranks_per_node < 1:
        raise ValueError(
            f"--nodes and ranks per node must be >= 1; got nodes={nodes}, "
            f"ranks_per_node={ranks_per_node}"
        )
    prec = precision_of(precision)
    psi = float(n_params)
    n_all, n = nodes * ranks_per_node, nodes
    g, p = GRAD_REDUCE_BYTES * psi, prec.param_bytes * psi
    host_of = [k // ranks_per_node for k in range(n_all)]
    ring = (n_all - 1) / n_all if n > 1 else 0.0  # the all-reduces' (gloo's ring)
    algos, frac = {}, {}
    for op in ("reduce_scatter", "all_gather"):
        if n_all == 1:
            algos[op], frac[op] = "copy", 0.0
            continue
        keep, _ = link_candidates(op, host_of)
        cost = link_bytes(op, host_of)
        algos[op] = "|".join(keep)
        frac[op] = max(cost[a] for a in keep)
    hops, _ = grad_hops_plan(
        [list(range(k, k + ranks_per_node)) for k in range(0, n_all, ranks_per_node)], grad_hops
    )
    rows = []
    r_node = ranks_per_node
    for label, stage, sg, qw, qg, ss in CROSS_NODE_CONFIGS:
        gathered = _QUANT_BYTES[qw] * psi if qw else p
        if qg and hops == 2:  # the packed exchange across, on each node's reduced slice
            reduced = (n - 1) / n * _GRAD_QUANT_BYTES[qg] * psi
        elif qg:  # the all-to-all: each node sends its ranks' chunks for the other nodes' ranks
            reduced = r_node * (n_all - r_node) / n_all * _GRAD_QUANT_BYTES[qg] * psi
        else:
            reduced = frac["reduce_scatter"] * g
        if sg == "node":
            b = 2 * (n - 1) / n * g
        elif stage == 0:
            b = 2 * ring * g
        elif stage in (1, 2) or not reshard_after_forward or ss is not None:
            b = reduced + frac["all_gather"] * gathered
        else:
            b = reduced + frac["all_gather"] * 2 * gathered
        rows.append(
            {
                "config": label,
                "stage": stage,
                "shard_group": sg,
                "quantize_weights": qw,
                "quantize_grads": qg,
                "secondary_shard": ss,
                "bytes": tp * b,
                "algorithms": {} if sg == "node" or stage == 0 else dict(algos),
                "grad_hops": (hops if sg != "node" else 2) if qg else None,
            }
        )
    return rows
