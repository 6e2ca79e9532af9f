"""bench/bench_quant_convergence.py with its ranks on emulated nodes: the quantized gradients
then take the two-hop path ([Note: two-hop quantized reduce-scatter] in
zero_kernels/comm/hier_quant.py) instead of one hop.

Each rank proves hosts in a /dev/shm folder of its node's (`comm.hosts.SHM_DIR`), as the
network-namespace nodes of the testbed do with their own tmpfs, so `comm.host_groups` finds
``--nodes`` nodes of world / nodes ranks; every quantized run asserts that it chose two hops.
Adds the variants ``g8`` (int8 gradients alone), ``g8_ef`` and ``g4_ef`` (int8 / int4 with
error feedback); every
other argument is bench_quant_convergence's (its file names get ``_nodesK`` appended to --tag).

    python bench/bench_hier_quant_convergence.py --nodes 2 --world 4 --variant g8 \
        --dtypes fp32 --resume-at 0 [--seed S]
"""

from __future__ import annotations

import os
import shutil
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_quant_convergence as bqc  # noqa: E402

EXTRA = {
    "g8": {"quantize_grads": "int8"},
    "g8_ef": {"quantize_grads": "int8", "grad_error_feedback": True},
    "g4_ef": {"quantize_grads": "int4", "grad_error_feedback": True},
}


def _checked_build(dtype, quant, init_seed, variant="q8"):
    model, opt = _BUILD(dtype, quant, init_seed, variant)
    if quant and "quantize_grads" in bqc.VARIANTS[variant]:
        choice = opt.comm_stats["choices"].get("quantize_grads")
        assert choice is not None and choice[0] == "two hops", choice
    return model, opt


_BUILD = bqc._build


def _entry(rank: int, port: int, world: int, args: tuple, q) -> None:
    """bench_quant_convergence's rank, after pointing its host proof at its node's folder."""
    from zero_kernels import comm

    root, nodes = os.environ["ZK_BENCH_NODES_ROOT"], int(os.environ["ZK_BENCH_NODES"])
    comm.hosts.SHM_DIR = os.path.join(root, f"node{rank // (world // nodes)}")
    os.makedirs(comm.hosts.SHM_DIR, exist_ok=True)
    bqc.VARIANTS.update(EXTRA)
    bqc._build = _checked_build
    bqc._entry(rank, port, world, args, q)


def main() -> int:
    argv = sys.argv[1:]
    nodes = 2
    if "--nodes" in argv:
        i = argv.index("--nodes")
        nodes = int(argv[i + 1])
        del argv[i : i + 2]
    world = int(argv[argv.index("--world") + 1]) if "--world" in argv else bqc.WORLD
    if nodes < 2 or world % nodes or world // nodes < 2:
        raise SystemExit(f"--nodes {nodes}: need >= 2 nodes of >= 2 ranks each in --world {world}")
    tag = argv.index("--tag") + 1 if "--tag" in argv else None
    if tag is None:
        argv += ["--tag", f"_nodes{nodes}"]
    else:
        argv[tag] += f"_nodes{nodes}"
    root = f"/dev/shm/zk-bench-nodes-{os.getpid()}"
    os.environ["ZK_BENCH_NODES_ROOT"], os.environ["ZK_BENCH_NODES"] = root, str(nodes)
    bqc.VARIANTS.update(EXTRA)
    bqc._entry = _entry  # spawned by reference: this module's function runs in each rank
    sys.argv = [sys.argv[0], *argv]
    try:
        return bqc.main(argv)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
