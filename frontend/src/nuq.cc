#include "kvq/frontend/nuq.h"

#include <algorithm>
#include <cmath>

namespace kvq::frontend {

void UnitHistogram::Add(double u) {
  if (!(u > 0.0 && u < 1.0)) return;  // the ends (and NaN) are not the book's to place
  const int b = std::min(kBins - 1, static_cast<int>(u * kBins));
  count[b] += 1.0;
}

void UnitHistogram::Merge(const UnitHistogram& o) {
  for (int b = 0; b < kBins; ++b) count[b] += o.count[b];
}

double UnitHistogram::total() const {
  double t = 0;
  for (double c : count) t += c;
  return t;
}

std::vector<float> FitCodeBook(const UnitHistogram& h, int bits) {
  const int L = 1 << bits;
  std::vector<double> c(L);
  for (int k = 0; k < L; ++k) c[k] = static_cast<double>(k) / (L - 1);
  if (h.total() > 0 && L > 2) {
    constexpr int kIterations = 200;
    for (int it = 0; it < kIterations; ++it) {
      // Each bin's mass (at its centre) goes to the nearest level; interior levels move to
      // the mean of their mass, the ends stay.
      std::vector<double> mass(L, 0.0), moment(L, 0.0);
      int k = 0;
      for (int b = 0; b < UnitHistogram::kBins; ++b) {
        if (h.count[b] == 0) continue;
        const double u = (b + 0.5) / UnitHistogram::kBins;
        while (k + 1 < L && u > 0.5 * (c[k] + c[k + 1])) ++k;
        mass[k] += h.count[b];
        moment[k] += h.count[b] * u;
      }
      double moved = 0;
      for (int j = 1; j + 1 < L; ++j) {
        if (mass[j] <= 0) continue;  // an empty cell keeps its level
        const double to = moment[j] / mass[j];
        moved = std::max(moved, std::abs(to - c[j]));
        c[j] = to;
      }
      std::sort(c.begin(), c.end());
      if (moved < 1e-7) break;
    }
  }
  return std::vector<float>(c.begin(), c.end());
}

float Compand(float u, const std::vector<float>& levels) {
  const int L = static_cast<int>(levels.size());
  if (u <= 0.0f) return 0.0f;
  if (u >= 1.0f) return 1.0f;
  const int k =
      static_cast<int>(std::upper_bound(levels.begin(), levels.end(), u) - levels.begin()) -
      1;  // levels[k] <= u < levels[k + 1]
  const float span = levels[k + 1] - levels[k];
  const float f = span > 0 ? (u - levels[k]) / span : 0.0f;
  return (static_cast<float>(k) + f) / static_cast<float>(L - 1);
}

float Expand(float y, const std::vector<float>& levels) {
  const int L = static_cast<int>(levels.size());
  if (y <= 0.0f) return 0.0f;
  if (y >= 1.0f) return 1.0f;
  const float p = y * static_cast<float>(L - 1);
  const int k = std::min(L - 2, static_cast<int>(p));
  return levels[k] + (p - static_cast<float>(k)) * (levels[k + 1] - levels[k]);
}

}  // namespace kvq::frontend
