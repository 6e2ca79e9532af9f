// The AVX-512 F/BW/VL vector type (16 fp32 lanes) and its traits, shared by the Adam and the
// quantization kernels.
// Include only from a file compiled for this instruction set (its target pragma in effect) with
// ZK_ISA_NS defined as avx512.
#pragma once
#include <immintrin.h>

#include <cstdint>

namespace zk {
inline namespace avx512 {

struct V16 {
  __m512 x;
  V16(float f) : x(_mm512_set1_ps(f)) {}
  V16(__m512 v) : x(v) {}
};
inline V16 operator+(V16 a, V16 b) { return _mm512_add_ps(a.x, b.x); }
inline V16 operator-(V16 a, V16 b) { return _mm512_sub_ps(a.x, b.x); }
inline V16 operator*(V16 a, V16 b) { return _mm512_mul_ps(a.x, b.x); }
inline V16 operator/(V16 a, V16 b) { return _mm512_div_ps(a.x, b.x); }
inline V16 fma(V16 a, V16 b, V16 c) { return _mm512_fmadd_ps(a.x, b.x, c.x); }
inline V16 vsqrt(V16 a) { return _mm512_sqrt_ps(a.x); }
inline V16 vmax_of(V16 a, V16 b) {  // NaN from either side wins, like torch.maximum
  __m512 r = _mm512_max_ps(a.x, b.x);
  r = _mm512_mask_mov_ps(r, _mm512_cmp_ps_mask(b.x, b.x, _CMP_UNORD_Q), b.x);
  return _mm512_mask_mov_ps(r, _mm512_cmp_ps_mask(a.x, a.x, _CMP_UNORD_Q), a.x);
}

struct Avx512Traits {
  using V = V16;
  static constexpr int W = 16;
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static V load_bf16(const uint16_t* p) {
    __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
  static V load_f16(const uint16_t* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static void store(float* p, V v) { _mm512_storeu_ps(p, v.x); }
  static void store_nt(float* p, V v) { _mm512_stream_ps(p, v.x); }  // p 64-byte aligned
  static void store_bf16(uint16_t* p, V v) {
    __m512i u = _mm512_castps_si512(v.x);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(
        _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
    __m512i qnan = _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
    r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v.x, v.x, _CMP_UNORD_Q), qnan);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(r));
  }
  static void store_f16(uint16_t* p, V v) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                        _mm512_cvtps_ph(v.x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  static V finite_acc(V acc, V x) { return acc + (x - x); }
  static bool all_zero(V acc) {
    return _mm512_cmp_ps_mask(acc.x, _mm512_setzero_ps(), _CMP_EQ_OQ) == 0xffff;
  }
};

}  // namespace avx512
}  // namespace zk
