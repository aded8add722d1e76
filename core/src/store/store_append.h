// StoreImpl::Append's steps, in the order Append takes them (LevelDB's DBImpl::Write split into
// named steps): find or create the sequences, lock them, plan every item, publish and reserve,
// apply. One AppendBatch is one attempt; a race with another writer starts a new one.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "core/src/store/store_impl.h"

namespace kvq::core {

class StoreImpl::AppendBatch {
 public:
  AppendBatch(StoreImpl& store, const std::string& tenant, const std::vector<AppendSpec>& batch)
      : store_(store), tenant_(tenant), batch_(batch) {}
  // Releases the prefix groups still pinned (an attempt that failed, raced or threw).
  ~AppendBatch();
  AppendBatch(const AppendBatch&) = delete;
  AppendBatch& operator=(const AppendBatch&) = delete;

  // 1. Finds each sequence the batch names, or makes the one its first append creates (not
  // visible to other calls until Publish).
  absl::Status FindOrCreateSequences();
  std::vector<Sequence*> sequences() const;

  // The steps below run with every sequence of sequences() locked (by Append's
  // SequenceLocks, a lock set the thread-safety analysis cannot follow: the methods that read
  // a sequence's guarded fields are marked ABSL_NO_THREAD_SAFETY_ANALYSIS).

  // 2. Validates the whole batch before anything is stored, simulating the lengths it
  // produces: each item's new tokens and duplicates, the prefix groups it takes from the
  // index (pinned there) and the bytes the batch may grow by.
  absl::Status Plan();
  // 3. Makes the new sequences visible and reserves the planned bytes, evicting as the rules
  // say. ABORTED when another call created, deleted or evicted one of the sequences since
  // step 1 (nothing changed; the caller starts again).
  absl::Status Publish(const std::vector<Sequence*>& locked);
  // 4. Applies the items in order. A failing item stops the batch there: the items before it
  // stay applied, and it leaves its sequence as it was (host memory running out excepted:
  // that sequence is marked corrupt). Then fixes the accounting and reports the lengths.
  absl::Status Apply(const std::vector<Sequence*>& locked, AppendOutcome* outcome);

 private:
  // What applying item i does, decided by Plan.
  struct ItemPlan {
    int64_t from = 0, n = 0;  // new tokens: [from, from + n) of the item's own range
    std::vector<uint64_t> new_hashes;
    // The first `attach.size()` groups of the new tokens come from the prefix index,
    // pinned there until Apply hands the holds to the sequence (then attach_keys is empty).
    std::vector<SealedBlockPtr> attach;
    std::vector<PrefixKey> attach_keys;
  };

  // Plan, per item.
  absl::Status PlanItem(size_t i);
  absl::Status CheckTarget(size_t i, const Sequence& s) const;
  absl::Status CheckTensors(size_t i, const Sequence& s) const;
  // The tokens of item i already stored (`overlap` of them from its start) must be what it
  // re-sends: the same bytes, or for an attach the same sealed groups.
  // Rows [0, count) of item i's keys and values, at positions from `pos` on.
  absl::Status CheckResentTokens(size_t i, const Sequence& s, int64_t pos, int64_t count,
                                 const std::vector<uint64_t>& pending) const;
  absl::Status CheckResentAttach(size_t i, const Sequence& s, int64_t overlap) const;
  // Pins the indexed groups item i takes instead of encoding them, when it may take any.
  // At most max_groups of them (-1: any).
  void PinIndexedGroups(size_t i, const Sequence& s, int64_t len, bool pending_empty,
                        int64_t max_groups = -1);
  absl::Status CheckProbeWeights(size_t i, int64_t n) const;
  // Plan for an item with encoded groups (AppendSpec::encoded), in place of PlanItem's steps.
  absl::Status PlanEncoded(size_t i, Sequence* s);
  // Its groups the layer holds already must be the same bytes.
  absl::Status CheckResentGroups(size_t i, const Sequence& s, int64_t g0, int64_t g1) const;

  // Apply, per item.
  absl::Status ApplyItem(size_t i, AppendOutcome* outcome);
  absl::Status ApplyEncoded(size_t i, AppendOutcome* outcome);
  // The layer's cache, made on first use.
  LayerCache& CacheFor(Sequence* s, int layer);
  // Attaches item i's pinned groups and hands their holds to the sequence; false when the
  // sequence was evicted meanwhile (nothing more is stored for it).
  absl::StatusOr<bool> AttachPinned(size_t i, Sequence* s, LayerCache& cache);
  // Encodes tokens [from, from + n) of item i into the cache.
  absl::Status AppendData(size_t i, Sequence* s, LayerCache& cache, int64_t from, int64_t n);
  // Indexes the groups the layer sealed since the last call (or holds the indexed copy).
  absl::Status IndexSealedGroups(Sequence* s, int layer);
  // After Apply: the new accounting, the new sequences a failure left empty removed, the
  // lengths reported.
  void Finish(const std::vector<Sequence*>& locked, bool failed, AppendOutcome* outcome);

  // Releases the pins not handed to a sequence: every item's, or items [from, to)'s.
  void ReleasePins();
  void ReleasePinsLocked(size_t from = 0, size_t to = SIZE_MAX)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(store_.mu_);

  StoreImpl& store_;
  const std::string& tenant_;
  const std::vector<AppendSpec>& batch_;
  absl::flat_hash_map<std::string, std::shared_ptr<Sequence>> seqs_;
  absl::flat_hash_set<std::string> fresh_;  // the ids of the sequences this batch creates
  std::vector<ItemPlan> plans_;
  // Item i's encoded groups placed at its start (AppendSpec::encoded's first_group is ignored).
  std::vector<EncodedGroupsView> runs_;
  // Per (sequence, layer): the hashes of the tokens the items planned so far add.
  absl::flat_hash_map<std::pair<Sequence*, int>, std::vector<uint64_t>> pending_;
  int64_t estimate_ = 0;    // the bytes reserved for the whole batch
  int64_t duplicates_ = 0;  // tokens re-sent identically
};

}  // namespace kvq::core
