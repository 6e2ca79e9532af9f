// The CPU loops of the low-bit-state Adam step, written once over a traits type LT and included
// by each ISA's file after it has defined LT (adam_cpu_{scalar,avx2,avx512}.cpp). LT extends the
// Adam vector traits (adam_cpu_impl.h: V, W, load, store, finite_acc, all_zero) with:
//   dec_m(const int8_t*, float s) -> V      q * |q| * s of W codes
//   dec_u(const uint8_t*, float s) -> V     q * q * s
//   enc_m(int8_t*, const float* x, float inv), enc_u(uint8_t*, const float* x, float inv)
//   vabs(V), vmaxf(V, V) (finite lanes), hmax(V) -> float
// An int8 block runs in two passes over its own elements: the update (p and out written, the new
// m and u = sqrt(v) kept in an L1-resident scratch array, their maxima and finiteness folded),
// then the encode of the scratch into codes. Memory sees each byte once: one pass over the data.
#pragma once
#include <algorithm>
#include <cstring>
#include <stdexcept>

#include "adam_cpu_impl.h"
#include "adam_lowbit.h"

namespace zk {
inline namespace ZK_ISA_NS {

// One-lane low-bit traits: the tail of every block.
struct ScalarLowbit : ScalarTraits {
  static V dec_m(const int8_t* q, float s) { return Scalar(decode_m(*q, s)); }
  static V dec_u(const uint8_t* q, float s) { return Scalar(decode_u(*q, s)); }
  static void enc_m(int8_t* q, const float* x, float inv) {
    *q = static_cast<int8_t>(encode_m(*x, inv));
  }
  static void enc_u(uint8_t* q, const float* x, float inv) {
    *q = static_cast<uint8_t>(encode_u(*x, inv));
  }
  static V vabs(V x) { return Scalar(fabsf(x.x)); }
  static V vmaxf(V a, V b) { return Scalar(a.x > b.x ? a.x : b.x); }
  static float hmax(V x) { return x.x; }
};

struct BlockFold {
  int64_t i;  // where this pass stopped
  float amax_m, amax_u;
  bool finite;
};

// Pass 1 of an int8 block over [i, end) with LT's lanes (stops before a partial vector).
template <class LT, DType G, DType O>
BlockFold lowbit_update(const AdamArgs& a, const AdamLowbitBuffers& b, int64_t i, int64_t end,
                        float sm, float sv, float* tm, float* tu, int64_t base) {
  using V = typename LT::V;
  const auto* qm = static_cast<const int8_t*>(b.m);
  const auto* qv = static_cast<const uint8_t*>(b.v);
  V am(0.0f), au(0.0f), fin(0.0f);
  const int64_t pf = LT::W > 1 ? prefetch_distance() : 0;
  for (; i + LT::W <= end; i += LT::W) {
    if (pf > 0) {
      __builtin_prefetch(b.p + i + pf, 1, 3);
      __builtin_prefetch(elem_ptr<G>(b.g, i + pf), 0, 3);
    }
    V p = LT::load(b.p + i);
    V m = LT::dec_m(qm + i, sm);
    V u = LT::dec_u(qv + i, sv);
    V v = u * u;
    u = adam_math(a, p, vload<LT, G>(b.g, i), m, v, static_cast<V*>(nullptr));
    LT::store(b.p + i, p);
    if constexpr (O != DType::kNone) vstore<LT, O>(b.out, i, p);
    LT::store(tm + (i - base), m);
    LT::store(tu + (i - base), u);
    am = LT::vmaxf(am, LT::vabs(m));
    au = LT::vmaxf(au, u);
    fin = LT::finite_acc(fin, m);
    fin = LT::finite_acc(fin, u);
  }
  return BlockFold{i, LT::hmax(am), LT::hmax(au), LT::all_zero(fin)};
}

template <class LT>
int64_t lowbit_encode(const AdamLowbitBuffers& b, int64_t i, int64_t end, const float* tm,
                      const float* tu, int64_t base, float inv_m, float inv_u) {
  auto* qm = static_cast<int8_t*>(b.m);
  auto* qv = static_cast<uint8_t*>(b.v);
  for (; i + LT::W <= end; i += LT::W) {
    LT::enc_m(qm + i, tm + (i - base), inv_m);
    LT::enc_u(qv + i, tu + (i - base), inv_u);
  }
  return i;
}

template <class LT, DType G, DType O>
void lowbit_block_i8(const AdamArgs& a, const AdamLowbitBuffers& b, int64_t blk) {
  alignas(64) float tm[kMaxLowbitBlock];
  alignas(64) float tu[kMaxLowbitBlock];
  const int64_t begin = lowbit_block_begin(b, blk);
  const int64_t end = lowbit_block_end(b, blk);
  const float sm = b.m_scale[blk], sv = b.v_scale[blk];
  const BlockFold f1 = lowbit_update<LT, G, O>(a, b, begin, end, sm, sv, tm, tu, begin);
  const BlockFold f2 = lowbit_update<ScalarLowbit, G, O>(a, b, f1.i, end, sm, sv, tm, tu, begin);
  const bool finite = f1.finite && f2.finite;
  const LowbitScale s_m = lowbit_scale(std::max(f1.amax_m, f2.amax_m), kMCodes, finite);
  const LowbitScale s_u = lowbit_scale(std::max(f1.amax_u, f2.amax_u), kVCodes, finite);
  b.m_scale[blk] = s_m.scale;
  b.v_scale[blk] = s_u.scale;
  if (!finite) {  // codes 0 under a NaN scale: the state stays non-finite, as fp32 state would
    std::memset(static_cast<int8_t*>(b.m) + begin, 0, size_t(end - begin));
    std::memset(static_cast<uint8_t*>(b.v) + begin, 0, size_t(end - begin));
    return;
  }
  const int64_t i = lowbit_encode<LT>(b, begin, end, tm, tu, begin, s_m.inv, s_u.inv);
  lowbit_encode<ScalarLowbit>(b, i, end, tm, tu, begin, s_m.inv, s_u.inv);
}

// bf16 moments: one pass, element-wise, over [i, end) with LT's lanes.
template <class LT, DType G, DType O>
int64_t lowbit_bf16_lanes(const AdamArgs& a, const AdamLowbitBuffers& b, int64_t i, int64_t end) {
  using V = typename LT::V;
  const int64_t pf = LT::W > 1 ? prefetch_distance() : 0;
  for (; i + LT::W <= end; i += LT::W) {
    if (pf > 0) {
      __builtin_prefetch(b.p + i + pf, 1, 3);
      __builtin_prefetch(elem_ptr<DType::kBF16>(b.m, i + pf), 1, 3);
      __builtin_prefetch(elem_ptr<DType::kBF16>(b.v, i + pf), 1, 3);
      __builtin_prefetch(elem_ptr<G>(b.g, i + pf), 0, 3);
    }
    V p = LT::load(b.p + i);
    V m = vload<LT, DType::kBF16>(b.m, i), v = vload<LT, DType::kBF16>(b.v, i), u(0.0f);
    u = adam_math(a, p, vload<LT, G>(b.g, i), m, v, static_cast<V*>(nullptr));
    LT::store(b.p + i, p);
    vstore<LT, DType::kBF16>(b.m, i, m);
    vstore<LT, DType::kBF16>(b.v, i, v);
    if constexpr (O != DType::kNone) vstore<LT, O>(b.out, i, p);
  }
  return i;
}

template <class LT, DType G, DType O>
void lowbit_typed(const AdamArgs& a, const AdamLowbitBuffers& b, int64_t b0, int64_t b1) {
  if (b.fmt == MomentFormat::kInt8) {
    for (int64_t blk = b0; blk < b1; ++blk) lowbit_block_i8<LT, G, O>(a, b, blk);
    return;
  }
  const int64_t begin = b0 * b.block, end = std::min(b1 * b.block, b.n);
  const int64_t i = lowbit_bf16_lanes<LT, G, O>(a, b, begin, end);
  lowbit_bf16_lanes<ScalarLowbit, G, O>(a, b, i, end);
}

template <class LT, DType G>
void lowbit_by_out(const AdamArgs& a, const AdamLowbitBuffers& b, int64_t b0, int64_t b1) {
  switch (b.out_dtype) {
    case DType::kNone: return lowbit_typed<LT, G, DType::kNone>(a, b, b0, b1);
    case DType::kBF16: return lowbit_typed<LT, G, DType::kBF16>(a, b, b0, b1);
    case DType::kF16: return lowbit_typed<LT, G, DType::kF16>(a, b, b0, b1);
    default: throw std::invalid_argument("adam_lowbit_cpu: out dtype must be none, bf16 or fp16");
  }
}

// Blocks [b0, b1) of b, any grad and out dtype (kBF16: chunks of `block` elements).
template <class LT>
void lowbit_range(const AdamArgs& a, const AdamLowbitBuffers& b, int64_t b0, int64_t b1) {
  switch (b.grad) {
    case DType::kF32: return lowbit_by_out<LT, DType::kF32>(a, b, b0, b1);
    case DType::kBF16: return lowbit_by_out<LT, DType::kBF16>(a, b, b0, b1);
    case DType::kF16: return lowbit_by_out<LT, DType::kF16>(a, b, b0, b1);
    default: throw std::invalid_argument("adam_lowbit_cpu: grad dtype must be fp32, bf16 or fp16");
  }
}

}  // namespace ZK_ISA_NS
}  // namespace zk
