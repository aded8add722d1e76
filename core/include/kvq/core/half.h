// fp16 (IEEE binary16) and bf16 <-> fp32 conversions, exact round-to-nearest-even.
#pragma once

#include <cstddef>
#include <cstdint>

#include "kvq/format/block_format.h"

namespace kvq::core {

using format::FloatToHalf;
using format::HalfToFloat;
uint16_t FloatToBF16(float f);
inline float BF16ToFloat(uint16_t b) {
  uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  __builtin_memcpy(&f, &u, 4);
  return f;
}

// Bulk conversions (vectorized with F16C where the CPU has it).
void HalfToFloatN(const uint16_t* in, float* out, size_t n);
void FloatToHalfN(const float* in, uint16_t* out, size_t n);

}  // namespace kvq::core
