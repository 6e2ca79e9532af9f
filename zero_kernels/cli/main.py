"""The `zero-kernels` command: `demo`, `estimate`, `bench`, `tune`, `checkpoint`, `config`,
`testbed`.

Bad arguments end in one line on stderr naming the argument and what it accepts, exit code 2,
never a traceback (set ZERO_KERNELS_TRACEBACK=1 to see one for an unexpected error). A reader
that closes the pipe early (`zero-kernels estimate ... | head -1`) ends the command quietly with
exit code 141 (`EXIT_BROKEN_PIPE`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

__all__ = ["main"]

PROG = "zero-kernels"
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE: what a shell shows for a tool killed by SIGPIPE


class _UsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit 2 (argparse would print the usage too)
        raise _UsageError(message)


def _positive_float(name: str):
    def parse(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a number > 0; got {text!r}") from None
        if not v > 0:
            raise argparse.ArgumentTypeError(f"must be a number > 0; got {text!r}")
        return v

    parse.__name__ = name
    return parse


def build_parser() -> argparse.ArgumentParser:
    from ..tools.models import MODEL_SIZES
    from . import checkpoint, config, testbed, tune
    from .optimizers import OPTIMIZER_CHOICES

    p = _Parser(
        prog=PROG,
        description="ZeRO for PyTorch: train a demo, estimate memory, run the benchmarks, "
        "look into checkpoints, run scripts on a namespace testbed of several nodes.",
    )
    p.add_argument("--version", action="store_true", help="print the version and exit")
    sub = p.add_subparsers(
        dest="command",
        parser_class=_Parser,
        metavar="{demo,estimate,bench,tune,checkpoint,config,testbed}",
    )

    d = sub.add_parser(
        "demo",
        help="train a small GPT with ZeRO on local ranks and report",
        description="Train a small GPT on the shipped corpus with ZeRO and DDP on "
        "the same data and seed; report memory, communication, time.",
    )
    d.add_argument("--stage", type=int, default=2, help="ZeRO stage: 0 = DDP, 1, 2, 3 (default 2)")
    d.add_argument(
        "--nproc",
        type=int,
        default=None,
        help="ranks on this node (default: one per GPU, else 2); ignored under torchrun",
    )
    d.add_argument("--nnodes", type=int, default=1, help="machines (default 1)")
    d.add_argument("--node-rank", type=int, default=0, help="this machine's index (default 0)")
    d.add_argument("--master-addr", default="127.0.0.1", help="address of node 0")
    d.add_argument("--master-port", type=int, default=None, help="port on node 0 (default free)")
    d.add_argument("--steps", type=int, default=200, help="training steps (default 200)")
    d.add_argument(
        "--model-size",
        default="small",
        choices=list(MODEL_SIZES),
        help="GPT size (default small, 0.84M params)",
    )
    d.add_argument(
        "--precision",
        default="fp32",
        choices=["fp32", "bf16"],
        help="fp32, or bf16 weights/grads with fp32 master weights (default fp32)",
    )
    d.add_argument(
        "--optimizer",
        default="adamw",
        choices=list(OPTIMIZER_CHOICES),
        help="optimizer (default adamw)",
    )
    d.add_argument("--lr", type=_positive_float("lr"), default=None, help="learning rate")
    d.add_argument(
        "--bucket-mb",
        type=_positive_float("bucket-mb"),
        default=1.0,
        help="communication bucket size in MB (default 1)",
    )
    d.add_argument("--batch-size", type=int, default=8, help="sequences per rank per step")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    d.add_argument("--out", default="zero_kernels_demo", help="report folder (JSON and PNG)")
    d.add_argument(
        "--no-baseline",
        dest="baseline",
        action="store_false",
        help="skip the DDP run (no loss comparison)",
    )
    d.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    d.add_argument(
        "--timeout",
        dest="timeout_s",
        type=_positive_float("timeout"),
        default=1800.0,
        help="seconds before the ranks are stopped (default 1800)",
    )
    d.add_argument(
        "--checkpoint-dir",
        default=None,
        help="save checkpoints here and resume from the latest one when started again",
    )
    d.add_argument(
        "--checkpoint-every",
        type=int,
        default=0,
        help="steps between checkpoints (default 0: only resume, never save)",
    )

    e = sub.add_parser(
        "estimate",
        help="per-rank memory and communication of each ZeRO stage",
        description="Per-rank model-state memory and communication per step of "
        "each ZeRO stage (activations not included).",
    )
    src = e.add_mutually_exclusive_group(required=True)
    src.add_argument("--params", help="parameter count: 7.5B, 1.3e9, 125M")
    src.add_argument(
        "--model",
        help="package.module:factory (built on the meta device) or a transformers config.json",
    )
    e.add_argument(
        "--world-size",
        "-n",
        type=int,
        default=None,
        help="data-parallel ranks (required: the stages shard over them)",
    )
    e.add_argument(
        "--nodes",
        type=int,
        default=None,
        help="nodes the ranks are spread over (evenly): adds the bytes per node per step that "
        "cross the links, per configuration (flat, shard_group=node, secondary_shard=node, "
        "quantized)",
    )
    e.add_argument(
        "--precision",
        default="mixed",
        help="mixed (bf16/fp16 + fp32 master, default), mixed-fp32-grads (what "
        "ZeroOptimizer holds with bf16/fp16 params), bf16-sr (the same with "
        "bf16_stochastic_round: no master), fp32 or bf16 (pure)",
    )
    e.add_argument(
        "--optimizer",
        default="adam",
        help="adam (K=12 mixed), sgd-momentum, sgd, adafactor, muon, lion, ...",
    )
    e.add_argument(
        "--gpu-mem", default=None, help="memory of one device (80GB, 24GiB): says which stages fit"
    )
    e.add_argument("--prefetch", type=int, default=1, help="stage-3 layers prefetched (default 1)")
    e.add_argument(
        "--bucket-mb",
        type=_positive_float("bucket-mb"),
        default=None,
        help="ZeroOptimizer bucket size in MiB, for stage 2's comm buffers "
        "(default 25, as ZeroOptimizer)",
    )
    e.add_argument(
        "--offload-optimizer",
        choices=["nvme", "cpu"],
        default=None,
        help="stages 1-3 with the Adam moments on disk (OffloadPolicy(offload_optimizer='nvme')):"
        " RAM, disk and I/O per step per rank; cpu: masters and moments in host memory for "
        "GPU params (the host tier): device and host bytes, bus bytes per step",
    )
    e.add_argument(
        "--offload-params",
        choices=["nvme", "cpu"],
        default=None,
        help="stage 3 with the param shards and fp32 masters on disk too "
        "(OffloadPolicy(offload_params='nvme')); cpu (with --offload-optimizer cpu): the "
        "param shards in host memory",
    )
    e.add_argument(
        "--offload-staging-mb",
        type=_positive_float("offload-staging-mb"),
        default=48.0,
        help="the staging buffers' MiB with --offload-optimizer (default 48, as ZeroOptimizer)",
    )
    e.add_argument(
        "--state-dtype",
        choices=["fp32", "bf16", "int8"],
        default="fp32",
        help="stages 1-3: the fused Adam step's moments (PrecisionPolicy(state_dtype=...)): "
        "fp32 8, bf16 4, int8 2 + 8/block bytes per param",
    )
    e.add_argument(
        "--state-block",
        type=int,
        default=256,
        help="int8 state: elements per quantization block (default 256, as ZeroOptimizer)",
    )
    e.add_argument(
        "--shard-group",
        default=None,
        help="stages 1-3 sharded over groups of K ranks, replicated across the groups "
        "(CommPolicy(shard_group=K); 'node': the ranks of one of --nodes)",
    )
    e.add_argument(
        "--secondary-shard",
        default=None,
        help="stage 3 with hpZ's secondary shard over K ranks (GatherPolicy(secondary_shard=K);"
        " 'node': the ranks of one of --nodes)",
    )
    e.add_argument(
        "--frozen",
        default=None,
        help="with --params: params that do not train beside them (a frozen base under "
        "adapters: 7B), whole on every rank at every stage (stage 3 too, unless "
        "--shard-frozen); --model counts its own requires_grad=False params",
    )
    e.add_argument(
        "--shard-frozen",
        action="store_true",
        help="stage 3 shards the frozen params too (GatherPolicy(shard_frozen=True))",
    )
    e.add_argument(
        "--tp",
        type=int,
        default=1,
        help="tensor-parallel size beside the --world-size data-parallel ranks (DTensor params "
        "of parallelize_module): each rank holds params / tp, which the stages shard over dp",
    )
    e.add_argument("--json", action="store_true", help="print JSON instead of a table")

    b = sub.add_parser(
        "bench",
        help="run the bench/ suite and write JSON/CSV/PNG",
        description="Run the benchmarks in bench/ (kernel, bucketing, end-to-end "
        "stages); missing optional peers are skipped with a line.",
    )
    b.add_argument("--quick", action="store_true", help="a smoke run (seconds)")
    b.add_argument("--out", default="bench_results", help="results folder")
    b.add_argument(
        "--only",
        action="append",
        default=None,
        help="run only benchmarks whose name contains this (repeatable)",
    )
    b.add_argument("--bench-dir", default=None, help="folder of bench_*.py (default ./bench)")
    b.add_argument(
        "--timeout",
        type=_positive_float("timeout"),
        default=1800.0,
        help="seconds per benchmark script (default 1800)",
    )
    tune.add_parser(sub, _Parser)
    checkpoint.add_parser(sub, _Parser)
    config.add_parser(sub, _Parser)
    testbed.add_parser(sub, _Parser)
    return p


def _ranks_option(name: str, value: str | None, args) -> int | None:
    """``--shard-group`` / ``--secondary-shard``: None, a rank count, or "node" (--nodes')."""
    if value is None:
        return None
    if value == "node":
        if args.nodes is None:
            raise ValueError(f"--{name} node needs --nodes (how many ranks a node holds)")
        return args.world_size // args.nodes
    try:
        k = int(value)
    except ValueError:
        raise ValueError(f"--{name} must be a rank count or 'node'; got {value!r}") from None
    return k


def _cmd_estimate(args) -> int:
    from ..tools import estimate as est
    from ..tools.estimate_links import cross_node

    if args.world_size is None:  # no silent default: 1 rank would show no saving at all
        raise ValueError(
            "--world-size (-n) is required: the number of data-parallel ranks, e.g. --world-size 8"
        )
    n_params = est.parse_count(args.params) if args.params else None
    frozen = est.parse_count(args.frozen, name="--frozen") if args.frozen is not None else None
    gpu_mem = est.parse_bytes(args.gpu_mem) if args.gpu_mem is not None else None
    if args.world_size < 1:
        raise ValueError(f"--world-size must be >= 1; got {args.world_size}")
    if args.prefetch < 0:
        raise ValueError(f"--prefetch must be >= 0; got {args.prefetch}")
    bucket_mb = args.bucket_mb if args.bucket_mb is not None else est.DEFAULT_BUCKET_MB
    cross = None
    if args.nodes is not None:
        if args.nodes < 1 or args.world_size % args.nodes:
            raise ValueError(
                f"--nodes must be >= 1 and divide --world-size {args.world_size}; got "
                f"--nodes {args.nodes}"
            )
    groups = {
        k: _ranks_option(k, getattr(args, k.replace("-", "_")), args)
        for k in ("shard-group", "secondary-shard")
    }
    e = est.estimate(
        n_params,
        args.world_size,
        shard_size=groups["shard-group"],
        secondary_shard=groups["secondary-shard"],
        model=args.model,
        precision=args.precision,
        optimizer=args.optimizer,
        prefetch=args.prefetch,
        gpu_mem=gpu_mem,
        bucket_mb=bucket_mb,
        offload_optimizer=args.offload_optimizer,
        offload_staging_mb=args.offload_staging_mb,
        offload_params=args.offload_params,
        state_dtype=args.state_dtype,
        state_block=args.state_block,
        frozen=frozen,
        shard_frozen=args.shard_frozen,
        tp=args.tp,
    )
    if args.nodes is not None:
        cross = cross_node(
            e.n_params, args.nodes, args.world_size // args.nodes, precision=e.precision, tp=e.tp
        )
        if e.tp > 1:  # the plain stages: hierarchy, hpZ and quantization are refused under tp
            cross = [c for c in cross if c["config"] in ("DDP", "stage 1", "stage 2", "stage 3")]
    if args.json:
        d = e.as_dict()
        if cross is not None:
            d["cross_node"] = {"nodes": args.nodes, "per_node_per_step": cross}
        print(json.dumps(d, indent=1))
        return 0
    prec = {
        "mixed": "mixed precision (16-bit params/grads, fp32 master)",
        "fp32": "fp32",
        "mixed-fp32-grads": "mixed precision (16-bit params, fp32 grads and master)",
        "bf16": "pure bf16",
        "bf16-sr": "bf16 params without a master (stochastic rounding), fp32 grads",
    }[e.precision]
    k = e.stages[0].optim_bytes / e.n_params
    local = f"{e.n_params / 1e9:.4g}B" if e.n_params >= 1e9 else f"{e.n_params / 1e6:.4g}M"
    whole = e.n_params * e.tp  # the model's (tp > 1: the rows hold each rank's slice)
    count = f"{whole / 1e9:.4g}B" if whole >= 1e9 else f"{whole / 1e6:.4g}M"
    frozen_txt = ""
    if e.frozen_params:
        fz = e.frozen_params
        frozen_txt = f" + {fz / 1e9:.4g}B frozen" if fz >= 1e9 else f" + {fz / 1e6:.4g}M frozen"
    print(
        f"{count} params{frozen_txt}"
        + (f" ({e.model})" if e.model else "")
        + f", {e.world_size} ranks, {prec}, {e.optimizer} (K = {k:.3g} bytes/param)"
        + (f"; tp {e.tp}: each rank holds {local} of them (params / tp)" if e.tp > 1 else "")
    )
    f = est.format_bytes
    head = (
        f"{'stage':<8}{'params':>10}{'grads':>10}{'optim':>10}{'live':>10}{'total':>10}"
        f"{'comm/step':>12}{'wire/rank':>12}"
    )
    if gpu_mem is not None:
        head += f"{'fits ' + f(gpu_mem):>16}"
    print(head)
    for s in e.stages:
        live = (
            f(s.live_bytes)
            if s.stage == 3 and e.largest_layer
            else ("n/a" if s.stage == 3 else "-")
        )
        row = (
            f"{str(s.stage) + (' (DDP)' if s.stage == 0 else ''):<8}{f(s.params_bytes):>10}"
            f"{f(s.grads_bytes):>10}{f(s.optim_bytes):>10}{live:>10}{f(s.total_bytes):>10}"
            f"{f(s.comm_bytes):>12}{f(s.wire_bytes):>12}"
        )
        if gpu_mem is not None:
            row += f"{'yes' if s.fits else 'no':>16}"
        print(row)
    if e.frozen_params:
        s3 = [s for s in e.stages if s.stage == 3 and s.frozen_bytes < e.stages[0].frozen_bytes]
        where = (
            f"whole on every rank at stages 0-2, 1/N at stage 3 ({f(s3[0].frozen_bytes)}, "
            "--shard-frozen: all-gathered with their units, in its comm)"
            if s3
            else "whole on every rank (stage 3 too: GatherPolicy(shard_frozen=True), "
            "--shard-frozen here, shards them, as FSDP and DeepSpeed's ZeRO-3 do)"
        )
        lead = (
            f"the {f(e.stages[0].frozen_bytes)} of frozen params are in every stage's total"
            if s3
            else f"every stage's total includes {f(e.stages[0].frozen_bytes)} of frozen params "
            "per rank"
        )
        print(f"{'frozen':<8}{lead}: {where}")
    hier = [s for s in e.stages if s.stage and s.shard_size != e.world_size]
    if hier:
        print(
            f"stages 1-3 sharded over groups of {hier[0].shard_size} ranks, "
            f"{e.world_size // hier[0].shard_size} replicas"
        )
    for s in e.stages:
        if s.secondary_bytes:
            print(
                f"stage 3's total includes the secondary shard, {f(s.secondary_bytes)} per rank "
                "at the end of the forward"
            )
    if cross is not None:
        print(
            f"across nodes ({args.nodes} nodes x {args.world_size * e.tp // args.nodes} ranks"
            + (f": {args.world_size // args.nodes} dp x tp {e.tp}, tp inside" if e.tp > 1 else "")
            + ", ring collectives, fp32 gradient reduction unless quantized), bytes per node per "
            "step:"
        )
        w = max(len(c["config"]) for c in cross)
        for c in cross:
            print(f"  {c['config']:<{w}}{f(c['bytes']):>12}")
    for s in e.stages:
        if s.comm_buffer_bytes:
            print(
                f"{'buffers':<8}stage {s.stage}: + {f(s.comm_buffer_bytes)} of comm buffers "
                f"(<= 2 in-flight buckets of {e.bucket_mb:g} MiB, fp32 grads), not in the "
                "totals above"
            )
    for s in e.stages:
        if s.offload_host_bytes:
            shards = " and param shards" if s.stage == 3 and args.offload_params else ""
            print(
                f"{'offload':<8}stage {s.stage}: masters and Adam moments{shards} in host memory, "
                f"{f(s.offload_host_bytes)} per rank with the pinned staging (out of the "
                f"device's total), {f(s.offload_bus_bytes)} over the bus per step"
            )
    for s in e.stages:
        if s.offload_disk_bytes:
            what = "Adam moments" if s.offload_staging_bytes else ""
            if s.stage == 3 and args.offload_params:
                what = (what + ", " if what else "") + "param shards and masters"
            print(
                f"{'offload':<8}stage {s.stage}: {what} on disk, {f(s.offload_disk_bytes)}"
                f" per rank ({f(s.offload_staging_bytes)} of staging in the "
                f"total), {f(s.offload_io_bytes)} read + written per step"
            )
    grad_only = "autograd's largest gradient"  # DDP: no receive buffers of ours
    what = "receive buffers" + (
        " and autograd's largest gradient"
        if e.model
        else " (--model adds autograd's largest gradient)"
    )
    for s in e.stages:
        if s.scratch_bytes:
            print(
                f"{'scratch':<8}stage {s.stage}: + {f(s.scratch_bytes)} of "
                f"{what if s.stage else grad_only}, not in the totals above"
            )
    notes = [
        "model states only: activations, temporary buffers and fragmentation come on top",
        "comm/step: the ZeRO paper's volume, 2Ψ elements for DDP (all-reduce) and stages "
        "1-2 (reduce-scatter Ψ + all-gather Ψ), 3Ψ for stage 3, in bytes of the dtype "
        "communicated; wire/rank: what one rank sends with ring collectives",
    ]
    if e.precision == "mixed":
        notes.append(
            "mixed counts 16-bit grads (the paper); ZeroOptimizer reduces and holds "
            "grads in fp32: --precision mixed-fp32-grads for what it holds"
        )
    if e.largest_layer is None:
        notes.append("stage-3 live window needs --model (largest layer)")
    if e.optimizer == "adafactor" and e.model is None:
        notes.append("adafactor's factored state needs --model for its exact size; counted as 0")
    for n in notes:
        print(f"  note: {n}")
    return 0


def _cmd_demo(args) -> int:
    from .demo import config_from_args, run_demo, validate

    cfg = config_from_args(args)
    validate(cfg)
    return run_demo(cfg)


def _cmd_bench(args) -> int:
    from .bench_runner import run_bench

    return run_bench(
        quick=args.quick,
        out=args.out,
        only=args.only,
        bench_dir=args.bench_dir,
        timeout_s=args.timeout,
    )


def _cmd_tune(args, argv: list[str]) -> int:
    from .tune import config_from_args, run_tune

    return run_tune(config_from_args(args, argv))


def _cmd_checkpoint(args) -> int:
    from .checkpoint import run

    return run(args)


def _cmd_config(args) -> int:
    from .config import run

    return run(args)


def _cmd_testbed(args) -> int:
    from .testbed import run

    return run(args)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `zero-kernels` console script; returns the exit code."""
    try:
        try:
            rc = _main(argv)
        finally:  # a closed pipe shows here, not as a traceback at interpreter exit
            if sys.stdout is not None:
                sys.stdout.flush()
        comm = sys.modules.get("zero_kernels.comm")
        if comm is not None and comm.joined_here():  # a rank under torchrun (demo, tune)
            comm.exit_process(rc)  # [Note: leaving a rank] in zero_kernels/comm
        return rc
    except BrokenPipeError:
        # The reader went away: stop quietly. Point stdout at /dev/null so the interpreter's
        # final flush of what is still buffered does not raise again.
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (OSError, ValueError):  # stdout has no file descriptor (captured)
            pass
        return EXIT_BROKEN_PIPE


def _main(argv: list[str] | None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        parser = build_parser()
        args = parser.parse_args(argv)
        if args.version:
            from .._version import __version__

            print(f"zero_kernels {__version__}")
            return 0
        if args.command is None:
            parser.print_help()
            return 2
        cmd = {
            "demo": _cmd_demo,
            "estimate": _cmd_estimate,
            "bench": _cmd_bench,
            "checkpoint": _cmd_checkpoint,
            "config": _cmd_config,
            "testbed": _cmd_testbed,
            "tune": lambda a: _cmd_tune(a, argv),
        }[args.command]
        return cmd(args)
    except _UsageError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    except (ValueError, TypeError, NotImplementedError) as e:
        if os.environ.get("ZERO_KERNELS_TRACEBACK"):
            raise
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        print(f"{PROG}: error: {msg}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
