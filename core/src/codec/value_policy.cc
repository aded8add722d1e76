#include "core/src/codec/value_policy.h"

#include <algorithm>
#include <cmath>
#include <queue>
#include <vector>

namespace kvq::core {

void ChooseValueBits(const CodecOptions& o, const float* values, int64_t ld, const float* weights,
                     int n, int64_t first_position, uint8_t* bits) {
  constexpr int kMin = 1, kMax = 4;
  std::vector<double> range2(n);
  for (int t = 0; t < n; ++t) {
    const float* v = values + t * ld;
    float lo = v[0], hi = v[0];
    for (int c = 1; c < o.head_dim; ++c) {
      lo = std::min(lo, v[c]);
      hi = std::max(hi, v[c]);
    }
    range2[t] = static_cast<double>(hi - lo) * (hi - lo);
  }
  // Expected squared error per element of a b-bit asymmetric code ~ (range / (2^b - 1))^2.
  auto err = [](int b) {
    const double l = (1 << b) - 1;
    return 1.0 / (l * l);
  };
  long budget = std::lround(std::floor(static_cast<double>(o.value_budget) * n + 1e-9));
  for (int t = 0; t < n; ++t) {
    const bool sink = first_position + t < o.sink_tokens;
    bits[t] = sink ? kMax : kMin;
    budget -= bits[t];
  }
  using Item = std::pair<double, int>;
  std::priority_queue<Item> heap;
  auto gain = [&](int t) {
    const double w = weights ? std::max(0.0f, weights[t]) : 1.0;
    return w * range2[t] * (err(bits[t]) - err(bits[t] + 1)) + 1e-30 * range2[t];
  };
  for (int t = 0; t < n; ++t)
    if (bits[t] < kMax) heap.push({gain(t), t});
  while (budget > 0 && !heap.empty()) {
    const int t = heap.top().second;
    heap.pop();
    ++bits[t];
    --budget;
    if (bits[t] < kMax) heap.push({gain(t), t});
  }
}

}  // namespace kvq::core
