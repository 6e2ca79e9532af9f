// Scalar CPU path: any dtype combination (fp32 / bf16 / fp16 state, grad and copy-out), the
// fallback for CPUs without AVX2, and the ISA dispatch.
#include <cstdlib>
#include <stdexcept>

#include "adam_cpu.h"
#include "adam_cpu_impl.h"

namespace zk {

namespace {

template <DType G>
bool finite_typed(const void* grad, float scale, int64_t begin, int64_t end) {
  using GT = typename Storage<G>::T;
  const GT* g = static_cast<const GT*>(grad);
  bool ok = true;
  for (int64_t i = begin; i < end; ++i) ok &= is_finite_f(Storage<G>::load(g, i) * scale);
  return ok;
}

}  // namespace

void adam_mixed_scalar(const AdamArgs& a, const AdamBuffers& b, int64_t begin, int64_t end) {
  adam_mixed_range(a, b, begin, end);
}

void adam_f32_scalar(const AdamArgs& a, const AdamBuffers& b, int64_t begin, int64_t end) {
  adam_f32_tail(a, b, begin, end);
}

bool finite_f32_scalar(const float* g, float scale, int64_t begin, int64_t end) {
  return finite_typed<DType::kF32>(g, scale, begin, end);
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
  if (b.state != DType::kF32 || b.grad != DType::kF32) {
#if defined(__x86_64__)
    if (isa == CpuIsa::kAVX512) return adam_mixed_avx512(a, b, begin, end);
    if (isa == CpuIsa::kAVX2) return adam_mixed_avx2(a, b, begin, end);
#endif
    return adam_mixed_scalar(a, b, begin, end);
  }
#if defined(__x86_64__)
  if (isa == CpuIsa::kAVX512) return adam_f32_avx512(a, b, begin, end);
  if (isa == CpuIsa::kAVX2) return adam_f32_avx2(a, b, begin, end);
#endif
  adam_f32_scalar(a, b, begin, end);
}

bool all_finite_cpu(const void* grad, DType dtype, float scale, int64_t begin, int64_t end,
                    CpuIsa isa) {
  switch (dtype) {
    case DType::kF32:
#if defined(__x86_64__)
      if (isa == CpuIsa::kAVX512)
        return finite_f32_avx512(static_cast<const float*>(grad), scale, begin, end);
      if (isa == CpuIsa::kAVX2)
        return finite_f32_avx2(static_cast<const float*>(grad), scale, begin, end);
#endif
      return finite_f32_scalar(static_cast<const float*>(grad), scale, begin, end);
    case DType::kBF16: return finite_typed<DType::kBF16>(grad, scale, begin, end);
    case DType::kF16: return finite_typed<DType::kF16>(grad, scale, begin, end);
    default: throw std::invalid_argument("all_finite_cpu: dtype must be fp32, bf16 or fp16");
  }
}

}  // namespace zk
