// A fixed pool of worker threads running submitted closures in FIFO order: the server's
// workers, and the second thread of a split Attend in the benchmarks and tests.
//
// Core itself owns no threads (the store, the caches and the kernels run on whichever thread
// calls them); this is a type the caller instantiates and owns, kept here so that the server,
// the benchmarks and the tests share one pool rather than each its own copy.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace kvq::core {

class WorkerPool {
 public:
  // `threads` workers (at least 1). spin_us > 0: a worker that runs out of work polls the
  // queue that many microseconds before it sleeps on the condition variable, so that work
  // submitted soon after (the next layer's Attend, a split Attend's helper) starts without
  // the tens of microseconds a sleeping vCPU of a VM takes to wake (kvq-bench-codec
  // AttendSplit: 2-thread scaling at head_dim 64 went from 1.60-1.82x to 1.79-1.96x). The
  // poll costs that much CPU per idle spell, so leave it 0 where cores are shared.
  explicit WorkerPool(int threads, int spin_us = 0);
  // Runs every closure still queued, then joins the workers. Submit must not race with it.
  ~WorkerPool();
  WorkerPool(const WorkerPool&) = delete;
  WorkerPool& operator=(const WorkerPool&) = delete;

  void Submit(std::function<void()> fn);
  size_t size() const { return threads_.size(); }
  // Workers with nothing to do: those waiting (polling or asleep) less the closures queued
  // that none has taken yet, at least 0. A snapshot, stale as soon as it is read: a hint for
  // how much parallelism a call may ask for, never a promise that a submitted closure starts.
  int idle() const;

 private:
  void Run();

  const int spin_us_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> queue_;  // guarded by mu_
  bool stop_ = false;                        // guarded by mu_
  int sleeping_ = 0;                         // workers blocked on cv_; guarded by mu_
  // Read without the lock (idle(), the poll): changed under mu_ with the queue.
  std::atomic<int> queued_{0};
  std::atomic<int> waiting_;  // workers not running a closure
  std::vector<std::thread> threads_;
};

}  // namespace kvq::core
