// The store's state and its methods, private to core: Store (kvq/core/store.h) forwards every
// call here (LevelDB's DB and DBImpl). store.cc: lifetimes, reads and accounting;
// store_append.cc: the write path; store_api.cc: the forwarding.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <list>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/time/time.h"
#include "core/src/store/prefix_index.h"
#include "kvq/core/mutex.h"
#include "kvq/core/store.h"

namespace kvq::core {

class StoreImpl {
 public:
  StoreImpl(StoreOptions opts, Registry* registry);
  ~StoreImpl();
  StoreImpl(const StoreImpl&) = delete;
  StoreImpl& operator=(const StoreImpl&) = delete;

  const StoreOptions& options() const { return opts_; }

  absl::Status Append(const std::string& tenant, const std::vector<AppendSpec>& batch,
                      AppendOutcome* outcome);

  absl::StatusOr<int64_t> Score(const LayerRef& at, const ReadRows& q, float scale,
                                bool corrections_only, std::vector<float>* out);
  absl::StatusOr<int64_t> Readout(const LayerRef& at, const ReadRows& p, bool as_logits,
                                  std::vector<float>* out);
  absl::StatusOr<int64_t> Attend(const LayerRef& at, const ReadRows& q, const AttendOptions& ao,
                                 std::vector<float>* out);
  absl::StatusOr<RangeRead> Decode(const LayerRef& at, TokenRange range, std::vector<float>* keys,
                                   std::vector<float>* values);
  absl::StatusOr<RangeRead> DecodeAs(const LayerRef& at, TokenRange range, DType dtype,
                                     std::vector<uint8_t>* keys, std::vector<uint8_t>* values);
  absl::StatusOr<RangeRead> ReadEncoded(const LayerRef& at, TokenRange range, DType dtype,
                                        EncodedGroups* groups, std::vector<uint8_t>* keys,
                                        std::vector<uint8_t>* values);
  absl::Status VerifyLayer(const LayerRef& at);

  absl::StatusOr<SequenceInfo> Describe(const std::string& tenant, const std::string& sequence_id);
  absl::StatusOr<int64_t> IndexedPrefixTokens(const std::string& tenant, const PrefixProbe& probe);
  absl::StatusOr<int64_t> Delete(const std::string& tenant, const std::string& sequence_id);

  UsageStats TenantUsage(const std::string& tenant) const;
  UsageStats TotalUsage() const;
  std::vector<std::pair<std::string, UsageStats>> AllTenants() const;
  int64_t LiveSequences(const std::string& model, int version) const;

  int64_t Sweep();
  using Dropped = Store::Dropped;
  Dropped DropAll();
  int64_t Scrub();
  int64_t RetainedScrubDrops() const {
    MutexLock l(&mu_);
    return retained_scrub_drops_;
  }

  int64_t LastEvictionPlanStepsForTest() const {
    MutexLock l(&mu_);
    return last_plan_steps_;
  }
  LayerCache* LayerForTest(const std::string& tenant, const std::string& sequence_id, int layer);

  struct Sequence;
  struct Tenant;

 private:
  // One attempt of Append, in named steps (core/src/store/store_append.h).
  class AppendBatch;

  absl::StatusOr<std::shared_ptr<Sequence>> Find(const std::string& tenant, const std::string& id,
                                                 int basis_version);
  // The range reads' common part: finds the layer, resolves the range against its length
  // under the sequence's reader lock (verifying every block first when the range is the whole
  // layer) and calls read(cache, first, end, &found) there (found: what the read returns, its
  // first position already set); cache is null for a layer never appended.
  absl::StatusOr<RangeRead> ReadRange(
      const LayerRef& at, TokenRange range,
      const std::function<absl::Status(const LayerCache* cache, int64_t from, int64_t end,
                                       RangeRead* found)>& read);
  // Makes room for `bytes` more for `tenant`, evicting LRU sequences not in `keep`; the
  // evicted sequences go into *evicted (when given) so that the caller destroys them after
  // releasing mu_.
  absl::Status ReserveLocked(const std::string& tenant, int64_t bytes,
                             const std::vector<Sequence*>& keep,
                             std::vector<std::shared_ptr<Sequence>>* evicted = nullptr)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // drop: also drop the prefix blocks only this sequence held (eviction); else they stay
  // retained when StoreOptions::retain_prefixes.
  void UnlinkLocked(Sequence* s, bool drop) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The prefix index's steps that change what the tenant and the store count (prefix_index.h
  // for the rules). Release: one holder of `key` fewer; once none is left it stays retained,
  // or goes when `drop` or retaining is off.
  void ReleasePrefixLocked(Tenant& t, const std::pair<uint64_t, uint64_t>& key, bool drop)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Drops an entry and every entry that extends it; returns the bytes freed.
  int64_t DropPrefixLocked(Tenant& t, const std::pair<uint64_t, uint64_t>& key)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Drops retained entries of tenant t, least recently used first with their extensions,
  // until `need` bytes are freed (or none is left; need <= 0: every one idle since before
  // older_than); returns the bytes freed.
  int64_t DropRetainedLocked(Tenant& t, int64_t need,
                             absl::Time older_than = absl::InfiniteFuture())
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void TouchLocked(Sequence* s) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Re-measures a sequence after a change and fixes the accounting. Returns whether the store
  // or the sequence's tenant is now past its capacity or quota (a reservation is an estimate;
  // the caller then settles, ReserveLocked with 0 bytes), read under the same lock.
  bool Remeasure(Sequence* s, int64_t reserved);
  // The codec tables of (model entry, layer, codec), built on first use and shared by every
  // sequence's cache of that layer for as long as one holds them (kept weakly here).
  std::shared_ptr<const LayerCodecTables> LayerTables(const ModelEntry& model, int layer,
                                                      const CodecOptions& codec)
      ABSL_LOCKS_EXCLUDED(tables_mu_);

  StoreOptions opts_;
  Registry* registry_;
  mutable Mutex mu_;
  absl::flat_hash_map<std::string, std::unique_ptr<Tenant>> tenants_ ABSL_GUARDED_BY(mu_);
  std::list<Sequence*> lru_ ABSL_GUARDED_BY(mu_);  // front: most recent
  int64_t used_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t evictions_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t expirations_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t retained_scrub_drops_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t last_plan_steps_ ABSL_GUARDED_BY(mu_) = 0;
  Mutex tables_mu_;
  absl::flat_hash_map<std::string, std::weak_ptr<const LayerCodecTables>> tables_
      ABSL_GUARDED_BY(tables_mu_);
};

struct StoreImpl::Sequence {
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

  // Guarded by StoreImpl::mu_.
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

struct StoreImpl::Tenant {
  absl::flat_hash_map<std::string, std::shared_ptr<Sequence>> seqs;
  int64_t bytes = 0;  // stored + reserved, prefix index included
  int64_t evictions = 0;
  int64_t expirations = 0;
  PrefixIndex prefixes;  // its bytes are in `bytes` (and the store's used bytes)
  int64_t shared_tokens = 0;
};

// What a sequence takes besides its codes, windows and arrival hashes (store.cc says what).
int64_t SequenceOverheadBytes(const StoreImpl::Sequence& s);

}  // namespace kvq::core
