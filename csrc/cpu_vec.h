// Typed loads and stores over a CPU vector-traits type VT (fp32, bf16 or fp16 storage, fp32 lanes),
// shared by the Adam and the quantization kernels. VT provides load/load_bf16/load_f16 and
// store/store_bf16/store_f16 (ScalarTraits in adam_cpu_impl.h, Avx2Traits in cpu_vec_avx2.h,
// Avx512Traits in cpu_vec_avx512.h).
#pragma once
#include <cstdint>

#include "zk_types.h"

#ifndef ZK_ISA_NS
#define ZK_ISA_NS generic
#endif

namespace zk {
inline namespace ZK_ISA_NS {

template <class VT, DType D>
inline typename VT::V vload(const void* base, int64_t i) {
  if constexpr (D == DType::kF32) {
    return VT::load(static_cast<const float*>(base) + i);
  } else if constexpr (D == DType::kBF16) {
    return VT::load_bf16(static_cast<const uint16_t*>(base) + i);
  } else {
    return VT::load_f16(static_cast<const uint16_t*>(base) + i);
  }
}

template <class VT, DType D>
inline void vstore(void* base, int64_t i, typename VT::V v) {
  if constexpr (D == DType::kF32) {
    VT::store(static_cast<float*>(base) + i, v);
  } else if constexpr (D == DType::kBF16) {
    VT::store_bf16(static_cast<uint16_t*>(base) + i, v);
  } else {
    VT::store_f16(static_cast<uint16_t*>(base) + i, v);
  }
}

}  // namespace ZK_ISA_NS
}  // namespace zk
