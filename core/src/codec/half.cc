#include "kvq/core/half.h"

#include <immintrin.h>

#include <cstring>

namespace kvq::core {

uint16_t FloatToBF16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);  // NaN
  u += 0x7fffu + ((u >> 16) & 1);  // round to nearest even
  return static_cast<uint16_t>(u >> 16);
}

__attribute__((target("f16c,avx"))) static void HalfToFloatF16C(const uint16_t* in, float* out,
                                                                size_t n) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(out + i,
                     _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(in + i))));
  for (; i < n; ++i) out[i] = HalfToFloat(in[i]);
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

}  // namespace kvq::core
