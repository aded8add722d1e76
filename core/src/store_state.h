// What the store keeps per sequence and per tenant: private to the store's sources
// (store.cc: lifetimes, reads and accounting; store_append.cc: the write path).
#pragma once

#include <atomic>
#include <cstdint>
#include <list>
#include <memory>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/time/time.h"
#include "kvq/core/store.h"
#include "prefix_index.h"

namespace kvq::core {

struct Store::Sequence {
  std::string tenant, id;
  std::shared_ptr<const ModelEntry> model;
  CodecOptions codec;

  Mutex mu;
  std::vector<std::unique_ptr<LayerCache>> layers ABSL_GUARDED_BY(mu);
  // Per layer, per stored token: hash of the bytes it arrived as, for idempotent re-sends.
  // The tokens of indexed (sealed) groups keep theirs in the prefix index instead (the hashes
  // of the sequence that first stored the group): hashes[l] holds tokens from
  // hash_base[l] = (indexed groups) x G on. Length(l) is the layer's token count.
  std::vector<std::vector<uint64_t>> hashes ABSL_GUARDED_BY(mu);
  std::vector<int64_t> hash_base ABSL_GUARDED_BY(mu);
  int64_t Length(int layer) const ABSL_SHARED_LOCKS_REQUIRED(mu) {
    return hash_base[layer] + static_cast<int64_t>(hashes[layer].size());
  }
  // Per layer: prefix-sharing state.
  struct LayerPrefix {
    bool open = true;                   // every append so far carried token ids
    PrefixKey seed;                     // the chain's root (PrefixSeed), set at creation
    std::vector<PrefixKey> block_keys;  // key of each sealed group
    std::vector<uint32_t> pending_ids;  // ids of the tokens after the sealed groups
  };
  std::vector<LayerPrefix> prefix ABSL_GUARDED_BY(mu);
  bool dtype_set ABSL_GUARDED_BY(mu) = false;
  DType dtype ABSL_GUARDED_BY(mu) = DType::kF32;
  std::atomic<bool> corrupt{false};

  // Guarded by Store::mu_.
  std::vector<PrefixKey> node_keys;  // prefix-index entries this sequence holds
  int64_t bytes = 0;
  int64_t tokens = 0;
  int64_t blocks = 0;
  int64_t elements = 0;
  SizeReport size;
  absl::Time last_used;
  std::list<Sequence*>::iterator lru;
  bool linked = false;
};

struct Store::Tenant {
  absl::flat_hash_map<std::string, std::shared_ptr<Sequence>> seqs;
  int64_t bytes = 0;  // stored + reserved, prefix index included
  int64_t evictions = 0;
  int64_t expirations = 0;
  PrefixIndex prefixes;  // its bytes are in `bytes` (and the store's used bytes)
  int64_t shared_tokens = 0;
};

}  // namespace kvq::core
