// A fixed pool of worker threads running submitted closures in FIFO order.
#pragma once

#include <deque>
#include <functional>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"

namespace kvq::server {

class WorkerPool {
 public:
  explicit WorkerPool(int threads) {
    for (int i = 0; i < threads; ++i) threads_.emplace_back([this] { Run(); });
  }
  // Runs every queued closure, then joins.
  ~WorkerPool() {
    {
      absl::MutexLock l(&mu_);
      stop_ = true;
    }
    for (auto& t : threads_) t.join();
  }
  void Submit(std::function<void()> fn) {
    absl::MutexLock l(&mu_);
    queue_.push_back(std::move(fn));
  }
  size_t size() const { return threads_.size(); }

 private:
  void Run() {
    for (;;) {
      std::function<void()> fn;
      {
        absl::MutexLock l(&mu_);
        mu_.Await(absl::Condition(
            +[](WorkerPool* p) { return p->stop_ || !p->queue_.empty(); }, this));
        if (queue_.empty()) return;  // stop_ and drained
        fn = std::move(queue_.front());
        queue_.pop_front();
      }
      fn();
    }
  }

  absl::Mutex mu_;
  std::deque<std::function<void()>> queue_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::thread> threads_;
};

}  // namespace kvq::server
