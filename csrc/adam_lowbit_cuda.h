// CUDA launcher of the Adam/AdamW step with low-bit moments (bf16, or blockwise int8 with a
// square-law map; zero_kernels/ops/lowbit.py [Note: low-bit state]), torch-free. Pointers in the
// buffers are device pointers; `stream` is a cudaStream_t passed as void*. Returns a cudaError_t
// as int (0 = success; cuda_error_string in adam_cuda.h names it).
#pragma once
#include "adam_lowbit.h"

namespace zk {

// One step over one tensor. found_inf (device float[1], may be null when not needed) is read
// first: non-zero skips the step. With check_finite a scan of grad * scale runs before the update
// and sets *found_inf = 1 on a non-finite value; the update kernel then writes nothing. Every
// kernel runs on `stream`; nothing waits on the host.
int adam_lowbit_cuda(const AdamArgs& a, const AdamLowbitBuffers& b, float* found_inf,
                     bool check_finite, void* stream);

}  // namespace zk
