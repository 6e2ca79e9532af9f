"""What each rank of `zero-kernels tune` runs: the probe (collective bandwidth per algorithm and
size, compute time, activations, optimizer step) and one trial of one configuration.

Each job is a fresh set of processes (forked from a server that has torch imported, so a job
starts in about half a second) with its own gloo process group: nothing a trial allocated can
hide in another trial's memory. The ranks send rank 0's gathered results to the supervisor
(`zero_kernels.cli.tune`) through a queue; a rank that fails sends its error and exits 1.

[Note: preloading]
The server that forks the ranks imports this module, so what it imports is loaded once, not in
every job: torch, zero_kernels' optimizer and DDP, and torch._dynamo, which torch.optim imports
when the first optimizer is built (about 3 s on a 2-core machine, in every rank of every job
otherwise).

[Note: peak memory]
A trial's memory is each rank's peak of anonymous resident memory (the process's own data, not
the pages of shared libraries) above its value just before the model is built: torch, the
process group and the corpus are in the baseline; the model, its gradients and optimizer state,
activations, comm buffers, the comm probe's buffers and the allocator's slack are not. Linux
keeps a high-water mark of the whole resident set only (VmHWM of /proc/self/status), which also
counts the library pages a forked rank faults in as it first runs their code (~40 MB of torch's
here, ~200 MB before the optimizer's imports were preloaded), so the peak is taken as VmHWM minus
the file-backed and shared pages resident at the end (RssFile + RssShmem, which only grow
during a trial), minus RssAnon at the baseline. That is exact when those pages are all in
before the peak (the warm-up steps run every code path first), and never more than the truth.
The shared-memory slots of `zero_kernels.comm.shm` are comm buffers, so they count: as much of
RssShmem as the slot files this rank maps (at most what it touched, plus a slot's untouched
tail).
The mark is reset at the baseline by writing "5" to /proc/self/clear_refs (Linux >= 4.0),
checked by reading it back; where that fails the mark since the process started is used (it
started a moment before, forked from an idle server) and ``hwm_reset`` says so.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
import traceback

import torch
import torch._dynamo  # noqa: F401  (see [Note: preloading])
from torch.nn.parallel import DistributedDataParallel as DDP

from .. import comm
from ..fused_adam import FusedAdamW
from ..ops.quant import DEFAULT_BLOCK, dequantize_blockwise, quantize_blockwise
from ..optimizer import ZeroOptimizer
from ..policy import ZeroPolicy
from ..tools.models import load_corpus
from .tune_model import ModelSource, build_model, is_gpt, make_batches, step_loss

__all__ = ["PeakRSS", "rank_main"]

LR, WEIGHT_DECAY = 1e-3, 0.01  # the trials' AdamW hyper-parameters (the demo's)


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise OSError(f"/proc/self/status has no {field}")


class PeakRSS:
    """Peak anonymous resident bytes of this process above the moment of construction ([Note:
    peak memory])."""

    def __init__(self) -> None:
        self.hwm_reset = False
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            # after a reset the mark is the current RSS (a little slack: pages may come in)
            self.hwm_reset = _status_kib("VmHWM") <= _status_kib("VmRSS") + 1024
        except OSError:
            pass
        self.base = _status_kib("RssAnon") * 1024

    def peak(self) -> int:
        from zero_kernels.comm import shm

        shmem = _status_kib("RssShmem") * 1024
        slots = min(shm.mapped_bytes(), shmem)  # comm's shared-memory slots: comm buffers
        files = _status_kib("RssFile") * 1024 + shmem - slots
        return max(0, _status_kib("VmHWM") * 1024 - files - self.base)


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else 0.0


# ---------------------------------------------------------------------------------------------
# The probe
# ---------------------------------------------------------------------------------------------


def _time_collective(op: str, nbytes: int, reps: int, n: int, group=None) -> list[float]:
    """This rank's seconds for ``reps`` runs of ``op`` on a full buffer of ``nbytes`` (fp32)
    over ``group`` (of ``n`` ranks), each run after a barrier, after one untimed run."""
    numel = max(n, nbytes // 4 // n * n)
    full, shard = torch.ones(numel), torch.ones(numel // n)
    out = []
    for i in range(reps + 1):
        comm.barrier(group=group)
        t0 = time.perf_counter()
        if op == "reduce_scatter":
            comm.reduce_scatter(shard, full, group=group).wait()
        elif op == "all_gather":
            comm.all_gather(full, shard, group=group).wait()
        else:
            comm.all_reduce(full, group=group)
        if i:
            out.append(time.perf_counter() - t0)
    return out


def _bandwidth(job: dict, n: int, scope: str = "world", group=None) -> list[dict]:
    """Every (op, algorithm, size) over ``group`` (``scope``: "world"; across nodes also
    "node", a node's ranks, and "cross", one rank of each node: [Note: tune across nodes])."""
    rows = []
    algorithms = job["algorithms"] if scope == "world" else job["link_algorithms"][scope]
    try:
        for op in ("reduce_scatter", "all_gather", "all_reduce"):
            for algo in algorithms if op != "all_reduce" else ("native",):
                if op != "all_reduce":
                    comm.set_algorithm(op, algo, group=group)
                for nbytes in job["sizes"]:
                    reps = 5 if nbytes <= 2**20 else 3 if nbytes <= 16 * 2**20 else 2
                    rows.append(
                        {
                            "op": op,
                            "algorithm": algo,
                            "bytes": nbytes,
                            "scope": scope,
                            "ranks": n,
                            "seconds": _time_collective(op, nbytes, reps, n, group),
                        }
                    )
    finally:
        comm.set_algorithm("all", None, group=group)
        comm.free_scratch()
    return rows


def _compute(job: dict, rank: int, n: int) -> dict:
    """Forward + backward of one rank's batch, its activations, and the optimizer steps."""
    src: ModelSource = job["source"]
    reps, warm = job["steps"], 2
    torch.manual_seed(job["seed"])
    model = build_model(src)
    batches = make_batches(model, src, steps=warm + reps, seed=job["seed"], rank=rank)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, fused=True)
    psi = sum(p.numel() for p in model.parameters() if p.requires_grad)
    fb, step = [], []
    act = 0
    tracker = PeakRSS()
    for i, batch in enumerate(batches):
        t0 = time.perf_counter()
        step_loss(model, batch).backward()
        t1 = time.perf_counter()
        if i == 0:  # activations: the first backward's peak, less the grads it allocated
            act = max(0, tracker.peak() - 4 * psi)
        opt.step()
        t2 = time.perf_counter()
        opt.zero_grad(set_to_none=False)
        if i >= warm:
            fb.append(t1 - t0)
            step.append(t2 - t1)
    del opt, model, batches
    shard = torch.nn.Parameter(torch.zeros(-(-psi // n)))
    shard.grad = torch.full_like(shard, 1e-3)
    by_dtype = {}  # the fused step over the shard, per state dtype tune tries (measured: on
    for sd in ("fp32", *[d for d in job.get("state_dtypes", ()) if d != "fp32"]):  # an
        # arithmetic-bound CPU int8 state is slower than fp32, not 16/28 of it)
        sopt = FusedAdamW(
            [shard], lr=LR, weight_decay=WEIGHT_DECAY, state_dtype=sd, min_lowbit_numel=0
        )
        shard_t = []
        for i in range(warm + reps):
            t0 = time.perf_counter()
            sopt.step()
            if i >= warm:
                shard_t.append(time.perf_counter() - t0)
        by_dtype[sd] = _median(shard_t)
        del sopt
    quant = {}  # quantize + dequantize per element, each format tune tries
    x = torch.randn(1 << 20)
    for fmt in job.get("quant_formats", ()):
        bits = {"int8": 8, "int4": 4}[fmt]
        out = torch.empty_like(x)
        ts = []
        for i in range(warm + reps):
            t0 = time.perf_counter()
            q, sc = quantize_blockwise(x, bits=bits)
            dequantize_blockwise(q, sc, bits, DEFAULT_BLOCK, x.numel(), out=out)
            if i >= warm:
                ts.append(time.perf_counter() - t0)
        quant[fmt] = _median(ts) / x.numel()
    return {
        "quant_s_per_elem": quant,
        "fwd_bwd_s": _median(fb),
        "optimizer_full_s": _median(step),
        "optimizer_shard_s": by_dtype["fp32"],
        "optimizer_shard_s_by_dtype": by_dtype,
        "activation_bytes": act,
        "hwm_reset": tracker.hwm_reset,
    }


def probe(job: dict, rank: int, n: int, links: dict | None = None) -> dict:
    """Compute first: its activations are measured as growth of a fresh process's memory, which
    the bandwidth buffers, freed but kept by the allocator, would hide. ``links``: across
    nodes, {"node": group, "cross": group} of this rank, each probed too."""
    compute = _compute(job, rank, n)
    comm.barrier()
    rows = _bandwidth(job, n)
    for scope, group in (links or {}).items():
        comm.barrier()
        rows += _bandwidth(job, comm.world_size(group), scope, group)
    return {"bandwidth": rows, **compute}


# ---------------------------------------------------------------------------------------------
# One trial
# ---------------------------------------------------------------------------------------------


def trial(job: dict, rank: int, n: int) -> dict:
    """Warm-up steps, then timed steps of one configuration; this rank's times and peak."""
    src: ModelSource = job["source"]
    cfg = job["config"]  # a TrialConfig
    warm, steps = job["warmup"], job["steps"]
    corpus = load_corpus() if src.kind in ("size", "config") else None
    comm.barrier()
    tracker = PeakRSS()
    torch.manual_seed(job["seed"])
    model = build_model(src)
    batches = make_batches(
        model,
        src,
        steps=warm + steps,
        seed=job["seed"],
        rank=rank,
        corpus=corpus if is_gpt(model) else None,
    )
    if cfg.stage == 0:
        fwd = DDP(model, gradient_as_bucket_view=True)
        opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, fused=True)
    else:
        kw = cfg.policy_options()
        if "reduce_dtype" in kw:
            kw["reduce_dtype"] = torch.bfloat16
        fwd = model
        pol = ZeroPolicy.resolve(**kw)
        opt = ZeroOptimizer(model, torch.optim.AdamW, policy=pol, lr=LR, weight_decay=WEIGHT_DECAY)
    times = []
    for i, batch in enumerate(batches):
        if i == warm:
            comm.barrier()  # timed steps start together
            if cfg.stage:
                opt.reset_comm_stats()
        t0 = time.perf_counter()
        step_loss(fwd, batch).backward()
        opt.step()
        opt.zero_grad(set_to_none=cfg.stage != 0)
        if i >= warm:
            times.append(time.perf_counter() - t0)
    out = {"step_times_s": times, "step_time_s": _median(times)}
    if cfg.stage:
        if cfg.overlap_param_gather:
            opt.wait_params()
        stats = opt.comm_stats
        out["exposed_comm_s"] = stats["exposed_comm_s"] / max(1, stats["steps"])
        out["model_state_bytes"] = int(opt.memory_report()["model_state_bytes"])
        out["algorithms"] = {
            f"{op} {label}": r["algorithm"] for (op, label), r in comm.probe_results().items()
        }
        # each collective's algorithm and why, the quantized gradients' hops ([Note:
        # link-aware choice] in zero_kernels/comm/choose.py)
        out["comm_choices"] = {k: list(v) for k, v in stats["choices"].items()}
    out["peak_rss_bytes"] = tracker.peak()
    out["hwm_reset"] = tracker.hwm_reset
    if cfg.stage:
        opt.close()
    return out


# ---------------------------------------------------------------------------------------------
# The process of one rank
# ---------------------------------------------------------------------------------------------


def rank_main(local_rank: int, nproc: int, port: int, job: dict, queue) -> None:
    """Target of each rank's process: run ``job`` ("probe" or "trial"), send rank 0's gathered
    results (a list by rank) or this rank's error to ``queue``."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(local_rank),
        WORLD_SIZE=str(nproc),
        LOCAL_RANK=str(local_rank),
    )
    try:
        torch.set_num_threads(job["threads"])
        comm.init("gloo", local_rank, nproc, timeout_s=job["timeout_s"])
        fn = probe if job["kind"] == "probe" else trial
        res = fn(job, local_rank, nproc)
        every = comm.gather_object(res, dst=0)
        if local_rank == 0:
            queue.put(("ok", every))
        comm.barrier()
        comm.shutdown()
    except BaseException as e:  # noqa: BLE001 (sent to the supervisor, then exit non-zero)
        why = str(e).strip().splitlines()[0] if str(e).strip() else ""
        queue.put(("error", local_rank, f"{type(e).__name__}: {why}", traceback.format_exc()))
        queue.close()
        queue.join_thread()  # the message must leave before this process does
        sys.stderr.flush()
        os._exit(1)
    queue.close()
    queue.join_thread()  # rank 0's result must leave before this process does
    comm.exit_process(0)  # [Note: leaving a rank] in zero_kernels/comm
