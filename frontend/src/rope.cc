#include "kvq/frontend/rope.h"

#include <cmath>

namespace kvq::frontend {

void RopeAngles(const Rope& r, int64_t start, int n, std::vector<float>* cos_out,
                std::vector<float>* sin_out) {
  const int P = static_cast<int>(r.inv_freq.size());
  cos_out->resize(static_cast<size_t>(n) * P);
  sin_out->resize(cos_out->size());
  for (int i = 0; i < n; ++i) {
    for (int j = 0; j < P; ++j) {
      // In double: positions up to the context length times a frequency near 1.
      const double th = static_cast<double>(start + i) * r.inv_freq[j];
      (*cos_out)[static_cast<size_t>(i) * P + j] = static_cast<float>(std::cos(th));
      (*sin_out)[static_cast<size_t>(i) * P + j] = static_cast<float>(std::sin(th));
    }
  }
}

void RotateRows(const Rope& r, int64_t start, int n, int heads, int head_dim, float* rows,
                bool inverse) {
  const int P = static_cast<int>(r.inv_freq.size());
  std::vector<float> c, s;
  RopeAngles(r, start, n, &c, &s);
  for (int i = 0; i < n; ++i)
    for (int h = 0; h < heads; ++h)
      RotatePairs(rows + (static_cast<size_t>(i) * heads + h) * head_dim,
                  c.data() + static_cast<size_t>(i) * P, s.data() + static_cast<size_t>(i) * P, P,
                  r.halves, inverse);
}

}  // namespace kvq::frontend
