// dualserve::attend_rows: paged attention for a padded step of few query rows per sequence
// (decode, an EAGLE verify tree, a diffusion block), the form of
// decoders/engine/compiled.py:PaddedPagedAttention._rows.
//
// Each query row attends to the keys its mask shows: the sequence's cached keys (read from
// the pool by slot) then the step's new ones. A row's result depends only on the keys it
// sees and their order, never on how many rows, sequences or padded positions share the
// step: scores are dot products with one fixed reduction tree, exp is one fixed polynomial
// per element, and the softmax sums run over the visible keys one after another. So a token
// decoded alone and the same token inside a verify tree get the same bits, on the AVX-512
// path and on the plain C path alike.

#include <torch/library.h>
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/zeros.h>
#include <c10/util/BFloat16.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#define ATTEND_X86 1
#endif

namespace {

constexpr int LANES = 16;

// exp(x) for x <= 0 (Cephes' single-precision polynomial), every step an IEEE fma/mul/add so
// that the scalar and vector forms agree bit for bit.
constexpr float LOG2E = 1.44269504088896341f, LN2_HI = 0.693359375f, LN2_LO = -2.12194440e-4f;
constexpr float P0 = 1.9875691500E-4f, P1 = 1.3981999507E-3f, P2 = 8.3334519073E-3f, P3 = 4.1665795894E-2f,
                P4 = 1.6666665459E-1f, P5 = 5.0000001201E-1f;

inline float exp_scalar(float x) {
  x = std::fmax(x, -87.0f);
  const float n = std::nearbyint(x * LOG2E);
  float r = std::fma(-n, LN2_HI, x);
  r = std::fma(-n, LN2_LO, r);
  float p = P0;
  p = std::fma(p, r, P1);
  p = std::fma(p, r, P2);
  p = std::fma(p, r, P3);
  p = std::fma(p, r, P4);
  p = std::fma(p, r, P5);
  float y = std::fma(p, r * r, r);
  y = y + 1.0f;
  const int32_t bits = (int32_t(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, 4);
  return y * scale;
}


#ifdef ATTEND_X86
// the same halving as dot_scalar: 16 -> 8 -> 4 -> 2 -> 1 lanes
__attribute__((target("avx512f")))
inline float hsum_avx512(__m512 v) {
  __m256 h = _mm256_add_ps(_mm512_castps512_ps256(v),
                           _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
  __m128 q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
  q = _mm_add_ps(q, _mm_movehl_ps(q, q));
  q = _mm_add_ss(q, _mm_shuffle_ps(q, q, 1));
  return _mm_cvtss_f32(q);
}


__attribute__((target("avx512f")))
inline void exp_avx512(float* x, int64_t n) {  // in place, x <= 0
  for (int64_t i = 0; i < n; i += LANES) {
    const __mmask16 m = n - i >= LANES ? __mmask16(0xFFFF) : __mmask16((1u << (n - i)) - 1);
    __m512 v = _mm512_max_ps(_mm512_maskz_loadu_ps(m, x + i), _mm512_set1_ps(-87.0f));
    const __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(v, _mm512_set1_ps(LOG2E)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fmadd_ps(_mm512_sub_ps(_mm512_setzero_ps(), k), _mm512_set1_ps(LN2_HI), v);
    r = _mm512_fmadd_ps(_mm512_sub_ps(_mm512_setzero_ps(), k), _mm512_set1_ps(LN2_LO), r);
    __m512 p = _mm512_set1_ps(P0);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(P1));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(P2));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(P3));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(P4));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(P5));
    __m512 y = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r);
    y = _mm512_add_ps(y, _mm512_set1_ps(1.0f));
    const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(k), _mm512_set1_epi32(127)), 23);
    _mm512_mask_storeu_ps(x + i, m, _mm512_mul_ps(y, _mm512_castsi512_ps(e)));
  }
}

#endif

// A key or value row: fp32 (the step's new ones) or the cache's dtype; read as fp32 either way.
struct RowRef {
  const void* p;
  bool cached;
};

template <typename C>
inline float load_scalar(const RowRef& r, int64_t x) {
  return r.cached ? static_cast<float>(static_cast<const C*>(r.p)[x]) : static_cast<const float*>(r.p)[x];
}

template <typename C>
inline float dot_scalar(const float* q, const RowRef& k, int64_t d) {
  float acc[LANES] = {0};
  for (int64_t i = 0; i < d; i += LANES)
    for (int l = 0; l < LANES; ++l) acc[l] = std::fma(q[i + l], load_scalar<C>(k, i + l), acc[l]);
  for (int w = LANES / 2; w >= 1; w /= 2)
    for (int l = 0; l < w; ++l) acc[l] = acc[l] + acc[l + w];
  return acc[0];
}

template <typename C>
inline void axpy_scalar(float* acc, float p, const RowRef& v, int64_t d) {
  for (int64_t i = 0; i < d; ++i) acc[i] = std::fma(p, load_scalar<C>(v, i), acc[i]);
}

#ifdef ATTEND_X86
template <typename C>
__attribute__((target("avx512f")))
inline __m512 load16(const RowRef& r, int64_t i) {
  if (r.cached) {
    if constexpr (std::is_same_v<C, c10::BFloat16>) {
      const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const C*>(r.p) + i));
      return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    } else {
      return _mm512_loadu_ps(static_cast<const float*>(r.p) + i);
    }
  }
  return _mm512_loadu_ps(static_cast<const float*>(r.p) + i);
}

template <typename C>
__attribute__((target("avx512f")))
inline float dot_avx512(const float* q, const RowRef& k, int64_t d) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t i = 0; i < d; i += LANES) acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + i), load16<C>(k, i), acc);
  return hsum_avx512(acc);
}

template <typename C>
__attribute__((target("avx512f")))
inline void axpy_avx512(float* acc, float p, const RowRef& v, int64_t d) {
  const __m512 s = _mm512_set1_ps(p);
  for (int64_t i = 0; i < d; i += LANES)
    _mm512_storeu_ps(acc + i, _mm512_fmadd_ps(s, load16<C>(v, i), _mm512_loadu_ps(acc + i)));
}

// One head of one query row over its n visible keys, q and the output held in registers
// (DC = head_dim / 16); the same operations, in the same order, as the generic path.
template <typename C, int DC>
__attribute__((target("avx512f")))
void head_avx512(const float* qrow, const RowRef* keys, const RowRef* vals, int64_t n, float* scores, float sc,
                 float* o) {
  __m512 qv[DC];
  for (int c = 0; c < DC; ++c) qv[c] = _mm512_loadu_ps(qrow + c * LANES);
  float mx = -INFINITY;
  for (int64_t j = 0; j < n; ++j) {
    __m512 acc = _mm512_setzero_ps();
    for (int c = 0; c < DC; ++c) acc = _mm512_fmadd_ps(qv[c], load16<C>(keys[j], c * LANES), acc);
    scores[j] = hsum_avx512(acc) * sc;
    mx = std::fmax(mx, scores[j]);
  }
  for (int64_t j = 0; j < n; ++j) scores[j] = scores[j] - mx;
  exp_avx512(scores, n);
  float denom = 0.f;
  for (int64_t j = 0; j < n; ++j) denom += scores[j];
  __m512 out[DC];
  for (int c = 0; c < DC; ++c) out[c] = _mm512_setzero_ps();
  for (int64_t j = 0; j < n; ++j) {
    const __m512 p = _mm512_set1_ps(scores[j]);
    for (int c = 0; c < DC; ++c) out[c] = _mm512_fmadd_ps(p, load16<C>(vals[j], c * LANES), out[c]);
  }
  const __m512 dv = _mm512_set1_ps(denom);
  for (int c = 0; c < DC; ++c) _mm512_storeu_ps(o + c * LANES, _mm512_div_ps(out[c], dv));
}
#endif

bool wide_cpu() {
#ifdef ATTEND_X86
  static const bool ok = __builtin_cpu_supports("avx512f");
  return ok;
#else
  return false;
#endif
}

template <typename C>
at::Tensor attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& kc,
                  const at::Tensor& vc, const at::Tensor& rows, const at::Tensor& context, const at::Tensor& mask,
                  double scale, bool simd) {
  const int64_t T = q.size(0), H = q.size(1), d = q.size(2), KV = k.size(1), group = H / KV;
  const int64_t S = rows.size(0), Q = rows.size(1), W = context.size(1);
  at::Tensor out = at::zeros({T, H, d}, q.options());
  const float* qp = q.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  const C* kcp = kc.data_ptr<C>();
  const C* vcp = vc.data_ptr<C>();
  const int64_t* rp = rows.data_ptr<int64_t>();
  const int64_t* cp = context.data_ptr<int64_t>();
  const bool* mp = mask.data_ptr<bool>();
  float* op = out.data_ptr<float>();
#ifdef ATTEND_X86
  const bool wide = simd && wide_cpu();
#endif
  const float sc = float(scale);

  // One task per (sequence, query row, kv head): the group's heads share the visible-key list.
  // A step with little work (a decode step: about 5 us a task) runs on the calling thread; a
  // parallel region's wake-up would cost more than it saves.
  const int64_t work = S * Q * H * (W + Q);
  const int64_t grain = work < (1 << 14) ? S * Q * KV : 1;
  at::parallel_for(0, S * Q * KV, grain, [&](int64_t begin, int64_t end) {
    std::vector<RowRef> keys, vals;
    std::vector<float> scores;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t s = task / (Q * KV), i = (task / KV) % Q, h = task % KV;
      const int64_t t = rp[s * Q + i];
      if (t >= T) continue;  // a padded query
      const bool* row_mask = mp + (s * Q + i) * (W + Q);
      // the visible keys and values, in order: cached ones by slot, then the step's new ones
      keys.clear();
      vals.clear();
      for (int64_t j = 0; j < W + Q; ++j) {
        if (!row_mask[j]) continue;
        if (j < W) {
          const int64_t slot = cp[s * W + j];
          keys.push_back({kcp + (slot * KV + h) * d, true});
          vals.push_back({vcp + (slot * KV + h) * d, true});
        } else {
          const int64_t tj = rp[s * Q + (j - W)];
          keys.push_back({kp + (tj * KV + h) * d, false});
          vals.push_back({vp + (tj * KV + h) * d, false});
        }
      }
      const int64_t n = int64_t(keys.size());
      if (n == 0) continue;
      scores.resize(n);
      for (int64_t g = 0; g < group; ++g) {
        const int64_t head = h * group + g;
        const float* qrow = qp + (t * H + head) * d;
#ifdef ATTEND_X86
        if (wide && d == 64) {
          head_avx512<C, 4>(qrow, keys.data(), vals.data(), n, scores.data(), sc, op + (t * H + head) * d);
          continue;
        }
        if (wide && d == 128) {
          head_avx512<C, 8>(qrow, keys.data(), vals.data(), n, scores.data(), sc, op + (t * H + head) * d);
          continue;
        }
#endif
        float mx = -INFINITY;
        for (int64_t j = 0; j < n; ++j) {
#ifdef ATTEND_X86
          const float dot = wide ? dot_avx512<C>(qrow, keys[j], d) : dot_scalar<C>(qrow, keys[j], d);
#else
          const float dot = dot_scalar<C>(qrow, keys[j], d);
#endif
          scores[j] = dot * sc;
          mx = std::fmax(mx, scores[j]);
        }
        for (int64_t j = 0; j < n; ++j) scores[j] = scores[j] - mx;
#ifdef ATTEND_X86
        if (wide) {
          exp_avx512(scores.data(), n);
        } else
#endif
        {
          for (int64_t j = 0; j < n; ++j) scores[j] = exp_scalar(scores[j]);
        }
        float denom = 0.f;
        for (int64_t j = 0; j < n; ++j) denom += scores[j];
        float* o = op + (t * H + head) * d;
        for (int64_t j = 0; j < n; ++j) {
#ifdef ATTEND_X86
          if (wide) {
            axpy_avx512<C>(o, scores[j], vals[j], d);
            continue;
          }
#endif
          axpy_scalar<C>(o, scores[j], vals[j], d);
        }
        for (int64_t x = 0; x < d; ++x) o[x] = o[x] / denom;
      }
    }
  });
  return out;
}

at::Tensor attend_rows(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& kc,
                       const at::Tensor& vc, const at::Tensor& rows, const at::Tensor& context,
                       const at::Tensor& mask, double scale, int64_t force_scalar) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.sizes() == k.sizes(), "attend_rows: q (T, H, d), k and v (T, KV, d)");
  TORCH_CHECK(q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat,
              "attend_rows: q, k and v must be fp32");
  TORCH_CHECK(q.size(2) % LANES == 0 && q.size(1) % k.size(1) == 0, "attend_rows: head_dim must be a multiple of 16");
  TORCH_CHECK(kc.scalar_type() == vc.scalar_type() && kc.dim() == 3 && kc.size(1) == k.size(1) &&
              kc.size(2) == q.size(2), "attend_rows: the cache must be (slots, KV, d)");
  TORCH_CHECK(rows.scalar_type() == at::kLong && context.scalar_type() == at::kLong &&
              mask.scalar_type() == at::kBool && mask.size(2) == context.size(1) + rows.size(1),
              "attend_rows: rows (S, Q), context (S, W) long, mask (S, Q, W + Q) bool");
  const auto qc = q.contiguous(), kk = k.contiguous(), vv = v.contiguous(), kcc = kc.contiguous(),
             vcc = vc.contiguous(), rc = rows.contiguous(), cc = context.contiguous(), mc = mask.contiguous();
  if (kc.scalar_type() == at::kBFloat16)
    return attend<c10::BFloat16>(qc, kk, vv, kcc, vcc, rc, cc, mc, scale, !force_scalar);
  TORCH_CHECK(kc.scalar_type() == at::kFloat, "attend_rows: the cache must be bf16 or fp32");
  return attend<float>(qc, kk, vv, kcc, vcc, rc, cc, mc, scale, !force_scalar);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(dualserve, lib) {
  lib.def("attend_rows(Tensor q, Tensor k, Tensor v, Tensor kc, Tensor vc, Tensor rows, Tensor context, "
          "Tensor mask, float scale, int force_scalar=0) -> Tensor");
}

TORCH_LIBRARY_IMPL(dualserve, CPU, lib) { lib.impl("attend_rows", attend_rows); }
