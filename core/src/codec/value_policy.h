// The A^2 value policy: per-token value widths from predicted attention-squared weights.
//
// Widths come from {1,2,3,4} bits. Given weights w_j (>= 0) and a budget of B mean bits, a
// greedy allocation starts every token at 1 bit and repeatedly upgrades the token with the
// largest w_j * range_j^2 * (4^-b - 4^-(b+1)) (the drop in its expected squared error) until
// the budget is spent. Sinks (positions < sink_tokens) are pinned to 4 bits and paid for
// from the same budget. With all weights equal this reduces to (nearly) uniform widths.
#pragma once

#include <cstdint>

#include "kvq/core/codec.h"

namespace kvq::core {

// values: [n][d] fp32 (row stride ld), weights: [n] (null: uniform), first_position: the
// sequence position of row 0 (for the sink rule). Writes n widths.
void ChooseValueBits(const CodecOptions& o, const float* values, int64_t ld, const float* weights,
                     int n, int64_t first_position, uint8_t* bits);

}  // namespace kvq::core
