// dot8's activations: each row quantized per group of 32 to int8 digits (llama.cpp's Q8
// activations, and with two digits what the first left over), the same bits on every path.
// Included by dot8.h, inside namespace dualserve_dot8, after dot8_tiles.h.
#pragma once

// Per row and group of 32: sx = max|x| / 127, a = round(x / sx) (ties to even), sum = sum a.
// Every path divides (not multiplies by a reciprocal) and rounds in the default mode, so
// they agree bit for bit.
// With ``tied`` the scale is given instead (a second digit's: the first's / 16).
inline void quantize_group_scalar(const float* v, int8_t* a, float* sx, int32_t* sum, const float* tied = nullptr) {
  float amax = 0.f;
  for (int i = 0; i < GROUP; ++i) amax = std::fmax(amax, std::fabs(v[i]));
  const float s = tied ? *tied : amax / 127.f;
  int32_t total = 0;
  for (int i = 0; i < GROUP; ++i) {
    const int32_t qi = s > 0.f ? int32_t(std::nearbyint(v[i] / s)) : 0;
    a[i] = int8_t(std::clamp(qi, -128, 127));  // saturated, as the vector paths store it
    total += qi;
  }
  *sx = s;
  *sum = total;
}

// One group as ``digits`` int8 digits (1 or 2). The first is llama.cpp's Q8 digit, sx = max|x| / 127.
// The second quantizes what the first left over, x - a0 sx, on a scale TIED to the first,
// sx / 16 (exact: a power of two), so |a1| <= 8 and x ~ (16 a0 + a1) sx / 16: about 12 bits of
// the group, one integer per input that the tile functions sum exactly (dot8_tiles.h, "fused").
// The residual is computed in the same fp32 operations on every path (contraction is off).
constexpr float DIGIT_RADIX = 16.f;

inline void quantize_digits(const float* f, int64_t digits, int8_t* a, float* sx, int32_t* sum, int64_t stride_a,
                            int64_t stride_s) {
  float rest[GROUP];
  const float* v = f;
  for (int64_t k = 0; k < digits; ++k) {
    int8_t* ak = a + k * stride_a;
    const float tied = k ? sx[(k - 1) * stride_s] / DIGIT_RADIX : 0.f;
    quantize_group_scalar(v, ak, sx + k * stride_s, sum + k * stride_s, k ? &tied : nullptr);
    if (k + 1 < digits) {
      const float s = sx[k * stride_s];
      for (int i = 0; i < GROUP; ++i) rest[i] = v[i] - float(ak[i]) * s;
      v = rest;
    }
  }
}

// How a product's activations are quantized: in plain C, or on the vector unit of its code path.
enum class Quantizer { SCALAR, AVX2, AVX512 };

// Where one group's quantized digits go: digit k's int8 values at a + k * stride_a, its scale and
// sums at index k * stride_s (with halves, the half sums at twice that index).
struct GroupOut {
  int8_t* a;
  float *sx, *fsum;
  int32_t *sum, *sum128, *half, *half128;  // half, half128: null without halves
  int64_t stride_a, stride_s;

  // Digit k's sum of digits (and of the first 16, read only with halves) and what follows from it;
  // the second digit's fsum is the fused sum, 16 sum0 + sum1, which the tile functions read.
  void sums(int64_t k, int32_t total, int32_t first) const {
    const int64_t i = k * stride_s;
    sum[i] = total;
    fsum[i] = float(k == 1 ? fuse(sum[0], total) : total);
    sum128[i] = 128 * total;
    if (half) {
      half[2 * i] = first;
      half[2 * i + 1] = total - first;
      half128[2 * i] = 128 * first;
      half128[2 * i + 1] = 128 * (total - first);
    }
  }
};

// A group in plain C: quantize_digits on the widened values, then each digit's sums.
template <typename T>
void quantize_group_digits_scalar(const T* xg, int64_t digits, const GroupOut& o) {
  float v[GROUP];
  for (int i = 0; i < GROUP; ++i) v[i] = static_cast<float>(xg[i]);
  quantize_digits(v, digits, o.a, o.sx, o.sum, o.stride_a, o.stride_s);
  for (int64_t k = 0; k < digits; ++k) {
    int32_t first = 0;
    if (o.half)
      for (int i = 0; i < GROUP / 2; ++i) first += o.a[k * o.stride_a + i];
    o.sums(k, o.sum[k * o.stride_s], first);
  }
}

#ifdef DOT8_X86
// 16 values of x as fp32: a bf16 is the high half of its float, so the widening is exact.
template <typename T>
__attribute__((target("avx512f,avx512bw"))) inline __m512 load16_ps(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return _mm512_loadu_ps(p);
  } else {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
}

// One group's ``digits`` digits with the residual kept in registers: quantize_digits' operations
// on 16 lanes (the maximum, one division per value, rounding to nearest even, the residual
// x - float(a) * s with a the stored int8), so the same bits.
template <typename T>
__attribute__((target("avx512f,avx512bw"))) void quantize_group_digits_avx512(const T* xg, int64_t digits,
                                                                              const GroupOut& o) {
  __m512 x0 = load16_ps(xg), x1 = load16_ps(xg + 16);
  for (int64_t k = 0; k < digits; ++k) {
    int8_t* ak = o.a + k * o.stride_a;
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(x0), _mm512_abs_ps(x1)));
    const float s = k ? o.sx[(k - 1) * o.stride_s] / DIGIT_RADIX : amax / 127.f;
    o.sx[k * o.stride_s] = s;
    int32_t total = 0;
    __m128i a0 = _mm_setzero_si128(), a1 = _mm_setzero_si128();
    if (s > 0.f) {
      const __m512 vs = _mm512_set1_ps(s);
      const __m512i q0 = _mm512_cvtps_epi32(_mm512_div_ps(x0, vs)), q1 = _mm512_cvtps_epi32(_mm512_div_ps(x1, vs));
      a0 = _mm512_cvtsepi32_epi8(q0);
      a1 = _mm512_cvtsepi32_epi8(q1);
      total = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
    }
    _mm_storeu_si128(reinterpret_cast<__m128i*>(ak), a0);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(ak + 16), a1);
    // the first half's sum from the stored digits, as the scalar path counts them
    o.sums(k, total, o.half ? _mm512_reduce_add_epi32(_mm512_cvtepi8_epi32(a0)) : 0);
    if (k + 1 < digits) {
      const __m512 vs = _mm512_set1_ps(s);
      x0 = _mm512_sub_ps(x0, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(a0)), vs));
      x1 = _mm512_sub_ps(x1, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(a1)), vs));
    }
  }
}

// 8 values of x as fp32 (load16_ps on 8 lanes).
template <typename T>
__attribute__((target("avx2"))) inline __m256 load8_ps(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return _mm256_loadu_ps(p);
  } else {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
}

__attribute__((target("avx2"))) inline int32_t hsum8_epi32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
  return _mm_cvtsi128_si32(s);
}

// quantize_group_digits_avx512 on 8 lanes, for AVX2 CPUs: the same operations, so the same bits.
template <typename T>
__attribute__((target("avx2"))) void quantize_group_digits_avx2(const T* xg, int64_t digits, const GroupOut& o) {
  __m256 x[4];
  for (int j = 0; j < 4; ++j) x[j] = load8_ps(xg + 8 * j);
  const __m256 sign = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  for (int64_t k = 0; k < digits; ++k) {
    int8_t* ak = o.a + k * o.stride_a;
    __m256 m = _mm256_max_ps(_mm256_max_ps(_mm256_and_ps(x[0], sign), _mm256_and_ps(x[1], sign)),
                             _mm256_max_ps(_mm256_and_ps(x[2], sign), _mm256_and_ps(x[3], sign)));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    const float s = k ? o.sx[(k - 1) * o.stride_s] / DIGIT_RADIX : _mm_cvtss_f32(m4) / 127.f;
    o.sx[k * o.stride_s] = s;
    int32_t total = 0;
    __m256i packed = _mm256_setzero_si256();  // the 32 digits, in order
    if (s > 0.f) {
      const __m256 vs = _mm256_set1_ps(s);
      __m256i q[4];
      for (int j = 0; j < 4; ++j) q[j] = _mm256_cvtps_epi32(_mm256_div_ps(x[j], vs));
      // Saturating packs interleave the 128-bit lanes; the permutation puts the bytes back in order.
      const __m256i p01 = _mm256_packs_epi32(q[0], q[1]), p23 = _mm256_packs_epi32(q[2], q[3]);
      packed = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(p01, p23), _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
      total = hsum8_epi32(_mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3])));
    }
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(ak), packed);
    const __m128i lo16 = _mm256_castsi256_si128(packed), hi16 = _mm256_extracti128_si256(packed, 1);
    o.sums(k, total, o.half ? hsum8_epi32(_mm256_add_epi32(_mm256_cvtepi8_epi32(lo16),
                                                           _mm256_cvtepi8_epi32(_mm_srli_si128(lo16, 8))))
                            : 0);
    if (k + 1 < digits) {
      const __m256 vs = _mm256_set1_ps(s);
      const __m128i parts[4] = {lo16, _mm_srli_si128(lo16, 8), hi16, _mm_srli_si128(hi16, 8)};
      for (int j = 0; j < 4; ++j)
        x[j] = _mm256_sub_ps(x[j], _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(parts[j])), vs));
    }
  }
}
#endif

// Scratch memory for one Quantized, taken from its thread's pool and given back when it ends. A
// decode step quantizes 121 activations, and allocating their buffers anew each time (two of them
// past the C library's small-chunk cache) showed in the step's profile. Each thread keeps one block per
// nesting depth (dot8_lora holds two Quantized at once), grown to the largest asked and reused;
// a Quantized lives on the thread that made it, within one call, so the depths unwind in order.
// Only where the rows are kept changes, never what is computed.
class Scratch {
  struct Block {
    std::unique_ptr<char[]> bytes;
    size_t size = 0;
  };
  struct Pool {
    std::vector<Block> blocks;  // one per nesting depth
    size_t depth = 0;
  };
  static Pool& pool() {
    thread_local Pool p;
    return p;
  }
  char* base_;
  size_t size_, used_ = 0;

 public:
  static constexpr size_t ALIGN = 64;
  static size_t rounded(size_t bytes) { return (bytes + ALIGN - 1) / ALIGN * ALIGN; }
  explicit Scratch(size_t bytes) : size_(bytes) {
    Pool& p = pool();
    const size_t d = p.depth++;
    if (p.blocks.size() <= d) p.blocks.emplace_back();
    Block& b = p.blocks[d];
    if (b.size < bytes + ALIGN) {
      b.bytes.reset(new char[bytes + ALIGN]);
      b.size = bytes + ALIGN;
    }
    base_ = reinterpret_cast<char*>(rounded(reinterpret_cast<uintptr_t>(b.bytes.get())));
  }
  ~Scratch() { --pool().depth; }
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
  // The next n elements of type T (n may be 0), 64-byte aligned.
  template <typename T>
  T* take(size_t n) {
    T* out = reinterpret_cast<T*>(base_ + used_);
    used_ += rounded(n * sizeof(T));
    TORCH_CHECK(used_ <= size_, "dot8: a Quantized took more scratch than it sized");
    return out;
  }
};

// x's rows quantized to int8 groups of 32, with what every tile function reads. Row r's digit k is
// quantized row r * digits + k: a row's digits sit side by side (the tile functions fuse them), and
// every quantized row is
// computed alone, so nothing depends on how many rows came together or which thread quantized it.
// The buffers, from the thread's Scratch, are left uninitialized: every entry read is written.
struct Quantized {
  int64_t K, G, digits;
  Scratch scratch;
  int8_t* a;
  float *sx, *fsum;
  int32_t *sum, *sum128, *half = nullptr, *half128 = nullptr;
  int8_t* a64 = nullptr;  // with ``interleave``: (M, G, 64), row r's group g as [a0 | a1]
  int8_t* blk = nullptr;  // ``blocked`` (int4 weights), two digits on AVX-512 without ``interleave``: Acts::blk

  // Whether the optional interleaved (a64) and blocked (blk) copies are made.
  static bool wants_a64(bool interleave, int64_t digits) { return interleave && digits == 2; }
  static bool wants_blk(bool blocked, bool interleave, int64_t digits, Quantizer how) {
    return blocked && !interleave && digits == 2 && how == Quantizer::AVX512;
  }

  // The bytes a Quantized of these arguments takes from its Scratch (``take`` checks it).
  static size_t bytes(int64_t M, int64_t K, int64_t digits, bool halves, bool a64, bool blk) {
    const size_t rows = size_t(M * digits), n = rows * size_t(K / GROUP);
    size_t total = Scratch::rounded(rows * size_t(K)) + 2 * Scratch::rounded(n * sizeof(float)) +
                   2 * Scratch::rounded(n * sizeof(int32_t));
    if (halves) total += 2 * Scratch::rounded(2 * n * sizeof(int32_t));
    if (a64) total += Scratch::rounded(size_t(M) * size_t(K / GROUP) * 64);
    if (blk) total += Scratch::rounded(size_t(M) * size_t(K / GROUP) * 64);
    return total;
  }

  // M rows of x, each as ``digits`` quantized rows (quantize_digits). ``halves``: also the sums
  // of each group's two halves (read for weights stored with an offset and multipliers per half).
  // ``interleave`` (two digits): also each group's two digits side by side, the A tile rows of
  // AMX's folded int4 path (dot8_amx.h).
  template <typename T>
  Quantized(const T* x, int64_t M, int64_t K_, Quantizer how, int64_t digits_ = 1, bool halves = false,
            bool interleave = false, bool blocked = false)
      : K(K_), G(K_ / GROUP), digits(digits_),
        scratch(bytes(M, K_, digits_, halves, wants_a64(interleave, digits_),
                      wants_blk(blocked, interleave, digits_, how))) {
    const int64_t rows = M * digits, n = rows * G;
    a = scratch.take<int8_t>(rows * K);
    sx = scratch.take<float>(n);
    fsum = scratch.take<float>(n);
    sum = scratch.take<int32_t>(n);
    sum128 = scratch.take<int32_t>(n);
    if (halves) {
      half = scratch.take<int32_t>(2 * n);
      half128 = scratch.take<int32_t>(2 * n);
    }
    if (wants_a64(interleave, digits)) a64 = scratch.take<int8_t>(M * G * 64);
    if (wants_blk(blocked, interleave, digits, how)) blk = scratch.take<int8_t>(M * G * 64);
    void (*group)(const T*, int64_t, const GroupOut&) = quantize_group_digits_scalar<T>;
#ifdef DOT8_X86
    if (how == Quantizer::AVX512) group = quantize_group_digits_avx512<T>;
    if (how == Quantizer::AVX2) group = quantize_group_digits_avx2<T>;
#else
    (void)how;
#endif
    // Groups are independent: a large activation is split between the threads.
    const int64_t grain = M * G * digits * GROUP < (int64_t(1) << 14) ? M * G : 64;
    at::parallel_for(0, M * G, grain, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const int64_t r = i / G, g = i % G, q = r * digits * G + g;  // digit 0's index among the scales
        const GroupOut o{a + r * digits * K + g * GROUP, sx + q, fsum + q, sum + q,
                         sum128 + q, halves ? half + 2 * q : nullptr,
                         halves ? half128 + 2 * q : nullptr, K, G};
        group(x + r * K + g * GROUP, digits, o);
        if (a64)
          for (int64_t k = 0; k < 2; ++k) std::memcpy(a64 + i * 64 + k * GROUP, o.a + k * K, GROUP);
        if (blk) {  // token r in its block of MAX_ROWS: [g][token][a0 | a1]
          const int64_t b0 = r / MAX_ROWS * MAX_ROWS, tokens = std::min<int64_t>(MAX_ROWS, M - b0);
          int8_t* at = blk + (b0 * G + g * tokens + (r - b0)) * 64;
          for (int64_t k = 0; k < 2; ++k) std::memcpy(at + k * GROUP, o.a + k * K, GROUP);
        }
      }
    });
  }
  Acts acts() const {
    return Acts{a, sx, sum, fsum, sum128, K, G,
                half128, half, digits == 2, a64, blk};
  }
};
