#include "kvq/core/outliers.h"

#include <algorithm>
#include <queue>
#include <utility>

namespace kvq::core {

std::vector<int64_t> TrimOutliers(float* x, const std::vector<std::vector<int64_t>>& units,
                                  int64_t budget) {
  struct Unit {
    std::vector<int64_t> order;  // element indices by value
    size_t lo = 0, hi = 0;       // the kept span of `order`
    bool top = false;            // whether the next removal is at the top
  };
  std::vector<Unit> us(units.size());
  // Gain of the better removal at either end; -1 when the unit keeps only two.
  auto gain = [&](Unit& u) -> double {
    if (u.hi - u.lo < 2) return -1.0;
    const double lo = x[u.order[u.lo]], hi = x[u.order[u.hi]];
    const double r = hi - lo, rt = x[u.order[u.hi - 1]] - lo, rb = hi - x[u.order[u.lo + 1]];
    u.top = rt <= rb;
    const double n = static_cast<double>(u.order.size());
    return n * (r * r - std::min(rt, rb) * std::min(rt, rb));
  };
  std::priority_queue<std::pair<double, size_t>> best;
  for (size_t i = 0; i < units.size(); ++i) {
    Unit& u = us[i];
    u.order = units[i];
    std::sort(u.order.begin(), u.order.end(), [&](int64_t a, int64_t b) { return x[a] < x[b]; });
    if (u.order.empty()) continue;
    u.hi = u.order.size() - 1;
    const double g = gain(u);
    if (g > 0) best.push({g, i});
  }
  for (int64_t left = budget; left > 0 && !best.empty(); --left) {
    const size_t i = best.top().second;
    best.pop();
    Unit& u = us[i];
    if (u.top) {
      --u.hi;
    } else {
      ++u.lo;
    }
    const double g = gain(u);
    if (g > 0) best.push({g, i});
  }
  std::vector<int64_t> removed;
  for (Unit& u : us) {
    if (u.order.empty()) continue;
    const float lo = x[u.order[u.lo]], hi = x[u.order[u.hi]];
    for (size_t k = 0; k < u.order.size(); ++k) {
      if (k >= u.lo && k <= u.hi) continue;
      removed.push_back(u.order[k]);
      x[u.order[k]] = std::clamp(x[u.order[k]], lo, hi);
    }
  }
  return removed;
}

}  // namespace kvq::core
