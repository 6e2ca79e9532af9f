"""`zero-kernels config explain ds_config.json`: what a DeepSpeed config becomes here, key by key.

Each line: the kind (mapped, caller, same, speed, differs, refused; [Note: DeepSpeed config] in
`zero_kernels.integrations.ds_config`), the key, its value and what it becomes; then the
`ZeroOptimizer` call it amounts to. Exit codes: 0 every key maps, 1 some key is refused (or
trains differently, unless ``--allow-differences``), 2 bad arguments or a file that is not JSON.
"""

from __future__ import annotations

import json

__all__ = ["add_parser", "run"]


def add_parser(sub, parser_class) -> None:
    c = sub.add_parser(
        "config",
        help="explain what a DeepSpeed config becomes here",
        description="Read a DeepSpeed ds_config.json as zero_kernels policies.",
    )
    cs = c.add_subparsers(dest="action", parser_class=parser_class, metavar="{explain}")
    cs.required = True
    e = cs.add_parser("explain", help="print the mapping key by key")
    e.add_argument("path", metavar="DS_CONFIG")
    e.add_argument(
        "--num-training-steps",
        type=int,
        default=None,
        help="resolves scheduler.params.total_num_steps 'auto' (as HF's Trainer does)",
    )
    e.add_argument(
        "--hidden-size",
        type=int,
        default=None,
        help="the model's hidden size: resolves the bucket sizes' 'auto' (as HF's Trainer does)",
    )
    e.add_argument(
        "--allow-differences",
        action="store_true",
        help="accept keys that train differently here (warnings instead of errors)",
    )
    e.add_argument("--json", action="store_true", help="print JSON")


def run(args) -> int:
    from ..integrations.ds_config import map_deepspeed_config

    model = None
    if args.hidden_size is not None:

        class _Config:
            hidden_size = args.hidden_size

        class _Model:
            config = _Config

        model = _Model()
    m = map_deepspeed_config(
        args.path,
        model=model,
        num_training_steps=args.num_training_steps,
        allow_differences=args.allow_differences,
    )
    if args.json:
        print(
            json.dumps(
                {
                    "lines": [
                        {"kind": ln.kind, "key": ln.key, "value": ln.value, "becomes": ln.becomes}
                        for ln in m.lines
                    ],
                    "stage": m.stage,
                    "options": {k: str(v) for k, v in m.options.items()},
                    "refused": [ln.key for ln in m.refused],
                },
                indent=1,
                default=str,
            )
        )
    else:
        print(m.explain())
    return 1 if m.refused else 0
