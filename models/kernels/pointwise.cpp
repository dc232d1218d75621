// The transformer's non-GEMM arithmetic as the project's own ops, so that a step computes the
// same bits whichever way it runs: eager, or inside a compiled graph that inductor fused around
// different outputs (with or without EAGLE's feature layers), for one row or many.
//
//   dualserve::rms_norm(x, w, eps)  y = w * (x / sqrt(mean(x^2) + eps)), per row of fp32 x
//   dualserve::silu_mul(gu)         silu(gate) * up for gu = [gate | up] (rows, 2 * inner)
//   dualserve::rotary(pos, inv)     cos and sin of pos * inv (tokens, head_dim), RoPE's rotate-half layout
//
// Left to PyTorch, inductor generates its own reductions and transcendental functions, and their
// rounding is not eager ATen's; these ops are opaque to it (it calls them as they are). Every
// row is computed alone, in a fixed order: a sum of squares in sixteen interleaved lanes combined
// by one halving tree, and exp as exp.h's polynomial, the same bits on AVX-512, AVX2 and plain C.

#include <torch/library.h>
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace {

#include "exp.h"

// Rows per parallel task: a decode step's few rows stay on the calling thread.
constexpr int64_t GRAIN = 16;

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat, "rms_norm: fp32 only");
  TORCH_CHECK(x.size(-1) == w.numel(), "rms_norm: the weight's width must match x's last dimension");
  const at::Tensor xc = x.contiguous(), wc = w.contiguous();
  const int64_t K = x.size(-1), M = K ? x.numel() / K : 0;
  at::Tensor out = at::empty(x.sizes(), x.options());
  const float* px = xc.data_ptr<float>();
  const float* pw = wc.data_ptr<float>();
  float* py = out.data_ptr<float>();
  const float feps = float(eps);
  at::parallel_for(0, M, GRAIN, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* xr = px + r * K;
      float acc[16] = {0};
      int64_t i = 0;
      for (; i + 16 <= K; i += 16)
        for (int l = 0; l < 16; ++l) acc[l] = acc[l] + xr[i + l] * xr[i + l];
      for (int l = 0; i < K; ++i, ++l) acc[l] = acc[l] + xr[i] * xr[i];
      for (int width = 8; width >= 1; width /= 2)
        for (int l = 0; l < width; ++l) acc[l] = acc[l] + acc[l + width];
      const float inv = 1.0f / std::sqrt(acc[0] / float(K) + feps);
      float* yr = py + r * K;
      for (int64_t j = 0; j < K; ++j) yr[j] = pw[j] * (xr[j] * inv);
    }
  });
  return out;
}

// e = exp(-|g|) for n values, in place, on the widest path the CPU has (the same bits on each).
// force: 0 the widest, 1 plain C, 2 AVX2 (where the CPU has it), as attend_rows takes it.
void exp_neg_abs(float* e, int64_t n, int64_t force) {
  for (int64_t i = 0; i < n; ++i) e[i] = -std::fabs(e[i]);
#if defined(__x86_64__)
  static const bool avx512 = __builtin_cpu_supports("avx512f");
  static const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  if (avx512 && force == 0) return exp_avx512(e, n);
  if (avx2 && force != 1) return exp_avx2(e, n);
#else
  (void)force;
#endif
  for (int64_t i = 0; i < n; ++i) e[i] = exp_scalar(e[i]);
}

// silu(g) = g * sigmoid(g), sigmoid from e = exp(-|g|): 1 / (1 + e) for g >= 0, e / (1 + e) below.
at::Tensor silu_mul(const at::Tensor& gu, int64_t force_scalar) {
  TORCH_CHECK(gu.scalar_type() == at::kFloat, "silu_mul: fp32 only");
  TORCH_CHECK(gu.size(-1) % 2 == 0, "silu_mul: the last dimension must hold gate and up");
  const at::Tensor xc = gu.contiguous();
  const int64_t width = gu.size(-1), inner = width / 2, M = width ? gu.numel() / width : 0;
  std::vector<int64_t> shape(gu.sizes().begin(), gu.sizes().end());
  shape.back() = inner;
  at::Tensor out = at::empty(shape, gu.options());
  const float* px = xc.data_ptr<float>();
  float* py = out.data_ptr<float>();
  at::parallel_for(0, M, GRAIN, [&](int64_t begin, int64_t end) {
    std::vector<float> e(inner);
    for (int64_t r = begin; r < end; ++r) {
      const float* g = px + r * width;
      const float* u = g + inner;
      std::memcpy(e.data(), g, sizeof(float) * inner);
      exp_neg_abs(e.data(), inner, force_scalar);
      float* y = py + r * inner;
      for (int64_t j = 0; j < inner; ++j) {
        const float sig = g[j] >= 0.f ? 1.0f / (1.0f + e[j]) : e[j] / (1.0f + e[j]);
        y[j] = (g[j] * sig) * u[j];
      }
    }
  });
  return out;
}

// (cos, sin), each (tokens, 2 * half): angle i of a token is float(pos) * inv[i], as the reference
// forms it in fp32, repeated for both halves (rotate-half layout); cosf and sinf of the C library.
std::tuple<at::Tensor, at::Tensor> rotary(const at::Tensor& positions, const at::Tensor& inv_freq) {
  TORCH_CHECK(inv_freq.scalar_type() == at::kFloat, "rotary: fp32 frequencies only");
  const at::Tensor pos = positions.to(at::kLong).contiguous(), inv = inv_freq.contiguous();
  const int64_t T = pos.numel(), half = inv.numel(), D = 2 * half;
  at::Tensor c = at::empty({T, D}, inv.options()), s = at::empty({T, D}, inv.options());
  const int64_t* pp = pos.data_ptr<int64_t>();
  const float* pi = inv.data_ptr<float>();
  float* pc = c.data_ptr<float>();
  float* ps = s.data_ptr<float>();
  for (int64_t t = 0; t < T; ++t) {
    const float p = float(pp[t]);
    for (int64_t i = 0; i < half; ++i) {
      const float angle = p * pi[i];
      pc[t * D + i] = pc[t * D + half + i] = std::cos(angle);
      ps[t * D + i] = ps[t * D + half + i] = std::sin(angle);
    }
  }
  return {c, s};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(dualserve, lib) {
  lib.def("rms_norm(Tensor x, Tensor w, float eps) -> Tensor");
  lib.def("silu_mul(Tensor gu, int force_scalar=0) -> Tensor");
  lib.def("rotary(Tensor positions, Tensor inv_freq) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(dualserve, CPU, lib) {
  lib.impl("rms_norm", rms_norm);
  lib.impl("silu_mul", silu_mul);
  lib.impl("rotary", rotary);
}
