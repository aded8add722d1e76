// Which sequences a write must evict to fit its tenant's quota and the store's capacity. A
// pure function over the store's accounting and its LRU order: the store plans first and
// evicts only when the whole write fits (a write that cannot fit evicts nothing).
//
// The rules (docs/API.md, "Eviction"): over the quota, the writer's own least recently used
// sequences go; over the capacity, the least recently used sequence of any tenant holding more
// than an equal share of the capacity (the writer counted without this write), else the
// writer's own. Evicting a sequence frees its own bytes and every shared prefix block that no
// surviving sequence holds. (Retained prefix blocks that no sequence holds are a cache the
// store drops before it plans.)
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/functional/function_ref.h"

namespace kvq::core {

// A sequence as planning sees it.
struct EvictionCandidate {
  const void* handle = nullptr;  // the store's sequence; unique among candidates
  std::string_view tenant;
  int64_t bytes = 0;  // its own counted bytes
  struct Block {
    const void* key = nullptr;  // unique among the blocks of every candidate
    int64_t bytes = 0;
    int64_t holders = 0;  // sequences holding it now
  };
  std::vector<Block> blocks;  // the shared prefix blocks it holds
};

struct EvictionRequest {
  std::string_view writer;
  int64_t write_bytes = 0;
  int64_t quota = 0;     // per tenant; 0: none
  int64_t capacity = 0;  // of the store; 0: none
  int64_t used_bytes = 0;
  // What each tenant holds now (a tenant absent holds nothing).
  absl::flat_hash_map<std::string_view, int64_t> tenant_bytes;
};

struct EvictionPlan {
  bool fits = false;
  std::vector<const void*> victims;  // in the order they are chosen
  // Candidates looked at: linear in the candidates, however many are chosen (each search
  // resumes where the last stopped; a sequence skipped once stays skipped, since owners only
  // shrink while planning).
  int64_t steps = 0;
};

// `order(i)`: candidate i in LRU order, least recently used first, or null past the end; the
// sequences the write appends to are not candidates. Called with increasing indices from two
// cursors, so an order over a linked list can materialize candidates lazily.
EvictionPlan PlanEviction(const EvictionRequest& request,
                          absl::FunctionRef<const EvictionCandidate*(size_t)> order);

}  // namespace kvq::core
