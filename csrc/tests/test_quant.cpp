// C++ unit tests of the torch-free blockwise quantization kernels: every instruction set this
// CPU runs against an independent model of the formulas (quant_math.h), bit for bit: q bytes,
// scales, error-feedback residuals and dequantized values, at odd sizes, fp32/bf16/fp16 inputs,
// zero blocks, NaN and +-inf blocks, and blocks split across calls as threads would split them.
// Prints the first mismatches and exits non-zero on failure.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("fp-contract=off")  // the model rounds each operation, as the kernels do
#endif
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <stdexcept>
#include <vector>

#include "quant_cpu.h"
#include "zk_convert.h"

namespace {

using zk::DType;

int failures = 0;
long long checks = 0;

void expect(bool ok, const char* what, long long i, double got, double want) {
  ++checks;
  if (!ok && ++failures <= 12) {
    std::printf("FAIL %s [%lld]: got %.9g want %.9g\n", what, i, got, want);
  }
}

uint32_t bits_of(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

// x as stored (fp32 bits or bf16/fp16 halves) and as the fp32 values the kernels read.
struct Input {
  DType dtype;
  std::vector<float> f32;
  std::vector<uint16_t> half;
  std::vector<float> value;
  const void* ptr() const {
    return dtype == DType::kF32 ? static_cast<const void*>(f32.data()) : half.data();
  }
};

Input make_input(const std::vector<float>& v, DType dtype) {
  Input in{dtype, {}, {}, {}};
  for (float f : v) {
    if (dtype == DType::kF32) {
      in.f32.push_back(f);
      in.value.push_back(f);
    } else {
      const uint16_t h = dtype == DType::kBF16 ? zk::float_to_bf16(f) : zk::float_to_f16(f);
      in.half.push_back(h);
      in.value.push_back(dtype == DType::kBF16 ? zk::bf16_to_float(h) : zk::f16_to_float(h));
    }
  }
  return in;
}

struct Quantized {
  std::vector<uint8_t> q;
  std::vector<float> scales;
  std::vector<float> error;  // empty: no error feedback
};

// The formulas written plainly, with std::nearbyint and float compares instead of bit tricks.
Quantized model_quantize(const std::vector<float>& x, const std::vector<float>* err, int bits,
                         int64_t block) {
  const int64_t n = int64_t(x.size());
  const int qmax = bits == 8 ? 127 : 7;
  const int64_t nb = (n + block - 1) / block;
  Quantized out;
  out.q.assign(bits == 8 ? n : (n + 1) / 2, 0);
  out.scales.assign(nb, 0.0f);
  if (err) out.error = *err;
  std::vector<int> qv(n, 0);
  for (int64_t blk = 0; blk < nb; ++blk) {
    const int64_t b0 = blk * block, b1 = std::min(n, b0 + block);
    std::vector<float> y(x.begin() + b0, x.begin() + b1);
    if (err) {
      for (int64_t i = b0; i < b1; ++i) y[i - b0] = x[i] + (*err)[i];
    }
    bool nan = false, inf = false;
    float absmax = 0.0f;
    for (float v : y) {
      if (std::isnan(v)) {
        nan = true;
      } else if (std::isinf(v)) {
        inf = true;
      } else {
        absmax = std::max(absmax, std::fabs(v));
      }
    }
    if (nan || inf) {
      out.scales[blk] = nan ? std::nanf("") : INFINITY;
      for (int64_t i = b0; i < b1; ++i) {
        const float v = y[i - b0];
        qv[i] = (!nan && v == INFINITY) ? qmax : (!nan && v == -INFINITY) ? -qmax : 0;
        if (err) out.error[i] = 0.0f;
      }
      continue;
    }
    const float scale = absmax / float(qmax);
    float inv = float(qmax) / absmax;
    if (!(inv < FLT_MAX)) inv = FLT_MAX;
    out.scales[blk] = scale;
    for (int64_t i = b0; i < b1; ++i) {
      const float v = y[i - b0];
      float t = v * inv;
      t = std::min(std::max(t, -float(qmax)), float(qmax));
      qv[i] = int(std::nearbyint(t));
      if (err) {
        const float deq = float(qv[i]) * scale;
        out.error[i] = v - deq;
      }
    }
  }
  for (int64_t i = 0; i < n; ++i) {
    if (bits == 8) {
      out.q[i] = uint8_t(int8_t(qv[i]));
    } else {
      out.q[i / 2] |= uint8_t((qv[i] & 0xf) << (4 * (i % 2)));
    }
  }
  return out;
}

int model_get(const std::vector<uint8_t>& q, int bits, int64_t i) {
  if (bits == 8) return int8_t(q[i]);
  int nib = (q[i / 2] >> (4 * (i % 2))) & 0xf;
  return nib >= 8 ? nib - 16 : nib;
}

Quantized run_quantize(const Input& in, const std::vector<float>* err, int bits, int64_t block,
                       zk::CpuIsa isa) {
  const int64_t n = int64_t(in.value.size());
  const int64_t nb = zk::quant_num_blocks(n, block);
  Quantized out;
  out.q.assign(zk::quant_packed_bytes(n, bits), 0xa5);  // garbage: every byte must be written
  out.scales.assign(nb, -1.0f);
  if (err) out.error = *err;
  zk::QuantBuffers b{
      in.ptr(), in.dtype, err ? out.error.data() : nullptr, out.q.data(), out.scales.data(), n,
      block,    bits};
  const int64_t mid = nb / 3;  // two uneven block ranges, as two threads would take them
  zk::quantize_cpu(b, 0, mid, isa);
  zk::quantize_cpu(b, mid, nb, isa);
  return out;
}

bool same_float(float a, float b) { return bits_of(a) == bits_of(b) || (a != a && b != b); }

void compare_quantized(const Quantized& got, const Quantized& want, const char* tag) {
  for (size_t i = 0; i < want.q.size(); ++i) {
    if (got.q[i] != want.q[i]) expect(false, tag, i, got.q[i], want.q[i]);
  }
  for (size_t i = 0; i < want.scales.size(); ++i) {
    if (!same_float(got.scales[i], want.scales[i])) {
      expect(false, "scale", i, got.scales[i], want.scales[i]);
    }
    if (got.scales[i] != got.scales[i]) {
      expect(bits_of(got.scales[i]) == zk::kQuietNaNBits, "canonical NaN scale", i, 0, 0);
    }
  }
  for (size_t i = 0; i < want.error.size(); ++i) {
    if (!same_float(got.error[i], want.error[i])) {
      expect(false, "error", i, got.error[i], want.error[i]);
    }
  }
  ++checks;
}

// Dequantize got into each dtype (and accumulate into fp32) and compare with the model.
void check_dequantize(const Quantized& qz, int64_t n, int bits, int64_t block, zk::CpuIsa isa) {
  const int64_t nb = zk::quant_num_blocks(n, block);
  std::vector<float> model(n);
  for (int64_t i = 0; i < n; ++i) model[i] = float(model_get(qz.q, bits, i)) * qz.scales[i / block];
  for (DType od : {DType::kF32, DType::kBF16, DType::kF16}) {
    std::vector<float> f32(n, 7.0f);
    std::vector<uint16_t> half(n, 0x1234);
    void* out = od == DType::kF32 ? static_cast<void*>(f32.data()) : half.data();
    zk::DequantBuffers b{qz.q.data(), qz.scales.data(), out, od, false, n, block, bits};
    zk::dequantize_cpu(b, 0, nb / 2, isa);
    zk::dequantize_cpu(b, nb / 2, nb, isa);
    for (int64_t i = 0; i < n; ++i) {
      const float want = model[i];
      if (od == DType::kF32) {
        if (!same_float(f32[i], want)) expect(false, "deq fp32", i, f32[i], want);
      } else {
        const uint16_t w = od == DType::kBF16 ? zk::float_to_bf16(want) : zk::float_to_f16(want);
        const bool nan = want != want;
        const float back =
            od == DType::kBF16 ? zk::bf16_to_float(half[i]) : zk::f16_to_float(half[i]);
        if (!(half[i] == w || (nan && back != back))) expect(false, "deq half", i, back, want);
      }
    }
  }
  // accumulate: out + q * scale, two roundings
  std::vector<float> acc(n);
  for (int64_t i = 0; i < n; ++i) acc[i] = 0.25f * float(i % 13) - 1.0f;
  std::vector<float> want = acc;
  for (int64_t i = 0; i < n; ++i) want[i] = want[i] + model[i];
  zk::DequantBuffers b{qz.q.data(), qz.scales.data(), acc.data(), DType::kF32, true, n, block,
                       bits};
  zk::dequantize_cpu(b, 0, nb, isa);
  for (int64_t i = 0; i < n; ++i) {
    if (!same_float(acc[i], want[i])) expect(false, "deq accumulate", i, acc[i], want[i]);
  }
  ++checks;
}

std::vector<float> random_values(int64_t n, unsigned seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal;
  std::uniform_real_distribution<float> mag(-6.0f, 3.0f);
  std::vector<float> v(n);
  // blocks of very different magnitudes, exact ties of x * inv now and then
  for (int64_t i = 0; i < n; ++i) v[i] = normal(rng) * std::pow(10.0f, mag(rng) * (i % 97 == 0));
  for (int64_t i = 0; i < n; i += 31) v[i] = float(int(i % 9) - 4) * 0.5f;
  return v;
}

void test_against_model(zk::CpuIsa isa) {
  for (int bits : {8, 4}) {
    for (int64_t block : {2, 16, 32, 64, 256, 1000}) {
      for (int64_t n : {int64_t(1), block - 1, block, block + 1, 3 * block + 7, int64_t(100003)}) {
        if (n <= 0) continue;
        const std::vector<float> raw = random_values(n, unsigned(n * 7 + block + bits));
        std::vector<float> err(n);
        for (int64_t i = 0; i < n; ++i) err[i] = raw[(i * 7) % n] * 0.01f;
        for (DType d : {DType::kF32, DType::kBF16, DType::kF16}) {
          const Input in = make_input(raw, d);
          for (bool with_err : {false, true}) {
            const std::vector<float>* e = with_err ? &err : nullptr;
            const Quantized got = run_quantize(in, e, bits, block, isa);
            compare_quantized(got, model_quantize(in.value, e, bits, block), "q bytes");
            if (d == DType::kF32 && !with_err) check_dequantize(got, n, bits, block, isa);
          }
        }
      }
    }
  }
}

// zeros, NaN, +inf, -inf, inf and -inf together, a tiny block, and the last block partial.
void test_special_blocks(zk::CpuIsa isa) {
  const int64_t block = 32;
  for (int bits : {8, 4}) {
    const int qmax = bits == 8 ? 127 : 7;
    std::vector<float> x = random_values(7 * block + 5, 11);
    for (int64_t i = 0; i < block; ++i) x[i] = 0.0f;  // block 0: zeros (one -0)
    x[3] = -0.0f;
    x[block + 17] = NAN;            // block 1: NaN
    x[2 * block + 1] = INFINITY;    // block 2: +inf
    x[3 * block + 30] = -INFINITY;  // block 3: -inf
    x[4 * block] = INFINITY;        // block 4: both infs and a NaN
    x[4 * block + 1] = -INFINITY;
    x[4 * block + 2] = NAN;
    for (int64_t i = 5 * block; i < 6 * block; ++i) x[i] = 1e-40f * float(i % 5);  // subnormals
    x[7 * block + 4] = INFINITY;  // the partial last block: +inf
    std::vector<float> err(x.size(), 0.125f);
    const Input in = make_input(x, DType::kF32);
    const Quantized got = run_quantize(in, &err, bits, block, isa);
    compare_quantized(got, model_quantize(in.value, &err, bits, block), "special q");
    expect(got.scales[0] == 0.125f / float(qmax), "error-fed zero block", 0, got.scales[0], 0);
    expect(std::isnan(got.scales[1]) && std::isnan(got.scales[4]), "NaN block scale", 1,
           got.scales[1], NAN);
    expect(got.scales[2] == INFINITY && got.scales[3] == INFINITY && got.scales[7] == INFINITY,
           "inf block scale", 2, got.scales[2], INFINITY);
    const int64_t n = int64_t(x.size());
    std::vector<float> deq(n);
    zk::DequantBuffers b{got.q.data(), got.scales.data(), deq.data(), DType::kF32, false, n, block,
                         bits};
    zk::dequantize_cpu(b, 0, zk::quant_num_blocks(n, block), isa);
    for (int64_t i = 0; i < n; ++i) {
      const int64_t blk = i / block;
      const float y = x[i] + 0.125f;
      if (blk == 0) {
        // error feedback made block 0 all 0.125: check the plain zero block below instead
        continue;
      }
      if (blk == 1 || blk == 4) expect(std::isnan(deq[i]), "NaN block -> NaN", i, deq[i], NAN);
      if (blk == 2 || blk == 3 || blk == 7) {
        if (std::isinf(y)) {
          expect(deq[i] == y, "inf stays inf with its sign", i, deq[i], y);
          expect(model_get(got.q, bits, i) == (y > 0 ? qmax : -qmax), "inf q", i,
                 model_get(got.q, bits, i), qmax);
        } else {
          expect(std::isnan(deq[i]), "finite in an inf block -> NaN", i, deq[i], NAN);
        }
      }
      if (blk == 1 || blk == 2 || blk == 3 || blk == 4 || blk == 7) {
        expect(got.error[i] == 0.0f, "residual reset in a non-finite block", i, got.error[i], 0);
      }
    }
    // a zero block without error feedback: scale 0, q 0, exact zeros back
    const Input zeros = make_input(std::vector<float>(block + 3, 0.0f), DType::kF32);
    const Quantized z = run_quantize(zeros, nullptr, bits, block, isa);
    std::vector<float> zdeq(block + 3, 5.0f);
    zk::DequantBuffers zb{z.q.data(), z.scales.data(), zdeq.data(), DType::kF32,
                          false,      block + 3,       block,       bits};
    zk::dequantize_cpu(zb, 0, 2, isa);
    for (int64_t i = 0; i < block + 3; ++i) {
      expect(bits_of(zdeq[i]) == 0 && z.scales[i / block] == 0.0f, "zeros -> +0", i, zdeq[i], 0);
    }
  }
}

// |x - deq| <= scale * (1/2 + 2^-14): half a step, plus fp32 rounding of inv, y * inv and q * s.
void test_error_bound(zk::CpuIsa isa) {
  for (int bits : {8, 4}) {
    const int64_t n = 50000, block = 128;
    const std::vector<float> x = random_values(n, 5);
    const Input in = make_input(x, DType::kF32);
    const Quantized qz = run_quantize(in, nullptr, bits, block, isa);
    std::vector<float> deq(n);
    zk::DequantBuffers b{qz.q.data(), qz.scales.data(), deq.data(), DType::kF32, false, n, block,
                         bits};
    zk::dequantize_cpu(b, 0, zk::quant_num_blocks(n, block), isa);
    for (int64_t i = 0; i < n; ++i) {
      const double s = qz.scales[i / block];
      const double bound = s * (0.5 + std::ldexp(1.0, -14));
      if (!(std::fabs(double(x[i]) - deq[i]) <= bound)) {
        expect(false, "error bound", i, std::fabs(double(x[i]) - deq[i]), bound);
      }
    }
    ++checks;
  }
}

void test_bad_arguments() {
  float x = 1.0f, s = 0.0f;
  uint8_t q = 0;
  int thrown = 0;
  for (int bits : {3, 4}) {
    zk::QuantBuffers b{&x, DType::kF32, nullptr, &q, &s, 1, bits == 4 ? 3 : 2, bits};
    try {
      zk::quantize_cpu(b, 0, 1, zk::CpuIsa::kScalar);
    } catch (const std::invalid_argument&) {
      ++thrown;
    }
  }
  zk::QuantBuffers b{&x, DType::kF32, nullptr, &q, &s, 1, 2, 8};
  try {
    zk::quantize_cpu(b, 0, 2, zk::CpuIsa::kScalar);  // one block only
  } catch (const std::out_of_range&) {
    ++thrown;
  }
  zk::DequantBuffers d{&q, &s, &x, DType::kBF16, true, 1, 2, 8};
  try {
    zk::dequantize_cpu(d, 0, 1, zk::CpuIsa::kScalar);  // accumulate into bf16
  } catch (const std::invalid_argument&) {
    ++thrown;
  }
  expect(thrown == 4, "bad arguments throw", 0, thrown, 4);
}

}  // namespace

int main() {
  const zk::CpuIsa best = zk::cpu_isa_best();
  std::printf("cpu isa: %s\n", zk::cpu_isa_name(best));
  for (int isa = 0; isa <= int(best); ++isa) {
    test_against_model(zk::CpuIsa(isa));
    test_special_blocks(zk::CpuIsa(isa));
    test_error_bound(zk::CpuIsa(isa));
  }
  test_bad_arguments();
  std::printf("%lld checks, %d failures\n", checks, failures);
  return failures == 0 ? 0 : 1;
}
