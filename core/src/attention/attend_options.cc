#include "kvq/core/attend_options.h"

#include <algorithm>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <utility>

namespace kvq::core {

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
