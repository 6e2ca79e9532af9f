// CUDA launchers of blockwise quantize / dequantize, torch-free. Pointers in the buffers are
// device pointers; `stream` is a cudaStream_t passed as void*. Each returns a cudaError_t as int
// (0 = success; cuda_error_string in adam_cuda.h names it). Formulas: quant_math.h.
#pragma once
#include "quant_math.h"

namespace zk {

// q, scales and (b.error) the residuals of every block of b.
int quantize_cuda(const QuantBuffers& b, void* stream);

// out = q * scale (or out += q * scale with b.accumulate, fp32 out) for every element of b.
int dequantize_cuda(const DequantBuffers& b, void* stream);

}  // namespace zk
