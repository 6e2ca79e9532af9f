// The one file that includes torch: checks tensors (device, dtype, contiguity, sizes, naming the
// argument), splits CPU work over torch's intra-op threads, and calls the torch-free kernels.
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <string>
#include <vector>

#include "adam_cpu.h"
#include "adam_lowbit.h"
#include "flat_copy.h"
#include "quant_cpu.h"
#include "zk_types.h"

#ifdef ZK_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "adam_cuda.h"
#include "adam_lowbit_cuda.h"
#include "quant_cuda.h"
#endif

namespace {

using zk::DType;

constexpr int64_t kGrain = 32768;  // elements per CPU task: large enough to amortise scheduling

zk::CpuIsa g_isa = zk::cpu_isa_best();

DType to_dtype(const at::Tensor& t, const char* name) {
  switch (t.scalar_type()) {
    case at::kFloat: return DType::kF32;
    case at::kBFloat16: return DType::kBF16;
    case at::kHalf: return DType::kF16;
    default:
      TORCH_CHECK_TYPE(false, name, ".dtype must be float32, bfloat16 or float16, got ",
                       t.scalar_type());
  }
}

void check_like(const at::Tensor& t, const at::Tensor& ref, const char* name) {
  TORCH_CHECK(t.device() == ref.device(), name, " is on ", t.device(), ", param is on ",
              ref.device());
  TORCH_CHECK(t.numel() == ref.numel(), name, ".numel()=", t.numel(),
              " differs from param.numel()=", ref.numel());
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous, got stride ", t.strides());
}

struct Scalars {
  double lr, beta1, beta2, eps, weight_decay, step_size, bc2_sqrt, grad_scale;
  bool adamw, amsgrad, maximize;
  zk::AdamArgs args() const {
    TORCH_CHECK(bc2_sqrt > 0.0, "bias_correction2_sqrt must be > 0, got ", bc2_sqrt);
    return zk::make_adam_args(lr, beta1, beta2, eps, weight_decay, step_size, bc2_sqrt, grad_scale,
                              adamw, amsgrad, maximize);
  }
};

zk::AdamBuffers make_buffers(const at::Tensor& p, const at::Tensor& g, const at::Tensor& m,
                             const at::Tensor& v, const c10::optional<at::Tensor>& vmax,
                             const c10::optional<at::Tensor>& out, bool amsgrad) {
  DType s = to_dtype(p, "param");
  check_like(g, p, "grad");
  check_like(m, p, "exp_avg");
  check_like(v, p, "exp_avg_sq");
  TORCH_CHECK(p.is_contiguous(), "param must be contiguous, got stride ", p.strides());
  DType gd = to_dtype(g, "grad");
  TORCH_CHECK_TYPE(gd == DType::kF32 || gd == s, "grad.dtype must be float32 or param.dtype (",
                   p.scalar_type(), "), got ", g.scalar_type());
  TORCH_CHECK_TYPE(m.scalar_type() == p.scalar_type() && v.scalar_type() == p.scalar_type(),
                   "exp_avg/exp_avg_sq must have param.dtype ", p.scalar_type(), ", got ",
                   m.scalar_type(), "/", v.scalar_type());
  void* vmax_ptr = nullptr;
  if (amsgrad) {
    TORCH_CHECK(vmax.has_value(), "amsgrad=True needs max_exp_avg_sq, got None");
    check_like(*vmax, p, "max_exp_avg_sq");
    TORCH_CHECK_TYPE(vmax->scalar_type() == p.scalar_type(), "max_exp_avg_sq must have dtype ",
                     p.scalar_type(), ", got ", vmax->scalar_type());
    vmax_ptr = vmax->data_ptr();
  }
  void* out_ptr = nullptr;
  DType od = DType::kNone;
  if (out.has_value()) {
    check_like(*out, p, "out_lowp");
    od = to_dtype(*out, "out_lowp");
    TORCH_CHECK_TYPE(od != DType::kF32, "out_lowp.dtype must be bfloat16 or float16, got float32");
    out_ptr = out->data_ptr();
  }
  return zk::AdamBuffers{p.data_ptr(), g.data_ptr(),
                         m.data_ptr(), v.data_ptr(),
                         vmax_ptr,     out_ptr,
                         p.numel(),    s,
                         gd,           od};
}

void check_found_inf(const c10::optional<at::Tensor>& found_inf, const at::Tensor& p,
                     bool check_finite) {
  if (check_finite) TORCH_CHECK(found_inf.has_value(), "check_finite=True needs found_inf");
  if (!found_inf.has_value()) return;
  TORCH_CHECK(found_inf->numel() == 1 && found_inf->scalar_type() == at::kFloat &&
                  found_inf->device() == p.device(),
              "found_inf must be one float32 element on ", p.device(), ", got shape ",
              found_inf->sizes(), " dtype ", found_inf->scalar_type(), " on ", found_inf->device());
}

// ---- CPU ----
bool all_finite_range(const void* g, DType gd, float scale, int64_t n) {
  std::atomic<bool> ok{true};
  at::parallel_for(0, n, kGrain, [&](int64_t b, int64_t e) {
    if (ok.load(std::memory_order_relaxed) && !zk::all_finite_cpu(g, gd, scale, b, e, g_isa)) {
      ok.store(false, std::memory_order_relaxed);
    }
  });
  return ok.load();
}

void step_cpu(const zk::AdamArgs& a, const std::vector<zk::AdamBuffers>& bufs,
              const c10::optional<at::Tensor>& found_inf, bool check_finite) {
  float* flag = found_inf.has_value() ? found_inf->data_ptr<float>() : nullptr;
  if (flag != nullptr && *flag != 0.0f) return;
  if (check_finite) {
    for (const auto& b : bufs) {
      if (!all_finite_range(b.g, b.grad, a.grad_scale, b.n)) {
        *flag = 1.0f;
        return;
      }
    }
  }
  for (const auto& b : bufs) {
    at::parallel_for(0, b.n, kGrain,
                     [&](int64_t s, int64_t e) { zk::adam_step_cpu(a, b, s, e, g_isa); });
  }
}

#ifdef ZK_WITH_CUDA
void cuda_ok(int err, const char* what) {
  TORCH_CHECK(err == 0, what, " failed: ", zk::cuda_error_string(err));
}
#endif

void run_step(const std::vector<zk::AdamBuffers>& bufs, const at::Tensor& p0,
              const c10::optional<at::Tensor>& found_inf, bool check_finite, const Scalars& s) {
  const zk::AdamArgs a = s.args();
  if (p0.is_cpu()) return step_cpu(a, bufs, found_inf, check_finite);
#ifdef ZK_WITH_CUDA
  TORCH_CHECK(p0.is_cuda(), "param must be a CPU or CUDA tensor, got ", p0.device());
  c10::cuda::CUDAGuard guard(p0.device());
  void* stream = c10::cuda::getCurrentCUDAStream().stream();
  float* flag = found_inf.has_value() ? found_inf->data_ptr<float>() : nullptr;
  if (bufs.size() == 1) {
    cuda_ok(zk::adam_step_cuda(a, bufs[0], flag, check_finite, stream), "adam_step_cuda");
  } else {
    cuda_ok(zk::adam_step_multi_cuda(a, bufs.data(), int(bufs.size()), flag, check_finite, stream),
            "adam_step_multi_cuda");
  }
#else
  TORCH_CHECK(false, "zero_kernels._C was built without CUDA kernels; param is on ", p0.device());
#endif
}

void adam_step(const at::Tensor& p, const at::Tensor& g, const at::Tensor& m, const at::Tensor& v,
               const c10::optional<at::Tensor>& vmax, const c10::optional<at::Tensor>& out,
               const c10::optional<at::Tensor>& found_inf, bool check_finite, double lr,
               double beta1, double beta2, double eps, double weight_decay, double step_size,
               double bc2_sqrt, double grad_scale, bool adamw, bool amsgrad, bool maximize) {
  Scalars s{lr,       beta1,      beta2, eps,     weight_decay, step_size,
            bc2_sqrt, grad_scale, adamw, amsgrad, maximize};
  check_found_inf(found_inf, p, check_finite);
  std::vector<zk::AdamBuffers> bufs{make_buffers(p, g, m, v, vmax, out, amsgrad)};
  run_step(bufs, p, found_inf, check_finite, s);
}

void adam_step_multi(const std::vector<at::Tensor>& ps, const std::vector<at::Tensor>& gs,
                     const std::vector<at::Tensor>& ms, const std::vector<at::Tensor>& vs,
                     const std::vector<at::Tensor>& vmaxes,
                     const c10::optional<at::Tensor>& found_inf, bool check_finite, double lr,
                     double beta1, double beta2, double eps, double weight_decay, double step_size,
                     double bc2_sqrt, double grad_scale, bool adamw, bool amsgrad, bool maximize) {
  const size_t n = ps.size();
  TORCH_CHECK(gs.size() == n && ms.size() == n && vs.size() == n,
              "params/grads/exp_avgs/exp_avg_sqs must have one length, got ", n, "/", gs.size(),
              "/", ms.size(), "/", vs.size());
  TORCH_CHECK(!amsgrad || vmaxes.size() == n, "amsgrad=True needs ", n, " max_exp_avg_sqs, got ",
              vmaxes.size());
  if (n == 0) return;
  Scalars s{lr,       beta1,      beta2, eps,     weight_decay, step_size,
            bc2_sqrt, grad_scale, adamw, amsgrad, maximize};
  check_found_inf(found_inf, ps[0], check_finite);
  std::vector<zk::AdamBuffers> bufs;
  bufs.reserve(n);
  for (size_t i = 0; i < n; ++i) {
    TORCH_CHECK(ps[i].device() == ps[0].device() && ps[i].scalar_type() == ps[0].scalar_type() &&
                    gs[i].scalar_type() == gs[0].scalar_type(),
                "params[", i, "] differs in device or dtype from params[0]; group them first");
    c10::optional<at::Tensor> vm;
    if (amsgrad) vm = vmaxes[i];
    bufs.push_back(make_buffers(ps[i], gs[i], ms[i], vs[i], vm, c10::nullopt, amsgrad));
  }
  run_step(bufs, ps[0], found_inf, check_finite, s);
}

bool all_finite(const at::Tensor& g, double scale) {
  TORCH_CHECK(g.is_cpu(), "all_finite: grad must be a CPU tensor, got ", g.device());
  TORCH_CHECK(g.is_contiguous(), "all_finite: grad must be contiguous");
  return all_finite_range(g.data_ptr(), to_dtype(g, "grad"), float(scale), g.numel());
}

// bf16_stochastic_round (sr_round.h): element j's random bits from (key, first + j).
void sr_round_bf16(const at::Tensor& src, const at::Tensor& dst, int64_t key, int64_t first) {
  TORCH_CHECK(src.is_cpu() && dst.is_cpu() && src.scalar_type() == at::kFloat &&
                  dst.scalar_type() == at::kBFloat16 && src.is_contiguous() &&
                  dst.is_contiguous() && dst.numel() == src.numel(),
              "sr_round_bf16: src fp32 and dst bf16 must be contiguous CPU tensors of one numel");
  const float* s = src.data_ptr<float>();
  auto* d = reinterpret_cast<uint16_t*>(dst.data_ptr());
  at::parallel_for(0, src.numel(), kGrain, [&](int64_t b, int64_t e) {
    zk::sr_round_bf16_cpu(s + b, d + b, e - b, uint32_t(key), uint32_t(first + b));
  });
}

// ---- flat buffers ----
// Copy each tensor into flat[offsets[i] : offsets[i] + numel] (to_flat) or back (from flat),
// converting dtypes. CPU work is split over threads by elements, not by tensors, so one large
// tensor among many small ones does not serialise the copy.
void flat_copy(const std::vector<at::Tensor>& tensors, const at::Tensor& flat,
               const std::vector<int64_t>& offsets, bool to_flat) {
  TORCH_CHECK(offsets.size() == tensors.size(), "offsets has ", offsets.size(), " entries for ",
              tensors.size(), " tensors");
  TORCH_CHECK(flat.dim() == 1 && flat.is_contiguous(), "flat must be a contiguous 1-D tensor");
  const DType fd = to_dtype(flat, "flat");
  std::vector<zk::CopySegment> segs;
  segs.reserve(tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    const at::Tensor& t = tensors[i];
    TORCH_CHECK(t.device() == flat.device(), "tensors[", i, "] is on ", t.device(), ", flat is on ",
                flat.device());
    TORCH_CHECK(t.is_contiguous(), "tensors[", i, "] must be contiguous, got stride ", t.strides());
    TORCH_CHECK(offsets[i] >= 0 && offsets[i] + t.numel() <= flat.numel(), "tensors[", i,
                "] (numel ", t.numel(), ") at offset ", offsets[i],
                " does not fit in flat of numel ", flat.numel());
    const DType td = to_dtype(t, "tensors[i]");
    const size_t fsz = fd == DType::kF32 ? 4 : 2;
    char* fptr = static_cast<char*>(flat.data_ptr()) + offsets[i] * int64_t(fsz);
    if (to_flat) {
      segs.push_back({fptr, fd, t.data_ptr(), td, t.numel()});
    } else {
      segs.push_back({t.data_ptr(), td, fptr, fd, t.numel()});
    }
  }
  if (flat.is_cpu()) {
    std::vector<int64_t> starts = zk::segment_starts(segs);
    at::parallel_for(0, starts.back(), kGrain,
                     [&](int64_t b, int64_t e) { zk::copy_segments_cpu(segs, starts, b, e); });
    return;
  }
#ifdef ZK_WITH_CUDA
  c10::cuda::CUDAGuard guard(flat.device());
  void* stream = c10::cuda::getCurrentCUDAStream().stream();
  for (const auto& s : segs) {
    cuda_ok(zk::convert_copy_cuda(s.dst, s.dst_dtype, s.src, s.src_dtype, s.n, stream),
            "convert_copy_cuda");
  }
#else
  TORCH_CHECK(false, "zero_kernels._C was built without CUDA kernels; flat is on ", flat.device());
#endif
}

// p += g, m += g, v += g over CPU fp32 tensors: the step's memory traffic without its math.
void stream_probe(const at::Tensor& p, const at::Tensor& g, const at::Tensor& m,
                  const at::Tensor& v) {
  TORCH_CHECK(p.is_cpu() && p.scalar_type() == at::kFloat && p.is_contiguous(),
              "stream_probe: p must be a contiguous float32 CPU tensor");
  check_like(g, p, "g");
  check_like(m, p, "m");
  check_like(v, p, "v");
  TORCH_CHECK(g.scalar_type() == at::kFloat && m.scalar_type() == at::kFloat &&
                  v.scalar_type() == at::kFloat,
              "stream_probe: g, m, v must be float32");
  float* pp = p.data_ptr<float>();
  const float* gp = g.data_ptr<float>();
  float* mp = m.data_ptr<float>();
  float* vp = v.data_ptr<float>();
  at::parallel_for(0, p.numel(), kGrain, [&](int64_t s, int64_t e) {
    zk::stream_probe_cpu(pp, gp, mp, vp, s, e, g_isa);
  });
}

// The step's access pattern with no math, in one variant (adam_cpu.h: stream_probe_variant_cpu):
// m, v float32 (the fp32 step, 28 bytes per element), bfloat16 (the bf16-state step, 20) or int8,
// uint8 (the int8-state step, 16). `threads` > 0: at most that many tasks (0: torch's intra-op
// threads). Returns the seconds of the parallel region (steady clock).
double stream_probe_variant(const at::Tensor& p, const at::Tensor& g, const at::Tensor& m,
                            const at::Tensor& v, int64_t prefetch, bool nt, int64_t threads) {
  TORCH_CHECK(p.is_cpu() && p.scalar_type() == at::kFloat && p.is_contiguous(),
              "stream_probe_variant: p must be a contiguous float32 CPU tensor");
  check_like(g, p, "g");
  check_like(m, p, "m");
  check_like(v, p, "v");
  TORCH_CHECK(g.scalar_type() == at::kFloat, "stream_probe_variant: g must be float32");
  zk::ProbePattern pattern = zk::ProbePattern::kInt8;
  if (m.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat) {
    pattern = zk::ProbePattern::kStep;
  } else if (m.scalar_type() == at::kBFloat16 && v.scalar_type() == at::kBFloat16) {
    pattern = zk::ProbePattern::kBF16;
  } else {
    TORCH_CHECK(m.scalar_type() == at::kChar && v.scalar_type() == at::kByte,
                "stream_probe_variant: m, v must be float32, bfloat16, or int8 and uint8, got ",
                m.scalar_type(), ", ", v.scalar_type());
  }
  TORCH_CHECK(prefetch >= 0, "stream_probe_variant: prefetch must be >= 0, got ", prefetch);
  TORCH_CHECK(threads >= 0, "stream_probe_variant: threads must be >= 0, got ", threads);
  if (nt) {
    for (const at::Tensor* t : {&p, &m, &v}) {
      TORCH_CHECK(reinterpret_cast<uintptr_t>(t->data_ptr()) % 64 == 0,
                  "stream_probe_variant: nt=True needs 64-byte aligned p, m, v");
    }
  }
  const zk::ProbeBuffers b{
      p.data_ptr<float>(), g.data_ptr<float>(), m.data_ptr(), v.data_ptr(), pattern, prefetch, nt};
  const int64_t n = p.numel();
  const int64_t grain = threads > 0 ? std::max<int64_t>(1, (n + threads - 1) / threads) : kGrain;
  const auto t0 = std::chrono::steady_clock::now();
  at::parallel_for(0, n, grain,
                   [&](int64_t s, int64_t e) { zk::stream_probe_variant_cpu(b, s, e, g_isa); });
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

int64_t prefetch_distance() { return zk::prefetch_distance(); }

void set_prefetch_distance(int64_t elems) {
  TORCH_CHECK_VALUE(elems >= 0, "set_prefetch_distance: elems must be >= 0, got ", elems);
  zk::set_prefetch_distance(elems);
}

// ---- blockwise quantization (zero_kernels/ops/quant.py [Note: quantized bytes]) ----
// The Python layer checks the arguments with the messages users see; these checks keep a wrong
// call from reading or writing outside a tensor.
void check_quant_layout(int64_t bits, int64_t block) {
  TORCH_CHECK_VALUE(bits == 4 || bits == 8, "bits must be 4 or 8, got ", bits);
  TORCH_CHECK_VALUE(block > 0 && (bits == 8 || block % 2 == 0),
                    "block must be > 0 (and even for bits=4), got ", block);
}

void check_quant_tensor(const at::Tensor& t, const at::Tensor& ref, const char* name,
                        at::ScalarType dtype, int64_t numel) {
  TORCH_CHECK(t.device() == ref.device(), name, " is on ", t.device(), ", expected ", ref.device());
  TORCH_CHECK_TYPE(t.scalar_type() == dtype, name, ".dtype must be ", dtype, ", got ",
                   t.scalar_type());
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous, got stride ", t.strides());
  TORCH_CHECK(t.numel() == numel, name, ".numel()=", t.numel(), ", expected ", numel);
}

int64_t quant_grain(int64_t block) { return std::max<int64_t>(1, kGrain / block); }

// ---- low-bit moments (zero_kernels/ops/lowbit.py [Note: low-bit state]) ----
void adam_step_lowbit(const at::Tensor& p, const at::Tensor& g, const at::Tensor& m,
                      const at::Tensor& v, const c10::optional<at::Tensor>& m_scale,
                      const c10::optional<at::Tensor>& v_scale,
                      const c10::optional<at::Tensor>& out,
                      const c10::optional<at::Tensor>& found_inf, bool check_finite, int64_t block,
                      const c10::optional<at::Tensor>& starts, double lr, double beta1,
                      double beta2, double eps, double weight_decay, double step_size,
                      double bc2_sqrt, double grad_scale, bool adamw, bool maximize) {
  TORCH_CHECK_TYPE(p.scalar_type() == at::kFloat, "param must be float32 (the master), got ",
                   p.scalar_type());
  TORCH_CHECK(p.is_contiguous(), "param must be contiguous, got stride ", p.strides());
  check_like(g, p, "grad");
  check_like(m, p, "exp_avg");
  check_like(v, p, "exp_avg_sq");
  TORCH_CHECK_VALUE(block >= 64 && block <= zk::kMaxLowbitBlock && block % 64 == 0,
                    "block must be a multiple of 64 in [64, ", zk::kMaxLowbitBlock, "], got ",
                    block);
  zk::AdamLowbitBuffers b{};
  b.p = p.data_ptr<float>();
  b.g = g.data_ptr();
  b.grad = to_dtype(g, "grad");
  b.m = m.data_ptr();
  b.v = v.data_ptr();
  b.n = p.numel();
  b.block = block;
  int64_t nb = (b.n + block - 1) / block;
  if (starts.has_value()) {  // the blocks of a sharded step follow its pieces
    TORCH_CHECK(starts->scalar_type() == at::kLong && starts->dim() == 1 &&
                    starts->is_contiguous() && starts->is_cpu() && starts->numel() >= 2,
                "block_starts must be a contiguous 1-D int64 CPU tensor of >= 2 entries");
    const int64_t* st = starts->data_ptr<int64_t>();
    nb = starts->numel() - 1;
    TORCH_CHECK_VALUE(st[0] == 0 && st[nb] == b.n, "block_starts must run from 0 to ", b.n,
                      ", got ", st[0], " to ", st[nb]);
    for (int64_t k = 0; k < nb; ++k) {
      TORCH_CHECK_VALUE(st[k + 1] > st[k] && st[k + 1] - st[k] <= block, "block_starts[", k + 1,
                        "] - block_starts[", k, "] = ", st[k + 1] - st[k],
                        " must be in [1, block=", block, "]");
    }
    b.starts = st;
    b.nblocks = nb;
  }
  if (m.scalar_type() == at::kBFloat16) {
    TORCH_CHECK(!starts.has_value(), "block_starts is for int8 moments; exp_avg is bfloat16");
    TORCH_CHECK_TYPE(v.scalar_type() == at::kBFloat16, "exp_avg is bfloat16, exp_avg_sq is ",
                     v.scalar_type());
    b.fmt = zk::MomentFormat::kBF16;
  } else {
    TORCH_CHECK_TYPE(m.scalar_type() == at::kChar && v.scalar_type() == at::kByte,
                     "exp_avg/exp_avg_sq must be bfloat16/bfloat16 or int8/uint8, got ",
                     m.scalar_type(), "/", v.scalar_type());
    TORCH_CHECK(m_scale.has_value() && v_scale.has_value(),
                "int8 moments need exp_avg_scale and exp_avg_sq_scale");
    check_quant_tensor(*m_scale, p, "exp_avg_scale", at::kFloat, nb);
    check_quant_tensor(*v_scale, p, "exp_avg_sq_scale", at::kFloat, nb);
    b.m_scale = m_scale->data_ptr<float>();
    b.v_scale = v_scale->data_ptr<float>();
    b.fmt = zk::MomentFormat::kInt8;
  }
  b.out_dtype = DType::kNone;
  if (out.has_value()) {
    check_like(*out, p, "out_lowp");
    b.out_dtype = to_dtype(*out, "out_lowp");
    TORCH_CHECK_TYPE(b.out_dtype != DType::kF32, "out_lowp.dtype must be bfloat16 or float16");
    b.out = out->data_ptr();
  }
  check_found_inf(found_inf, p, check_finite);
  Scalars s{lr,       beta1,      beta2, eps,   weight_decay, step_size,
            bc2_sqrt, grad_scale, adamw, false, maximize};
  const zk::AdamArgs a = s.args();
  float* flag = found_inf.has_value() ? found_inf->data_ptr<float>() : nullptr;
  if (!p.is_cpu()) {
#ifdef ZK_WITH_CUDA
    TORCH_CHECK(p.is_cuda(), "adam_step_lowbit: param must be a CPU or CUDA tensor, got ",
                p.device());
    c10::cuda::CUDAGuard guard(p.device());
    void* stream = c10::cuda::getCurrentCUDAStream().stream();
    at::Tensor dev_starts;  // checked on the host above; the kernel reads a device copy
    if (starts.has_value()) {
      dev_starts = starts->to(p.device(), /*non_blocking=*/true);
      b.starts = dev_starts.data_ptr<int64_t>();
    }
    cuda_ok(zk::adam_lowbit_cuda(a, b, flag, check_finite, stream), "adam_lowbit_cuda");
    return;
#else
    TORCH_CHECK(false,
                "adam_step_lowbit: zero_kernels._C was built without CUDA kernels; param is on ",
                p.device(), " (backend='triton' or 'reference' runs on other devices)");
#endif
  }
  if (flag != nullptr && *flag != 0.0f) return;
  if (check_finite && !all_finite_range(b.g, b.grad, a.grad_scale, b.n)) {
    *flag = 1.0f;
    return;
  }
  at::parallel_for(0, nb, quant_grain(block),
                   [&](int64_t b0, int64_t b1) { zk::adam_lowbit_cpu(a, b, b0, b1, int(g_isa)); });
}

void quantize_blockwise(const at::Tensor& x, const c10::optional<at::Tensor>& error,
                        const at::Tensor& q, const at::Tensor& scales, int64_t bits,
                        int64_t block) {
  check_quant_layout(bits, block);
  TORCH_CHECK(x.is_contiguous(), "x must be contiguous, got stride ", x.strides());
  const int64_t n = x.numel();
  const DType xd = to_dtype(x, "x");
  check_quant_tensor(q, x, "q", at::kByte, zk::quant_packed_bytes(n, int(bits)));
  check_quant_tensor(scales, x, "scales", at::kFloat, zk::quant_num_blocks(n, block));
  float* err = nullptr;
  if (error.has_value()) {
    check_quant_tensor(*error, x, "error", at::kFloat, n);
    err = error->data_ptr<float>();
  }
  if (n == 0) return;
  const zk::QuantBuffers b{
      x.data_ptr(), xd, err, q.data_ptr<uint8_t>(), scales.data_ptr<float>(), n, block, int(bits)};
  if (x.is_cpu()) {
    at::parallel_for(0, zk::quant_num_blocks(n, block), quant_grain(block),
                     [&](int64_t b0, int64_t b1) { zk::quantize_cpu(b, b0, b1, g_isa); });
    return;
  }
#ifdef ZK_WITH_CUDA
  TORCH_CHECK(x.is_cuda(), "x must be a CPU or CUDA tensor, got ", x.device());
  c10::cuda::CUDAGuard guard(x.device());
  cuda_ok(zk::quantize_cuda(b, c10::cuda::getCurrentCUDAStream().stream()), "quantize_cuda");
#else
  TORCH_CHECK(false, "zero_kernels._C was built without CUDA kernels; x is on ", x.device());
#endif
}

void dequantize_blockwise(const at::Tensor& q, const at::Tensor& scales, const at::Tensor& out,
                          int64_t bits, int64_t block, bool accumulate) {
  check_quant_layout(bits, block);
  TORCH_CHECK(out.is_contiguous(), "out must be contiguous, got stride ", out.strides());
  const int64_t n = out.numel();
  const DType od = to_dtype(out, "out");
  TORCH_CHECK_TYPE(!accumulate || od == DType::kF32, "accumulate=True needs a float32 out, got ",
                   out.scalar_type());
  check_quant_tensor(q, out, "q", at::kByte, zk::quant_packed_bytes(n, int(bits)));
  check_quant_tensor(scales, out, "scales", at::kFloat, zk::quant_num_blocks(n, block));
  if (n == 0) return;
  const zk::DequantBuffers b{q.data_ptr<uint8_t>(),
                             scales.data_ptr<float>(),
                             out.data_ptr(),
                             od,
                             accumulate,
                             n,
                             block,
                             int(bits)};
  if (out.is_cpu()) {
    at::parallel_for(0, zk::quant_num_blocks(n, block), quant_grain(block),
                     [&](int64_t b0, int64_t b1) { zk::dequantize_cpu(b, b0, b1, g_isa); });
    return;
  }
#ifdef ZK_WITH_CUDA
  TORCH_CHECK(out.is_cuda(), "out must be a CPU or CUDA tensor, got ", out.device());
  c10::cuda::CUDAGuard guard(out.device());
  cuda_ok(zk::dequantize_cuda(b, c10::cuda::getCurrentCUDAStream().stream()), "dequantize_cuda");
#else
  TORCH_CHECK(false, "zero_kernels._C was built without CUDA kernels; out is on ", out.device());
#endif
}

std::string cpu_isa() { return zk::cpu_isa_name(g_isa); }

void set_cpu_isa(const std::string& name) {
  zk::CpuIsa want;
  if (name == "auto") {
    want = zk::cpu_isa_best();
  } else if (name == "avx512") {
    want = zk::CpuIsa::kAVX512;
  } else if (name == "avx2") {
    want = zk::CpuIsa::kAVX2;
  } else if (name == "scalar") {
    want = zk::CpuIsa::kScalar;
  } else {
    TORCH_CHECK_VALUE(false, "isa must be one of auto, avx512, avx2, scalar, got '", name, "'");
  }
  TORCH_CHECK_VALUE(int(want) <= int(zk::cpu_isa_best()), "isa='", name,
                    "' is not supported by this CPU (best: ", zk::cpu_isa_name(zk::cpu_isa_best()),
                    ")");
  g_isa = want;
}

bool has_cuda() {
#ifdef ZK_WITH_CUDA
  return true;
#else
  return false;
#endif
}

// The CUDA images compiled in, comma-separated ("sm_80,sm_90,compute_90": machine code, and PTX
// the driver compiles for newer GPUs), as setup.py passes them; "" without CUDA kernels or where
// the build did not say (backend "auto" checks the device against it: ops/backends.py).
#define ZK_STR_(...) #__VA_ARGS__
#define ZK_STR(...) ZK_STR_(__VA_ARGS__)
std::string cuda_archs() {
#if defined(ZK_WITH_CUDA) && defined(ZK_CUDA_ARCHS)
  return ZK_STR(ZK_CUDA_ARCHS);
#else
  return "";
#endif
}

}  // namespace

// bindings_host.cpp: the host services' bindings, added to the same module
void register_host(py::module_& m);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "zero_kernels native kernels: fused Adam/AdamW step, flat copies, quantization";
  m.def("adam_step", &adam_step, "One fused Adam/AdamW step over one flat buffer (in place)",
        py::arg("param"), py::arg("grad"), py::arg("exp_avg"), py::arg("exp_avg_sq"),
        py::arg("max_exp_avg_sq"), py::arg("out_lowp"), py::arg("found_inf"),
        py::arg("check_finite"), py::arg("lr"), py::arg("beta1"), py::arg("beta2"), py::arg("eps"),
        py::arg("weight_decay"), py::arg("step_size"), py::arg("bc2_sqrt"), py::arg("grad_scale"),
        py::arg("adamw"), py::arg("amsgrad"), py::arg("maximize"));
  m.def("adam_step_multi", &adam_step_multi, "The fused step over lists of tensors");
  m.def("adam_step_lowbit", &adam_step_lowbit, "The step with bf16 or blockwise int8 moments");
  m.def("sr_round_bf16", &sr_round_bf16, "dst = src rounded to bf16 stochastically (sr_round.h)");
  m.def("all_finite", &all_finite, "All grad * scale finite (CPU)", py::arg("grad"),
        py::arg("scale") = 1.0);
  m.def("flat_copy", &flat_copy, "Copy tensors into (to_flat) or out of a flat buffer",
        py::arg("tensors"), py::arg("flat"), py::arg("offsets"), py::arg("to_flat"));
  m.def("quantize_blockwise", &quantize_blockwise,
        "Blockwise symmetric int8/int4 quantization of x into q and scales (error: feedback)",
        py::arg("x"), py::arg("error"), py::arg("q"), py::arg("scales"), py::arg("bits"),
        py::arg("block"));
  m.def("dequantize_blockwise", &dequantize_blockwise,
        "out = q * scale per block (accumulate: out += q * scale, fp32 out)", py::arg("q"),
        py::arg("scales"), py::arg("out"), py::arg("bits"), py::arg("block"),
        py::arg("accumulate"));
  m.def("stream_probe", &stream_probe, "p += g, m += g, v += g (bandwidth floor of the step)");
  m.def("stream_probe_variant", &stream_probe_variant,
        "The traffic of the step (fp32, bf16 or int8 moments) in one variant; seconds taken",
        py::arg("p"), py::arg("g"), py::arg("m"), py::arg("v"), py::arg("prefetch") = 0,
        py::arg("nt") = false, py::arg("threads") = 0);
  m.def("prefetch_distance", &prefetch_distance, "Software prefetch distance of the CPU step");
  m.def("set_prefetch_distance", &set_prefetch_distance, "Set it (elements; 0: none)");
  m.def("default_prefetch_distance", &zk::default_prefetch_distance, "This CPU's default");
  m.def("cpu_isa", &cpu_isa, "Instruction set the CPU kernels use now");
  m.def("set_cpu_isa", &set_cpu_isa, "Force the CPU kernels' instruction set (tests)");
  m.def("has_cuda", &has_cuda, "Whether the CUDA kernels were compiled in");
  m.def("cuda_archs", &cuda_archs, "The CUDA images compiled in (sm_XY, compute_XY)");
  register_host(m);  // bindings_host.cpp: shm words, the host block cache, the aio engine
}
