// AVX2 + FMA path of the fp32 CPU step (8 lanes). Compiled for AVX2 by the pragma below and
// only called when cpuid reports avx2 and fma (adam_cpu_scalar.cpp: cpu_isa_best).
#include <cstdint>
#if defined(__x86_64__)
#include <immintrin.h>

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c"))), apply_to = function)
#else
#pragma GCC target("avx2,fma,f16c")
#endif
#define ZK_ISA_NS avx2
#include "adam_cpu.h"
#include "adam_cpu_impl.h"
#include "adam_lowbit_impl.h"
#include "cpu_vec_avx2.h"
#include "stream_probe_impl.h"

namespace zk {
inline namespace avx2 {

// Low-bit moments on 8 lanes (adam_lowbit_impl.h); the same fp32 operations as ScalarLowbit.
struct Avx2Lowbit : Avx2Traits {
  static __m256 absv(__m256 x) {
    return _mm256_and_ps(x, _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff)));
  }
  static V dec_m(const int8_t* q, float s) {
    const __m256 f = _mm256_cvtepi32_ps(
        _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q))));
    return _mm256_mul_ps(_mm256_mul_ps(f, absv(f)), _mm256_set1_ps(s));
  }
  static V dec_u(const uint8_t* q, float s) {
    const __m256 f = _mm256_cvtepi32_ps(
        _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q))));
    return _mm256_mul_ps(_mm256_mul_ps(f, f), _mm256_set1_ps(s));
  }
  static __m128i narrow(__m256 r) {  // 8 integral floats in [-255, 255] -> 8 x i16
    const __m256i i = _mm256_cvtps_epi32(r);
    return _mm_packs_epi32(_mm256_castsi256_si128(i), _mm256_extracti128_si256(i, 1));
  }
  static __m256 rne(__m256 t) {
    return _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  }
  static void enc_m(int8_t* q, const float* x, float inv) {
    const __m256 y = _mm256_loadu_ps(x);
    __m256 t = _mm256_sqrt_ps(_mm256_mul_ps(absv(y), _mm256_set1_ps(inv)));
    t = rne(_mm256_min_ps(t, _mm256_set1_ps(kMCodes)));
    const __m256 sign = _mm256_and_ps(y, _mm256_castsi256_ps(_mm256_set1_epi32(int(0x80000000u))));
    const __m128i w = narrow(_mm256_or_ps(t, sign));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(q), _mm_packs_epi16(w, w));
  }
  static void enc_u(uint8_t* q, const float* x, float inv) {
    const __m256 y = _mm256_loadu_ps(x);
    __m256 t = _mm256_sqrt_ps(_mm256_mul_ps(y, _mm256_set1_ps(inv)));
    t = rne(_mm256_min_ps(t, _mm256_set1_ps(kVCodes)));
    const __m256 pos = _mm256_cmp_ps(y, _mm256_setzero_ps(), _CMP_GT_OQ);
    t = _mm256_max_ps(t, _mm256_and_ps(pos, _mm256_set1_ps(1.0f)));
    const __m128i w = narrow(t);
    _mm_storel_epi64(reinterpret_cast<__m128i*>(q), _mm_packus_epi16(w, w));
  }
  static V vabs(V x) { return absv(x.x); }
  static V vmaxf(V a, V b) { return _mm256_max_ps(a.x, b.x); }
  static float hmax(V x) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(x.x), _mm256_extractf128_ps(x.x, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
    return _mm_cvtss_f32(m);
  }
};

}  // namespace avx2

void adam_lowbit_range_avx2(const AdamArgs& a, const AdamLowbitBuffers& b, int64_t b0, int64_t b1) {
  lowbit_range<Avx2Lowbit>(a, b, b0, b1);
}
void adam_range_avx2(const AdamArgs& a, const AdamBuffers& b, int64_t begin, int64_t end) {
  adam_range<Avx2Traits>(a, b, begin, end);
}
void stream_probe_avx2(float* p, const float* g, float* m, float* v, int64_t b, int64_t e) {
  stream_probe_range<Avx2Traits>(p, g, m, v, b, e);
}
void probe_variant_avx2(const ProbeBuffers& b, int64_t begin, int64_t end) {
  probe_range<Avx2Traits>(b, begin, end);
}
bool finite_range_avx2(const void* g, DType d, float scale, int64_t begin, int64_t end) {
  return finite_range<Avx2Traits>(g, d, scale, begin, end);
}

}  // namespace zk

#if defined(__clang__)
#pragma clang attribute pop
#endif
#endif  // __x86_64__
