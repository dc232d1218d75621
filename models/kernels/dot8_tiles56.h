// dot8's 5- and 6-bit weights (ggml's own approach for Q5 and Q6): a group's low nibbles sit in
// int4's four chunks, its high bits in one plane (5 bits: 1 bit a value) or two (6 bits: 2) of 64
// bytes after them, each plane byte holding the high bits of the values in the same byte of the
// nibble chunks (dot8_tiles.h: stored_value). One load of a plane serves the high bits of 4
// chunks (5 bits) or 2 (6 bits); a value is rebuilt as u = nibble | high << 4 by a shift and a
// bitwise select per 64 bytes, then multiplied exactly as int4's nibbles are. Then the kinds'
// table, which picks a tile function per (bits, minimum, multipliers).
// Included by dot8.h, inside namespace dualserve_dot8, after dot8_tiles.h.
#pragma once

#ifdef DOT8_X86

// The high bits of nibble vector I (chunk I / 2's low or high nibbles) moved to bit 4 of each byte,
// not yet masked. 16-bit shifts by at most 4 never carry a needed bit across a byte.
template <int HB, int I>
__attribute__((target("avx512f,avx512bw"), always_inline)) inline __m512i high_at4(const __m512i* planes) {
  constexpr int P = 8 / HB, S = 4 - HB * (I % P);
  if constexpr (S > 0) return _mm512_slli_epi16(planes[I / P], S);
  else if constexpr (S < 0) return _mm512_srli_epi16(planes[I / P], -S);
  else return planes[I / P];
}

template <int HB, int I>
__attribute__((target("avx2"), always_inline)) inline __m256i high_at4(const __m256i* planes) {
  constexpr int P = 8 / HB, S = 4 - HB * (I % P);
  if constexpr (S > 0) return _mm256_slli_epi16(planes[I / P], S);
  else if constexpr (S < 0) return _mm256_srli_epi16(planes[I / P], -S);
  else return planes[I / P];
}

// Chunk J of a group (inputs 8J..8J+7) into R rows' int32 sums of u * a.
template <int R, int HB, int J>
__attribute__((target("avx512f,avx512bw,avx512vnni"), always_inline))
inline void chunk_avx512(__m512i* acc, const uint8_t* qg, const __m512i* planes, const int8_t* a, int64_t K) {
  const __m512i low = _mm512_set1_epi8(0x0F), mask = _mm512_set1_epi8(HB == 1 ? 0x10 : 0x30);
  const __m512i v = _mm512_loadu_si512(qg + J * 64);
  // 0xF8: a | (b & c)
  const __m512i ul = _mm512_ternarylogic_epi32(_mm512_and_si512(v, low), high_at4<HB, 2 * J>(planes), mask, 0xF8);
  const __m512i uh = _mm512_ternarylogic_epi32(_mm512_and_si512(_mm512_srli_epi16(v, 4), low),
                                               high_at4<HB, 2 * J + 1>(planes), mask, 0xF8);
  for (int r = 0; r < R; ++r) {
    const int8_t* ar = a + r * K + 8 * J;
    acc[r] = _mm512_dpbusd_epi32(acc[r], ul, _mm512_set1_epi32(load4(ar)));
    acc[r] = _mm512_dpbusd_epi32(acc[r], uh, _mm512_set1_epi32(load4(ar + 4)));
  }
}

template <int R, int BITS, bool MIN, int MULT>
__attribute__((target("avx512f,avx512bw,avx512vnni,f16c,fma")))
void tile56_avx512_rows(const Weights& w, int64_t t, const Acts& x, int64_t r0, float* out, int64_t ldo, int valid) {
  constexpr int HB = BITS - 4, OFF = offset_of(BITS, MIN);
  const uint8_t* q = w.tile(t);
  __m512 y[R];
  for (int r = 0; r < R; ++r) y[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < w.G; ++g) {
    __m512i acc[R];
    __m512i dlo[MULT == 2 ? R : 1];  // inputs 0..15's dots, with multipliers per half
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_si512();
    const uint8_t* qg = q + g * BITS * 64;
    const int8_t* a = x.a + r0 * x.K + g * GROUP;
    for (int j = 0; j < BITS; ++j)  // prefetch, as in tile_avx512_rows
      _mm_prefetch(reinterpret_cast<const char*>(qg + PREFETCH + j * 64), _MM_HINT_T0);
    __m512i planes[HB];
    for (int p = 0; p < HB; ++p) planes[p] = _mm512_loadu_si512(qg + (4 + p) * 64);
    chunk_avx512<R, HB, 0>(acc, qg, planes, a, x.K);
    chunk_avx512<R, HB, 1>(acc, qg, planes, a, x.K);
    if constexpr (MULT == 2) {
      for (int r = 0; r < R; ++r) {
        dlo[r] = minus_offset<OFF>(acc[r], x.half, ((r0 + r) * x.G + g) * 2);
        acc[r] = _mm512_setzero_si512();
      }
    }
    chunk_avx512<R, HB, 2>(acc, qg, planes, a, x.K);
    chunk_avx512<R, HB, 3>(acc, qg, planes, a, x.K);
    for (int r = 0; r < R; ++r) {
      const int64_t rg = (r0 + r) * x.G + g;
      acc[r] = MULT == 2 ? minus_offset<OFF>(acc[r], x.half, rg * 2 + 1) : minus_offset<OFF>(acc[r], x.sum, rg);
    }
    epilogue512<R, MIN, MULT>(y, acc, dlo, w, t, g, x, r0);
  }
  store512<R>(y, x, out, ldo, valid);
}

// AVX2: chunk J's 32 bytes at qg (one half tile) into R rows' int32 sums of u * a. maddubs makes
// pair sums in int16: u <= 63 and |a| <= 127 (activations are quantized to -127..127), so a pair
// is at most 2 * 63 * 127 = 16002 and the chunk's two pairs per lane 32004, below 32767; they
// widen to int32 once a chunk.
template <int R, int HB, int J>
__attribute__((target("avx2,fma,f16c"), always_inline))
inline void chunk_avx2(__m256i* acc, const uint8_t* qg, const __m256i* planes, const int8_t* a, int64_t K) {
  const __m256i low = _mm256_set1_epi8(0x0F), mask = _mm256_set1_epi8(HB == 1 ? 0x10 : 0x30);
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qg + J * 64));
  const __m256i ul = _mm256_or_si256(_mm256_and_si256(v, low), _mm256_and_si256(high_at4<HB, 2 * J>(planes), mask));
  const __m256i uh = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 4), low),
                                     _mm256_and_si256(high_at4<HB, 2 * J + 1>(planes), mask));
  for (int r = 0; r < R; ++r) {
    const int8_t* ar = a + r * K + 8 * J;
    const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(ul, _mm256_set1_epi32(load4(ar))),
                                           _mm256_maddubs_epi16(uh, _mm256_set1_epi32(load4(ar + 4))));
    acc[r] = _mm256_add_epi32(acc[r], _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
  }
}

template <int R, int BITS, bool MIN, int MULT>
__attribute__((target("avx2,fma,f16c")))
void tile56_avx2_rows(const Weights& w, int64_t t, const Acts& x, int64_t r0, float* out, int64_t ldo, int valid) {
  constexpr int HB = BITS - 4, OFF = offset_of(BITS, MIN);
  const uint8_t* q = w.tile(t);
  for (int half = 0; half < 2; ++half) {
    __m256 y[R];
    for (int r = 0; r < R; ++r) y[r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < w.G; ++g) {
      __m256i acc[R];
      __m256i dlo[MULT == 2 ? R : 1];  // inputs 0..15's dots, with multipliers per half
      for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_si256();
      const uint8_t* qg = q + g * BITS * 64 + half * 32;
      const int8_t* a = x.a + r0 * x.K + g * GROUP;
      if (R >= 2 && half == 0)  // as in tile_avx2_rows
        for (int j = 0; j < BITS; ++j) _mm_prefetch(reinterpret_cast<const char*>(qg + PREFETCH + j * 64), _MM_HINT_T0);
      __m256i planes[HB];
      for (int p = 0; p < HB; ++p) planes[p] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qg + (4 + p) * 64));
      chunk_avx2<R, HB, 0>(acc, qg, planes, a, x.K);
      chunk_avx2<R, HB, 1>(acc, qg, planes, a, x.K);
      if constexpr (MULT == 2) {
        for (int r = 0; r < R; ++r) {
          dlo[r] = minus_offset<OFF>(acc[r], x.half, ((r0 + r) * x.G + g) * 2);
          acc[r] = _mm256_setzero_si256();
        }
      }
      chunk_avx2<R, HB, 2>(acc, qg, planes, a, x.K);
      chunk_avx2<R, HB, 3>(acc, qg, planes, a, x.K);
      for (int r = 0; r < R; ++r) {
        const int64_t rg = (r0 + r) * x.G + g;
        acc[r] = MULT == 2 ? minus_offset<OFF>(acc[r], x.half, rg * 2 + 1) : minus_offset<OFF>(acc[r], x.sum, rg);
      }
      epilogue256<R, MIN, MULT>(y, acc, dlo, w, t, g, half * 8, x, r0);
    }
    store256<R>(y, x, out, ldo, valid - half * 8, half * 8);
  }
}

// ---- a kind's tile function for a block of 1..8 rows (1..6 on AVX2) ----

template <int BITS, bool MIN, int MULT>
struct Avx512 {
  template <int R>
  static void rows(const Weights& w, int64_t t, const Acts& x, int64_t r0, float* out, int64_t ldo, int valid) {
    if constexpr (BITS == 5 || BITS == 6) tile56_avx512_rows<R, BITS, MIN, MULT>(w, t, x, r0, out, ldo, valid);
    else tile_avx512_rows<R, BITS, MIN, MULT>(w, t, x, r0, out, ldo, valid);
  }
  static void tile(const Weights& w, int64_t t, const Acts& x, int64_t r0, int rows, float* out, int64_t ldo,
                   int valid) {
    if constexpr (BITS == 4) {
      if (x.fused) {  // int4 and two digits: up to 8 tokens (16 quantized rows), folded
        switch (rows / 2) {
          case 1: return tile_avx512_folded<1, MIN, MULT>(w, t, x, r0, out, ldo, valid);
          case 2: return tile_avx512_folded<2, MIN, MULT>(w, t, x, r0, out, ldo, valid);
          case 3: return tile_avx512_folded<3, MIN, MULT>(w, t, x, r0, out, ldo, valid);
          case 4: return tile_avx512_folded<4, MIN, MULT>(w, t, x, r0, out, ldo, valid);
          case 5: return tile_avx512_folded<5, MIN, MULT>(w, t, x, r0, out, ldo, valid);
          case 6: return tile_avx512_folded<6, MIN, MULT>(w, t, x, r0, out, ldo, valid);
          case 7: return tile_avx512_folded<7, MIN, MULT>(w, t, x, r0, out, ldo, valid);
          default: return tile_avx512_folded<8, MIN, MULT>(w, t, x, r0, out, ldo, valid);
        }
      }
    }
    switch (rows) {
      case 1: return Avx512::rows<1>(w, t, x, r0, out, ldo, valid);
      case 2: return Avx512::rows<2>(w, t, x, r0, out, ldo, valid);
      case 3: return Avx512::rows<3>(w, t, x, r0, out, ldo, valid);
      case 4: return Avx512::rows<4>(w, t, x, r0, out, ldo, valid);
      case 5: return Avx512::rows<5>(w, t, x, r0, out, ldo, valid);
      case 6: return Avx512::rows<6>(w, t, x, r0, out, ldo, valid);
      case 7: return Avx512::rows<7>(w, t, x, r0, out, ldo, valid);
      default: return Avx512::rows<8>(w, t, x, r0, out, ldo, valid);
    }
  }
};

template <int BITS, bool MIN, int MULT>
struct Avx2 {
  template <int R>
  static void rows(const Weights& w, int64_t t, const Acts& x, int64_t r0, float* out, int64_t ldo, int valid) {
    if constexpr (BITS == 5 || BITS == 6) tile56_avx2_rows<R, BITS, MIN, MULT>(w, t, x, r0, out, ldo, valid);
    else if constexpr (BITS == 8) tile_avx2_rows<R, MIN, MULT>(w, t, x, r0, out, ldo, valid);
  }
  static void tile(const Weights& w, int64_t t, const Acts& x, int64_t r0, int rows, float* out, int64_t ldo,
                   int valid) {
    if constexpr (BITS == 4) {  // any rows up to AVX2_INT4_ROWS, one unpacking a group for all
      if (x.fused) return tile_avx2_int4<MIN, MULT, true>(w, t, x, r0, rows, out, ldo, valid);
      return tile_avx2_int4<MIN, MULT, false>(w, t, x, r0, rows, out, ldo, valid);
    }
    switch (rows) {
      case 1: return Avx2::rows<1>(w, t, x, r0, out, ldo, valid);
      case 2: return Avx2::rows<2>(w, t, x, r0, out, ldo, valid);
      case 3: return Avx2::rows<3>(w, t, x, r0, out, ldo, valid);
      case 4: return Avx2::rows<4>(w, t, x, r0, out, ldo, valid);
      case 5: return Avx2::rows<5>(w, t, x, r0, out, ldo, valid);
      default: return Avx2::rows<6>(w, t, x, r0, out, ldo, valid);
    }
  }
};

#endif  // DOT8_X86

// ---- the weight kinds: an index into a path's table of tile functions ----

// (bits 4 / 5 / 6 / 8) x (minimum) x (multipliers: none, per group, per half group).
constexpr int KINDS = 4 * 2 * 3;

inline int kind_of(const Weights& w) {
  const int b = w.bits == 4 ? 0 : w.bits == 5 ? 1 : w.bits == 6 ? 2 : 3;
  return (b * 2 + (w.minimum ? 1 : 0)) * 3 + (w.s ? w.s_per : 0);
}

using TileFn = void (*)(const Weights&, int64_t, const Acts&, int64_t, int, float*, int64_t, int);

template <template <int, bool, int> class P, typename Fn = TileFn>
struct Table {
  Fn fn[KINDS];
  Table() {
    fill<4>(fn);
    fill<5>(fn + 6);
    fill<6>(fn + 12);
    fill<8>(fn + 18);
  }
  template <int BITS>
  static void fill(Fn* f) {
    f[0] = P<BITS, false, 0>::tile;
    f[1] = P<BITS, false, 1>::tile;
    f[2] = P<BITS, false, 2>::tile;
    f[3] = P<BITS, true, 0>::tile;
    f[4] = P<BITS, true, 1>::tile;
    f[5] = P<BITS, true, 2>::tile;
  }
};
