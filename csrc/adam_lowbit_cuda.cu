// CUDA kernels of the Adam/AdamW step with low-bit moments. Torch-free: compiled by nvcc alone in
// CMake, and by torch's build in setup.py. Format: zero_kernels/ops/lowbit.py [Note: low-bit
// state]; the per-element formulas are adam_lowbit.h's, the ones the CPU paths run.
//
// - int8: one thread block per quantization block (grid-stride over blocks). Pass 1 decodes,
//   updates (p and out written) and keeps the new m and u = sqrt(v) in shared memory (2 * block
//   floats, at most 32 KiB; thread t owns slots t, t + T, ...: coalesced global accesses, and it
//   reads back only its own slots); max |m|, max u and finiteness are reduced over the block (warp
//   shuffles, then one shared slot per warp); pass 2 encodes the scratch. Memory sees each byte
//   once. A non-finite block stores scale NaN and codes 0, as the CPU does.
// - bf16: a grid-stride loop over elements.
// - The non-finite scan is a separate kernel writing the device flag that the update kernels
//   read first: no host synchronisation anywhere.
#include <cuda_runtime.h>

#include <cstdint>

#define ZK_ISA_NS cuda
#include "adam_lowbit_cuda.h"

namespace zk {
namespace {

constexpr int kThreads = 256;  // threads per CUDA block (at most; an int8 block of 64 gets 64)
constexpr int kWarps = kThreads / 32;
constexpr int kGridCap = 65535 * 8;

inline int grid_of(int64_t items, int64_t per_block) {
  int64_t blocks = (items + per_block - 1) / per_block;
  if (blocks < 1) blocks = 1;
  return static_cast<int>(blocks > kGridCap ? kGridCap : blocks);
}

template <DType G>
__device__ __forceinline__ float load_g(const void* g, int64_t i) {
  return Storage<G>::load(static_cast<const typename Storage<G>::T*>(g), i);
}

template <DType G>
__global__ void lowbit_scan_kernel(const void* grad, int64_t n, float scale, float* found_inf) {
  bool bad = false;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    bad |= !is_finite_f(load_g<G>(grad, i) * scale);
  }
  if (__syncthreads_or(bad) && threadIdx.x == 0) *found_inf = 1.0f;
}

// max of finite non-negative values over a warp (all 32 lanes take part)
__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, off));
  return x;
}

template <DType O>
__device__ __forceinline__ void store_out(void* out, int64_t i, float p) {
  if constexpr (O != DType::kNone) {
    Storage<O>::store(static_cast<typename Storage<O>::T*>(out), i, p);
  }
}

// int8 moments. blockDim.x is a multiple of 32 (at most kThreads); the dynamic shared memory
// holds 2 * b.block floats: the block's new m, then its new u.
template <DType G, DType O>
__global__ void __launch_bounds__(kThreads)
    lowbit_i8_kernel(AdamArgs a, AdamLowbitBuffers b, int64_t nblocks, const float* found_inf) {
  if (found_inf != nullptr && *found_inf != 0.0f) return;
  extern __shared__ float scratch[];
  float* tm = scratch;
  float* tu = scratch + b.block;
  __shared__ float red_m[kWarps];
  __shared__ float red_u[kWarps];
  auto* qm = static_cast<int8_t*>(b.m);
  auto* qv = static_cast<uint8_t*>(b.v);
  const int t = threadIdx.x, nt = blockDim.x, lane = t & 31, warp = t >> 5, nwarps = nt >> 5;
  // the loop bound is the same for every thread of the block: each barrier sees all of them
  for (int64_t blk = blockIdx.x; blk < nblocks; blk += gridDim.x) {
    const int64_t begin = lowbit_block_begin(b, blk);  // block_starts, or blk * b.block
    const int len = int(lowbit_block_end(b, blk) - begin);
    const float sm = b.m_scale[blk], sv = b.v_scale[blk];
    float am = 0.0f, au = 0.0f;
    bool fin = true;
    for (int j = t; j < len; j += nt) {  // each thread reads back only its own slots
      const int64_t i = begin + j;
      Scalar p(b.p[i]), m(decode_m(qm[i], sm)), u(decode_u(qv[i], sv));
      Scalar v = u * u;
      u = adam_math(a, p, Scalar(load_g<G>(b.g, i)), m, v, static_cast<Scalar*>(nullptr));
      b.p[i] = p.x;
      store_out<O>(b.out, i, p.x);
      tm[j] = m.x;
      tu[j] = u.x;
      am = fmaxf(am, fabsf(m.x));
      au = fmaxf(au, u.x);
      fin = fin && is_finite_f(m.x) && is_finite_f(u.x);
    }
    am = warp_max(am);
    au = warp_max(au);
    if (lane == 0) {
      red_m[warp] = am;
      red_u[warp] = au;
    }
    // a barrier too: every thread has read this block's scales and written its warp's slot
    const bool finite = __syncthreads_and(fin) != 0;
    for (int w = 0; w < nwarps; ++w) {
      am = fmaxf(am, red_m[w]);
      au = fmaxf(au, red_u[w]);
    }
    const LowbitScale s_m = lowbit_scale(am, kMCodes, finite);
    const LowbitScale s_u = lowbit_scale(au, kVCodes, finite);
    if (t == 0) {
      b.m_scale[blk] = s_m.scale;
      b.v_scale[blk] = s_u.scale;
    }
    for (int j = t; j < len; j += nt) {  // codes 0 under a NaN scale: the state stays non-finite
      qm[begin + j] = static_cast<int8_t>(finite ? encode_m(tm[j], s_m.inv) : 0);
      qv[begin + j] = static_cast<uint8_t>(finite ? encode_u(tu[j], s_u.inv) : 0);
    }
    __syncthreads();  // red_m / red_u are rewritten for the next block
  }
}

// bf16 moments, element-wise.
template <DType G, DType O>
__global__ void lowbit_bf16_kernel(AdamArgs a, AdamLowbitBuffers b, const float* found_inf) {
  if (found_inf != nullptr && *found_inf != 0.0f) return;
  auto* bm = static_cast<uint16_t*>(b.m);
  auto* bv = static_cast<uint16_t*>(b.v);
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < b.n;
       i += int64_t(gridDim.x) * blockDim.x) {
    Scalar p(b.p[i]), m(bf16_to_float(bm[i])), v(bf16_to_float(bv[i])), u(0.0f);
    u = adam_math(a, p, Scalar(load_g<G>(b.g, i)), m, v, static_cast<Scalar*>(nullptr));
    b.p[i] = p.x;
    bm[i] = float_to_bf16(m.x);
    bv[i] = float_to_bf16(v.x);
    store_out<O>(b.out, i, p.x);
  }
}

struct Launch {
  const AdamArgs& a;
  const AdamLowbitBuffers& b;
  const float* found_inf;
  cudaStream_t st;

  template <DType G, DType O>
  int run() const {
    if (b.fmt == MomentFormat::kBF16) {
      lowbit_bf16_kernel<G, O><<<grid_of(b.n, kThreads), kThreads, 0, st>>>(a, b, found_inf);
      return int(cudaGetLastError());
    }
    // an int8 block of up to 256 elements: one element per thread; larger: 256 threads
    const int threads = b.block < kThreads ? int(b.block) : kThreads;
    const int64_t nblocks = lowbit_num_blocks(b);
    const size_t smem = size_t(2 * b.block) * sizeof(float);  // at most 32 KiB: no opt-in
    lowbit_i8_kernel<G, O><<<grid_of(nblocks, 1), threads, smem, st>>>(a, b, nblocks, found_inf);
    return int(cudaGetLastError());
  }
};
static_assert(2 * kMaxLowbitBlock * sizeof(float) <= 48 * 1024,
              "an int8 block's scratch must fit the default dynamic shared memory");

template <DType G>
int by_out(const Launch& l) {
  switch (l.b.out_dtype) {
    case DType::kNone: return l.run<G, DType::kNone>();
    case DType::kBF16: return l.run<G, DType::kBF16>();
    case DType::kF16: return l.run<G, DType::kF16>();
    default: return int(cudaErrorInvalidValue);
  }
}

int scan(const AdamLowbitBuffers& b, float scale, float* found_inf, cudaStream_t st) {
  const int grid = grid_of(b.n, int64_t(kThreads) * 8);
  switch (b.grad) {
    case DType::kF32:
      lowbit_scan_kernel<DType::kF32><<<grid, kThreads, 0, st>>>(b.g, b.n, scale, found_inf);
      break;
    case DType::kBF16:
      lowbit_scan_kernel<DType::kBF16><<<grid, kThreads, 0, st>>>(b.g, b.n, scale, found_inf);
      break;
    case DType::kF16:
      lowbit_scan_kernel<DType::kF16><<<grid, kThreads, 0, st>>>(b.g, b.n, scale, found_inf);
      break;
    default: return int(cudaErrorInvalidValue);
  }
  return int(cudaGetLastError());
}

bool layout_ok(const AdamLowbitBuffers& b) {
  if (b.n < 0 || b.p == nullptr || b.g == nullptr || b.m == nullptr || b.v == nullptr) {
    return false;
  }
  if (b.out_dtype != DType::kNone && b.out == nullptr) return false;
  if (b.fmt == MomentFormat::kBF16) return b.block > 0;
  if (b.fmt != MomentFormat::kInt8) return false;
  return b.block >= 64 && b.block <= kMaxLowbitBlock && b.block % 64 == 0 && b.m_scale != nullptr &&
         b.v_scale != nullptr;
}

}  // namespace

int adam_lowbit_cuda(const AdamArgs& a, const AdamLowbitBuffers& b, float* found_inf,
                     bool check_finite, void* stream) {
  if (b.n == 0) return 0;
  if (!layout_ok(b)) return int(cudaErrorInvalidValue);
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  if (check_finite) {
    if (found_inf == nullptr) return int(cudaErrorInvalidValue);
    if (int err = scan(b, a.grad_scale, found_inf, st)) return err;
  }
  const Launch l{a, b, found_inf, st};
  switch (b.grad) {
    case DType::kF32: return by_out<DType::kF32>(l);
    case DType::kBF16: return by_out<DType::kBF16>(l);
    case DType::kF16: return by_out<DType::kF16>(l);
    default: return int(cudaErrorInvalidValue);
  }
}

}  // namespace zk
