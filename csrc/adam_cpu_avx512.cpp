// AVX-512 path of the fp32 CPU step (16 lanes). Compiled for AVX-512 by the pragma below and
// only called when cpuid reports avx512f/bw/vl (adam_cpu_scalar.cpp: cpu_isa_best).
#include <cstdint>
#if defined(__x86_64__)
#include <immintrin.h>

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512vl,fma,f16c"))), \
                             apply_to = function)
#else
#pragma GCC target("avx512f,avx512bw,avx512vl,fma,f16c")
#endif
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"  // false positive on _mm512_undefined_*
#define ZK_ISA_NS avx512
#include "adam_cpu.h"
#include "adam_cpu_impl.h"

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

void adam_range_avx512(const AdamArgs& a, const AdamBuffers& b, int64_t begin, int64_t end) {
  adam_range<Avx512Traits>(a, b, begin, end);
}
void stream_probe_avx512(float* p, const float* g, float* m, float* v, int64_t b, int64_t e) {
  stream_probe_range<Avx512Traits>(p, g, m, v, b, e);
}
bool finite_range_avx512(const void* g, DType d, float scale, int64_t begin, int64_t end) {
  return finite_range<Avx512Traits>(g, d, scale, begin, end);
}

}  // namespace zk

#if defined(__clang__)
#pragma clang attribute pop
#endif
#endif  // __x86_64__
