#include "kvq/core/half.h"

#include <immintrin.h>

#include <cstring>

namespace kvq::core {

__attribute__((target("f16c,avx"))) static void HalfToFloatF16C(const uint16_t* in, float* out,
                                                                size_t n) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(out + i,
                     _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(in + i))));
  for (; i < n; ++i) out[i] = HalfToFloat(in[i]);
}

static bool HasAvx2() {
  static const bool ok = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2");
  }();
  return ok;
}

// FloatToBF16's rule on 8 lanes: the same integer operations, so the same bits.
__attribute__((target("avx2"))) static void FloatToBF16Avx2(const float* in, uint16_t* out,
                                                            size_t n) {
  const __m256i one = _mm256_set1_epi32(1), bias = _mm256_set1_epi32(0x7fff),
                abs_mask = _mm256_set1_epi32(0x7fffffff), inf = _mm256_set1_epi32(0x7f800000),
                quiet = _mm256_set1_epi32(0x40);
  size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    __m256i half[2];
    for (int j = 0; j < 2; ++j) {
      const __m256i u = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(in + i + 8 * j));
      const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), one);
      const __m256i rounded =
          _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(bias, lsb)), 16);
      const __m256i nan = _mm256_or_si256(_mm256_srli_epi32(u, 16), quiet);
      // (u & 0x7fffffff) > 0x7f800000 as signed compare: both sides are non-negative.
      const __m256i is_nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, abs_mask), inf);
      half[j] =
          _mm256_and_si256(_mm256_blendv_epi8(rounded, nan, is_nan), _mm256_set1_epi32(0xffff));
    }
    // Pack the two 8-lane halves to 16 uint16 (packus works per 128-bit lane: reorder after).
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(half[0], half[1]), 0xd8);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), packed);
  }
  for (; i < n; ++i) out[i] = FloatToBF16(in[i]);
}

void FloatToBF16N(const float* in, uint16_t* out, size_t n) {
  if (HasAvx2()) return FloatToBF16Avx2(in, out, n);
  for (size_t i = 0; i < n; ++i) out[i] = FloatToBF16(in[i]);
}

static bool HasF16C() {
  static const bool ok = [] {
    __builtin_cpu_init();
#if defined(__clang__) && __clang_major__ < 15
    return __builtin_cpu_supports("avx2");  // clang 14 knows no "f16c"; AVX2 CPUs have it
#else
    return __builtin_cpu_supports("f16c") && __builtin_cpu_supports("avx");
#endif
  }();
  return ok;
}

void HalfToFloatN(const uint16_t* in, float* out, size_t n) {
  if (HasF16C()) return HalfToFloatF16C(in, out, n);
  for (size_t i = 0; i < n; ++i) out[i] = HalfToFloat(in[i]);
}

__attribute__((target("f16c,avx"))) static void FloatToHalfF16C(const float* in, uint16_t* out,
                                                                size_t n) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i),
                     _mm256_cvtps_ph(_mm256_loadu_ps(in + i), _MM_FROUND_TO_NEAREST_INT));
  for (; i < n; ++i) out[i] = FloatToHalf(in[i]);
}

void FloatToHalfN(const float* in, uint16_t* out, size_t n) {
  if (HasF16C()) return FloatToHalfF16C(in, out, n);
  for (size_t i = 0; i < n; ++i) out[i] = FloatToHalf(in[i]);
}

// 16 values per step: the check on the 16-bit inputs (masked magnitudes compared as signed
// integers: both sides are non-negative), the conversion into fp32.
template <bool kHalf>
__attribute__((target("avx2,f16c"))) static bool WidenStorableAvx2(const uint16_t* in, float* out,
                                                                   size_t n, uint16_t bound) {
  const __m256i magnitude = _mm256_set1_epi16(0x7fff),
                limit = _mm256_set1_epi16(static_cast<int16_t>(bound));
  __m256i over = _mm256_setzero_si256();
  size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(in + i));
    over = _mm256_or_si256(over, _mm256_cmpgt_epi16(_mm256_and_si256(h, magnitude), limit));
    const __m128i h0 = _mm256_castsi256_si128(h), h1 = _mm256_extracti128_si256(h, 1);
    if constexpr (kHalf) {
      _mm256_storeu_ps(out + i, _mm256_cvtph_ps(h0));
      _mm256_storeu_ps(out + i + 8, _mm256_cvtph_ps(h1));
    } else {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i),
                          _mm256_slli_epi32(_mm256_cvtepu16_epi32(h0), 16));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i + 8),
                          _mm256_slli_epi32(_mm256_cvtepu16_epi32(h1), 16));
    }
  }
  bool ok = _mm256_testz_si256(over, over);
  for (; i < n; ++i) {
    ok &= (in[i] & 0x7fff) <= bound;
    out[i] = kHalf ? HalfToFloat(in[i]) : BF16ToFloat(in[i]);
  }
  return ok;
}

bool HalfToFloatStorableN(const uint16_t* in, float* out, size_t n) {
  if (HasAvx2() && HasF16C()) return WidenStorableAvx2<true>(in, out, n, kHalfStorableBits);
  bool ok = true;
  for (size_t i = 0; i < n; ++i) {
    ok &= (in[i] & 0x7fff) <= kHalfStorableBits;
    out[i] = HalfToFloat(in[i]);
  }
  return ok;
}

bool BF16ToFloatStorableN(const uint16_t* in, float* out, size_t n) {
  if (HasAvx2()) return WidenStorableAvx2<false>(in, out, n, kBF16StorableBits);
  bool ok = true;
  for (size_t i = 0; i < n; ++i) {
    ok &= (in[i] & 0x7fff) <= kBF16StorableBits;
    out[i] = BF16ToFloat(in[i]);
  }
  return ok;
}

}  // namespace kvq::core
