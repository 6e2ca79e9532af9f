"""`zero-kernels checkpoint inspect|verify|export|convert`: look into a checkpoint without training.

``inspect`` also reads a DeepSpeed checkpoint folder (``global_stepN/`` or the folder with its
``latest``); ``convert --from deepspeed SRC DST`` writes it in our format under DST, streamed
([Note: DeepSpeed checkpoints] in `zero_kernels.checkpoint.deepspeed`).

Exit codes: 0 fine, 1 a checkpoint that fails (verify: every problem printed, one per line; the
others: the `CheckpointError` on one line), 2 bad arguments.

PATH with no checkpoint of its own but checkpoints one level down (``zero-kernels demo
--checkpoint-dir DIR`` writes one per run: DIR/stage0, DIR/stage2): ``inspect`` names them and
shows each (``--json``: ``{"path": PATH, "checkpoints": [one inspect dict each]}``); ``verify``
and ``export`` act on one checkpoint, so they name them and exit 2, printing the command for
the first.
"""

from __future__ import annotations

import json
import shlex
import sys

__all__ = ["add_parser", "run"]


def add_parser(sub, parser_class) -> None:
    c = sub.add_parser(
        "checkpoint",
        help="inspect, verify or export a checkpoint of save_checkpoint",
        description="Look into a checkpoint written by zero_kernels.save_checkpoint. PATH is a "
        "checkpoint directory or the directory of checkpoints (its `latest` is used).",
    )
    cs = c.add_subparsers(
        dest="action", parser_class=parser_class, metavar="{inspect,verify,export,convert}"
    )
    cs.required = True
    i = cs.add_parser("inspect", help="world size, stage, step, tensors, sizes")
    i.add_argument("path", metavar="PATH")
    i.add_argument("--json", action="store_true", help="print JSON")
    v = cs.add_parser("verify", help="check every file's size and sha256 and the tensors")
    v.add_argument("path", metavar="PATH")
    e = cs.add_parser(
        "export",
        help="one consolidated safetensors file with the model's own names (streamed)",
    )
    e.add_argument("path", metavar="PATH")
    e.add_argument("--to", required=True, help="output file, e.g. model.safetensors")
    e.add_argument(
        "--dtype",
        choices=["fp32", "bf16", "fp16"],
        default=None,
        help="cast floating tensors (default: each param's own dtype in the model)",
    )
    v = cs.add_parser("convert", help="write another framework's checkpoint in our format")
    v.add_argument("--from", dest="source", choices=["deepspeed"], required=True)
    v.add_argument("path", metavar="SRC")
    v.add_argument("dst", metavar="DST", help="checkpoint root to write into")


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return str(n)


def run(args) -> int:
    from ..checkpoint import CheckpointError, export_model, inspect_checkpoint, verify_checkpoint
    from ..checkpoint.deepspeed import is_deepspeed_checkpoint
    from ..checkpoint.format import CheckpointsBelow, resolve

    if args.action == "convert" or (
        args.action == "inspect" and is_deepspeed_checkpoint(args.path)
    ):
        return _deepspeed(args)
    try:
        resolve(args.path)
    except CheckpointsBelow as e:
        return _several(args, e)
    except CheckpointError:
        pass  # each action reports it below, in its own way
    try:
        if args.action == "verify":
            problems = verify_checkpoint(args.path)
            for p in problems:
                print(p, file=sys.stderr)
            if problems:
                print(f"FAILED: {len(problems)} problem(s)", file=sys.stderr)
                return 1
            info = inspect_checkpoint(args.path)
            print(f"ok: {info['path']} ({len(info['files'])} files, {_size(info['bytes'])})")
            return 0
        if args.action == "inspect":
            info = inspect_checkpoint(args.path)
            if args.json:
                print(json.dumps(info, indent=1, default=str))
                return 0
            _print_info(info)
            return 0
        out = export_model(args.path, args.to, dtype=args.dtype)
        print(f"wrote {out['path']}: {out['tensors']} tensors, {_size(out['bytes'])}")
        return 0
    except CheckpointError as e:
        print(f"zero-kernels checkpoint: error: {e}", file=sys.stderr)
        return 1


def _deepspeed(args) -> int:
    from ..checkpoint import CheckpointError
    from ..checkpoint.deepspeed import inspect_deepspeed_checkpoint
    from ..checkpoint.deepspeed_convert import convert_deepspeed_checkpoint

    try:
        if args.action == "convert":
            out = convert_deepspeed_checkpoint(args.path, args.dst)
            print(f"wrote {out}")
            return 0
        info = inspect_deepspeed_checkpoint(args.path)
    except CheckpointError as e:
        print(f"zero-kernels checkpoint: error: {e}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(info, indent=1, default=str))
        return 0
    rows = [
        ("checkpoint", f"{info['path']} (DeepSpeed {info['ds_version']})"),
        ("layout", f"ZeRO stage {info['stage']}, world size {info['world_size']}"),
        ("steps", f"{info['global_steps']} (Adam step {info['adam_step']})"),
        (
            "params",
            f"{info['params']} tensors, {info['param_numel']:,} elements "
            f"({info['model_dtype']}, fp32 masters)",
        ),
        ("param groups", json.dumps(info["param_groups"], default=str)[:200]),
        ("loss scaler", json.dumps(info["loss_scaler"])),
        ("lr scheduler", json.dumps(info["lr_scheduler"])),
        ("buffers", ", ".join(info["buffers"]) or "none"),
        ("size", f"{_size(info['bytes'])} in {len(info['files'])} files"),
    ]
    w = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{w}}  {v}")
    for name, n in info["files"].items():
        print(f"  {name:<48}{_size(n):>14}")
    return 0


def _several(args, below) -> int:
    """PATH holds checkpoints one level down only (see the module's docstring)."""
    from ..checkpoint import CheckpointError, inspect_checkpoint

    found = below.found
    if args.action != "inspect":
        cmd = f"zero-kernels checkpoint {args.action} {shlex.quote(found[0])}"
        if args.action == "export":
            cmd += f" --to {shlex.quote(args.to)}"
        print(
            f"zero-kernels checkpoint: error: {args.path}: no checkpoint of its own; "
            f"checkpoints one level down: {', '.join(found)}. {args.action} takes one of them, "
            f"e.g. {cmd}",
            file=sys.stderr,
        )
        return 2
    infos, failed = [], 0
    for d in found:
        try:
            infos.append(inspect_checkpoint(d))
        except CheckpointError as e:
            failed += 1
            print(f"zero-kernels checkpoint: error: {e}", file=sys.stderr)
    if args.json:
        print(json.dumps({"path": args.path, "checkpoints": infos}, indent=1, default=str))
        return 1 if failed else 0
    print(
        f"{args.path}: no checkpoint of its own; {len(found)} checkpoint(s) one level down: "
        + ", ".join(found)
    )
    for info in infos:
        print()
        _print_info(info)
    return 1 if failed else 0


def _print_info(info: dict) -> None:
    stage = "0 (a torch optimizer, replicated)" if info["stage"] == 0 else str(info["stage"])
    rows = [
        ("checkpoint", info["path"]),
        (
            "format",
            f"version {info['format_version']} (zero_kernels {info['zero_kernels_version']}"
            f", torch {info['torch_version']})",
        ),
        ("world size", str(info["world_size"])),
        ("stage", stage + ("" if info["stage"] == 0 else f", {info['mode']} partition")),
        ("optimizer", info["optimizer_class"]),
        ("steps", str(info["steps"])),
        ("extra", json.dumps(info["extra"], default=str)[:200]),
        (
            "params",
            f"{info['params']} tensors, {info['param_numel']:,} elements "
            f"({', '.join(info['param_dtypes'])}); {info['params_with_state']} with state "
            f"({', '.join(info['state_keys']) or 'none'})",
        ),
        ("param groups", str(info["param_groups"])),
        ("scheduler", "saved" if info["scheduler"] else "none"),
        ("loss scaler", json.dumps(info["scaler"]) if info["scaler"] else "none"),
        ("model tensors", f"{info['model_tensors']} buffers / frozen params"),
        ("elements per rank", ", ".join(f"{n:,}" for n in info["numel_per_rank"])),
        ("size", f"{_size(info['bytes'])} in {len(info['files'])} files"),
    ]
    w = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{w}}  {v}")
    for name, n in sorted(info["files"].items()):
        print(f"  {name:<28}{_size(n):>14}")
