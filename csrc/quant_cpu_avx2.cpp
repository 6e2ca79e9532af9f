// AVX2 path of blockwise quantization (8 lanes). Compiled for AVX2 by the pragma below and only
// called when cpuid reports avx2 and fma (adam_cpu_scalar.cpp: cpu_isa_best). fp-contract is off:
// y * inv, q * scale and the adds after them are rounded one by one, as quant_math.h says.
#include <cstdint>
#if defined(__x86_64__)
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c"))), apply_to = function)
#pragma clang fp contract(off)
#else
#pragma GCC target("avx2,fma,f16c")
#pragma GCC optimize("fp-contract=off")
#endif
#include <immintrin.h>

#include <cstring>
#define ZK_ISA_NS avx2
#include "cpu_vec.h"
#include "cpu_vec_avx2.h"
#include "quant_cpu.h"
#include "quant_cpu_impl.h"

namespace zk {
inline namespace avx2 {

struct Avx2Quant {
  static constexpr int W = 8;
  using Acc = __m256i;

  template <DType D, bool E>
  static __m256 load_y(const QuantBuffers& b, int64_t i) {
    __m256 y = vload<Avx2Traits, D>(b.x, i).x;
    if constexpr (E) y = _mm256_add_ps(y, _mm256_loadu_ps(b.error + i));
    return y;
  }

  static Acc acc_zero() { return _mm256_setzero_si256(); }
  // abs bits are <= 0x7fffffff, so the signed max is the unsigned one
  static uint32_t acc_max(Acc a) {
    __m128i m = _mm_max_epi32(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1));
    m = _mm_max_epi32(m, _mm_shuffle_epi32(m, _MM_SHUFFLE(1, 0, 3, 2)));
    m = _mm_max_epi32(m, _mm_shuffle_epi32(m, _MM_SHUFFLE(2, 3, 0, 1)));
    return static_cast<uint32_t>(_mm_cvtsi128_si32(m));
  }

  template <DType D, bool E>
  static Acc absmax(Acc acc, const QuantBuffers& b, int64_t i) {
    const __m256i bits = _mm256_castps_si256(load_y<D, E>(b, i));
    return _mm256_max_epi32(acc, _mm256_and_si256(bits, _mm256_set1_epi32(int(kAbsMask))));
  }

  template <DType D, bool E, int BITS>
  static void quant(const QuantBuffers& b, int64_t i, const BlockScale& s) {
    constexpr float qmax = BITS == 8 ? 127.0f : 7.0f;
    const __m256 y = load_y<D, E>(b, i);
    __m256 t = _mm256_mul_ps(y, _mm256_set1_ps(s.inv));
    t = _mm256_min_ps(_mm256_max_ps(t, _mm256_set1_ps(-qmax)), _mm256_set1_ps(qmax));
    const __m256i qi =
        _mm256_cvttps_epi32(_mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    if constexpr (E) {
      const __m256 deq = _mm256_mul_ps(_mm256_cvtepi32_ps(qi), _mm256_set1_ps(s.scale));
      _mm256_storeu_ps(b.error + i, _mm256_sub_ps(y, deq));
    }
    if constexpr (BITS == 8) {
      // 8 x int32 -> 8 x int16 -> 8 bytes (in range, so the saturating packs are exact)
      const __m128i w =
          _mm_packs_epi32(_mm256_castsi256_si128(qi), _mm256_extracti128_si256(qi, 1));
      _mm_storel_epi64(reinterpret_cast<__m128i*>(b.q + i), _mm_packs_epi16(w, w));
    } else {
      // nibbles; the low byte of each 64-bit lane becomes even | odd << 4, then 4 bytes gathered
      const __m256i nib = _mm256_and_si256(qi, _mm256_set1_epi32(0xf));
      const __m256i pair = _mm256_or_si256(nib, _mm256_srli_epi64(nib, 28));
      const __m256i pick =
          _mm256_setr_epi8(0, 8, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, 0, 8, -1,
                           -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1);
      const __m256i g = _mm256_shuffle_epi8(pair, pick);
      const __m128i four =
          _mm_unpacklo_epi16(_mm256_castsi256_si128(g), _mm256_extracti128_si256(g, 1));
      const int32_t word = _mm_cvtsi128_si32(four);
      std::memcpy(b.q + (i >> 1), &word, 4);
    }
  }

  template <int BITS>
  static __m256i load_q(const uint8_t* q, int64_t i) {
    if constexpr (BITS == 8) {
      return _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + i)));
    } else {
      int32_t word;
      std::memcpy(&word, q + (i >> 1), 4);
      const __m256i w = _mm256_cvtepu8_epi64(_mm_cvtsi32_si128(word));  // byte k in lane k
      const __m256i lo = _mm256_and_si256(w, _mm256_set1_epi64x(0xf));
      const __m256i hi =
          _mm256_slli_epi64(_mm256_and_si256(_mm256_srli_epi64(w, 4), _mm256_set1_epi64x(0xf)), 32);
      return _mm256_srai_epi32(_mm256_slli_epi32(_mm256_or_si256(lo, hi), 28), 28);
    }
  }

  template <DType O, int BITS, bool ACC>
  static void dequant(const DequantBuffers& b, int64_t i, float scale) {
    __m256 v = _mm256_mul_ps(_mm256_cvtepi32_ps(load_q<BITS>(b.q, i)), _mm256_set1_ps(scale));
    if constexpr (ACC) v = _mm256_add_ps(_mm256_loadu_ps(static_cast<const float*>(b.out) + i), v);
    vstore<Avx2Traits, O>(b.out, i, V8(v));
  }
};

}  // namespace avx2

void quantize_blocks_avx2(const QuantBuffers& b, int64_t b0, int64_t b1) {
  quantize_blocks<Avx2Quant>(b, b0, b1);
}
void dequantize_blocks_avx2(const DequantBuffers& b, int64_t b0, int64_t b1) {
  dequantize_blocks<Avx2Quant>(b, b0, b1);
}

}  // namespace zk

#if defined(__clang__)
#pragma clang attribute pop
#endif
#endif  // __x86_64__
