// The CPU block loops of blockwise quantization, written once over a quant-traits type QT and
// included by each ISA's file after it has defined QT (quant_cpu_{scalar,avx2,avx512}.cpp).
// QT provides W (lanes; 0: no vector part) and, when W > 0:
//   Acc, acc_zero(), acc_max(Acc) -> uint32_t            running max of abs_bits(y)
//   absmax<D, E>(Acc, const QuantBuffers&, i) -> Acc      elements [i, i + W) folded in
//   quant<D, E, BITS>(const QuantBuffers&, i, BlockScale)  elements [i, i + W) of a finite block
//   dequant<O, BITS, ACC>(const DequantBuffers&, i, scale) elements [i, i + W)
// Vector chunks start at a block's first element and never cross its end; the rest of a block,
// and every element of a non-finite block, runs quant_math.h's scalar formulas, which give the
// same bits as the lanes (the same fp32 operations, rounded the same way).
#pragma once
#include <algorithm>
#include <stdexcept>

#include "quant_math.h"

namespace zk {
inline namespace ZK_ISA_NS {

// Bytes of elements [i, end) from f(j) -> q: int8 one byte each; int4 two per byte (i even, as
// every block starts on a byte), an odd end leaving the last byte's high nibble 0.
template <int BITS, class F>
inline void put_q_range(uint8_t* q, int64_t i, int64_t end, F&& f) {
  if constexpr (BITS == 8) {
    for (; i < end; ++i) q[i] = static_cast<uint8_t>(f(i));
  } else {
    for (; i + 1 < end; i += 2) {
      const int lo = f(i);
      q[i >> 1] = pack_int4(lo, f(i + 1));
    }
    if (i < end) q[i >> 1] = pack_int4(f(i), 0);
  }
}

template <class QT, DType D, bool E, int BITS>
void quantize_block(const QuantBuffers& b, int64_t blk) {
  const int64_t begin = blk * b.block;
  const int64_t end = std::min(begin + b.block, b.n);
  int64_t i = begin;
  uint32_t m = 0;
  if constexpr (QT::W > 0) {
    typename QT::Acc acc = QT::acc_zero();
    for (; i + QT::W <= end; i += QT::W) acc = QT::template absmax<D, E>(acc, b, i);
    m = QT::acc_max(acc);
  }
  for (; i < end; ++i) m = std::max(m, abs_bits(quant_load_y<D, E>(b, i)));
  const BlockScale s = block_scale(m, BITS == 8 ? 127.0f : 7.0f);
  b.scales[blk] = s.scale;
  i = begin;
  if constexpr (QT::W > 0) {
    if (s.finite) {
      for (; i + QT::W <= end; i += QT::W) QT::template quant<D, E, BITS>(b, i, s);
    }
  }
  put_q_range<BITS>(b.q, i, end, [&](int64_t j) { return quant_element<D, E, BITS>(b, j, s); });
}

template <class QT, DType D, bool E, int BITS>
void quantize_typed(const QuantBuffers& b, int64_t b0, int64_t b1) {
  for (int64_t blk = b0; blk < b1; ++blk) quantize_block<QT, D, E, BITS>(b, blk);
}

template <class QT, DType D, bool E>
void quantize_by_bits(const QuantBuffers& b, int64_t b0, int64_t b1) {
  if (b.bits == 8) return quantize_typed<QT, D, E, 8>(b, b0, b1);
  quantize_typed<QT, D, E, 4>(b, b0, b1);
}

template <class QT, DType D>
void quantize_by_error(const QuantBuffers& b, int64_t b0, int64_t b1) {
  if (b.error != nullptr) return quantize_by_bits<QT, D, true>(b, b0, b1);
  quantize_by_bits<QT, D, false>(b, b0, b1);
}

// Blocks [b0, b1) of b, any dtype, bits and error feedback (checked by quantize_cpu).
template <class QT>
void quantize_blocks(const QuantBuffers& b, int64_t b0, int64_t b1) {
  switch (b.x_dtype) {
    case DType::kF32: return quantize_by_error<QT, DType::kF32>(b, b0, b1);
    case DType::kBF16: return quantize_by_error<QT, DType::kBF16>(b, b0, b1);
    case DType::kF16: return quantize_by_error<QT, DType::kF16>(b, b0, b1);
    default: throw std::invalid_argument("quantize_cpu: x dtype must be fp32, bf16 or fp16");
  }
}

template <class QT, DType O, int BITS, bool ACC>
void dequantize_typed(const DequantBuffers& b, int64_t b0, int64_t b1) {
  using OT = typename Storage<O>::T;
  OT* out = static_cast<OT*>(b.out);
  for (int64_t blk = b0; blk < b1; ++blk) {
    const int64_t begin = blk * b.block;
    const int64_t end = std::min(begin + b.block, b.n);
    const float s = b.scales[blk];
    int64_t i = begin;
    if constexpr (QT::W > 0) {
      for (; i + QT::W <= end; i += QT::W) QT::template dequant<O, BITS, ACC>(b, i, s);
    }
    for (; i < end; ++i) {
      float v = q_mul(static_cast<float>(quant_get<BITS>(b.q, i)), s);
      if constexpr (ACC) v = q_add(static_cast<const float*>(b.out)[i], v);
      Storage<O>::store(out, i, v);
    }
  }
}

template <class QT, DType O, bool ACC>
void dequantize_by_bits(const DequantBuffers& b, int64_t b0, int64_t b1) {
  if (b.bits == 8) return dequantize_typed<QT, O, 8, ACC>(b, b0, b1);
  dequantize_typed<QT, O, 4, ACC>(b, b0, b1);
}

// Blocks [b0, b1) of b (accumulate only into fp32, checked by dequantize_cpu).
template <class QT>
void dequantize_blocks(const DequantBuffers& b, int64_t b0, int64_t b1) {
  switch (b.out_dtype) {
    case DType::kF32:
      if (b.accumulate) return dequantize_by_bits<QT, DType::kF32, true>(b, b0, b1);
      return dequantize_by_bits<QT, DType::kF32, false>(b, b0, b1);
    case DType::kBF16: return dequantize_by_bits<QT, DType::kBF16, false>(b, b0, b1);
    case DType::kF16: return dequantize_by_bits<QT, DType::kF16, false>(b, b0, b1);
    default: throw std::invalid_argument("dequantize_cpu: out dtype must be fp32, bf16 or fp16");
  }
}

}  // namespace ZK_ISA_NS
}  // namespace zk
