// dot8's tile functions: one tile of 16 output channels times up to 8 (6 on AVX2) quantized
// rows, on the scalar, AVX-512 VNNI and AVX2 paths (dot8.cpp's header has the layout). Each is a
// template over the weight's kind: BITS (4 or 8), MIN (w = d q + m; int4 always has one) and MULT
// (integer multipliers per half group and for the minimum). The plain kinds (Q4_0/Q4_1 as int4,
// Q8_0 as int8) instantiate with MULT false and compile to the loops they had before multipliers
// existed. Every path makes the same integers and the same float operations in the same order.
// Included inside dot8.cpp's anonymous namespace.
#pragma once

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
  const int32_t* half128; // (M, G, 2): 128 * the sums of inputs 0..15 and 16..31 (int8 with multipliers)
};

struct Weights {
  const uint8_t* q;
  const uint16_t* d;  // fp16 bits
  const uint16_t* m;
  int64_t G;
  int bits;
  bool minimum;       // int8 with w = d q + m (int4 always)
  const int8_t* s;    // [tile][group][2][16]: the multipliers of inputs 0..15 and 16..31, or null
  const int8_t* mn;   // [tile][group][16]: the minimum's multiplier, or null
  int chunks() const { return bits == 4 ? 4 : 8; }
  const uint8_t* tile(int64_t t) const { return q + t * G * chunks() * 64; }
  const uint16_t* dt(int64_t t) const { return d + t * G * TILE; }
  const uint16_t* mt(int64_t t) const { return m + t * G * TILE; }
  const int8_t* st(int64_t t) const { return s + t * G * 2 * TILE; }
  const int8_t* mnt(int64_t t) const { return mn + t * G * TILE; }
};

inline float half_to_float(uint16_t h) { return static_cast<float>(c10::Half(h, c10::Half::from_bits())); }

inline int32_t load4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// A group's chunks j < CH / 2 hold inputs 0..15 (int4: 8j..8j+7; int8: 4j..4j+3), the rest 16..31,
// so each half's integer sum is ready after its chunks. With multipliers the group's value is
//   v = d * float(s_lo dot_lo + s_hi dot_hi) + m * float(mn asum)
// where every product and the sum are integers below 2^24 (checked at packing: a group's
// max|q_lo s_lo| + max|q_hi s_hi| <= 8256, and 16 * 127 * 8256 < 2^24), so the vector paths' float
// multiply and fma of them are exact and equal the scalar path's int32 arithmetic.

// ---- the reference path: plain C, the same integers and the same float order ----

template <int BITS, bool MIN, bool MULT>
struct Scalar {
  static void tile(const Weights& w, int64_t t, const Acts& x, int64_t r0, int rows, float* out, int64_t ldo,
                   int valid) {
    constexpr int CH = BITS == 4 ? 4 : 8;
    const uint8_t* q = w.tile(t);
    for (int r = 0; r < rows; ++r) {
      const int8_t* a = x.a + (r0 + r) * x.K;
      for (int c = 0; c < valid; ++c) {
        float y = 0.f;
        for (int64_t g = 0; g < w.G; ++g) {
          const uint8_t* qg = q + g * CH * 64;
          int32_t dot[2] = {0, 0};  // inputs 0..15, 16..31
          for (int j = 0; j < CH; ++j) {
            const uint8_t* lane = qg + j * 64 + c * 4;
            int32_t& acc = dot[j >= CH / 2];
            for (int b = 0; b < 4; ++b) {
              if (BITS == 4) {
                acc += int32_t(lane[b] & 0x0F) * a[g * GROUP + 8 * j + b];
                acc += int32_t(lane[b] >> 4) * a[g * GROUP + 8 * j + 4 + b];
              } else {
                acc += (int32_t(lane[b]) - 128) * a[g * GROUP + 4 * j + b];
              }
            }
          }
          const int64_t rg = (r0 + r) * x.G + g;
          int32_t total = dot[0] + dot[1];
          if (MULT) total = w.st(t)[g * 2 * TILE + c] * dot[0] + w.st(t)[g * 2 * TILE + TILE + c] * dot[1];
          float v = half_to_float(w.dt(t)[g * TILE + c]) * float(total);
          if (MIN) {
            const int32_t asum = MULT ? w.mnt(t)[g * TILE + c] * x.sum[rg] : x.sum[rg];
            v = std::fma(half_to_float(w.mt(t)[g * TILE + c]), float(asum), v);
          }
          y = std::fma(x.sx[rg], v, y);
        }
        out[r * ldo + c] = y;
      }
    }
  }
};

#ifdef DOT8_X86

// ---- AVX-512 VNNI: 16 channels per register ----

template <int R, int BITS, bool MIN, bool MULT>
__attribute__((target("avx512f,avx512bw,avx512vnni,f16c,fma")))
void tile_avx512_rows(const Weights& w, int64_t t, const Acts& x, int64_t r0, float* out, int64_t ldo, int valid) {
  constexpr int CH = BITS == 4 ? 4 : 8;
  const uint8_t* q = w.tile(t);
  const __m512i low = _mm512_set1_epi8(0x0F);
  __m512 y[R];
  for (int r = 0; r < R; ++r) y[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < w.G; ++g) {
    __m512i acc[R];
    __m512 lo[MULT ? R : 1];  // s_lo * dot_lo, exact
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_si512();
    const uint8_t* qg = q + g * CH * 64;
    const int64_t k0 = g * GROUP;
    // Two rows or more make a group's work long enough that the hardware prefetcher falls behind
    // the weight stream (without the hint, 3 rows cost more than 4); one row streams best unaided.
    if (R >= 2)
      for (int j = 0; j < CH; ++j) _mm_prefetch(reinterpret_cast<const char*>(qg + PREFETCH + j * 64), _MM_HINT_T0);
    for (int j = 0; j < CH; ++j) {
      if constexpr (MULT) {
        if (j == CH / 2) {
          const __m512 s = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
              _mm_loadu_si128(reinterpret_cast<const __m128i*>(w.st(t) + g * 2 * TILE))));
          for (int r = 0; r < R; ++r) {
            __m512i dot = acc[r];
            if (BITS == 8) dot = _mm512_sub_epi32(dot, _mm512_set1_epi32(x.half128[((r0 + r) * x.G + g) * 2]));
            lo[r] = _mm512_mul_ps(s, _mm512_cvtepi32_ps(dot));
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
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.dt(t) + g * TILE)));
    const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.mt(t) + g * TILE)));
    __m512 s_hi = _mm512_setzero_ps(), mn = _mm512_setzero_ps();
    if constexpr (MULT) {
      s_hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(w.st(t) + g * 2 * TILE + TILE))));
      if constexpr (MIN)
        mn = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(w.mnt(t) + g * TILE))));
    }
    for (int r = 0; r < R; ++r) {
      const int64_t rg = (r0 + r) * x.G + g;
      __m512i dot = acc[r];
      if (BITS == 8) dot = _mm512_sub_epi32(dot, _mm512_set1_epi32(MULT ? x.half128[rg * 2 + 1] : x.sum128[rg]));
      __m512 v;
      if constexpr (MULT) {
        v = _mm512_mul_ps(d, _mm512_fmadd_ps(s_hi, _mm512_cvtepi32_ps(dot), lo[r]));
      } else {
        v = _mm512_mul_ps(d, _mm512_cvtepi32_ps(dot));
      }
      if (MIN) {
        const __m512 asum = MULT ? _mm512_mul_ps(mn, _mm512_set1_ps(x.fsum[rg])) : _mm512_set1_ps(x.fsum[rg]);
        v = _mm512_fmadd_ps(m, asum, v);
      }
      y[r] = _mm512_fmadd_ps(_mm512_set1_ps(x.sx[rg]), v, y[r]);
    }
  }
  const __mmask16 mask = valid >= TILE ? __mmask16(0xFFFF) : __mmask16((1u << valid) - 1);
  for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(out + r * ldo, mask, y[r]);
}

template <int BITS, bool MIN, bool MULT>
struct Avx512 {
  static void tile(const Weights& w, int64_t t, const Acts& x, int64_t r0, int rows, float* out, int64_t ldo,
                   int valid) {
    switch (rows) {
      case 1: return tile_avx512_rows<1, BITS, MIN, MULT>(w, t, x, r0, out, ldo, valid);
      case 2: return tile_avx512_rows<2, BITS, MIN, MULT>(w, t, x, r0, out, ldo, valid);
      case 3: return tile_avx512_rows<3, BITS, MIN, MULT>(w, t, x, r0, out, ldo, valid);
      case 4: return tile_avx512_rows<4, BITS, MIN, MULT>(w, t, x, r0, out, ldo, valid);
      case 5: return tile_avx512_rows<5, BITS, MIN, MULT>(w, t, x, r0, out, ldo, valid);
      case 6: return tile_avx512_rows<6, BITS, MIN, MULT>(w, t, x, r0, out, ldo, valid);
      case 7: return tile_avx512_rows<7, BITS, MIN, MULT>(w, t, x, r0, out, ldo, valid);
      default: return tile_avx512_rows<8, BITS, MIN, MULT>(w, t, x, r0, out, ldo, valid);
    }
  }
};

// ---- AVX2: each tile as two halves of 8 channels ----

// Rows per register block: 6 rows' int16 and float accumulators take 12 of the 16 registers
// (over the model's GEMMs, 6-row blocks ran 3-6% faster than 4-row ones at 4 to 12 rows).
constexpr int AVX2_ROWS = 6;

// 8 int8 multipliers as floats, exactly.
__attribute__((target("avx2,fma,f16c"))) inline __m256 multipliers(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

template <int R, int BITS, bool MIN, bool MULT>
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
      __m256 lo[MULT ? R : 1];  // s_lo * dot_lo, exact
      for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_si256();
      const uint8_t* qg = q + g * CH * 64 + half * 32;
      const int64_t k0 = g * GROUP;
      if (R >= 2 && half == 0)  // as in tile_avx512_rows
        for (int j = 0; j < CH; ++j) _mm_prefetch(reinterpret_cast<const char*>(qg + PREFETCH + j * 64), _MM_HINT_T0);
      if (BITS == 4) {
        // A group's 8 pair sums per lane stay in int16: |u * a| <= 15 * 127, so a pair is at
        // most 3810 and the group's sum at most 30480. One widening a group (a half group with
        // multipliers) instead of one a pair: fewer instructions, the same integers.
        __m256i acc16[R];
        for (int r = 0; r < R; ++r) acc16[r] = _mm256_setzero_si256();
        for (int j = 0; j < CH; ++j) {
          if constexpr (MULT) {
            if (j == CH / 2) {
              const __m256 s = multipliers(w.st(t) + g * 2 * TILE + half * 8);
              for (int r = 0; r < R; ++r) {
                lo[r] = _mm256_mul_ps(s, _mm256_cvtepi32_ps(_mm256_madd_epi16(acc16[r], _mm256_set1_epi16(1))));
                acc16[r] = _mm256_setzero_si256();
              }
            }
          }
          const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qg + j * 64));
          const __m256i lo4 = _mm256_and_si256(v, low);
          const __m256i hi4 = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
          for (int r = 0; r < R; ++r) {
            const int8_t* a = x.a + (r0 + r) * x.K + k0 + 8 * j;
            acc16[r] = _mm256_add_epi16(acc16[r], _mm256_maddubs_epi16(lo4, _mm256_set1_epi32(load4(a))));
            acc16[r] = _mm256_add_epi16(acc16[r], _mm256_maddubs_epi16(hi4, _mm256_set1_epi32(load4(a + 4))));
          }
        }
        for (int r = 0; r < R; ++r) acc[r] = _mm256_madd_epi16(acc16[r], _mm256_set1_epi16(1));
      } else {
        // int8: a pair can reach 2 * 128 * 127, so each pair sum widens at once.
        for (int j = 0; j < CH; ++j) {
          if constexpr (MULT) {
            if (j == CH / 2) {
              const __m256 s = multipliers(w.st(t) + g * 2 * TILE + half * 8);
              for (int r = 0; r < R; ++r) {
                lo[r] = _mm256_mul_ps(s, _mm256_cvtepi32_ps(acc[r]));
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
      }
      const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w.dt(t) + g * TILE + half * 8)));
      const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w.mt(t) + g * TILE + half * 8)));
      __m256 s_hi = _mm256_setzero_ps(), mn = _mm256_setzero_ps();
      if constexpr (MULT) {
        s_hi = multipliers(w.st(t) + g * 2 * TILE + TILE + half * 8);
        if constexpr (MIN) mn = multipliers(w.mnt(t) + g * TILE + half * 8);
      }
      for (int r = 0; r < R; ++r) {
        const int64_t rg = (r0 + r) * x.G + g;
        __m256 v;  // int8: acc is already sum q a
        if constexpr (MULT) {
          v = _mm256_mul_ps(d, _mm256_fmadd_ps(s_hi, _mm256_cvtepi32_ps(acc[r]), lo[r]));
        } else {
          v = _mm256_mul_ps(d, _mm256_cvtepi32_ps(acc[r]));
        }
        if (MIN) {
          const __m256 asum = MULT ? _mm256_mul_ps(mn, _mm256_set1_ps(x.fsum[rg])) : _mm256_set1_ps(x.fsum[rg]);
          v = _mm256_fmadd_ps(m, asum, v);
        }
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

template <int BITS, bool MIN, bool MULT>
struct Avx2 {
  static void tile(const Weights& w, int64_t t, const Acts& x, int64_t r0, int rows, float* out, int64_t ldo,
                   int valid) {
    switch (rows) {
      case 1: return tile_avx2_rows<1, BITS, MIN, MULT>(w, t, x, r0, out, ldo, valid);
      case 2: return tile_avx2_rows<2, BITS, MIN, MULT>(w, t, x, r0, out, ldo, valid);
      case 3: return tile_avx2_rows<3, BITS, MIN, MULT>(w, t, x, r0, out, ldo, valid);
      case 4: return tile_avx2_rows<4, BITS, MIN, MULT>(w, t, x, r0, out, ldo, valid);
      case 5: return tile_avx2_rows<5, BITS, MIN, MULT>(w, t, x, r0, out, ldo, valid);
      default: return tile_avx2_rows<6, BITS, MIN, MULT>(w, t, x, r0, out, ldo, valid);
    }
  }
};

#endif  // DOT8_X86

// The weight kinds, an index into a path's table of tile functions.
enum Kind { W4, W4_MULT, W8, W8_MIN, W8_MULT, W8_MIN_MULT, KINDS };  // int4/int8, with a minimum, multipliers

inline Kind kind_of(const Weights& w) {
  if (w.bits == 4) return w.s ? W4_MULT : W4;
  if (w.s) return w.minimum ? W8_MIN_MULT : W8_MULT;
  return w.minimum ? W8_MIN : W8;
}

using TileFn = void (*)(const Weights&, int64_t, const Acts&, int64_t, int, float*, int64_t, int);

template <template <int, bool, bool> class P>
struct Table {
  TileFn fn[KINDS] = {P<4, true, false>::tile, P<4, true, true>::tile, P<8, false, false>::tile,
                      P<8, true, false>::tile, P<8, false, true>::tile, P<8, true, true>::tile};
};
