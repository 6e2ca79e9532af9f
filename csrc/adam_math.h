// The one Adam/AdamW math routine, written once over a "vector" type V so that the scalar
// CPU path, the AVX2 and AVX-512 paths and the CUDA kernel all run the same sequence of
// operations. V needs: V(float) broadcast, + - * /, fma(a, b, c) = a*b + c, sqrt, max, neg.
//
// Per element (fp32):
//   g  = grad * grad_scale;  g = -g if maximize
//   p  = p * (1 - lr*wd)            (AdamW)      |  g = g + wd*p   (Adam, L2)
//   m  = beta1*m + (1-beta1)*g
//   v  = beta2*v + (1-beta2)*g*g
//   vm = max(vm, v)                 (amsgrad)
//   p  = p - step_size * m / (sqrt(vm or v) * inv_bc2_sqrt + eps)
// Returns sqrt(vm or v), which the low-bit state stores (adam_lowbit.h: u = sqrt(v)).
#pragma once
#include "zk_convert.h"

namespace zk {
inline namespace ZK_ISA_NS {

template <typename V>
ZK_HD V adam_math(const AdamArgs& a, V& p, V g, V& m, V& v, V* vmax) {
  g = g * V(a.grad_scale);
  if (a.maximize) g = V(0.0f) - g;
  if (a.weight_decay != 0.0f) {
    if (a.adamw) {
      p = p * V(a.decay);
    } else {
      g = fma(p, V(a.weight_decay), g);
    }
  }
  m = fma(m, V(a.beta1), g * V(a.one_minus_beta1));
  v = fma(v, V(a.beta2), (g * g) * V(a.one_minus_beta2));
  V src = v;
  if (a.amsgrad) {
    *vmax = vmax_of(*vmax, v);
    src = *vmax;
  }
  const V root = vsqrt(src);
  V denom = fma(root, V(a.inv_bc2_sqrt), V(a.eps));
  p = p - V(a.step_size) * (m / denom);
  return root;
}

// Scalar "vector": plain float.
struct Scalar {
  float x;
  ZK_HD Scalar(float f) : x(f) {}
  ZK_HD Scalar() : x(0.0f) {}
};
ZK_HD Scalar operator+(Scalar a, Scalar b) { return Scalar(a.x + b.x); }
ZK_HD Scalar operator-(Scalar a, Scalar b) { return Scalar(a.x - b.x); }
ZK_HD Scalar operator*(Scalar a, Scalar b) { return Scalar(a.x * b.x); }
ZK_HD Scalar operator/(Scalar a, Scalar b) { return Scalar(a.x / b.x); }
#if defined(__CUDA_ARCH__)
ZK_HD Scalar fma(Scalar a, Scalar b, Scalar c) { return Scalar(__fmaf_rn(a.x, b.x, c.x)); }
ZK_HD Scalar vsqrt(Scalar a) { return Scalar(__fsqrt_rn(a.x)); }
#else
#if defined(__FMA__)
ZK_HD Scalar fma(Scalar a, Scalar b, Scalar c) { return Scalar(__builtin_fmaf(a.x, b.x, c.x)); }
#else  // no FMA unit for this file's target: a software fmaf would be 20x slower
ZK_HD Scalar fma(Scalar a, Scalar b, Scalar c) { return Scalar(a.x * b.x + c.x); }
#endif
ZK_HD Scalar vsqrt(Scalar a) { return Scalar(__builtin_sqrtf(a.x)); }
#endif
// max that keeps NaN from either side, like torch.maximum
ZK_HD Scalar vmax_of(Scalar a, Scalar b) {
  if (a.x != a.x) return a;
  if (b.x != b.x) return b;
  return Scalar(a.x > b.x ? a.x : b.x);
}

// Finite test for the non-finite scan: x - x is 0 for finite x and NaN for inf/nan.
ZK_HD bool is_finite_f(float x) { return (x - x) == 0.0f; }

}  // namespace ZK_ISA_NS
}  // namespace zk
