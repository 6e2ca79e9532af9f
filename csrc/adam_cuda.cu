// CUDA kernels of the fused Adam/AdamW step (single buffer and multi-tensor) and the converting
// flat copy. Torch-free: compiled by nvcc alone in CMake, and by torch's build in setup.py.
//
// - 64-bit indexing throughout (buffers over 2^31 elements are normal for ZeRO shards).
// - fp32 buffers whose pointers are 16-byte aligned take a float4 path (one 128-bit load per
//   tensor per 4 elements); everything else a scalar grid-stride loop.
// - The non-finite scan is a separate kernel writing a device flag, read by the update kernel:
//   no host synchronisation anywhere.
#include <cuda_runtime.h>

#include <cstdint>

#define ZK_ISA_NS cuda
#include "adam_cuda.h"
#include "adam_math.h"

namespace zk {
namespace {

constexpr int kThreads = 256;

inline int grid_for(int64_t n, int per_thread) {
  int64_t blocks = (n + int64_t(kThreads) * per_thread - 1) / (int64_t(kThreads) * per_thread);
  if (blocks < 1) blocks = 1;
  return static_cast<int>(blocks > 65535 * 8 ? 65535 * 8 : blocks);
}

template <DType G>
__global__ void finite_scan_kernel(const void* grad, int64_t n, float scale, float* found_inf) {
  using GT = typename Storage<G>::T;
  const GT* g = static_cast<const GT*>(grad);
  bool bad = false;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    bad |= !is_finite_f(Storage<G>::load(g, i) * scale);
  }
  if (__syncthreads_or(bad) && threadIdx.x == 0) *found_inf = 1.0f;
}

// Element i of one buffer, any dtype combination.
template <DType S, DType G, DType O>
__device__ __forceinline__ void adam_element(const AdamArgs& a, const AdamBuffers& b, int64_t i) {
  using ST = typename Storage<S>::T;
  ST* p = static_cast<ST*>(b.p);
  ST* m = static_cast<ST*>(b.m);
  ST* v = static_cast<ST*>(b.v);
  ST* vmax = static_cast<ST*>(b.vmax);
  Scalar pp(Storage<S>::load(p, i)), mm(Storage<S>::load(m, i)), vv(Storage<S>::load(v, i));
  Scalar vm(a.amsgrad ? Storage<S>::load(vmax, i) : 0.0f);
  Scalar gg(Storage<G>::load(static_cast<const typename Storage<G>::T*>(b.g), i));
  adam_math(a, pp, gg, mm, vv, &vm);
  Storage<S>::store(p, i, pp.x);
  Storage<S>::store(m, i, mm.x);
  Storage<S>::store(v, i, vv.x);
  if (a.amsgrad) Storage<S>::store(vmax, i, vm.x);
  if constexpr (O != DType::kNone) {
    Storage<O>::store(static_cast<typename Storage<O>::T*>(b.out), i, pp.x);
  }
}

template <DType S, DType G, DType O>
__global__ void adam_kernel(AdamArgs a, AdamBuffers b, const float* found_inf) {
  if (found_inf != nullptr && *found_inf != 0.0f) return;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < b.n;
       i += int64_t(gridDim.x) * blockDim.x) {
    adam_element<S, G, O>(a, b, i);
  }
}

// fp32 state and grad, 16-byte aligned: 4 elements per thread per iteration.
template <DType O>
__global__ void adam_kernel_f32x4(AdamArgs a, AdamBuffers b, const float* found_inf) {
  if (found_inf != nullptr && *found_inf != 0.0f) return;
  const int64_t n4 = b.n / 4;
  float4* p = static_cast<float4*>(b.p);
  const float4* g = static_cast<const float4*>(b.g);
  float4* m = static_cast<float4*>(b.m);
  float4* v = static_cast<float4*>(b.v);
  float4* vmax = static_cast<float4*>(b.vmax);
  for (int64_t j = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; j < n4;
       j += int64_t(gridDim.x) * blockDim.x) {
    float4 P = p[j], G4 = g[j], M = m[j], V = v[j];
    float4 VM = a.amsgrad ? vmax[j] : make_float4(0.f, 0.f, 0.f, 0.f);
    float* pp = &P.x;
    float* gg = &G4.x;
    float* mm = &M.x;
    float* vv = &V.x;
    float* vm = &VM.x;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      Scalar sp(pp[k]), sm(mm[k]), sv(vv[k]), svm(vm[k]);
      adam_math(a, sp, Scalar(gg[k]), sm, sv, &svm);
      pp[k] = sp.x;
      mm[k] = sm.x;
      vv[k] = sv.x;
      vm[k] = svm.x;
    }
    p[j] = P;
    m[j] = M;
    v[j] = V;
    if (a.amsgrad) vmax[j] = VM;
    if constexpr (O != DType::kNone) {
      using OT = typename Storage<O>::T;
      OT* out = static_cast<OT*>(b.out) + 4 * j;
#pragma unroll
      for (int k = 0; k < 4; ++k) Storage<O>::store(out, k, pp[k]);
    }
  }
  // tail (n % 4 elements), handled by the first threads of block 0
  const int64_t tail = 4 * n4 + blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (blockIdx.x == 0 && tail < b.n) adam_element<DType::kF32, DType::kF32, O>(a, b, tail);
}

struct MultiMeta {
  AdamBuffers bufs[kMultiMaxTensors];
  uint8_t block_tensor[kMultiMaxBlocks];
  int32_t block_chunk[kMultiMaxBlocks];
};

template <DType S, DType G, DType O>
__global__ void adam_multi_kernel(AdamArgs a, MultiMeta meta, const float* found_inf) {
  if (found_inf != nullptr && *found_inf != 0.0f) return;
  const AdamBuffers& b = meta.bufs[meta.block_tensor[blockIdx.x]];
  const int64_t start = int64_t(meta.block_chunk[blockIdx.x]) * kMultiChunk;
  const int64_t stop = start + kMultiChunk < b.n ? start + kMultiChunk : b.n;
  for (int64_t i = start + threadIdx.x; i < stop; i += blockDim.x) adam_element<S, G, O>(a, b, i);
}

template <DType D, DType S>
__global__ void convert_kernel(void* dst, const void* src, int64_t n) {
  using DT = typename Storage<D>::T;
  using ST = typename Storage<S>::T;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    Storage<D>::store(static_cast<DT*>(dst), i, Storage<S>::load(static_cast<const ST*>(src), i));
  }
}

// ---- dtype dispatch: calls f.template run<S, G, O>() ----
template <class F, DType S, DType G>
int by_out(DType o, const F& f) {
  switch (o) {
    case DType::kNone: return f.template run<S, G, DType::kNone>();
    case DType::kBF16: return f.template run<S, G, DType::kBF16>();
    case DType::kF16: return f.template run<S, G, DType::kF16>();
    default: return int(cudaErrorInvalidValue);
  }
}
template <class F, DType S>
int by_grad(DType g, DType o, const F& f) {
  if (g == DType::kF32) return by_out<F, S, DType::kF32>(o, f);
  if (g == S) return by_out<F, S, S>(o, f);
  return int(cudaErrorInvalidValue);
}
template <class F>
int dispatch(DType s, DType g, DType o, const F& f) {
  switch (s) {
    case DType::kF32: return by_grad<F, DType::kF32>(g, o, f);
    case DType::kBF16: return by_grad<F, DType::kBF16>(g, o, f);
    case DType::kF16: return by_grad<F, DType::kF16>(g, o, f);
    default: return int(cudaErrorInvalidValue);
  }
}

int scan(const void* g, DType gd, int64_t n, float scale, float* found_inf, cudaStream_t st) {
  const int grid = grid_for(n, 8);
  switch (gd) {
    case DType::kF32:
      finite_scan_kernel<DType::kF32><<<grid, kThreads, 0, st>>>(g, n, scale, found_inf);
      break;
    case DType::kBF16:
      finite_scan_kernel<DType::kBF16><<<grid, kThreads, 0, st>>>(g, n, scale, found_inf);
      break;
    case DType::kF16:
      finite_scan_kernel<DType::kF16><<<grid, kThreads, 0, st>>>(g, n, scale, found_inf);
      break;
    default: return int(cudaErrorInvalidValue);
  }
  return int(cudaGetLastError());
}

bool aligned16(const void* ptr) { return (reinterpret_cast<uintptr_t>(ptr) & 15u) == 0; }

struct SingleLaunch {
  const AdamArgs& a;
  const AdamBuffers& b;
  const float* found_inf;
  cudaStream_t st;
  template <DType S, DType G, DType O>
  int run() const {
    if constexpr (S == DType::kF32 && G == DType::kF32) {
      if (aligned16(b.p) && aligned16(b.g) && aligned16(b.m) && aligned16(b.v) &&
          (!a.amsgrad || aligned16(b.vmax))) {
        adam_kernel_f32x4<O><<<grid_for(b.n, 4), kThreads, 0, st>>>(a, b, found_inf);
        return int(cudaGetLastError());
      }
    }
    adam_kernel<S, G, O><<<grid_for(b.n, 1), kThreads, 0, st>>>(a, b, found_inf);
    return int(cudaGetLastError());
  }
};

struct MultiLaunch {
  const AdamArgs& a;
  const MultiMeta& meta;
  int blocks;
  const float* found_inf;
  cudaStream_t st;
  template <DType S, DType G, DType O>
  int run() const {
    adam_multi_kernel<S, G, O><<<blocks, kThreads, 0, st>>>(a, meta, found_inf);
    return int(cudaGetLastError());
  }
};

}  // namespace

int adam_step_cuda(const AdamArgs& a, const AdamBuffers& b, float* found_inf, bool check_finite,
                   void* stream) {
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  if (b.n == 0) return 0;
  if (check_finite) {
    if (found_inf == nullptr) return int(cudaErrorInvalidValue);
    if (int err = scan(b.g, b.grad, b.n, a.grad_scale, found_inf, st)) return err;
  }
  return dispatch(b.state, b.grad, b.out_dtype, SingleLaunch{a, b, found_inf, st});
}

int adam_step_multi_cuda(const AdamArgs& a, const AdamBuffers* bufs, int n, float* found_inf,
                         bool check_finite, void* stream) {
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  if (check_finite) {
    if (found_inf == nullptr) return int(cudaErrorInvalidValue);
    // every scan before any update: an overflow in the last tensor leaves the first untouched
    for (int t = 0; t < n; ++t) {
      if (bufs[t].n == 0) continue;
      if (int err = scan(bufs[t].g, bufs[t].grad, bufs[t].n, a.grad_scale, found_inf, st))
        return err;
    }
  }
  MultiMeta meta{};
  int ntensors = 0, nblocks = 0;
  auto flush = [&]() -> int {
    if (nblocks == 0) return 0;
    const AdamBuffers& b0 = meta.bufs[0];
    int err =
        dispatch(b0.state, b0.grad, b0.out_dtype, MultiLaunch{a, meta, nblocks, found_inf, st});
    ntensors = 0;
    nblocks = 0;
    return err;
  };
  for (int t = 0; t < n; ++t) {
    const AdamBuffers& b = bufs[t];
    if (b.n == 0) continue;
    if (ntensors > 0 && (b.state != meta.bufs[0].state || b.grad != meta.bufs[0].grad ||
                         b.out_dtype != meta.bufs[0].out_dtype)) {
      return int(cudaErrorInvalidValue);  // one dtype combination per call
    }
    const int64_t chunks = (b.n + kMultiChunk - 1) / kMultiChunk;
    for (int64_t c = 0; c < chunks; ++c) {
      if (nblocks == kMultiMaxBlocks || (c == 0 && ntensors == kMultiMaxTensors)) {
        if (int err = flush()) return err;
      }
      if (c == 0 || ntensors == 0) meta.bufs[ntensors++] = b;
      meta.block_tensor[nblocks] = static_cast<uint8_t>(ntensors - 1);
      meta.block_chunk[nblocks] = static_cast<int32_t>(c);
      ++nblocks;
    }
  }
  return flush();
}

int convert_copy_cuda(void* dst, DType dd, const void* src, DType sd, int64_t n, void* stream) {
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  if (n == 0) return 0;
  if (dd == sd) {
    const size_t bytes = size_t(n) * (dd == DType::kF32 ? 4 : 2);
    return int(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, st));
  }
  const int grid = grid_for(n, 4);
#define ZK_CONVERT(D, S)                                          \
  if (dd == D && sd == S) {                                       \
    convert_kernel<D, S><<<grid, kThreads, 0, st>>>(dst, src, n); \
    return int(cudaGetLastError());                               \
  }
  ZK_CONVERT(DType::kF32, DType::kBF16)
  ZK_CONVERT(DType::kF32, DType::kF16)
  ZK_CONVERT(DType::kBF16, DType::kF32)
  ZK_CONVERT(DType::kF16, DType::kF32)
  ZK_CONVERT(DType::kBF16, DType::kF16)
  ZK_CONVERT(DType::kF16, DType::kBF16)
#undef ZK_CONVERT
  return int(cudaErrorInvalidValue);
}

const char* cuda_error_string(int err) { return cudaGetErrorString(static_cast<cudaError_t>(err)); }

}  // namespace zk
