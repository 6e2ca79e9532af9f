"""LoRA over a frozen base at stage 3: what ``shard_frozen=True`` saves per rank, and costs in step
time, against the frozen base kept whole, DDP and FSDP2 (``fully_shard`` per layer, which shards
frozen params too); [Note: frozen shards] in zero_kernels/partition/frozen.py.

A Llama (transformers, random weights; ``--layers``, ``--hidden``, ``--vocab``) under PEFT's LoRA
(r=8 on q_proj, v_proj, down_proj), fp32, AdamW, batch 2 x 64 tokens, on ``--world`` gloo ranks.
Per variant: rank 0's RSS after the optimizer is built and the first step taken (VmRSS), its
peak over the timed steps (VmHWM, reset through /proc/self/clear_refs at the first timed step),
the param bytes of ``memory_report()`` (ours), the median step time, and the final loss (every
variant trains the same model on the same batches: their losses agree).

``--autocast``: every variant's forward and backward under ``torch.autocast("cpu", bf16,
cache_enabled=False)`` over the fp32 model (the frozen weights are cast for each matmul). The
variants with the suffix ``_saved`` (``stage3_saved``, ``stage3_shard_frozen_saved``) turn off
what [Note: frozen casts] (zero_kernels/partition/recast.py) does, so that autograd saves the
frozen weights' casts as it did before it: the same code otherwise, side by side.

    python bench/bench_frozen_shards.py [--world 2] [--steps 6] [--tag frozen_shards]
    python bench/bench_frozen_shards.py --autocast --variants \
        ddp,fsdp2,stage3,stage3_saved,stage3_shard_frozen,stage3_shard_frozen_saved
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time

import torch

from zero_kernels.policy import ZeroPolicy

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, ".."))

from harness import (  # noqa: E402
    init_gloo,
    markdown_table,
    run_group,
    run_info,
    status_bytes,
    write_results,
)

MB = 1e6
VARIANTS = ("ddp", "fsdp2", "stage3", "stage3_shard_frozen")


def _model(args):
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 11 // 4,
        num_hidden_layers=args.layers,
        num_attention_heads=8,
        num_key_value_heads=8,
        max_position_embeddings=128,
        tie_word_embeddings=True,
    )
    m = LlamaForCausalLM(cfg)
    lora = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"])
    return get_peft_model(m, lora)


def _reset_hwm() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def worker(rank, world, port, args, q):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from zero_kernels import ZeroOptimizer

    init_gloo(rank, world, port)
    torch.set_num_threads(1)
    v = args.variant
    m = _model(args)
    m.train()
    trained = [p for p in m.parameters() if p.requires_grad]
    report = None
    if v == "ddp":
        run = DDP(m)
        opt = torch.optim.AdamW(trained, lr=1e-4, fused=True)
    elif v == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for layer in m.base_model.model.model.layers:
            fully_shard(layer)
        fully_shard(m)
        run = m
        opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-4)
    else:
        if v.endswith("_saved"):  # the frozen casts saved as autograd saves them
            from zero_kernels.partition.units import UnitScheduler

            UnitScheduler._frozen_casts = lambda self, u: []
        zo = ZeroOptimizer(
            trained,
            torch.optim.AdamW,
            policy=ZeroPolicy.resolve(
                stage=3, shard_frozen=v.removesuffix("_saved").endswith("shard_frozen")
            ),
            module=m,
            lr=1e-4,
        )
        run, opt, report = m, zo, zo
    cast = (
        torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False)
        if args.autocast
        else contextlib.nullcontext()
    )
    g = torch.Generator().manual_seed(rank)
    times, loss = [], None
    built = 0
    for step in range(args.steps):
        x = torch.randint(0, args.vocab, (2, 64), generator=g)
        if step == 1:
            _reset_hwm()
        t0 = time.perf_counter()
        with cast:
            loss = run(input_ids=x, labels=x).loss
            loss.backward()
        opt.step()
        opt.zero_grad()
        dt = time.perf_counter() - t0
        if step == 0:
            built = status_bytes("VmRSS")
        else:
            times.append(dt)
    out = {
        "variant": v,
        "rss_after_step0_MB": built / MB,
        "peak_rss_MB": status_bytes("VmHWM") / MB,
        "step_s": statistics.median(times),
        "final_loss": float(loss),
    }
    if report is not None:
        mr = report.memory_report()
        out["param_bytes_MB"] = mr["param_bytes"] / MB
        out["gathered_peak_MB"] = mr["gathered_param_peak_bytes"] / MB
        report.close()
    dist.barrier()
    q.put((rank, out))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    ap.add_argument("--tag", default="frozen_shards")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=8000)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--autocast", action="store_true", help="bf16 autocast, its cache off")
    args = ap.parse_args()
    m = _model(args)
    frozen = sum(p.numel() for p in m.parameters() if not p.requires_grad)
    trained = sum(p.numel() for p in m.parameters() if p.requires_grad)
    del m
    print(f"frozen {frozen / 1e6:.1f}M params, trained {trained / 1e6:.2f}M", flush=True)
    rows = []
    for v in args.variants.split(","):
        args.variant = v
        res = run_group(worker, args.world, args, timeout=1800)
        r0 = res[0]
        rows.append({k: round(x, 3) if isinstance(x, float) else x for k, x in r0.items()})
        print(rows[-1], flush=True)
    keys = ["variant", "rss_after_step0_MB", "peak_rss_MB", "param_bytes_MB", "gathered_peak_MB"]
    keys.append("step_s")
    keys.append("final_loss")
    for r in rows:
        r.setdefault("param_bytes_MB", "")
        r.setdefault("gathered_peak_MB", "")
    payload = {
        **run_info(os.path.basename(__file__)),
        "config": {k: v for k, v in vars(args).items() if k != "variant"},
        "frozen_params": frozen,
        "trained_params": trained,
    }
    print(markdown_table(rows, keys))
    write_results(args.out, f"bench_{args.tag}", payload, rows)


if __name__ == "__main__":
    main()
