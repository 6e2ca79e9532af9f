// The streaming probe's loops (adam_cpu.h: stream_probe_variant_cpu), written once over a vector
// traits type VT and included by each ISA's file after it has defined VT. VT provides what the
// Adam loops use (adam_cpu_impl.h) and store_nt(float*, V), a non-temporal store to a
// W * 4-byte-aligned address (ScalarTraits: a plain store).
// The vector loop runs in chunks of kProbeChunk elements, each chunk one 64-byte line of a byte
// stream, two of a 2-byte stream and four of a fp32 stream (the narrow streams as 8-byte words):
// one software prefetch per line per stream, and, with non-temporal stores, whole lines written by
// streaming stores (the head before the first chunk boundary and the tail run one element at a
// time, with plain stores).
#pragma once
#include <cstdint>
#include <cstring>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "adam_cpu.h"
#include "adam_cpu_impl.h"

namespace zk {
inline namespace ZK_ISA_NS {

constexpr int64_t kProbeChunk = 64;

// Bytes per element of m and v, and +1 on each code of an 8-byte word of them.
constexpr int64_t probe_moment_bytes(ProbePattern P) {
  return P == ProbePattern::kStep ? 4 : P == ProbePattern::kBF16 ? 2 : 1;
}
constexpr uint64_t probe_ones(ProbePattern P) {
  return P == ProbePattern::kBF16 ? 0x0001000100010001ull : 0x0101010101010101ull;
}

inline void probe_put_u64(uint8_t* q, uint64_t x, bool nt) {
#if defined(__x86_64__)
  if (nt) {
    _mm_stream_si64(reinterpret_cast<long long*>(q), static_cast<long long>(x));
    return;
  }
#endif
  (void)nt;
  std::memcpy(q, &x, sizeof(x));
}

inline void probe_fence(bool nt) {
#if defined(__x86_64__)
  if (nt) _mm_sfence();  // streaming stores are weakly ordered: order them before returning
#endif
  (void)nt;
}

// Elements [i, end) one at a time.
inline void probe_elems(const ProbeBuffers& b, int64_t i, int64_t end) {
  for (; i < end; ++i) {
    b.p[i] += b.g[i];
    if (b.pattern == ProbePattern::kStep) {
      static_cast<float*>(b.m)[i] += b.g[i];
      static_cast<float*>(b.v)[i] += b.g[i];
    } else if (b.pattern == ProbePattern::kBF16) {
      static_cast<uint16_t*>(b.m)[i] += 1;
      static_cast<uint16_t*>(b.v)[i] += 1;
    } else {
      static_cast<uint8_t*>(b.m)[i] += 1;
      static_cast<uint8_t*>(b.v)[i] += 1;
    }
  }
}

template <class VT, bool NT>
inline void probe_put(float* p, typename VT::V x) {
  if constexpr (NT) {
    VT::store_nt(p, x);
  } else {
    VT::store(p, x);
  }
}

// Whole chunks from i (a multiple of kProbeChunk); returns where they stopped.
template <class VT, ProbePattern P, bool NT, bool PF>
int64_t probe_chunks(const ProbeBuffers& b, int64_t i, int64_t end) {
  using V = typename VT::V;
  constexpr int64_t kMB = probe_moment_bytes(P);
  auto* m = static_cast<float*>(b.m);
  auto* v = static_cast<float*>(b.v);
  auto* mb = static_cast<uint8_t*>(b.m);
  auto* vb = static_cast<uint8_t*>(b.v);
  for (; i + kProbeChunk <= end; i += kProbeChunk) {
    if constexpr (PF) {
      const int64_t j = i + b.prefetch;
      for (int64_t l = 0; l < kProbeChunk; l += 16) {
        __builtin_prefetch(b.p + j + l, 1, 3);
        __builtin_prefetch(b.g + j + l, 0, 3);
        if constexpr (P == ProbePattern::kStep) {
          __builtin_prefetch(m + j + l, 1, 3);
          __builtin_prefetch(v + j + l, 1, 3);
        }
      }
      if constexpr (P != ProbePattern::kStep) {
        for (int64_t l = 0; l < kProbeChunk * kMB; l += 64) {
          __builtin_prefetch(mb + j * kMB + l, 1, 3);
          __builtin_prefetch(vb + j * kMB + l, 1, 3);
        }
      }
    }
    for (int64_t k = i; k < i + kProbeChunk; k += VT::W) {
      const V gk = VT::load(b.g + k);
      probe_put<VT, NT>(b.p + k, VT::load(b.p + k) + gk);
      if constexpr (P == ProbePattern::kStep) {
        probe_put<VT, NT>(m + k, VT::load(m + k) + gk);
        probe_put<VT, NT>(v + k, VT::load(v + k) + gk);
      }
    }
    if constexpr (P != ProbePattern::kStep) {
      for (int64_t k = i * kMB; k < (i + kProbeChunk) * kMB; k += 8) {
        uint64_t x, y;
        std::memcpy(&x, mb + k, sizeof(x));
        std::memcpy(&y, vb + k, sizeof(y));
        probe_put_u64(mb + k, x + probe_ones(P), NT);
        probe_put_u64(vb + k, y + probe_ones(P), NT);
      }
    }
  }
  probe_fence(NT);
  return i;
}

template <class VT, ProbePattern P>
int64_t probe_by_variant(const ProbeBuffers& b, int64_t i, int64_t end) {
  const bool pf = b.prefetch > 0;
  if (b.nt) {
    return pf ? probe_chunks<VT, P, true, true>(b, i, end)
              : probe_chunks<VT, P, true, false>(b, i, end);
  }
  return pf ? probe_chunks<VT, P, false, true>(b, i, end)
            : probe_chunks<VT, P, false, false>(b, i, end);
}

// Elements [begin, end) of the probe with VT's lanes (chunk-aligned part) and one at a time.
template <class VT>
void probe_range(const ProbeBuffers& b, int64_t begin, int64_t end) {
  int64_t i = begin;
  if constexpr (VT::W > 1) {
    int64_t head = (begin + kProbeChunk - 1) / kProbeChunk * kProbeChunk;
    head = head < end ? head : end;
    probe_elems(b, i, head);
    switch (b.pattern) {
      case ProbePattern::kStep: i = probe_by_variant<VT, ProbePattern::kStep>(b, head, end); break;
      case ProbePattern::kBF16: i = probe_by_variant<VT, ProbePattern::kBF16>(b, head, end); break;
      default: i = probe_by_variant<VT, ProbePattern::kInt8>(b, head, end); break;
    }
  }
  probe_elems(b, i, end);
}

}  // namespace ZK_ISA_NS
}  // namespace zk
