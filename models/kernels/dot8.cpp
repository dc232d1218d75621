// dualserve::dot8_linear: y = x @ W^T with W in GGUF-style groups of 32 (int4 with a
// scale and a minimum, or int8 with a scale) and x quantized per row to int8 groups
// of 32 (llama.cpp's Q8 activations). Every group's dot product is an exact integer
// sum (AVX512-VNNI vpdpbusd, AVX2 vpmaddubsw, or plain C), so all code
// paths give the same integers; the float epilogue runs in one fixed order per
// output, so a row's result is the same bits for any row count, thread count or CPU.
//
// Weight layout (built by models/kernels/__init__.py: pack):
//   tiles of 16 output channels; per tile, per group g, CHUNKS chunks of 64 bytes,
//   lane c (4 bytes) of a chunk belongs to channel c of the tile:
//     int4 (bits 4): chunk j holds k = 8j..8j+3 in the low nibbles and 8j+4..8j+7
//                    in the high nibbles, q in 0..15, w = d * q + m;
//     int8 (bits 8): chunk j holds k = 4j..4j+3 as u = q + 128, w = d * q.
//   d and m: fp16, [tile][group][16].
// Per output channel n and row r:  y = sum_g sx[r,g] * (d[n,g] * dot + m[n,g] * asum[r,g])
// where dot = sum_k q[n,k] a[r,k] (int4) or sum_k u a - 128 asum (int8), a = round(x / sx).

#include <torch/library.h>
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <c10/util/Half.h>
#include <c10/util/BFloat16.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#define DOT8_X86 1
#endif

namespace {

constexpr int TILE = 16;
constexpr int GROUP = 32;
constexpr int MAX_ROWS = 8;  // rows per register block
constexpr int PREFETCH = 4096;  // bytes ahead in the weight stream

struct Acts {
  const int8_t* a;        // (M, K)
  const float* sx;        // (M, G)
  const int32_t* sum;     // (M, G)
  const float* fsum;      // (M, G): float(sum), exact; read by broadcast loads, not converted per tile
  const int32_t* sum128;  // (M, G): 128 * sum (int8 weights are stored as q + 128)
  int64_t K, G;
};

struct Weights {
  const uint8_t* q;
  const uint16_t* d;  // fp16 bits
  const uint16_t* m;
  int64_t G;
  int bits;
  int chunks() const { return bits == 4 ? 4 : 8; }
  const uint8_t* tile(int64_t t) const { return q + t * G * chunks() * 64; }
  const uint16_t* dt(int64_t t) const { return d + t * G * TILE; }
  const uint16_t* mt(int64_t t) const { return m + t * G * TILE; }
};

inline float half_to_float(uint16_t h) { return static_cast<float>(c10::Half(h, c10::Half::from_bits())); }

inline int32_t load4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// ---- the reference path: plain C, the same integers and the same float order ----

void tile_scalar(const Weights& w, int64_t t, const Acts& x, int64_t r0, int rows, float* out, int64_t ldo,
                 int valid) {
  const uint8_t* q = w.tile(t);
  for (int r = 0; r < rows; ++r) {
    const int8_t* a = x.a + (r0 + r) * x.K;
    for (int c = 0; c < valid; ++c) {
      float y = 0.f;
      for (int64_t g = 0; g < w.G; ++g) {
        const uint8_t* qg = q + g * w.chunks() * 64;
        int32_t dot = 0;
        for (int j = 0; j < w.chunks(); ++j) {
          const uint8_t* lane = qg + j * 64 + c * 4;
          for (int b = 0; b < 4; ++b) {
            if (w.bits == 4) {
              dot += int32_t(lane[b] & 0x0F) * a[g * GROUP + 8 * j + b];
              dot += int32_t(lane[b] >> 4) * a[g * GROUP + 8 * j + 4 + b];
            } else {
              dot += (int32_t(lane[b]) - 128) * a[g * GROUP + 4 * j + b];
            }
          }
        }
        const int64_t rg = (r0 + r) * x.G + g;
        float v = half_to_float(w.dt(t)[g * TILE + c]) * float(dot);
        if (w.bits == 4) v = std::fma(half_to_float(w.mt(t)[g * TILE + c]), float(x.sum[rg]), v);
        y = std::fma(x.sx[rg], v, y);
      }
      out[r * ldo + c] = y;
    }
  }
}

#ifdef DOT8_X86

// ---- AVX-512 VNNI: 16 channels per register ----

template <int R, int BITS>
__attribute__((target("avx512f,avx512bw,avx512vnni,f16c,fma")))
void tile_avx512_rows(const Weights& w, int64_t t, const Acts& x, int64_t r0, float* out, int64_t ldo, int valid) {
  constexpr int CH = BITS == 4 ? 4 : 8;
  const uint8_t* q = w.tile(t);
  const __m512i low = _mm512_set1_epi8(0x0F);
  __m512 y[R];
  for (int r = 0; r < R; ++r) y[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < w.G; ++g) {
    __m512i acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_si512();
    const uint8_t* qg = q + g * CH * 64;
    const int64_t k0 = g * GROUP;
    // Two rows or more make a group's work long enough that the hardware prefetcher falls behind
    // the weight stream (without the hint, 3 rows cost more than 4); one row streams best unaided.
    if (R >= 2)
      for (int j = 0; j < CH; ++j) _mm_prefetch(reinterpret_cast<const char*>(qg + PREFETCH + j * 64), _MM_HINT_T0);
    for (int j = 0; j < CH; ++j) {
      const __m512i v = _mm512_loadu_si512(qg + j * 64);
      if (BITS == 4) {
        const __m512i lo = _mm512_and_si512(v, low);
        const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
        for (int r = 0; r < R; ++r) {
          const int8_t* a = x.a + (r0 + r) * x.K + k0 + 8 * j;
          acc[r] = _mm512_dpbusd_epi32(acc[r], lo, _mm512_set1_epi32(load4(a)));
          acc[r] = _mm512_dpbusd_epi32(acc[r], hi, _mm512_set1_epi32(load4(a + 4)));
        }
      } else {
        for (int r = 0; r < R; ++r) {
          const int8_t* a = x.a + (r0 + r) * x.K + k0 + 4 * j;
          acc[r] = _mm512_dpbusd_epi32(acc[r], v, _mm512_set1_epi32(load4(a)));
        }
      }
    }
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.dt(t) + g * TILE)));
    const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.mt(t) + g * TILE)));
    for (int r = 0; r < R; ++r) {
      const int64_t rg = (r0 + r) * x.G + g;
      __m512i dot = acc[r];
      if (BITS == 8) dot = _mm512_sub_epi32(dot, _mm512_set1_epi32(x.sum128[rg]));
      __m512 v = _mm512_mul_ps(d, _mm512_cvtepi32_ps(dot));
      if (BITS == 4) v = _mm512_fmadd_ps(m, _mm512_set1_ps(x.fsum[rg]), v);
      y[r] = _mm512_fmadd_ps(_mm512_set1_ps(x.sx[rg]), v, y[r]);
    }
  }
  const __mmask16 mask = valid >= TILE ? __mmask16(0xFFFF) : __mmask16((1u << valid) - 1);
  for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(out + r * ldo, mask, y[r]);
}

template <int BITS>
void tile_avx512(const Weights& w, int64_t t, const Acts& x, int64_t r0, int rows, float* out, int64_t ldo,
                 int valid) {
  switch (rows) {
    case 1: return tile_avx512_rows<1, BITS>(w, t, x, r0, out, ldo, valid);
    case 2: return tile_avx512_rows<2, BITS>(w, t, x, r0, out, ldo, valid);
    case 3: return tile_avx512_rows<3, BITS>(w, t, x, r0, out, ldo, valid);
    case 4: return tile_avx512_rows<4, BITS>(w, t, x, r0, out, ldo, valid);
    case 5: return tile_avx512_rows<5, BITS>(w, t, x, r0, out, ldo, valid);
    case 6: return tile_avx512_rows<6, BITS>(w, t, x, r0, out, ldo, valid);
    case 7: return tile_avx512_rows<7, BITS>(w, t, x, r0, out, ldo, valid);
    default: return tile_avx512_rows<8, BITS>(w, t, x, r0, out, ldo, valid);
  }
}

// ---- AVX2: each tile as two halves of 8 channels ----

// Rows per register block: 6 rows' int16 and float accumulators take 12 of the 16 registers
// (over the model's GEMMs, 6-row blocks ran 3-6% faster than 4-row ones at 4 to 12 rows).
constexpr int AVX2_ROWS = 6;

template <int R, int BITS>
__attribute__((target("avx2,fma,f16c")))
void tile_avx2_rows(const Weights& w, int64_t t, const Acts& x, int64_t r0, float* out, int64_t ldo, int valid) {
  constexpr int CH = BITS == 4 ? 4 : 8;
  const uint8_t* q = w.tile(t);
  const __m256i low = _mm256_set1_epi8(0x0F);
  for (int half = 0; half < 2; ++half) {
    __m256 y[R];
    for (int r = 0; r < R; ++r) y[r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < w.G; ++g) {
      __m256i acc[R];
      for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_si256();
      const uint8_t* qg = q + g * CH * 64 + half * 32;
      const int64_t k0 = g * GROUP;
      if (R >= 2 && half == 0)  // as in tile_avx512_rows
        for (int j = 0; j < CH; ++j) _mm_prefetch(reinterpret_cast<const char*>(qg + PREFETCH + j * 64), _MM_HINT_T0);
      if (BITS == 4) {
        // A group's 8 pair sums per lane stay in int16: |u * a| <= 15 * 127, so a pair is at
        // most 3810 and the group's sum at most 30480. One widening a group instead of one a
        // pair: fewer instructions, the same integers.
        __m256i acc16[R];
        for (int r = 0; r < R; ++r) acc16[r] = _mm256_setzero_si256();
        for (int j = 0; j < CH; ++j) {
          const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qg + j * 64));
          const __m256i lo = _mm256_and_si256(v, low);
          const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
          for (int r = 0; r < R; ++r) {
            const int8_t* a = x.a + (r0 + r) * x.K + k0 + 8 * j;
            acc16[r] = _mm256_add_epi16(acc16[r], _mm256_maddubs_epi16(lo, _mm256_set1_epi32(load4(a))));
            acc16[r] = _mm256_add_epi16(acc16[r], _mm256_maddubs_epi16(hi, _mm256_set1_epi32(load4(a + 4))));
          }
        }
        for (int r = 0; r < R; ++r) acc[r] = _mm256_madd_epi16(acc16[r], _mm256_set1_epi16(1));
      } else {
        // int8: a pair can reach 2 * 127 * 127, so each pair sum widens at once.
        for (int j = 0; j < CH; ++j) {
          const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qg + j * 64));
          const __m256i s = _mm256_xor_si256(v, _mm256_set1_epi8(char(0x80)));  // u - 128 = q, signed
          const __m256i mag = _mm256_sign_epi8(s, s);
          for (int r = 0; r < R; ++r) {
            const int8_t* a = x.a + (r0 + r) * x.K + k0 + 4 * j;
            const __m256i sa = _mm256_sign_epi8(_mm256_set1_epi32(load4(a)), s);
            acc[r] = _mm256_add_epi32(acc[r], _mm256_madd_epi16(_mm256_maddubs_epi16(mag, sa),
                                                                _mm256_set1_epi16(1)));
          }
        }
      }
      const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w.dt(t) + g * TILE + half * 8)));
      const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w.mt(t) + g * TILE + half * 8)));
      for (int r = 0; r < R; ++r) {
        const int64_t rg = (r0 + r) * x.G + g;
        __m256 v = _mm256_mul_ps(d, _mm256_cvtepi32_ps(acc[r]));  // int8: acc is already sum q a
        if (BITS == 4) v = _mm256_fmadd_ps(m, _mm256_set1_ps(x.fsum[rg]), v);
        y[r] = _mm256_fmadd_ps(_mm256_set1_ps(x.sx[rg]), v, y[r]);
      }
    }
    const int n = valid - half * 8;
    for (int r = 0; r < R; ++r) {
      if (n >= 8) {
        _mm256_storeu_ps(out + r * ldo + half * 8, y[r]);
      } else if (n > 0) {
        alignas(32) float buf[8];
        _mm256_store_ps(buf, y[r]);
        std::memcpy(out + r * ldo + half * 8, buf, sizeof(float) * n);
      }
    }
  }
}

template <int BITS>
void tile_avx2(const Weights& w, int64_t t, const Acts& x, int64_t r0, int rows, float* out, int64_t ldo,
               int valid) {
  switch (rows) {
    case 1: return tile_avx2_rows<1, BITS>(w, t, x, r0, out, ldo, valid);
    case 2: return tile_avx2_rows<2, BITS>(w, t, x, r0, out, ldo, valid);
    case 3: return tile_avx2_rows<3, BITS>(w, t, x, r0, out, ldo, valid);
    case 4: return tile_avx2_rows<4, BITS>(w, t, x, r0, out, ldo, valid);
    case 5: return tile_avx2_rows<5, BITS>(w, t, x, r0, out, ldo, valid);
    default: return tile_avx2_rows<6, BITS>(w, t, x, r0, out, ldo, valid);
  }
}

#endif  // DOT8_X86

using TileFn = void (*)(const Weights&, int64_t, const Acts&, int64_t, int, float*, int64_t, int);

struct Path {
  const char* name;
  TileFn four, eight;
  int rows;
};

// DUALSERVE_DOT8_PATH=avx2 or scalar forces a narrower path than the CPU allows (tests run
// every path a CI host may take).
Path pick_path() {
  const char* want = std::getenv("DUALSERVE_DOT8_PATH");
  const std::string forced = want ? want : "";
  if (forced == "scalar") return {"scalar", tile_scalar, tile_scalar, MAX_ROWS};
#ifdef DOT8_X86
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  if (avx2 && forced == "avx2") return {"avx2", tile_avx2<4>, tile_avx2<8>, AVX2_ROWS};
  if (avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vnni"))
    return {"avx512_vnni", tile_avx512<4>, tile_avx512<8>, MAX_ROWS};
  if (avx2) return {"avx2", tile_avx2<4>, tile_avx2<8>, AVX2_ROWS};
#endif
  return {"scalar", tile_scalar, tile_scalar, MAX_ROWS};
}

Path& path(int64_t force_scalar) {
  static Path best = pick_path();
  static Path scalar = {"scalar", tile_scalar, tile_scalar, MAX_ROWS};
  return force_scalar ? scalar : best;
}

// Per row and group of 32: sx = max|x| / 127, a = round(x / sx) (ties to even), sum = sum a.
// Every path divides (not multiplies by a reciprocal) and rounds in the default mode, so
// they agree bit for bit.
inline void quantize_group_scalar(const float* v, int8_t* a, float* sx, int32_t* sum) {
  float amax = 0.f;
  for (int i = 0; i < GROUP; ++i) amax = std::fmax(amax, std::fabs(v[i]));
  const float s = amax / 127.f;
  int32_t total = 0;
  for (int i = 0; i < GROUP; ++i) {
    const int32_t qi = s > 0.f ? int32_t(std::nearbyint(v[i] / s)) : 0;
    a[i] = int8_t(qi);
    total += qi;
  }
  *sx = s;
  *sum = total;
}

#ifdef DOT8_X86
__attribute__((target("avx512f,avx512bw")))
void quantize_group_avx512(const float* v, int8_t* a, float* sx, int32_t* sum) {
  const __m512 x0 = _mm512_loadu_ps(v), x1 = _mm512_loadu_ps(v + 16);
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(x0), _mm512_abs_ps(x1)));
  const float s = amax / 127.f;
  *sx = s;
  if (!(s > 0.f)) {
    std::memset(a, 0, GROUP);
    *sum = 0;
    return;
  }
  const __m512 vs = _mm512_set1_ps(s);
  const __m512i q0 = _mm512_cvtps_epi32(_mm512_div_ps(x0, vs)), q1 = _mm512_cvtps_epi32(_mm512_div_ps(x1, vs));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(a), _mm512_cvtsepi32_epi8(q0));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(a + 16), _mm512_cvtsepi32_epi8(q1));
  *sum = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
}
#endif

// One group as ``digits`` int8 digits: digit k quantizes what the digits before it left over
// (x - a0 sx0 - a1 sx1 ...), each with its own scale, so two digits carry about 15 bits of the
// group (the residual is within half a step of the first digit, 1/254 of the group's range).
// The residual is computed in the same fp32 operations on every path (contraction is off).
inline void quantize_digits(const float* f, int64_t digits, int8_t* a, float* sx, int32_t* sum, int64_t stride_a,
                            int64_t stride_s, bool wide) {
  float rest[GROUP];
  const float* v = f;
  for (int64_t k = 0; k < digits; ++k) {
    int8_t* ak = a + k * stride_a;
#ifdef DOT8_X86
    if (wide) {
      quantize_group_avx512(v, ak, sx + k * stride_s, sum + k * stride_s);
    } else {
      quantize_group_scalar(v, ak, sx + k * stride_s, sum + k * stride_s);
    }
#else
    (void)wide;
    quantize_group_scalar(v, ak, sx + k * stride_s, sum + k * stride_s);
#endif
    if (k + 1 < digits) {
      const float s = sx[k * stride_s];
      for (int i = 0; i < GROUP; ++i) rest[i] = v[i] - float(ak[i]) * s;
      v = rest;
    }
  }
}

// Row r's digit k is quantized row r * digits + k: a row's digits sit side by side, and every
// quantized row is computed alone, so nothing depends on how many rows came together.
template <typename T>
void quantize_rows(const T* x, int64_t M, int64_t K, int64_t digits, int8_t* a, float* sx, int32_t* sum, bool simd) {
  const int64_t G = K / GROUP;
#ifdef DOT8_X86
  static const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
  const bool wide = avx512 && simd;
#else
  const bool wide = false;
#endif
  float v[GROUP];
  for (int64_t r = 0; r < M; ++r) {
    for (int64_t g = 0; g < G; ++g) {
      const T* xg = x + r * K + g * GROUP;
      const float* f;
      if constexpr (std::is_same_v<T, float>) {
        f = xg;
      } else {
        for (int i = 0; i < GROUP; ++i) v[i] = static_cast<float>(xg[i]);
        f = v;
      }
      const int64_t row = r * digits;
      quantize_digits(f, digits, a + row * K + g * GROUP, sx + row * G + g, sum + row * G + g, K, G, wide);
    }
  }
}

// x's rows quantized to int8 groups of 32, with what every tile function reads.
struct Quantized {
  std::vector<int8_t> a;
  std::vector<float> sx, fsum;
  std::vector<int32_t> sum, sum128;
  int64_t K, G;

  // M rows of x, each as ``digits`` quantized rows (quantize_digits).
  template <typename T>
  Quantized(const T* x, int64_t M, int64_t K_, bool simd, int64_t digits = 1) : a(M * digits * K_),
      sx(M * digits * (K_ / GROUP)), fsum(M * digits * (K_ / GROUP)), sum(M * digits * (K_ / GROUP)),
      sum128(M * digits * (K_ / GROUP)), K(K_), G(K_ / GROUP) {
    quantize_rows(x, M, K, digits, a.data(), sx.data(), sum.data(), simd);
    for (int64_t i = 0; i < M * digits * G; ++i) {
      fsum[i] = float(sum[i]);
      sum128[i] = 128 * sum[i];
    }
  }
  Acts acts() const { return Acts{a.data(), sx.data(), sum.data(), fsum.data(), sum128.data(), K, G}; }
};

Quantized quantize(const at::Tensor& x, int64_t force_scalar, int64_t digits) {
  TORCH_CHECK(digits >= 1 && digits <= 3, "dot8: digits must be 1, 2 or 3");
  const int64_t M = x.size(0), K = x.size(1);
  if (x.scalar_type() == at::kFloat) return Quantized(x.data_ptr<float>(), M, K, !force_scalar, digits);
  return Quantized(x.data_ptr<c10::BFloat16>(), M, K, !force_scalar, digits);
}

Weights checked_weights(const at::Tensor& q, const at::Tensor& d, const at::Tensor& m, int64_t K, int64_t n,
                        int64_t bits, const char* what) {
  TORCH_CHECK(bits == 4 || bits == 8, what, ": bits must be 4 or 8");
  const int64_t G = K / GROUP, tiles = (n + TILE - 1) / TILE;
  const int64_t chunk_bytes = (bits == 4 ? 4 : 8) * 64;
  TORCH_CHECK(q.numel() == tiles * G * chunk_bytes && d.numel() == tiles * G * TILE && m.numel() == d.numel(),
              what, ": the packed weight does not match the input width");
  return Weights{q.data_ptr<uint8_t>(), reinterpret_cast<const uint16_t*>(d.data_ptr<at::Half>()),
                 reinterpret_cast<const uint16_t*>(m.data_ptr<at::Half>()), G, int(bits)};
}

// y (M, n) = the quantized rows times the packed weight.
void product(const Weights& w, const Acts& acts, int64_t M, int64_t n, float* y, int64_t force_scalar) {
  const Path& p = path(force_scalar);
  const TileFn fn = w.bits == 4 ? p.four : p.eight;
  const int64_t tiles = (n + TILE - 1) / TILE;
  // A small product (a LoRA factor, a draft head's layer) runs on the calling thread: waking the
  // other threads costs more than its work. Rows never depend on the thread that computes them.
  const int64_t grain = M * n * acts.K < (int64_t(1) << 18) ? tiles : 4;
  at::parallel_for(0, tiles, grain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int valid = int(std::min<int64_t>(TILE, n - t * TILE));
      for (int64_t r0 = 0; r0 < M; r0 += p.rows) {
        const int rows = int(std::min<int64_t>(p.rows, M - r0));
        fn(w, t, acts, r0, rows, y + r0 * n + t * TILE, n, valid);
      }
    }
  });
}

// y (M, n) = rows of ``digits`` quantized rows each times the weight: the digits' products are
// added in digit order, in fp32, the same way for any M.
void product_digits(const Weights& w, const Acts& acts, int64_t M, int64_t digits, int64_t n, float* y,
                    int64_t force_scalar) {
  if (digits == 1) {
    product(w, acts, M, n, y, force_scalar);
    return;
  }
  std::vector<float> parts(M * digits * n);
  product(w, acts, M * digits, n, parts.data(), force_scalar);
  for (int64_t r = 0; r < M; ++r) {
    const float* p = parts.data() + r * digits * n;
    float* out = y + r * n;
    for (int64_t c = 0; c < n; ++c) out[c] = p[c];
    for (int64_t k = 1; k < digits; ++k)
      for (int64_t c = 0; c < n; ++c) out[c] += p[k * n + c];
  }
}

void check_input(const at::Tensor& x, const char* what) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), what, ": x must be a contiguous matrix");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, what, ": x must be fp32 or bf16");
  TORCH_CHECK(x.size(1) % GROUP == 0, what, ": the input width must be a multiple of 32");
}

at::Tensor dot8_linear(const at::Tensor& x, const at::Tensor& q, const at::Tensor& d, const at::Tensor& m,
                       int64_t n, int64_t bits, int64_t force_scalar, int64_t digits) {
  check_input(x, "dot8_linear");
  const int64_t M = x.size(0), K = x.size(1);
  const Weights w = checked_weights(q, d, m, K, n, bits, "dot8_linear");
  at::Tensor out = at::empty({M, n}, x.options().dtype(at::kFloat));
  if (M == 0) return out;
  const Quantized qx = quantize(x, force_scalar, digits);
  product_digits(w, qx.acts(), M, digits, n, out.data_ptr<float>(), force_scalar);
  return out;
}

// y = W x + B (A x): a projection and its low-rank adapter (LoRA) in one call, the same bits as
// dot8_linear(x, W) + dot8_linear(dot8_linear(x, A), B): x is quantized once for W and A, the
// rank-wide A x (fp32) is quantized for B, and the two products are added in fp32 last. A and B
// hold 8-bit weights. One call instead of two, and one quantization of x instead of two, per
// adapted projection: a twin forward makes 120 of them.
at::Tensor dot8_lora(const at::Tensor& x, const at::Tensor& q, const at::Tensor& d, const at::Tensor& m, int64_t n,
                     int64_t bits, const at::Tensor& qa, const at::Tensor& da, const at::Tensor& ma, int64_t rank,
                     const at::Tensor& qb, const at::Tensor& db, const at::Tensor& mb, int64_t force_scalar,
                     int64_t digits) {
  check_input(x, "dot8_lora");
  TORCH_CHECK(rank % GROUP == 0, "dot8_lora: the rank must be a multiple of 32");
  const int64_t M = x.size(0), K = x.size(1);
  const Weights w = checked_weights(q, d, m, K, n, bits, "dot8_lora");
  const Weights wa = checked_weights(qa, da, ma, K, rank, 8, "dot8_lora (A)");
  const Weights wb = checked_weights(qb, db, mb, rank, n, 8, "dot8_lora (B)");
  at::Tensor out = at::empty({M, n}, x.options().dtype(at::kFloat));
  if (M == 0) return out;
  const Quantized qx = quantize(x, force_scalar, digits);
  float* y = out.data_ptr<float>();
  product_digits(w, qx.acts(), M, digits, n, y, force_scalar);
  std::vector<float> ax(M * rank), up(M * n);
  product_digits(wa, qx.acts(), M, digits, rank, ax.data(), force_scalar);
  const Quantized qa_x(ax.data(), M, rank, !force_scalar, digits);
  product_digits(wb, qa_x.acts(), M, digits, n, up.data(), force_scalar);
  for (int64_t i = 0; i < M * n; ++i) y[i] += up[i];
  return out;
}

std::string dot8_path() { return path(0).name; }

}  // namespace

TORCH_LIBRARY(dualserve, lib) {
  lib.def("dot8_linear(Tensor x, Tensor q, Tensor d, Tensor m, int n, int bits, int force_scalar=0, int digits=1) "
          "-> Tensor");
  lib.def("dot8_lora(Tensor x, Tensor q, Tensor d, Tensor m, int n, int bits, Tensor qa, Tensor da, Tensor ma, "
          "int rank, Tensor qb, Tensor db, Tensor mb, int force_scalar=0, int digits=1) -> Tensor");
  lib.def("dot8_path() -> str", &dot8_path);
}

TORCH_LIBRARY_IMPL(dualserve, CPU, lib) {
  lib.impl("dot8_linear", dot8_linear);
  lib.impl("dot8_lora", dot8_lora);
}
