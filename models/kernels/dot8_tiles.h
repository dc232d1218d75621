// dot8's tile functions: one tile of 16 output channels times up to 8 (6 on AVX2) quantized
// rows, on the scalar, AVX-512 VNNI and AVX2 paths (dot8.cpp's header has the layout). Each is a
// template over the weight's kind: BITS (4, 5, 6 or 8), MIN (w = d q + m) and
// MULT (integer multipliers: 0 none, 1 one per group, 2 one per half group; the minimum's with
// MIN). This header holds the shared pieces, the scalar reference and the int4 / int8 vector
// loops; dot8_tiles56.h the 5- and 6-bit loops and the table of kinds. Every path makes the same
// integers and the same float operations in the same order.
// Included by dot8.h, inside namespace dualserve_dot8.
#pragma once

constexpr int TILE = 16;
constexpr int GROUP = 32;
constexpr int MAX_ROWS = 8;  // rows per register block
constexpr int PREFETCH = 4096;  // bytes ahead in the weight stream

// The stored value is u = q + OFFSET(BITS, MIN), unsigned: int8 holds q + 128; 4 bits hold a
// minimum kind's 0..15 as it is and Q4_0's q in -8..7 (w = d q, no minimum) as q + 8; 5 bits hold
// Q5_0's q in -16..15 as q + 16 and a minimum kind's 0..31 as it is; 6 bits hold -32..31 as
// q + 32 (Q6_K, and a fused layer's Q4_K beside Q6_K parts, which has a minimum).
constexpr int offset_of(int bits, bool minimum) {
  return bits == 8 ? 128 : bits == 6 ? 32 : (bits == 5 || bits == 4) && !minimum ? (1 << bits) / 2 : 0;
}

struct Acts {
  const int8_t* a;        // (M, K)
  const float* sx;        // (M, G)
  const int32_t* sum;     // (M, G)
  const float* fsum;      // (M, G): float(sum), exact (fused: the second digit's row holds the pair's); read by
                          // broadcast loads, not converted per tile
  const int32_t* sum128;  // (M, G): 128 * sum (int8 weights are stored as q + 128)
  int64_t K, G;
  const int32_t* half128; // (M, G, 2): 128 * the sums of inputs 0..15 and 16..31 (int8 with multipliers)
  const int32_t* half;    // (M, G, 2): those sums (5 / 6 bits with an offset and multipliers per half)
  bool fused;             // two digits a row: quantized rows 2i, 2i + 1 are output row i's (fuse)
  const int8_t* a64;      // fused, or null: (M / 2, G, 64), a token's group as [a0 | a1] (AMX's folded int4 path)
  const int8_t* blk;      // fused on AVX-512's vector path, or null: (M / 2, G, 64) in blocks of MAX_ROWS tokens,
                          // each block group-major, [g][token][a0 | a1] (tile_avx512_folded)
};

struct Weights {
  const uint8_t* q;
  const uint16_t* d;  // fp16 bits, per group or (dshift 3) per super-block of 8 groups
  const uint16_t* m;  // the same layout as d; null without a minimum
  int64_t G;
  int bits;           // 4, 5, 6 or 8: a group of a tile is ``bits`` chunks of 64 bytes
  bool minimum;       // w = d q + m
  const int8_t* s;    // [tile][group][s_per][16]: the multipliers, or null
  const int8_t* mn;   // [tile][group][16]: the minimum's multiplier, or null
  int s_per;          // 2: inputs 0..15 and 16..31 apart, 1: one per group
  int dshift;         // 0: d, m per group; 3: per 8 groups
  const uint8_t* tile(int64_t t) const { return q + t * G * bits * 64; }
  const uint16_t* dg(int64_t t, int64_t g) const { return d + (t * (G >> dshift) + (g >> dshift)) * TILE; }
  const uint16_t* mg(int64_t t, int64_t g) const { return m + (t * (G >> dshift) + (g >> dshift)) * TILE; }
  const int8_t* sg(int64_t t, int64_t g) const { return s + (t * G + g) * s_per * TILE; }
  const int8_t* mng(int64_t t, int64_t g) const { return mn + (t * G + g) * TILE; }
};

inline float half_to_float(uint16_t h) { return static_cast<float>(c10::Half(h, c10::Half::from_bits())); }

inline int32_t load4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// The stored value u of input k (0..31) of lane c in a group's chunks qg (dot8.cpp's header): int8
// byte k % 4 of chunk k / 4; else nibble n = (k / 4) % 2 of byte k % 4 of chunk k / 8, and for 5 / 6
// bits the HB = BITS - 4 high bits of nibble vector i = k / 4 at bits HB (i % P) of plane i / P
// (chunk 4 + i / P), P = 8 / HB of them to a byte.
template <int BITS>
inline int32_t stored_value(const uint8_t* qg, int c, int k) {
  const int b = k % 4;
  if constexpr (BITS == 8) {
    return qg[(k / 4) * 64 + c * 4 + b];
  } else {
    const int i = k / 4;
    int32_t u = (qg[(i / 2) * 64 + c * 4 + b] >> (4 * (i % 2))) & 0x0F;
    if constexpr (BITS > 4) {
      constexpr int HB = BITS - 4, P = 8 / HB;
      u |= ((qg[(4 + i / P) * 64 + c * 4 + b] >> (HB * (i % P))) & ((1 << HB) - 1)) << 4;
    }
    return u;
  }
}

// Two digits' integers as one: the first digit counts 16 of the second (dot8_acts.h).
inline int32_t fuse(int32_t first, int32_t second) { return 16 * first + second; }

// A group's inputs 0..15 come before 16..31 (chunks j < 2 for int4 / 5 / 6 bits, j < 4 for int8),
// so each half's integer sum is ready halfway. The group's value is
//   v = d * float(s_lo dot_lo + s_hi dot_hi) + m * (mn * float(asum))
// (s = 1 without multipliers, s_lo = s_hi with one a group; mn = 1 without). The multiplied sum
// is an int32 on every path (at most 2 * 128 * 16 * 128 * 2040 < 2^31: a fused activation is at
// most 16 * 127 + 8), so its one rounding to float is the same everywhere, and the same for a
// weight whose multipliers are stored per group or per half; mn * asum is exact (< 2^24).

// ---- the reference path: plain C, the same integers and the same float order ----

template <int BITS, bool MIN, int MULT>
struct Scalar {
  // Quantized row r's integer dots of group g with lane c (inputs 0..15, 16..31), sum q a exactly.
  static void dots(const uint8_t* qg, const int8_t* a, int c, int32_t dot[2]) {
    constexpr int OFF = offset_of(BITS, MIN);
    dot[0] = dot[1] = 0;
    for (int k = 0; k < GROUP; ++k) dot[k >= GROUP / 2] += (stored_value<BITS>(qg, c, k) - OFF) * a[k];
  }

  static void tile(const Weights& w, int64_t t, const Acts& x, int64_t r0, int rows, float* out, int64_t ldo,
                   int valid) {
    const uint8_t* q = w.tile(t);
    const int step = x.fused ? 2 : 1;  // quantized rows per output row
    for (int r = 0; r < rows; r += step) {
      const int8_t* a = x.a + (r0 + r) * x.K;
      for (int c = 0; c < valid; ++c) {
        float y = 0.f;
        for (int64_t g = 0; g < w.G; ++g) {
          const uint8_t* qg = q + g * BITS * 64;
          int32_t dot[2];
          dots(qg, a + g * GROUP, c, dot);
          int64_t rg = (r0 + r) * x.G + g;
          if (x.fused) {  // the two digits as one integer: 16 a0 + a1
            int32_t dot1[2];
            dots(qg, a + x.K + g * GROUP, c, dot1);
            dot[0] = fuse(dot[0], dot1[0]);
            dot[1] = fuse(dot[1], dot1[1]);
            rg += x.G;  // the second digit's scale and fsum are the fused integer's
          }
          // s_lo dot_lo + s_hi dot_hi in int32 (at most 2 * 128 * 16 * 128 * 2040 < 2^31), one rounding
          int32_t total = dot[0] + dot[1];
          if (MULT == 2) total = w.sg(t, g)[c] * dot[0] + w.sg(t, g)[TILE + c] * dot[1];
          if (MULT == 1) total = w.sg(t, g)[c] * total;
          float v = half_to_float(w.dg(t, g)[c]) * float(total);
          if (MIN) v = std::fma(half_to_float(w.mg(t, g)[c]), MULT ? float(w.mng(t, g)[c]) * x.fsum[rg] : x.fsum[rg], v);
          y = std::fma(x.sx[rg], v, y);
        }
        out[(r / step) * ldo + c] = y;
      }
    }
  }
};

#ifdef DOT8_X86

// ---- the vector paths' epilogue, per group: the same float operations as the scalar path ----

__attribute__((target("avx512f"), always_inline)) inline __m512i fuse512(__m512i first, __m512i second) {
  return _mm512_add_epi32(_mm512_slli_epi32(first, 4), second);
}

__attribute__((target("avx2"), always_inline)) inline __m256i fuse256(__m256i first, __m256i second) {
  return _mm256_add_epi32(_mm256_slli_epi32(first, 4), second);
}

// A group's d, m (floats) and multipliers (int32: s is s_hi with two a group, s_lo the first
// half's) for 16 channels (AVX-512) or the 8 at ``lane`` (AVX2); mn as a float.
struct Scales512 {
  __m512 d, m, mn;
  __m512i s, s_lo;
};

struct Scales256 {
  __m256 d, m, mn;
  __m256i s, s_lo;
};

template <bool MIN, int MULT>
__attribute__((target("avx512f,avx512bw,f16c,fma")))
inline Scales512 scales512(const Weights& w, int64_t t, int64_t g) {
  Scales512 p;
  p.d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.dg(t, g))));
  p.m = p.mn = _mm512_setzero_ps();
  p.s = p.s_lo = _mm512_setzero_si512();
  if constexpr (MIN) p.m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.mg(t, g))));
  if constexpr (MULT) {
    p.s = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w.sg(t, g) + (MULT == 2 ? TILE : 0))));
    if constexpr (MULT == 2) p.s_lo = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w.sg(t, g))));
    if constexpr (MIN)
      p.mn = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w.mng(t, g)))));
  }
  return p;
}

// v = d * float(s_lo dot_lo + s_hi dot_hi) + m * (mn * float(asum)), the integers in int32 as on
// the scalar path; dlo is read with multipliers per half only (dot is then dot_hi).
template <bool MIN, int MULT>
__attribute__((target("avx512f,avx512bw,f16c,fma")))
inline __m512 value512(const Scales512& p, __m512i dot, __m512i dlo, float fsum) {
  __m512i total = dot;
  if constexpr (MULT == 2) total = _mm512_add_epi32(_mm512_mullo_epi32(p.s_lo, dlo), _mm512_mullo_epi32(p.s, dot));
  if constexpr (MULT == 1) total = _mm512_mullo_epi32(p.s, dot);
  __m512 v = _mm512_mul_ps(p.d, _mm512_cvtepi32_ps(total));
  if constexpr (MIN) {
    const __m512 asum = MULT ? _mm512_mul_ps(p.mn, _mm512_set1_ps(fsum)) : _mm512_set1_ps(fsum);
    v = _mm512_fmadd_ps(p.m, asum, v);
  }
  return v;
}

// The epilogue of group g for R quantized rows r0.. whose exact integer dots are dot (and, with
// multipliers per half, dlo for inputs 0..15): y[r] += sx * v. Fused rows (two digits) go in
// pairs into y[r] of the pair's first row, as one integer 16 a0 + a1 (dot8_acts.h), whose scale
// and sum are the second row's. FOLDED: dot and dlo are R tokens' fused integers already.
template <int R, bool MIN, int MULT, bool FOLDED = false>
__attribute__((target("avx512f,avx512bw,f16c,fma"), always_inline))
inline void epilogue512(__m512* y, const __m512i* dot, const __m512i* dlo, const Weights& w, int64_t t, int64_t g,
                        const Acts& x, int64_t r0) {
  const Scales512 p = scales512<MIN, MULT>(w, t, g);
  const __m512i none = _mm512_setzero_si512();
  if (!FOLDED && x.fused) {
#pragma GCC unroll 16
    for (int r = 0; r + 1 < R; r += 2) {
      const int64_t rg = (r0 + r + 1) * x.G + g;
      const __m512i lo = MULT == 2 ? fuse512(dlo[r], dlo[r + 1]) : none;
      y[r] = _mm512_fmadd_ps(_mm512_set1_ps(x.sx[rg]),
                             value512<MIN, MULT>(p, fuse512(dot[r], dot[r + 1]), lo, x.fsum[rg]), y[r]);
    }
  } else {
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const int64_t rg = (r0 + (FOLDED ? 2 * r + 1 : r)) * x.G + g;  // folded: token r's second digit row
      y[r] = _mm512_fmadd_ps(_mm512_set1_ps(x.sx[rg]),
                             value512<MIN, MULT>(p, dot[r], MULT == 2 ? dlo[r] : none, x.fsum[rg]), y[r]);
    }
  }
}

// y's R rows (fused: every other one) of 16 channels, of which ``valid`` exist, to out.
template <int R>
__attribute__((target("avx512f"), always_inline))
inline void store512(const __m512* y, const Acts& x, float* out, int64_t ldo, int valid) {
  const __mmask16 mask = valid >= TILE ? __mmask16(0xFFFF) : __mmask16((1u << valid) - 1);
  const int step = x.fused ? 2 : 1;
  for (int r = 0; r < R; r += step) _mm512_mask_storeu_ps(out + (r / step) * ldo, mask, y[r]);
}

// 8 int8 multipliers as int32.
__attribute__((target("avx2,fma,f16c"))) inline __m256i multipliers(const int8_t* p) {
  return _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}

template <bool MIN, int MULT>
__attribute__((target("avx2,fma,f16c")))
inline Scales256 scales256(const Weights& w, int64_t t, int64_t g, int lane) {
  Scales256 p;
  p.d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w.dg(t, g) + lane)));
  p.m = p.mn = _mm256_setzero_ps();
  p.s = p.s_lo = _mm256_setzero_si256();
  if constexpr (MIN) p.m = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w.mg(t, g) + lane)));
  if constexpr (MULT) {
    p.s = multipliers(w.sg(t, g) + (MULT == 2 ? TILE : 0) + lane);
    if constexpr (MULT == 2) p.s_lo = multipliers(w.sg(t, g) + lane);
    if constexpr (MIN) p.mn = _mm256_cvtepi32_ps(multipliers(w.mng(t, g) + lane));
  }
  return p;
}

template <bool MIN, int MULT>
__attribute__((target("avx2,fma,f16c")))
inline __m256 value256(const Scales256& p, __m256i dot, __m256i dlo, float fsum) {
  __m256i total = dot;
  if constexpr (MULT == 2) total = _mm256_add_epi32(_mm256_mullo_epi32(p.s_lo, dlo), _mm256_mullo_epi32(p.s, dot));
  if constexpr (MULT == 1) total = _mm256_mullo_epi32(p.s, dot);
  __m256 v = _mm256_mul_ps(p.d, _mm256_cvtepi32_ps(total));
  if constexpr (MIN) {
    const __m256 asum = MULT ? _mm256_mul_ps(p.mn, _mm256_set1_ps(fsum)) : _mm256_set1_ps(fsum);
    v = _mm256_fmadd_ps(p.m, asum, v);
  }
  return v;
}

// y's R rows (fused: every other one) of 8 channels, of which n exist (n may be 0 or less), to out + at.
template <int R>
__attribute__((target("avx2,fma,f16c")))
inline void store256(const __m256* y, const Acts& x, float* out, int64_t ldo, int n, int at) {
  const int step = x.fused ? 2 : 1;
  for (int r = 0; r < R; r += step) {
    float* o = out + (r / step) * ldo + at;
    if (n >= 8) {
      _mm256_storeu_ps(o, y[r]);
    } else if (n > 0) {
      alignas(32) float buf[8];
      _mm256_store_ps(buf, y[r]);
      std::memcpy(o, buf, sizeof(float) * n);
    }
  }
}

// epilogue512 on the 8 channels at ``lane``.
template <int R, bool MIN, int MULT>
__attribute__((target("avx2,fma,f16c"), always_inline))
inline void epilogue256(__m256* y, const __m256i* dot, const __m256i* dlo, const Weights& w, int64_t t, int64_t g,
                        int lane, const Acts& x, int64_t r0) {
  const Scales256 p = scales256<MIN, MULT>(w, t, g, lane);
  const __m256i none = _mm256_setzero_si256();
  if (x.fused) {
    for (int r = 0; r + 1 < R; r += 2) {
      const int64_t rg = (r0 + r + 1) * x.G + g;
      const __m256i lo = MULT == 2 ? fuse256(dlo[r], dlo[r + 1]) : none;
      y[r] = _mm256_fmadd_ps(_mm256_set1_ps(x.sx[rg]),
                             value256<MIN, MULT>(p, fuse256(dot[r], dot[r + 1]), lo, x.fsum[rg]), y[r]);
    }
  } else {
    for (int r = 0; r < R; ++r) {
      const int64_t rg = (r0 + r) * x.G + g;
      y[r] = _mm256_fmadd_ps(_mm256_set1_ps(x.sx[rg]),
                             value256<MIN, MULT>(p, dot[r], MULT == 2 ? dlo[r] : none, x.fsum[rg]), y[r]);
    }
  }
}
#endif  // DOT8_X86

#ifdef DOT8_X86

// dot = sum u a - OFF * (the activations' sum over the same inputs, sums[i]): sum q a, exactly.
template <int OFF>
__attribute__((target("avx512f"), always_inline)) inline __m512i minus_offset(__m512i acc, const int32_t* sums, int64_t i) {
  if constexpr (OFF == 0) return acc;
  else return _mm512_sub_epi32(acc, _mm512_set1_epi32(OFF * sums[i]));
}

template <int OFF>
__attribute__((target("avx2"), always_inline)) inline __m256i minus_offset(__m256i acc, const int32_t* sums, int64_t i) {
  if constexpr (OFF == 0) return acc;
  else return _mm256_sub_epi32(acc, _mm256_set1_epi32(OFF * sums[i]));
}

// The same for a token's two digits as one integer (dot8_acts.h): its quantized rows' sums at
// sums[first] and sums[second], fused as the dots are.
template <int OFF>
__attribute__((target("avx512f"), always_inline)) inline __m512i minus_fused_offset(__m512i acc, const int32_t* sums,
                                                                                    int64_t first, int64_t second) {
  if constexpr (OFF == 0) return acc;
  else return _mm512_sub_epi32(acc, _mm512_set1_epi32(OFF * fuse(sums[first], sums[second])));
}

// ---- AVX-512 VNNI, int4 and int8: 16 channels per register ----

template <int R, int BITS, bool MIN, int MULT>
__attribute__((target("avx512f,avx512bw,avx512vnni,f16c,fma")))
void tile_avx512_rows(const Weights& w, int64_t t, const Acts& x, int64_t r0, float* out, int64_t ldo, int valid) {
  constexpr int CH = BITS;
  const uint8_t* q = w.tile(t);
  const __m512i low = _mm512_set1_epi8(0x0F);
  __m512 y[R];
  for (int r = 0; r < R; ++r) y[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < w.G; ++g) {
    __m512i acc[R];
    __m512i dlo[MULT == 2 ? R : 1];  // inputs 0..15's dots, with multipliers per half
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_si512();
    const uint8_t* qg = q + g * CH * 64;
    const int64_t k0 = g * GROUP;
    // The hardware prefetcher falls behind the weight stream (without the hint, 3 rows cost more
    // than 4); from memory one row too gains 5-8% (int4, int8) and 12-18% (5 and 6 bits, which do
    // more work per byte) on a 2-core AVX-512 host.
    for (int j = 0; j < CH; ++j) _mm_prefetch(reinterpret_cast<const char*>(qg + PREFETCH + j * 64), _MM_HINT_T0);
    for (int j = 0; j < CH; ++j) {
      if constexpr (MULT == 2) {
        if (j == CH / 2) {
          for (int r = 0; r < R; ++r) {
            dlo[r] = acc[r];
            if (BITS == 8) dlo[r] = _mm512_sub_epi32(dlo[r], _mm512_set1_epi32(x.half128[((r0 + r) * x.G + g) * 2]));
            acc[r] = _mm512_setzero_si512();
          }
        }
      }
      const __m512i v = _mm512_loadu_si512(qg + j * 64);
      if (BITS == 4) {
        const __m512i lo4 = _mm512_and_si512(v, low);
        const __m512i hi4 = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
        for (int r = 0; r < R; ++r) {
          const int8_t* a = x.a + (r0 + r) * x.K + k0 + 8 * j;
          acc[r] = _mm512_dpbusd_epi32(acc[r], lo4, _mm512_set1_epi32(load4(a)));
          acc[r] = _mm512_dpbusd_epi32(acc[r], hi4, _mm512_set1_epi32(load4(a + 4)));
        }
      } else {
        for (int r = 0; r < R; ++r) {
          const int8_t* a = x.a + (r0 + r) * x.K + k0 + 4 * j;
          acc[r] = _mm512_dpbusd_epi32(acc[r], v, _mm512_set1_epi32(load4(a)));
        }
      }
    }
    if constexpr (BITS == 8)
      for (int r = 0; r < R; ++r) {
        const int64_t rg = (r0 + r) * x.G + g;
        acc[r] = _mm512_sub_epi32(acc[r], _mm512_set1_epi32(MULT == 2 ? x.half128[rg * 2 + 1] : x.sum128[rg]));
      }
    if constexpr (BITS == 4 && offset_of(BITS, MIN) != 0)  // Q4_0: u = q + 8
      for (int r = 0; r < R; ++r) {
        constexpr int OFF = offset_of(BITS, MIN);
        const int64_t rg = (r0 + r) * x.G + g;
        if constexpr (MULT == 2) dlo[r] = minus_offset<OFF>(dlo[r], x.half, rg * 2);
        acc[r] = MULT == 2 ? minus_offset<OFF>(acc[r], x.half, rg * 2 + 1) : minus_offset<OFF>(acc[r], x.sum, rg);
      }
    epilogue512<R, MIN, MULT>(y, acc, dlo, w, t, g, x, r0);
  }
  store512<R>(y, x, out, ldo, valid);
}

// The sum of P partial integer dots (exact, so any order gives the same integer).
template <int P>
__attribute__((target("avx512f"), always_inline)) inline __m512i sum_parts(const __m512i* p) {
  if constexpr (P == 1) return p[0];
  else if constexpr (P == 2) return _mm512_add_epi32(p[0], p[1]);
  else return _mm512_add_epi32(_mm512_add_epi32(p[0], p[1]), _mm512_add_epi32(p[2], p[3]));
}

// Two digits times int4, folded (AVX-512): each of R tokens keeps ONE integer, into which its
// first digit multiplies the nibbles shifted up, 16 u (at most 240, still an unsigned byte), and
// its second digit u: the fused integer 16 a0 + a1 (dot8_acts.h) with no fuse step, and the int4
// unpacking serves 8 tokens (16 quantized rows) at once. With one or two tokens that integer is
// summed in 4 or 2 partial accumulators (sum_parts).
template <int R, bool MIN, int MULT>
__attribute__((target("avx512f,avx512bw,avx512vnni,f16c,fma")))
void tile_avx512_folded(const Weights& w, int64_t t, const Acts& x, int64_t r0, float* out, int64_t ldo, int valid) {
  const uint8_t* q = w.tile(t);
  const __m512i low = _mm512_set1_epi8(0x0F), high = _mm512_set1_epi8(char(0xF0));
  // The block's R tokens' digits of a group lie side by side (Acts::blk): one pointer a group, the
  // tokens at fixed offsets. Rows K apart took one register each and, K a multiple of 4 KB, the
  // same L1 set each (at 8 tokens, 16 streams in an 8-way set).
  const int8_t* blk = x.blk + (r0 / 2) * x.G * 64;
  __m512 y[R];
  for (int r = 0; r < R; ++r) y[r] = _mm512_setzero_ps();
  // A token's 16 vpdpbusd a group are one chain of dependent adds; with one or two tokens the
  // chain's latency, not the unit's rate, sets the pace, so each token's sum is split into P
  // partial sums that run side by side and add up at the group's end: the same integer.
  constexpr int P = R == 1 ? 4 : R == 2 ? 2 : 1;
  for (int64_t g = 0; g < w.G; ++g) {
    __m512i acc[R];
    __m512i part[R][P];
    __m512i dlo[MULT == 2 ? R : 1];
    for (int r = 0; r < R; ++r)
      for (int i = 0; i < P; ++i) part[r][i] = _mm512_setzero_si512();
    const uint8_t* qg = q + g * 4 * 64;
    const int8_t* ag = blk + g * R * 64;
    for (int j = 0; j < 4; ++j) _mm_prefetch(reinterpret_cast<const char*>(qg + PREFETCH + j * 64), _MM_HINT_T0);
    for (int j = 0; j < 4; ++j) {
      if constexpr (MULT == 2) {
        if (j == 2)
          for (int r = 0; r < R; ++r) {
            dlo[r] = sum_parts<P>(part[r]);
            for (int i = 0; i < P; ++i) part[r][i] = _mm512_setzero_si512();
          }
      }
      const __m512i v = _mm512_loadu_si512(qg + j * 64);
      const __m512i lo4 = _mm512_and_si512(v, low), hi4 = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
      const __m512i lo16 = _mm512_and_si512(_mm512_slli_epi16(v, 4), high), hi16 = _mm512_and_si512(v, high);
      for (int r = 0; r < R; ++r) {
        const int8_t* a0 = ag + r * 64 + 8 * j;
        const int8_t* a1 = a0 + GROUP;
        __m512i* p = part[r];
        p[0] = _mm512_dpbusd_epi32(p[0], lo16, _mm512_set1_epi32(load4(a0)));
        p[1 % P] = _mm512_dpbusd_epi32(p[1 % P], hi16, _mm512_set1_epi32(load4(a0 + 4)));
        p[2 % P] = _mm512_dpbusd_epi32(p[2 % P], lo4, _mm512_set1_epi32(load4(a1)));
        p[3 % P] = _mm512_dpbusd_epi32(p[3 % P], hi4, _mm512_set1_epi32(load4(a1 + 4)));
      }
    }
    for (int r = 0; r < R; ++r) acc[r] = sum_parts<P>(part[r]);
    if constexpr (offset_of(4, MIN) != 0)  // Q4_0: u = q + 8; token r's digits are quantized rows rg, rg + G
      for (int r = 0; r < R; ++r) {
        constexpr int OFF = offset_of(4, MIN);
        const int64_t rg = (r0 + 2 * r) * x.G + g;
        if constexpr (MULT == 2) dlo[r] = minus_fused_offset<OFF>(dlo[r], x.half, rg * 2, (rg + x.G) * 2);
        acc[r] = MULT == 2 ? minus_fused_offset<OFF>(acc[r], x.half, rg * 2 + 1, (rg + x.G) * 2 + 1)
                           : minus_fused_offset<OFF>(acc[r], x.sum, rg, rg + x.G);
      }
    epilogue512<R, MIN, MULT, true>(y, acc, dlo, w, t, g, x, r0);
  }
  const __mmask16 mask = valid >= TILE ? __mmask16(0xFFFF) : __mmask16((1u << valid) - 1);
  for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(out + r * ldo, mask, y[r]);
}

// ---- AVX2: each tile as two halves of 8 channels ----

// int4: one group of a half tile is unpacked once into its 8 nibble vectors (4 values of one
// channel a lane), which stay in registers while every row of the block takes its dots from them:
// 8 maddubs a row and digit, whose pairs add up in int16 (|u * a| <= 15 * 127, so a pair is at
// most 3810 and the group's sum at most 30480) and widen once. The rows' float sums wait between
// groups in a buffer in L1 rather than in registers: a block of 6 rows held in registers spilled
// every product to the stack (16 vector registers), and ran at a third of maddubs' rate.
constexpr int AVX2_INT4_ROWS = 16;  // quantized rows per block (8 tokens of two digits)

// Exact integer dots of one quantized row's group with the 8 channels of the unpacked nibbles:
// all 32 inputs into dot, or with multipliers per half (MULT 2) inputs 0..15 into lo and 16..31
// into dot. Nibble vector 2j holds inputs 8j..8j+3, 2j + 1 inputs 8j+4..8j+7.
template <int MULT>
__attribute__((target("avx2,fma,f16c"), always_inline))
inline void group_dots_avx2(const __m256i* nib, const int8_t* a, __m256i& dot, __m256i& lo) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i p[8];
  for (int i = 0; i < 8; ++i) p[i] = _mm256_maddubs_epi16(nib[i], _mm256_set1_epi32(load4(a + 4 * i)));
  const __m256i first = _mm256_add_epi16(_mm256_add_epi16(p[0], p[1]), _mm256_add_epi16(p[2], p[3]));
  const __m256i second = _mm256_add_epi16(_mm256_add_epi16(p[4], p[5]), _mm256_add_epi16(p[6], p[7]));
  if constexpr (MULT == 2) {
    lo = _mm256_madd_epi16(first, ones);
    dot = _mm256_madd_epi16(second, ones);
  } else {
    dot = _mm256_madd_epi16(_mm256_add_epi16(first, second), ones);
  }
}

// group_dots_avx2 of quantized row r's group g, less the offset's share (Q4_0: u = q + 8): sum q a.
template <bool MIN, int MULT>
__attribute__((target("avx2,fma,f16c"), always_inline))
inline void row_dots_avx2(const __m256i* nib, const Acts& x, int64_t r, int64_t g, __m256i& dot, __m256i& lo) {
  constexpr int OFF = offset_of(4, MIN);
  group_dots_avx2<MULT>(nib, x.a + r * x.K + g * GROUP, dot, lo);
  if constexpr (OFF != 0) {
    const int64_t rg = r * x.G + g;
    if constexpr (MULT == 2) lo = minus_offset<OFF>(lo, x.half, rg * 2);
    dot = MULT == 2 ? minus_offset<OFF>(dot, x.half, rg * 2 + 1) : minus_offset<OFF>(dot, x.sum, rg);
  }
}

template <bool MIN, int MULT, bool FUSED>
__attribute__((target("avx2,fma,f16c")))
void tile_avx2_int4(const Weights& w, int64_t t, const Acts& x, int64_t r0, int rows, float* out, int64_t ldo,
                    int valid) {
  constexpr int STEP = FUSED ? 2 : 1;  // quantized rows per output row
  const uint8_t* q = w.tile(t);
  const __m256i low = _mm256_set1_epi8(0x0F);
  const int outs = rows / STEP;
  alignas(32) float ybuf[AVX2_INT4_ROWS][8];
  for (int half = 0; half < 2; ++half) {
    for (int o = 0; o < outs; ++o) _mm256_store_ps(ybuf[o], _mm256_setzero_ps());
    for (int64_t g = 0; g < w.G; ++g) {
      const uint8_t* qg = q + g * 4 * 64 + half * 32;
      if (rows >= 2 && half == 0)  // as in tile_avx512_rows (measured with 2 rows or more on AVX2)
        for (int j = 0; j < 4; ++j) _mm_prefetch(reinterpret_cast<const char*>(qg + PREFETCH + j * 64), _MM_HINT_T0);
      __m256i nib[8];
      for (int j = 0; j < 4; ++j) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qg + j * 64));
        nib[2 * j] = _mm256_and_si256(v, low);
        nib[2 * j + 1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
      }
      const Scales256 p = scales256<MIN, MULT>(w, t, g, half * 8);
      for (int o = 0; o < outs; ++o) {
        const int64_t r = r0 + o * STEP;
        __m256i dot, lo = _mm256_setzero_si256();
        row_dots_avx2<MIN, MULT>(nib, x, r, g, dot, lo);
        if constexpr (FUSED) {  // the second digit's dots, then the two as one integer
          __m256i dot1, lo1 = _mm256_setzero_si256();
          row_dots_avx2<MIN, MULT>(nib, x, r + 1, g, dot1, lo1);
          dot = fuse256(dot, dot1);
          if constexpr (MULT == 2) lo = fuse256(lo, lo1);
        }
        // The scale and sum of the output row's last quantized row (with two digits, the fused integer's).
        const int64_t rg = (r + STEP - 1) * x.G + g;
        const __m256 y = _mm256_load_ps(ybuf[o]);
        _mm256_store_ps(ybuf[o], _mm256_fmadd_ps(_mm256_set1_ps(x.sx[rg]), value256<MIN, MULT>(p, dot, lo, x.fsum[rg]), y));
      }
    }
    const int n = valid - half * 8;
    for (int o = 0; o < outs && n > 0; ++o) std::memcpy(out + o * ldo + half * 8, ybuf[o], sizeof(float) * std::min(n, 8));
  }
}

// int8: rows per register block: 6 rows' int32 and float accumulators take 12 of the 16 registers.
constexpr int AVX2_ROWS = 6;

template <int R, bool MIN, int MULT>
__attribute__((target("avx2,fma,f16c")))
void tile_avx2_rows(const Weights& w, int64_t t, const Acts& x, int64_t r0, float* out, int64_t ldo, int valid) {
  constexpr int CH = 8;
  const uint8_t* q = w.tile(t);
  for (int half = 0; half < 2; ++half) {
    __m256 y[R];
    for (int r = 0; r < R; ++r) y[r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < w.G; ++g) {
      __m256i acc[R];
      __m256i dlo[MULT == 2 ? R : 1];  // inputs 0..15's dots, with multipliers per half
      for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_si256();
      const uint8_t* qg = q + g * CH * 64 + half * 32;
      const int64_t k0 = g * GROUP;
      if (R >= 2 && half == 0)  // as in tile_avx512_rows (measured with 2 rows or more on AVX2)
        for (int j = 0; j < CH; ++j) _mm_prefetch(reinterpret_cast<const char*>(qg + PREFETCH + j * 64), _MM_HINT_T0);
      // A pair can reach 2 * 128 * 127, so each pair sum widens at once.
      for (int j = 0; j < CH; ++j) {
        if constexpr (MULT == 2) {
          if (j == CH / 2) {
            for (int r = 0; r < R; ++r) {
              dlo[r] = acc[r];
              acc[r] = _mm256_setzero_si256();
            }
          }
        }
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
      epilogue256<R, MIN, MULT>(y, acc, dlo, w, t, g, half * 8, x, r0);  // acc is already sum q a
    }
    store256<R>(y, x, out, ldo, valid - half * 8, half * 8);
  }
}


#endif  // DOT8_X86
