// AVX-512 path of blockwise quantization (16 lanes). Compiled for AVX-512 by the pragma below and
// only called when cpuid reports avx512f/bw/vl (adam_cpu_scalar.cpp: cpu_isa_best). fp-contract
// is off: y * inv, q * scale and the adds after them are rounded one by one (quant_math.h).
#include <cstdint>
#if defined(__x86_64__)
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512vl,fma,f16c"))), \
                             apply_to = function)
#pragma clang fp contract(off)
#else
#pragma GCC target("avx512f,avx512bw,avx512vl,fma,f16c")
#pragma GCC optimize("fp-contract=off")
#endif
// false positives on _mm512_undefined_* / _mm256_undefined_* inside GCC's own intrinsics
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#include <immintrin.h>

#define ZK_ISA_NS avx512
#include "cpu_vec.h"
#include "cpu_vec_avx512.h"
#include "quant_cpu.h"
#include "quant_cpu_impl.h"

namespace zk {
inline namespace avx512 {

struct Avx512Quant {
  static constexpr int W = 16;
  using Acc = __m512i;

  template <DType D, bool E>
  static __m512 load_y(const QuantBuffers& b, int64_t i) {
    __m512 y = vload<Avx512Traits, D>(b.x, i).x;
    if constexpr (E) y = _mm512_add_ps(y, _mm512_loadu_ps(b.error + i));
    return y;
  }

  static Acc acc_zero() { return _mm512_setzero_si512(); }
  // abs bits are <= 0x7fffffff, so the signed max is the unsigned one
  static uint32_t acc_max(Acc a) { return static_cast<uint32_t>(_mm512_reduce_max_epi32(a)); }

  template <DType D, bool E>
  static Acc absmax(Acc acc, const QuantBuffers& b, int64_t i) {
    const __m512i bits = _mm512_castps_si512(load_y<D, E>(b, i));
    return _mm512_max_epi32(acc, _mm512_and_si512(bits, _mm512_set1_epi32(int(kAbsMask))));
  }

  template <DType D, bool E, int BITS>
  static void quant(const QuantBuffers& b, int64_t i, const BlockScale& s) {
    constexpr float qmax = BITS == 8 ? 127.0f : 7.0f;
    const __m512 y = load_y<D, E>(b, i);
    __m512 t = _mm512_mul_ps(y, _mm512_set1_ps(s.inv));
    t = _mm512_min_ps(_mm512_max_ps(t, _mm512_set1_ps(-qmax)), _mm512_set1_ps(qmax));
    const __m512i qi =
        _mm512_cvttps_epi32(_mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    if constexpr (E) {
      const __m512 deq = _mm512_mul_ps(_mm512_cvtepi32_ps(qi), _mm512_set1_ps(s.scale));
      _mm512_storeu_ps(b.error + i, _mm512_sub_ps(y, deq));
    }
    if constexpr (BITS == 8) {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(b.q + i), _mm512_cvtepi32_epi8(qi));
    } else {
      // the low byte of each 64-bit lane becomes even | odd << 4; vpmovqb keeps those 8 bytes
      const __m512i nib = _mm512_and_si512(qi, _mm512_set1_epi32(0xf));
      const __m512i pair = _mm512_or_si512(nib, _mm512_srli_epi64(nib, 28));
      _mm_storel_epi64(reinterpret_cast<__m128i*>(b.q + (i >> 1)), _mm512_cvtepi64_epi8(pair));
    }
  }

  template <int BITS>
  static __m512i load_q(const uint8_t* q, int64_t i) {
    if constexpr (BITS == 8) {
      return _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + i)));
    } else {
      const __m512i w = _mm512_cvtepu8_epi64(
          _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + (i >> 1))));  // byte k in lane k
      const __m512i lo = _mm512_and_si512(w, _mm512_set1_epi64(0xf));
      const __m512i hi =
          _mm512_slli_epi64(_mm512_and_si512(_mm512_srli_epi64(w, 4), _mm512_set1_epi64(0xf)), 32);
      return _mm512_srai_epi32(_mm512_slli_epi32(_mm512_or_si512(lo, hi), 28), 28);
    }
  }

  template <DType O, int BITS, bool ACC>
  static void dequant(const DequantBuffers& b, int64_t i, float scale) {
    __m512 v = _mm512_mul_ps(_mm512_cvtepi32_ps(load_q<BITS>(b.q, i)), _mm512_set1_ps(scale));
    if constexpr (ACC) v = _mm512_add_ps(_mm512_loadu_ps(static_cast<const float*>(b.out) + i), v);
    vstore<Avx512Traits, O>(b.out, i, V16(v));
  }
};

}  // namespace avx512

void quantize_blocks_avx512(const QuantBuffers& b, int64_t b0, int64_t b1) {
  quantize_blocks<Avx512Quant>(b, b0, b1);
}
void dequantize_blocks_avx512(const DequantBuffers& b, int64_t b0, int64_t b1) {
  dequantize_blocks<Avx512Quant>(b, b0, b1);
}

}  // namespace zk

#if defined(__clang__)
#pragma clang attribute pop
#endif
#endif  // __x86_64__
