// The AVX2 + FMA + F16C vector type (8 fp32 lanes) and its traits, shared by the Adam and the
// quantization kernels.
// Include only from a file compiled for this instruction set (its target pragma in effect) with
// ZK_ISA_NS defined as avx2.
#pragma once
#include <immintrin.h>

#include <cstdint>

namespace zk {
inline namespace avx2 {

struct V8 {
  __m256 x;
  V8(float f) : x(_mm256_set1_ps(f)) {}
  V8(__m256 v) : x(v) {}
};
inline V8 operator+(V8 a, V8 b) { return _mm256_add_ps(a.x, b.x); }
inline V8 operator-(V8 a, V8 b) { return _mm256_sub_ps(a.x, b.x); }
inline V8 operator*(V8 a, V8 b) { return _mm256_mul_ps(a.x, b.x); }
inline V8 operator/(V8 a, V8 b) { return _mm256_div_ps(a.x, b.x); }
inline V8 fma(V8 a, V8 b, V8 c) { return _mm256_fmadd_ps(a.x, b.x, c.x); }
inline V8 vsqrt(V8 a) { return _mm256_sqrt_ps(a.x); }
inline V8 vmax_of(V8 a, V8 b) {  // NaN from either side wins, like torch.maximum
  __m256 r = _mm256_max_ps(a.x, b.x);
  r = _mm256_blendv_ps(r, b.x, _mm256_cmp_ps(b.x, b.x, _CMP_UNORD_Q));
  return _mm256_blendv_ps(r, a.x, _mm256_cmp_ps(a.x, a.x, _CMP_UNORD_Q));
}

struct Avx2Traits {
  using V = V8;
  static constexpr int W = 8;
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static V load_bf16(const uint16_t* p) {
    __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
  static V load_f16(const uint16_t* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static void store(float* p, V v) { _mm256_storeu_ps(p, v.x); }
  static void store_nt(float* p, V v) { _mm256_stream_ps(p, v.x); }  // p 32-byte aligned
  static void store_bf16(uint16_t* p, V v) {
    __m256i u = _mm256_castps_si256(v.x);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(
        _mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
    __m256i qnan = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
    __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v.x, v.x, _CMP_UNORD_Q));
    r = _mm256_blendv_epi8(r, qnan, nan);
    // pack 8 x u32 (each <= 0xffff) to 8 x u16: packus works per 128-bit lane, then fix order
    __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
  }
  static void store_f16(uint16_t* p, V v) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                     _mm256_cvtps_ph(v.x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  static V finite_acc(V acc, V x) { return acc + (x - x); }
  static bool all_zero(V acc) {
    return _mm256_movemask_ps(_mm256_cmp_ps(acc.x, _mm256_setzero_ps(), _CMP_EQ_OQ)) == 0xff;
  }
};

}  // namespace avx2
}  // namespace zk
