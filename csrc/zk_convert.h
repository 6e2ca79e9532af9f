// Bit-exact fp32 <-> bf16 / fp16 conversions and typed loads/stores, usable on host and device.
// Inline functions live in an ISA-specific inline namespace: each CPU kernel file compiled for
// another instruction set gets its own copies, so the linker cannot hand AVX-512 code to the
// scalar path.
#pragma once
#include "zk_types.h"

#ifndef ZK_ISA_NS
#define ZK_ISA_NS generic
#endif

namespace zk {
inline namespace ZK_ISA_NS {

// ---- bit-exact scalar conversions, usable on host and device ----
ZK_HD float bits_to_float(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  union {
    uint32_t u;
    float f;
  } x{u};
  return x.f;
#endif
}
ZK_HD uint32_t float_to_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  union {
    float f;
    uint32_t u;
  } x{f};
  return x.u;
#endif
}
ZK_HD float bf16_to_float(uint16_t h) { return bits_to_float(static_cast<uint32_t>(h) << 16); }
// Round to nearest even; NaN stays a (quiet) NaN.
ZK_HD uint16_t float_to_bf16(float f) {
  uint32_t u = float_to_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}
ZK_HD float f16_to_float(uint16_t h) {
  uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t man = h & 0x3ffu;
  if (exp == 0x1fu) return bits_to_float(sign | 0x7f800000u | (man << 13));  // inf / nan
  if (exp == 0) {
    if (man == 0) return bits_to_float(sign);
    // subnormal: value = man * 2^-24
    float v = static_cast<float>(man) * 5.9604644775390625e-8f;
    return sign ? -v : v;
  }
  return bits_to_float(sign | ((exp + 112u) << 23) | (man << 13));
}
// Round to nearest even, overflow to inf, subnormals handled.
ZK_HD uint16_t float_to_f16(float f) {
  uint32_t u = float_to_bits(f);
  uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u);   // nan
  if (a >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // >= 65520 rounds to inf
  if (a < 0x38800000u) {  // below 2^-14: subnormal or zero
    // value / 2^-24, rounded to nearest even
    float v = bits_to_float(a) * 16777216.0f;  // exact (power-of-two scaling)
    uint32_t q = static_cast<uint32_t>(v);
    float rem = v - static_cast<float>(q);
    if (rem > 0.5f || (rem == 0.5f && (q & 1u))) ++q;
    return static_cast<uint16_t>(sign | q);
  }
  uint32_t r = a + 0xfffu + ((a >> 13) & 1u);
  return static_cast<uint16_t>(sign | ((r - (112u << 23)) >> 13));
}

template <DType D>
struct Storage;
template <>
struct Storage<DType::kF32> {
  using T = float;
  static ZK_HD float load(const T* p, int64_t i) { return p[i]; }
  static ZK_HD void store(T* p, int64_t i, float x) { p[i] = x; }
};
template <>
struct Storage<DType::kBF16> {
  using T = uint16_t;
  static ZK_HD float load(const T* p, int64_t i) { return bf16_to_float(p[i]); }
  static ZK_HD void store(T* p, int64_t i, float x) { p[i] = float_to_bf16(x); }
};
template <>
struct Storage<DType::kF16> {
  using T = uint16_t;
  static ZK_HD float load(const T* p, int64_t i) { return f16_to_float(p[i]); }
  static ZK_HD void store(T* p, int64_t i, float x) { p[i] = float_to_f16(x); }
};

}  // namespace ZK_ISA_NS
}  // namespace zk
