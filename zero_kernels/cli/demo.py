"""`zero-kernels demo`: train a small GPT with ZeRO on local ranks; report what it saved and cost.

Every rank trains the DDP baseline (stage 0) and then the asked-for stage on the same seed and the
same batches, so the report can show the largest loss difference between the two, the bytes each
rank held against the stage's formula (`zero_kernels.tools.estimate`), the bytes reduce-scattered /
all-gathered / all-reduced per step, the exposed communication time and the step time.

[Note: launching]
Without torchrun the command starts its own ranks and is their supervisor. They fork from
Python's forkserver, which imports torch and the package once (`PRELOAD`): a rank starts in a
fraction of a second instead of importing torch itself, which matters where ranks outnumber cores
and where one process runs several demos (the tests); each rank takes the launching process's
environment as it is at the call, and its standard output and error (`_Fd`: passed as file
descriptors, as multiprocessing passes its pipes; without them a rank would write where the
server's were when it started). As supervisor it polls them, and when one fails it
terminates the others, prints the failed rank's error on one line and exits 1, so no process is
left behind. Under torchrun (RANK /
WORLD_SIZE / LOCAL_RANK in the environment) the process is one rank and torchrun supervises.
`--nnodes/--node-rank/--master-addr/--master-port` let the self-spawning mode span machines too.

[Note: resuming]
With ``--checkpoint-dir DIR --checkpoint-every K`` every run (DDP baseline and ZeRO stage) saves
its training state to ``DIR/stage<s>`` every K steps and, when the command is started again with
the same DIR, resumes from the latest complete checkpoint at whatever world size it has now (a
checkpoint loads at any world size and stage). Batches are a pure function of (seed, step, rank),
so a resumed run at the same world size continues the uninterrupted one exactly; at another
world size the global batch changes with it. Rank 0 prints ``zero-kernels demo: resumed
DIR/stage<s> at step S (world size W)``; tests/checkpoints/test_elastic.py runs this under
torchrun's elastic restart. Each run's checkpoints are a checkpoint root of their own (DIR/stage0,
DIR/stage2), so at the end rank 0 prints the command that inspects each one it wrote (``zero-kernels
checkpoint inspect DIR/stage<s>``); ``zero-kernels checkpoint inspect DIR`` names and shows them all
(see `zero_kernels.cli.checkpoint`).

[Note: exposed communication of DDP]
DDP's buckets are all-reduced through a comm hook that counts their bytes and the time the last
one was issued; what backward spends after that instant is communication not hidden behind
compute. ZeroOptimizer measures its own (time blocked in `Handle.wait`).
"""

from __future__ import annotations

import dataclasses
import faulthandler
import os
import shlex
import statistics
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch

from ..tools.models import MODEL_SIZES, build_gpt, get_batch, load_corpus
from . import stop_processes
from .launch import available_stages, free_port, under_torchrun
from .optimizers import optimizer_spec

__all__ = ["DemoConfig", "available_stages", "run_demo"]


@dataclass(frozen=True)
class DemoConfig:
    stage: int = 2
    nproc: int | None = None  # ranks per node; None: one per GPU, else 2
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None
    steps: int = 200
    model_size: str = "small"
    precision: str = "fp32"
    optimizer: str = "adamw"
    lr: float | None = None
    bucket_mb: float = 1.0
    batch_size: int = 8  # sequences per rank per step
    seed: int = 0
    out: str = "zero_kernels_demo"
    device: str = "auto"
    baseline: bool = True  # also run DDP (stage 0) for the loss comparison
    progress: bool = True
    timeout_s: float = 1800.0
    checkpoint_dir: str | None = None  # save every checkpoint_every steps; resume from it
    checkpoint_every: int = 0


# ---------------------------------------------------------------------------------------------
# One rank
# ---------------------------------------------------------------------------------------------


def _tensor_bytes(obj, seen: set[int]) -> int:
    """Bytes of the distinct tensor storages reachable in obj (dicts, lists, tensors)."""
    if isinstance(obj, torch.Tensor):
        key = obj.untyped_storage().data_ptr() if obj.device.type != "meta" else id(obj)
        if key in seen or obj.numel() == 0:
            return 0
        seen.add(key)
        return obj.untyped_storage().nbytes()
    if isinstance(obj, dict):
        return sum(_tensor_bytes(v, seen) for v in obj.values())
    if isinstance(obj, list | tuple):
        return sum(_tensor_bytes(v, seen) for v in obj)
    return 0


class _DDPHook:
    """DDP comm hook: averages buckets like DDP's default, counting bytes and issue times."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.bytes = 0
        self.last_issue = 0.0


def _ddp_hook(state: _DDPHook, bucket):
    from .. import comm

    t = bucket.buffer()
    state.bytes += t.numel() * t.element_size()
    t.div_(state.world)
    fut = comm.all_reduce_future(t)
    state.last_issue = time.perf_counter()
    return fut


def _train(
    cfg: DemoConfig,
    stage: int,
    rank: int,
    world: int,
    device: torch.device,
    data: torch.Tensor,
    bar_desc: str,
) -> dict:
    """Train one stage; returns this rank's losses, step times, bytes held and comm counters."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(cfg.seed)
    model = build_gpt(cfg.model_size).to(device)
    lowp = cfg.precision == "bf16"
    if lowp:
        model = model.to(torch.bfloat16)
    opt_cls, opt_kw = optimizer_spec(cfg.optimizer, cfg.lr)
    block = model.cfg.block_size
    hook = None
    master: list[torch.nn.Parameter] = []
    if stage == 0:
        ddp = DDP(
            model,
            gradient_as_bucket_view=True,
            bucket_cap_mb=cfg.bucket_mb,
            device_ids=[device.index] if device.type == "cuda" else None,
        )
        hook = _DDPHook(world)
        ddp.register_comm_hook(hook, _ddp_hook)
        fwd = ddp
        if lowp:  # fp32 master weights; the torch optimizer steps those
            master = [torch.nn.Parameter(p.detach().float()) for p in model.parameters()]
            opt = opt_cls(master, **opt_kw)
        else:
            opt = opt_cls(model.parameters(), **opt_kw)
    else:
        from ..optimizer import ZeroOptimizer
        from ..policy import CommPolicy

        fwd = model
        comm_policy = CommPolicy(bucket_size_mb=cfg.bucket_mb)
        opt = ZeroOptimizer(model, opt_cls, stage=stage, comm=comm_policy, **opt_kw)

    bar = _progress(cfg, rank, bar_desc)
    losses, times, exposed = [], [], []
    mem = None
    ckpt = _Checkpoints(cfg, stage, fwd, opt) if cfg.checkpoint_dir else None
    start = 0
    if ckpt is not None:
        start, losses = ckpt.resume()
        if bar is not None and start:
            bar.update(start)
    fail_rank = os.environ.get("ZERO_KERNELS_DEMO_FAIL_RANK")  # fault injection for the tests
    for step in range(start, cfg.steps):
        if fail_rank == str(rank) and step == 1:
            raise RuntimeError(f"injected failure on rank {rank} (ZERO_KERNELS_DEMO_FAIL_RANK)")
        x, y = get_batch(data, cfg.batch_size, block, seed=cfg.seed, step=step, rank=rank)
        x, y = x.to(device), y.to(device)
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = fwd(x, y)
        loss.backward()
        t_bwd = time.perf_counter()
        if master:
            for m, p in zip(master, model.parameters()):
                m.grad = p.grad.float()
        opt.step()
        if master:
            with torch.no_grad():
                for m, p in zip(master, model.parameters()):
                    p.copy_(m)
        if step == cfg.steps - 1:  # bytes held at the end of a step, grads still there
            mem = _memory(model, opt, master, stage)
        opt.zero_grad(set_to_none=stage != 0)
        if master:
            for m in master:
                m.grad = None
        if device.type == "cuda":
            torch.cuda.synchronize()
        t1 = time.perf_counter()
        if hook is not None:
            exposed.append(max(0.0, t_bwd - hook.last_issue) if hook.last_issue else 0.0)
        times.append(t1 - t0)
        losses.append(float(loss.detach()))
        if ckpt is not None:
            ckpt.maybe_save(step + 1, losses)
        if bar is not None:
            bar.set_postfix_str(progress_postfix(losses[-1], times[-1]))
            bar.update(1)
    if bar is not None:
        bar.close()

    steps = max(1, cfg.steps)
    if stage == 0:
        comm = {
            "all_reduce_bytes": hook.bytes / steps,
            "reduce_scatter_bytes": 0.0,
            "all_gather_bytes": 0.0,
            "exposed_comm_s": statistics.median(exposed[1:] or exposed or [0.0]),
        }
    else:
        comm = _zero_comm(opt, steps)
    warm = times[min(2, len(times) - 1) :] if times else [0.0]
    return {
        "stage": stage,
        "losses": losses,
        "step_time_s": statistics.median(warm),
        "memory": mem,
        "comm": comm,
    }


class _Checkpoints:
    """``--checkpoint-dir DIR --checkpoint-every K``: the run of each stage saves to DIR/stage<s>
    every K steps (`zero_kernels.save_checkpoint`, the last 2 kept) and, started again, resumes
    from the latest one at whatever world size it now has. The loss history so far (the mean
    over the saving ranks) travels in the checkpoint's ``extra``."""

    def __init__(self, cfg: DemoConfig, stage: int, model, opt):
        self.dir = os.path.join(cfg.checkpoint_dir, f"stage{stage}")
        self.every, self.model, self.opt = cfg.checkpoint_every, model, opt

    def resume(self) -> tuple[int, list[float]]:
        from .. import checkpoint

        if not os.path.exists(os.path.join(self.dir, "latest")):
            return 0, []
        from .. import comm

        extra = checkpoint.load_checkpoint(self.dir, self.model, self.opt)
        step = int(extra["step"])
        if comm.rank() == 0:
            print(
                f"zero-kernels demo: resumed {self.dir} at step {step} "
                f"(world size {comm.world_size()})",
                file=sys.stderr,
                flush=True,
            )
        return step, [float(x) for x in extra["loss_mean"]]

    def maybe_save(self, step: int, losses: list[float]) -> None:
        if self.every <= 0 or step % self.every:
            return
        from .. import checkpoint, comm

        every = comm.all_gather_object(losses)
        mean = [sum(r[i] for r in every) / len(every) for i in range(len(losses))]
        extra = {"step": step, "loss_mean": mean}
        checkpoint.save_checkpoint(self.dir, self.model, self.opt, extra=extra, keep_last=2)


def _memory(model: torch.nn.Module, opt, master: list, stage: int) -> dict:
    """Bytes of params, grads and optimizer state this rank holds (each storage counted once)."""
    report = getattr(opt, "memory_report", None)
    if stage != 0 and callable(report):
        r = dict(report())
        return {
            "params": int(r["param_bytes"]),
            "grads": int(r["grad_bytes"]),
            "optim": int(r.get("master_bytes", 0)) + int(r["optim_state_bytes"]),
            "grads_peak": int(r.get("grad_peak_bytes", r["grad_bytes"])),
            "comm_buffers": int(r.get("comm_buffer_bytes", 0)),
            "live": int(r.get("gathered_param_peak_bytes", 0)),
            "source": "ZeroOptimizer.memory_report()",
        }
    seen: set[int] = set()
    params = _tensor_bytes(list(model.parameters()), seen)
    grads = _tensor_bytes([p.grad for p in model.parameters() if p.grad is not None], seen)
    inner = getattr(opt, "optim", None) or getattr(opt, "optimizer", None) or opt
    optim = _tensor_bytes(master, seen) + _tensor_bytes(dict(inner.state), seen)
    # DDP's grads are views of its buckets (gradient_as_bucket_view): no separate comm buffers
    return {
        "params": params,
        "grads": grads,
        "optim": optim,
        "grads_peak": grads,
        "comm_buffers": 0,
        "source": "counted from tensors",
    }


def _zero_comm(opt, steps: int) -> dict:
    stats = dict(opt.comm_stats)
    steps = stats.get("steps") or steps
    return {
        "all_reduce_bytes": 0.0,
        "reduce_scatter_bytes": stats.get("reduce_scatter_bytes", 0) / steps,
        "all_gather_bytes": stats.get("all_gather_bytes", 0) / steps,
        "exposed_comm_s": stats.get("exposed_comm_s", 0.0) / steps,
    }


def progress_postfix(loss: float, step_s: float) -> str:
    """The progress line's figures: rank 0's own loss (the summary shows the mean over ranks)."""
    return f"loss (rank 0) {loss:.3f}, {1e3 * step_s:.0f} ms/step"


def _progress(cfg: DemoConfig, rank: int, desc: str):
    if rank != 0 or not cfg.progress:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return PlainBar(cfg.steps, desc)
    return tqdm(total=cfg.steps, desc=desc, file=sys.stderr, dynamic_ncols=True, mininterval=0.5)


class PlainBar:
    """A progress line every 10% when tqdm is not installed."""

    def __init__(self, total: int, desc: str) -> None:
        self.total, self.desc, self.n, self.post = total, desc, 0, ""

    def set_postfix_str(self, text: str) -> None:
        self.post = text

    def update(self, k: int) -> None:
        self.n += k
        if self.n == self.total or self.n % max(1, self.total // 10) == 0:
            print(f"{self.desc}: {self.n}/{self.total} {self.post}", file=sys.stderr, flush=True)

    def close(self) -> None:
        pass


def _device_for(cfg: DemoConfig, local_rank: int) -> torch.device:
    if cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available()):
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def run_rank(cfg: DemoConfig, rank: int, world: int, local_rank: int) -> dict | None:
    """Everything one rank does; returns the report on global rank 0, None elsewhere."""
    from .. import comm

    device = _device_for(cfg, local_rank)
    if device.type == "cpu":
        torch.set_num_threads(1)
    comm.init("nccl" if device.type == "cuda" else "gloo", rank, world, timeout_s=300)
    # On an error there is no barrier and no teardown: the peers may be blocked in a collective;
    # the supervisor (or torchrun) stops them once this rank has exited non-zero.
    data = load_corpus()
    stages = _stages(cfg)
    runs = {}
    for s in stages:
        desc = "stage 0 (DDP)" if s == 0 else f"stage {s} (ZeRO)"
        runs[s] = _train(cfg, s, rank, world, device, data, desc)
    per_rank = comm.gather_object(runs, dst=0)
    report = None
    if rank == 0:
        from .report import build_report

        report = build_report(cfg, world, device, per_rank)
    comm.barrier()
    comm.shutdown()
    return report


def _stages(cfg: DemoConfig) -> list[int]:
    """The runs of the demo, in order: the DDP baseline (stage 0) first where there is one."""
    return [0, cfg.stage] if cfg.stage != 0 and cfg.baseline else [cfg.stage]


def _finish(cfg: DemoConfig, report: dict) -> None:
    """Rank 0 at the end: the report, then the inspect command of each run's checkpoints."""
    from .report import write_report

    write_report(cfg, report)
    if not cfg.checkpoint_dir:
        return
    for s in _stages(cfg):
        d = os.path.join(cfg.checkpoint_dir, f"stage{s}")
        if os.path.exists(os.path.join(d, "latest")):
            print(f"  checkpoints of stage {s}: zero-kernels checkpoint inspect {shlex.quote(d)}")


# ---------------------------------------------------------------------------------------------
# Launching and supervising the ranks
# ---------------------------------------------------------------------------------------------


def _one_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"


# what the forkserver the ranks fork from imports once ([Note: launching])
PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "zero_kernels.optimizer", __name__]


class _Fd:
    """A file descriptor of the launcher that reaches the rank as a descriptor of its own (sent
    with the process's data, ``multiprocessing.reduction.DupFd``; pickled only when a process
    starts)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self):
        from multiprocessing import reduction

        return (_Fd._received, (reduction.DupFd(self.fd),))

    @staticmethod
    def _received(dup) -> int:
        return dup.detach()


def _spawned(
    local_rank: int, cfg: DemoConfig, nproc: int, port: int, errors, env, out: int, err: int
) -> None:
    os.environ.clear()  # the launcher's environment now, not the forkserver's at its start
    os.environ.update(env)
    for mine, theirs in ((1, out), (2, err)):  # the launcher's stdout and stderr now
        os.dup2(theirs, mine)
        os.close(theirs)
    rank = cfg.node_rank * nproc + local_rank
    world = cfg.nnodes * nproc
    # a rank that dies of a signal (an abort in native code at exit included) says where every
    # thread of it was
    faulthandler.enable(all_threads=True)
    os.environ.update(
        MASTER_ADDR=cfg.master_addr,
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(local_rank),
    )
    try:
        report = run_rank(cfg, rank, world, local_rank)
        if report is not None:
            _finish(cfg, report)
    except BaseException as e:  # noqa: BLE001 (sent to the supervisor, then exit non-zero)
        errors.put((rank, _one_line(e), traceback.format_exc()))
        errors.close()
        errors.join_thread()  # the message must leave before this process does
        sys.stderr.flush()
        os._exit(1)
    from .. import comm

    comm.exit_process(0)  # the results are written: [Note: leaving a rank] in zero_kernels/comm


def run_demo(cfg: DemoConfig) -> int:
    """Run the demo (spawning ranks unless under torchrun); returns the exit code."""
    if under_torchrun():
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        report = run_rank(cfg, rank, world, int(os.environ["LOCAL_RANK"]))
        if report is not None:
            _finish(cfg, report)
        return 0

    import torch.multiprocessing as mp

    nproc = cfg.nproc or (torch.cuda.device_count() if _device_for_parent(cfg) == "cuda" else 2)
    port = cfg.master_port or free_port()
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)  # read when the server starts
    errors = ctx.Queue()
    env = dict(os.environ)
    procs = [
        ctx.Process(
            target=_spawned,
            args=(i, cfg, nproc, port, errors, env, _Fd(1), _Fd(2)),
            daemon=False,
        )
        for i in range(nproc)
    ]
    for p in procs:
        p.start()
    deadline = time.monotonic() + cfg.timeout_s
    failed = None
    try:
        while True:
            codes = [p.exitcode for p in procs]
            if any(c not in (None, 0) for c in codes):
                failed = next(i for i, c in enumerate(codes) if c not in (None, 0))
                break
            if all(c == 0 for c in codes):
                break
            if time.monotonic() > deadline:
                failed = -1
                break
            time.sleep(0.1)
    except KeyboardInterrupt:
        failed = -2
    finally:
        stop_processes(procs, terminate=failed is not None)
    if failed is None:
        return 0
    if failed == -1:
        print(
            f"zero-kernels demo: error: timed out after {cfg.timeout_s:.0f} s; ranks terminated",
            file=sys.stderr,
        )
        return 1
    if failed == -2:
        print("zero-kernels demo: interrupted; ranks terminated", file=sys.stderr)
        return 130
    msg = None
    try:
        rank, line, tb = errors.get(timeout=2)
        msg = f"rank {rank} failed: {line}"
        if os.environ.get("ZERO_KERNELS_TRACEBACK"):
            print(tb, file=sys.stderr)
    except Exception:  # noqa: BLE001 (the rank died without a Python error, e.g. killed)
        rank = cfg.node_rank * nproc + failed
        msg = f"rank {rank} failed with exit code {procs[failed].exitcode}"
    print(f"zero-kernels demo: error: {msg}", file=sys.stderr)
    return 1


def _device_for_parent(cfg: DemoConfig) -> str:
    if cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available()):
        return "cuda"
    return "cpu"


def config_from_args(args) -> DemoConfig:
    names = {f.name for f in dataclasses.fields(DemoConfig)}
    return DemoConfig(**{k: v for k, v in vars(args).items() if k in names and v is not None})


def validate(cfg: DemoConfig) -> None:
    """Raise ValueError naming the argument for a bad demo configuration."""
    if cfg.stage not in available_stages():
        raise ValueError(
            f"--stage must be one of {', '.join(map(str, available_stages()))} "
            f"(the stages in this build); got {cfg.stage}"
        )
    if cfg.model_size not in MODEL_SIZES:
        raise ValueError(
            f"--model-size must be one of {', '.join(MODEL_SIZES)}; got {cfg.model_size!r}"
        )
    for name, v, lo in (
        ("--steps", cfg.steps, 1),
        ("--nproc", cfg.nproc, 1),
        ("--nnodes", cfg.nnodes, 1),
        ("--batch-size", cfg.batch_size, 1),
    ):
        if v is not None and v < lo:
            raise ValueError(f"{name} must be >= {lo}; got {v}")
    if not 0 <= cfg.node_rank < cfg.nnodes:
        raise ValueError(f"--node-rank must be in 0..{cfg.nnodes - 1}; got {cfg.node_rank}")
    if cfg.nnodes > 1 and cfg.master_port is None and not under_torchrun():
        raise ValueError("--master-port is required with --nnodes > 1 (the same on every node)")
    if cfg.bucket_mb <= 0:
        raise ValueError(f"--bucket-mb must be > 0; got {cfg.bucket_mb}")
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is available here; use cpu or auto")
    if cfg.checkpoint_every < 0:
        raise ValueError(f"--checkpoint-every must be >= 0; got {cfg.checkpoint_every}")
    if cfg.checkpoint_every and not cfg.checkpoint_dir:
        raise ValueError("--checkpoint-every needs --checkpoint-dir DIR")
    if cfg.checkpoint_dir and cfg.precision == "bf16" and (cfg.stage == 0 or cfg.baseline):
        raise ValueError(
            "--checkpoint-dir with --precision bf16: the DDP run keeps its fp32 masters outside "
            "the model, which checkpoints do not take; use --no-baseline with --stage 1, 2 or 3"
        )
    optimizer_spec(cfg.optimizer)
    Path(cfg.out)  # a path is always accepted; it is created when the report is written
