// CPU Adam/AdamW step over one range [begin, end) of a flat buffer, torch-free.
// The caller (bindings.cpp) splits a buffer across threads; each call is single-threaded.
#pragma once
#include <cstdint>

#include "zk_types.h"

namespace zk {

enum class CpuIsa : int { kScalar = 0, kAVX2 = 1, kAVX512 = 2 };

CpuIsa cpu_isa_best();  // the widest instruction set this CPU runs (cpuid)
const char* cpu_isa_name(CpuIsa isa);

// One Adam/AdamW step over elements [begin, end). Every dtype combination of AdamBuffers runs;
// fp32 state + fp32 grad takes the vector path of `isa` (which must not exceed cpu_isa_best()).
void adam_step_cpu(const AdamArgs& args, const AdamBuffers& buf, int64_t begin, int64_t end,
                   CpuIsa isa);

// True when every grad[i] * scale, i in [begin, end), is finite.
bool all_finite_cpu(const void* grad, DType dtype, float scale, int64_t begin, int64_t end,
                    CpuIsa isa);

// The step's memory traffic without its math (benchmarks' bandwidth floor), elements [begin, end).
void stream_probe_cpu(float* p, const float* g, float* m, float* v, int64_t begin, int64_t end,
                      CpuIsa isa);

// Software prefetch distance of the CPU step loops (fp32 and low-bit), in elements ahead on each
// stream; 0 turns software prefetch off. Read once per call; the default is
// default_prefetch_distance() (512, or 128 on AMD family 0x19: adam_cpu_scalar.cpp).
int64_t prefetch_distance();
void set_prefetch_distance(int64_t elems);  // elems >= 0
int64_t default_prefetch_distance();

// The streaming floor of a step's access pattern with its variants (benchmarks, issue 25):
//   kStep: p, m, v fp32 read and written in place, g fp32 read (28 bytes per element);
//   kBF16: p fp32 and m, v 2 bytes each read and written, g fp32 read (20 bytes per element);
//   kInt8: p fp32 and m, v 1 byte each read and written, g fp32 read (16 bytes per element, the
//          int8-state step's traffic; its block scales, 16 bytes per block, not counted).
// Each element is changed by an add (p += g; m += g or each m code + 1, ...): the traffic of the
// step without its math. Variants: `prefetch` elements of software prefetch ahead on every stream
// (0: none), `nt` non-temporal (streaming) stores of the written streams (the buffers must be
// 64-byte aligned; the vector paths only, the scalar path stores normally).
enum class ProbePattern : int { kStep = 0, kBF16 = 1, kInt8 = 2 };
struct ProbeBuffers {
  float* p;
  const float* g;
  void* m;  // kStep: float*, kBF16: uint16_t*, kInt8: uint8_t*
  void* v;  // likewise
  ProbePattern pattern;
  int64_t prefetch;
  bool nt;
};
void stream_probe_variant_cpu(const ProbeBuffers& b, int64_t begin, int64_t end, CpuIsa isa);

// Per-ISA entry points (defined in adam_cpu_{scalar,avx2,avx512}.cpp).
void adam_range_scalar(const AdamArgs&, const AdamBuffers&, int64_t, int64_t);
void adam_range_avx2(const AdamArgs&, const AdamBuffers&, int64_t, int64_t);
void adam_range_avx512(const AdamArgs&, const AdamBuffers&, int64_t, int64_t);
bool finite_range_scalar(const void*, DType, float, int64_t, int64_t);
bool finite_range_avx2(const void*, DType, float, int64_t, int64_t);
bool finite_range_avx512(const void*, DType, float, int64_t, int64_t);
void stream_probe_scalar(float*, const float*, float*, float*, int64_t, int64_t);
void stream_probe_avx2(float*, const float*, float*, float*, int64_t, int64_t);
void stream_probe_avx512(float*, const float*, float*, float*, int64_t, int64_t);
void probe_variant_scalar(const ProbeBuffers&, int64_t, int64_t);
void probe_variant_avx2(const ProbeBuffers&, int64_t, int64_t);
void probe_variant_avx512(const ProbeBuffers&, int64_t, int64_t);

}  // namespace zk
