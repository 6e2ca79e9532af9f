#include "flat_copy.h"

#include <algorithm>
#include <cstring>

#include "sr_round.h"
#include "zk_convert.h"

namespace zk {

namespace {

size_t elem_size(DType d) { return d == DType::kF32 ? 4 : 2; }

float load_any(const void* p, DType d, int64_t i) {
  switch (d) {
    case DType::kF32: return static_cast<const float*>(p)[i];
    case DType::kBF16: return bf16_to_float(static_cast<const uint16_t*>(p)[i]);
    default: return f16_to_float(static_cast<const uint16_t*>(p)[i]);
  }
}

template <DType D, DType S>
void convert_range(void* dst, const void* src, int64_t b, int64_t e) {
  using DT = typename Storage<D>::T;
  using ST = typename Storage<S>::T;
  for (int64_t i = b; i < e; ++i) {
    Storage<D>::store(static_cast<DT*>(dst), i, Storage<S>::load(static_cast<const ST*>(src), i));
  }
}

void copy_range(const CopySegment& s, int64_t b, int64_t e) {
  if (s.dst_dtype == s.src_dtype) {
    const size_t es = elem_size(s.src_dtype);
    std::memcpy(static_cast<char*>(s.dst) + b * es, static_cast<const char*>(s.src) + b * es,
                size_t(e - b) * es);
    return;
  }
  if (s.dst_dtype == DType::kF32 && s.src_dtype == DType::kBF16) {
    return convert_range<DType::kF32, DType::kBF16>(s.dst, s.src, b, e);
  }
  if (s.dst_dtype == DType::kBF16 && s.src_dtype == DType::kF32) {
    return convert_range<DType::kBF16, DType::kF32>(s.dst, s.src, b, e);
  }
  if (s.dst_dtype == DType::kF32 && s.src_dtype == DType::kF16) {
    return convert_range<DType::kF32, DType::kF16>(s.dst, s.src, b, e);
  }
  if (s.dst_dtype == DType::kF16 && s.src_dtype == DType::kF32) {
    return convert_range<DType::kF16, DType::kF32>(s.dst, s.src, b, e);
  }
  for (int64_t i = b; i < e; ++i) {  // bf16 <-> fp16 through fp32
    const float x = load_any(s.src, s.src_dtype, i);
    uint16_t* d = static_cast<uint16_t*>(s.dst);
    d[i] = s.dst_dtype == DType::kBF16 ? float_to_bf16(x) : float_to_f16(x);
  }
}

}  // namespace

std::vector<int64_t> segment_starts(const std::vector<CopySegment>& segs) {
  std::vector<int64_t> starts(segs.size() + 1, 0);
  for (size_t i = 0; i < segs.size(); ++i) starts[i + 1] = starts[i] + segs[i].n;
  return starts;
}

void copy_segments_cpu(const std::vector<CopySegment>& segs, const std::vector<int64_t>& starts,
                       int64_t begin, int64_t end) {
  // first segment that holds `begin`
  size_t k = size_t(std::upper_bound(starts.begin(), starts.end(), begin) - starts.begin()) - 1;
  for (; k < segs.size() && starts[k] < end; ++k) {
    const int64_t b = std::max(begin, starts[k]) - starts[k];
    const int64_t e = std::min(end, starts[k + 1]) - starts[k];
    if (b < e) copy_range(segs[k], b, e);
  }
}

#if defined(__x86_64__) && defined(__GNUC__)
__attribute__((target_clones("avx2", "default")))
#endif
void sr_round_bf16_cpu(const float* src, uint16_t* dst, int64_t n, uint32_t key, uint32_t first) {
  sr_round_bf16(src, dst, n, key, first);
}

}  // namespace zk
