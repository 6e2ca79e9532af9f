"""Checks of hierarchical sharding (``shard_group``), run by tests/topology/test_hier.py on 4 gloo
ranks
(2 shard groups of 2 ranks): every stage trains as DDP does (fused AdamW, clipping), the
whole-state accessors and torch's consolidated state see one copy of the state, the bytes across
replica groups are one shard per bucket, and bad values are errors naming the argument."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from dist_utils import run_checks
from numerics import rel_err
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from zero_opt import zero_opt


def _model():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(12, 40), nn.Tanh(), nn.Linear(40, 40), nn.Tanh(), nn.Linear(40, 3, bias=False)
    )


def _train(rank, stage, steps=4, clip=None, torch_clip=False, **kw):
    """Our model and optimizer and DDP's after ``steps`` steps on the same per-rank batches."""

    base = _model()
    m, r = copy.deepcopy(base), copy.deepcopy(base)
    extra = dict(units=[m[0], m[2]]) if stage == 3 else {}
    hp = dict(lr=1e-2, weight_decay=0.1)
    zo = zero_opt(m, torch.optim.AdamW, stage=stage, bucket_size_mb=0.002, **extra, **hp, **kw)
    ddp = DDP(r)
    to = torch.optim.AdamW(r.parameters(), fused=True, **hp)
    norms = []
    for s in range(steps):
        g = torch.Generator().manual_seed(100 * s + rank)
        x = torch.randn(6, 12, generator=g)
        zo.zero_grad()
        to.zero_grad()
        m(x).pow(2).mean().backward()
        ddp(x).pow(2).mean().backward()
        if clip is not None:
            a = (
                torch.nn.utils.clip_grad_norm_(list(m.parameters()), clip)
                if torch_clip
                else zo.clip_grad_norm_(clip)
            )
            b = torch.nn.utils.clip_grad_norm_(r.parameters(), clip)
            norms.append((float(a), float(b)))
        zo.step()
        to.step()
    return zo, m, r, to, norms


def _same_params(zo, m, r, tol, what):
    with zo.gathered_params():
        d = max(rel_err(a, b) for a, b in zip(m.parameters(), r.parameters()))
    assert d <= tol, f"{what}: {d:.3g} from DDP"
    return d


def check_stages_match_ddp(rank, world):
    out = {}
    for stage in (1, 2, 3):
        zo, m, r, _, _ = _train(rank, stage, shard_group=2)
        assert zo.shard_size == 2 and zo.world_size == world, (zo.shard_size, zo.world_size)
        assert zo.layout.world_size == 2
        out[f"stage {stage}"] = _same_params(zo, m, r, 2e-6, f"stage {stage}, shard_group=2")
        zo.close()
    return out


def check_clipping_over_one_copy(rank, world):
    """The global norm counts each gradient element once (replicas hold the same shard): with
    both clip paths, at a max_norm that clips every step."""
    out = {}
    for stage, torch_clip in ((2, False), (3, True), (1, True)):
        zo, m, r, _, norms = _train(rank, stage, clip=0.05, torch_clip=torch_clip, shard_group=2)
        for a, b in norms:
            assert abs(a - b) <= 1e-5 * b, f"stage {stage}: norm {a} vs DDP's {b}"
        assert norms[0][1] > 0.05, norms  # it did clip
        out[f"stage {stage}"] = _same_params(zo, m, r, 2e-6, f"stage {stage} clipped")
        zo.close()
    return out


def check_whole_state_one_copy(rank, world):
    zo, m, r, to, _ = _train(rank, 2, steps=2, shard_group=2)
    w = m[2].weight
    assert rel_err(zo.full_param(w), r[2].weight.detach()) <= 2e-6
    st = zo.full_state(w)
    ref = to.state[r[2].weight]
    assert rel_err(st["exp_avg"], ref["exp_avg"]) <= 2e-5
    assert rel_err(st["exp_avg_sq"], ref["exp_avg_sq"]) <= 2e-5
    got = {}
    for to_rank in (0, 3):  # rank 3 is in the second shard group
        got[to_rank] = zo.consolidated_state_dict(to=to_rank)  # every rank calls both
    zo.close()
    for to_rank, sd in got.items():
        if rank != to_rank:
            assert sd is None, f"consolidated_state_dict(to={to_rank}) returned on rank {rank}"
            continue
        assert len(sd["state"]) == len(list(m.parameters()))
        # param 2 is m[2].weight (params: 0, 1 of m[0]; 2, 3 of m[2]; 4 of m[4])
        assert rel_err(sd["state"][2]["exp_avg"], ref["exp_avg"]) <= 2e-5
        assert rel_err(sd["state"][2]["exp_avg_sq"], ref["exp_avg_sq"]) <= 2e-5


def check_bytes_across_replicas(rank, world):
    """Per step, what crosses replica groups is each bucket's shard once (fp32), and the
    reduce-scatter stays inside the shard group."""
    zo, m, r, _, _ = _train(rank, 2, steps=3, shard_group=2)
    cs = zo.comm_stats
    shard_numel = sum(b.shard_numel(2) for b in zo.layout.buffers)
    assert cs["replica_all_reduce_bytes"] == 3 * 4 * shard_numel, (cs, shard_numel)
    n_buckets = sum(len(b.buckets) for b in zo.layout.buffers)
    assert cs["replica_all_reduce_calls"] == 3 * n_buckets, cs
    zo.close()
    zo, *_ = _train(rank, 2, steps=1)  # flat: nothing across replicas
    assert zo.comm_stats["replica_all_reduce_bytes"] == 0
    zo.close()


def check_bytes_by_link(rank, world):
    """[Note: bytes by link]: what each rank sends, by the algorithm that ran. On one host (as
    proven) nothing crosses. With the world taken for two hosts {0, 1} {2, 3}: a ring (ours, and
    gloo's all-gather) sends 3 chunks to the next rank (inside for ranks 0 and 2, across for 1
    and 3), gloo's reduce-scatter twice that (an all-reduce), pairwise one chunk to each other
    rank (1 inside, 2 across), the quantized reduce-scatter's all-to-all as pairwise. Training
    with shard_group=2 on those hosts: only the replica all-reduce crosses; the step ledger has
    one entry per step and its entries add up to comm_stats."""
    from zero_kernels import comm
    from zero_kernels.comm import hosts, links
    from zero_kernels.comm.quant import packed_sizes, reduce_scatter_quantized

    key = comm.base.group_key(None)
    saved = hosts.PROVEN.get(key)
    numel, c = 1024, 1024  # the full buffer (fp32: 4096 bytes), a chunk in bytes
    x, out, full = torch.ones(numel), torch.zeros(numel // world), torch.zeros(numel)

    def sent(op, algo):
        comm.set_algorithm("all", algo)
        log = comm.CommLog()
        if op == "rs":
            comm.reduce_scatter(out, x, log=log).wait()
        else:
            comm.all_gather(full, out, log=log).wait()
        return log.inside_node_bytes, log.cross_node_bytes

    got = {}
    try:
        links.forget()
        assert links.learn() == [[0, 1, 2, 3]]
        for algo in ("pairwise", "ring", "shm", "native"):
            rs = 6 * c if algo == "native" else 3 * c  # gloo's reduce-scatter: an all-reduce
            assert sent("rs", algo) == (rs, 0), (algo, sent("rs", algo))
            assert sent("ag", algo) == (3 * c, 0), algo
        hosts.PROVEN[key] = ((0, 1), (2, 3))  # as the proof finds two nodes (the testbed)
        real = hosts.host_groups  # every group's proof (the optimizer's side group's too)
        hosts.host_groups = lambda group=None: [[0, 1], [2, 3]]
        links.forget()
        assert links.learn() == [[0, 1], [2, 3]]
        nxt_inside = rank in (0, 2)
        for algo in ("pairwise", "ring", "native"):
            for op in ("rs", "ag"):
                k = 6 if (algo, op) == ("native", "rs") else 3
                want = (
                    (c, 2 * c) if algo == "pairwise" else (k * c, 0) if nxt_inside else (0, k * c)
                )
                got[f"{op} {algo}"] = sent(op, algo)
                assert got[f"{op} {algo}"] == want, (op, algo, got[f"{op} {algo}"], want)
        log = comm.CommLog()
        reduce_scatter_quantized(out, x, bits=8, block=256, group=None, log=log).wait()
        per = packed_sizes(numel // world, 8, 256)[2]
        assert (log.inside_node_bytes, log.cross_node_bytes) == (per, 2 * per), (log, per)
        assert log.reduce_scatter_bytes == world * per
        comm.set_algorithm("all", "pairwise")
        zo, *_ = _train(rank, 2, steps=3, shard_group=2)
        cs, ledger = zo.comm_stats, zo.comm_ledger
        zo.close()
        # inside: the 2-rank shard group's pairwise reduce-scatters and gathers, half of each
        # buffer; across: the shards' all-reduce over 2 replicas, a ring of 2 sends it once
        assert cs["cross_node_bytes"] == cs["replica_all_reduce_bytes"] > 0, cs
        assert 2 * cs["inside_node_bytes"] == cs["reduce_scatter_bytes"] + cs["all_gather_bytes"]
        assert [(e["step"], e["outcome"]) for e in ledger] == [
            (0, "stepped"),
            (1, "stepped"),
            (2, "stepped"),
        ], ledger
        for k in (
            "reduce_scatter_bytes",
            "all_gather_bytes",
            "inside_node_bytes",
            "cross_node_bytes",
            "replica_all_reduce_calls",
        ):
            assert sum(e[k] for e in ledger) == cs[k], (k, ledger, cs)
            assert len({e[k] for e in ledger}) == 1, (k, ledger)  # every step the same
    finally:
        comm.set_algorithm("all", None)
        if "real" in locals():
            hosts.host_groups = real
        if saved is None:
            hosts.PROVEN.pop(key, None)
        else:
            hosts.PROVEN[key] = saved
        links.forget()
    return got


def check_shorthands(rank, world):
    """ "node" on one host and K = world are the flat layout; a 2-D DeviceMesh as FSDP2 takes
    it is shard_group=2's."""
    from torch.distributed.device_mesh import init_device_mesh

    out = {}
    for spec in ("node", world):
        zo, m, r, _, _ = _train(rank, 2, steps=2, shard_group=spec)
        assert zo.shard_size == world and zo.sharded_state.n_replicas == 1, spec
        out[str(spec)] = _same_params(zo, m, r, 2e-6, f"shard_group={spec!r}")
        zo.close()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    zo, m, r, _, _ = _train(rank, 3, steps=2, shard_group=mesh)
    assert zo.shard_size == 2 and zo.sharded_state.n_replicas == 2
    out["mesh"] = _same_params(zo, m, r, 2e-6, "shard_group=DeviceMesh")
    zo.close()
    return out


def check_bad_values(rank, world):
    import pytest

    for bad, err, words in (
        (3, ValueError, "shard_group=3: must divide the world size 4"),
        ("rack", ValueError, "shard_group='rack'"),
        (0, ValueError, "shard_group=0"),
    ):
        with pytest.raises(err, match=words):
            zero_opt(_model(), torch.optim.AdamW, stage=2, shard_group=bad, lr=1e-3)
    dist.barrier()


def check_checkpoint_across_layouts(rank, world):
    """A checkpoint saved by a hierarchical layout (the first shard group writes) loads into
    another hierarchical one, a flat one, and a different stage: every param's fp32 value and
    AdamW state as saved; and a flat save loads into a hierarchical layout."""
    import tempfile

    from zero_kernels.checkpoint import load_checkpoint, save_checkpoint

    root = tempfile.mkdtemp(prefix="zk-hier-ckpt-") if rank == 0 else None
    box = [root]
    dist.broadcast_object_list(box, src=0)
    root = box[0]
    zo, m, _, _, _ = _train(rank, 2, steps=2, shard_group=2)
    params = list(m.parameters())
    want = [(zo.full_param(p), zo.full_state(p)) for p in params]
    path = save_checkpoint(root + "/a", m, zo)
    zo.close()
    out = {}
    for stage, sg in ((3, 2), (1, "world"), (2, 2)):
        m2 = _model()
        extra = dict(units=[m2[0], m2[2]]) if stage == 3 else {}
        z2 = zero_opt(m2, torch.optim.AdamW, stage=stage, shard_group=sg, lr=1e-2, **extra)
        load_checkpoint(path, m2, z2)
        worst = 0.0
        for p, (v, st) in zip(m2.parameters(), want):
            got = z2.full_state(p)
            worst = max(worst, rel_err(z2.full_param(p), v))
            for k in ("exp_avg", "exp_avg_sq"):
                worst = max(worst, rel_err(got[k], st[k]))
        assert worst == 0.0, f"stage {stage}, shard_group={sg!r}: {worst:.3g} off what was saved"
        out[f"stage {stage} shard_group={sg}"] = worst
        if sg == "world":  # and back: a flat save into a hierarchical layout
            flat = save_checkpoint(root + "/b", m2, z2)
        z2.close()
    m3 = _model()
    z3 = zero_opt(m3, torch.optim.AdamW, stage=2, shard_group=2, lr=1e-2)
    load_checkpoint(flat, m3, z3)
    for p, (v, _) in zip(m3.parameters(), want):
        assert rel_err(z3.full_param(p), v) == 0.0
    z3.close()
    dist.barrier()
    if rank == 0:
        import shutil

        shutil.rmtree(root, ignore_errors=True)
    return out


CHECKS = [
    check_stages_match_ddp,
    check_clipping_over_one_copy,
    check_whole_state_one_copy,
    check_bytes_across_replicas,
    check_bytes_by_link,
    check_shorthands,
    check_bad_values,
    check_checkpoint_across_layouts,
]


def worker(rank, world):
    return run_checks(rank, world, CHECKS)
