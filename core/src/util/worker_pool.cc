#include "kvq/core/worker_pool.h"

#include <algorithm>
#include <chrono>

#include "kvq/core/cache.h"

namespace kvq::core {
namespace {

// One spin-wait step: tells the core (and its hyperthread sibling) that this is a poll.
inline void CpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

}  // namespace

WorkerPool::WorkerPool(int threads, int spin_us)
    : spin_us_(std::max(0, spin_us)), waiting_(std::max(1, threads)) {
  for (int i = 0; i < std::max(1, threads); ++i) threads_.emplace_back([this] { Run(); });
}

WorkerPool::~WorkerPool() {
  {
    std::lock_guard<std::mutex> l(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  for (auto& t : threads_) t.join();
}

void WorkerPool::Submit(std::function<void()> fn) {
  bool wake;
  {
    std::lock_guard<std::mutex> l(mu_);
    queue_.push_back(std::move(fn));
    queued_.fetch_add(1, std::memory_order_release);
    wake = sleeping_ > 0;  // a polling worker sees queued_ without a notification
  }
  if (wake) cv_.notify_one();
}

int WorkerPool::idle() const {
  return std::max(
      0, waiting_.load(std::memory_order_acquire) - queued_.load(std::memory_order_acquire));
}

void WorkerPool::Run() {
  std::unique_lock<std::mutex> l(mu_);
  for (;;) {
    if (queue_.empty() && !stop_ && spin_us_ > 0) {
      l.unlock();
      const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(spin_us_);
      while (queued_.load(std::memory_order_acquire) == 0 &&
             std::chrono::steady_clock::now() < until)
        CpuRelax();
      l.lock();
    }
    if (queue_.empty() && !stop_) {
      ++sleeping_;
      cv_.wait(l, [&] { return stop_ || !queue_.empty(); });
      --sleeping_;
    }
    if (queue_.empty()) return;  // stopping, and drained
    std::function<void()> fn = std::move(queue_.front());
    queue_.pop_front();
    // Busy before the closure leaves the queue, so that idle() never counts it twice.
    waiting_.fetch_sub(1, std::memory_order_release);
    queued_.fetch_sub(1, std::memory_order_release);
    l.unlock();
    fn();
    fn = nullptr;  // its captures are released before the worker counts as idle
    waiting_.fetch_add(1, std::memory_order_release);
    l.lock();
  }
}

RunParts ClaimingRunParts(WorkerPool* pool, int helpers) {
  return ClaimingRunParts([pool](std::function<void()> fn) { pool->Submit(std::move(fn)); },
                          helpers);
}

}  // namespace kvq::core
