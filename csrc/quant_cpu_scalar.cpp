// Scalar CPU path of blockwise quantization (CPUs without AVX2) and its ISA dispatch.
// No fused multiply-add anywhere in the quantization files: quant_math.h's formulas are rounded
// once per operation on every backend (the vector files set the same option).
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("fp-contract=off")
#elif defined(__clang__)
#pragma clang fp contract(off)
#endif
#include <stdexcept>
#include <string>

#include "quant_cpu.h"
#include "quant_cpu_impl.h"

namespace zk {
namespace {

struct ScalarQuant {
  static constexpr int W = 0;  // every element through quant_math.h
};

void check_layout(const char* fn, int64_t n, int64_t block, int bits) {
  if (bits != 8 && bits != 4) {
    throw std::invalid_argument(std::string(fn) + ": bits must be 4 or 8, got " +
                                std::to_string(bits));
  }
  if (block <= 0 || (bits == 4 && block % 2 != 0)) {
    throw std::invalid_argument(std::string(fn) + ": block must be > 0 (and even for int4), got " +
                                std::to_string(block));
  }
  if (n < 0) throw std::invalid_argument(std::string(fn) + ": n must be >= 0");
}

void check_range(const char* fn, int64_t b0, int64_t b1, int64_t n, int64_t block) {
  if (b0 < 0 || b0 > b1 || b1 > quant_num_blocks(n, block)) {
    throw std::out_of_range(std::string(fn) + ": block range outside the buffer");
  }
}

}  // namespace

void quantize_blocks_scalar(const QuantBuffers& b, int64_t b0, int64_t b1) {
  quantize_blocks<ScalarQuant>(b, b0, b1);
}
void dequantize_blocks_scalar(const DequantBuffers& b, int64_t b0, int64_t b1) {
  dequantize_blocks<ScalarQuant>(b, b0, b1);
}

void quantize_cpu(const QuantBuffers& b, int64_t b0, int64_t b1, CpuIsa isa) {
  check_layout("quantize_cpu", b.n, b.block, b.bits);
  check_range("quantize_cpu", b0, b1, b.n, b.block);
#if defined(__x86_64__)
  if (isa == CpuIsa::kAVX512) return quantize_blocks_avx512(b, b0, b1);
  if (isa == CpuIsa::kAVX2) return quantize_blocks_avx2(b, b0, b1);
#endif
  quantize_blocks_scalar(b, b0, b1);
}

void dequantize_cpu(const DequantBuffers& b, int64_t b0, int64_t b1, CpuIsa isa) {
  check_layout("dequantize_cpu", b.n, b.block, b.bits);
  check_range("dequantize_cpu", b0, b1, b.n, b.block);
  if (b.accumulate && b.out_dtype != DType::kF32) {
    throw std::invalid_argument("dequantize_cpu: accumulate needs an fp32 out");
  }
#if defined(__x86_64__)
  if (isa == CpuIsa::kAVX512) return dequantize_blocks_avx512(b, b0, b1);
  if (isa == CpuIsa::kAVX2) return dequantize_blocks_avx2(b, b0, b1);
#endif
  dequantize_blocks_scalar(b, b0, b1);
}

}  // namespace zk
