// WorkerPool: FIFO order, the idle count, draining at destruction, with and without the poll
// before sleeping. Gates (a closure blocked on a mutex the test holds) make every state
// deterministic; nothing here depends on timing. Gates outlive their pools.
#include "kvq/core/worker_pool.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <future>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace kvq::core {
namespace {

class WorkerPoolTest : public ::testing::TestWithParam<int> {};  // the spin_us

// A closure that blocks its worker until Open(); Started() waits until a worker runs it.
class Gate {
 public:
  Gate() { mu_.lock(); }
  ~Gate() { Open(); }
  std::function<void()> Closure() {
    return [this] {
      started_.set_value();
      std::lock_guard<std::mutex> l(mu_);
    };
  }
  void Started() { started_.get_future().wait(); }
  void Open() {
    if (!open_) mu_.unlock();
    open_ = true;
  }

 private:
  std::mutex mu_;
  std::promise<void> started_;
  bool open_ = false;
};

TEST_P(WorkerPoolTest, OneThreadRunsClosuresInSubmissionOrder) {
  std::vector<int> order;
  Gate gate;
  {
    WorkerPool pool(1, GetParam());
    pool.Submit(gate.Closure());
    gate.Started();
    for (int i = 0; i < 100; ++i) pool.Submit([&order, i] { order.push_back(i); });
    gate.Open();
  }
  ASSERT_EQ(order.size(), 100u);
  for (int i = 0; i < 100; ++i) EXPECT_EQ(order[i], i);
}

TEST_P(WorkerPoolTest, IdleCountsWaitingWorkersLessQueuedClosures) {
  Gate a, b;  // outlive the pool, which may still be leaving their closures
  WorkerPool pool(2, GetParam());
  EXPECT_EQ(pool.size(), 2u);
  EXPECT_EQ(pool.idle(), 2);  // started with nothing to do
  pool.Submit(a.Closure());
  a.Started();
  EXPECT_EQ(pool.idle(), 1);  // one worker runs a
  pool.Submit(b.Closure());
  b.Started();
  EXPECT_EQ(pool.idle(), 0);  // both run
  std::atomic<bool> ran{false};
  pool.Submit([&ran] { ran = true; });
  EXPECT_EQ(pool.idle(), 0);  // queued behind both: still none idle, never negative
  a.Open();
  b.Open();
  // Both workers come back to waiting once the queue drained (liveness: bounded, not timed).
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (pool.idle() != 2 && std::chrono::steady_clock::now() < deadline) std::this_thread::yield();
  EXPECT_TRUE(ran);
  EXPECT_EQ(pool.idle(), 2);
}

TEST_P(WorkerPoolTest, DestructionRunsEveryQueuedClosure) {
  std::atomic<int> ran{0};
  Gate gate;
  {
    WorkerPool pool(1, GetParam());  // its one worker blocked: all 1000 still queued
    pool.Submit(gate.Closure());
    gate.Started();
    for (int i = 0; i < 1000; ++i) pool.Submit([&ran] { ran.fetch_add(1); });
    gate.Open();
  }  // joins only after the queue drained
  EXPECT_EQ(ran.load(), 1000);
}

TEST_P(WorkerPoolTest, ClosureCapturesAreReleasedBeforeTheWorkerIsIdleAgain) {
  Gate gate;  // the next closure starts only after the first one (and its captures) finished
  WorkerPool pool(1, GetParam());
  auto held = std::make_shared<int>(7);
  std::weak_ptr<int> watch = held;
  std::promise<void> ran;
  pool.Submit([held = std::move(held), &ran] { ran.set_value(); });
  ran.get_future().wait();
  pool.Submit(gate.Closure());
  gate.Started();
  EXPECT_TRUE(watch.expired());
  gate.Open();  // before the pool joins its worker
}

INSTANTIATE_TEST_SUITE_P(SleepOrPoll, WorkerPoolTest, ::testing::Values(0, 50),
                         [](const ::testing::TestParamInfo<int>& p) {
                           return p.param == 0 ? std::string("Sleep") : std::string("Poll50us");
                         });

}  // namespace
}  // namespace kvq::core
