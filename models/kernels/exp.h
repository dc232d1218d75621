// exp(x) for x <= 0 as one fixed polynomial, shared by the project's kernels (attend.cpp,
// pointwise.cpp): the scalar, AVX-512 and AVX2 forms make the same IEEE operations in the same
// order, so they agree bit for bit. Included inside each file's anonymous namespace.
#pragma once

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


#if defined(__x86_64__)
// exp_scalar's steps on 16 lanes (x <= 0).
__attribute__((target("avx512f"))) inline __m512 exp512(__m512 v) {
  v = _mm512_max_ps(v, _mm512_set1_ps(-87.0f));
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
  return _mm512_mul_ps(y, _mm512_castsi512_ps(e));
}

__attribute__((target("avx512f")))
inline void exp_avx512(float* x, int64_t n) {  // in place, x <= 0
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = n - i >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (n - i)) - 1);
    _mm512_mask_storeu_ps(x + i, m, exp512(_mm512_maskz_loadu_ps(m, x + i)));
  }
}

#endif

#if defined(__x86_64__)
// exp_scalar's steps on 8 lanes (x <= 0).
__attribute__((target("avx2,fma"))) inline __m256 exp256(__m256 v) {
  v = _mm256_max_ps(v, _mm256_set1_ps(-87.0f));
  const __m256 k = _mm256_round_ps(_mm256_mul_ps(v, _mm256_set1_ps(LOG2E)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fmadd_ps(_mm256_sub_ps(_mm256_setzero_ps(), k), _mm256_set1_ps(LN2_HI), v);
  r = _mm256_fmadd_ps(_mm256_sub_ps(_mm256_setzero_ps(), k), _mm256_set1_ps(LN2_LO), r);
  __m256 p = _mm256_set1_ps(P0);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(P1));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(P2));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(P3));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(P4));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(P5));
  __m256 y = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r);
  y = _mm256_add_ps(y, _mm256_set1_ps(1.0f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

__attribute__((target("avx2,fma")))
inline void exp_avx2(float* x, int64_t n) {  // in place, x <= 0; exp_scalar's steps
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(x + i, exp256(_mm256_loadu_ps(x + i)));
  if (i < n) {  // the last few through a zeroed buffer
    alignas(32) float buf[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    std::memcpy(buf, x + i, sizeof(float) * (n - i));
    _mm256_store_ps(buf, exp256(_mm256_load_ps(buf)));
    std::memcpy(x + i, buf, sizeof(float) * (n - i));
  }
}
#endif
