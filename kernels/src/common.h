// Helpers shared by the kernel tables (internal).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "kvq/format/block_format.h"

namespace kvq::kernels::internal {

// fp16 <-> fp32 (kvq/format/block_format.h): F16C instructions where the translation unit is
// compiled for them, else exact bit manipulation; the same bits either way.
using format::FloatToHalf;
using format::HalfToFloat;

// __builtin_cpu_supports("f16c") is not known to clang before 15; every x86 CPU with AVX2
// (which each caller checks too) has F16C.
#if defined(__clang__) && __clang_major__ < 15
#define KVQ_CPU_HAS_F16C() 1
#else
#define KVQ_CPU_HAS_F16C() __builtin_cpu_supports("f16c")
#endif

// The reference project_queries and dense_readout_f32 (ref.cc), which every table uses
// (kernels.h).
void ProjectQueries(const float* q, int n_q, int d, const float* basis, int r, float* out);
void DenseReadoutF32(const float* v, int tokens, int d, const float* p, int64_t p_stride, int n_q,
                     float* out, int64_t out_stride);

// The N bytes at p (N <= 8) as the low bytes of a word, little-endian, loaded in register-sized
// pieces: a memcpy of an odd size into a zeroed word compiles to narrow stores and one wide
// reload, which stalls on store forwarding (44% of a 3-bit channel dequantize on AVX-512).
template <int N>
inline uint64_t LoadLowBytes(const uint8_t* p) {
  static_assert(N >= 1 && N <= 8);
  if constexpr (N == 8 || N == 4 || N == 2 || N == 1) {
    using Word = std::conditional_t<
        N == 8, uint64_t,
        std::conditional_t<N == 4, uint32_t, std::conditional_t<N == 2, uint16_t, uint8_t>>>;
    Word w;
    std::memcpy(&w, p, N);
    return w;
  } else if constexpr (N > 4) {
    return LoadLowBytes<4>(p) | (LoadLowBytes<N - 4>(p + 4) << 32);
  } else if constexpr (N > 2) {
    return LoadLowBytes<2>(p) | (LoadLowBytes<N - 2>(p + 2) << 16);
  }
}

// Quantization parameters as stored: fp16-rounded zero (= min) and scale.
struct QParams {
  float scale, zero, inv;
};
inline QParams MakeParams(float lo, float hi, int bits, uint16_t* s16, uint16_t* z16) {
  const float levels = static_cast<float>((1 << bits) - 1);
  *z16 = FloatToHalf(lo);
  float zero = HalfToFloat(*z16);
  float scale = (hi - zero) / levels;
  *s16 = FloatToHalf(scale);
  float s = HalfToFloat(*s16);
  // fp16 rounding may shrink the scale so that hi no longer fits: bump to the next value.
  if (s > 0 && zero + s * levels < hi) {
    *s16 = static_cast<uint16_t>(*s16 + 1);
    s = HalfToFloat(*s16);
  }
  if (!(s > 0) || !std::isfinite(s)) {
    *s16 = 0;
    s = 0;
  }
  return {s, zero, s > 0 ? 1.0f / s : 0.0f};
}

inline int QuantizeOne(float x, const QParams& p, int maxq) {
  float v = (x - p.zero) * p.inv;
  int q = static_cast<int>(std::nearbyint(v));
  return q < 0 ? 0 : (q > maxq ? maxq : q);
}

// Reads code i (bits b) from an LSB-first packed row.
inline int GetCode(const uint8_t* row, int b, int64_t i) {
  int64_t bit = i * b;
  const uint8_t* p = row + (bit >> 3);
  uint32_t w = p[0] | (b + (bit & 7) > 8 ? (static_cast<uint32_t>(p[1]) << 8) : 0u);
  return static_cast<int>((w >> (bit & 7)) & ((1u << b) - 1));
}
inline void PutCode(uint8_t* row, int b, int64_t i, int code) {
  int64_t bit = i * b;
  uint8_t* p = row + (bit >> 3);
  uint32_t v = static_cast<uint32_t>(code) << (bit & 7);
  p[0] |= static_cast<uint8_t>(v);
  if (b + (bit & 7) > 8) p[1] |= static_cast<uint8_t>(v >> 8);
}
inline int64_t RowBytes(int64_t n, int b) { return (n * b + 7) / 8; }

// Scalar building blocks shared by the tables (defined in ref.cc). The channel range
// function ORs codes into `codes`, which the caller has zeroed.
void QuantizeChannelRange(const float* x, int64_t ld, int tokens, int n_ch, int c0, int c1,
                          int bits, uint16_t* scale, uint16_t* zero, uint8_t* codes, float* deq);
void QuantizeRowScalar(const float* x, int n, int group, int bits, uint16_t* scale, uint16_t* zero,
                       uint8_t* codes);

// 2- and 3-bit codes on int16 dot products (avx512_vnni.cc; only where CpuHasPairDot()): the
// same contracts as KernelTable::score_codes with bits = 2 or 3 (n_ch <= 512 and even,
// tokens % 16 == 0) and readout_rows with every row of `bits` (2 or 3), records of rec >= 16
// bytes (n % 16 == 0, group % 16 == 0, n_rows <= 128, at most 4 groups). The fp32 weights
// of each (block, query) are rounded to int16 on the scale of their largest magnitude.
bool CpuHasPairDot();
void ScorePairDot(const uint8_t* codes, int bits, int n_ch, int tokens, const uint16_t* scale,
                  const uint16_t* zero, const float* q, int64_t qs, int n_q, float mult,
                  bool accumulate, float* out, int64_t os);
void ReadoutPairDot(const uint8_t* rows, int bits, int64_t rec, int n_rows, int n, int group,
                    const float* p, int64_t ps, int n_q, float* out, int64_t os);

// The block a read will verify two blocks from now (xxh3_simd asks for it ahead of time): its
// cache lines are requested a few at a time from the int16 kernels' loops, so that they arrive
// while this block is computed; a burst of ~100 prefetches stalls the core until the fill
// buffers drain, which puts memory time and compute in series. Per thread; a range the kernels
// did not finish is requested whole by the next checksum.
struct PrefetchAhead {
  const char* next = nullptr;
  const char* end = nullptr;
  void Some(int lines) {
    for (; lines > 0 && next < end; --lines, next += 64) __builtin_prefetch(next, 0, 3);
  }
};
PrefetchAhead& Ahead();

}  // namespace kvq::kernels::internal
