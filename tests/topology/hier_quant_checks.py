"""Checks of the quantized gradients' two-hop form across hosts ([Note: two-hop quantized
reduce-scatter] in zero_kernels/comm/hier_quant.py), run by tests/topology/test_hier_quant_grads.py
on spawned gloo ranks that emulate nodes of ``world // NODES`` ranks: each rank proves hosts in a
/dev/shm folder of its node's (`comm.hosts.SHM_DIR`), so `comm.host_groups` finds the nodes
as it finds network-namespace nodes on the testbed.

The collective against the exact mean (within the bound the quantizer allows, and not exact),
against one hop, with a 1/L of one hop's bytes across; inf kept; error feedback bounding the
error of a sum over steps; ZeroOptimizer at stages 1-3 with int8 and int4 gradients choosing
the two hops and ending close to unquantized training and to one hop."""

from __future__ import annotations

import os
import shutil

import torch
from dist_utils import run_checks
from numerics import rel_err
from torch import nn

NODES = 2


def _emulate_nodes(rank: int, world: int) -> str:
    """Point this rank's host proof at its node's folder; returns the folders' root."""
    from zero_kernels import comm

    root = f"/dev/shm/zk-hier-quant-{os.getppid()}-{world}"
    per = world // NODES
    comm.hosts.SHM_DIR = os.path.join(root, f"node{rank // per}")
    os.makedirs(comm.hosts.SHM_DIR, exist_ok=True)
    return root


def _inputs(world: int, numel: int, seed: int) -> list[torch.Tensor]:
    return [
        torch.randn(numel, generator=torch.Generator().manual_seed(seed + 100 * r)) * (1 + r)
        for r in range(world)
    ]


def _bound(parts: list[torch.Tensor], bits: int, block: int) -> torch.Tensor:
    """Per element: the sum over ``parts`` of half a quantization step of each one's block."""
    qmax = 2 ** (bits - 1) - 1
    out = torch.zeros_like(parts[0])
    for p in parts:
        pad = (-p.numel()) % block
        b = torch.nn.functional.pad(p, (0, pad)).view(-1, block)
        step = b.abs().amax(dim=1, keepdim=True) / qmax
        out += (step / 2).expand_as(b).reshape(-1)[: p.numel()]
    return out


def check_hosts_emulated(rank, world):
    from zero_kernels import comm

    per = world // NODES
    want = [list(range(k * per, (k + 1) * per)) for k in range(NODES)]
    got = comm.host_groups()
    assert got == want, (got, want)
    return {}


def check_two_hop_vs_exact_and_one_hop(rank, world):
    """The collective: each rank's chunk is the mean within the quantizer's bound (the node's
    sums quantized once each), not exact; one hop on the same input as close; bytes across the
    hosts 1/L of one hop's, and the hop inside the node counted apart."""
    from zero_kernels import comm
    from zero_kernels.comm.hier_quant import node_split
    from zero_kernels.comm.quant import GRAD_BLOCK, reduce_scatter_quantized

    comm.learn_hosts()
    hosts = comm.host_groups()
    split = node_split(None, hosts)
    assert split is not None and (split.nodes, split.per_node) == (NODES, world // NODES)
    per = world // NODES
    out = {}
    for c, bits in ((1, 8), (300, 8), (1000, 4), (1000, 8)):
        block = GRAD_BLOCK[bits]
        xs = _inputs(world, c * world, seed=c + bits)
        chunk = slice(rank * c, (rank + 1) * c)
        exact = torch.stack([x[chunk] for x in xs]).double().mean(0).float()
        node_means = [
            torch.stack([xs[q][chunk] for q in range(h * per, (h + 1) * per)]).mean(0)
            for h in range(NODES)
        ]
        mine = rank // per
        bound = _bound([m for h, m in enumerate(node_means) if h != mine], bits, block) / NODES
        two, log2 = torch.full((c,), float("nan")), comm.CommLog()
        split.reduce_scatter(two, xs[rank].clone(), bits=bits, block=block, log=log2).wait()
        err = (two - exact).abs()
        assert bool((err <= bound + 1e-6).all()), (c, bits, (err - bound).max().item())
        one, log1 = torch.full((c,), float("nan")), comm.CommLog()
        reduce_scatter_quantized(one, xs[rank].clone(), bits=bits, block=block, log=log1).wait()
        # one hop quantizes every other rank's chunk alone: its own bound
        others = [xs[q][chunk] for q in range(world) if q != rank]
        assert bool(((one - exact).abs() <= _bound(others, bits, block) / world + 1e-6).all())
        if c >= 300:  # as close as one hop: the node's sums pass the quantizer, fewer of them
            e2, e1 = rel_err(two, exact), rel_err(one, exact)
            assert 0 < e2 <= 1.5 * e1, (c, bits, e2, e1)
        # across: (n-1) packed chunks against one hop's (N - L); inside: the exact hop
        assert log1.cross_node_bytes == per * log2.cross_node_bytes > 0, (log1, log2)
        assert log2.node_reduce_scatter_calls == 1
        assert log2.node_reduce_scatter_bytes == 4 * c * world
        assert log2.reduce_scatter_calls == 1 and log2.inside_node_bytes > 0
        out[f"{c} int{bits}"] = {
            "rel_two": rel_err(two, exact),
            "rel_one": rel_err(one, exact),
            "cross_two": log2.cross_node_bytes,
            "cross_one": log1.cross_node_bytes,
        }
    # inf on one rank reaches every rank's chunk it falls in
    c = 512
    x = torch.randn(c * world, generator=torch.Generator().manual_seed(rank))
    if rank == world - 1:
        x[torch.arange(world) * c + 3] = float("inf")
    got = torch.zeros(c)
    split.reduce_scatter(got, x, bits=8, block=256).wait()
    assert not torch.isfinite(got[:256]).all() and torch.isfinite(got[256:]).all()
    return out


def check_error_feedback_bounds_the_sum(rank, world):
    """With error feedback the error of the sum of K steps' outputs stays one step's; without,
    the same input K times errs K times."""
    from zero_kernels import comm
    from zero_kernels.comm.hier_quant import node_split

    split = node_split(None, comm.host_groups())
    c, k, bits = 1024, 8, 4
    xs = _inputs(world, c * world, seed=7)
    exact = torch.stack([x[rank * c : (rank + 1) * c] for x in xs]).double().mean(0)
    sums = {}
    for fb in (False, True):
        errors = {} if fb else None
        total = torch.zeros(c, dtype=torch.float64)
        for _ in range(k):
            got = torch.zeros(c)
            split.reduce_scatter(got, xs[rank].clone(), bits=bits, block=32, errors=errors).wait()
            total += got.double()
        sums[fb] = (total - k * exact).abs().max().item()
        if fb:
            assert set(errors) == {"reduce_scatter"} and errors["reduce_scatter"].numel() == (
                NODES * c
            )
    one = sums[False] / k  # deterministic: one step's error, k times
    assert sums[True] <= 2 * one, sums
    assert sums[False] >= 3 * sums[True], sums
    return {"feedback": sums[True], "none": sums[False]}


def _model():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 4)
    )


def _train(rank, stage, steps=4, **options):
    from zero_kernels import ZeroOptimizer
    from zero_kernels.policy import ZeroPolicy

    m = _model()
    policy = ZeroPolicy.resolve(stage=stage, bucket_size_mb=0.01, **options)
    zo = ZeroOptimizer(m, torch.optim.AdamW, policy=policy, lr=1e-2)
    for s in range(steps):
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(10 * s + rank))
        zo.zero_grad()
        m(x).pow(2).mean().backward()
        zo.step()
    params = [zo.full_param(p).clone() for p in m.parameters()]
    return zo, params


def _one_host(fn, *args, **kw):
    """``fn(*args, **kw)`` with every rank proving hosts in one folder (one host: one hop)."""
    from zero_kernels import comm

    mine = comm.hosts.SHM_DIR
    comm.hosts.SHM_DIR = os.path.dirname(mine)
    try:
        return fn(*args, **kw)
    finally:
        comm.hosts.SHM_DIR = mine


def check_optimizer_two_hops(rank, world):
    """Stages 1-3 with int8 and int4 gradients choose two hops across the emulated nodes, reduce
    each bucket inside the node first, and end close to unquantized training and to one hop
    (the same run on one host); error feedback keeps its buffers and stays close."""
    out = {}
    for stage, qg, fb in ((1, "int8", False), (2, "int8", True), (3, "int4", False)):
        za, pa = _train(rank, stage)
        za.close()
        zo, pq = _train(rank, stage, quantize_grads=qg, grad_error_feedback=fb)
        st = zo.comm_stats
        choice, why = st["choices"]["quantize_grads"]
        assert choice == "two hops", (choice, why)
        assert st["node_reduce_scatter_calls"] > 0 and st["reduce_scatter_calls"] > 0, st
        if fb:
            assert zo.memory_report()["comm_error_feedback_bytes"] > 0
        zo.close()
        z1, p1 = _one_host(_train, rank, stage, quantize_grads=qg, grad_error_feedback=fb)
        s1 = z1.comm_stats
        assert s1["choices"]["quantize_grads"][0] == "one hop", s1["choices"]
        assert s1["node_reduce_scatter_calls"] == 0
        z1.close()
        d_exact = max(rel_err(a, b) for a, b in zip(pq, pa))
        d_one = max(rel_err(a, b) for a, b in zip(p1, pa))
        # 4 AdamW steps at lr 1e-2 (normalised updates: a small gradient's error moves its
        # param by up to lr a step)
        tol = 1e-1 if qg == "int4" else 5e-2
        assert 0 < d_exact <= tol, (stage, qg, d_exact, d_one)
        assert d_exact <= 2 * d_one + 1e-3, (stage, qg, d_exact, d_one)
        out[f"stage {stage} {qg}{' ef' if fb else ''}"] = {"two_hop": d_exact, "one_hop": d_one}
    return out


def check_link_aware_choice(rank, world):
    """Across the emulated hosts the reduce-scatter is chosen by its bytes on the host link
    (the ring: each node sends (N-1)/N of the buffer; native 2x, pairwise L x), the choice and
    why kept in the log; the all-gather's tie (native, ring) goes to the probe."""
    from zero_kernels import comm

    os.environ.pop(comm.ENV_ALGO, None)
    comm.set_algorithm("all", None)
    comm.learn_hosts()
    c = 4096
    x, out, full = torch.ones(c * world), torch.zeros(c), torch.zeros(c * world)
    log = comm.CommLog()
    comm.reduce_scatter(out, x, log=log).wait()
    assert torch.equal(out, torch.ones(c)), "the mean of ones"
    comm.all_gather(full, out, log=log).wait()
    (rs_algo, rs_why), (ag_algo, ag_why) = (
        next(v for k, v in log.choices.items() if k.startswith(op))
        for op in ("reduce_scatter", "all_gather")
    )
    assert rs_algo == "ring" and f"across {NODES} hosts" in rs_why, (rs_algo, rs_why)
    assert ag_algo in ("native", "ring") and "probe" in ag_why, (ag_algo, ag_why)
    per = world // NODES
    last_of_node = rank % per == per - 1  # the ring's step that leaves the node
    want = 2 * (world - 1) * c * 4 if last_of_node else 0
    assert log.cross_node_bytes == want, (log.cross_node_bytes, want)
    return {"reduce_scatter": rs_algo, "all_gather": ag_algo, "why": rs_why}


CHECKS = [
    check_hosts_emulated,
    check_link_aware_choice,
    check_two_hop_vs_exact_and_one_hop,
    check_error_feedback_bounds_the_sum,
    check_optimizer_two_hops,
]
CHECKS_8 = [check_hosts_emulated, check_link_aware_choice, check_two_hop_vs_exact_and_one_hop]


def _run(rank, world, checks):
    import torch.distributed as dist

    root = _emulate_nodes(rank, world)
    try:
        return run_checks(rank, world, checks)
    finally:
        dist.barrier()
        if rank == 0:
            shutil.rmtree(root, ignore_errors=True)


def worker(rank, world):
    return _run(rank, world, CHECKS)


def worker_8(rank, world):
    return _run(rank, world, CHECKS_8)
