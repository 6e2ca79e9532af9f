// Flat-buffer copy-in / copy-out on the CPU, torch-free: many tensors to or from one flat
// buffer, converting fp32 / bf16 / fp16, split over threads by element ranges; and the
// stochastically rounded fp32 -> bf16 copy of bf16 params stepped without a master.
#pragma once
#include <cstdint>
#include <vector>

#include "zk_types.h"

namespace zk {

struct CopySegment {
  void* dst;
  DType dst_dtype;
  const void* src;
  DType src_dtype;
  int64_t n;
};

// Exclusive prefix sums of the segments' sizes, plus the total as the last entry.
std::vector<int64_t> segment_starts(const std::vector<CopySegment>& segs);

// Copy the elements [begin, end) of the concatenation of all segments.
void copy_segments_cpu(const std::vector<CopySegment>& segs, const std::vector<int64_t>& starts,
                       int64_t begin, int64_t end);

// bf16_stochastic_round's copy-out: sr_round.h's loop, with an AVX2 clone where the CPU has it.
void sr_round_bf16_cpu(const float* src, uint16_t* dst, int64_t n, uint32_t key, uint32_t first);

}  // namespace zk
