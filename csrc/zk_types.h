// Plain types shared by the torch-free kernels (CPU and CUDA) and the one binding file.
#pragma once
#include <cstdint>

#if defined(__CUDACC__)
#define ZK_HD __host__ __device__ __forceinline__
#else
#define ZK_HD inline
#endif

namespace zk {

// Storage dtypes the kernels read and write. Math is always fp32.
enum class DType : int { kNone = 0, kF32 = 1, kBF16 = 2, kF16 = 3 };

// Scalars of one Adam/AdamW step, precomputed on the host in double then rounded once.
// Formula: zero_kernels/ops/hyper.py [Note: one math routine].
struct AdamArgs {
  float lr;
  float beta1;
  float beta2;
  float eps;
  float weight_decay;
  float step_size;        // lr / (1 - beta1^step)
  float inv_bc2_sqrt;     // 1 / sqrt(1 - beta2^step)
  float grad_scale;       // grads are multiplied by this first
  float one_minus_beta1;  // 1 - beta1, formed in double then rounded once (as torch does)
  float one_minus_beta2;  // 1 - beta2, likewise: 1.0f - 0.999f is 1.3e-5 off relative
  float decay;            // 1 - lr * weight_decay (AdamW), likewise
  bool adamw;             // decoupled weight decay (AdamW) instead of L2 (Adam)
  bool amsgrad;
  bool maximize;
};

// One contiguous range of n elements. p, m, v, vmax share `state`; g has `grad`;
// out (optional) receives the updated params in `out` (bf16 or fp16).
struct AdamBuffers {
  void* p;
  const void* g;
  void* m;
  void* v;
  void* vmax;  // nullptr unless amsgrad
  void* out;   // nullptr when no low-precision copy-out
  int64_t n;
  DType state;
  DType grad;
  DType out_dtype;
};

// The one place AdamArgs are formed from the step's scalars: every derived factor is computed in
// double and rounded to float once (as torch does; 1.0f - 0.999f would be 1.3e-5 off relative).
// step_size = lr / (1 - beta1^step), bc2_sqrt = sqrt(1 - beta2^step).
inline AdamArgs make_adam_args(double lr, double beta1, double beta2, double eps,
                               double weight_decay, double step_size, double bc2_sqrt,
                               double grad_scale, bool adamw, bool amsgrad, bool maximize) {
  AdamArgs a{};
  a.lr = float(lr);
  a.beta1 = float(beta1);
  a.beta2 = float(beta2);
  a.eps = float(eps);
  a.weight_decay = float(weight_decay);
  a.step_size = float(step_size);
  a.inv_bc2_sqrt = float(1.0 / bc2_sqrt);
  a.grad_scale = float(grad_scale);
  a.one_minus_beta1 = float(1.0 - beta1);
  a.one_minus_beta2 = float(1.0 - beta2);
  a.decay = float(1.0 - lr * weight_decay);
  a.adamw = adamw;
  a.amsgrad = amsgrad;
  a.maximize = maximize;
  return a;
}

}  // namespace zk
