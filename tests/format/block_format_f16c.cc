// format's fp16 conversions as compiled with F16C (this file builds with -mf16c): the
// block_format_test holds them to the portable form bit for bit.
#include "kvq/format/block_format.h"

#ifndef __F16C__
#error "block_format_f16c.cc must be compiled with -mf16c"
#endif

namespace kvq::testing {

uint16_t F16cFloatToHalf(float f) { return format::FloatToHalf(f); }
float F16cHalfToFloat(uint16_t h) { return format::HalfToFloat(h); }

}  // namespace kvq::testing
