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

}  // namespace zk
