// C++ unit tests of the torch-free CPU kernels: every instruction set this CPU runs against a
// double-precision model of the formula, the non-finite scan, bf16/fp16 conversions and the
// segmented flat copy. Prints the first mismatches and exits non-zero on failure.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "adam_cpu.h"
#include "flat_copy.h"
#include "zk_convert.h"

namespace {

int failures = 0;
int checks = 0;

void expect(bool ok, const char* what, long long i, double got, double want) {
  ++checks;
  if (!ok) {
    if (++failures <= 10) {
      std::printf("FAIL %s [%lld]: got %.9g want %.9g\n", what, i, got, want);
    }
  }
}

bool close(double a, double b, double rtol, double atol) {
  if (std::isnan(a) && std::isnan(b)) return true;
  return std::fabs(a - b) <= atol + rtol * std::fabs(b);
}

// The formula in double, independently of adam_math.h.
void model_step(const zk::AdamArgs& a, double& p, double g, double& m, double& v, double& vm) {
  g *= a.grad_scale;
  if (a.maximize) g = -g;
  if (a.weight_decay != 0) {
    if (a.adamw) {
      p *= a.decay;
    } else {
      g += double(a.weight_decay) * p;
    }
  }
  m = a.beta1 * m + double(a.one_minus_beta1) * g;
  v = a.beta2 * v + double(a.one_minus_beta2) * g * g;
  double src = v;
  if (a.amsgrad) {
    vm = std::max(vm, v);
    src = vm;
  }
  p -= double(a.step_size) * m / (std::sqrt(src) * a.inv_bc2_sqrt + a.eps);
}

zk::AdamArgs make_args(bool adamw, bool amsgrad, bool maximize, float wd) {
  const int step = 4;
  const double b1 = 0.9, b2 = 0.999, lr = 1e-3;
  return zk::make_adam_args(lr, b1, b2, 1e-8, wd, lr / (1 - std::pow(b1, step)),
                            std::sqrt(1 - std::pow(b2, step)), 0.5, adamw, amsgrad, maximize);
}

void test_fp32_step(zk::CpuIsa isa, int64_t n) {
  std::mt19937 rng(static_cast<unsigned>(n));
  std::normal_distribution<float> normal;
  for (int variant = 0; variant < 16; ++variant) {
    const zk::AdamArgs a =
        make_args(variant & 1, variant & 2, variant & 4, (variant & 8) ? 0.1f : 0);
    std::vector<float> p(n), g(n), m(n), v(n), vm(n);
    std::vector<uint16_t> out(n);
    for (int64_t i = 0; i < n; ++i) {
      p[i] = normal(rng);
      g[i] = normal(rng);
      m[i] = 0.1f * normal(rng);
      v[i] = 0.01f * std::fabs(normal(rng));
      vm[i] = v[i] * 1.5f;
    }
    std::vector<float> p0 = p, m0 = m, v0 = v, vm0 = vm;
    zk::AdamBuffers b{
        p.data(),   g.data(), m.data(),        v.data(),        a.amsgrad ? vm.data() : nullptr,
        out.data(), n,        zk::DType::kF32, zk::DType::kF32, zk::DType::kBF16};
    // split into two uneven ranges, as threads would
    const int64_t mid = n / 3;
    zk::adam_step_cpu(a, b, 0, mid, isa);
    zk::adam_step_cpu(a, b, mid, n, isa);
    for (int64_t i = 0; i < n; ++i) {
      double pp = p0[i], mm = m0[i], vv = v0[i], vvm = vm0[i];
      model_step(a, pp, g[i], mm, vv, vvm);
      expect(close(p[i], pp, 1e-6, 1e-6), "param", i, p[i], pp);
      expect(close(m[i], mm, 1e-6, 1e-7), "exp_avg", i, m[i], mm);
      expect(close(v[i], vv, 1e-6, 1e-9), "exp_avg_sq", i, v[i], vv);
      if (a.amsgrad) expect(close(vm[i], vvm, 1e-6, 1e-9), "max_exp_avg_sq", i, vm[i], vvm);
      const float back = zk::bf16_to_float(out[i]);
      expect(close(back, p[i], 1.0 / 256, 0), "out_bf16", i, back, p[i]);
    }
  }
}

void test_scan(zk::CpuIsa isa) {
  for (int64_t n : {1, 7, 16, 1023}) {
    std::vector<float> g(n, 1.0f);
    expect(zk::all_finite_cpu(g.data(), zk::DType::kF32, 2.0f, 0, n, isa), "finite", n, 1, 1);
    for (int64_t where : {int64_t(0), n / 2, n - 1}) {
      for (float bad : {INFINITY, -INFINITY, NAN}) {
        std::vector<float> h(n, 1.0f);
        h[where] = bad;
        expect(!zk::all_finite_cpu(h.data(), zk::DType::kF32, 1.0f, 0, n, isa), "non-finite", where,
               0, 1);
      }
    }
    g[n - 1] = 3e38f;  // finite, but not after scaling by 10
    expect(!zk::all_finite_cpu(g.data(), zk::DType::kF32, 10.0f, 0, n, isa), "scaled overflow", n,
           0, 1);
  }
}

void test_conversions() {
  // exact cases: ties to even, overflow, subnormals, NaN
  struct Case {
    float x;
    uint16_t bf16;
    uint16_t f16;
  };
  const Case cases[] = {
      {1.0f, 0x3f80, 0x3c00},          {-2.0f, 0xc000, 0xc000},
      {65504.0f, 0x4780, 0x7bff},      {65520.0f, 0x4780, 0x7c00},
      {1.00390625f, 0x3f80, 0x3c04},   {1.01171875f, 0x3f82, 0x3c0c},
      {5.9604645e-8f, 0x3380, 0x0001}, {2.9802322e-8f, 0x3300, 0x0000},
      {INFINITY, 0x7f80, 0x7c00},      {0.0f, 0x0000, 0x0000},
  };
  for (const Case& c : cases) {
    expect(zk::float_to_bf16(c.x) == c.bf16, "to_bf16", c.bf16, zk::float_to_bf16(c.x), c.bf16);
    expect(zk::float_to_f16(c.x) == c.f16, "to_f16", c.f16, zk::float_to_f16(c.x), c.f16);
  }
  expect(std::isnan(zk::bf16_to_float(zk::float_to_bf16(NAN))), "bf16 nan", 0, 0, 0);
  expect(std::isnan(zk::f16_to_float(zk::float_to_f16(NAN))), "f16 nan", 0, 0, 0);
  // every fp16 value round-trips through fp32 exactly
  for (uint32_t h = 0; h < 0x10000; ++h) {
    const float f = zk::f16_to_float(uint16_t(h));
    if (std::isnan(f)) continue;
    expect(zk::float_to_f16(f) == h, "f16 round trip", h, zk::float_to_f16(f), h);
  }
}

void test_flat_copy() {
  std::vector<float> a(5, 1.5f), b(70001, -2.0f), c(3, 0.25f);
  std::vector<uint16_t> flat(5 + 70001 + 3 + 4, 0);
  std::vector<zk::CopySegment> segs = {
      {flat.data() + 1, zk::DType::kBF16, a.data(), zk::DType::kF32, 5},
      {flat.data() + 7, zk::DType::kBF16, b.data(), zk::DType::kF32, 70001},
      {flat.data() + 70008, zk::DType::kBF16, c.data(), zk::DType::kF32, 3},
  };
  auto starts = zk::segment_starts(segs);
  expect(starts.back() == 70009, "starts total", 0, double(starts.back()), 70009);
  // uneven thread ranges that cut segments in the middle
  zk::copy_segments_cpu(segs, starts, 0, 3);
  zk::copy_segments_cpu(segs, starts, 3, 40000);
  zk::copy_segments_cpu(segs, starts, 40000, starts.back());
  expect(flat[0] == 0 && flat[6] == 0, "untouched gap", 0, flat[0] + flat[6], 0);
  for (int i = 0; i < 5; ++i)
    expect(zk::bf16_to_float(flat[1 + i]) == 1.5f, "seg a", i, zk::bf16_to_float(flat[1 + i]), 1.5);
  for (int i = 0; i < 70001; ++i) {
    if (zk::bf16_to_float(flat[7 + i]) != -2.0f)
      expect(false, "seg b", i, zk::bf16_to_float(flat[7 + i]), -2);
  }
  for (int i = 0; i < 3; ++i)
    expect(zk::bf16_to_float(flat[70008 + i]) == 0.25f, "seg c", i,
           zk::bf16_to_float(flat[70008 + i]), 0.25);
}

}  // namespace

int main() {
  const zk::CpuIsa best = zk::cpu_isa_best();
  std::printf("cpu isa: %s\n", zk::cpu_isa_name(best));
  for (int isa = 0; isa <= int(best); ++isa) {
    for (int64_t n : {1, 7, 16, 17, 1023, (1 << 20) + 3}) test_fp32_step(zk::CpuIsa(isa), n);
    test_scan(zk::CpuIsa(isa));
  }
  test_conversions();
  test_flat_copy();
  std::printf("%d checks, %d failures\n", checks, failures);
  return failures == 0 ? 0 : 1;
}
