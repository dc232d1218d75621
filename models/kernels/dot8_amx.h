// dot8's Intel AMX path: a block of up to 16 quantized rows times one tile of 16 output channels,
// each group's integer dots by one tile multiply (TDPBSSD, K = 32, or two of K = 16 with
// multipliers per half group), then the AVX-512 path's float epilogue, the same operations in the
// same order, so the same bits. The weight layout is AMX's B-tile layout already: a group's int8
// chunk j holds inputs 4j..4j+3 of each channel; int4 / 5 / 6 bits unpack a chunk's low and high
// nibbles to B rows 2j and 2j + 1. Every value is stored as the signed q = u - offset, so the tile
// sums are sum q a exactly, with no offset correction.
// Linux gives a process the AMX tile state only on request (arch_prctl); the tile configuration is
// per thread, so each thread loads it for each block of rows it runs (amx_configure).
// Included by dot8.h, inside namespace dualserve_dot8, after dot8_tiles56.h.
#pragma once

#ifdef DOT8_X86

constexpr int AMX_ROWS = 16;  // rows of an A / C tile
constexpr int AMX_BUILD = 2;  // groups between building a B tile and its multiply

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Whether this CPU and kernel let the process use AMX int8 tiles (asked once).
inline bool amx_permitted() {
  unsigned a, b, c, d;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
  const bool tile = d & (1u << 24), int8 = d & (1u << 25);
  if (!tile || !int8 || !__builtin_cpu_supports("avx512f") || !__builtin_cpu_supports("avx512bw")) return false;
  if (!__get_cpuid(1, &a, &b, &c, &d) || !(c & (1u << 27))) return false;  // OSXSAVE
  unsigned lo, hi;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  if ((lo & (3u << 17)) != (3u << 17)) return false;  // XTILECFG and XTILEDATA enabled by the OS
#ifdef __linux__
  constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
  return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
#else
  return false;
#endif
}

// tmm0..3: C (rows x 16 int32); tmm4, 5: A (rows x 32 activation bytes, 16 with halves); tmm6, 7: B
// (8 rows of 64 bytes: inputs 4i..4i+3 of 16 channels, 4 rows with halves).
// Folded (tile_amx_folded): A is rows x 64 (both digits) and B 16 rows of 64.
__attribute__((target("amx-tile"))) inline void amx_configure(int rows, bool halves, bool folded = false) {
  TileConfig cfg;
  for (int i = 0; i < 4; ++i) {
    cfg.rows[i] = uint8_t(rows);
    cfg.colsb[i] = 64;
  }
  for (int i = 4; i < 6; ++i) {
    cfg.rows[i] = uint8_t(rows);
    cfg.colsb[i] = folded ? 64 : halves ? 16 : 32;
  }
  for (int i = 6; i < 8; ++i) {
    cfg.rows[i] = folded ? 16 : halves ? 4 : 8;
    cfg.colsb[i] = 64;
  }
  // GCC 12 does not see that ldtilecfg reads the configuration, and drops the stores without this.
  __asm__ volatile("" : : "r"(&cfg) : "memory");
  _tile_loadconfig(&cfg);
}

__attribute__((target("amx-tile"))) inline void amx_release() { _tile_release(); }

// Chunk J of a 4-, 5- or 6-bit group (its low and high nibbles) as B rows 2J and 2J + 1, signed.
template <int BITS, bool MIN, int J>
__attribute__((target("avx512f,avx512bw"), always_inline)) inline void b_rows(const uint8_t* qg, const __m512i* planes,
                                                                              int8_t* b) {
  constexpr int OFF = offset_of(BITS, MIN);
  const __m512i low = _mm512_set1_epi8(0x0F);
  const __m512i v = _mm512_loadu_si512(qg + J * 64);
  __m512i ul = _mm512_and_si512(v, low), uh = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
  if constexpr (BITS > 4) {
    constexpr int HB = BITS - 4;
    const __m512i mask = _mm512_set1_epi8(HB == 1 ? 0x10 : 0x30);
    ul = _mm512_ternarylogic_epi32(ul, high_at4<HB, 2 * J>(planes), mask, 0xF8);
    uh = _mm512_ternarylogic_epi32(uh, high_at4<HB, 2 * J + 1>(planes), mask, 0xF8);
  }
  if constexpr (OFF != 0) {
    ul = _mm512_sub_epi8(ul, _mm512_set1_epi8(char(OFF)));
    uh = _mm512_sub_epi8(uh, _mm512_set1_epi8(char(OFF)));
  }
  _mm512_store_si512(b + (2 * J) * 64, ul);
  _mm512_store_si512(b + (2 * J + 1) * 64, uh);
}

// Group qg's 32 inputs of 16 channels as a signed B tile (8 rows of 64 bytes) at b.
template <int BITS, bool MIN>
__attribute__((target("avx512f,avx512bw"), always_inline)) inline void b_tile(const uint8_t* qg, int8_t* b) {
  if constexpr (BITS == 8) {
    for (int j = 0; j < 8; ++j)  // u - 128 as a signed byte
      _mm512_store_si512(b + j * 64, _mm512_xor_si512(_mm512_loadu_si512(qg + j * 64), _mm512_set1_epi8(char(0x80))));
  } else {
    __m512i planes[BITS == 4 ? 1 : BITS - 4];
    if constexpr (BITS > 4)
      for (int p = 0; p < BITS - 4; ++p) planes[p] = _mm512_loadu_si512(qg + (4 + p) * 64);
    b_rows<BITS, MIN, 0>(qg, planes, b);
    b_rows<BITS, MIN, 1>(qg, planes, b);
    b_rows<BITS, MIN, 2>(qg, planes, b);
    b_rows<BITS, MIN, 3>(qg, planes, b);
  }
}

// Group g of a tile's weight q into slot S: its B tile built at b, multiplied by A (the rows'
// activations a, stride lda), and its integer dots (with halves: dot_lo, then dot_hi) stored as
// rows x 16 int32 at c. Slot S uses C tile S (with halves: 2S and 2S + 1) and the A and B tiles of
// its parity, so that the multiplies of consecutive groups need not wait on each other.
template <int BITS, bool MIN, int MULT, int S>
__attribute__((target("amx-tile,amx-int8,avx512f,avx512bw"), always_inline))
inline void amx_issue(const int8_t* a, int64_t lda, int64_t g, const int8_t* b, int32_t* c) {
  const int8_t* ag = a + g * GROUP;
  constexpr int HALF = AMX_ROWS * TILE;  // int32s of one C tile
  if constexpr (MULT == 2) {
    // Each half group apart: A's 16 inputs of the half times B's 4 rows of it.
#define DOT8_AMX_HALVES(CLO, CHI, A0, A1, B0, B1) \
  _tile_loadd(A0, ag, lda);                       \
  _tile_loadd(A1, ag + 16, lda);                  \
  _tile_loadd(B0, b, 64);                         \
  _tile_loadd(B1, b + 256, 64);                   \
  _tile_zero(CLO);                                \
  _tile_zero(CHI);                                \
  _tile_dpbssd(CLO, A0, B0);                      \
  _tile_dpbssd(CHI, A1, B1);                      \
  _tile_stored(CLO, c, 64);                       \
  _tile_stored(CHI, c + HALF, 64);
    if constexpr (S == 0) { DOT8_AMX_HALVES(0, 1, 4, 5, 6, 7) }
    else { DOT8_AMX_HALVES(2, 3, 4, 5, 6, 7) }
#undef DOT8_AMX_HALVES
  } else {
#define DOT8_AMX_GROUP(C, A, B) \
  _tile_loadd(A, ag, lda);      \
  _tile_loadd(B, b, 64);        \
  _tile_zero(C);                \
  _tile_dpbssd(C, A, B);        \
  _tile_stored(C, c, 64);
    if constexpr (S == 0) { DOT8_AMX_GROUP(0, 4, 6) }
    else if constexpr (S == 1) { DOT8_AMX_GROUP(1, 5, 7) }
    else if constexpr (S == 2) { DOT8_AMX_GROUP(2, 4, 6) }
    else { DOT8_AMX_GROUP(3, 5, 7) }
#undef DOT8_AMX_GROUP
  }
}

// The epilogue of tile_avx512_rows for group g, whose dots are at c, into the rows' sums y (in
// registers: the loop unrolls over RB rows); fused rows in pairs, as epilogue512.
template <int RB, bool MIN, int MULT>
__attribute__((target("avx512f,avx512bw,f16c,fma"), always_inline))
inline void amx_epilogue(__m512* y, int rows, const Weights& w, int64_t t, int64_t g, const Acts& x, int64_t r0,
                         const int32_t* c) {
  constexpr int HALF = AMX_ROWS * TILE;
  const int32_t* hi = c + (MULT == 2 ? HALF : 0);
  const Scales512 p = scales512<MIN, MULT>(w, t, g);
  const __m512i none = _mm512_setzero_si512();
  if (x.fused) {
#pragma GCC unroll 16
    for (int r = 0; r + 1 < RB; r += 2) {
      if (r < rows) {
        const int64_t rg = (r0 + r + 1) * x.G + g;
        const __m512i lo = MULT == 2 ? fuse512(_mm512_load_si512(c + r * TILE), _mm512_load_si512(c + (r + 1) * TILE))
                                     : none;
        const __m512i dot = fuse512(_mm512_load_si512(hi + r * TILE), _mm512_load_si512(hi + (r + 1) * TILE));
        y[r] = _mm512_fmadd_ps(_mm512_set1_ps(x.sx[rg]), value512<MIN, MULT>(p, dot, lo, x.fsum[rg]), y[r]);
      }
    }
  } else {
#pragma GCC unroll 16
    for (int r = 0; r < RB; ++r) {
      if (r < rows) {
        const int64_t rg = (r0 + r) * x.G + g;
        const __m512i lo = MULT == 2 ? _mm512_load_si512(c + r * TILE) : none;
        y[r] = _mm512_fmadd_ps(_mm512_set1_ps(x.sx[rg]),
                               value512<MIN, MULT>(p, _mm512_load_si512(hi + r * TILE), lo, x.fsum[rg]), y[r]);
      }
    }
  }
}

// Group g's B tile at b (with the weight stream's prefetch, as in tile_avx512_rows).
template <int BITS, bool MIN>
__attribute__((target("avx512f,avx512bw"), always_inline))
inline void amx_build(const uint8_t* q, int64_t g, int8_t* b) {
  const uint8_t* qg = q + g * BITS * 64;
  for (int j = 0; j < BITS; ++j) _mm_prefetch(reinterpret_cast<const char*>(qg + PREFETCH + j * 64), _MM_HINT_T0);
  b_tile<BITS, MIN>(qg, b);
}

// Rows r0..r0 + rows - 1 (rows <= RB <= 16, the tiles configured for them) times tile t. Software
// pipelined, so that the vector work and the tile unit overlap instead of waiting on each other:
// a group's B tile is built AMX_BUILD groups ahead of its multiply (a tile load waits until the
// vector stores that built it reach the cache), and the multiply runs AHEAD groups ahead of the float
// epilogue, which reads the dots it stored. Each row's sums still take the groups in order.
// The B tiles go to a ring of BS on the stack, or with ``built`` (room for all G) to built + 512 g,
// where later blocks of rows of the same tile find them (``reuse``: built holds them already).
template <int RB, int BITS, bool MIN, int MULT>
__attribute__((target("amx-tile,amx-int8,avx512f,avx512bw,avx512vnni,f16c,fma")))
void tile_amx(const Weights& w, int64_t t, const Acts& x, int64_t r0, int rows, float* out, int64_t ldo, int valid,
              int8_t* built, bool reuse) {
  constexpr int SLOTS = MULT == 2 ? 2 : 4, AHEAD = MULT == 2 ? 1 : 2, H = MULT == 2 ? 2 : 1;
  constexpr int BUILD = AMX_BUILD + AHEAD, BS = 8;  // BUILD < BS
  alignas(64) int8_t b[BS][512];
  alignas(64) int32_t c[SLOTS][H * AMX_ROWS * TILE];
  __m512 y[RB];
#pragma GCC unroll 16
  for (int r = 0; r < RB; ++r) y[r] = _mm512_setzero_ps();
  const uint8_t* q = w.tile(t);
  const int8_t* a = x.a + r0 * x.K;
  const int64_t G = w.G;
  const auto bt = [&](int64_t g) -> int8_t* { return built ? built + g * 512 : b[g % BS]; };
  if (!reuse)
    for (int64_t g = 0; g < std::min<int64_t>(BUILD, G); ++g) amx_build<BITS, MIN>(q, g, bt(g));
#define DOT8_AMX_ISSUE(S, g) amx_issue<BITS, MIN, MULT, S>(a, x.K, g, bt(g), c[S])
  DOT8_AMX_ISSUE(0, 0);
  if (AHEAD > 1 && G > 1) DOT8_AMX_ISSUE(1, 1);
  for (int64_t g0 = 0; g0 < G; g0 += SLOTS) {
    // group g0 + i: build group g + BUILD's B, issue group g + AHEAD's multiply into its slot,
    // then the epilogue of slot i
#define DOT8_AMX_STEP(I)                                                           \
  if (g0 + I < G) {                                                                \
    if (!reuse && g0 + I + BUILD < G) amx_build<BITS, MIN>(q, g0 + I + BUILD, bt(g0 + I + BUILD)); \
    if (g0 + I + AHEAD < G) DOT8_AMX_ISSUE((I + AHEAD) % SLOTS, g0 + I + AHEAD);    \
    amx_epilogue<RB, MIN, MULT>(y, rows, w, t, g0 + I, x, r0, c[I]);                    \
  }
    DOT8_AMX_STEP(0)
    DOT8_AMX_STEP(1)
    if constexpr (SLOTS == 4) {
      DOT8_AMX_STEP(2)
      DOT8_AMX_STEP(3)
    }
#undef DOT8_AMX_STEP
  }
#undef DOT8_AMX_ISSUE
  const __mmask16 mask = valid >= TILE ? __mmask16(0xFFFF) : __mmask16((1u << valid) - 1);
  const int step = x.fused ? 2 : 1;
#pragma GCC unroll 16
  for (int r = 0; r < RB; r += step)
    if (r < rows) _mm512_mask_storeu_ps(out + (r / step) * ldo, mask, y[r]);
}

// Two digits times int4 weights, folded into each group's tile multiply: C = A0 (16 q) + A1 q,
// where A0 and A1 are the tokens' first and second digits. One multiply of K = 64: A's row is a
// token's group as [a0 | a1] (Acts::a64, written by the quantizer), B's 16 rows are [16 q | q].
// With a minimum q is the stored u (16 u at most 240: TDPBSUD, signed activations and unsigned
// weights); without one (Q4_0) it is u - 8, and 16 q lies in -128..112 (TDPBSSD). C is then the
// fused integer 16 a0 + a1 of each token (dot8_acts.h) times q, sum q a exactly, with no epilogue
// work, and a tile holds 16 tokens. Weights with multipliers per half are not folded (tile_amx
// fuses them).
constexpr bool folds(int bits, int mult) { return bits == 4 && mult != 2; }

// Group g's int4 B tile as [16 q | q] (16 rows of 64 bytes) at b: chunk J's low nibbles are input
// rows 2J, its high ones 2J + 1. Stored u: q = v & 0x0F, 16 q = (v << 4) & 0xF0 (low nibbles);
// (v >> 4) & 0x0F and v & 0xF0 (high). Signed (SIGNED: q = u - 8), 16 q is 16 u - 128, the same
// bytes with the top bit flipped, and q is the nibble minus 8.
template <bool SIGNED>
__attribute__((target("avx512f,avx512bw"), always_inline))
inline void amx_build_folded(const uint8_t* q, int64_t g, int8_t* b) {
  const uint8_t* qg = q + g * 4 * 64;
  for (int j = 0; j < 4; ++j) _mm_prefetch(reinterpret_cast<const char*>(qg + PREFETCH + j * 64), _MM_HINT_T0);
  const __m512i low = _mm512_set1_epi8(0x0F), high = _mm512_set1_epi8(char(0xF0)), top = _mm512_set1_epi8(char(0x80));
  const __m512i eight = _mm512_set1_epi8(8);
  for (int j = 0; j < 4; ++j) {
    const __m512i v = _mm512_loadu_si512(qg + j * 64);
    const __m512i shifted = _mm512_slli_epi16(v, 4), down = _mm512_srli_epi16(v, 4);
    if constexpr (SIGNED) {  // 0x6A: (x & y) ^ z
      _mm512_store_si512(b + (2 * j) * 64, _mm512_ternarylogic_epi32(shifted, high, top, 0x6A));
      _mm512_store_si512(b + (2 * j + 1) * 64, _mm512_ternarylogic_epi32(v, high, top, 0x6A));
      _mm512_store_si512(b + (8 + 2 * j) * 64, _mm512_sub_epi8(_mm512_and_si512(v, low), eight));
      _mm512_store_si512(b + (8 + 2 * j + 1) * 64, _mm512_sub_epi8(_mm512_and_si512(down, low), eight));
    } else {
      _mm512_store_si512(b + (2 * j) * 64, _mm512_and_si512(shifted, high));
      _mm512_store_si512(b + (2 * j + 1) * 64, _mm512_and_si512(v, high));
      _mm512_store_si512(b + (8 + 2 * j) * 64, _mm512_and_si512(v, low));
      _mm512_store_si512(b + (8 + 2 * j + 1) * 64, _mm512_and_si512(down, low));
    }
  }
}

// Group g's folded multiply into C tile S (A and B tiles of S's parity); its store apart
// (amx_store_folded), a step later, so that the store does not wait on the multiply just issued.
template <int S, bool SIGNED>
__attribute__((target("amx-tile,amx-int8"), always_inline))
inline void amx_multiply_folded(const int8_t* ag, int64_t lda, const int8_t* b) {
#define DOT8_AMX_FOLD(C, A, B) \
  _tile_loadd(A, ag, lda);      \
  _tile_loadd(B, b, 64);        \
  _tile_zero(C);                \
  if constexpr (SIGNED) _tile_dpbssd(C, A, B); \
  else _tile_dpbsud(C, A, B);
  if constexpr (S == 0) { DOT8_AMX_FOLD(0, 4, 6) }
  else if constexpr (S == 1) { DOT8_AMX_FOLD(1, 5, 7) }
  else if constexpr (S == 2) { DOT8_AMX_FOLD(2, 4, 6) }
  else { DOT8_AMX_FOLD(3, 5, 7) }
#undef DOT8_AMX_FOLD
}

template <int S>
__attribute__((target("amx-tile"), always_inline)) inline void amx_store_folded(int32_t* c) {
  if constexpr (S == 0) _tile_stored(0, c, 64);
  else if constexpr (S == 1) _tile_stored(1, c, 64);
  else if constexpr (S == 2) _tile_stored(2, c, 64);
  else _tile_stored(3, c, 64);
}

// Tokens r0 / 2.. (rows / 2 <= TB <= 16, the tiles configured for them) times tile t, software
// pipelined as tile_amx: at group g's turn, group g + BUILD's B tile is built, group g + 2's
// multiply issued, group g + 1's dots stored and group g's epilogue run (each row's sums still
// take the groups in order). The B tiles go to a ring of BS on the stack, or with ``built`` (room
// for all G) to built + 1024 g, where later blocks of rows of the same tile find them (``reuse``:
// built already holds them, and nothing is built).
template <int TB, int BITS, bool MIN, int MULT>
__attribute__((target("amx-tile,amx-int8,avx512f,avx512bw,avx512vnni,f16c,fma")))
void tile_amx_folded(const Weights& w, int64_t t, const Acts& x, int64_t r0, int rows, float* out, int64_t ldo,
                     int valid, int8_t* built, bool reuse) {
  static_assert(BITS == 4, "only int4 folds");
  constexpr bool SIGNED = offset_of(BITS, MIN) != 0;
  constexpr int SLOTS = 4, AHEAD = 2, BUILD = AMX_BUILD + AHEAD, BS = 8;
  alignas(64) int8_t b[BS][1024];
  alignas(64) int32_t c[SLOTS][AMX_ROWS * TILE];
  const int tokens = rows / 2;
  __m512 y[TB];
#pragma GCC unroll 16
  for (int r = 0; r < TB; ++r) y[r] = _mm512_setzero_ps();
  const uint8_t* q = w.tile(t);
  const int8_t* a = x.a64 + (r0 / 2) * x.G * 64;  // token r0 / 2's interleaved groups
  const int64_t G = w.G, lda = G * 64;
  const auto bt = [&](int64_t g) -> int8_t* { return built ? built + g * 1024 : b[g % BS]; };
#define DOT8_AMX_MULTIPLY(S, g) amx_multiply_folded<S, SIGNED>(a + (g) * 64, lda, bt(g))
  if (!reuse)
    for (int64_t g = 0; g < std::min<int64_t>(BUILD, G); ++g) amx_build_folded<SIGNED>(q, g, bt(g));
  DOT8_AMX_MULTIPLY(0, 0);
  if (G > 1) DOT8_AMX_MULTIPLY(1, 1);
  amx_store_folded<0>(c[0]);
  for (int64_t g0 = 0; g0 < G; g0 += SLOTS) {
#define DOT8_AMX_STEP(I)                                                                          \
  if (g0 + I < G) {                                                                               \
    const int64_t g = g0 + I;                                                                     \
    if (!reuse && g + BUILD < G) amx_build_folded<SIGNED>(q, g + BUILD, bt(g + BUILD));             \
    if (g + AHEAD < G) DOT8_AMX_MULTIPLY((I + AHEAD) % SLOTS, g + AHEAD);                         \
    if (g + 1 < G) amx_store_folded<(I + 1) % SLOTS>(c[(I + 1) % SLOTS]);                          \
    const Scales512 p = scales512<MIN, MULT>(w, t, g);                                            \
    _Pragma("GCC unroll 16") for (int r = 0; r < TB; ++r) {                                       \
      if (r < tokens) {                                                                           \
        const int64_t rg = (r0 + 2 * r + 1) * x.G + g;                                            \
        y[r] = _mm512_fmadd_ps(_mm512_set1_ps(x.sx[rg]),                                          \
                               value512<MIN, MULT>(p, _mm512_load_si512(c[I] + r * TILE),         \
                                                   _mm512_setzero_si512(), x.fsum[rg]), y[r]);    \
      }                                                                                           \
    }                                                                                             \
  }
    DOT8_AMX_STEP(0)
    DOT8_AMX_STEP(1)
    DOT8_AMX_STEP(2)
    DOT8_AMX_STEP(3)
#undef DOT8_AMX_STEP
  }
#undef DOT8_AMX_MULTIPLY
  const __mmask16 mask = valid >= TILE ? __mmask16(0xFFFF) : __mmask16((1u << valid) - 1);
#pragma GCC unroll 16
  for (int r = 0; r < TB; ++r)
    if (r < tokens) _mm512_mask_storeu_ps(out + r * ldo, mask, y[r]);
}

// A kind's block of rows on AMX (dot8.cpp: product). A product of more than one block passes
// ``built`` (1 KB a group), into which the first block of each tile builds its B tiles and from which
// the rest read them (``reuse``): a prompt's blocks of 16 tokens unpack each group of weights once
// instead of once a block. The same multiplies and epilogue, so the same bits. A block alone passes
// null, and its B tiles go to the multiply's ring.
using BlockFn = void (*)(const Weights&, int64_t, const Acts&, int64_t, int, float*, int64_t, int, int8_t*, bool);
constexpr int64_t AMX_BUILT_BYTES = 1024;  // a group's B tile, folded (unfolded: 512)

template <int BITS, bool MIN, int MULT>
struct Amx {
  static void tile(const Weights& w, int64_t t, const Acts& x, int64_t r0, int rows, float* out, int64_t ldo,
                   int valid, int8_t* built, bool reuse) {
    if constexpr (folds(BITS, MULT)) {
      if (x.a64) {
        if (rows <= 8) return tile_amx_folded<4, BITS, MIN, MULT>(w, t, x, r0, rows, out, ldo, valid, built, reuse);
        if (rows <= 16) return tile_amx_folded<8, BITS, MIN, MULT>(w, t, x, r0, rows, out, ldo, valid, built, reuse);
        return tile_amx_folded<16, BITS, MIN, MULT>(w, t, x, r0, rows, out, ldo, valid, built, reuse);
      }
    }
    if (rows <= 4) return tile_amx<4, BITS, MIN, MULT>(w, t, x, r0, rows, out, ldo, valid, built, reuse);
    if (rows <= 8) return tile_amx<8, BITS, MIN, MULT>(w, t, x, r0, rows, out, ldo, valid, built, reuse);
    tile_amx<16, BITS, MIN, MULT>(w, t, x, r0, rows, out, ldo, valid, built, reuse);
  }
};

#endif  // DOT8_X86
