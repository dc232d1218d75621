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
#include "c_shim.h"  // the packages' direct calls, at the end
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#include <algorithm>
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
// silu_mul's tasks: SILU_CHUNK columns (a multiple of 16, so only a row's end is a partial vector),
// and threads only from SILU_GRAIN tasks (16k values, about 20 us on one core).
constexpr int64_t SILU_CHUNK = 1024, SILU_GRAIN = 16;

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

// silu(g) = g * sigmoid(g), sigmoid from e = exp(-|g|): 1 / (1 + e) for g >= 0, e / (1 + e) below;
// y = (g * sigmoid) * u. The vector forms make the same IEEE operations (a division is correctly
// rounded on every path), so every path gives the same bits.
void silu_row_scalar(const float* g, const float* u, float* y, int64_t n, int64_t force) {
  std::vector<float> e(g, g + n);
  exp_neg_abs(e.data(), n, force);
  for (int64_t j = 0; j < n; ++j) {
    const float sig = g[j] >= 0.f ? 1.0f / (1.0f + e[j]) : e[j] / (1.0f + e[j]);
    y[j] = (g[j] * sig) * u[j];
  }
}

#if defined(__x86_64__)
__attribute__((target("avx512f"))) void silu_row_avx512(const float* g, const float* u, float* y, int64_t n) {
  const __m512 one = _mm512_set1_ps(1.0f);
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 m = n - j >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (n - j)) - 1);
    const __m512 gv = _mm512_maskz_loadu_ps(m, g + j);
    const __m512 e = exp512(_mm512_castsi512_ps(  // -|g|
        _mm512_or_si512(_mm512_castps_si512(gv), _mm512_set1_epi32(int(0x80000000u)))));
    const __mmask16 pos = _mm512_cmp_ps_mask(gv, _mm512_setzero_ps(), _CMP_GE_OQ);
    const __m512 sig = _mm512_div_ps(_mm512_mask_blend_ps(pos, e, one), _mm512_add_ps(one, e));
    _mm512_mask_storeu_ps(y + j, m, _mm512_mul_ps(_mm512_mul_ps(gv, sig), _mm512_maskz_loadu_ps(m, u + j)));
  }
}

__attribute__((target("avx2,fma"))) void silu_row_avx2(const float* g, const float* u, float* y, int64_t n) {
  const __m256 one = _mm256_set1_ps(1.0f);
  const __m256 sign = _mm256_set1_ps(-0.0f);
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    const __m256 gv = _mm256_loadu_ps(g + j);
    const __m256 e = exp256(_mm256_or_ps(gv, sign));  // -|g|
    const __m256 pos = _mm256_cmp_ps(gv, _mm256_setzero_ps(), _CMP_GE_OQ);
    const __m256 sig = _mm256_div_ps(_mm256_blendv_ps(e, one, pos), _mm256_add_ps(one, e));
    _mm256_storeu_ps(y + j, _mm256_mul_ps(_mm256_mul_ps(gv, sig), _mm256_loadu_ps(u + j)));
  }
  if (j < n) silu_row_scalar(g + j, u + j, y + j, n - j, 2);
}
#endif

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
#if defined(__x86_64__)
  static const bool avx512 = __builtin_cpu_supports("avx512f");
  static const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#endif
  // Tasks of SILU_CHUNK columns of a row (every value is computed alone, so the split never changes
  // a bit): a verify's few wide rows are shared by the threads, a decode's one row stays on the
  // calling thread.
  const int64_t chunks = (inner + SILU_CHUNK - 1) / SILU_CHUNK;
  at::parallel_for(0, M * chunks, SILU_GRAIN, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t r = task / chunks, c0 = task % chunks * SILU_CHUNK, n = std::min(SILU_CHUNK, inner - c0);
      const float* g = px + r * width + c0;
      const float* u = px + r * width + inner + c0;
      float* y = py + r * inner + c0;
#if defined(__x86_64__)
      if (avx512 && force_scalar == 0) {
        silu_row_avx512(g, u, y, n);
        continue;
      }
      if (avx2 && force_scalar != 1) {
        silu_row_avx2(g, u, y, n);
        continue;
      }
#endif
      silu_row_scalar(g, u, y, n, force_scalar);
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

// The packages' direct calls (c_shim.h).
using dualserve_shim::give;
using dualserve_shim::tensor;

DUALSERVE_SHIM aoti_torch_cpu_rms_norm(AtenTensorHandle x, AtenTensorHandle w, double eps, AtenTensorHandle* ret0) {
  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE({ give(ret0, rms_norm(tensor(x), tensor(w), eps)); });
}

DUALSERVE_SHIM aoti_torch_cpu_silu_mul(AtenTensorHandle gu, int64_t force_scalar, AtenTensorHandle* ret0) {
  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE({ give(ret0, silu_mul(tensor(gu), force_scalar)); });
}

DUALSERVE_SHIM aoti_torch_cpu_rotary(AtenTensorHandle positions, AtenTensorHandle inv_freq, AtenTensorHandle* ret0,
                                     AtenTensorHandle* ret1) {
  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE({
    auto [c, s] = rotary(tensor(positions), tensor(inv_freq));
    give(ret0, std::move(c));
    give(ret1, std::move(s));
  });
}
