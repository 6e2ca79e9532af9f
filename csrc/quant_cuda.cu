// CUDA kernels of blockwise quantization. Torch-free: compiled by nvcc alone in CMake, and by
// torch's build in setup.py.
//
// - quantize: one warp per block (grid-stride over blocks). The lanes fold max |y| as bits
//   (quant_math.h: NaN above inf above finite), reduce it with shuffles, then write q (int4: one
//   byte, two elements, per lane and step) and the residuals; lane 0 writes the scale. A block is
//   read twice; the second read comes from L1/L2.
// - dequantize: a grid-stride loop over elements (int8) or bytes (int4, two elements each).
// - The formulas go through quant_math.h's q_* helpers (the _rn intrinsics), so nvcc cannot fuse
//   a multiply and an add: the bytes equal the CPU kernels' and the torch reference's.
#include <cuda_runtime.h>

#include <cstdint>

#define ZK_ISA_NS cuda
#include "quant_cuda.h"

namespace zk {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;

inline int grid_of(int64_t work_items, int64_t per_block) {
  int64_t blocks = (work_items + per_block - 1) / per_block;
  if (blocks < 1) blocks = 1;
  return static_cast<int>(blocks > 65535 * 8 ? 65535 * 8 : blocks);
}

__device__ __forceinline__ uint32_t warp_max(uint32_t v) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    const uint32_t o = __shfl_xor_sync(0xffffffffu, v, off);
    v = o > v ? o : v;
  }
  return v;
}

template <DType D, bool E, int BITS>
__global__ void quantize_kernel(QuantBuffers b, int64_t nblocks) {
  const int lane = threadIdx.x & 31;
  const int64_t first = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const int64_t stride = (int64_t(gridDim.x) * blockDim.x) >> 5;
  // the loop bound is the same for the 32 lanes of a warp: every shuffle sees all of them
  for (int64_t blk = first; blk < nblocks; blk += stride) {
    const int64_t begin = blk * b.block;
    const int64_t end = begin + b.block < b.n ? begin + b.block : b.n;
    uint32_t m = 0;
    for (int64_t i = begin + lane; i < end; i += 32) {
      const uint32_t a = abs_bits(quant_load_y<D, E>(b, i));
      m = a > m ? a : m;
    }
    const BlockScale s = block_scale(warp_max(m), BITS == 8 ? 127.0f : 7.0f);
    if (lane == 0) b.scales[blk] = s.scale;
    if constexpr (BITS == 8) {
      for (int64_t i = begin + lane; i < end; i += 32) {
        b.q[i] = static_cast<uint8_t>(quant_element<D, E, 8>(b, i, s));
      }
    } else {  // begin is even: byte k holds elements 2k, 2k + 1
      for (int64_t i = begin + 2 * lane; i < end; i += 64) {
        const int lo = quant_element<D, E, 4>(b, i, s);
        const int hi = i + 1 < end ? quant_element<D, E, 4>(b, i + 1, s) : 0;
        b.q[i >> 1] = pack_int4(lo, hi);
      }
    }
  }
}

template <DType O, int BITS, bool ACC>
__global__ void dequantize_kernel(DequantBuffers b) {
  using OT = typename Storage<O>::T;
  OT* out = static_cast<OT*>(b.out);
  const int64_t step = int64_t(gridDim.x) * blockDim.x;
  constexpr int per = BITS == 8 ? 1 : 2;  // elements per thread and step
  for (int64_t k = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; k * per < b.n; k += step) {
#pragma unroll
    for (int j = 0; j < per; ++j) {
      const int64_t i = k * per + j;
      if (i >= b.n) break;
      float v = q_mul(static_cast<float>(quant_get<BITS>(b.q, i)), b.scales[i / b.block]);
      if constexpr (ACC) v = q_add(static_cast<const float*>(b.out)[i], v);
      Storage<O>::store(out, i, v);
    }
  }
}

template <DType D, bool E>
int launch_quantize(const QuantBuffers& b, int64_t nblocks, cudaStream_t st) {
  const int grid = grid_of(nblocks, kWarps);
  if (b.bits == 8) {
    quantize_kernel<D, E, 8><<<grid, kThreads, 0, st>>>(b, nblocks);
  } else {
    quantize_kernel<D, E, 4><<<grid, kThreads, 0, st>>>(b, nblocks);
  }
  return int(cudaGetLastError());
}

template <DType D>
int quantize_by_error(const QuantBuffers& b, int64_t nblocks, cudaStream_t st) {
  if (b.error != nullptr) return launch_quantize<D, true>(b, nblocks, st);
  return launch_quantize<D, false>(b, nblocks, st);
}

template <DType O, bool ACC>
int launch_dequantize(const DequantBuffers& b, cudaStream_t st) {
  const int64_t items = b.bits == 8 ? b.n : (b.n + 1) / 2;
  const int grid = grid_of(items, int64_t(kThreads) * 4);
  if (b.bits == 8) {
    dequantize_kernel<O, 8, ACC><<<grid, kThreads, 0, st>>>(b);
  } else {
    dequantize_kernel<O, 4, ACC><<<grid, kThreads, 0, st>>>(b);
  }
  return int(cudaGetLastError());
}

bool layout_ok(int64_t n, int64_t block, int bits) {
  return n >= 0 && block > 0 && (bits == 8 || (bits == 4 && block % 2 == 0));
}

}  // namespace

int quantize_cuda(const QuantBuffers& b, void* stream) {
  if (!layout_ok(b.n, b.block, b.bits)) return int(cudaErrorInvalidValue);
  if (b.n == 0) return 0;
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  const int64_t nblocks = quant_num_blocks(b.n, b.block);
  switch (b.x_dtype) {
    case DType::kF32: return quantize_by_error<DType::kF32>(b, nblocks, st);
    case DType::kBF16: return quantize_by_error<DType::kBF16>(b, nblocks, st);
    case DType::kF16: return quantize_by_error<DType::kF16>(b, nblocks, st);
    default: return int(cudaErrorInvalidValue);
  }
}

int dequantize_cuda(const DequantBuffers& b, void* stream) {
  if (!layout_ok(b.n, b.block, b.bits)) return int(cudaErrorInvalidValue);
  if (b.accumulate && b.out_dtype != DType::kF32) return int(cudaErrorInvalidValue);
  if (b.n == 0) return 0;
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  switch (b.out_dtype) {
    case DType::kF32:
      if (b.accumulate) return launch_dequantize<DType::kF32, true>(b, st);
      return launch_dequantize<DType::kF32, false>(b, st);
    case DType::kBF16: return launch_dequantize<DType::kBF16, false>(b, st);
    case DType::kF16: return launch_dequantize<DType::kF16, false>(b, st);
    default: return int(cudaErrorInvalidValue);
  }
}

}  // namespace zk
