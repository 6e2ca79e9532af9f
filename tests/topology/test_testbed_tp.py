"""ZeRO over tensor parallelism on the two-node testbed: with the tp pairs inside a node and dp
across, the bytes on the link are dp's only.

One run of bench/bench_testbed_tp.py's ranks (2 nodes x 2 ranks, 1 Gbit/s, its "tiny" TP GPT,
ZeroOptimizer stage 2, 1 warm-up and 1 measured step) on two meshes in turn: dp 2 x tp 2
(``init_device_mesh(..., ("dp", "tp"))``: tp = ranks {0, 1} and {2, 3}, each a node) and the
same mesh transposed (``("tp", "dp")``: tp across the link). Bands, each node's bytes sent per
step over the link (tc's counters, payload plus ~4.7% of headers):

- tp inside: within [1.0, 1.15] of the estimator's dp bytes (`cross_node` over one rank's local
  elements, tp=2), and ZeroOptimizer's own count of its bytes across nodes within 1% of them;
- transposed: within [0.95, 1.25] of tp's payload as the ranks counted it (the DTensor
  collectives of a step, priced as gloo sends them across), and at least 4x the tp-inside
  bytes; tp's payload is at least 2x dp's, so the two layouts cannot be mistaken.
"""

from __future__ import annotations

import importlib.util
import os

import pytest

from zero_kernels.tools.estimate_links import cross_node

pytestmark = pytest.mark.distributed

BENCH = os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench", "bench_testbed_tp.py"
)
BENCH = os.path.normpath(BENCH)


def _bench():
    spec = importlib.util.spec_from_file_location("bench_testbed_tp", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def runs(testbed):  # the fixture skips, with the reason, where no testbed can be made
    bench = _bench()
    args = bench.worker_args(1, 1, "tiny", 2, "zero2", "tp_inside,tp_across")
    res = testbed(BENCH, *args, nodes=2, ranks_per_node=2, timeout=150)
    assert res.ok, (res.exit_codes, [open(n.log).read()[-3000:] for n in res.nodes])
    return bench.collect(res, steps=1, tp=2)


def test_layouts(runs):
    inside, across = runs["tp_inside"], runs["tp_across"]
    assert inside["groups"] == {"dp": [[0, 2], [1, 3]], "tp": [[0, 1], [2, 3]]}, inside
    assert inside["groups_cross_nodes"] == {"dp": [True, True], "tp": [False, False]}
    assert across["groups"] == {"dp": [[0, 1], [2, 3]], "tp": [[0, 2], [1, 3]]}, across
    assert across["groups_cross_nodes"] == {"dp": [False, False], "tp": [True, True]}


def test_link_carries_dp_only(runs):
    c = runs["tp_inside"]["cands"]["zero2"]
    est = c["dp_estimate_bytes_per_node_per_step"]
    assert est == 2 * 2 * 4 * c["local_elements"] / 2  # 2 ranks x (RS + AG) x fp32 x (n-1)/n
    sent = c["sent_bytes_per_node_per_step"]
    assert all(1.0 <= s / est <= 1.15 for s in sent), (sent, est)
    counted = c["counted_cross_bytes_per_node"]
    assert all(abs(x / est - 1) <= 0.01 for x in counted), (counted, est)
    # tp's payload, were it on the link, would be more than dp's twice over: not hidden in it
    assert min(c["tp_send_bytes_per_node"]) >= 2 * est, (c["tp_send_bytes_per_node"], est)


def test_transposed_mesh_puts_tp_on_the_link(runs):
    inside = runs["tp_inside"]["cands"]["zero2"]
    across = runs["tp_across"]["cands"]["zero2"]
    sent, tp = across["sent_bytes_per_node_per_step"], across["tp_send_bytes_per_node"]
    assert all(0.95 <= s / t <= 1.25 for s, t in zip(sent, tp)), (sent, tp)
    assert all(s >= 4 * i for s, i in zip(sent, inside["sent_bytes_per_node_per_step"])), (
        sent,
        inside["sent_bytes_per_node_per_step"],
    )
    assert across["counted_cross_bytes_per_node"] == [0, 0]  # dp stays inside the nodes


def test_cross_node_tp():
    """`cross_node(..., tp=k)`: a node's k tp ranks each in a dp group of their own."""
    one = {r["config"]: r["bytes"] for r in cross_node(455424, 2, 1)}
    two = {r["config"]: r["bytes"] for r in cross_node(455424, 2, 1, tp=2)}
    assert two == {k: 2 * v for k, v in one.items()}
    assert two["stage 2"] == 2 * 4 * 455424  # RS + AG of fp32 local elements, half each
    for bad in (0, True, 1.5):
        with pytest.raises(ValueError, match="--tp"):
            cross_node(10, 2, 1, tp=bad)
