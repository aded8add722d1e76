#include "kvq/core/partial_attention.h"

#include <algorithm>
#include <cmath>
#include <condition_variable>
#include <limits>
#include <memory>
#include <mutex>

#include "kvq/core/cache.h"

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

namespace {
// One Run's parts; shared with the helpers, which may start after Run returned.
struct Claims {
  std::mutex mu;
  std::condition_variable idle;
  const std::function<void(int)>* task = nullptr;  // valid while next < n
  int n = 0, next = 0, running = 0;
  // Claims and runs parts until none is left.
  void Work() {
    std::unique_lock<std::mutex> l(mu);
    while (next < n) {
      const int k = next++;
      ++running;
      l.unlock();
      (*task)(k);
      l.lock();
      if (--running == 0 && next >= n) idle.notify_all();
    }
  }
};
}  // namespace

RunParts ClaimingRunParts(std::function<void(std::function<void()>)> submit, int helpers) {
  return [submit = std::move(submit), helpers](int n, const std::function<void(int)>& task) {
    auto c = std::make_shared<Claims>();
    c->task = &task;
    c->n = n;
    for (int i = 0; i < std::min(helpers, n - 1); ++i) submit([c] { c->Work(); });
    c->Work();
    std::unique_lock<std::mutex> l(c->mu);
    c->idle.wait(l, [&] { return c->running == 0; });
  };
}

int AttendSplitParts(int64_t min_tokens, int idle, int workers) {
  if (min_tokens <= 0 || idle <= 0) return 1;
  return std::max(1, std::min({idle + 1, kMaxAttendParts, workers}));
}

}  // namespace kvq::core
