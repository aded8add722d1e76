// Horizontal reductions of four AVX-512 vectors at once, shared by the AVX-512 translation
// units (internal; include only where AVX-512F is enabled).
#pragma once

#include <immintrin.h>

// Internal linkage: avx512.cc and avx512_vnni.cc are compiled with different -m flags, so
// each keeps its own copy (no out-of-line copy built for one ISA called from the other).
namespace kvq::kernels::internal {
namespace {

// out[j] = op over v[j]'s 16 lanes, j < 4: the first two levels of a transposing tree on the
// four vectors, then one in-lane tree (10 operations instead of four separate reductions).
template <typename Op>
inline void Reduce4(const __m512* v, float* out, Op op) {
  const __m512 a =
      op(_mm512_shuffle_f32x4(v[0], v[1], 0x44), _mm512_shuffle_f32x4(v[0], v[1], 0xEE));
  const __m512 b =
      op(_mm512_shuffle_f32x4(v[2], v[3], 0x44), _mm512_shuffle_f32x4(v[2], v[3], 0xEE));
  __m512 c = op(_mm512_shuffle_f32x4(a, b, 0x88), _mm512_shuffle_f32x4(a, b, 0xDD));
  c = op(c, _mm512_shuffle_ps(c, c, _MM_SHUFFLE(1, 0, 3, 2)));
  c = op(c, _mm512_shuffle_ps(c, c, _MM_SHUFFLE(2, 3, 0, 1)));
  const __m512i lanes = _mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0);
  _mm_storeu_ps(out, _mm512_castps512_ps128(_mm512_permutexvar_ps(lanes, c)));
}

inline void ReduceAdd4(const __m512* v, float* out) {
  Reduce4(v, out, [](__m512 x, __m512 y) { return _mm512_add_ps(x, y); });
}
// The max of non-negative floats as unsigned integers: the same order, and a NaN (above
// infinity as bits) is kept rather than dropped as vmaxps may drop it.
inline __m512 MaxBits(__m512 x, __m512 y) {
  return _mm512_castsi512_ps(_mm512_max_epu32(_mm512_castps_si512(x), _mm512_castps_si512(y)));
}
inline void ReduceMaxBits4(const __m512* v, float* out) { Reduce4(v, out, MaxBits); }

}  // namespace
}  // namespace kvq::kernels::internal
