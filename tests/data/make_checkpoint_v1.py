"""Writes tests/data/checkpoint_v1: a checkpoint of format version 1, kept so that later versions
of zero_kernels are tested against a file this version wrote (test_checkpoint.py loads it).

    python tests/data/make_checkpoint_v1.py     # from the repository root; 2 gloo ranks

ZeRO stage 2, AdamW (flat, fused kernel), two param groups, StepLR, world size 2, fp32; the
model and data are checkpoint_checks.Net and its batches (fp32: each rank half the batch).
"""

import os
import shutil
import sys

here = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(here))

import checkpoint_checks as cc  # noqa: E402
from dist_utils import run_workers  # noqa: E402

OUT = os.path.join(here, "checkpoint_v1")
CONFIG = ("adamw", 2, "flat", "fp32")


def write(rank: int, world: int, out: str) -> None:
    import zero_kernels as zk

    wrapped, m, o, sched = cc.build(CONFIG)
    cc.train(CONFIG, wrapped, o, sched, rank, world, range(cc.K))
    zk.save_checkpoint(out, wrapped, o, scheduler=sched, extra={"step": cc.K, "note": "v1"})
    o.close()


if __name__ == "__main__":
    shutil.rmtree(OUT, ignore_errors=True)
    run_workers(write, 2, OUT)
    print("wrote", OUT)
