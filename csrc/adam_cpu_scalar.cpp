// Scalar CPU path (CPUs without AVX2) and the ISA dispatch of the CPU step.
#include <atomic>
#if defined(__x86_64__)
#include <cpuid.h>
#endif
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

// The software prefetch distance of the step loops, per CPU family, as measured side by side
// (bench/README.md, "The bandwidth floor" and "Prefetch distance per CPU"): 512 elements was
// tuned on the 2-core Xeon (~84% -> ~100% of the probe) and measured fastest on the AMD EPYC
// Zen 5 (family 0x1a); on the AMD EPYC Zen 4 (family 0x19) 512 ran 0.76-0.94x torch's fused
// step from DRAM and 64-128 at 0.92-1.14x, so AMD family 0x19 takes 128. Every distance gives
// bitwise the same results; `set_prefetch_distance` overrides the default.
namespace {
int amd_family() {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (__get_cpuid(0, &a, &b, &c, &d) == 0) return -1;
  const bool amd = b == 0x68747541u && d == 0x69746e65u && c == 0x444d4163u;  // "AuthenticAMD"
  if (!amd || __get_cpuid(1, &a, &b, &c, &d) == 0) return -1;
  const unsigned base = (a >> 8) & 0xfu;
  return int(base == 0xfu ? base + ((a >> 20) & 0xffu) : base);
#else
  return -1;
#endif
}
}  // namespace

int64_t default_prefetch_distance() {
  static const int64_t d = amd_family() == 0x19 ? 128 : 512;
  return d;
}

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
