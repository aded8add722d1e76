#include "kvq/client/hash_ring.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "xxhash.h"

namespace kvq::client {

HashRing::HashRing(std::vector<std::string> servers, int virtual_nodes)
    : servers_(std::move(servers)) {
  points_.reserve(servers_.size() * static_cast<size_t>(std::max(1, virtual_nodes)));
  for (int s = 0; s < static_cast<int>(servers_.size()); ++s) {
    for (int v = 0; v < std::max(1, virtual_nodes); ++v) {
      const std::string point = absl::StrCat(servers_[s], "#", v);
      points_.emplace_back(XXH3_64bits(point.data(), point.size()), s);
    }
  }
  // Ties (astronomically rare) are broken by address so the ring does not depend on order.
  std::sort(points_.begin(), points_.end(), [this](const auto& a, const auto& b) {
    return a.first != b.first ? a.first < b.first : servers_[a.second] < servers_[b.second];
  });
}

int HashRing::Lookup(uint64_t key) const {
  auto it = std::lower_bound(points_.begin(), points_.end(), key,
                             [](const auto& p, uint64_t k) { return p.first < k; });
  if (it == points_.end()) it = points_.begin();
  return it->second;
}

std::string_view HashRing::HashTag(std::string_view sequence_id) {
  const size_t open = sequence_id.find('{');
  if (open == std::string_view::npos) return sequence_id;
  const size_t close = sequence_id.find('}', open + 1);
  if (close == std::string_view::npos || close == open + 1) return sequence_id;
  return sequence_id.substr(open + 1, close - open - 1);
}

uint64_t HashRing::KeyOf(std::string_view tenant, std::string_view sequence_id) {
  sequence_id = HashTag(sequence_id);
  std::string key;
  key.reserve(tenant.size() + 1 + sequence_id.size());
  key.append(tenant).push_back('\0');
  key.append(sequence_id);
  return XXH3_64bits(key.data(), key.size());
}

}  // namespace kvq::client
