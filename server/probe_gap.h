// The gaps between a router's health probes, per prober (kvq-server --drop-after-probe-gap,
// docs/ROUTER.md). A router (HAProxy) marks a shard down only after `fall` checks in a row
// failed and then sends the shard's keys to other shards, where a frontend re-puts and appends
// to them; the shard itself sees that time only as a gap in the router's probes. A probe that
// arrives after a gap longer than the router's check interval may therefore follow such a time,
// and the copies the shard holds may be stale.
#pragma once

#include <cstddef>
#include <functional>
#include <optional>
#include <string>

#include "absl/container/flat_hash_map.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace kvq::server {

class ProbeGapWatch {
 public:
  // max_gap > 0; now: the clock (tests pass a fake one).
  ProbeGapWatch(absl::Duration max_gap, std::function<absl::Time()> now);

  // Records a probe from `prober` (an identity: one router's probes must share it and no other
  // router's). Returns the gap since that prober's previous probe when it is longer than
  // max_gap; nullopt for a prober's first probe (a router that starts has routed nothing
  // elsewhere yet) and for one within max_gap.
  std::optional<absl::Duration> Probe(const std::string& prober);

  // Probers remembered at most; a new one beyond them replaces the one heard from least
  // recently (a router's replicas come and go with new addresses).
  static constexpr size_t kMaxProbers = 256;

 private:
  const absl::Duration max_gap_;
  const std::function<absl::Time()> now_;
  absl::Mutex mu_;
  absl::flat_hash_map<std::string, absl::Time> last_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kvq::server
