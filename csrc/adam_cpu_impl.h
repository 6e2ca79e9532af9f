// The range loop of the fp32 CPU step, written once over a vector-traits type VT and included by
// each ISA's file after it has defined VT. VT provides: V (the adam_math vector type), W (lanes),
// load(const float*), store(float*, V), store_bf16(uint16_t*, V), store_f16(uint16_t*, V),
// finite_acc(V acc, V x) and all_zero(V acc) for the non-finite scan.
#pragma once
#include <stdexcept>

#include "adam_math.h"

namespace zk {
inline namespace ZK_ISA_NS {

inline void adam_f32_tail(const AdamArgs& a, const AdamBuffers& b, int64_t i, int64_t end) {
  float* p = static_cast<float*>(b.p);
  const float* g = static_cast<const float*>(b.g);
  float* m = static_cast<float*>(b.m);
  float* v = static_cast<float*>(b.v);
  float* vmax = static_cast<float*>(b.vmax);
  for (; i < end; ++i) {
    Scalar pp(p[i]), mm(m[i]), vv(v[i]), vm(a.amsgrad ? vmax[i] : 0.0f);
    adam_math(a, pp, Scalar(g[i]), mm, vv, &vm);
    p[i] = pp.x;
    m[i] = mm.x;
    v[i] = vv.x;
    if (a.amsgrad) vmax[i] = vm.x;
    if (b.out_dtype == DType::kBF16) {
      static_cast<uint16_t*>(b.out)[i] = float_to_bf16(pp.x);
    } else if (b.out_dtype == DType::kF16) {
      static_cast<uint16_t*>(b.out)[i] = float_to_f16(pp.x);
    }
  }
}

template <class VT>
void adam_f32_range(const AdamArgs& a, const AdamBuffers& b, int64_t begin, int64_t end) {
  using V = typename VT::V;
  constexpr int W = VT::W;
  float* p = static_cast<float*>(b.p);
  const float* g = static_cast<const float*>(b.g);
  float* m = static_cast<float*>(b.m);
  float* v = static_cast<float*>(b.v);
  float* vmax = static_cast<float*>(b.vmax);
  uint16_t* out = static_cast<uint16_t*>(b.out);
  int64_t i = begin;
  for (; i + W <= end; i += W) {
    V pp = VT::load(p + i), mm = VT::load(m + i), vv = VT::load(v + i);
    V vm = a.amsgrad ? VT::load(vmax + i) : V(0.0f);
    adam_math(a, pp, VT::load(g + i), mm, vv, &vm);
    VT::store(p + i, pp);
    VT::store(m + i, mm);
    VT::store(v + i, vv);
    if (a.amsgrad) VT::store(vmax + i, vm);
    if (b.out_dtype == DType::kBF16) {
      VT::store_bf16(out + i, pp);
    } else if (b.out_dtype == DType::kF16) {
      VT::store_f16(out + i, pp);
    }
  }
  adam_f32_tail(a, b, i, end);
}

template <class VT>
bool finite_f32_range(const float* g, float scale, int64_t begin, int64_t end) {
  using V = typename VT::V;
  constexpr int W = VT::W;
  V acc(0.0f);
  int64_t i = begin;
  for (; i + W <= end; i += W) acc = VT::finite_acc(acc, VT::load(g + i) * V(scale));
  bool ok = VT::all_zero(acc);
  for (; i < end; ++i) ok = ok && is_finite_f(g[i] * scale);
  return ok;
}

template <DType S, DType G, DType O>
void mixed_range_impl(const AdamArgs& a, const AdamBuffers& b, int64_t begin, int64_t end) {
  using ST = typename Storage<S>::T;
  using GT = typename Storage<G>::T;
  ST* p = static_cast<ST*>(b.p);
  const GT* g = static_cast<const GT*>(b.g);
  ST* m = static_cast<ST*>(b.m);
  ST* v = static_cast<ST*>(b.v);
  ST* vmax = static_cast<ST*>(b.vmax);
  for (int64_t i = begin; i < end; ++i) {
    Scalar pp(Storage<S>::load(p, i)), mm(Storage<S>::load(m, i)), vv(Storage<S>::load(v, i));
    Scalar vm(a.amsgrad ? Storage<S>::load(vmax, i) : 0.0f);
    adam_math(a, pp, Scalar(Storage<G>::load(g, i)), mm, vv, &vm);
    Storage<S>::store(p, i, pp.x);
    Storage<S>::store(m, i, mm.x);
    Storage<S>::store(v, i, vv.x);
    if (a.amsgrad) Storage<S>::store(vmax, i, vm.x);
    if constexpr (O != DType::kNone) {
      Storage<O>::store(static_cast<typename Storage<O>::T*>(b.out), i, pp.x);
    }
  }
}

template <DType S, DType G>
void mixed_out_impl(const AdamArgs& a, const AdamBuffers& b, int64_t begin, int64_t end) {
  switch (b.out_dtype) {
    case DType::kNone: return mixed_range_impl<S, G, DType::kNone>(a, b, begin, end);
    case DType::kBF16: return mixed_range_impl<S, G, DType::kBF16>(a, b, begin, end);
    case DType::kF16: return mixed_range_impl<S, G, DType::kF16>(a, b, begin, end);
    default: throw std::invalid_argument("adam_step_cpu: out dtype must be none, bf16 or fp16");
  }
}

template <DType S>
void mixed_grad_impl(const AdamArgs& a, const AdamBuffers& b, int64_t begin, int64_t end) {
  switch (b.grad) {
    case DType::kF32: return mixed_out_impl<S, DType::kF32>(a, b, begin, end);
    case DType::kBF16: return mixed_out_impl<S, DType::kBF16>(a, b, begin, end);
    case DType::kF16: return mixed_out_impl<S, DType::kF16>(a, b, begin, end);
    default: throw std::invalid_argument("adam_step_cpu: grad dtype must be fp32, bf16 or fp16");
  }
}

// Any dtype combination, element by element (the compiler vectorises it for the ISA it is
// compiled for).
inline void adam_mixed_range(const AdamArgs& a, const AdamBuffers& b, int64_t begin, int64_t end) {
  switch (b.state) {
    case DType::kF32: return mixed_grad_impl<DType::kF32>(a, b, begin, end);
    case DType::kBF16: return mixed_grad_impl<DType::kBF16>(a, b, begin, end);
    case DType::kF16: return mixed_grad_impl<DType::kF16>(a, b, begin, end);
    default: throw std::invalid_argument("adam_step_cpu: state dtype must be fp32, bf16 or fp16");
  }
}

}  // namespace ZK_ISA_NS
}  // namespace zk
