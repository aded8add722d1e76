#include "core/src/store/eviction_planner.h"

#include <algorithm>

#include "absl/container/flat_hash_set.h"

namespace kvq::core {

EvictionPlan PlanEviction(const EvictionRequest& r,
                          absl::FunctionRef<const EvictionCandidate*(size_t)> order) {
  EvictionPlan plan;
  auto held = [&](std::string_view tenant) {
    auto it = r.tenant_bytes.find(tenant);
    return it == r.tenant_bytes.end() ? int64_t{0} : it->second;
  };
  int64_t writer_bytes = held(r.writer), used = r.used_bytes;
  absl::flat_hash_set<const void*> chosen;
  // Holders of each block that survive the plan so far.
  absl::flat_hash_map<const void*, int64_t> holders_left;
  auto choose = [&](const EvictionCandidate& v) {
    plan.victims.push_back(v.handle);
    chosen.insert(v.handle);
    int64_t freed = v.bytes;
    for (const EvictionCandidate::Block& b : v.blocks) {
      auto [left, fresh] = holders_left.try_emplace(b.key, b.holders);
      if (--left->second == 0) freed += b.bytes;
    }
    return freed;
  };
  // The next candidate from index i on that `ok` accepts (i moves past it).
  auto next = [&](size_t& i, auto ok) -> const EvictionCandidate* {
    for (;; ++i, ++plan.steps) {
      const EvictionCandidate* c = order(i);
      if (!c) return nullptr;
      if (!chosen.contains(c->handle) && ok(*c)) {
        ++i;
        return c;
      }
    }
  };
  auto own = [&](const EvictionCandidate& c) { return c.tenant == r.writer; };
  size_t own_at = 0;
  while (r.quota > 0 && writer_bytes + r.write_bytes > r.quota) {
    const EvictionCandidate* v = next(own_at, own);
    if (!v) return plan;
    const int64_t freed = choose(*v);
    writer_bytes -= freed;
    used -= freed;
  }
  int64_t active = held(r.writer) > 0 ? 0 : 1;  // the writer counts as active
  for (const auto& [name, bytes] : r.tenant_bytes) active += bytes > 0 ? 1 : 0;
  const int64_t share = r.capacity > 0 ? r.capacity / std::max<int64_t>(1, active) : 0;
  // Other tenants' bytes once their chosen victims are gone.
  absl::flat_hash_map<std::string_view, int64_t> after;
  auto over_share = [&](const EvictionCandidate& c) {
    if (c.tenant == r.writer) return writer_bytes > share;
    auto a = after.find(c.tenant);
    return (a != after.end() ? a->second : held(c.tenant)) > share;
  };
  size_t share_at = 0;
  own_at = 0;
  while (r.capacity > 0 && used + r.write_bytes > r.capacity) {
    const EvictionCandidate* v = next(share_at, over_share);
    if (!v) v = next(own_at, own);
    if (!v) return plan;
    const int64_t freed = choose(*v);
    if (v->tenant == r.writer) {
      writer_bytes -= freed;
    } else {
      auto [a, fresh] = after.try_emplace(v->tenant, held(v->tenant));
      a->second -= freed;
    }
    used -= freed;
  }
  plan.fits = true;
  return plan;
}

}  // namespace kvq::core
