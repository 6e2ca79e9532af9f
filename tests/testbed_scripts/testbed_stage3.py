"""Stage 3 with the default algorithm choice, a few steps of a small GPT: on the testbed (run as a
script under torchrun, each rank saving what `worker` returns into the out folder) or on one host
(`worker` through tests/dist_utils.run_workers)."""

from __future__ import annotations

import os

import torch
from zero_opt import zero_opt

STEPS = 3
LINKS: dict = {}  # tag -> this rank's (inside, cross) bytes of steps 1.. by the step ledger


def _train(rank: int, stage: int, shard_group) -> tuple[list, dict, int]:
    """Steps 1.. are between the testbed's marks "<tag> start" and "<tag> end" (step 0 probes
    the algorithms: left out), their bytes by link in `LINKS`."""
    from zero_kernels.tools import testbed
    from zero_kernels.tools.models import GPT, GPTConfig, get_batch, load_corpus

    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=32))
    opt = zero_opt(
        model, torch.optim.AdamW, stage=stage, lr=1e-2, timeout=60, shard_group=shard_group
    )
    data = load_corpus()
    losses = []
    tag = f"stage {stage} {'world' if shard_group == 'world' else 'hier'}"
    for step in range(STEPS):
        if step == 1:
            testbed.mark(f"{tag} start")
        x, y = get_batch(data, 2, 32, seed=0, step=step, rank=rank)
        opt.zero_grad()
        loss = model(x, y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    testbed.mark(f"{tag} end")
    ledger = opt.comm_ledger[1:]
    LINKS[tag] = tuple(sum(e[k] for e in ledger) for k in ("inside_node_bytes", "cross_node_bytes"))
    # whole tensors (collective), as numpy arrays: torch's queue would share tensors' storage
    # with the parent through the worker, which may have ended by then
    state = {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}
    size = opt.shard_size
    opt.close()
    return losses, state, size


def worker(rank: int, world: int, shard_group=2) -> dict:
    """``shard_group``: of the hierarchical run ("node" on the testbed, 2 on one host: the same
    shard groups, [[0, 1], [2, 3]])."""
    from zero_kernels import comm

    losses, state, _ = _train(rank, 3, "world")  # stage 3, the default algorithm choice
    algorithms = {f"{op} {c}": res["algorithm"] for (op, c), res in comm.probe_results().items()}
    hier = {stage: _train(rank, stage, shard_group) for stage in (2, 3)}
    return {
        "hier": hier,
        "state": state,
        "losses": losses,
        "algorithms": algorithms,
        "hosts": comm.host_groups(),
        "shm_why": comm.shm.capable(None),
        "explicit_shm": _explicit_shm(world),
        "links": dict(LINKS),
    }


def _explicit_shm(world: int) -> str | None:
    """The error of a reduce-scatter with shm asked for explicitly on the world group (None: it
    ran)."""
    from zero_kernels import comm

    comm.set_algorithm("all", "shm")
    try:
        comm.reduce_scatter(torch.zeros(4), torch.ones(4 * world)).wait()
        return None
    except ValueError as e:
        return str(e)
    finally:
        comm.set_algorithm("all", None)


if __name__ == "__main__":
    from datetime import timedelta

    import torch.distributed as dist

    from zero_kernels.tools import testbed

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    r, n = dist.get_rank(), dist.get_world_size()
    out = worker(r, n, "node")
    torch.save(out, os.path.join(testbed.out_dir(), f"rank{r}.pt"))
    dist.destroy_process_group()
