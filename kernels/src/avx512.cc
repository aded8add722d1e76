// AVX-512 kernel table (16 lanes). Compiled with -mavx512f/bw/vl/dq; used only when the CPU
// reports those features at run time.
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

// libxxhash's AVX2 path measured ~2x faster than its AVX-512 path on ~1 KiB blocks here
// (Zen 4 splits 512-bit operations), so this table inlines the AVX2 one.
#define XXH_INLINE_ALL
#define XXH_VECTOR XXH_AVX2
#include <xxhash.h>

#include "avx512_reduce.h"
#include "common.h"
#include "kvq/kernels/kernels.h"

namespace kvq::kernels {
namespace {

struct Isa {
  static constexpr int W = 16;
  static constexpr const char* kName = "avx512";
  using F = __m512;
  using I = __m512i;
  static constexpr bool kPairDot = true;  // internal::*PairDot2 may be called
  struct Words {
    __m512i lo, hi;
  };

  static F Zero() { return _mm512_setzero_ps(); }
  static F Set1(float v) { return _mm512_set1_ps(v); }
  static F Load(const float* p) { return _mm512_loadu_ps(p); }
  static void Store(float* p, F v) { _mm512_storeu_ps(p, v); }
  static F Add(F a, F b) { return _mm512_add_ps(a, b); }
  static F Sub(F a, F b) { return _mm512_sub_ps(a, b); }
  static F Mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F Fmadd(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F Min(F a, F b) { return _mm512_min_ps(a, b); }
  static F Max(F a, F b) { return _mm512_max_ps(a, b); }
  static float ReduceAdd(F v) { return _mm512_reduce_add_ps(v); }
  static float ReduceMin(F v) { return _mm512_reduce_min_ps(v); }
  static float ReduceMax(F v) { return _mm512_reduce_max_ps(v); }
  // Lane t of the result = the min (max, sum) of v[t]'s lanes: a transposing tree of 15
  // operations per level pair instead of a horizontal reduction per vector.
  template <typename Op>
  static F TransposeReduce(const F* v, Op op) {
    F s1[8], s2[4], s3[2];
    for (int k = 0; k < 8; ++k)
      s1[k] = op(_mm512_shuffle_f32x4(v[2 * k], v[2 * k + 1], 0x44),
                 _mm512_shuffle_f32x4(v[2 * k], v[2 * k + 1], 0xEE));
    for (int k = 0; k < 4; ++k)
      s2[k] = op(_mm512_shuffle_f32x4(s1[2 * k], s1[2 * k + 1], 0x88),
                 _mm512_shuffle_f32x4(s1[2 * k], s1[2 * k + 1], 0xDD));
    for (int k = 0; k < 2; ++k)
      s3[k] = op(_mm512_shuffle_ps(s2[2 * k], s2[2 * k + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                 _mm512_shuffle_ps(s2[2 * k], s2[2 * k + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    const F r = op(_mm512_shuffle_ps(s3[0], s3[1], _MM_SHUFFLE(2, 0, 2, 0)),
                   _mm512_shuffle_ps(s3[0], s3[1], _MM_SHUFFLE(3, 1, 3, 1)));
    // lane 4L + j holds row L + 4j
    return _mm512_permutexvar_ps(
        _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), r);
  }
  static void ReduceAdd4(const F* v, float* out) { internal::ReduceAdd4(v, out); }
  static F TransposeMin(const F* v) {
    return TransposeReduce(v, [](F a, F b) { return _mm512_min_ps(a, b); });
  }
  static F TransposeMax(const F* v) {
    return TransposeReduce(v, [](F a, F b) { return _mm512_max_ps(a, b); });
  }
  static F TransposeAdd(const F* v) {
    return TransposeReduce(v, [](F a, F b) { return _mm512_add_ps(a, b); });
  }
  static F CvtI(I v) { return _mm512_cvtepi32_ps(v); }
  // v[i] lane j -> v[j] lane i (16 x 16): 32 unpacks/shuffles within 128-bit lanes, then 32
  // 128-bit lane shuffles.
  static void TransposeSquare(F* v) {
    F t[16];
    for (int k = 0; k < 8; ++k) {
      t[2 * k] = _mm512_unpacklo_ps(v[2 * k], v[2 * k + 1]);
      t[2 * k + 1] = _mm512_unpackhi_ps(v[2 * k], v[2 * k + 1]);
    }
    for (int k = 0; k < 4; ++k) {
      v[4 * k] = _mm512_shuffle_ps(t[4 * k], t[4 * k + 2], _MM_SHUFFLE(1, 0, 1, 0));
      v[4 * k + 1] = _mm512_shuffle_ps(t[4 * k], t[4 * k + 2], _MM_SHUFFLE(3, 2, 3, 2));
      v[4 * k + 2] = _mm512_shuffle_ps(t[4 * k + 1], t[4 * k + 3], _MM_SHUFFLE(1, 0, 1, 0));
      v[4 * k + 3] = _mm512_shuffle_ps(t[4 * k + 1], t[4 * k + 3], _MM_SHUFFLE(3, 2, 3, 2));
    }
    for (int k = 0; k < 2; ++k)
      for (int j = 0; j < 4; ++j) {
        t[8 * k + j] = _mm512_shuffle_f32x4(v[8 * k + j], v[8 * k + 4 + j], 0x88);
        t[8 * k + 4 + j] = _mm512_shuffle_f32x4(v[8 * k + j], v[8 * k + 4 + j], 0xdd);
      }
    for (int j = 0; j < 8; ++j) {
      v[j] = _mm512_shuffle_f32x4(t[j], t[8 + j], 0x88);
      v[8 + j] = _mm512_shuffle_f32x4(t[j], t[8 + j], 0xdd);
    }
  }
  // slot[t][k] (8 fp16 per token) for t < 16 and k < kinds: out[k * stride + t] as floats.
  // Two permutes over 8 slots each and a blend per k (tokens 0-7 from the first pair of
  // vectors, 8-15 from the second).
  static void SlotsToFloats(const uint16_t (*slot)[8], int kinds, float* out, int64_t stride) {
    const __m512i a = _mm512_loadu_si512(slot[0]), b = _mm512_loadu_si512(slot[4]);
    const __m512i c = _mm512_loadu_si512(slot[8]), d = _mm512_loadu_si512(slot[12]);
    const __m512i step = _mm512_set_epi16(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 56, 48,
                                          40, 32, 24, 16, 8, 0, 56, 48, 40, 32, 24, 16, 8, 0);
    for (int k = 0; k < kinds; ++k) {
      const __m512i idx = _mm512_add_epi16(step, _mm512_set1_epi16(static_cast<int16_t>(k)));
      const __m512i lo = _mm512_permutex2var_epi16(a, idx, b);
      const __m512i hi = _mm512_permutex2var_epi16(c, idx, d);
      const __m256i h =
          _mm256_mask_blend_epi16(0xff00, _mm512_castsi512_si256(lo), _mm512_castsi512_si256(hi));
      _mm512_storeu_ps(out + k * stride, _mm512_cvtph_ps(h));
    }
  }
  static F LoadHalf(const uint16_t* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }

  template <int B>
  static F DecodeCodes(const uint8_t* p) {
    if constexpr (B == 8) {
      return _mm512_cvtepi32_ps(
          _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
    } else {
      const uint64_t w = internal::LoadLowBytes<2 * B>(p);  // 16 codes of B bits
      __m512i v;
      __m512i shifts;
      if constexpr (B <= 2) {
        v = _mm512_set1_epi32(static_cast<uint32_t>(w));
        shifts = _mm512_mullo_epi32(
            _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
            _mm512_set1_epi32(B));
      } else {
        // Lanes 0-7 read bits [0, 32); lanes 8-15 read w >> kW1, which keeps codes 8..15
        // whole for B = 3 (bits 24..47) and B = 4 (bits 32..63).
        constexpr int kW1 = B == 3 ? 24 : 32;
        v = _mm512_mask_blend_epi32(0xff00, _mm512_set1_epi32(static_cast<uint32_t>(w)),
                                    _mm512_set1_epi32(static_cast<uint32_t>(w >> kW1)));
        shifts = _mm512_setr_epi32(0, B, 2 * B, 3 * B, 4 * B, 5 * B, 6 * B, 7 * B, 8 * B - kW1,
                                   9 * B - kW1, 10 * B - kW1, 11 * B - kW1, 12 * B - kW1,
                                   13 * B - kW1, 14 * B - kW1, 15 * B - kW1);
      }
      // vpermps reads the low 4 bits of each lane: a table periodic in 2^B turns the shifted
      // word into the code's float value in one instruction (no mask, no int->float convert).
      const __m512 lut = _mm512_setr_ps(0 % (1 << B), 1 % (1 << B), 2 % (1 << B), 3 % (1 << B),
                                        4 % (1 << B), 5 % (1 << B), 6 % (1 << B), 7 % (1 << B),
                                        8 % (1 << B), 9 % (1 << B), 10 % (1 << B), 11 % (1 << B),
                                        12 % (1 << B), 13 % (1 << B), 14 % (1 << B), 15 % (1 << B));
      return _mm512_permutexvar_ps(_mm512_srlv_epi32(v, shifts), lut);
    }
  }

  // internal::MakeParams on every lane (the same operations in the same order, so the same
  // fp16 bits): zero = fp16(lo), scale = fp16((hi - zero) / levels), bumped one ulp when
  // hi no longer fits, 0 when not positive and finite; inv = 1 / scale or 0.
  static void MakeParams(F lo, F hi, int bits, uint16_t* s16, uint16_t* z16, F* scale, F* zero,
                         F* inv) {
    const F levels = _mm512_set1_ps(static_cast<float>((1 << bits) - 1));
    const __m256i zh = _mm512_cvtps_ph(lo, _MM_FROUND_TO_NEAREST_INT);
    const F z = _mm512_cvtph_ps(zh);
    __m256i sh =
        _mm512_cvtps_ph(_mm512_div_ps(_mm512_sub_ps(hi, z), levels), _MM_FROUND_TO_NEAREST_INT);
    F s = _mm512_cvtph_ps(sh);
    const __mmask16 bump =
        _mm512_cmp_ps_mask(s, _mm512_setzero_ps(), _CMP_GT_OQ) &
        _mm512_cmp_ps_mask(_mm512_add_ps(z, _mm512_mul_ps(s, levels)), hi, _CMP_LT_OQ);
    sh = _mm256_mask_add_epi16(sh, bump, sh, _mm256_set1_epi16(1));
    s = _mm512_cvtph_ps(sh);
    const __mmask16 ok = _mm512_cmp_ps_mask(s, _mm512_setzero_ps(), _CMP_GT_OQ) &
                         _mm512_cmp_ps_mask(s, _mm512_set1_ps(INFINITY), _CMP_LT_OQ);
    sh = _mm256_maskz_mov_epi16(ok, sh);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(s16), sh);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(z16), zh);
    *scale = _mm512_maskz_mov_ps(ok, s);
    *zero = z;
    *inv = _mm512_maskz_div_ps(ok, _mm512_set1_ps(1.0f), s);
  }

  // quantize_channels for 4 channels of 8 bits (the HeadQ side code at rank 4: x [tokens][4])
  // with 4 tokens per vector (lane 4p + c); codes are transposed to channel-major rows.
  // False when the shape is another one.
  static bool QuantizeChannels4x8(const float* x, int64_t ld, int tokens, int n_ch, uint16_t* scale,
                                  uint16_t* zero, uint8_t* codes) {
    if (n_ch != 4 || ld != 4 || tokens % 4 != 0) return false;
    F lo = Load(x), hi = lo;
    for (int t = 4; t < tokens; t += 4) {
      const F v = Load(x + t * 4);
      lo = Min(lo, v);
      hi = Max(hi, v);
    }
    // every 128-bit lane ends up with the 4 channels' ranges
    lo = Min(lo, _mm512_shuffle_f32x4(lo, lo, 0x4E));
    lo = Min(lo, _mm512_shuffle_f32x4(lo, lo, 0xB1));
    hi = Max(hi, _mm512_shuffle_f32x4(hi, hi, 0x4E));
    hi = Max(hi, _mm512_shuffle_f32x4(hi, hi, 0xB1));
    alignas(64) uint16_t s16[16], z16[16];
    F sv, zv, iv;
    MakeParams(lo, hi, 8, s16, z16, &sv, &zv, &iv);
    std::memcpy(scale, s16, 8);
    std::memcpy(zero, z16, 8);
    const __m128i tr = _mm_setr_epi8(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    for (int t = 0; t < tokens; t += 4) {
      const __m128i b =
          _mm_shuffle_epi8(_mm512_cvtepi32_epi8(QuantizeLanes(Load(x + t * 4), zv, iv, 255)), tr);
      const uint32_t w[4] = {static_cast<uint32_t>(_mm_extract_epi32(b, 0)),
                             static_cast<uint32_t>(_mm_extract_epi32(b, 1)),
                             static_cast<uint32_t>(_mm_extract_epi32(b, 2)),
                             static_cast<uint32_t>(_mm_extract_epi32(b, 3))};
      for (int c = 0; c < 4; ++c) std::memcpy(codes + c * tokens + t, &w[c], 4);
    }
    return true;
  }

  // score_codes for the HeadQ side code at rank 4, 8 bits, contiguous queries (q stride 4):
  // the weights and biases of four queries in one vector (lane 4i + c), then 16 tokens per
  // vector. False when the shape is another one.
  static bool ScoreSide4x8(const uint8_t* codes, int tokens, const uint16_t* scale,
                           const uint16_t* zero, const float* q, int n_q, float mult,
                           bool accumulate, float* out, int64_t os) {
    if (tokens % 16 != 0) return false;
    const __m512 s = _mm512_broadcast_f32x4(
        _mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(scale))));
    const __m512 z = _mm512_broadcast_f32x4(
        _mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(zero))));
    for (int i0 = 0; i0 < n_q; i0 += 4) {
      const int n4 = std::min(4, n_q - i0);
      const __m512 qv =
          _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << (4 * n4)) - 1), q + 4 * i0);
      alignas(64) float w[16], b[16];
      _mm512_store_ps(w, _mm512_mul_ps(_mm512_mul_ps(qv, s), _mm512_set1_ps(mult)));
      F bz = _mm512_mul_ps(qv, z);  // lane 4i: q_i . zero after two in-lane steps
      bz = _mm512_add_ps(bz, _mm512_shuffle_ps(bz, bz, _MM_SHUFFLE(1, 0, 3, 2)));
      bz = _mm512_add_ps(bz, _mm512_shuffle_ps(bz, bz, _MM_SHUFFLE(2, 3, 0, 1)));
      _mm512_store_ps(b, _mm512_mul_ps(bz, _mm512_set1_ps(mult)));
      for (int t0 = 0; t0 < tokens; t0 += 16) {
        F v[4];
        for (int c = 0; c < 4; ++c)
          v[c] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(
              _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + c * tokens + t0))));
        for (int i = 0; i < n4; ++i) {
          float* o = out + (i0 + i) * os + t0;
          F acc = _mm512_set1_ps(b[4 * i]);
          if (accumulate) acc = _mm512_add_ps(_mm512_loadu_ps(o), acc);
          for (int c = 0; c < 4; ++c)
            acc = _mm512_fmadd_ps(_mm512_set1_ps(w[4 * i + c]), v[c], acc);
          _mm512_storeu_ps(o, acc);
        }
      }
    }
    return true;
  }

  static I QuantizeLanes(F x, F zero, F inv, int maxq) {
    I q = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_sub_ps(x, zero), inv));  // round to even
    return _mm512_min_epi32(_mm512_max_epi32(q, _mm512_setzero_si512()), _mm512_set1_epi32(maxq));
  }

  // Each lane's code shifted right by k bits (the part of a code that crosses into the next
  // 64-bit word).
  static I ShiftRight(I q, int k) { return _mm512_srl_epi32(q, _mm_cvtsi32_si128(k)); }
  static void ClearWords(Words* w) { w->lo = w->hi = _mm512_setzero_si512(); }
  static void OrIntoWords(Words* w, I q, int shift) {
    const __m128i s = _mm_cvtsi32_si128(shift);
    w->lo = _mm512_or_si512(w->lo,
                            _mm512_sll_epi64(_mm512_cvtepu32_epi64(_mm512_castsi512_si256(q)), s));
    w->hi = _mm512_or_si512(
        w->hi, _mm512_sll_epi64(_mm512_cvtepu32_epi64(_mm512_extracti64x4_epi64(q, 1)), s));
  }
  static void StoreWords(const Words* w, uint64_t* out) {
    _mm512_storeu_si512(out, w->lo);
    _mm512_storeu_si512(out + 8, w->hi);
  }

  // Packs 16 codes (one per lane, channel order) into 2*bits bytes at dst (bits != 3).
  static void PackRow(I q, int bits, uint8_t* dst) {
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    switch (bits) {
      case 8:
        _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), _mm512_cvtepi32_epi8(q));
        return;
      case 4: {
        __m512i s = _mm512_sllv_epi32(
            q, _mm512_slli_epi32(_mm512_and_si512(lane, _mm512_set1_epi32(7)), 2));
        uint32_t w[2] = {static_cast<uint32_t>(_mm512_mask_reduce_or_epi32(0x00ff, s)),
                         static_cast<uint32_t>(_mm512_mask_reduce_or_epi32(0xff00, s))};
        std::memcpy(dst, w, 8);
        return;
      }
      default: {  // 1 or 2 bits: 16 codes fit one 32-bit word (2 or 4 bytes written)
        __m512i s = _mm512_sllv_epi32(q, _mm512_mullo_epi32(lane, _mm512_set1_epi32(bits)));
        const uint32_t w = static_cast<uint32_t>(_mm512_reduce_or_epi32(s));
        if (bits == 1) {
          const uint16_t h = static_cast<uint16_t>(w);
          std::memcpy(dst, &h, 2);  // constant sizes: no library call (and no vzeroupper)
        } else {
          std::memcpy(dst, &w, 4);
        }
        return;
      }
    }
  }

  // Packs 64 2-bit codes (16 per vector, channel order) into 16 bytes: codes as bytes, then
  // pairs (a + 4b) and pairs of pairs (c + 16d) by multiply-adds.
  static constexpr bool kPack64x2 = true;
  static void Pack64x2(const I* q, uint8_t* dst) {
    __m512i b = _mm512_castsi128_si512(_mm512_cvtepi32_epi8(q[0]));
    b = _mm512_inserti32x4(b, _mm512_cvtepi32_epi8(q[1]), 1);
    b = _mm512_inserti32x4(b, _mm512_cvtepi32_epi8(q[2]), 2);
    b = _mm512_inserti32x4(b, _mm512_cvtepi32_epi8(q[3]), 3);
    const __m512i pairs = _mm512_maddubs_epi16(b, _mm512_set1_epi16(0x0401));
    const __m512i quads = _mm512_madd_epi16(pairs, _mm512_set1_epi32(0x00100001));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), _mm512_cvtepi32_epi8(quads));
  }

  static F Exp(F x) {
    const __mmask16 underflow = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_LT_OQ);
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
    F fx = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    F r = _mm512_fnmadd_ps(fx, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(fx, _mm512_set1_ps(-2.12194440e-4f), r);
    F p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    F y = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    y = _mm512_scalef_ps(y, fx);
    return _mm512_mask_blend_ps(underflow, y, _mm512_setzero_ps());
  }
};

#include "simd_impl.h"

bool CpuHasAvx512() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
         KVQ_CPU_HAS_F16C() && __builtin_cpu_supports("fma");
}

}  // namespace

const KernelTable* Avx512() {
  static const bool ok = CpuHasAvx512();
  return ok ? &kTable : nullptr;
}

}  // namespace kvq::kernels
