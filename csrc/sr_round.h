// Stochastic rounding of fp32 to bf16 for params stepped without an fp32 master
// (bf16_stochastic_round; zero_kernels/ops/sr.py [Note: stochastic rounding]), torch-free, usable
// on host and device. x rounds up (away from zero) to the next bf16 with probability equal to the
// dropped fraction: the 16 dropped bits plus 16 random bits, carried into the kept ones. The
// random bits are a hash of (key, element index), so a step gives the same bits on every rank,
// at every world size and on every backend; key = sr_key(seed, step, param index) (ops/sr.py).
#pragma once
#include <cstdint>

#include "zk_convert.h"

namespace zk {
inline namespace ZK_ISA_NS {

// A 32-bit integer hash with good avalanche (Wellons' "lowbias32" constants).
ZK_HD uint32_t sr_hash32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7feb352du;
  x ^= x >> 15;
  x *= 0x846ca68bu;
  x ^= x >> 16;
  return x;
}

// bf16 bits of x, rounded stochastically; inf and NaN as round to nearest (NaN stays quiet).
ZK_HD uint16_t sr_bf16(float x, uint32_t key, uint32_t index) {
  const uint32_t u = float_to_bits(x);
  if ((u & 0x7f800000u) == 0x7f800000u) return float_to_bf16(x);
  const uint32_t r = sr_hash32(key ^ sr_hash32(index)) & 0xffffu;
  return static_cast<uint16_t>((u + r) >> 16);
}

// dst[j] = sr_bf16(src[j], key, first + j) for j < n (the index wraps at 2^32).
inline void sr_round_bf16(const float* src, uint16_t* dst, int64_t n, uint32_t key,
                          uint32_t first) {
  for (int64_t j = 0; j < n; ++j) dst[j] = sr_bf16(src[j], key, first + static_cast<uint32_t>(j));
}

}  // namespace ZK_ISA_NS
}  // namespace zk
