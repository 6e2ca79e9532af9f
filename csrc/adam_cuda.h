// CUDA launchers of the fused Adam/AdamW step and the flat-buffer copy, torch-free.
// Pointers are device pointers; `stream` is a cudaStream_t passed as void*. Each launcher returns
// a cudaError_t as int (0 = success) so that the binding can raise with the CUDA message.
#pragma once
#include <cstdint>

#include "zk_types.h"

namespace zk {

constexpr int kMultiMaxTensors = 16;    // tensors per multi-tensor launch
constexpr int kMultiMaxBlocks = 320;    // blocks per multi-tensor launch
constexpr int64_t kMultiChunk = 65536;  // elements per block in a multi-tensor launch

// One step over one flat buffer. found_inf (device float[1], may be null when not needed) is
// read first: non-zero skips the step. With check_finite a scan of grad * scale runs before the
// update and sets *found_inf = 1 on a non-finite value; the update kernel then writes nothing.
int adam_step_cuda(const AdamArgs& args, const AdamBuffers& buf, float* found_inf,
                   bool check_finite, void* stream);

// The same over n separate buffers of one dtype combination, in as few launches as the
// kernel-argument limits allow (kMultiMaxTensors tensors, kMultiMaxBlocks blocks each).
int adam_step_multi_cuda(const AdamArgs& args, const AdamBuffers* bufs, int n, float* found_inf,
                         bool check_finite, void* stream);

// dst[i] = convert(src[i]) for i < n (fp32 / bf16 / fp16 either side).
int convert_copy_cuda(void* dst, DType dst_dtype, const void* src, DType src_dtype, int64_t n,
                      void* stream);

const char* cuda_error_string(int err);

}  // namespace zk
