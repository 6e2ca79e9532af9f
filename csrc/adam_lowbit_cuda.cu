// CUDA kernels of the Adam/AdamW step with low-bit moments. Torch-free: compiled by nvcc alone in
// CMake, and by torch's build in setup.py. Format: zero_kernels/ops/lowbit.py [Note: low-bit
// state]; the per-element formulas are adam_lowbit.h's, the ones the CPU paths run.
//
// The int8 step moves 16 bytes per element (fp32 p read and written, fp32 g, two code bytes read
// and written) and runs some 90 instructions on it, four of them correctly rounded square roots
// and divisions whose expansions branch to a slow path: ptxas does not interleave two elements'
// math, so each thread's math is one long dependent chain and the kernel is latency-bound. It
// goes fast with many warps resident, each with all its loads in flight before its math starts,
// and little spent per block. (One thread per element, a shared-memory scratch and two barriers
// per block, the first version, ran at 1.1 TB/s on an H200 at block 256; this one at 3.2 TB/s,
// as fast as the Triton kernel.) Hence:
//
// - int8: a group of gs threads owns one quantization block (grid-stride over blocks), K = 8
//   elements per thread in registers. A thread issues all its loads first, decodes and updates
//   its elements (p and out stored at once), keeps the new m and u = sqrt(v), takes max |m| and
//   max u over the group (unsigned maxima of the fp32 bits, see i8_step), forms the two scales
//   (one lowbit_scale per warp: even lanes m's, odd lanes u's, then a shuffle) and encodes and
//   stores the codes from its registers: memory sees each byte once; only the cross-warp maxima
//   of large blocks go through shared memory. A non-finite block stores scale NaN and codes 0,
//   as the CPU does.
//   Groups: block <= 256: 8, 16 or 32 lanes of one warp (shuffles or one REDUX, no barrier;
//   256-thread CTAs of independent groups); larger: one CTA of ceil(block / 8) threads rounded
//   to whole warps (up to 512), one __syncthreads per block.
//   Element k of thread t sits at 4 * (t + (k / 4) * gs) + k % 4 (16-byte p, 16- or 8-byte g,
//   4 bytes of each code array per access) where the buffers are aligned for it and the block's
//   begin and length are multiples of 4 (without block_starts every block but a short last one;
//   with it, decided per block), else at t + k * gs (one element per access, still coalesced);
//   the same registers and the same code serve both layouts, so the fallback costs no registers.
//   K = 8 measured best: K = 4 spends more per block and per element, more adds registers
//   (63-77 at K = 8: 32 warps per SM).
// - bf16: one chunk of 4 elements per thread per grid-stride iteration (16-byte p, 8-byte m and
//   v, 16- or 8-byte g, 8-byte out); the n % 4 tail and unaligned buffers take the same code
//   element by element.
// - The non-finite scan is a separate kernel writing the device flag that the update kernels
//   read first (no update may start before the whole gradient is known finite): 4 loads of 16
//   bytes per thread in flight; no host synchronisation anywhere.
#include <cuda_runtime.h>

#include <cstdint>

#define ZK_ISA_NS cuda
#include "adam_lowbit_cuda.h"

namespace zk {
namespace {

constexpr int kThreads = 256;  // threads per CUDA block of the scan and bf16 kernels
constexpr int kGridCap = 65535 * 8;

inline int grid_of(int64_t items, int64_t per_block) {
  int64_t blocks = (items + per_block - 1) / per_block;
  if (blocks < 1) blocks = 1;
  return static_cast<int>(blocks > kGridCap ? kGridCap : blocks);
}

inline bool aligned(const void* ptr, uintptr_t bytes) {
  return (reinterpret_cast<uintptr_t>(ptr) & (bytes - 1)) == 0;
}

// ---- bf16 moments' accesses: V consecutive fp32 (F) or 16-bit (H) elements ----
template <int V>
struct Lanes;
template <>
struct Lanes<1> {
  using F = float;
  using H = uint16_t;
};
template <>
struct Lanes<4> {
  using F = float4;
  using H = uint2;
};
// the raw grad chunk: fp32 lanes, or the bits of bf16/fp16 ones
template <DType G, int V>
struct GradLanes {
  using T = typename Lanes<V>::H;
};
template <int V>
struct GradLanes<DType::kF32, V> {
  using T = typename Lanes<V>::F;
};

// element e of a chunk (e is a constant once the loops are unrolled)
__device__ __forceinline__ float get(float x, int) { return x; }
__device__ __forceinline__ float get(const float4& x, int e) {
  return e == 0 ? x.x : e == 1 ? x.y : e == 2 ? x.z : x.w;
}
__device__ __forceinline__ void put(float& x, int, float f) { x = f; }
__device__ __forceinline__ void put(float4& x, int e, float f) {
  if (e == 0) x.x = f;
  if (e == 1) x.y = f;
  if (e == 2) x.z = f;
  if (e == 3) x.w = f;
}
__device__ __forceinline__ uint32_t half_at(uint16_t x, int) { return x; }
__device__ __forceinline__ uint32_t half_at(const uint2& x, int e) {
  return ((e < 2 ? x.x : x.y) >> (16 * (e & 1))) & 0xffffu;
}
__device__ __forceinline__ void set_half(uint16_t& x, int, uint32_t h) { x = uint16_t(h); }
__device__ __forceinline__ void set_half(uint2& x, int e, uint32_t h) {
  if (e < 2) {
    x.x |= h << (16 * (e & 1));
  } else {
    x.y |= h << (16 * (e & 1));
  }
}

// fp32 of grad element e of a raw chunk: Storage<G>'s own conversion
template <DType G, class T>
__device__ __forceinline__ float grad_at(const T& x, int e) {
  if constexpr (G == DType::kF32) {
    return get(x, e);
  } else {
    const auto h = static_cast<typename Storage<G>::T>(half_at(x, e));
    return Storage<G>::load(&h, 0);
  }
}
// the 16 bits Storage<O> stores for p
template <DType O>
__device__ __forceinline__ uint32_t out_bits(float p) {
  typename Storage<O>::T h;
  Storage<O>::store(&h, 0, p);
  return h;
}

// ---- non-finite scan: grad * scale, 16-byte loads (or elements where unaligned) ----
template <DType G, bool kVec>
struct ScanLanes {
  using T = uint4;
  static constexpr int kW = 16 / int(sizeof(typename Storage<G>::T));
};
template <DType G>
struct ScanLanes<G, false> {
  using T = typename Storage<G>::T;
  static constexpr int kW = 1;
};

template <DType G>
__device__ __forceinline__ bool scan_bad(const typename Storage<G>::T& x, int, float scale) {
  return !is_finite_f(Storage<G>::load(&x, 0) * scale);
}
template <DType G>
__device__ __forceinline__ bool scan_bad(const uint4& x, int e, float scale) {
  const uint32_t w[4] = {x.x, x.y, x.z, x.w};
  if constexpr (G == DType::kF32) {
    return !is_finite_f(bits_to_float(w[e]) * scale);
  } else {
    const auto h = static_cast<typename Storage<G>::T>((w[e >> 1] >> (16 * (e & 1))) & 0xffffu);
    return !is_finite_f(Storage<G>::load(&h, 0) * scale);
  }
}

constexpr int kScanUnroll = 4;  // loads in flight per thread

template <DType G, bool kVec>
__global__ void __launch_bounds__(kThreads)
    lowbit_scan_kernel(const void* grad, int64_t n, float scale, float* found_inf) {
  using L = ScanLanes<G, kVec>;
  using GT = typename Storage<G>::T;
  const auto* g = static_cast<const typename L::T*>(grad);
  const int64_t nv = n / L::kW;  // whole loads
  bool bad = false;
  for (int64_t i0 = blockIdx.x * int64_t(blockDim.x) * kScanUnroll + threadIdx.x; i0 < nv;
       i0 += int64_t(gridDim.x) * blockDim.x * kScanUnroll) {
    typename L::T x[kScanUnroll];
#pragma unroll
    for (int r = 0; r < kScanUnroll; ++r) {
      const int64_t i = i0 + int64_t(r) * blockDim.x;
      if (i < nv) x[r] = g[i];
    }
#pragma unroll
    for (int r = 0; r < kScanUnroll; ++r) {
      if (i0 + int64_t(r) * blockDim.x < nv) {
#pragma unroll
        for (int e = 0; e < L::kW; ++e) bad |= scan_bad<G>(x[r], e, scale);
      }
    }
  }
  if constexpr (kVec) {  // the last n % kW elements: threads of block 0
    const int64_t i = nv * L::kW + threadIdx.x;
    if (blockIdx.x == 0 && i < n) {
      bad |= !is_finite_f(Storage<G>::load(static_cast<const GT*>(grad), i) * scale);
    }
  }
  if (__syncthreads_or(bad) && threadIdx.x == 0) *found_inf = 1.0f;
}

// ---- int8 moments ----

// One element: decode, update (p in place), the new m and u = sqrt(v) out.
__device__ __forceinline__ void i8_element(const AdamArgs& a, float& p, float g, uint32_t qm,
                                           uint32_t qv, float sm, float sv, float& m_out,
                                           float& u_out) {
  Scalar sp(p), m(decode_m(int(static_cast<int8_t>(static_cast<uint8_t>(qm))), sm));
  Scalar u(decode_u(int(qv), sv));
  Scalar v = u * u;
  u = adam_math(a, sp, Scalar(g), m, v, static_cast<Scalar*>(nullptr));
  p = sp.x;
  m_out = m.x;
  u_out = u.x;
}

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
constexpr bool kHasRedux = true;  // __reduce_max_sync
#else
constexpr bool kHasRedux = false;
#endif

// Max of unsigned values over a group of GS lanes (mask: the group's lanes, GS a power of 2).
template <int GS>
__device__ __forceinline__ uint32_t group_max(uint32_t x, unsigned mask) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  if constexpr (GS == 32) return __reduce_max_sync(mask, x);  // one instruction for a warp
#endif
  if constexpr (GS < 32 || !kHasRedux) {
#pragma unroll
    for (int off = GS / 2; off > 0; off >>= 1) x = max(x, __shfl_xor_sync(mask, x, off));
  }
  return x;
}

// Groups of GS <= 32 lanes of one warp.
template <int GS>
struct WarpGroup {
  unsigned mask;  // the group's lanes
  __device__ __forceinline__ void max2(uint32_t& am, uint32_t& au) const {
    am = group_max<GS>(am, mask);
    au = group_max<GS>(au, mask);
  }
  // x of the group's thread src (src < GS)
  __device__ __forceinline__ float bcast(float x, int src) const {
    return __shfl_sync(mask, x, src, GS);
  }
};

// A whole CTA: warp maxima, then one shared slot pair per warp. `slots` holds 2 * 32 entries
// per block parity: the slots of block k are rewritten by block k + 2 only, after every thread
// has passed block k + 1's barrier, hence has read them.
struct CtaGroup {
  uint32_t* slots;  // this block's parity
  int lane, warp, nwarps;
  __device__ __forceinline__ void max2(uint32_t& am, uint32_t& au) const {
    am = group_max<32>(am, 0xffffffffu);
    au = group_max<32>(au, 0xffffffffu);
    if (lane == 0) {
      slots[2 * warp] = am;
      slots[2 * warp + 1] = au;
    }
    __syncthreads();
    for (int w = 0; w < nwarps; ++w) {
      am = max(am, slots[2 * w]);
      au = max(au, slots[2 * w + 1]);
    }
  }
  // x of lane src of this warp (src < 32)
  __device__ __forceinline__ float bcast(float x, int src) const {
    return __shfl_sync(0xffffffffu, x, src);
  }
};

// One quantization block, `blk` ([begin, begin + len) of the tensor, len <= K * gs), stepped by
// the group of gs threads that owns it: i8_load (every load of thread t, issued before any math)
// then i8_step. Thread t holds elements k = 0 .. K - 1 at offset
//   4 * (t + (k / 4) * gs) + k % 4   (vec: begin and len multiples of 4, buffers aligned), or
//   t + k * gs                       (otherwise)
// in the same registers either way, so one copy of the math serves both layouts. Elements past
// len are loaded as zeros, computed, and neither counted nor stored.
template <DType G, int K>
struct I8Regs {  // one block's inputs, loaded
  static_assert(K % 4 == 0, "K: whole chunks of 4");
  static constexpr bool kG32 = G == DType::kF32;
  int64_t blk, begin;
  int len;
  bool vec;
  float sm, sv;                   // the block's scales
  float P[K];                     // params
  float Gf[kG32 ? K : 1];         // fp32 grads
  uint32_t Gh[kG32 ? 1 : K / 2];  // bf16/fp16 grads, two per word
  uint32_t QM[K / 4], QV[K / 4];  // codes, four per word
};

template <DType G, int K>
__device__ __forceinline__ void i8_load(const AdamLowbitBuffers& b, int64_t blk, bool vec_ok, int t,
                                        int gs, I8Regs<G, K>& x) {
  constexpr int C = K / 4;
  constexpr bool kG32 = G == DType::kF32;
  using GT = typename Storage<G>::T;
  x.blk = blk;
  x.begin = lowbit_block_begin(b, blk);  // block_starts, or blk * b.block
  x.len = int(lowbit_block_end(b, blk) - x.begin);
  x.vec = vec_ok && ((x.begin | int64_t(x.len)) & 3) == 0;
  const int len = x.len;
  const float* const p = b.p + x.begin;
  const GT* const g = static_cast<const GT*>(b.g) + x.begin;
  const uint8_t* const qm = static_cast<const uint8_t*>(b.m) + x.begin;
  const uint8_t* const qv = static_cast<const uint8_t*>(b.v) + x.begin;
  x.sm = b.m_scale[blk];
  x.sv = b.v_scale[blk];
#pragma unroll
  for (int k = 0; k < K; ++k) {
    x.P[k] = 0.0f;
    if constexpr (kG32) x.Gf[k] = 0.0f;
  }
#pragma unroll
  for (int r = 0; r < C; ++r) {
    x.QM[r] = x.QV[r] = 0;
    if constexpr (!kG32) x.Gh[2 * r] = x.Gh[2 * r + 1] = 0;
  }
  if (x.vec) {
#pragma unroll
    for (int r = 0; r < C; ++r) {
      const int c = t + r * gs;
      if (4 * c < len) {
        const float4 v = reinterpret_cast<const float4*>(p)[c];
        x.P[4 * r] = v.x;
        x.P[4 * r + 1] = v.y;
        x.P[4 * r + 2] = v.z;
        x.P[4 * r + 3] = v.w;
        if constexpr (kG32) {
          const float4 y = reinterpret_cast<const float4*>(g)[c];
          x.Gf[4 * r] = y.x;
          x.Gf[4 * r + 1] = y.y;
          x.Gf[4 * r + 2] = y.z;
          x.Gf[4 * r + 3] = y.w;
        } else {
          const uint2 y = reinterpret_cast<const uint2*>(g)[c];
          x.Gh[2 * r] = y.x;
          x.Gh[2 * r + 1] = y.y;
        }
        x.QM[r] = reinterpret_cast<const uint32_t*>(qm)[c];
        x.QV[r] = reinterpret_cast<const uint32_t*>(qv)[c];
      }
    }
  } else {
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const int j = t + k * gs;
      if (j < len) {
        x.P[k] = p[j];
        if constexpr (kG32) {
          x.Gf[k] = g[j];
        } else {
          x.Gh[k >> 1] |= uint32_t(g[j]) << (16 * (k & 1));
        }
        x.QM[k >> 2] |= uint32_t(qm[j]) << (8 * (k & 3));
        x.QV[k >> 2] |= uint32_t(qv[j]) << (8 * (k & 3));
      }
    }
  }
}

// The block's max |m| and max u are unsigned maxima of the fp32 bits: every |m| and u is +0,
// positive, +inf or a NaN (u = sqrt(v), v = u_old^2 * beta2 + (g^2 * (1 - beta2)) is never -0,
// and sqrt of a negative v is a NaN), so on finite values the bit order is the value order (the
// maxima equal fmaxf's, whatever the order of the reduction) and every inf or NaN lies above
// every finite value: the block is finite exactly when both maxima are (is_finite_f), with no
// per-element test.
template <DType G, DType O, int K, class Group>
__device__ __forceinline__ void i8_step(const AdamArgs& a, const AdamLowbitBuffers& b,
                                        I8Regs<G, K>& x, int t, int gs, const Group& grp) {
  constexpr int C = K / 4;
  constexpr bool kG32 = G == DType::kF32;
  using GT = typename Storage<G>::T;
  const int64_t blk = x.blk;
  const int len = x.len;
  const bool vec = x.vec;
  float* const p = b.p + x.begin;
  uint8_t* const qm = static_cast<uint8_t*>(b.m) + x.begin;
  uint8_t* const qv = static_cast<uint8_t*>(b.v) + x.begin;
  const auto offset = [&](int k) { return vec ? 4 * (t + (k >> 2) * gs) + (k & 3) : t + k * gs; };
  float* const P = x.P;
  const uint32_t* const QM = x.QM;
  const uint32_t* const QV = x.QV;

  float M[K], U[K];                                 // the new m and u, kept for the encode
  uint32_t OW[O == DType::kNone ? 1 : K / 2] = {};  // out, two per word
  uint32_t am = 0, au = 0;  // bits of max |m|, max u (+0 for a thread without elements)
#pragma unroll
  for (int k = 0; k < K; ++k) {
    float grad;
    if constexpr (kG32) {
      grad = x.Gf[k];
    } else {
      const auto h = static_cast<GT>(x.Gh[k >> 1] >> (16 * (k & 1)));
      grad = Storage<G>::load(&h, 0);
    }
    const uint32_t cm = (QM[k >> 2] >> (8 * (k & 3))) & 0xffu;
    const uint32_t cv = (QV[k >> 2] >> (8 * (k & 3))) & 0xffu;
    i8_element(a, P[k], grad, cm, cv, x.sm, x.sv, M[k], U[k]);
    if constexpr (O != DType::kNone) OW[k >> 1] |= out_bits<O>(P[k]) << (16 * (k & 1));
    const bool in = offset(k) < len;
    am = max(am, in ? float_to_bits(fabsf(M[k])) : 0u);
    au = max(au, in ? float_to_bits(U[k]) : 0u);
  }
  using OT = typename Storage<O == DType::kNone ? DType::kBF16 : O>::T;
  OT* const out = static_cast<OT*>(b.out) + x.begin;
  if (vec) {
#pragma unroll
    for (int r = 0; r < C; ++r) {
      const int c = t + r * gs;
      if (4 * c < len) {
        reinterpret_cast<float4*>(p)[c] =
            make_float4(P[4 * r], P[4 * r + 1], P[4 * r + 2], P[4 * r + 3]);
        if constexpr (O != DType::kNone) {
          reinterpret_cast<uint2*>(out)[c] = make_uint2(OW[2 * r], OW[2 * r + 1]);
        }
      }
    }
  } else {
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const int j = t + k * gs;
      if (j < len) {
        p[j] = P[k];
        if constexpr (O != DType::kNone) out[j] = static_cast<OT>(OW[k >> 1] >> (16 * (k & 1)));
      }
    }
  }

  // every thread of the group has read the block's scales before the reduction completes
  grp.max2(am, au);
  const float amax_m = bits_to_float(am), amax_u = bits_to_float(au);
  const bool finite = is_finite_f(amax_m) && is_finite_f(amax_u);
  // even threads form m's scale, odd ones u's (one lowbit_scale per warp); threads 0 and 1 of
  // the group store them, every thread takes both encode factors from them
  const bool odd = (t & 1) != 0;
  const LowbitScale s = lowbit_scale(odd ? amax_u : amax_m, odd ? kVCodes : kMCodes, finite);
  if (t < 2) (odd ? b.v_scale : b.m_scale)[blk] = s.scale;
  const float inv_m = grp.bcast(s.inv, 0), inv_u = grp.bcast(s.inv, 1);
  uint32_t WM[C] = {}, WV[C] = {};  // codes 0 under a NaN scale: the state stays non-finite
  if (finite) {
#pragma unroll
    for (int k = 0; k < K; ++k) {
      WM[k >> 2] |= (uint32_t(encode_m(M[k], inv_m)) & 0xffu) << (8 * (k & 3));
      WV[k >> 2] |= (uint32_t(encode_u(U[k], inv_u)) & 0xffu) << (8 * (k & 3));
    }
  }
  if (vec) {
#pragma unroll
    for (int r = 0; r < C; ++r) {
      const int c = t + r * gs;
      if (4 * c < len) {
        reinterpret_cast<uint32_t*>(qm)[c] = WM[r];
        reinterpret_cast<uint32_t*>(qv)[c] = WV[r];
      }
    }
  } else {
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const int j = t + k * gs;
      if (j < len) {
        qm[j] = static_cast<uint8_t>(WM[k >> 2] >> (8 * (k & 3)));
        qv[j] = static_cast<uint8_t>(WV[k >> 2] >> (8 * (k & 3)));
      }
    }
  }
}

// One block of the grid-stride loop: the group's thread t of gs.
template <DType G, DType O, int K, class Group>
__device__ __forceinline__ void i8_any(const AdamArgs& a, const AdamLowbitBuffers& b, int64_t blk,
                                       bool vec_ok, int t, int gs, const Group& grp) {
  I8Regs<G, K> x;
  i8_load(b, blk, vec_ok, t, gs, x);
  i8_step<G, O, K>(a, b, x, t, gs, grp);
}

constexpr int kGroupCta = 256;  // threads per CTA of warp groups

// Groups of GS <= 32 lanes (aligned within a warp), kGroupCta / GS of them per CTA, each
// looping over its own blocks: no barrier, shuffles over the group's lanes only.
template <DType G, DType O, int K, int GS>
__global__ void __launch_bounds__(kGroupCta)
    lowbit_i8_warp_kernel(AdamArgs a, AdamLowbitBuffers b, int64_t nblocks, bool vec_ok,
                          const float* found_inf) {
  static_assert(GS >= 2 && GS <= 32 && (GS & (GS - 1)) == 0, "GS: a power of 2 up to 32");
  if (found_inf != nullptr && *found_inf != 0.0f) return;
  const int lane = threadIdx.x & 31;
  const WarpGroup<GS> grp{(0xffffffffu >> (32 - GS)) << (lane & ~(GS - 1))};
  const int t = threadIdx.x & (GS - 1);
  const int64_t groups = int64_t(gridDim.x) * (kGroupCta / GS);
  for (int64_t blk = (blockIdx.x * int64_t(kGroupCta) + threadIdx.x) / GS; blk < nblocks;
       blk += groups) {
    i8_any<G, O, K>(a, b, blk, vec_ok, t, GS, grp);
  }
}

// One CTA of blockDim.x threads (a multiple of 32, at most kMaxLowbitBlock / K) per block, K
// elements each.
template <DType G, DType O, int K>
__global__ void __launch_bounds__(kMaxLowbitBlock / K)
    lowbit_i8_cta_kernel(AdamArgs a, AdamLowbitBuffers b, int64_t nblocks, bool vec_ok,
                         const float* found_inf) {
  static_assert(kMaxLowbitBlock / K <= 1024, "at most 32 warps");
  if (found_inf != nullptr && *found_inf != 0.0f) return;
  __shared__ uint32_t red[2][2 * 32];  // [block parity][2 * warp + (0: m, 1: u)]
  const int t = threadIdx.x;
  int par = 0;
  // the loop bound is the same for every thread of the CTA: each barrier sees all of them
  for (int64_t blk = blockIdx.x; blk < nblocks; blk += gridDim.x) {
    const CtaGroup grp{red[par], t & 31, t >> 5, int(blockDim.x >> 5)};
    i8_any<G, O, K>(a, b, blk, vec_ok, t, int(blockDim.x), grp);
    par ^= 1;
  }
}

// ---- bf16 moments ----

template <DType G, int V>
struct Bf16Chunk {
  typename Lanes<V>::F p;
  typename GradLanes<G, V>::T g;
  typename Lanes<V>::H m, v;
};

template <DType G, int V>
__device__ __forceinline__ void bf16_load(const AdamLowbitBuffers& b, int64_t c,
                                          Bf16Chunk<G, V>& x) {
  x.p = reinterpret_cast<const typename Lanes<V>::F*>(b.p)[c];
  x.g = static_cast<const typename GradLanes<G, V>::T*>(b.g)[c];
  x.m = static_cast<const typename Lanes<V>::H*>(b.m)[c];
  x.v = static_cast<const typename Lanes<V>::H*>(b.v)[c];
}

template <DType G, DType O, int V>
__device__ __forceinline__ void bf16_step(const AdamArgs& a, const AdamLowbitBuffers& b, int64_t c,
                                          Bf16Chunk<G, V>& x) {
  using H = typename Lanes<V>::H;
  H nm{}, nv{}, ob{};
#pragma unroll
  for (int e = 0; e < V; ++e) {
    Scalar p(get(x.p, e)), m(bf16_to_float(uint16_t(half_at(x.m, e))));
    Scalar v(bf16_to_float(uint16_t(half_at(x.v, e)))), u(0.0f);
    u = adam_math(a, p, Scalar(grad_at<G>(x.g, e)), m, v, static_cast<Scalar*>(nullptr));
    put(x.p, e, p.x);
    set_half(nm, e, float_to_bf16(m.x));
    set_half(nv, e, float_to_bf16(v.x));
    if constexpr (O != DType::kNone) set_half(ob, e, out_bits<O>(p.x));
  }
  reinterpret_cast<typename Lanes<V>::F*>(b.p)[c] = x.p;
  static_cast<H*>(b.m)[c] = nm;
  static_cast<H*>(b.v)[c] = nv;
  if constexpr (O != DType::kNone) static_cast<H*>(b.out)[c] = ob;
}

// V = 4: chunks of 4 elements (buffers aligned for them), the n % 4 tail by block 0's threads;
// V = 1: element-wise. One chunk per thread per iteration (two, loads first, measured slower).
template <DType G, DType O, int V>
__global__ void __launch_bounds__(kThreads)
    lowbit_bf16_kernel(AdamArgs a, AdamLowbitBuffers b, const float* found_inf) {
  if (found_inf != nullptr && *found_inf != 0.0f) return;
  const int64_t nc = b.n / V;
  for (int64_t c = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; c < nc;
       c += int64_t(gridDim.x) * blockDim.x) {
    Bf16Chunk<G, V> x;
    bf16_load(b, c, x);
    bf16_step<G, O>(a, b, c, x);
  }
  if constexpr (V > 1) {
    const int64_t i = nc * V + threadIdx.x;
    if (blockIdx.x == 0 && i < b.n) {
      Bf16Chunk<G, 1> x;
      bf16_load(b, i, x);
      bf16_step<G, O>(a, b, i, x);
    }
  }
}

struct Launch {
  const AdamArgs& a;
  const AdamLowbitBuffers& b;
  const float* found_inf;
  cudaStream_t st;

  template <DType G, DType O, int K, int GS>
  int warp_groups(int64_t nblocks, bool vec_ok) const {
    static_assert(K * GS <= 256, "a warp group holds at most 256 elements");
    lowbit_i8_warp_kernel<G, O, K, GS>
        <<<grid_of(nblocks, kGroupCta / GS), kGroupCta, 0, st>>>(a, b, nblocks, vec_ok, found_inf);
    return int(cudaGetLastError());
  }
  // one CTA per block: ceil(block / K) threads, rounded up to whole warps
  template <DType G, DType O, int K>
  int cta_groups(int64_t nblocks, bool vec_ok) const {
    static_assert(kMaxLowbitBlock % (32 * K) == 0, "the largest block fills whole warps");
    const int threads = int((b.block + 32 * K - 1) / (32 * K)) * 32;
    lowbit_i8_cta_kernel<G, O, K>
        <<<grid_of(nblocks, 1), threads, 0, st>>>(a, b, nblocks, vec_ok, found_inf);
    return int(cudaGetLastError());
  }

  template <DType G, DType O>
  int run() const {
    constexpr uintptr_t gsize = sizeof(typename Storage<G>::T);
    if (b.fmt == MomentFormat::kBF16) {
      const bool vec = aligned(b.p, 16) && aligned(b.g, 4 * gsize) && aligned(b.m, 8) &&
                       aligned(b.v, 8) && (O == DType::kNone || aligned(b.out, 8));
      if (vec) {
        lowbit_bf16_kernel<G, O, 4>
            <<<grid_of(b.n / 4, kThreads), kThreads, 0, st>>>(a, b, found_inf);
      } else {
        lowbit_bf16_kernel<G, O, 1><<<grid_of(b.n, kThreads), kThreads, 0, st>>>(a, b, found_inf);
      }
      return int(cudaGetLastError());
    }
    // the 4-element layout: 16 bytes of p, 4 elements of g and out, 4 bytes of each code array
    const bool vec_ok = aligned(b.p, 16) && aligned(b.g, 4 * gsize) && aligned(b.m, 4) &&
                        aligned(b.v, 4) && (O == DType::kNone || aligned(b.out, 8));
    const int64_t nblocks = lowbit_num_blocks(b);
    // K = 8 elements per thread: groups of block / 8 threads (K * gs >= block)
    if (b.block <= 64) return warp_groups<G, O, 8, 8>(nblocks, vec_ok);
    if (b.block <= 128) return warp_groups<G, O, 8, 16>(nblocks, vec_ok);
    if (b.block <= 256) return warp_groups<G, O, 8, 32>(nblocks, vec_ok);
    return cta_groups<G, O, 8>(nblocks, vec_ok);
  }
};

template <DType G>
int by_out(const Launch& l) {
  switch (l.b.out_dtype) {
    case DType::kNone: return l.run<G, DType::kNone>();
    case DType::kBF16: return l.run<G, DType::kBF16>();
    case DType::kF16: return l.run<G, DType::kF16>();
    default: return int(cudaErrorInvalidValue);
  }
}

template <DType G>
int scan_as(const AdamLowbitBuffers& b, float scale, float* found_inf, cudaStream_t st) {
  if (aligned(b.g, 16)) {
    constexpr int kW = ScanLanes<G, true>::kW;
    const int grid = grid_of(b.n / kW, int64_t(kThreads) * kScanUnroll);
    lowbit_scan_kernel<G, true><<<grid, kThreads, 0, st>>>(b.g, b.n, scale, found_inf);
  } else {
    const int grid = grid_of(b.n, int64_t(kThreads) * kScanUnroll);
    lowbit_scan_kernel<G, false><<<grid, kThreads, 0, st>>>(b.g, b.n, scale, found_inf);
  }
  return int(cudaGetLastError());
}

int scan(const AdamLowbitBuffers& b, float scale, float* found_inf, cudaStream_t st) {
  switch (b.grad) {
    case DType::kF32: return scan_as<DType::kF32>(b, scale, found_inf, st);
    case DType::kBF16: return scan_as<DType::kBF16>(b, scale, found_inf, st);
    case DType::kF16: return scan_as<DType::kF16>(b, scale, found_inf, st);
    default: return int(cudaErrorInvalidValue);
  }
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
