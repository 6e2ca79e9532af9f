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
#include "cpu_vec_avx512.h"

namespace zk {

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
