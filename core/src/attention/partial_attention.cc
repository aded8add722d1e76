#include "kvq/core/partial_attention.h"

#include <algorithm>
#include <cmath>
#include <limits>

namespace kvq::core {

void MergePartials(const float* m, const float* l, const float* o, int parts, int64_t rows, int d,
                   float* out) {
  constexpr float kNone = -std::numeric_limits<float>::infinity();
  for (int64_t r = 0; r < rows; ++r) {
    float* y = out + r * d;
    float mx = kNone;
    for (int k = 0; k < parts; ++k) mx = std::max(mx, m[k * rows + r]);
    std::fill(y, y + d, 0.0f);
    if (mx == kNone) continue;
    float denom = 0.0f;
    for (int k = 0; k < parts; ++k) {
      const float mk = m[k * rows + r];
      if (mk == kNone) continue;
      const float w = std::exp(mk - mx);
      denom += w * l[k * rows + r];
      const float* ok = o + (k * rows + r) * d;
      for (int c = 0; c < d; ++c) y[c] += w * ok[c];
    }
    const float inv = 1.0f / denom;
    for (int c = 0; c < d; ++c) y[c] *= inv;
  }
}

}  // namespace kvq::core
