// Scalar CPU path (CPUs without AVX2) and the ISA dispatch of the CPU step.
#include <atomic>
#include <cstdlib>
#include <stdexcept>

#include "adam_cpu.h"
#include "adam_cpu_impl.h"
#include "adam_lowbit_impl.h"
#include "stream_probe_impl.h"

namespace zk {

void adam_range_scalar(const AdamArgs& a, const AdamBuffers& b, int64_t begin, int64_t end) {
  adam_range<ScalarTraits>(a, b, begin, end);
}

void stream_probe_scalar(float* p, const float* g, float* m, float* v, int64_t b, int64_t e) {
  stream_probe_range<ScalarTraits>(p, g, m, v, b, e);
}
void probe_variant_scalar(const ProbeBuffers& b, int64_t begin, int64_t end) {
  probe_range<ScalarTraits>(b, begin, end);
}
bool finite_range_scalar(const void* g, DType d, float scale, int64_t begin, int64_t end) {
  return finite_range<ScalarTraits>(g, d, scale, begin, end);
}

void adam_lowbit_range_scalar(const AdamArgs& a, const AdamLowbitBuffers& b, int64_t b0,
                              int64_t b1) {
  lowbit_range<ScalarLowbit>(a, b, b0, b1);
}

void adam_lowbit_cpu(const AdamArgs& a, const AdamLowbitBuffers& b, int64_t b0, int64_t b1,
                     int isa) {
  if (b.block <= 0 || b.block > kMaxLowbitBlock || b0 < 0 || b0 > b1 || b1 > lowbit_num_blocks(b) ||
      (b.starts != nullptr && b.fmt != MomentFormat::kInt8)) {
    throw std::out_of_range("adam_lowbit_cpu: block range outside the buffer");
  }
#if defined(__x86_64__)
  if (isa == int(CpuIsa::kAVX512)) return adam_lowbit_range_avx512(a, b, b0, b1);
  if (isa == int(CpuIsa::kAVX2)) return adam_lowbit_range_avx2(a, b, b0, b1);
#endif
  adam_lowbit_range_scalar(a, b, b0, b1);
}

// The software prefetch distance of the step loops. 512 elements was tuned on the 2-core Xeon
// (~84% -> ~100% of the probe); on the 2-core AMD EPYC (Zen 5) a sweep of 0/256/512/1024/2048
// measured 512 fastest too, 0 (hardware prefetch alone) 8-68% slower (bench/README.md, "The
// bandwidth floor"), so one default serves both vendors.
int64_t default_prefetch_distance() { return 512; }

namespace {
std::atomic<int64_t> g_prefetch{default_prefetch_distance()};
}  // namespace

int64_t prefetch_distance() { return g_prefetch.load(std::memory_order_relaxed); }

void set_prefetch_distance(int64_t elems) {
  if (elems < 0) throw std::invalid_argument("set_prefetch_distance: elems must be >= 0");
  g_prefetch.store(elems, std::memory_order_relaxed);
}

CpuIsa cpu_isa_best() {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl")) {
    return CpuIsa::kAVX512;
  }
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return CpuIsa::kAVX2;
#endif
  return CpuIsa::kScalar;
}

const char* cpu_isa_name(CpuIsa isa) {
  switch (isa) {
    case CpuIsa::kAVX512: return "avx512";
    case CpuIsa::kAVX2: return "avx2";
    default: return "scalar";
  }
}

void adam_step_cpu(const AdamArgs& a, const AdamBuffers& b, int64_t begin, int64_t end,
                   CpuIsa isa) {
  if (begin < 0 || end > b.n || begin > end) {
    throw std::out_of_range("adam_step_cpu: range outside the buffer");
  }
#if defined(__x86_64__)
  if (isa == CpuIsa::kAVX512) return adam_range_avx512(a, b, begin, end);
  if (isa == CpuIsa::kAVX2) return adam_range_avx2(a, b, begin, end);
#endif
  adam_range_scalar(a, b, begin, end);
}

void stream_probe_cpu(float* p, const float* g, float* m, float* v, int64_t begin, int64_t end,
                      CpuIsa isa) {
#if defined(__x86_64__)
  if (isa == CpuIsa::kAVX512) return stream_probe_avx512(p, g, m, v, begin, end);
  if (isa == CpuIsa::kAVX2) return stream_probe_avx2(p, g, m, v, begin, end);
#endif
  stream_probe_scalar(p, g, m, v, begin, end);
}

void stream_probe_variant_cpu(const ProbeBuffers& b, int64_t begin, int64_t end, CpuIsa isa) {
#if defined(__x86_64__)
  if (isa == CpuIsa::kAVX512) return probe_variant_avx512(b, begin, end);
  if (isa == CpuIsa::kAVX2) return probe_variant_avx2(b, begin, end);
#endif
  probe_variant_scalar(b, begin, end);
}

bool all_finite_cpu(const void* grad, DType dtype, float scale, int64_t begin, int64_t end,
                    CpuIsa isa) {
#if defined(__x86_64__)
  if (isa == CpuIsa::kAVX512) return finite_range_avx512(grad, dtype, scale, begin, end);
  if (isa == CpuIsa::kAVX2) return finite_range_avx2(grad, dtype, scale, begin, end);
#endif
  return finite_range_scalar(grad, dtype, scale, begin, end);
}

}  // namespace zk
