// fp16 (IEEE binary16) and bf16 <-> fp32 conversions, exact round-to-nearest-even.
#pragma once

#include <cstddef>
#include <cstdint>

#include "kvq/format/block_format.h"

namespace kvq::core {

using format::FloatToHalf;
using format::HalfToFloat;
// Round to nearest even; a NaN stays a NaN (quiet bit set). Branch-free so that loops over it
// vectorize.
inline uint16_t FloatToBF16(float f) {
  uint32_t u;
  __builtin_memcpy(&u, &f, 4);
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1)) >> 16;
  const uint32_t nan = (u >> 16) | 0x40;
  return static_cast<uint16_t>((u & 0x7fffffffu) > 0x7f800000u ? nan : rounded);
}
inline float BF16ToFloat(uint16_t b) {
  uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  __builtin_memcpy(&f, &u, 4);
  return f;
}

// The largest magnitude, as the bits of each type with the sign cleared, within
// +-format::kHalfMax (the range the block format's fp16 scales and zero points hold): a value
// is storable when its sign-cleared bits are at most these (non-finite patterns are above).
inline constexpr uint16_t kHalfStorableBits = 0x7bff;     // 65504, every finite fp16
inline constexpr uint16_t kBF16StorableBits = 0x477f;     // 65280, the next bf16 is 65536
inline constexpr uint32_t kF32StorableBits = 0x477fe000;  // 65504.0f

// Bulk conversions (vectorized with F16C where the CPU has it).
void HalfToFloatN(const uint16_t* in, float* out, size_t n);
void FloatToHalfN(const float* in, uint16_t* out, size_t n);
// FloatToBF16 over n values (AVX2 where the CPU has it; the same bits).
void FloatToBF16N(const float* in, uint16_t* out, size_t n);
// HalfToFloatN and the bf16 widening, checking as they go: true when every value is storable
// (the bounds above), so that a caller reads its input once (AVX2 where the CPU has it).
bool HalfToFloatStorableN(const uint16_t* in, float* out, size_t n);
bool BF16ToFloatStorableN(const uint16_t* in, float* out, size_t n);

}  // namespace kvq::core
