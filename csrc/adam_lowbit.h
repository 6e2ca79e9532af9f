// Adam/AdamW with low-bit moments (bf16, or blockwise int8 with a square-law map) over a fp32
// master, torch-free: the buffers of one call and the per-element formulas, shared by the CPU
// paths and the CUDA kernel. Format, maps and rounding rules: zero_kernels/ops/lowbit.py
// [Note: low-bit state]. The update is adam_math.h's (which returns u = sqrt(v)), on the fp32 m and
// v of this step.
#pragma once
#include <cmath>
#include <cstdint>

#include "adam_math.h"
#include "quant_math.h"  // q_rne: the codes round as the quantizer's do
#include "zk_convert.h"

namespace zk {

enum class MomentFormat : int { kBF16 = 1, kInt8 = 2 };

// One contiguous tensor of n elements: p fp32, g of `grad`, out (optional) of `out_dtype`.
// kBF16: m, v are uint16 bf16 bits. kInt8: m int8, v uint8, one fp32 scale per `block`.
struct AdamLowbitBuffers {
  float* p;
  const void* g;
  void* m;
  void* v;
  float* m_scale;  // kInt8: ceil(n / block) scales of m, else nullptr
  float* v_scale;  // kInt8: one scale of u = sqrt(v) per block, else nullptr
  void* out;       // nullptr when no low-precision copy-out
  int64_t n;
  int64_t block;  // elements per block (kInt8: a multiple of 64, at most kMaxLowbitBlock)
  // kInt8, optional: block k covers [starts[k], starts[k + 1]) (nblocks + 1 ascending entries,
  // starts[0] = 0, starts[nblocks] = n, each block at most `block` long): the blocks of a sharded
  // step follow its pieces. nullptr: block k covers [k * block, min((k + 1) * block, n)).
  const int64_t* starts;
  int64_t nblocks;
  DType grad;
  DType out_dtype;
  MomentFormat fmt;
};

constexpr int64_t kMaxLowbitBlock = 4096;
constexpr float kMCodes = 127.0f;
constexpr float kVCodes = 255.0f;

inline namespace ZK_ISA_NS {

// The block's scale and encode factor from its max (finite blocks): s = A / c^2 and
// inv = min(c^2 / A, FLT_MAX) (A = 0 gives inv = FLT_MAX, and every element is 0).
struct LowbitScale {
  float scale;
  float inv;
};
ZK_HD LowbitScale lowbit_scale(float amax, float codes, bool finite) {
  LowbitScale s{};
  if (!finite) {
    s.scale = bits_to_float(0x7fc00000u);
    s.inv = 0.0f;
    return s;
  }
  const float c2 = codes * codes;  // exact
  s.scale = amax / c2;
  const float inv = c2 / amax;
  const float flt_max = bits_to_float(0x7f7fffffu);
  s.inv = inv < flt_max ? inv : flt_max;
  return s;
}

// Codes of one element (scalar formulas; the vector paths compute the same operations).
ZK_HD int encode_m(float m, float inv) {
  float t = vsqrt(Scalar(fabsf(m) * inv)).x;
  t = t < kMCodes ? t : kMCodes;
  const int q = q_rne(t);
  return m < 0.0f ? -q : q;
}
ZK_HD int encode_u(float u, float inv) {
  float t = vsqrt(Scalar(u * inv)).x;
  t = t < kVCodes ? t : kVCodes;
  int q = q_rne(t);
  return (q == 0 && u > 0.0f) ? 1 : q;
}
ZK_HD float decode_m(int q, float s) { return (float(q) * float(q < 0 ? -q : q)) * s; }
ZK_HD float decode_u(int q, float s) { return (float(q) * float(q)) * s; }

}  // namespace ZK_ISA_NS

// (`starts` is a host pointer for the CPU kernels and a device pointer for the CUDA kernel.)
ZK_HD int64_t lowbit_num_blocks(const AdamLowbitBuffers& b) {
  return b.starts != nullptr ? b.nblocks : (b.n + b.block - 1) / b.block;
}
ZK_HD int64_t lowbit_block_begin(const AdamLowbitBuffers& b, int64_t k) {
  return b.starts != nullptr ? b.starts[k] : k * b.block;
}
ZK_HD int64_t lowbit_block_end(const AdamLowbitBuffers& b, int64_t k) {
  if (b.starts != nullptr) return b.starts[k + 1];
  const int64_t e = (k + 1) * b.block;
  return e < b.n ? e : b.n;
}

// CPU: blocks [b0, b1) of one tensor (kBF16: `block`-element chunks), single-threaded.
void adam_lowbit_cpu(const AdamArgs& a, const AdamLowbitBuffers& b, int64_t b0, int64_t b1,
                     int isa);
void adam_lowbit_range_scalar(const AdamArgs&, const AdamLowbitBuffers&, int64_t, int64_t);
void adam_lowbit_range_avx2(const AdamArgs&, const AdamLowbitBuffers&, int64_t, int64_t);
void adam_lowbit_range_avx512(const AdamArgs&, const AdamLowbitBuffers&, int64_t, int64_t);

}  // namespace zk
