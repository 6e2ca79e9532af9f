#!/usr/bin/env bash
# One command for a machine with an NVIDIA GPU: build zero_kernels with CUDA (sm_80 + sm_90 by
# default), run the CUDA and Triton tests (the low-bit-state step's among them), then the kernel
# benchmark against torch's fused AdamW with the device's copy bandwidth measured in the same run,
# a timing of the low-bit-state step (bf16 / int8 moments; CUDA, Triton), then ZeroOptimizer
# stages 1-3 at world size 1 on NCCL (bench/gpu_zero_check.py: results vs torch, no host sync
# inside clip + step), then the host tier (bench/gpu_offload_check.py: offload_optimizer="cpu"
# against the state on the GPU, device memory, step time beside FSDP2's CPU offload), then torch's
# clip_grad_norm_ over ShardedGrads (one collective per call at world size 8). Uses the
# torch already installed (it never installs one). Meant to finish in under 8 minutes on an
# H100/H200 (5.5 measured on an H200 with 16 cores, 2026-12-04). The device section: the
# collectives' device of a meta-built stage 3, the CUDA wait timings held over 100 steps, and
# python/train_example.py on the GPU (issue 51).
#
#   bash bench/gpu_check.sh [OUT_DIR]       # results in OUT_DIR (default bench/results)
#   ONLY="tests offload" bash bench/gpu_check.sh OUT   # some sections only (a rerun after a fix;
#       the build always runs, quickly where build/ survived): tests bench lowbit zero offload clip device
#       fake8 (stage 3's gathered memory and the step's host syncs at world size 8, fake group)
set -uo pipefail
cd "$(dirname "$0")/.."
# every section runs whatever an earlier one gave (one device lease sees all of them); the
# script exits non-zero at the end if any failed, naming them
failed=()
section() { # section NAME: the status of the command before it
  local rc=$?
  if [[ $rc -ne 0 ]]; then failed+=("$1 (exit $rc)"); echo "!! $1 failed (exit $rc)"; fi
}
only="${ONLY:-tests bench lowbit zero offload clip fake8 device}"
want() { [[ " $only " == *" $1 "* ]]; }
out="${1:-bench/results}"
mkdir -p "$out"
py="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1
"$py" -c "import torch; assert torch.cuda.is_available(), 'no GPU visible to torch'; \
print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())" || exit 1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true

echo "== build (in place, with CUDA)"
export ZERO_KERNELS_CUDA_ARCH="${ZERO_KERNELS_CUDA_ARCH:-90}"
MAX_JOBS="${MAX_JOBS:-8}" "$py" setup.py build_ext --inplace >"$out/gpu_build.txt" 2>&1
section build
tail -n 30 "$out/gpu_build.txt"
"$py" -c "from zero_kernels import _C; assert _C.has_cuda(), 'built without CUDA kernels'; print('cuda kernels: yes')" ||
  { echo "!! no CUDA kernels: nothing else can run"; exit 1; }
"$py" -c "from zero_kernels import native; print('cuda images:', native.cuda_archs())"

if want tests; then
echo "== CUDA and Triton tests"
TRITON_INTERPRET=0 "$py" -m pytest -q -p no:cacheprovider tests/kernels/test_kernels_cuda.py tests/kernels/test_quant_cuda.py \
  tests/kernels/test_lowbit_cuda.py tests/kernels/test_lowbit_triton.py tests/precision/test_stochastic_round.py \
  tests/offload/test_offload_device.py tests/kernels/test_cuda_images.py 2>&1 | tee "$out/gpu_tests.txt" | tail -40
section "CUDA and Triton tests"
fi

if want bench; then
echo "== kernel benchmark (device copy bandwidth measured in the same run)"
"$py" bench/bench_adam.py --device cuda --sizes 1e7,1e8,5e8 --repeats 20 --no-deepspeed --out "$out" \
  2>&1 | tee "$out/gpu_bench.txt"
section "kernel benchmark"
fi

if want lowbit; then
echo "== low-bit-state step, 1e7 elements: bf16 / int8 moments (CUDA, Triton) vs the fp32 step"
"$py" - <<'EOF' 2>&1 | tee "$out/gpu_lowbit.txt"
import torch

from zero_kernels import ops
from zero_kernels.ops import lowbit
from zero_kernels.ops.hyper import AdamHyper

n, block, reps = 10_000_000, 256, 50
h = AdamHyper(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, step=10, adamw=True)
p, g = torch.randn(n, device="cuda"), torch.randn(n, device="cuda")


def per_step_ms(fn):
    for _ in range(5):  # Triton compiles on the first call
        fn()
    t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0.record()
    for _ in range(reps):
        fn()
    t1.record()
    t1.synchronize()
    return t0.elapsed_time(t1) / reps


def report(name, ms, bytes_per_param):
    print(f"{name:20s} {ms * 1e3:8.1f} us/step  {bytes_per_param * n / ms / 1e6:7.1f} GB/s")


m, v = torch.zeros(n, device="cuda"), torch.zeros(n, device="cuda")
report("fp32 state, cuda", per_step_ms(lambda: ops.adam_step(p, g, m, v, h, backend="cuda")), 28)
for fmt in ("bf16", "int8"):
    for backend in ("cuda", "triton"):
        s = lowbit.new_state(n, fmt, block, "cuda")
        ms = per_step_ms(
            lambda s=s, fmt=fmt, backend=backend: lowbit.adam_step_lowbit(
                p, g, s, h, state_dtype=fmt, block=block, backend=backend
            )
        )
        # p read + write, g read (fp32): 12 bytes; m and v read + write
        report(f"{fmt} state, {backend}", ms, 12 + 2 * lowbit.state_bytes_per_param(fmt, block))
EOF
section "low-bit-state step"
fi

if want zero; then
echo "== ZeroOptimizer stages 1-3, world size 1 on NCCL (no host sync inside clip + step)"
"$py" bench/gpu_zero_check.py --device cuda --out "$out" 2>&1 | tee "$out/gpu_zero_check.txt"
section "ZeroOptimizer stages 1-3"
fi

if want offload; then
echo "== the host tiers (offload_optimizer / offload_params='cpu'): against the state on the GPU, memory, time, FSDP2's CPU offload"
"$py" bench/gpu_offload_check.py --device cuda --out "$out" 2>&1 | tee "$out/gpu_offload_check.txt"
section "host tier"
fi

if want clip; then
echo "== torch's clip_grad_norm_ over ShardedGrads: one collective per call, world size 8 on the fake group, CUDA tensors, no host sync"
"$py" - cuda <<'EOF' 2>&1 | tee "$out/gpu_clip_collectives.txt"
# [Note: one collective per clip] in zero_kernels/partition/grads.py; the same check on the CPU:
# tests/stages/test_clip_norm.py::test_torch_clip_one_collective_at_world_8
import json
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.testing._internal.distributed.fake_pg import FakeStore

dev = sys.argv[1] if len(sys.argv) > 1 else "cuda"
dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
from zero_kernels import ZeroOptimizer  # noqa: E402

calls = []
for name in ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter",
             "reduce_scatter_tensor", "broadcast", "barrier"):
    def counted(*a, _f=getattr(dist, name), _n=name, **k):
        calls.append(_n)
        return _f(*a, **k)
    setattr(dist, name, counted)

out, bad = {}, []
for stage in (1, 2, 3):
    torch.manual_seed(0)
    m = nn.Sequential(*[nn.Linear(64, 64) for _ in range(26)]).to(dev)  # 52 params
    opt = ZeroOptimizer(m, torch.optim.AdamW, stage=stage, bucket_size_mb=0.01, lr=1e-3)
    for step in range(2):
        opt.zero_grad()
        m(torch.randn(8, 64, device=dev)).pow(2).mean().backward()
        for what, kw in (("p=2", {}), ("p=inf foreach", {"norm_type": float("inf"), "foreach": True})):
            calls.clear()
            if dev == "cuda" and step == 1:  # no host sync inside torch's clip (the 2nd step's)
                torch.cuda.synchronize()
                torch.cuda.set_sync_debug_mode("error")
            try:
                torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0, **kw)
            finally:
                if dev == "cuda":
                    torch.cuda.set_sync_debug_mode("default")
            key = f"stage {stage} step {step} torch clip {what}"
            out[key] = len(calls)
            if len(calls) != 1:
                bad.append(key)
        calls.clear()
        opt.clip_grad_norm_(1.0)
        out[f"stage {stage} step {step} opt.clip_grad_norm_"] = len(calls)
        opt.step()
    opt.close()
print(json.dumps(out, indent=1))
assert not bad, f"torch's clip_grad_norm_ issued more than one collective: {bad}"
print("collectives per torch clip at world size 8 (fake group): 1")
EOF
section "one collective per torch clip"
fi

if want fake8; then
echo "== world size 8 on the fake group, CUDA tensors: stage 3's reserved memory within its gather window; host syncs in clip + step (loss scaling, skip, GradScaler, int8 state)"
"$py" bench/gpu_fake8_check.py --device cuda --out "$out" 2>&1 | tee "$out/gpu_fake8_check.txt"
section "fake group, world size 8"
fi

if want device; then
echo "== the collectives' device and the held timing events (issue 51): a meta-built stage-3 model under init_process_group() without a backend; 100 steps at world size 8 on the fake group, CUDA tensors; python/train_example.py on the GPU"
# [Note: the collectives' device] in zero_kernels/comm/base.py (CPU: tests/comm/test_comm_device.py):
# a real group at world size 1 without a backend is torch's "cpu:gloo,cuda:nccl"
"$py" - <<'EOF' 2>&1 | tee "$out/gpu_device_choice.txt"
import json
import tempfile

import torch
import torch.distributed as dist
from torch import nn

torch.cuda.set_device(0)
dist.init_process_group(store=dist.FileStore(tempfile.mktemp(), 1), rank=0, world_size=1)
import zero_kernels  # noqa: E402
from zero_kernels import comm  # noqa: E402

with torch.device("meta"):
    m = nn.Sequential(*[nn.Linear(256, 256) for _ in range(4)])
opt = zero_kernels.ZeroOptimizer(m, torch.optim.AdamW, stage=3, lr=1e-3)
for _ in range(3):
    opt.zero_grad()
    m(torch.randn(8, 256, device="cuda")).pow(2).mean().backward()
    opt.step()
out = {
    "backend config": dist.get_backend_config(),
    "backends": comm.backends_of(),
    "optimizer device": str(opt.device),
    "param device": str(next(m.parameters()).device),
}
opt.close()
print(json.dumps(out, indent=1))
assert out["optimizer device"] == "cuda:0" and out["param device"] == "cuda:0", out
EOF
section "meta-built stage 3 without a backend"
# [Note: held timing events] in zero_kernels/comm/base.py (CPU: tests/comm/test_comm_timing.py)
"$py" - <<'EOF' 2>&1 | tee "$out/gpu_held_events.txt"
import json

import torch
import torch.distributed as dist
from torch import nn
from torch.testing._internal.distributed.fake_pg import FakeStore

torch.cuda.set_device(0)
dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
from zero_kernels import ZeroOptimizer  # noqa: E402
from zero_kernels.comm.base import TIMING_EVENTS_HELD  # noqa: E402

m = nn.Sequential(*[nn.Linear(256, 256) for _ in range(8)]).cuda()
opt = ZeroOptimizer(m, torch.optim.AdamW, stage=3, lr=1e-3, bucket_size_mb=0.1)
held = []
for step in range(100):
    opt.zero_grad()
    m(torch.randn(16, 256, device="cuda")).pow(2).mean().backward()
    opt.step()
    held.append(opt.comm_log.held_timing_events)
stats = opt.comm_stats
ledger = opt.comm_ledger
waits = stats["reduce_scatter_calls"] + stats["all_gather_calls"]
out = {
    "held after steps 1, 10, 100": [held[0], held[9], held[-1]],
    "most held": max(held),
    "collectives in 100 steps": waits,
    "untimed waits": stats["untimed_waits"],
    "exposed_comm_s": stats["exposed_comm_s"],
    "ledger entries": len(ledger),
    "held after reading": opt.comm_log.held_timing_events,
}
opt.close()
print(json.dumps(out, indent=1))
assert max(held) <= 2 * TIMING_EVENTS_HELD, out
assert held[-1] < waits, out  # folded as they complete: not every wait's pair held to the end
assert out["held after reading"] == 0 and len(ledger) == 100, out
EOF
section "held timing events bounded"
for stage in 0 3; do  # one GPU: one rank (LOCAL_RANK 0)
  "$py" -m torch.distributed.run --nproc-per-node 1 python/train_example.py --stage "$stage" --steps 10 \
    >"$out/gpu_train_example_$stage.txt" 2>&1
  rc=$?
  head -n 3 "$out/gpu_train_example_$stage.txt"
  (exit $rc) && grep -q "^device cuda:0, process group backend nccl" "$out/gpu_train_example_$stage.txt"
  section "train_example stage $stage on the GPU"
done
fi

if [[ ${#failed[@]} -gt 0 ]]; then
  printf '!! failed: %s\n' "${failed[@]}"
  exit 1
fi
echo "gpu_check: every section passed"
