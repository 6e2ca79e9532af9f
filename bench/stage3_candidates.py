"""bench_stage3's candidates: what each imports, and how each is built and stepped (the
timing, capacity and memory parts share them; see bench_stage3.py's docstring)."""

from __future__ import annotations

import os
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402
from torch import nn  # noqa: E402

from zero_kernels.policy import ZeroPolicy

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, ".."))

from harness import (  # noqa: E402
    marked_step,
    strip_host_cache,
    strip_mmap_threshold,
    strip_read_guard,
)

MiB = 2**20
ADAMW = dict(weight_decay=0.01, betas=(0.9, 0.999), eps=1e-8)


def import_libs(name: str) -> None:
    """The candidate's libraries, imported before the baseline (their import is not training
    memory)."""
    from torch.nn.parallel import DistributedDataParallel  # noqa: F401

    import zero_kernels  # noqa: F401
    import zero_kernels.tools.models  # noqa: F401

    if name.startswith("fsdp2"):
        from torch.distributed.fsdp import fully_shard  # noqa: F401
    if name.startswith("deepspeed"):
        import deepspeed  # noqa: F401
        from deepspeed.ops.adam import DeepSpeedCPUAdam  # noqa: F401
    warm_up()


def warm_up() -> None:
    """What any candidate's first use pulls in lazily, done before the baseline so that it is
    not counted as training memory: torch._dynamo and its ~900 modules (sympy...: ~150 MB of
    RSS, imported by the first DDP construction or meta-device init), and the code pages of the
    CPU kernels (a tiny GPT's forward, backward and fused AdamW step)."""
    import torch._dynamo  # noqa: F401

    from zero_kernels.tools.models import GPT

    with torch.device("meta"):
        nn.Embedding(8, 8)
    torch.manual_seed(0)
    m = GPT(gpt_cfg(1, 32, 4, 16))
    opt = torch.optim.AdamW(m.parameters(), fused=True)
    x = torch.randint(0, 256, (1, 16))
    m(x, x).backward()
    opt.step()
    del m, opt


def gpt_cfg(layers: int, d: int, heads: int, tokens: int):
    from zero_kernels.tools.models import GPTConfig

    return GPTConfig(vocab_size=256, block_size=tokens, n_layer=layers, n_head=heads, n_embd=d)


def gpt_batch(args, rank: int, step: int):
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randint(0, 256, (args.batch, args.tokens), generator=g)
    return x, torch.roll(x, -1, dims=1)


def build(name: str, model: nn.Module, args, lr: float):
    """-> (step(x, y) -> loss, optimizer-or-engine). Candidates as in the module docstring."""
    kw = dict(lr=lr, **ADAMW)
    name = strip_mmap_threshold(name)  # e.g. ddp_mmap4096: glibc's threshold at 4096 KiB
    name = strip_host_cache(name)  # e.g. ours_reshard_nocache: glibc for every block
    name = strip_read_guard(name)  # e.g. ours_reshard_noguard: no read guard in the forward
    # e.g. ours_reshard_compile: the same candidate, its model (DDP: the DDP module) run through
    # torch.compile (inductor); compiled at the first (warm-up) step
    compiled = name.endswith("_compile")
    if compiled:
        name = name[: -len("_compile")]
    C = torch.compile if compiled else (lambda m: m)  # noqa: E731
    if name == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        ddp = DDP(model, gradient_as_bucket_view=True, bucket_cap_mb=args.bucket_mb)
        opt = torch.optim.AdamW(model.parameters(), fused=True, **kw)

        # None (not zeros): backward makes them views of DDP's buckets again, and the
        # buckets rebuilt in the 2nd step do not coexist with the 1st step's (+4 B/param)
        zero = lambda: opt.zero_grad(set_to_none=True)  # noqa: E731
        fwd = C(ddp)
        return marked_step(lambda x, y: fwd_loss(fwd, x, y), opt.step, zero), opt
    if name.startswith("fsdp2"):
        from torch.distributed.fsdp import fully_shard

        reshard = "_noreshard" not in name
        blocks = list(model.blocks)
        for b in blocks:
            fully_shard(b, reshard_after_forward=reshard)
        fully_shard(model, reshard_after_forward=reshard)
        if name.endswith("_prefetch"):
            for i, b in enumerate(blocks):
                if i + 1 < len(blocks):
                    b.set_modules_to_forward_prefetch([blocks[i + 1]])
                if i > 0:
                    b.set_modules_to_backward_prefetch([blocks[i - 1]])
            model._set_unshard_async_op(True)
        opt = torch.optim.AdamW(model.parameters(), fused=True, **kw)

        zero = lambda: opt.zero_grad(set_to_none=True)  # noqa: E731
        fwd = C(model)
        return marked_step(lambda x, y: fwd_loss(fwd, x, y), opt.step, zero), opt
    if name.startswith("deepspeed"):
        if compiled:
            raise ValueError("deepspeed_zero3 has no _compile variant here")
        import deepspeed
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        opt = DeepSpeedCPUAdam(model.parameters(), adamw_mode=True, **kw)
        elems = int(args.bucket_mb * MiB) // 4
        cfg = {
            "train_micro_batch_size_per_gpu": args.batch,
            "gradient_accumulation_steps": 1,
            "gradient_clipping": 0.0,
            "fp16": {"enabled": False},
            "bf16": {"enabled": False},
            "zero_optimization": {
                "stage": 3,
                "overlap_comm": True,
                "contiguous_gradients": True,
                "reduce_bucket_size": elems,
            },
            "steps_per_print": 10**9,
            "wall_clock_breakdown": False,
        }
        engine, _, _, _ = deepspeed.initialize(
            model=model, optimizer=opt, config=cfg, dist_init_required=False
        )

        step = marked_step(
            lambda x, y: fwd_loss(engine, x, y), engine.step, backward=engine.backward
        )
        return step, engine
    if name.startswith(("ours", "stage")):
        from zero_kernels import ZeroOptimizer

        stage = 3 if name.startswith("ours") else int(name[5])
        if name.endswith("_noshm"):  # the probe without the shm algorithm (as before it)
            from zero_kernels.comm import shm

            shm.capable = lambda group: "left out by the _noshm candidate"
            name = name[: -len("_noshm")]
        for algo in ("native", "pairwise", "shm"):  # pin the collectives' algorithm (else probe)
            if name.endswith("_" + algo):
                from zero_kernels import comm

                comm.set_algorithm("all", algo)
                name = name[: -len(algo) - 1]
        extra = {}
        if name.endswith("_onegroup"):  # reduce-scatters on the main group, as before the twin
            from zero_kernels import comm

            comm.twin_group = lambda group=None, device=None: group
            name = name[: -len("_onegroup")]
        if name.endswith("_inflight1"):  # e.g. stage3_prefetch0_inflight1: the leanest stage 3
            extra["max_inflight_buckets"] = 1
            name = name[: -len("_inflight1")]
        for mode in ("first", "pass", "every"):  # e.g. ours_reshard_check_first
            if name.endswith("_check_" + mode):
                extra["check_order"] = mode
                name = name[: -len(mode) - 7]
        if stage == 3:
            extra.update(
                reshard_after_forward="_noreshard" not in name,
                prefetch=0 if name.endswith("prefetch0") else 1,
            )
        pol = ZeroPolicy.resolve(stage=stage, bucket_size_mb=args.bucket_mb, **extra)
        opt = ZeroOptimizer(model, torch.optim.AdamW, policy=pol, **kw)

        fwd = C(model)
        return marked_step(lambda x, y: fwd_loss(fwd, x, y), opt.step, opt.zero_grad), opt
    raise ValueError(f"unknown candidate {name!r}")


def fwd_loss(fwd, x, y):
    if y is None:  # the MLP
        return fwd(x).pow(2).mean()
    return fwd(x, y)
