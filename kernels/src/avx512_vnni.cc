// 2- and 3-bit scores and readouts on int16 dot products (AVX512-VNNI vpdpwssd, codes unpacked with
// AVX512-VBMI vpmultishiftqb), used by the AVX-512 table when the CPU has both. The fp32
// weights of a block are rounded to int16 on a per-(block, query) scale, so results differ
// from the fp32 loops by about 2^-16 of the block's largest weight (see docs/CODEC.md,
// "Kernels and dispatch"); codes and the arithmetic on them are exact.
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>

#include "avx512_reduce.h"
#include "common.h"

namespace kvq::kernels::internal {

bool CpuHasPairDot() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vbmi");
}

namespace {

inline uint32_t Load32(const void* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// acc += pairwise int16 products of a and b. Written in asm so that the accumulator stays in
// its register: GCC 12 copies vpdpwssd's destination around loops (a move per product).
inline __m512i Dot(__m512i acc, __m512i a, __m512i b) {
  __asm__("vpdpwssd %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b));
  return acc;
}

// Codes j < 16 of two 2-bit rows a and b (32 bits each): dword lane j = a_j | b_j << 16, the
// operand layout of vpdpwssd (a_j * w_lo + b_j * w_hi). The qword of lanes 2m, 2m+1 holds
// a | b << 32; vpmultishiftqb moves each code's bits to the bottom of its word, the mask
// drops the neighbours' bits.
inline __m512i DecodePair2(const uint8_t* a, const uint8_t* b) {
  const __m512i x = _mm512_mask_set1_epi32(_mm512_set1_epi32(static_cast<int>(Load32(a))), 0xAAAA,
                                           static_cast<int>(Load32(b)));
  alignas(64) static constexpr uint8_t kCtrl[64] = {
      0,  0, 32, 0, 2,  0, 34, 0, 4,  0, 36, 0, 6,  0, 38, 0, 8,  0, 40, 0, 10, 0,
      42, 0, 12, 0, 44, 0, 14, 0, 46, 0, 16, 0, 48, 0, 18, 0, 50, 0, 20, 0, 52, 0,
      22, 0, 54, 0, 24, 0, 56, 0, 26, 0, 58, 0, 28, 0, 60, 0, 30, 0, 62, 0};
  return _mm512_and_si512(_mm512_multishift_epi64_epi8(_mm512_load_si512(kCtrl), x),
                          _mm512_set1_epi32(0x00030003));
}

// The same for two 3-bit rows: 16 codes are 6 bytes per row, and token 2m's code starts at
// bit 6m, which no fixed qword of a broadcast reaches for every m. So one vpermb first gives
// each qword m the four bytes of a and of b from byte 3m/4 on (a in its low dword, b in its
// high one), and the multishift control differs per qword by the bit offset 6m mod 8. The
// rows are read with masked loads: never a byte past their 6.
inline __m512i DecodePair3(const uint8_t* a, const uint8_t* b) {
  const __m128i ab =
      _mm_unpacklo_epi64(_mm_maskz_loadu_epi8(0x3f, a), _mm_maskz_loadu_epi8(0x3f, b));
  alignas(64) static constexpr uint8_t kIdx[64] = {
      0,  1,  2,  3,  8, 9, 10, 11, 0,  1,  2,  3,  8, 9, 10, 11, 1,  2,  3,  4, 9, 10,
      11, 12, 2,  3,  4, 5, 10, 11, 12, 13, 3,  4,  5, 6, 11, 12, 13, 14, 3,  4, 5, 6,
      11, 12, 13, 14, 4, 5, 6,  7,  12, 13, 14, 15, 5, 6, 7,  8,  13, 14, 15, 0};
  // qword m: start byte s = 6m / 8, offset o = 6m - 8s; a_2m at o, b_2m at 32 + o, a_2m+1 at
  // o + 3, b_2m+1 at 35 + o.
  alignas(64) static constexpr uint8_t kCtrl[64] = {
      0,  0, 32, 0, 3,  0, 35, 0, 6,  0, 38, 0, 9,  0, 41, 0, 4,  0, 36, 0, 7,  0,
      39, 0, 2,  0, 34, 0, 5,  0, 37, 0, 0,  0, 32, 0, 3,  0, 35, 0, 6,  0, 38, 0,
      9,  0, 41, 0, 4,  0, 36, 0, 7,  0, 39, 0, 2,  0, 34, 0, 5,  0, 37, 0};
  const __m512i x = _mm512_permutexvar_epi8(_mm512_load_si512(kIdx), _mm512_castsi128_si512(ab));
  return _mm512_and_si512(_mm512_multishift_epi64_epi8(_mm512_load_si512(kCtrl), x),
                          _mm512_set1_epi32(0x00070007));
}

template <int B>
inline __m512i DecodePair(const uint8_t* a, const uint8_t* b) {
  if constexpr (B == 2)
    return DecodePair2(a, b);
  else
    return DecodePair3(a, b);
}

// x * inv rounded to int16, 16 lanes (|x * inv| <= 32767 by construction).
inline __m256i ToI16(__m512 x, float inv) {
  return _mm512_cvtepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(x, _mm512_set1_ps(inv))));
}

// steps[j] = mx[j] / 32767 for j < 4 in one division (the same roundings as four scalar ones).
inline void Step4(const float* mx, float* steps) {
  _mm_storeu_ps(steps, _mm_div_ps(_mm_loadu_ps(mx), _mm_set1_ps(32767.0f)));
}

// inv[j] = 32767 / mx[j] for j < 4, or 0 where a block's weights are all zero or not finite;
// the step back, mx / 32767, is then 0, or infinite or NaN and makes the results NaN as fp32
// would.
inline void Inverse4(const float* mx, float* inv) {
  const __m128 m = _mm_loadu_ps(mx);
  const __mmask8 ok = _mm_cmp_ps_mask(m, _mm_setzero_ps(), _CMP_GT_OQ) &
                      _mm_cmp_ps_mask(m, _mm_set1_ps(3e38f), _CMP_LT_OQ);
  _mm_storeu_ps(inv, _mm_maskz_div_ps(ok, _mm_set1_ps(32767.0f), m));
}

// Shapes: a template argument of 0 means "given at run time" (the last arguments); the
// common shapes (d = 64 or 128, 32-token blocks) get everything as constants, which lets the
// compiler keep the per-block preparation in registers.
struct Shape {
  int n_ch, tokens, ng;
};

// Scores of NQ queries over one block of B-bit codes: w = q * scale rounded to int16 on the
// scale of the query's largest |w|, then token tiles of 16 with two channels per dword.
template <int B, int NQ, int NCH_, int T_>
void ScorePairN(const uint8_t* codes, const float* sc, const float* ze, const float* q, int64_t qs,
                float mult, bool accumulate, float* out, int64_t os, Shape rt) {
  const int n_ch = NCH_ ? NCH_ : rt.n_ch, tokens = T_ ? T_ : rt.tokens;
  const int nv = (n_ch + 15) / 16;
  const __mmask16 tail = static_cast<__mmask16>((1u << (n_ch - (nv - 1) * 16)) - 1);
  constexpr int kNv = NCH_ ? (NCH_ + 15) / 16 : 32;
  __m512 wf[NQ][kNv];
  alignas(64) int16_t w16[NQ][512];
  __m512 b[4], mx[4];
  for (int j = 0; j < 4; ++j) b[j] = mx[j] = _mm512_setzero_ps();
  for (int j = 0; j < NQ; ++j)
    for (int k = 0; k < nv; ++k) {
      const __mmask16 m = k + 1 < nv ? 0xffff : tail;
      const __m512 qv = _mm512_maskz_loadu_ps(m, q + j * qs + 16 * k);
      const __m512 w = _mm512_mul_ps(qv, _mm512_load_ps(sc + 16 * k));
      wf[j][k] = w;
      b[j] = _mm512_fmadd_ps(qv, _mm512_load_ps(ze + 16 * k), b[j]);
      mx[j] = MaxBits(mx[j], _mm512_abs_ps(w));
    }
  float bias[4], top[4], ws[4];
  ReduceAdd4(b, bias);
  ReduceMaxBits4(mx, top);
  float inv[4];
  Inverse4(top, inv);
  Step4(top, ws);
  for (int j = 0; j < NQ; ++j) {
    for (int k = 0; k < nv; ++k)
      _mm256_store_si256(reinterpret_cast<__m256i*>(w16[j] + 16 * k), ToI16(wf[j][k], inv[j]));
    ws[j] *= mult;
    bias[j] *= mult;
  }
  constexpr int TILES = 2;  // tokens % 32 == 0 here; 16-token blocks take the 1-tile path
  const int64_t rb = tokens * B / 8;
  const int tiles = tokens % 32 == 0 ? TILES : 1;
  PrefetchAhead& ahead_ref = Ahead();
  PrefetchAhead ahead = ahead_ref;  // in registers for the loop
  for (int t0 = 0; t0 < tokens; t0 += 16 * tiles) {
    __m512i acc[TILES][NQ];
    for (int k = 0; k < TILES; ++k)
      for (int i = 0; i < NQ; ++i) acc[k][i] = _mm512_setzero_si512();
    const uint8_t* base = codes + t0 * B / 8;
    for (int c = 0; c < n_ch; c += 2) {
      ahead.Some(1);
      __m512i v[TILES];
      for (int k = 0; k < tiles; ++k)
        v[k] = DecodePair<B>(base + c * rb + 2 * B * k, base + (c + 1) * rb + 2 * B * k);
      for (int i = 0; i < NQ; ++i) {
        const __m512i w = _mm512_set1_epi32(static_cast<int>(Load32(w16[i] + c)));
        for (int k = 0; k < tiles; ++k) acc[k][i] = Dot(acc[k][i], v[k], w);
      }
    }
    for (int k = 0; k < tiles; ++k)
      for (int i = 0; i < NQ; ++i) {
        float* o = out + i * os + t0 + 16 * k;
        __m512 r = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[k][i]), _mm512_set1_ps(ws[i]),
                                   _mm512_set1_ps(bias[i]));
        if (accumulate) r = _mm512_add_ps(_mm512_loadu_ps(o), r);
        _mm512_storeu_ps(o, r);
      }
  }
  ahead_ref = ahead;
}

template <int B, int NCH_, int T_>
void ScorePairS(const uint8_t* codes, const float* sc, const float* ze, const float* q, int64_t qs,
                int n_q, float mult, bool accumulate, float* out, int64_t os, Shape rt) {
  for (int i0 = 0; i0 < n_q; i0 += 4) {
    const float* qi = q + i0 * qs;
    float* o = out + i0 * os;
    switch (std::min(4, n_q - i0)) {
      case 1:
        ScorePairN<B, 1, NCH_, T_>(codes, sc, ze, qi, qs, mult, accumulate, o, os, rt);
        break;
      case 2:
        ScorePairN<B, 2, NCH_, T_>(codes, sc, ze, qi, qs, mult, accumulate, o, os, rt);
        break;
      case 3:
        ScorePairN<B, 3, NCH_, T_>(codes, sc, ze, qi, qs, mult, accumulate, o, os, rt);
        break;
      default:
        ScorePairN<B, 4, NCH_, T_>(codes, sc, ze, qi, qs, mult, accumulate, o, os, rt);
        break;
    }
  }
}

// Readout of NQ queries over one block of B-bit token rows: coefficients p * scale rounded to
// int16 per (query, group), token pairs in the two words of each dword, chunk pairs of 16
// channels (2 * B bytes each).
template <int B, int NQ, int N_, int ROWS_, int NG_>
void ReadoutPairN(const uint8_t* rows, int64_t rec, int group, const float* hz, int64_t hs,
                  const float* p, int64_t ps, float* out, int64_t os, Shape rt) {
  constexpr int kRows = 128, kGroups = 8;
  const int n = N_ ? N_ : rt.n_ch, n_rows = ROWS_ ? ROWS_ : rt.tokens, ng = NG_ ? NG_ : rt.ng;
  const int nv = (n_rows + 15) / 16, pairs = (n_rows + 1) & ~1;
  const __mmask16 tail = static_cast<__mmask16>((1u << (n_rows - (nv - 1) * 16)) - 1);
  constexpr int kNv = ROWS_ ? (ROWS_ + 15) / 16 : kRows / 16;
  // Fixed shapes come with group == n / ng (see ReadoutPairDot); a group of 32 channels or a
  // multiple keeps both chunks of a pair in one group, so they share the coefficients.
  constexpr int kGroup = N_ && NG_ ? N_ / NG_ : 0;
  constexpr bool kPairInGroup = kGroup > 0 && kGroup % 32 == 0;
  __m512 cf[NQ][kGroups][kNv];
  alignas(64) int16_t c16[NQ][kGroups][kRows];
  // coef = p * scale (zero past n_rows: the odd row's pad), zero-point sums and max |coef|.
  constexpr int kAcc = NG_ ? (NQ * NG_ + 3) / 4 * 4 : 4 * kGroups;
  const int nk = (NQ * ng + 3) & ~3;
  __m512 zacc[kAcc], mx[kAcc];
  for (int k = NQ * ng; k < nk; ++k) zacc[k] = mx[k] = _mm512_setzero_ps();
  for (int j = 0; j < NQ; ++j)
    for (int g = 0; g < ng; ++g) {
      __m512 z = _mm512_setzero_ps(), x = _mm512_setzero_ps();
      for (int v = 0; v < nv; ++v) {
        const __mmask16 m = v + 1 < nv ? 0xffff : tail;
        const __m512 pv = _mm512_maskz_loadu_ps(m, p + j * ps + 16 * v);
        const __m512 c = _mm512_mul_ps(pv, _mm512_loadu_ps(hz + g * hs + 16 * v));
        cf[j][g][v] = c;
        z = _mm512_fmadd_ps(pv, _mm512_loadu_ps(hz + (ng + g) * hs + 16 * v), z);
        x = MaxBits(x, _mm512_abs_ps(c));
      }
      zacc[j * ng + g] = z;
      mx[j * ng + g] = x;
    }
  float zs[kAcc], top[kAcc], ws[kAcc], inv[kAcc];
  for (int k = 0; k < nk; k += 4) {
    ReduceAdd4(zacc + k, zs + k);
    ReduceMaxBits4(mx + k, top + k);
    Inverse4(top + k, inv + k);
    Step4(top + k, ws + k);
  }
  for (int j = 0; j < NQ; ++j)
    for (int g = 0; g < ng; ++g)
      for (int v = 0; v < nv; ++v)
        _mm256_store_si256(reinterpret_cast<__m256i*>(c16[j][g] + 16 * v),
                           ToI16(cf[j][g][v], inv[j * ng + g]));
  const int chunks = n / 16;
  PrefetchAhead& ahead_ref = Ahead();
  PrefetchAhead ahead = ahead_ref;  // in registers for the loop
  for (int ch = 0; ch < chunks; ch += 2) {
    const int nc = kPairInGroup || ch + 1 < chunks ? 2 : 1;
    const int g0 = ch * 16 / group, g1 = (ch + nc - 1) * 16 / group;
    __m512i acc[2][NQ];
    for (int k = 0; k < 2; ++k)
      for (int i = 0; i < NQ; ++i) acc[k][i] = _mm512_setzero_si512();
    const uint8_t* codes = rows + 4 * ng + ch * 2 * B;
    for (int t = 0; t < pairs; t += 2) {
      ahead.Some(1);
      const uint8_t* r0 = codes + t * rec;
      const uint8_t* r1 = t + 1 < n_rows ? r0 + rec : r0;  // an odd count's pad (weight 0)
      const __m512i v0 = DecodePair<B>(r0, r1);
      const __m512i v1 = nc == 2 ? DecodePair<B>(r0 + 2 * B, r1 + 2 * B) : v0;
      for (int i = 0; i < NQ; ++i) {
        const __m512i w0 = _mm512_set1_epi32(static_cast<int>(Load32(c16[i][g0] + t)));
        acc[0][i] = Dot(acc[0][i], v0, w0);
        acc[1][i] =
            Dot(acc[1][i], v1,
                kPairInGroup ? w0 : _mm512_set1_epi32(static_cast<int>(Load32(c16[i][g1] + t))));
      }
    }
    for (int k = 0; k < nc; ++k) {
      const int g = k ? g1 : g0;
      for (int i = 0; i < NQ; ++i) {
        float* o = out + i * os + (ch + k) * 16;
        const __m512 r =
            _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[k][i]), _mm512_set1_ps(ws[i * ng + g]),
                            _mm512_set1_ps(zs[i * ng + g]));
        _mm512_storeu_ps(o, _mm512_add_ps(_mm512_loadu_ps(o), r));
      }
    }
  }
  ahead_ref = ahead;
}

// The records' fp16 scales and zero points as floats, hz[k][t] (k < 2 * ng), 16 tokens at a
// time: four 16-byte record heads per vector, then one permute pair per kind. With the shape
// known, the record size (4 * ng + n * B / 8) and the clamping of the last rows fold away.
template <int B, int N_, int ROWS_, int NG_>
void LoadHeads(const uint8_t* rows, int64_t rec_rt, float (*hz)[128], Shape rt) {
  const int n_rows = ROWS_ ? ROWS_ : rt.tokens, ng = NG_ ? NG_ : rt.ng;
  const int64_t rec = N_ && NG_ ? 4 * NG_ + N_ * B / 8 : rec_rt;
  const __m512i step = _mm512_set_epi16(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 56, 48, 40,
                                        32, 24, 16, 8, 0, 56, 48, 40, 32, 24, 16, 8, 0);
  auto head = [&](int t) {
    return _mm_loadu_si128(reinterpret_cast<const __m128i*>(rows + std::min(t, n_rows - 1) * rec));
  };
  for (int t0 = 0; t0 < n_rows; t0 += 16) {
    __m512i a[4];
    for (int k = 0; k < 4; ++k) {
      const int t = t0 + 4 * k;
      __m512i v = _mm512_castsi128_si512(head(t));
      v = _mm512_inserti32x4(v, head(t + 1), 1);
      v = _mm512_inserti32x4(v, head(t + 2), 2);
      a[k] = _mm512_inserti32x4(v, head(t + 3), 3);
    }
    for (int k = 0; k < 2 * ng; ++k) {
      const __m512i idx = _mm512_add_epi16(step, _mm512_set1_epi16(static_cast<int16_t>(k)));
      const __m256i h = _mm256_mask_blend_epi16(
          0xff00, _mm512_castsi512_si256(_mm512_permutex2var_epi16(a[0], idx, a[1])),
          _mm512_castsi512_si256(_mm512_permutex2var_epi16(a[2], idx, a[3])));
      _mm512_store_ps(hz[k] + t0, _mm512_cvtph_ps(h));
    }
  }
}

template <int B, int N_, int ROWS_, int NG_>
void ReadoutPairS(const uint8_t* rows, int64_t rec, int group, const float* p, int64_t ps, int n_q,
                  float* out, int64_t os, Shape rt) {
  alignas(64) float hz[8][128];
  LoadHeads<B, N_, ROWS_, NG_>(rows, rec, hz, rt);
  for (int i0 = 0; i0 < n_q; i0 += 4) {
    const float* pi = p + i0 * ps;
    float* o = out + i0 * os;
    switch (std::min(4, n_q - i0)) {
      case 1:
        ReadoutPairN<B, 1, N_, ROWS_, NG_>(rows, rec, group, hz[0], 128, pi, ps, o, os, rt);
        break;
      case 2:
        ReadoutPairN<B, 2, N_, ROWS_, NG_>(rows, rec, group, hz[0], 128, pi, ps, o, os, rt);
        break;
      case 3:
        ReadoutPairN<B, 3, N_, ROWS_, NG_>(rows, rec, group, hz[0], 128, pi, ps, o, os, rt);
        break;
      default:
        ReadoutPairN<B, 4, N_, ROWS_, NG_>(rows, rec, group, hz[0], 128, pi, ps, o, os, rt);
        break;
    }
  }
}

}  // namespace

void ScorePairDot(const uint8_t* codes, int bits, int n_ch, int tokens, const uint16_t* scale,
                  const uint16_t* zero, const float* q, int64_t qs, int n_q, float mult,
                  bool accumulate, float* out, int64_t os) {
  alignas(64) float sc[512], ze[512];
  const int nv = (n_ch + 15) / 16;
  const __mmask16 tail = static_cast<__mmask16>((1u << (n_ch - (nv - 1) * 16)) - 1);
  for (int k = 0; k < nv; ++k) {
    const __mmask16 m = k + 1 < nv ? 0xffff : tail;
    _mm512_store_ps(sc + 16 * k, _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, scale + 16 * k)));
    _mm512_store_ps(ze + 16 * k, _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, zero + 16 * k)));
  }
  const Shape rt{n_ch, tokens, 0};
  // head_dim 64 and 128 get the channel count as a constant (the per-block weights stay in
  // registers) for every group length of the frontier's codecs (32, 64, 128 tokens), and the
  // token count for 2-bit keys in groups of 32 (the old default), 3-bit keys in groups of 128
  // (the default codec, docs/CODEC.md) and groups of 64 (G = 64 at d = 128: about 7% less
  // time than with the token count at run time, docs/BENCHMARKS.md).
  auto run = [&](auto bits_c) {
    constexpr int kB = decltype(bits_c)::value;
    constexpr int kT = kB == 2 ? 32 : 128;
    if (tokens == kT && n_ch == 64)
      ScorePairS<kB, 64, kT>(codes, sc, ze, q, qs, n_q, mult, accumulate, out, os, rt);
    else if (tokens == kT && n_ch == 128)
      ScorePairS<kB, 128, kT>(codes, sc, ze, q, qs, n_q, mult, accumulate, out, os, rt);
    else if (tokens == 64 && n_ch == 64)
      ScorePairS<kB, 64, 64>(codes, sc, ze, q, qs, n_q, mult, accumulate, out, os, rt);
    else if (tokens == 64 && n_ch == 128)
      ScorePairS<kB, 128, 64>(codes, sc, ze, q, qs, n_q, mult, accumulate, out, os, rt);
    else if (n_ch == 64)
      ScorePairS<kB, 64, 0>(codes, sc, ze, q, qs, n_q, mult, accumulate, out, os, rt);
    else if (n_ch == 128)
      ScorePairS<kB, 128, 0>(codes, sc, ze, q, qs, n_q, mult, accumulate, out, os, rt);
    else
      ScorePairS<kB, 0, 0>(codes, sc, ze, q, qs, n_q, mult, accumulate, out, os, rt);
  };
  if (bits == 2)
    run(std::integral_constant<int, 2>{});
  else
    run(std::integral_constant<int, 3>{});
}

void ReadoutPairDot(const uint8_t* rows, int bits, int64_t rec, int n_rows, int n, int group,
                    const float* p, int64_t ps, int n_q, float* out, int64_t os) {
  const Shape rt{n, n_rows, (n + group - 1) / group};
  // Fixed shapes for the frontier's codecs: blocks of 32, 64 or 128 tokens (G), head_dim 64 or
  // 128, groups of 32 or 64 channels (they keep group == N_ / NG_, ReadoutPairN's kGroup).
  auto fixed = [&](auto bits_c, auto n_c, auto rows_c) {
    constexpr int kB = decltype(bits_c)::value, kN = decltype(n_c)::value,
                  kRows = decltype(rows_c)::value;
    if (group == 32)
      ReadoutPairS<kB, kN, kRows, kN / 32>(rows, rec, group, p, ps, n_q, out, os, rt);
    else
      ReadoutPairS<kB, kN, kRows, kN / 64>(rows, rec, group, p, ps, n_q, out, os, rt);
  };
  auto by_rows = [&](auto bits_c, auto n_c) {
    if (n_rows == 32)
      fixed(bits_c, n_c, std::integral_constant<int, 32>{});
    else if (n_rows == 64)
      fixed(bits_c, n_c, std::integral_constant<int, 64>{});
    else if (n_rows == 128)
      fixed(bits_c, n_c, std::integral_constant<int, 128>{});
    else
      ReadoutPairS<decltype(bits_c)::value, 0, 0, 0>(rows, rec, group, p, ps, n_q, out, os, rt);
  };
  auto run = [&](auto bits_c) {
    constexpr int kB = decltype(bits_c)::value;
    if ((group == 32 || group == 64) && n == 64)
      by_rows(bits_c, std::integral_constant<int, 64>{});
    else if ((group == 32 || group == 64) && n == 128)
      by_rows(bits_c, std::integral_constant<int, 128>{});
    else
      ReadoutPairS<kB, 0, 0, 0>(rows, rec, group, p, ps, n_q, out, os, rt);
  };
  if (bits == 2)
    run(std::integral_constant<int, 2>{});
  else
    run(std::integral_constant<int, 3>{});
}

}  // namespace kvq::kernels::internal
