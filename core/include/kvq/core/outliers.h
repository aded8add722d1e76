// Dense-and-sparse outlier selection (KVQuant): which elements of a block a codec keeps exactly
// beside its codes, so that they do not widen their quantization ranges.
#pragma once

#include <cstdint>
#include <vector>

namespace kvq::core {

// `units` partition (some of) the elements of x into quantization ranges (each unit is
// quantized between its min and max). Removes up to `budget` elements, each time the one at an
// end of its unit whose removal shrinks size * range^2 (the unit's squared quantization error,
// up to a constant) the most, leaving at least two per unit; the removed elements are clamped
// into their unit's remaining range in x. Returns their indices, unit by unit.
std::vector<int64_t> TrimOutliers(float* x, const std::vector<std::vector<int64_t>>& units,
                                  int64_t budget);

}  // namespace kvq::core
