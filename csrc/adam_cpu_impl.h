// The CPU range loops, written once over a vector-traits type VT and included by each ISA's file
// after it has defined VT (adam_cpu_{scalar,avx2,avx512}.cpp). VT provides:
//   V (the adam_math vector type), W (lanes),
//   load(const float*), load_bf16(const uint16_t*), load_f16(const uint16_t*),
//   store(float*, V), store_bf16(uint16_t*, V), store_f16(uint16_t*, V),
//   finite_acc(V acc, V x) and all_zero(V acc) for the non-finite scan.
// Every dtype combination runs W lanes at a time; the tail runs the same math one lane at a time.
#pragma once
#include <stdexcept>

#include "adam_cpu.h"
#include "adam_math.h"
#include "cpu_vec.h"

namespace zk {
inline namespace ZK_ISA_NS {

// One-lane traits: the tail of every range, and the whole range on CPUs without AVX2.
struct ScalarTraits {
  using V = Scalar;
  static constexpr int W = 1;
  static V load(const float* p) { return Scalar(*p); }
  static V load_bf16(const uint16_t* p) { return Scalar(bf16_to_float(*p)); }
  static V load_f16(const uint16_t* p) { return Scalar(f16_to_float(*p)); }
  static void store(float* p, V v) { *p = v.x; }
  static void store_nt(float* p, V v) { *p = v.x; }  // one lane: a plain store
  static void store_bf16(uint16_t* p, V v) { *p = float_to_bf16(v.x); }
  static void store_f16(uint16_t* p, V v) { *p = float_to_f16(v.x); }
  static V finite_acc(V acc, V x) { return acc + (x - x); }
  static bool all_zero(V acc) { return acc.x == 0.0f; }
};

// Software prefetch prefetch_distance() elements ahead on every stream (0: none), a runtime
// setting read once per call (adam_cpu.h; default 512). The hardware prefetchers alone leave
// the step short of the bandwidth of the same access pattern without the math (the sqrt/div
// chain holds loads back; each core's outstanding misses bound its bandwidth): on the 2-core
// Xeon this was tuned on, ~84% of it, and 512 elements ahead (2 KB of fp32 per stream) ~100%;
// on the 2-core AMD EPYC 512 is also the fastest distance measured (bench/README.md, "The
// bandwidth floor"). A prefetch past the end of a buffer is harmless (no fault, no
// architectural effect).
template <DType D>
inline const char* elem_ptr(const void* base, int64_t i) {
  return static_cast<const char*>(base) + i * (D == DType::kF32 ? 4 : 2);
}

template <DType S, DType G>
inline void prefetch_at(const AdamBuffers& b, int64_t j) {
  __builtin_prefetch(elem_ptr<S>(b.p, j), 1, 3);
  __builtin_prefetch(elem_ptr<S>(b.m, j), 1, 3);
  __builtin_prefetch(elem_ptr<S>(b.v, j), 1, 3);
  __builtin_prefetch(elem_ptr<G>(b.g, j), 0, 3);
}

// Elements [i, end) with VT's lanes; returns where the full-width part stopped.
template <class VT, DType S, DType G, DType O>
int64_t adam_lanes(const AdamArgs& a, const AdamBuffers& b, int64_t i, int64_t end) {
  using V = typename VT::V;
  const int64_t pf = VT::W > 1 ? prefetch_distance() : 0;
  for (; i + VT::W <= end; i += VT::W) {
    if (pf > 0) prefetch_at<S, G>(b, i + pf);
    V p = vload<VT, S>(b.p, i), m = vload<VT, S>(b.m, i), v = vload<VT, S>(b.v, i);
    V vm = a.amsgrad ? vload<VT, S>(b.vmax, i) : V(0.0f);
    adam_math(a, p, vload<VT, G>(b.g, i), m, v, &vm);
    vstore<VT, S>(b.p, i, p);
    vstore<VT, S>(b.m, i, m);
    vstore<VT, S>(b.v, i, v);
    if (a.amsgrad) vstore<VT, S>(b.vmax, i, vm);
    if constexpr (O != DType::kNone) vstore<VT, O>(b.out, i, p);
  }
  return i;
}

template <class VT, DType S, DType G, DType O>
void adam_typed(const AdamArgs& a, const AdamBuffers& b, int64_t begin, int64_t end) {
  const int64_t i = adam_lanes<VT, S, G, O>(a, b, begin, end);
  adam_lanes<ScalarTraits, S, G, O>(a, b, i, end);
}

template <class VT, DType S, DType G>
void adam_by_out(const AdamArgs& a, const AdamBuffers& b, int64_t begin, int64_t end) {
  switch (b.out_dtype) {
    case DType::kNone: return adam_typed<VT, S, G, DType::kNone>(a, b, begin, end);
    case DType::kBF16: return adam_typed<VT, S, G, DType::kBF16>(a, b, begin, end);
    case DType::kF16: return adam_typed<VT, S, G, DType::kF16>(a, b, begin, end);
    default: throw std::invalid_argument("adam_step_cpu: out dtype must be none, bf16 or fp16");
  }
}

template <class VT, DType S>
void adam_by_grad(const AdamArgs& a, const AdamBuffers& b, int64_t begin, int64_t end) {
  switch (b.grad) {
    case DType::kF32: return adam_by_out<VT, S, DType::kF32>(a, b, begin, end);
    case DType::kBF16: return adam_by_out<VT, S, DType::kBF16>(a, b, begin, end);
    case DType::kF16: return adam_by_out<VT, S, DType::kF16>(a, b, begin, end);
    default: throw std::invalid_argument("adam_step_cpu: grad dtype must be fp32, bf16 or fp16");
  }
}

// The step over [begin, end) for any dtype combination.
template <class VT>
void adam_range(const AdamArgs& a, const AdamBuffers& b, int64_t begin, int64_t end) {
  switch (b.state) {
    case DType::kF32: return adam_by_grad<VT, DType::kF32>(a, b, begin, end);
    case DType::kBF16: return adam_by_grad<VT, DType::kBF16>(a, b, begin, end);
    case DType::kF16: return adam_by_grad<VT, DType::kF16>(a, b, begin, end);
    default: throw std::invalid_argument("adam_step_cpu: state dtype must be fp32, bf16 or fp16");
  }
}

template <class VT, DType G>
bool finite_typed(const void* g, float scale, int64_t begin, int64_t end) {
  using V = typename VT::V;
  V acc(0.0f);
  int64_t i = begin;
  for (; i + VT::W <= end; i += VT::W) acc = VT::finite_acc(acc, vload<VT, G>(g, i) * V(scale));
  bool ok = VT::all_zero(acc);
  for (; i < end; ++i) ok = ok && is_finite_f(vload<ScalarTraits, G>(g, i).x * scale);
  return ok;
}

// True when every g[i] * scale, i in [begin, end), is finite.
template <class VT>
bool finite_range(const void* g, DType dtype, float scale, int64_t begin, int64_t end) {
  switch (dtype) {
    case DType::kF32: return finite_typed<VT, DType::kF32>(g, scale, begin, end);
    case DType::kBF16: return finite_typed<VT, DType::kBF16>(g, scale, begin, end);
    case DType::kF16: return finite_typed<VT, DType::kF16>(g, scale, begin, end);
    default: throw std::invalid_argument("all_finite_cpu: dtype must be fp32, bf16 or fp16");
  }
}

// The optimizer step's memory traffic with no math: p += g, m += g, v += g (read 4 streams,
// write 3 in place, 28 bytes per element). Benchmarks time it as the bandwidth floor of the step.
template <class VT>
void stream_probe_range(float* p, const float* g, float* m, float* v, int64_t begin, int64_t end) {
  using V = typename VT::V;
  int64_t i = begin;
  for (; i + VT::W <= end; i += VT::W) {
    const V gi = VT::load(g + i);
    VT::store(p + i, VT::load(p + i) + gi);
    VT::store(m + i, VT::load(m + i) + gi);
    VT::store(v + i, VT::load(v + i) + gi);
  }
  for (; i < end; ++i) {
    p[i] += g[i];
    m[i] += g[i];
    v[i] += g[i];
  }
}

}  // namespace ZK_ISA_NS
}  // namespace zk
