// Blockwise symmetric int8/int4 quantization: the buffers of one call and the per-block and
// per-element formulas, written once for the CPU paths (the scalar path and the vector paths'
// tails and non-finite blocks) and the CUDA kernels. Byte format and non-finite rules:
// zero_kernels/ops/quant.py [Note: quantized bytes].
//
// Per block of `block` elements (the last one may be shorter), qmax = 127 (int8) or 7 (int4):
//   y      = x (+ error)                          fp32 add (error feedback)
//   absmax = max |y|                               as bits: any NaN above +inf above finite
//   scale  = absmax / qmax                         fp32 division, correctly rounded
//   inv    = min(qmax / absmax, FLT_MAX)           (absmax = 0: FLT_MAX, so 0 * inv = 0)
//   q      = rne(clamp(y * inv, -qmax, qmax))      round to nearest, ties to even
//   error  = y - q * scale                         two roundings, never an fma
//   deq    = q * scale,  accumulate: out + q * scale
// Every backend performs exactly these fp32 operations, so q, scales, error and deq agree bit
// for bit. No a * b + c here may become an fma: the CPU files compile with fp-contract off and
// the CUDA kernels use the _rn intrinsics, which nvcc never contracts.
#pragma once
#include "zk_convert.h"

namespace zk {

// One quantize call over n elements: x -> q (packed) and scales, the residual updated in place.
struct QuantBuffers {
  const void* x;  // n elements of x_dtype
  DType x_dtype;  // fp32, bf16 or fp16
  float* error;   // n fp32 residuals (error feedback), or nullptr
  uint8_t* q;     // n bytes (int8) or (n + 1) / 2 bytes (int4)
  float* scales;  // ceil(n / block) fp32 scales
  int64_t n;
  int64_t block;  // elements per block, > 0, even for int4
  int bits;       // 8 or 4
};

// One dequantize call: out[i] = q[i] * scales[i / block] (accumulate: out[i] += ...).
struct DequantBuffers {
  const uint8_t* q;
  const float* scales;
  void* out;        // n elements of out_dtype (fp32 when accumulating)
  DType out_dtype;  // fp32, bf16 or fp16
  bool accumulate;
  int64_t n;
  int64_t block;
  int bits;
};

constexpr uint32_t kAbsMask = 0x7fffffffu;
constexpr uint32_t kInfBits = 0x7f800000u;
constexpr uint32_t kQuietNaNBits = 0x7fc00000u;  // the one NaN a scale holds
constexpr uint32_t kFltMaxBits = 0x7f7fffffu;

inline int64_t quant_num_blocks(int64_t n, int64_t block) { return (n + block - 1) / block; }
inline int64_t quant_packed_bytes(int64_t n, int bits) { return bits == 8 ? n : (n + 1) / 2; }

inline namespace ZK_ISA_NS {

// fp32 operations rounded once each (on the device the _rn intrinsics, never fused).
ZK_HD float q_add(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}
ZK_HD float q_sub(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fsub_rn(a, b);
#else
  return a - b;
#endif
}
ZK_HD float q_mul(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}
ZK_HD float q_div(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}

// Round to nearest, ties to even, for |t| <= 2^22 (t is clamped to [-127, 127] first): adding
// and subtracting 1.5 * 2^23 leaves no fraction bits (default rounding mode).
ZK_HD int q_rne(float t) {
#if defined(__CUDA_ARCH__)
  return __float2int_rn(t);
#else
  const float magic = 12582912.0f;
  return static_cast<int>(q_sub(q_add(t, magic), magic));
#endif
}

// |y| as bits: as unsigned integers they order like |y|, and every NaN lies above +inf.
ZK_HD uint32_t abs_bits(float y) { return float_to_bits(y) & kAbsMask; }

struct BlockScale {
  float scale;  // what the scales tensor holds: absmax / qmax, +inf, or NaN
  float inv;    // min(qmax / absmax, FLT_MAX); unused when !finite
  bool finite;  // false: the block holds a NaN (scale NaN) or an inf (scale +inf)
  bool has_nan;
};

ZK_HD BlockScale block_scale(uint32_t absmax_bits, float qmax) {
  BlockScale s{};
  if (absmax_bits >= kInfBits) {
    s.has_nan = absmax_bits > kInfBits;
    s.scale = bits_to_float(s.has_nan ? kQuietNaNBits : kInfBits);
    s.inv = 0.0f;
    s.finite = false;
    return s;
  }
  const float absmax = bits_to_float(absmax_bits);
  const float flt_max = bits_to_float(kFltMaxBits);
  const float inv = q_div(qmax, absmax);  // +inf when absmax is 0 or tiny
  s.scale = q_div(absmax, qmax);
  s.inv = inv < flt_max ? inv : flt_max;
  s.finite = true;
  s.has_nan = false;
  return s;
}

// q of one element of a finite block.
ZK_HD int quant_finite(float y, float inv, float qmax) {
  float t = q_mul(y, inv);
  t = t < -qmax ? -qmax : t;
  t = t > qmax ? qmax : t;
  return q_rne(t);
}

// q of one element of a non-finite block: +-qmax where y is +-inf in an inf block, else 0.
ZK_HD int quant_nonfinite(float y, const BlockScale& s, int qmax) {
  if (s.has_nan) return 0;
  const uint32_t u = float_to_bits(y);
  if (u == kInfBits) return qmax;
  if (u == (kInfBits | 0x80000000u)) return -qmax;
  return 0;
}

template <DType D, bool E>
ZK_HD float quant_load_y(const QuantBuffers& b, int64_t i) {
  float y = Storage<D>::load(static_cast<const typename Storage<D>::T*>(b.x), i);
  if constexpr (E) y = q_add(y, b.error[i]);
  return y;
}

// Element i: its q, and (E) its new residual: y - q * scale, or 0 in a non-finite block (a NaN
// residual would poison every later step; the step that saw the overflow is skipped anyway).
template <DType D, bool E, int BITS>
ZK_HD int quant_element(const QuantBuffers& b, int64_t i, const BlockScale& s) {
  constexpr int qmax = BITS == 8 ? 127 : 7;
  const float y = quant_load_y<D, E>(b, i);
  const int q = s.finite ? quant_finite(y, s.inv, float(qmax)) : quant_nonfinite(y, s, qmax);
  if constexpr (E) b.error[i] = s.finite ? q_sub(y, q_mul(float(q), s.scale)) : 0.0f;
  return q;
}

// int4: element 2k in bits 0-3 of byte k, element 2k+1 in bits 4-7, two's complement nibbles.
ZK_HD uint8_t pack_int4(int lo, int hi) {
  return static_cast<uint8_t>((lo & 0xf) | ((hi & 0xf) << 4));
}

template <int BITS>
ZK_HD int quant_get(const uint8_t* q, int64_t i) {
  if constexpr (BITS == 8) {
    return static_cast<int8_t>(q[i]);
  } else {
    const int nib = (q[i >> 1] >> ((i & 1) * 4)) & 0xf;
    return (nib ^ 8) - 8;  // sign-extend 4 bits
  }
}

}  // namespace ZK_ISA_NS
}  // namespace zk
