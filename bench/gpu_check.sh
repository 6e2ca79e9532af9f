#!/usr/bin/env bash
# One command for a machine with an NVIDIA GPU: build zero_kernels with CUDA (sm_80 + sm_90 by
# default), run the CUDA and Triton tests (the low-bit-state step's among them), then the kernel
# benchmark against torch's fused AdamW with the device's copy bandwidth measured in the same run,
# a timing of the low-bit-state step (bf16 / int8 moments; CUDA, Triton), then ZeroOptimizer
# stages 1-3 at world size 1 on NCCL (bench/gpu_zero_check.py: results vs torch, no host sync
# inside clip + step), then the host tier (bench/gpu_offload_check.py: offload_optimizer="cpu"
# against the state on the GPU, device memory, step time beside FSDP2's CPU offload). Uses the
# torch already installed (it never installs one). Meant to finish in under 8 minutes on an
# H100/H200 (5.5 measured on an H200 with 16 cores, 2026-12-04).
#
#   bash bench/gpu_check.sh [OUT_DIR]       # results in OUT_DIR (default bench/results)
#   ONLY="tests offload" bash bench/gpu_check.sh OUT   # some sections only (a rerun after a fix;
#       the build always runs, quickly where build/ survived): tests bench lowbit zero offload
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
only="${ONLY:-tests bench lowbit zero offload fake8}"
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

if want tests; then
echo "== CUDA and Triton tests"
TRITON_INTERPRET=0 "$py" -m pytest -q -p no:cacheprovider tests/test_kernels_cuda.py tests/test_quant_cuda.py \
  tests/test_lowbit_cuda.py tests/test_lowbit_triton.py tests/test_stochastic_round.py 2>&1 | tee "$out/gpu_tests.txt" | tail -40
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

if want fake8; then
echo "== world size 8 on the fake group, CUDA tensors: stage 3's reserved memory within its gather window; host syncs in clip + step (loss scaling, skip, GradScaler, int8 state)"
"$py" bench/gpu_fake8_check.py --device cuda --out "$out" 2>&1 | tee "$out/gpu_fake8_check.txt"
section "fake group, world size 8"
fi

if [[ ${#failed[@]} -gt 0 ]]; then
  printf '!! failed: %s\n' "${failed[@]}"
  exit 1
fi
echo "gpu_check: every section passed"
