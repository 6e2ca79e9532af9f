// CPU blockwise quantize / dequantize over a range of blocks, torch-free. The caller
// (bindings.cpp) splits the blocks across threads; each call is single-threaded. Formulas and
// buffers: quant_math.h.
#pragma once
#include <cstdint>

#include "adam_cpu.h"  // CpuIsa, cpu_isa_best
#include "quant_math.h"

namespace zk {

// Blocks [block_begin, block_end) of b: q, scales and (b.error) the residuals. Throws
// std::invalid_argument on bits, block or dtype outside what QuantBuffers documents.
void quantize_cpu(const QuantBuffers& b, int64_t block_begin, int64_t block_end, CpuIsa isa);

// Blocks [block_begin, block_end) of b: out (written or, with b.accumulate, added to).
void dequantize_cpu(const DequantBuffers& b, int64_t block_begin, int64_t block_end, CpuIsa isa);

// Per-ISA entry points (quant_cpu_{scalar,avx2,avx512}.cpp), arguments already checked.
void quantize_blocks_scalar(const QuantBuffers&, int64_t, int64_t);
void quantize_blocks_avx2(const QuantBuffers&, int64_t, int64_t);
void quantize_blocks_avx512(const QuantBuffers&, int64_t, int64_t);
void dequantize_blocks_scalar(const DequantBuffers&, int64_t, int64_t);
void dequantize_blocks_avx2(const DequantBuffers&, int64_t, int64_t);
void dequantize_blocks_avx512(const DequantBuffers&, int64_t, int64_t);

}  // namespace zk
