#include "server/idle_streams.h"

#include <algorithm>
#include <utility>
#include <vector>

namespace kvq::server {

IdleStreams::IdleStreams(absl::Duration timeout) : timeout_(timeout) {
  if (timeout_ > absl::ZeroDuration()) thread_ = std::thread([this] { Run(); });
}

IdleStreams::~IdleStreams() {
  {
    absl::MutexLock l(&mu_);
    stop_ = true;
  }
  if (thread_.joinable()) thread_.join();
}

void IdleStreams::Add(IdleStream* s) {
  absl::MutexLock l(&mu_);
  active_[s] = absl::Now();
}

void IdleStreams::Touch(IdleStream* s) {
  absl::MutexLock l(&mu_);
  auto it = active_.find(s);
  if (it != active_.end()) it->second = absl::Now();
}

void IdleStreams::Remove(IdleStream* s) {
  absl::MutexLock l(&mu_);
  active_.erase(s);
}

void IdleStreams::Run() {
  // Streams expire between `timeout` and `timeout + tick` after their last message.
  const absl::Duration tick = std::clamp(timeout_ / 4, absl::Milliseconds(1), absl::Seconds(1));
  for (;;) {
    std::vector<std::pair<IdleStream*, absl::Duration>> expired;
    {
      absl::MutexLock l(&mu_);
      auto stop = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stop_; };
      if (mu_.AwaitWithTimeout(absl::Condition(&stop), tick)) return;
      const absl::Time now = absl::Now();
      for (auto it = active_.begin(); it != active_.end();) {
        auto next = std::next(it);
        if (now - it->second >= timeout_ && it->first->ClaimIdle()) {
          expired.emplace_back(it->first, now - it->second);
          active_.erase(it);
        }
        it = next;
      }
    }
    // Claimed streams are finished by nobody else, so they stay alive until failed here.
    for (const auto& [s, idle] : expired) s->ExpireIdle(idle);
  }
}

}  // namespace kvq::server
