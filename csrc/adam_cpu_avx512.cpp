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
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"  // false positives on _mm512_undefined_*
#pragma GCC diagnostic ignored "-Wuninitialized"
#define ZK_ISA_NS avx512
#include "adam_cpu.h"
#include "adam_cpu_impl.h"
#include "adam_lowbit_impl.h"
#include "cpu_vec_avx512.h"
#include "stream_probe_impl.h"

namespace zk {
inline namespace avx512 {

// Low-bit moments on 16 lanes (adam_lowbit_impl.h); the same fp32 operations as ScalarLowbit.
struct Avx512Lowbit : Avx512Traits {
  static V dec_m(const int8_t* q, float s) {
    const __m512 f = _mm512_cvtepi32_ps(
        _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q))));
    return _mm512_mul_ps(_mm512_mul_ps(f, _mm512_abs_ps(f)), _mm512_set1_ps(s));
  }
  static V dec_u(const uint8_t* q, float s) {
    const __m512 f = _mm512_cvtepi32_ps(
        _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q))));
    return _mm512_mul_ps(_mm512_mul_ps(f, f), _mm512_set1_ps(s));
  }
  static __m512 rne(__m512 t) {
    return _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  }
  static void enc_m(int8_t* q, const float* x, float inv) {
    const __m512 y = _mm512_loadu_ps(x);
    __m512 t = _mm512_sqrt_ps(_mm512_mul_ps(_mm512_abs_ps(y), _mm512_set1_ps(inv)));
    t = rne(_mm512_min_ps(t, _mm512_set1_ps(kMCodes)));
    const __m512i sign =
        _mm512_and_si512(_mm512_castps_si512(y), _mm512_set1_epi32(int(0x80000000u)));
    const __m512 r = _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(t), sign));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(r)));
  }
  static void enc_u(uint8_t* q, const float* x, float inv) {
    const __m512 y = _mm512_loadu_ps(x);
    __m512 t = _mm512_sqrt_ps(_mm512_mul_ps(y, _mm512_set1_ps(inv)));
    t = rne(_mm512_min_ps(t, _mm512_set1_ps(kVCodes)));
    const __mmask16 pos = _mm512_cmp_ps_mask(y, _mm512_setzero_ps(), _CMP_GT_OQ);
    t = _mm512_mask_max_ps(t, pos, t, _mm512_set1_ps(1.0f));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(t)));
  }
  static V vabs(V x) { return _mm512_abs_ps(x.x); }
  static V vmaxf(V a, V b) { return _mm512_max_ps(a.x, b.x); }
  static float hmax(V x) { return _mm512_reduce_max_ps(x.x); }
};

}  // namespace avx512

void adam_lowbit_range_avx512(const AdamArgs& a, const AdamLowbitBuffers& b, int64_t b0,
                              int64_t b1) {
  lowbit_range<Avx512Lowbit>(a, b, b0, b1);
}
void adam_range_avx512(const AdamArgs& a, const AdamBuffers& b, int64_t begin, int64_t end) {
  adam_range<Avx512Traits>(a, b, begin, end);
}
void stream_probe_avx512(float* p, const float* g, float* m, float* v, int64_t b, int64_t e) {
  stream_probe_range<Avx512Traits>(p, g, m, v, b, e);
}
void probe_variant_avx512(const ProbeBuffers& b, int64_t begin, int64_t end) {
  probe_range<Avx512Traits>(b, begin, end);
}
bool finite_range_avx512(const void* g, DType d, float scale, int64_t begin, int64_t end) {
  return finite_range<Avx512Traits>(g, d, scale, begin, end);
}

}  // namespace zk

#if defined(__clang__)
#pragma clang attribute pop
#endif
#endif  // __x86_64__
