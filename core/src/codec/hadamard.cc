#include "core/src/codec/hadamard.h"

#include <immintrin.h>

#include <cmath>

namespace kvq::core::hadamard {
namespace {

bool HasAvx2() {
  static const bool has = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2");
  }();
  return has;
}
bool HasAvx512() {
  static const bool has = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f");
  }();
  return has;
}

// Scalar on 8 lanes (d a multiple of 8): every element takes the same additions and
// subtractions in the same order (a + b where the loop adds, a - b where it subtracts; IEEE
// addition commutes exactly), so the bits are Scalar's. Strides 1, 2 and 4 pair lanes of
// one vector: its partner lanes (a permutation) added or subtracted, the halves blended.
__attribute__((target("avx2"))) void RotateAvx2(float* x, int d) {
  for (int i = 0; i < d; i += 8) {
    __m256 v = _mm256_loadu_ps(x + i), s;
    s = _mm256_permute_ps(v, 0xb1);  // stride 1: lanes 2k and 2k+1 swapped
    v = _mm256_blend_ps(_mm256_add_ps(v, s), _mm256_sub_ps(s, v), 0xaa);
    s = _mm256_permute_ps(v, 0x4e);  // stride 2
    v = _mm256_blend_ps(_mm256_add_ps(v, s), _mm256_sub_ps(s, v), 0xcc);
    s = _mm256_permute2f128_ps(v, v, 0x01);  // stride 4: the 128-bit halves swapped
    v = _mm256_blend_ps(_mm256_add_ps(v, s), _mm256_sub_ps(s, v), 0xf0);
    _mm256_storeu_ps(x + i, v);
  }
  for (int h = 8; h < d; h *= 2)
    for (int i = 0; i < d; i += 2 * h)
      for (int j = i; j < i + h; j += 8) {
        const __m256 a = _mm256_loadu_ps(x + j), b = _mm256_loadu_ps(x + j + h);
        _mm256_storeu_ps(x + j, _mm256_add_ps(a, b));
        _mm256_storeu_ps(x + j + h, _mm256_sub_ps(a, b));
      }
  const __m256 norm = _mm256_set1_ps(1.0f / std::sqrt(static_cast<float>(d)));
  for (int i = 0; i < d; i += 8)
    _mm256_storeu_ps(x + i, _mm256_mul_ps(_mm256_loadu_ps(x + i), norm));
}

// The same on 16 lanes with the whole row in registers (d a multiple of 16, at most
// kMaxVectors vectors): strides 1 to 8 inside each vector (the partner lanes' sum or, in the
// upper lanes, difference: one masked subtraction), the larger strides between vectors.
constexpr int kMaxVectors = 16;
__attribute__((target("avx512f"))) void RotateAvx512(float* x, int d) {
  const int n = d / 16;
  __m512 v[kMaxVectors];
  for (int i = 0; i < n; ++i) {
    __m512 a = _mm512_loadu_ps(x + 16 * i), s;
    s = _mm512_permute_ps(a, 0xb1);  // stride 1
    a = _mm512_mask_sub_ps(_mm512_add_ps(a, s), 0xaaaa, s, a);
    s = _mm512_permute_ps(a, 0x4e);  // stride 2
    a = _mm512_mask_sub_ps(_mm512_add_ps(a, s), 0xcccc, s, a);
    s = _mm512_shuffle_f32x4(a, a, _MM_SHUFFLE(2, 3, 0, 1));  // stride 4: 128-bit quarters
    a = _mm512_mask_sub_ps(_mm512_add_ps(a, s), 0xf0f0, s, a);
    s = _mm512_shuffle_f32x4(a, a, _MM_SHUFFLE(1, 0, 3, 2));  // stride 8: 256-bit halves
    v[i] = _mm512_mask_sub_ps(_mm512_add_ps(a, s), 0xff00, s, a);
  }
  for (int h = 1; h < n; h *= 2)
    for (int i = 0; i < n; i += 2 * h)
      for (int j = i; j < i + h; ++j) {
        const __m512 a = v[j], b = v[j + h];
        v[j] = _mm512_add_ps(a, b);
        v[j + h] = _mm512_sub_ps(a, b);
      }
  const __m512 norm = _mm512_set1_ps(1.0f / std::sqrt(static_cast<float>(d)));
  for (int i = 0; i < n; ++i) _mm512_storeu_ps(x + 16 * i, _mm512_mul_ps(v[i], norm));
}

}  // namespace

void Scalar(float* x, int d) {
  for (int h = 1; h < d; h *= 2)
    for (int i = 0; i < d; i += 2 * h)
      for (int j = i; j < i + h; ++j) {
        const float a = x[j], b = x[j + h];
        x[j] = a + b;
        x[j + h] = a - b;
      }
  const float norm = 1.0f / std::sqrt(static_cast<float>(d));
  for (int i = 0; i < d; ++i) x[i] *= norm;
}

bool Avx2(float* x, int d) {
  if (!HasAvx2() || d % 8 != 0) return false;
  RotateAvx2(x, d);
  return true;
}

bool Avx512(float* x, int d) {
  if (!HasAvx512() || d % 16 != 0 || d / 16 > kMaxVectors) return false;
  RotateAvx512(x, d);
  return true;
}

void RotateColumns(float* x, int d, int64_t n) {
  for (int h = 1; h < d; h *= 2)
    for (int i = 0; i < d; i += 2 * h)
      for (int j = i; j < i + h; ++j) {
        float* a = x + j * n;
        float* b = x + (j + h) * n;
        for (int64_t t = 0; t < n; ++t) {  // one butterfly for every row at once
          const float u = a[t], w = b[t];
          a[t] = u + w;
          b[t] = u - w;
        }
      }
  const float norm = 1.0f / std::sqrt(static_cast<float>(d));
  for (int64_t i = 0; i < static_cast<int64_t>(d) * n; ++i) x[i] *= norm;
}

void Rotate(float* x, int d) {
  if (!Avx512(x, d) && !Avx2(x, d)) Scalar(x, d);
}

}  // namespace kvq::core::hadamard
