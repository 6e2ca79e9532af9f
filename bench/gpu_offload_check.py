"""The host tier (``offload_optimizer="cpu"``, [Note: host tier] in zero_kernels/offload/host.py)
on a GPU: correctness against the run with the state on the GPU, device memory saved, and the
step's time beside its parts and a peer, at world size 1 (NCCL; gloo with --device cpu, the smoke
run on machines without a GPU). `bench/gpu_check.sh` runs it.

1. Correctness: a small GPT, stages 1-3, fp32 and bf16 params, 6 clipped AdamW steps with the
   state on the GPU, with the host tier, and at stage 3 with offload_params="cpu" too: the
   largest relative difference of any param (the CPU and CUDA kernels compute the same
   formulas; a last bit may differ where the compilers contract differently, and Adam carries
   it on). Bound 1e-3, as gpu_zero_check.py's against torch.
2. Memory and time: a GPT of --layers x --width (bf16 params, fp32 masters): the device's
   allocated bytes after the first step and its peak, and the median step (forward + backward,
   ``opt.step()``) with the state on the GPU, with the host tier (stage 2), with both host tiers
   (stage 3: the param shards on the host too), and FSDP2 ``fully_shard`` with
   ``CPUOffloadPolicy`` (torch's CPU offload: params, gradients and torch AdamW on the host).
   Beside them, what the host tier's step is made of, measured alone in the same run: the CPU
   kernel over the shard (`FusedAdamW` on host tensors of the same size), and the copies of the
   gradient (device to host) and the params (host to device) through pinned memory.

    python bench/gpu_offload_check.py [--device cuda|cpu] [--out DIR] [--layers 12 --width 768]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import sys
import time

import torch
import torch.distributed as dist

from zero_kernels.policy import ZeroPolicy

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from zero_kernels import FusedAdamW, ZeroOptimizer  # noqa: E402
from zero_kernels.tools.models import GPT, GPTConfig  # noqa: E402


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _batch(cfg, step, batch, device):
    g = torch.Generator().manual_seed(step)
    x = torch.randint(0, cfg.vocab_size, (batch, cfg.block_size + 1), generator=g).to(device)
    return x[:, :-1].contiguous(), x[:, 1:].contiguous()


def correctness(device, steps: int = 6) -> list[dict]:
    cfg = GPTConfig(vocab_size=256, block_size=64, n_layer=4, n_head=4, n_embd=128)
    rows = []
    for stage in (1, 2, 3):
        for dtype in (torch.float32, torch.bfloat16):
            torch.manual_seed(0)
            base = GPT(cfg).to(device=device, dtype=dtype)
            got, reps = [], []
            tiers = [None, "cpu"] + (["both"] if stage == 3 else [])
            for off in tiers:
                m = copy.deepcopy(base)
                kw = {"offload_optimizer": off}
                if off == "both":  # the param shards in host memory too
                    kw = {"offload_optimizer": "cpu", "offload_params": "cpu"}
                pol = ZeroPolicy.resolve(stage=stage, **kw)
                opt = ZeroOptimizer(m, torch.optim.AdamW, policy=pol, lr=1e-3, weight_decay=0.01)
                for s in range(steps):
                    x, y = _batch(cfg, s, 4, device)
                    opt.zero_grad()
                    m(x, y).backward()
                    opt.clip_grad_norm_(0.5)
                    opt.step()
                with opt.gathered_params(m) if stage == 3 else contextlib.nullcontext():
                    got.append({n: p.detach().clone() for n, p in m.named_parameters()})
                reps.append(opt.memory_report())
                opt.close()
            for k in range(1, len(got)):
                errs = {n: _rel(got[k][n], got[0][n]) for n in got[0]}
                worst = max(errs, key=errs.get)
                bits = all(torch.equal(got[k][n], got[0][n]) for n in got[0])
                row = {
                    "stage": stage,
                    "dtype": str(dtype)[6:],
                    "tiers": "optimizer" if k == 1 else "optimizer + params",
                    "max_rel_err_vs_on_device": errs[worst],
                    "worst_param": worst,
                    "bitwise": bits,
                    "to_host_bytes": reps[k]["offload_to_host_bytes"],
                    "to_device_bytes": reps[k]["offload_to_device_bytes"],
                    "ok": errs[worst] <= 1e-3,
                }
                print(json.dumps(row), flush=True)
                rows.append(row)
    return rows


def _median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2]


def _train_timed(m, opt, cfg, device, steps, batch, clip=True):
    fb, st = [], []
    for s in range(steps):
        x, y = _batch(cfg, s, batch, device)
        _sync(device)
        t0 = time.perf_counter()
        opt.zero_grad()
        m(x, y).backward()
        if clip:
            if hasattr(opt, "clip_grad_norm_"):
                opt.clip_grad_norm_(1.0)
            else:
                torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        _sync(device)
        t1 = time.perf_counter()
        opt.step()
        _sync(device)
        t2 = time.perf_counter()
        if s >= 2:  # warm-up: allocation, first-step state
            fb.append(t1 - t0)
            st.append(t2 - t1)
    return {
        "fwd_bwd_s": _median(fb),
        "step_s": _median(st),
        "total_s": _median([a + b for a, b in zip(fb, st)]),
    }


def _mem(device):
    if device.type != "cuda":
        return {}
    return {
        "device_allocated_bytes": torch.cuda.memory_allocated(device),
        "device_peak_bytes": torch.cuda.max_memory_allocated(device),
    }


def timing(device, layers: int, width: int, steps: int, batch: int) -> dict:
    cfg = GPTConfig(vocab_size=8192, block_size=256, n_layer=layers, n_head=width // 64,
                    n_embd=width)  # fmt: skip
    torch.manual_seed(0)
    base = GPT(cfg).to(dtype=torch.bfloat16)
    nparam = sum(p.numel() for p in base.parameters())
    out = {"params": nparam, "layers": layers, "width": width, "batch": batch, "rows": {}}
    both = {"offload_optimizer": "cpu", "offload_params": "cpu"}
    for name, stage, kw in (
        ("zero stage 2, state on the device", 2, {}),
        ("zero stage 2, host tier", 2, {"offload_optimizer": "cpu"}),
        ("zero stage 3, state on the device", 3, {}),
        ("zero stage 3, both host tiers", 3, both),
    ):
        m = copy.deepcopy(base).to(device)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        pol = ZeroPolicy.resolve(stage=stage, **kw)
        opt = ZeroOptimizer(m, torch.optim.AdamW, policy=pol, lr=1e-4)
        r = _train_timed(m, opt, cfg, device, steps, batch)
        r.update(_mem(device))
        out["rows"][name] = r
        print(name, json.dumps(r), flush=True)
        opt.close()
        del m, opt
        if device.type == "cuda":
            torch.cuda.empty_cache()
    # the peer: FSDP2 with torch's CPU offload (params, grads and the optimizer on the host)
    try:
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

        m = copy.deepcopy(base).float()  # FSDP2 keeps fp32 params; bf16 compute by its policy
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for blk in m.blocks:
            fully_shard(blk, offload_policy=CPUOffloadPolicy(), mp_policy=mp)
        fully_shard(m, offload_policy=CPUOffloadPolicy(), mp_policy=mp)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-4)
        r = _train_timed(m, opt, cfg, device, steps, batch)
        r.update(_mem(device))
        out["rows"]["FSDP2 fully_shard + CPUOffloadPolicy, torch AdamW"] = r
        print("fsdp2 cpu offload", json.dumps(r), flush=True)
        del m, opt
    except Exception as e:  # report what failed, go on
        out["rows"]["FSDP2 fully_shard + CPUOffloadPolicy, torch AdamW"] = {
            "error": f"{type(e).__name__}: {e}"[:300]
        }
        print("fsdp2 cpu offload failed:", e, flush=True)
    # the parts of the host tier's step, alone: the CPU kernel over the whole shard (bf16 params
    # with fp32 masters and bf16 gradients, as the step has them) and the bus both ways
    p = torch.randn(nparam)
    p.grad = torch.randn(nparam).bfloat16().float() * 1e-3
    k = FusedAdamW([p], lr=1e-4)
    ts = []
    for _ in range(5):
        t0 = time.perf_counter()
        k.step()
        ts.append(time.perf_counter() - t0)
    out["cpu_kernel_fp32_grads_s"] = _median(ts[1:])
    del p, k
    if device.type == "cuda":
        g = torch.empty(nparam, dtype=torch.bfloat16, device=device)
        h = torch.empty(nparam, dtype=torch.bfloat16, pin_memory=True)
        for what, (dst, src) in (("d2h", (h, g)), ("h2d", (g, h))):
            dst.copy_(src, non_blocking=True)
            _sync(device)
            t0 = time.perf_counter()
            for _ in range(5):
                dst.copy_(src, non_blocking=True)
            _sync(device)
            dt = (time.perf_counter() - t0) / 5
            out[f"{what}_bf16_shard_s"] = dt
            out[f"{what}_GBps"] = 2 * nparam / dt / 1e9
    out["threads"] = torch.get_num_threads()
    print(json.dumps({k: v for k, v in out.items() if k != "rows"}), flush=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--width", type=int, default=768)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=7)
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_offload_check: --device cuda but torch sees no GPU", file=sys.stderr)
        return 2
    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29563")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)
    try:
        rows = correctness(device)
        t = timing(device, args.layers, args.width, args.steps, args.batch)
    finally:
        dist.destroy_process_group()
    meta = {
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "cpus": os.cpu_count(),
        "command": " ".join(sys.argv),
    }
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"gpu_offload_check_{device.type}.json"), "w") as f:
        json.dump({"meta": meta, "correctness": rows, "timing": t}, f, indent=1)
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
