// dot8's activations: each row quantized per group of 32 to int8 digits (llama.cpp's Q8
// activations, and with two digits what the first left over), the same bits on every path.
// Included inside dot8.cpp's anonymous namespace, after dot8_tiles.h.
#pragma once

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
  std::vector<int32_t> sum, sum128, half, half128;
  int64_t K, G;

  // M rows of x, each as ``digits`` quantized rows (quantize_digits). ``halves``: also the sums
  // of each group's two halves (read for weights stored with an offset and multipliers per half).
  template <typename T>
  Quantized(const T* x, int64_t M, int64_t K_, bool simd, int64_t digits = 1, bool halves = false)
      : a(M * digits * K_), sx(M * digits * (K_ / GROUP)), fsum(M * digits * (K_ / GROUP)),
        sum(M * digits * (K_ / GROUP)), sum128(M * digits * (K_ / GROUP)), K(K_), G(K_ / GROUP) {
    quantize_rows(x, M, K, digits, a.data(), sx.data(), sum.data(), simd);
    for (int64_t i = 0; i < M * digits * G; ++i) {
      fsum[i] = float(sum[i]);
      sum128[i] = 128 * sum[i];
    }
    if (halves) {
      half.resize(2 * M * digits * G);
      half128.resize(2 * M * digits * G);
      for (int64_t i = 0; i < M * digits * G; ++i) {
        int32_t first = 0;
        for (int k = 0; k < GROUP / 2; ++k) first += a[i * GROUP + k];
        half[2 * i] = first;
        half[2 * i + 1] = sum[i] - first;
        half128[2 * i] = 128 * first;
        half128[2 * i + 1] = 128 * (sum[i] - first);
      }
    }
  }
  Acts acts() const {
    return Acts{a.data(), sx.data(), sum.data(), fsum.data(), sum128.data(), K, G, half128.data(), half.data()};
  }
};
