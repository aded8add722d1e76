// AVX2 + FMA + F16C kernel table (8 lanes), for CPUs without AVX-512.
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#define XXH_INLINE_ALL
#include <xxhash.h>

#include "common.h"
#include "kvq/kernels/kernels.h"

namespace kvq::kernels {
namespace {

struct Isa {
  static constexpr int W = 8;
  static constexpr const char* kName = "avx2";
  using F = __m256;
  using I = __m256i;
  static constexpr bool kPairDot = false;  // internal::*PairDot2 may be called
  static bool ScoreSide4x8(const uint8_t*, int, const uint16_t*, const uint16_t*, const float*, int,
                           float, bool, float*, int64_t) {
    return false;  // the generic loops
  }
  struct Words {
    __m256i lo, hi;
  };

  static F Zero() { return _mm256_setzero_ps(); }
  static F Set1(float v) { return _mm256_set1_ps(v); }
  static F Load(const float* p) { return _mm256_loadu_ps(p); }
  static void Store(float* p, F v) { _mm256_storeu_ps(p, v); }
  static F Add(F a, F b) { return _mm256_add_ps(a, b); }
  static F Sub(F a, F b) { return _mm256_sub_ps(a, b); }
  static F Mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F Fmadd(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F Min(F a, F b) { return _mm256_min_ps(a, b); }
  static F Max(F a, F b) { return _mm256_max_ps(a, b); }
  static __m128 Half4(F v, __m128 (*op)(__m128, __m128)) {
    __m128 a = op(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    a = op(a, _mm_movehl_ps(a, a));
    return op(a, _mm_shuffle_ps(a, a, 1));
  }
  static float ReduceAdd(F v) {
    return _mm_cvtss_f32(Half4(v, [](__m128 a, __m128 b) { return _mm_add_ps(a, b); }));
  }
  static float ReduceMin(F v) {
    return _mm_cvtss_f32(Half4(v, [](__m128 a, __m128 b) { return _mm_min_ps(a, b); }));
  }
  static float ReduceMax(F v) {
    return _mm_cvtss_f32(Half4(v, [](__m128 a, __m128 b) { return _mm_max_ps(a, b); }));
  }
  // out[j] = the sum of v[j]'s lanes, j < 4 (horizontal adds shared by the four).
  static void ReduceAdd4(const F* v, float* out) {
    const F h = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
    _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
  }
  // Lane t of the result = the min (max) of v[t]'s lanes.
  static F TransposeMin(const F* v) {
    alignas(32) float r[W];
    for (int t = 0; t < W; ++t) r[t] = ReduceMin(v[t]);
    return _mm256_load_ps(r);
  }
  static F TransposeMax(const F* v) {
    alignas(32) float r[W];
    for (int t = 0; t < W; ++t) r[t] = ReduceMax(v[t]);
    return _mm256_load_ps(r);
  }
  static F TransposeAdd(const F* v) {
    alignas(32) float r[W];
    for (int t = 0; t < W; ++t) r[t] = ReduceAdd(v[t]);
    return _mm256_load_ps(r);
  }
  static F CvtI(I v) { return _mm256_cvtepi32_ps(v); }
  // slot[t][k] (8 fp16 per token) for t < 8 and k < kinds: out[k * stride + t] as floats.
  static void SlotsToFloats(const uint16_t (*slot)[8], int kinds, float* out, int64_t stride) {
    for (int k = 0; k < kinds; ++k) {
      alignas(16) uint16_t h[8];
      for (int t = 0; t < 8; ++t) h[t] = slot[t][k];
      _mm256_storeu_ps(out + k * stride,
                       _mm256_cvtph_ps(_mm_load_si128(reinterpret_cast<const __m128i*>(h))));
    }
  }
  static F LoadHalf(const uint16_t* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }

  // v[i] lane j -> v[j] lane i (8 x 8).
  static void TransposeSquare(F* v) {
    F t[8], u[8];
    for (int k = 0; k < 4; ++k) {
      t[2 * k] = _mm256_unpacklo_ps(v[2 * k], v[2 * k + 1]);
      t[2 * k + 1] = _mm256_unpackhi_ps(v[2 * k], v[2 * k + 1]);
    }
    for (int k = 0; k < 2; ++k) {
      u[4 * k] = _mm256_shuffle_ps(t[4 * k], t[4 * k + 2], _MM_SHUFFLE(1, 0, 1, 0));
      u[4 * k + 1] = _mm256_shuffle_ps(t[4 * k], t[4 * k + 2], _MM_SHUFFLE(3, 2, 3, 2));
      u[4 * k + 2] = _mm256_shuffle_ps(t[4 * k + 1], t[4 * k + 3], _MM_SHUFFLE(1, 0, 1, 0));
      u[4 * k + 3] = _mm256_shuffle_ps(t[4 * k + 1], t[4 * k + 3], _MM_SHUFFLE(3, 2, 3, 2));
    }
    for (int j = 0; j < 4; ++j) {
      v[j] = _mm256_permute2f128_ps(u[j], u[4 + j], 0x20);
      v[4 + j] = _mm256_permute2f128_ps(u[j], u[4 + j], 0x31);
    }
  }

  template <int B>
  static F DecodeCodes(const uint8_t* p) {
    if constexpr (B == 8) {
      return _mm256_cvtepi32_ps(
          _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
    } else {
      const auto w = static_cast<uint32_t>(internal::LoadLowBytes<B>(p));  // 8 codes of B bits
      const __m256i shifts = _mm256_setr_epi32(0, B, 2 * B, 3 * B, 4 * B, 5 * B, 6 * B, 7 * B);
      __m256i v = _mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int>(w)), shifts);
      return _mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_set1_epi32((1 << B) - 1)));
    }
  }

  // internal::MakeParams on every lane (same operations, same order, same fp16 bits).
  static void MakeParams(F lo, F hi, int bits, uint16_t* s16, uint16_t* z16, F* scale, F* zero,
                         F* inv) {
    const F levels = _mm256_set1_ps(static_cast<float>((1 << bits) - 1));
    const __m128i zh = _mm256_cvtps_ph(lo, _MM_FROUND_TO_NEAREST_INT);
    const F z = _mm256_cvtph_ps(zh);
    __m128i sh =
        _mm256_cvtps_ph(_mm256_div_ps(_mm256_sub_ps(hi, z), levels), _MM_FROUND_TO_NEAREST_INT);
    F s = _mm256_cvtph_ps(sh);
    const F bump =
        _mm256_and_ps(_mm256_cmp_ps(s, _mm256_setzero_ps(), _CMP_GT_OQ),
                      _mm256_cmp_ps(_mm256_add_ps(z, _mm256_mul_ps(s, levels)), hi, _CMP_LT_OQ));
    // bump lanes are all ones (-1 as int16 after packing): subtracting adds one ulp
    const __m256i bi = _mm256_castps_si256(bump);
    const __m128i b16 =
        _mm_packs_epi32(_mm256_castsi256_si128(bi), _mm256_extracti128_si256(bi, 1));
    sh = _mm_sub_epi16(sh, b16);
    s = _mm256_cvtph_ps(sh);
    const F ok = _mm256_and_ps(_mm256_cmp_ps(s, _mm256_setzero_ps(), _CMP_GT_OQ),
                               _mm256_cmp_ps(s, _mm256_set1_ps(INFINITY), _CMP_LT_OQ));
    const __m256i oi = _mm256_castps_si256(ok);
    sh = _mm_and_si128(
        sh, _mm_packs_epi32(_mm256_castsi256_si128(oi), _mm256_extracti128_si256(oi, 1)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(s16), sh);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(z16), zh);
    *scale = _mm256_and_ps(ok, s);
    *zero = z;
    *inv = _mm256_and_ps(ok, _mm256_div_ps(_mm256_set1_ps(1.0f), s));
  }

  static bool QuantizeChannels4x8(const float*, int64_t, int, int, uint16_t*, uint16_t*, uint8_t*) {
    return false;
  }

  static I QuantizeLanes(F x, F zero, F inv, int maxq) {
    I q = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_sub_ps(x, zero), inv));
    return _mm256_min_epi32(_mm256_max_epi32(q, _mm256_setzero_si256()), _mm256_set1_epi32(maxq));
  }

  // Each lane's code shifted right by k bits (the part of a code that crosses into the next
  // 64-bit word).
  static I ShiftRight(I q, int k) { return _mm256_srl_epi32(q, _mm_cvtsi32_si128(k)); }
  static void ClearWords(Words* w) { w->lo = w->hi = _mm256_setzero_si256(); }
  static void OrIntoWords(Words* w, I q, int shift) {
    const __m128i s = _mm_cvtsi32_si128(shift);
    w->lo = _mm256_or_si256(w->lo,
                            _mm256_sll_epi64(_mm256_cvtepu32_epi64(_mm256_castsi256_si128(q)), s));
    w->hi = _mm256_or_si256(
        w->hi, _mm256_sll_epi64(_mm256_cvtepu32_epi64(_mm256_extracti128_si256(q, 1)), s));
  }
  static void StoreWords(const Words* w, uint64_t* out) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), w->lo);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 4), w->hi);
  }

  // Packs 8 codes into `bits` bytes at dst (bits != 3).
  static void PackRow(I q, int bits, uint8_t* dst) {
    alignas(32) int32_t c[8];
    _mm256_store_si256(reinterpret_cast<__m256i*>(c), q);
    if (bits == 8) {
      for (int j = 0; j < 8; ++j) dst[j] = static_cast<uint8_t>(c[j]);
      return;
    }
    uint32_t w = 0;
    for (int j = 0; j < 8; ++j) w |= static_cast<uint32_t>(c[j]) << (j * bits);
    switch (bits) {  // constant sizes: no library call
      case 1:
        dst[0] = static_cast<uint8_t>(w);
        break;
      case 2: {
        const uint16_t h = static_cast<uint16_t>(w);
        std::memcpy(dst, &h, 2);
        break;
      }
      default:
        std::memcpy(dst, &w, 4);
        break;
    }
  }

  static constexpr bool kPack64x2 = false;
  static void Pack64x2(const I*, uint8_t*) {}

  static F Exp(F x) {
    const F underflow = _mm256_cmp_ps(x, _mm256_set1_ps(-87.0f), _CMP_LT_OQ);
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
    F fx = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                           _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    F r = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), r);
    F p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    F y = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    __m256i e =
        _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127)), 23);
    y = _mm256_mul_ps(y, _mm256_castsi256_ps(e));
    return _mm256_andnot_ps(underflow, y);
  }
};

#include "simd_impl.h"

bool CpuHasAvx2() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && KVQ_CPU_HAS_F16C();
}

}  // namespace

const KernelTable* Avx2() {
  static const bool ok = CpuHasAvx2();
  return ok ? &kTable : nullptr;
}

}  // namespace kvq::kernels
