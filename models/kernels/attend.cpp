// dualserve::attend_rows: paged attention for a padded step of few query rows per sequence
// (decode, an EAGLE verify tree, a diffusion block), the form of
// decoders/engine/attention/padded.py:PaddedPagedAttention._rows.
//
// Each query row attends to the keys its mask shows: the sequence's cached keys (read from
// the pool by slot) then the step's new ones. A row's result depends only on the keys it
// sees and their order, never on how many rows, sequences or padded positions share the
// step: scores are dot products with one fixed reduction tree, exp is one fixed polynomial
// per element, and the softmax sums run over the visible keys one after another. So a token
// decoded alone and the same token inside a verify tree get the same bits, on the AVX-512,
// AVX2 and plain C paths alike (chosen at run time from the CPU's flags; the last argument
// forces one: 1 plain C, 2 AVX2).
//
// Work is split by (sequence, kv head, chunk of rows): the keys and values of a task are shared by
// all its rows and the group's query heads. AVX-512 reads them in place, widening a bf16 cache at
// each load (half the bytes of a widened copy, which a task's rows would reread from L2); the
// AVX2 and C paths widen them to fp32 once. On the vector paths the scores of sixteen (AVX2:
// eight) keys are reduced together (a transpose network that makes the same additions as one
// key's horizontal sum), and a task's scores come first, for all its rows and heads: on AVX-512 a
// block of sixteen bf16 keys is widened once for all of them, and one load of a value row feeds
// every head; on AVX2 a block of 64 keys, and then of their values, serves all of them from L1.

#include <torch/library.h>
#include "c_shim.h"  // the packages' direct calls, at the end
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/zeros.h>
#include <c10/util/BFloat16.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <algorithm>
#include <type_traits>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#define ATTEND_X86 1
#endif

namespace {

constexpr int LANES = 16;

#include "exp.h"  // exp_scalar, exp_avx512, exp_avx2: one polynomial, the same bits on every path

inline float dot_scalar(const float* q, const float* k, int64_t d) {
  float acc[LANES] = {0};
  for (int64_t i = 0; i < d; i += LANES)
    for (int l = 0; l < LANES; ++l) acc[l] = std::fma(q[i + l], k[i + l], acc[l]);
  for (int w = LANES / 2; w >= 1; w /= 2)
    for (int l = 0; l < w; ++l) acc[l] = acc[l] + acc[l + w];
  return acc[0];
}

// One row and head whose weighted values are still to add: its probabilities s over its nv
// visible keys (vis: their indices among the task's, or null for the first nv), its softmax sum,
// and its output row (zero until the values are added).
struct PendingRow {
  const float* s;
  const int32_t* vis;
  int64_t nv;
  float denom;
  float* out;
};

#ifdef ATTEND_X86
__attribute__((target("avx512f")))
inline void widen_avx512(const c10::BFloat16* src, int64_t d, float* dst) {  // d a multiple of 16
  for (int64_t i = 0; i < d; i += LANES)
    _mm512_storeu_ps(dst + i, _mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i))), 16)));
}

// Sixteen fp32 lanes of a key or value row held as the cache holds it (bf16 widens exactly).
template <typename C>
__attribute__((target("avx512f")))
inline __m512 load16(const C* p) {
  if constexpr (std::is_same_v<C, c10::BFloat16>)
    return _mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
  else
    return _mm512_loadu_ps(reinterpret_cast<const float*>(p));
}

// The cache lines of a key or value row of ``bytes``, asked for ahead of their use. A step's rows
// come from blocks scattered over the pool (16 tokens a block), where the hardware prefetchers
// restart at every block; a decode's keys and values are mostly in memory, its weights having
// streamed through the caches since the last step.
inline void prefetch_row(const void* p, int64_t bytes) {
  for (int64_t at = 0; at < bytes; at += 64) __builtin_prefetch(static_cast<const char*>(p) + at, 0, 3);
}

// Sixteen keys' scores at once. acc[j] is key j's 16 lane sums, exactly as dot_scalar forms them;
// the network below then halves all sixteen together (lanes l + 8, l + 4, l + 2, l + 1, the same
// additions as dot_scalar's tree and hsum_avx512), a few shuffles per key instead of a horizontal
// sum each. Lane 4k + m of the result holds key 4m + k; the final permute puts key j in lane j.
template <int DC, typename C>
__attribute__((target("avx512f")))
inline __m512 scores16_avx512(const __m512* qv, const C* const* keys) {
  __m512 a[16];
  for (int j = 0; j < 16; ++j) {
    a[j] = _mm512_setzero_ps();
    for (int c = 0; c < DC; ++c) a[j] = _mm512_fmadd_ps(qv[c], load16<C>(keys[j] + c * LANES), a[j]);
  }
  __m512 p[8];  // lanes 0-7: key 2i's l + (l + 8); lanes 8-15: key 2i + 1's
  for (int i = 0; i < 8; ++i)
    p[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xEE));
  __m512 r[4];  // 128-bit chunk k: key 4i + k's l + (l + 4)
  for (int i = 0; i < 4; ++i)
    r[i] = _mm512_add_ps(_mm512_shuffle_f32x4(p[2 * i], p[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(p[2 * i], p[2 * i + 1], 0xDD));
  __m512 s[2];  // chunk k: key 8i + k's lanes 0 + 2, 1 + 3, then key 8i + 4 + k's
  for (int i = 0; i < 2; ++i) {
    const __m512d x = _mm512_castps_pd(r[2 * i]), y = _mm512_castps_pd(r[2 * i + 1]);
    s[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  const __m512 f = _mm512_add_ps(_mm512_shuffle_ps(s[0], s[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm512_shuffle_ps(s[0], s[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512i order = _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0);
  return _mm512_permutexvar_ps(order, f);
}

// The scores of nq query rows (every row and head of a task: all[r * n + j] for query r and key j)
// over the task's n keys, sixteen keys at a time. A block of bf16 keys is widened once into kb (in
// L1) for all of them, rather than at each query's loads; the values are the same.
template <int DC, typename C>
__attribute__((target("avx512f")))
void scores_avx512(const float* const* qrows, int64_t nq, const C* const* keys, int64_t n, float sc, float* all) {
  const __m512 vsc = _mm512_set1_ps(sc);
  alignas(64) float kb[16 * DC * LANES];
  const float* widened[16];
  for (int k = 0; k < 16; ++k) widened[k] = kb + k * DC * LANES;
  for (int64_t j = 0; j < n; j += 16) {
    for (int64_t k = j + 16; k < std::min<int64_t>(n, j + 32); ++k) prefetch_row(keys[k], DC * LANES * sizeof(C));
    const float* const* block;
    if constexpr (std::is_same_v<C, c10::BFloat16>) {
      for (int k = 0; k < 16; ++k) widen_avx512(keys[j + k], DC * LANES, kb + k * DC * LANES);
      block = widened;
    } else {
      block = keys + j;
    }
    for (int64_t r = 0; r < nq; ++r) {
      __m512 qv[DC];
      for (int c = 0; c < DC; ++c) qv[c] = _mm512_loadu_ps(qrows[r] + c * LANES);
      _mm512_storeu_ps(all + r * n + j, _mm512_mul_ps(scores16_avx512<DC, float>(qv, block), vsc));
    }
  }
}

// G query heads of one row (heads of one kv group, so the same visible keys), their scores over
// the task's n keys already in all (g * stride): softmax and the weighted values over the visible
// ones alone (vis, in position order), each head with the operations and order of the plain C
// path. The heads only share work: one load of each value row feeds every head's accumulators,
// and their sequential softmax sums run side by side.
template <int DC, int G, typename C>
__attribute__((target("avx512f")))
void heads_avx512(const C* const* vals, const int32_t* vis, int64_t nv, bool prefix, float* all, float* scores,
                  int64_t stride, float* const* outs) {
  float* s[G];
  for (int g = 0; g < G; ++g) {
    float* a = all + g * stride;
    s[g] = prefix ? a : scores + g * stride;
    if (!prefix)
      for (int64_t j = 0; j < nv; ++j) s[g][j] = a[vis[j]];
    __m512 m = _mm512_set1_ps(-INFINITY);
    for (int64_t j = 0; j < nv; j += LANES) {
      const __mmask16 k = nv - j >= LANES ? __mmask16(0xFFFF) : __mmask16((1u << (nv - j)) - 1);
      m = _mm512_mask_max_ps(m, k, m, _mm512_maskz_loadu_ps(k, s[g] + j));
    }
    const __m512 mx = _mm512_set1_ps(_mm512_reduce_max_ps(m));
    for (int64_t j = 0; j < nv; j += LANES) {
      const __mmask16 k = nv - j >= LANES ? __mmask16(0xFFFF) : __mmask16((1u << (nv - j)) - 1);
      _mm512_mask_storeu_ps(s[g] + j, k, _mm512_sub_ps(_mm512_maskz_loadu_ps(k, s[g] + j), mx));
    }
    exp_avx512(s[g], nv);
  }
  float denom[G];
  for (int g = 0; g < G; ++g) denom[g] = 0.f;
  for (int64_t j = 0; j < nv; ++j)
    for (int g = 0; g < G; ++g) denom[g] += s[g][j];
  __m512 out[G][DC];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < DC; ++c) out[g][c] = _mm512_setzero_ps();
  for (int64_t j = 0; j < nv; ++j) {
    if (j + 8 < nv) prefetch_row(vals[prefix ? j + 8 : int64_t(vis[j + 8])], DC * LANES * sizeof(C));
    const C* v = vals[prefix ? j : int64_t(vis[j])];
    __m512 vv[DC];
    for (int c = 0; c < DC; ++c) vv[c] = load16<C>(v + c * LANES);
    for (int g = 0; g < G; ++g) {
      const __m512 p = _mm512_set1_ps(s[g][j]);
      for (int c = 0; c < DC; ++c) out[g][c] = _mm512_fmadd_ps(p, vv[c], out[g][c]);
    }
  }
  for (int g = 0; g < G; ++g) {
    const __m512 dv = _mm512_set1_ps(denom[g]);
    for (int c = 0; c < DC; ++c) _mm512_storeu_ps(outs[g] + c * LANES, _mm512_div_ps(out[g][c], dv));
  }
}

// A row's group of heads (their scores in all, one row of stride each), in blocks the registers
// hold (up to 4 heads of 64 dims, 2 of 128).
template <int DC, typename C>
__attribute__((target("avx512f")))
void group_avx512(int64_t group, const C* const* vals, const int32_t* vis, int64_t nv, bool prefix, float* all,
                  float* scores, int64_t stride, float* const* outs) {
  constexpr int B = DC <= 4 ? 4 : 2;
  for (int64_t g = 0; g < group;) {
    const int64_t b = std::min<int64_t>(B, group - g);
    float* a = all + g * stride;
    float* const* o = outs + g;
    if constexpr (B == 4) {
      if (b == 4) heads_avx512<DC, 4, C>(vals, vis, nv, prefix, a, scores, stride, o);
      if (b == 3) heads_avx512<DC, 3, C>(vals, vis, nv, prefix, a, scores, stride, o);
    }
    if (b == 2) heads_avx512<DC, 2, C>(vals, vis, nv, prefix, a, scores, stride, o);
    if (b == 1) heads_avx512<DC, 1, C>(vals, vis, nv, prefix, a, scores, stride, o);
    g += b;
  }
}
#endif

void head_scalar(const float* qrow, const float* const* keys, const float* const* vals, int64_t d, const int32_t* vis,
                 int64_t nv,
                 float* scores, float sc, float* o) {
  float mx = -INFINITY;
  for (int64_t j = 0; j < nv; ++j) {
    scores[j] = dot_scalar(qrow, keys[vis[j]], d) * sc;
    mx = std::fmax(mx, scores[j]);
  }
  for (int64_t j = 0; j < nv; ++j) scores[j] = exp_scalar(scores[j] - mx);
  float denom = 0.f;
  for (int64_t j = 0; j < nv; ++j) denom += scores[j];
  for (int64_t j = 0; j < nv; ++j) {
    const float* v = vals[vis[j]];
    for (int64_t x = 0; x < d; ++x) o[x] = std::fma(scores[j], v[x], o[x]);
  }
  for (int64_t x = 0; x < d; ++x) o[x] = o[x] / denom;
}

#ifdef ATTEND_X86
// ---- AVX2 (hosts without AVX-512): the same operations, eight lanes at a time ----
//
// A task scores all its queries (rows x heads) one block of keys at a time, and adds the values of
// one block of keys into every pending row's output before the next. A row and head at a time,
// streaming all the task's keys and values each, a prompt chunk's 512 rows after 2.5k cached
// tokens read 1.4 MB a row and head from L3, and attention ran at a twelfth of the FMA rate. Each
// score and each output element is formed by head_scalar's operations in its order: the bits are
// the same.

constexpr int64_t KEY_BLOCK = 64;  // keys (and values) a block: 16 KB of fp32 rows of 64, in L1

// Eight keys' scores for one query, each formed exactly as dot_scalar forms it: its lane sums 0-7
// (a) and 8-15 (b) over the head in chunks of 16, then l + 8, l + 4, l + 2, l + 1. Four keys'
// sums run side by side (eight chains of FMAs, where one pair's four waited on each one's latency);
// the last three steps run on pairs, then quadruples, of keys at once (the same additions, a few
// shuffles per key instead of a horizontal sum each); the result holds key j in lane j. DC: the
// head's chunks of 16, or 0 for a head size given at run time (d).
template <int DC>
__attribute__((target("avx2,fma")))
inline __m256 scores8_avx2(const float* q, const float* const* keys, int64_t d) {
  const int64_t dc = DC ? DC : d / LANES;
  __m256 p[4];  // keys 2i and 2i + 1 after l + 4: [key 2i's four sums | key 2i + 1's]
  for (int h = 0; h < 2; ++h) {  // keys 4h .. 4h + 3
    __m256 a[4], b[4];
    for (int k = 0; k < 4; ++k) a[k] = b[k] = _mm256_setzero_ps();
    for (int64_t c = 0; c < dc; ++c) {
      const __m256 qa = _mm256_loadu_ps(q + c * LANES), qb = _mm256_loadu_ps(q + c * LANES + 8);
      for (int k = 0; k < 4; ++k) {
        a[k] = _mm256_fmadd_ps(qa, _mm256_loadu_ps(keys[4 * h + k] + c * LANES), a[k]);
        b[k] = _mm256_fmadd_ps(qb, _mm256_loadu_ps(keys[4 * h + k] + c * LANES + 8), b[k]);
      }
    }
    for (int i = 0; i < 2; ++i) {
      const __m256 h0 = _mm256_add_ps(a[2 * i], b[2 * i]), h1 = _mm256_add_ps(a[2 * i + 1], b[2 * i + 1]);  // l + (l + 8)
      p[2 * h + i] = _mm256_add_ps(_mm256_permute2f128_ps(h0, h1, 0x20), _mm256_permute2f128_ps(h0, h1, 0x31));
    }
  }
  // l + 2, within each 128-bit half: [key 4i's two sums, key 4i + 2's | key 4i + 1's, key 4i + 3's]
  __m256 s[2];
  for (int i = 0; i < 2; ++i) {
    const __m256d x = _mm256_castps_pd(p[2 * i]), y = _mm256_castps_pd(p[2 * i + 1]);
    s[i] = _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(x, y)), _mm256_castpd_ps(_mm256_unpackhi_pd(x, y)));
  }
  // l + 1: [keys 0, 2, 4, 6 | 1, 3, 5, 7], then key j to lane j
  const __m256 f = _mm256_add_ps(_mm256_shuffle_ps(s[0], s[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm256_shuffle_ps(s[0], s[1], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm256_permutevar8x32_ps(f, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

// The scores of nq queries over a task's n keys (n a multiple of 16): all[r * n + j].
__attribute__((target("avx2,fma")))
void scores_avx2(const float* const* qrows, int64_t nq, const float* const* keys, int64_t n, int64_t d, float sc,
                 float* all) {
  const __m256 vsc = _mm256_set1_ps(sc);
  for (int64_t j0 = 0; j0 < n; j0 += KEY_BLOCK) {
    const int64_t j1 = std::min(n, j0 + KEY_BLOCK);
    for (int64_t r = 0; r < nq; ++r)
      for (int64_t j = j0; j < j1; j += 8) {
        const __m256 s8 = d == 64 ? scores8_avx2<4>(qrows[r], keys + j, d)
                        : d == 128 ? scores8_avx2<8>(qrows[r], keys + j, d) : scores8_avx2<0>(qrows[r], keys + j, d);
        _mm256_storeu_ps(all + r * n + j, _mm256_mul_ps(s8, vsc));
      }
  }
}

// head_scalar's softmax of a row's G heads' nv scores each, in place: each head's max subtracted,
// exp (the same polynomial), and its sequential sum, into denom. The max is exact in any order;
// the heads' sums run side by side, each in key order (one chain of dependent additions would
// wait on each one's latency).
template <int G>
__attribute__((target("avx2,fma")))
void softmax_avx2(float* const* s, int64_t nv, float* denom) {
  for (int g = 0; g < G; ++g) {
    __m256 m = _mm256_set1_ps(-INFINITY);
    int64_t j = 0;
    for (; j + 8 <= nv; j += 8) m = _mm256_max_ps(m, _mm256_loadu_ps(s[g] + j));
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, m);
    float mx = -INFINITY;
    for (int l = 0; l < 8; ++l) mx = std::max(mx, lanes[l]);
    for (; j < nv; ++j) mx = std::max(mx, s[g][j]);
    const __m256 vmx = _mm256_set1_ps(mx);
    for (j = 0; j + 8 <= nv; j += 8) _mm256_storeu_ps(s[g] + j, _mm256_sub_ps(_mm256_loadu_ps(s[g] + j), vmx));
    for (; j < nv; ++j) s[g][j] = s[g][j] - mx;
    exp_avx2(s[g], nv);
  }
  float sum[G];
  for (int g = 0; g < G; ++g) sum[g] = 0.f;
  for (int64_t j = 0; j < nv; ++j)
    for (int g = 0; g < G; ++g) sum[g] += s[g][j];
  for (int g = 0; g < G; ++g) denom[g] = sum[g];
}

// A row's group of heads, in blocks of up to 4.
__attribute__((target("avx2,fma")))
void softmax_group_avx2(float* const* s, int64_t group, int64_t nv, float* denom) {
  for (int64_t g = 0; g < group;) {
    const int64_t b = std::min<int64_t>(4, group - g);
    if (b == 4) softmax_avx2<4>(s + g, nv, denom + g);
    if (b == 3) softmax_avx2<3>(s + g, nv, denom + g);
    if (b == 2) softmax_avx2<2>(s + g, nv, denom + g);
    if (b == 1) softmax_avx2<1>(s + g, nv, denom + g);
    g += b;
  }
}

// out[c0 .. c0 + 8 W) += s[j] * value j, for j in [j0, j1), in order.
template <int W>
__attribute__((target("avx2,fma")))
inline void add_values_avx2(const PendingRow& row, const float* const* vals, int64_t j0, int64_t j1, int64_t c0) {
  __m256 acc[W];
  for (int c = 0; c < W; ++c) acc[c] = _mm256_loadu_ps(row.out + c0 + 8 * c);
  for (int64_t j = j0; j < j1; ++j) {
    const __m256 p = _mm256_set1_ps(row.s[j]);
    const float* v = vals[row.vis ? int64_t(row.vis[j]) : j] + c0;
    for (int c = 0; c < W; ++c) acc[c] = _mm256_fmadd_ps(p, _mm256_loadu_ps(v + 8 * c), acc[c]);
  }
  for (int c = 0; c < W; ++c) _mm256_storeu_ps(row.out + c0 + 8 * c, acc[c]);
}

// head_scalar's weighted values for every pending row, a block of values at a time: each output
// element takes its keys' terms in key order, then the division by its sum.
__attribute__((target("avx2,fma")))
void values_avx2(const PendingRow* pending, int64_t count, const float* const* vals, int64_t d) {
  int64_t most = 0;
  for (int64_t r = 0; r < count; ++r) most = std::max(most, pending[r].nv);
  for (int64_t j0 = 0; j0 < most; j0 += KEY_BLOCK)
    for (int64_t r = 0; r < count; ++r) {
      const PendingRow& row = pending[r];
      if (r + 1 < count) {  // the next row's probabilities and output, a task's rows apart in L2 or L3
        const PendingRow& next = pending[r + 1];
        for (int64_t b = 0; b < KEY_BLOCK * 4; b += 64)
          _mm_prefetch(reinterpret_cast<const char*>(next.s + j0) + b, _MM_HINT_T0);
        for (int64_t b = 0; b < d * 4; b += 64) _mm_prefetch(reinterpret_cast<const char*>(next.out) + b, _MM_HINT_T0);
      }
      const int64_t j1 = std::min(row.nv, j0 + KEY_BLOCK);
      if (j1 <= j0) continue;
      for (int64_t c0 = 0; c0 < d; c0 += 64) {  // d is a multiple of 16: 8 registers, or the last 2, 4 or 6
        switch (std::min<int64_t>(64, d - c0) / 8) {
          case 2: add_values_avx2<2>(row, vals, j0, j1, c0); break;
          case 4: add_values_avx2<4>(row, vals, j0, j1, c0); break;
          case 6: add_values_avx2<6>(row, vals, j0, j1, c0); break;
          default: add_values_avx2<8>(row, vals, j0, j1, c0); break;
        }
      }
    }
  for (int64_t r = 0; r < count; ++r) {
    const PendingRow& row = pending[r];
    const __m256 dv = _mm256_set1_ps(row.denom);
    for (int64_t c = 0; c < d; c += 8) _mm256_storeu_ps(row.out + c, _mm256_div_ps(_mm256_loadu_ps(row.out + c), dv));
  }
}
#endif

// Where a task's keys and values come from: cached rows of type C (by slot) and this step's new
// rows (fp32, already rounded as the cache holds them: the callers pass ``as_stored`` values).
template <typename C>
struct Source {
  const C *kc, *vc;
  const float *k, *v;
  const int64_t* context;  // this sequence's cached slots (W)
  const int64_t* rows;     // this sequence's query rows (Q); row j - W holds new key j
  int64_t W, Q, KV, h, d;
};

// A task's key and value rows, one pointer each in position order (``where``: a key's index or
// -1), held as type R. Keys are padded to a multiple of 16 with a zero row. Rows already of type
// R are read in place; the others are converted once into the task's own buffer (bf16 to fp32
// and fp32 to bf16 are both exact here: new rows are bf16 values when the cache is bf16).
template <typename R>
struct Rows {
  std::vector<const R*> keys, vals;
  std::vector<R> buffer, zero;  // buffer: the converted rows, a key and its value side by side
  int64_t next = 0;             // the buffer's next free pair

  template <typename C>
  void gather(const Source<C>& s, const int32_t* where, int64_t n, int64_t padded) {
    const int64_t d = s.d;
    zero.assign(d, R(0.f));
    keys.assign(padded, zero.data());
    vals.assign(n, nullptr);
    // Room for the rows not already of type R only: reading bf16 in place, a decode converts one
    // row, and a buffer for every key (zeroed when it grows) had cost a decode a quarter of its time.
    int64_t converted = 0;
    for (int64_t j = 0; j < s.W + s.Q; ++j)
      converted += where[j] >= 0 && (j < s.W ? !std::is_same_v<C, R> : !std::is_same_v<float, R>);
    buffer.resize(2 * converted * d);
    next = 0;
    for (int64_t j = 0; j < s.W + s.Q; ++j) {
      const int64_t at = where[j];
      if (at < 0) continue;
      if (j < s.W) {
        const int64_t row = (s.context[j] * s.KV + s.h) * d;
        place(s.kc + row, s.vc + row, at, d);
      } else {
        const int64_t row = (s.rows[j - s.W] * s.KV + s.h) * d;
        place(s.k + row, s.v + row, at, d);
      }
    }
  }

  template <typename X>
  void place(const X* k, const X* v, int64_t at, int64_t d) {
    if constexpr (std::is_same_v<X, R>) {
      keys[at] = k;
      vals[at] = v;
    } else {
      R* kd = buffer.data() + 2 * next++ * d;
      R* vd = kd + d;
      keys[at] = kd;
      vals[at] = vd;
#ifdef ATTEND_X86
      if constexpr (std::is_same_v<X, c10::BFloat16> && std::is_same_v<R, float>) {
        static const bool avx512 = __builtin_cpu_supports("avx512f");
        if (avx512) {
          widen_avx512(k, d, kd);
          widen_avx512(v, d, vd);
          return;
        }
      }
#endif
      for (int64_t x = 0; x < d; ++x) {
        kd[x] = static_cast<R>(static_cast<float>(k[x]));
        vd[x] = static_cast<R>(static_cast<float>(v[x]));
      }
    }
  }
};

#ifdef ATTEND_X86
// Every query's scores over a task's keys held as type R (nq queries: the task's rows times the
// group's heads), for head size 64 or 128.
template <typename R>
__attribute__((target("avx512f")))
void task_scores_avx512(const float* const* qrows, int64_t nq, const Rows<R>& rows, int64_t n, int64_t d, float sc,
                        float* all) {
  if (d == 64)
    scores_avx512<4, R>(qrows, nq, rows.keys.data(), n, sc, all);
  else
    scores_avx512<8, R>(qrows, nq, rows.keys.data(), n, sc, all);
}

// A row's group of heads, their scores in all (one row of n each): softmax and values.
template <typename R>
__attribute__((target("avx512f")))
void heads_of_row_avx512(int64_t group, const Rows<R>& rows, int64_t n, int64_t d, const int32_t* vis, int64_t nv,
                         bool prefix, float* all, float* scores, float* const* outs) {
  if (d == 64)
    group_avx512<4, R>(group, rows.vals.data(), vis, nv, prefix, all, scores, n, outs);
  else
    group_avx512<8, R>(group, rows.vals.data(), vis, nv, prefix, all, scores, n, outs);
}
#endif

// The code path: 0 = the widest this CPU has, 1 = plain C, 2 = AVX2 (tests run every path a
// host may take).
enum class Path { Scalar, Avx2, Avx512 };

Path pick_path(int64_t force) {
#ifdef ATTEND_X86
  static const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  static const bool avx512 = __builtin_cpu_supports("avx512f");
  if (force == 1) return Path::Scalar;
  if (force == 2) return avx2 ? Path::Avx2 : Path::Scalar;
  return avx512 ? Path::Avx512 : avx2 ? Path::Avx2 : Path::Scalar;
#else
  return Path::Scalar;
#endif
}

// A thread's buffers for attend's tasks (attend sizes each before use).
template <typename C>
struct Workspace {
  std::vector<int32_t> where, vis;
  std::vector<float> all, scores;
  Rows<C> rows_in_place;    // AVX-512: the task's rows as the cache holds them
  Rows<float> rows_widened;  // the AVX2 and C paths (and head sizes AVX-512 does not take): fp32
  std::vector<const float*> qrows, qall;  // qall: the task's queries (its rows' heads), scored together
  std::vector<int64_t> scored;             // a chunk row's first query in qall
  std::vector<float*> outs;
  std::vector<PendingRow> pending;         // AVX2: the task's rows and heads whose values are still to add
  std::vector<float*> probs;               // AVX2: a row's heads' probabilities
  std::vector<float> denoms;               // and their sums
};

template <typename C>
at::Tensor attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& kc,
                  const at::Tensor& vc, const at::Tensor& rows, const at::Tensor& context, const at::Tensor& mask,
                  double scale, Path path) {
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
  const bool wide = path == Path::Avx512 && (d == 64 || d == 128);
  const float sc = float(scale);

  // One task per (sequence, kv head, chunk of query rows): its keys are gathered once and shared
  // by the group's heads and the chunk's rows. Only a step with very little work (a decode over a
  // few dozen keys) runs on the calling thread, where a parallel region's wake-up would cost more
  // than it saves: a decode's keys and values come mostly from memory (the weights have streamed
  // through the caches since the last step), and two threads fetch them side by side. A step of
  // few sequences splits its rows so that every thread has a task.
  const int64_t work = S * Q * H * (W + Q);
  const int64_t threads = work < (1 << 8) ? 1 : at::get_num_threads();
  const int64_t chunks = std::min<int64_t>(Q, std::max<int64_t>(1, (2 * threads + S * KV - 1) / (S * KV)));
  const int64_t per_chunk = (Q + chunks - 1) / chunks;
  const int64_t tasks = S * KV * chunks;
  at::parallel_for(0, tasks, threads == 1 ? tasks : 1, [&](int64_t begin, int64_t end) {
    // The thread's buffers, kept from call to call (a decode makes 30 calls a step, and allocating
    // them anew each time showed in the step's profile); each is sized here and written before it is read.
    thread_local Workspace<C> ws;
    auto& [where, vis, all, scores, rows_in_place, rows_widened, qrows, qall, scored, outs, pending, probs, denoms] = ws;
    probs.resize(group);
    denoms.resize(group);
    where.resize(W + Q);
    vis.resize(W + Q);
    scores.resize(W + Q);
    qrows.resize(group);
    scored.resize(Q);
    outs.resize(group);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t s = task / (KV * chunks), h = (task / chunks) % KV, chunk = task % chunks;
      const int64_t i0 = chunk * per_chunk, i1 = std::min(Q, i0 + per_chunk);
      // the keys any of the chunk's rows sees, in position order
      int64_t n = 0;
      for (int64_t j = 0; j < W + Q; ++j) {
        bool seen = false;
        for (int64_t i = i0; i < i1 && !seen; ++i) seen = rp[s * Q + i] < T && mp[(s * Q + i) * (W + Q) + j];
        where[j] = seen ? int32_t(n++) : -1;
      }
      if (n == 0) continue;
      const int64_t padded = (n + 15) / 16 * 16;
      // AVX-512 reads keys and values in place, widening each load: a tree's or a canvas's rows
      // reread them, and 128 bf16 keys and values stay in L1 where a widened fp32 copy does not.
      // The other paths read a widened copy. Either way, the same values.
      const Source<C> src{kcp, vcp, kp, vp, cp + s * W, rp + s * Q, W, Q, KV, h, d};
      if (wide)
        rows_in_place.gather(src, where.data(), n, padded);
      else
        rows_widened.gather(src, where.data(), n, padded);
#ifdef ATTEND_X86
      const bool blocked = wide || path == Path::Avx2;
      if (blocked) {  // every row's and head's scores first: each block of keys serves them all
        qall.clear();
        for (int64_t i = i0; i < i1; ++i) {
          const int64_t t = rp[s * Q + i];
          scored[i - i0] = t < T ? int64_t(qall.size()) : -1;  // a padded query has none
          if (t < T)
            for (int64_t g = 0; g < group; ++g) qall.push_back(qp + (t * H + h * group + g) * d);
        }
        all.resize(qall.size() * padded);
        scores.resize(group * padded);
        if (wide)
          task_scores_avx512(qall.data(), int64_t(qall.size()), rows_in_place, padded, d, sc, all.data());
        else
          scores_avx2(qall.data(), int64_t(qall.size()), rows_widened.keys.data(), padded, d, sc, all.data());
        pending.clear();
      }
#endif
      for (int64_t i = i0; i < i1; ++i) {
        const int64_t t = rp[s * Q + i];
        if (t >= T) continue;  // a padded query
        const bool* row_mask = mp + (s * Q + i) * (W + Q);
        int64_t nv = 0;
        for (int64_t j = 0; j < W + Q; ++j)
          if (row_mask[j]) vis[nv++] = where[j];
        if (nv == 0) continue;
        // The row sees the task's first nv keys (vis is 0..nv-1: every key, or a causal row's keys up to
        // itself): its scores are read where they were computed, not gathered.
        const bool prefix = vis[nv - 1] == nv - 1;
        for (int64_t g = 0; g < group; ++g) {
          qrows[g] = qp + (t * H + h * group + g) * d;
          outs[g] = op + (t * H + h * group + g) * d;
        }
#ifdef ATTEND_X86
        if (wide) {
          heads_of_row_avx512(group, rows_in_place, padded, d, vis.data(), nv, prefix,
                              all.data() + scored[i - i0] * padded, scores.data(), outs.data());
          continue;
        }
        if (path == Path::Avx2) {
          // A row that sees the task's first nv keys keeps its probabilities where they were scored,
          // and its values wait for the task's blocked pass; another row's are gathered and added now.
          for (int64_t g = 0; g < group; ++g) {
            float* a = all.data() + (scored[i - i0] + g) * padded;
            probs[g] = prefix ? a : scores.data() + g * padded;
            if (!prefix)
              for (int64_t j = 0; j < nv; ++j) probs[g][j] = a[vis[j]];
          }
          softmax_group_avx2(probs.data(), group, nv, denoms.data());
          for (int64_t g = 0; g < group; ++g) {
            const PendingRow row{probs[g], prefix ? nullptr : vis.data(), nv, denoms[g], outs[g]};
            if (prefix)
              pending.push_back(row);
            else
              values_avx2(&row, 1, rows_widened.vals.data(), d);
          }
          continue;
        }
#endif
        for (int64_t g = 0; g < group; ++g)
          head_scalar(qrows[g], rows_widened.keys.data(), rows_widened.vals.data(), d, vis.data(), nv, scores.data(), sc, outs[g]);
      }
#ifdef ATTEND_X86
      if (path == Path::Avx2) values_avx2(pending.data(), int64_t(pending.size()), rows_widened.vals.data(), d);
#endif
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
    return attend<c10::BFloat16>(qc, kk, vv, kcc, vcc, rc, cc, mc, scale, pick_path(force_scalar));
  TORCH_CHECK(kc.scalar_type() == at::kFloat, "attend_rows: the cache must be bf16 or fp32");
  return attend<float>(qc, kk, vv, kcc, vcc, rc, cc, mc, scale, pick_path(force_scalar));
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(dualserve, lib) {
  lib.def("attend_rows(Tensor q, Tensor k, Tensor v, Tensor kc, Tensor vc, Tensor rows, Tensor context, "
          "Tensor mask, float scale, int force_scalar=0) -> Tensor");
}

TORCH_LIBRARY_IMPL(dualserve, CPU, lib) { lib.impl("attend_rows", attend_rows); }

// The packages' direct call (c_shim.h).
DUALSERVE_SHIM aoti_torch_cpu_attend_rows(AtenTensorHandle q, AtenTensorHandle k, AtenTensorHandle v, AtenTensorHandle kc,
                                          AtenTensorHandle vc, AtenTensorHandle rows, AtenTensorHandle context,
                                          AtenTensorHandle mask, double scale, int64_t force_scalar,
                                          AtenTensorHandle* ret0) {
  using dualserve_shim::tensor;
  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE({
    dualserve_shim::give(ret0, attend_rows(tensor(q), tensor(k), tensor(v), tensor(kc), tensor(vc), tensor(rows),
                                           tensor(context), tensor(mask), scale, force_scalar));
  });
}
