// One tenant's prefix index: sealed groups by the chained key of their token ids, each held
// by the sequences using it and retained (a cache, least recently used first) once none is.
// Private to the store; the store counts the bytes it returns against tenant and capacity.
#pragma once

#include <cstdint>
#include <optional>
#include <set>
#include <span>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/time/time.h"
#include "kvq/core/cache.h"
#include "kvq/core/codec.h"
#include "kvq/core/registry.h"

namespace kvq::core {

// A 128-bit chained key (XXH3-128 low, high).
using PrefixKey = std::pair<uint64_t, uint64_t>;

// The root of a layer's prefix chain: everything that must match for two sequences' blocks
// to be interchangeable (model, version, fingerprint, basis, every codec setting, layer).
PrefixKey PrefixSeed(const ModelEntry& m, const CodecOptions& c, int layer);

// The key of a group: XXH3-128 over (the previous key, the group's g <= 128 token ids).
PrefixKey ChainKey(const PrefixKey& prev, const uint32_t* ids, int g);

class PrefixIndex {
 public:
  struct Entry {
    SealedBlockPtr block;
    std::vector<uint64_t> hashes;  // arrival hashes of the G tokens (for re-sends)
    std::optional<PrefixKey> parent;
    std::vector<PrefixKey> children;
    int64_t refs = 0;  // sequences holding it (and appends pinning it)
    int64_t bytes = 0;
    absl::Time last_used;  // keys `retained_` while refs == 0
  };

  // A run of indexed groups an append takes instead of encoding them, held (pinned) once
  // each until the append hands every hold to its sequence or releases it.
  struct Run {
    std::vector<PrefixKey> keys;
    std::vector<SealedBlockPtr> blocks;
    std::vector<uint64_t> hashes;  // the groups' arrival hashes, in order
  };

  // Null when `key` is not indexed. Valid until the next Insert or Drop.
  const Entry* Find(const PrefixKey& key) const;

  // Indexes `block` under `key` (absent), held once, extending `parent` when given. Returns
  // the bytes it is counted at (IndexedGroupBytes).
  int64_t Insert(const PrefixKey& key, std::optional<PrefixKey> parent, SealedBlockPtr block,
                 std::span<const uint64_t> hashes, absl::Time now);

  // One holder more; false (and nothing changes) when `key` is not indexed.
  bool Hold(const PrefixKey& key);
  // One holder fewer; true when nobody holds it now (it is retained).
  bool Release(const PrefixKey& key);
  // Marks the entry used at `now` (no-op when absent).
  void Touch(const PrefixKey& key, absl::Time now);

  // Holds the longest run of indexed groups continuing the chain after `prev` with `ids`
  // (whole groups of `group` ids, at most `max_groups`).
  Run HoldRun(PrefixKey prev, std::span<const uint32_t> ids, int group, int64_t max_groups);
  // How many groups HoldRun would hold now, holding and touching nothing.
  int64_t RunLength(PrefixKey prev, std::span<const uint32_t> ids, int group,
                    int64_t max_groups) const;

  // Drops the entry and every entry extending it (none of which is held when it is not: a
  // holder of an extension holds its prefix too); returns the bytes freed. The key is taken
  // by value: a caller may pass one that lives in the index (DropRetained passes the front of
  // the retained set, which the drop erases).
  int64_t Drop(PrefixKey key);
  // Drops retained entries, least recently used first with their extensions, until `need`
  // bytes are freed or none is left (need <= 0: every one idle since before `older_than`);
  // returns the bytes freed.
  int64_t DropRetained(int64_t need, absl::Time older_than = absl::InfiniteFuture());
  // The retained entries whose block fails its checksum.
  std::vector<PrefixKey> CorruptRetained() const;

  int64_t entries() const { return static_cast<int64_t>(entries_.size()); }
  int64_t bytes() const { return bytes_; }
  int64_t retained_bytes() const { return retained_bytes_; }

 private:
  absl::flat_hash_map<PrefixKey, Entry> entries_;
  // The entries no one holds, least recently used first: pressure drops the front, O(log n)
  // per dropped entry rather than a scan of the index.
  std::set<std::pair<absl::Time, PrefixKey>> retained_;
  int64_t bytes_ = 0;
  int64_t retained_bytes_ = 0;
};

}  // namespace kvq::core
