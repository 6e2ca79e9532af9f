"""One rank of a world of 8 on torch's fake process group, with CUDA tensors (its collectives do
nothing: what is measured is what one rank allocates and synchronises). `bench/gpu_check.sh`
runs it with --device cuda; --device cpu is a smoke run of the same code.

1. memory: stage 3, 16 blocks of 2 x Linear(2048, 2048) (33.6 MB gathered per block), a
   sleep kernel in every block's forward so the GPU lags far behind the host. The peak of
   ``torch.cuda.max_memory_reserved()`` over a forward + backward, less what was allocated
   before it (the shards, gradients, optimizer state), must stay within the scheduler's window
   ([Note: gathered memory on CUDA] in zero_kernels/buffers.py): the root unit, (prefetch + 2)
   blocks gathered, the reduce-scatter bucket pool, one block's unreduced gradients (autograd's,
   transient) and 64 MiB of slack for activations and the allocator's rounding. Before, a
   gathered block freed on the compute stream could not be reused until the comm stream caught
   up, and the reserved memory climbed toward the whole model's gathered size (printed beside
   it).
2. syncs: clip + step with fp16 dynamic loss scaling, nonfinite="skip", torch's GradScaler and
   int8 optimizer state (stages 1-3): the host synchronisations counted with
   ``torch.cuda.set_sync_debug_mode("warn")`` (at most 1 per step: the verdict on non-finite
   gradients, or GradScaler's own read); int8 state with nonfinite="step" runs under "error"
   (none at all), and a profile of its step must show no host-to-device copy from pageable
   memory (the block tables are pinned once: zero_kernels/partition/lowbit_state.py).

    python bench/gpu_fake8_check.py [--device cuda|cpu] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings

import torch
import torch.distributed as dist
from torch import nn
from torch.testing._internal.distributed.fake_pg import FakeStore

from zero_kernels.policy import ZeroPolicy

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from zero_kernels import ZeroOptimizer  # noqa: E402

MB = 1 << 20
SLACK = 64 * MB  # activations (tiny here), allocator rounding, the step's temporaries


class Block(nn.Module):
    def __init__(self, d: int, lag: bool):
        super().__init__()
        self.a, self.b, self.lag = nn.Linear(d, d), nn.Linear(d, d), lag

    def forward(self, x):
        if self.lag and x.is_cuda:
            torch.cuda._sleep(5_000_000)  # a few ms: the host runs ahead of the GPU
        return x + self.b(torch.relu(self.a(x)))


class Net(nn.Module):
    def __init__(self, n: int, d: int, lag: bool = False):
        super().__init__()
        self.inp = nn.Linear(d, d)
        self.blocks = nn.ModuleList(Block(d, lag) for _ in range(n))
        self.out = nn.Linear(d, 8)

    def forward(self, x):
        x = self.inp(x)
        for b in self.blocks:
            x = b(x)
        return self.out(x)


def nbytes(ps) -> int:
    return sum(p.numel() * p.element_size() for p in ps)


def check_memory(device: torch.device, prefetch: int = 1) -> dict:
    n, d = (16, 2048) if device.type == "cuda" else (6, 256)
    torch.manual_seed(0)
    m = Net(n, d, lag=True).to(device)
    unit = nbytes(m.blocks[0].parameters())
    root = nbytes(m.inp.parameters()) + nbytes(m.out.parameters())
    whole = nbytes(m.parameters())
    zo = ZeroOptimizer(
        m, torch.optim.AdamW, policy=ZeroPolicy.resolve(stage=3, prefetch=prefetch), lr=1e-3
    )
    x = torch.randn(8, d, device=device)
    for _ in range(2):  # the first step records the order and creates the state
        m(x).pow(2).mean().backward()
        zo.step()
        zo.zero_grad()
    pool = zo.memory_report()["comm_buffer_bytes"]
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    m(x).pow(2).mean().backward()
    r = zo.memory_report()
    out = dict(
        check="memory",
        unit_MB=unit / MB,
        root_MB=root / MB,
        whole_model_MB=whole / MB,
        units_peak=r["gathered_units_peak"],
        gathered_peak_MB=r["gathered_param_peak_bytes"] / MB,
    )
    # the window, the bucket pool (allocated before already: counted twice, on the safe side),
    # one block's unreduced gradients (autograd's, freed once copied into the bucket) and slack
    bound = root + (prefetch + 2) * unit + pool + unit + SLACK
    if device.type == "cuda":
        torch.cuda.synchronize()
        extra = torch.cuda.max_memory_reserved() - before
        out.update(reserved_over_before_MB=extra / MB, bound_MB=bound / MB)
        out["ok"] = extra <= bound and r["gathered_units_peak"] <= prefetch + 2
    else:
        out["ok"] = r["gathered_units_peak"] <= prefetch + 2
    zo.step()
    zo.close()
    return out


def check_syncs(device: torch.device, mode: str, stage: int) -> dict:
    torch.manual_seed(0)
    m = Net(4, 64).to(device)
    kw: dict = dict(stage=stage, bucket_size_mb=0.01)
    if mode == "fp16":
        m = m.half()
        kw["loss_scale"] = "dynamic"
    elif mode == "skip":
        kw["nonfinite"] = "skip"
    elif mode == "int8":
        kw["state_dtype"] = "int8"
    units = [Block] if stage == 3 else None
    pol = ZeroPolicy.resolve(**kw)
    zo = ZeroOptimizer(m, torch.optim.AdamW, policy=pol, units=units, lr=1e-3)
    scaler = torch.amp.GradScaler(device.type, init_scale=1024.0) if mode == "scaler" else None
    dt = next(m.parameters()).dtype
    counts, pageable = [], 0
    for step in range(5):
        zo.zero_grad()
        loss = m(torch.randn(8, 64, device=device, dtype=dt)).float().pow(2).mean()
        (scaler.scale(loss) if scaler is not None else zo.scale_loss(loss)).backward()
        measured = step >= 2 and device.type == "cuda"
        strict = mode == "int8"  # nothing may synchronise
        prof = None
        if measured and strict:
            prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
            prof.__enter__()
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            if measured:
                torch.cuda.set_sync_debug_mode("error" if strict else "warn")
            try:
                if scaler is not None:
                    scaler.unscale_(zo)
                zo.clip_grad_norm_(1.0)
                if scaler is not None:
                    scaler.step(zo)
                    scaler.update()
                else:
                    zo.step()
            finally:
                if measured:
                    torch.cuda.set_sync_debug_mode("default")
        if prof is not None:
            torch.cuda.synchronize()
            prof.__exit__(None, None, None)
            pageable += sum("Pageable" in e.name for e in prof.events())
        if measured:
            counts.append(sum("synchronizing" in str(w.message) for w in seen))
    zo.close()
    ok = all(c <= (0 if mode == "int8" else 1) for c in counts) and pageable == 0
    return dict(
        check="syncs", mode=mode, stage=stage, syncs_per_step=counts, pageable=pageable, ok=ok
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_fake8_check: --device cuda but torch sees no GPU", file=sys.stderr)
        return 2
    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
    runs = [lambda: check_memory(device)]
    for mode in ("fp16", "skip", "scaler", "int8"):
        for stage in (1, 2, 3):
            runs.append(lambda mode=mode, stage=stage: check_syncs(device, mode, stage))
    rows = []
    try:
        for run in runs:
            try:
                r = run()
            except Exception as e:  # report every check, then fail
                r = {"ok": False, "error": f"{type(e).__name__}: {e}"}
            print(json.dumps(r, default=str), flush=True)
            rows.append(r)
    finally:
        dist.destroy_process_group()
    os.makedirs(args.out, exist_ok=True)
    meta = {
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "command": " ".join(sys.argv),
    }
    with open(os.path.join(args.out, f"gpu_fake8_check_{device.type}.json"), "w") as f:
        json.dump({"meta": meta, "checks": rows}, f, indent=1, default=str)
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
