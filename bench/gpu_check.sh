#!/usr/bin/env bash
# One command for a machine with an NVIDIA GPU: build zero_kernels with CUDA (sm_80 + sm_90 by
# default), run the CUDA and Triton tests, then the kernel benchmark against torch's fused AdamW
# with the device's copy bandwidth measured in the same run, then ZeroOptimizer stages 1-3 at
# world size 1 on NCCL (bench/gpu_zero_check.py: results vs torch, no host sync inside clip +
# step). Uses the torch already installed (it never installs one). Meant to finish in under 8 minutes on an H100/H200.
#
#   bash bench/gpu_check.sh [OUT_DIR]       # results in OUT_DIR (default bench/results)
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-bench/results}"
mkdir -p "$out"
py="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1
"$py" -c "import torch; assert torch.cuda.is_available(), 'no GPU visible to torch'; \
print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true

echo "== build (in place, with CUDA)"
export ZERO_KERNELS_CUDA_ARCH="${ZERO_KERNELS_CUDA_ARCH:-90}"
MAX_JOBS="${MAX_JOBS:-8}" "$py" setup.py build_ext --inplace 2>&1 | tail -3
"$py" -c "from zero_kernels import _C; assert _C.has_cuda(), 'built without CUDA kernels'; print('cuda kernels: yes')"

echo "== CUDA and Triton tests"
TRITON_INTERPRET=0 "$py" -m pytest -q -p no:cacheprovider tests/test_kernels_cuda.py tests/test_quant_cuda.py 2>&1 | tee "$out/gpu_tests.txt" | tail -5

echo "== kernel benchmark (device copy bandwidth measured in the same run)"
"$py" bench/bench_adam.py --device cuda --sizes 1e7,1e8,5e8 --repeats 20 --no-deepspeed --out "$out" \
  2>&1 | tee "$out/gpu_bench.txt"

echo "== ZeroOptimizer stages 1-3, world size 1 on NCCL (no host sync inside clip + step)"
"$py" bench/gpu_zero_check.py --device cuda --out "$out" 2>&1 | tee "$out/gpu_zero_check.txt"
