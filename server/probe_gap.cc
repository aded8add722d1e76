#include "server/probe_gap.h"

#include <utility>

namespace kvq::server {

ProbeGapWatch::ProbeGapWatch(absl::Duration max_gap, std::function<absl::Time()> now)
    : max_gap_(max_gap), now_(std::move(now)) {}

std::optional<absl::Duration> ProbeGapWatch::Probe(const std::string& prober) {
  const absl::Time now = now_();
  absl::MutexLock l(&mu_);
  auto it = last_.find(prober);
  if (it == last_.end()) {
    if (last_.size() >= kMaxProbers) {
      auto oldest = last_.begin();
      for (auto p = last_.begin(); p != last_.end(); ++p) {
        if (p->second < oldest->second) oldest = p;
      }
      last_.erase(oldest);
    }
    last_.emplace(prober, now);
    return std::nullopt;
  }
  const absl::Duration gap = now - it->second;
  it->second = now;
  if (gap > max_gap_) return gap;
  return std::nullopt;
}

}  // namespace kvq::server
