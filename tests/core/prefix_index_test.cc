// The prefix index on its own (core/src/store/prefix_index.h, private to the store): chained keys,
// insert and lookup, holds and retention, dropping with extensions, and the bytes it counts.
// The store's use of it is in prefix_test.cc.
#include "core/src/store/prefix_index.h"

#include <memory>
#include <vector>

#include "gtest/gtest.h"

namespace kvq::core {
namespace {

constexpr int kG = 4;

// A group whose block holds `bytes` bytes (capacity exactly that), or a block that fails its
// checksum (a truncated one).
SealedBlockPtr Block(size_t bytes = 0, bool corrupt = false) {
  auto b = std::make_shared<SealedBlock>();
  b->bytes.reserve(bytes);
  if (corrupt) {
    b->bytes.assign(4, 0);
    b->offsets = {0, 4};
  }
  return b;
}

std::vector<uint64_t> Hashes(uint64_t base, int n = kG) {
  std::vector<uint64_t> h(n);
  for (int i = 0; i < n; ++i) h[i] = base * 100 + i;
  return h;
}

absl::Time At(int seconds) { return absl::FromUnixSeconds(1700000000 + seconds); }

const PrefixKey kRoot{1, 2};

// The chain key of ids [0, groups * kG) of `ids` after kRoot.
PrefixKey KeyOf(const std::vector<uint32_t>& ids, int groups) {
  PrefixKey k = kRoot;
  for (int g = 0; g < groups; ++g) k = ChainKey(k, ids.data() + g * kG, kG);
  return k;
}

// Indexes the first `groups` groups of `ids` as one chain, each held once and group g used at
// now + g seconds; returns the keys.
std::vector<PrefixKey> InsertChain(PrefixIndex& index, const std::vector<uint32_t>& ids, int groups,
                                   absl::Time now) {
  std::vector<PrefixKey> keys;
  for (int g = 0; g < groups; ++g) {
    const PrefixKey k = KeyOf(ids, g + 1);
    index.Insert(k, g > 0 ? std::optional<PrefixKey>(keys.back()) : std::nullopt, Block(),
                 Hashes(g), now + absl::Seconds(g));
    keys.push_back(k);
  }
  return keys;
}

TEST(ChainKeyTest, DependsOnThePreviousKeyAndEveryId) {
  std::vector<uint32_t> ids = {5, 6, 7, 8};
  const PrefixKey k = ChainKey(kRoot, ids.data(), kG);
  EXPECT_EQ(ChainKey(kRoot, ids.data(), kG), k);
  EXPECT_NE(ChainKey({1, 3}, ids.data(), kG), k);
  EXPECT_NE(ChainKey(kRoot, ids.data(), kG - 1), k);
  ids[3] = 9;
  EXPECT_NE(ChainKey(kRoot, ids.data(), kG), k);
}

TEST(PrefixIndexTest, InsertedGroupsAreFoundHeldAndLinkedToTheirParent) {
  PrefixIndex index;
  const std::vector<uint32_t> ids = {1, 2, 3, 4, 5, 6, 7, 8};
  const std::vector<PrefixKey> keys = InsertChain(index, ids, 2, At(0));
  EXPECT_EQ(index.entries(), 2);
  const std::vector<uint32_t> longer = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12};
  EXPECT_EQ(index.Find(KeyOf(longer, 3)), nullptr);  // a third group was never inserted
  const PrefixIndex::Entry* first = index.Find(keys[0]);
  const PrefixIndex::Entry* second = index.Find(keys[1]);
  ASSERT_NE(first, nullptr);
  ASSERT_NE(second, nullptr);
  EXPECT_EQ(first->refs, 1);
  EXPECT_FALSE(first->parent.has_value());
  EXPECT_EQ(first->children, std::vector<PrefixKey>{keys[1]});
  ASSERT_TRUE(second->parent.has_value());
  EXPECT_EQ(*second->parent, keys[0]);
  EXPECT_EQ(second->hashes, Hashes(1));
  EXPECT_EQ(index.bytes(), first->bytes + second->bytes);
  EXPECT_EQ(index.retained_bytes(), 0);  // both held
}

// The counted bytes follow what the group holds: its block's capacity and its hashes.
TEST(PrefixIndexTest, CountsEachGroupsBlockAndHashes) {
  PrefixIndex index;
  const int64_t empty = index.Insert({1, 1}, std::nullopt, Block(0), Hashes(0), At(0));
  const int64_t big = index.Insert({2, 2}, std::nullopt, Block(1000), Hashes(0), At(0));
  const int64_t more_hashes =
      index.Insert({3, 3}, std::nullopt, Block(0), Hashes(0, 2 * kG), At(0));
  EXPECT_GT(empty, 0);  // the bookkeeping alone
  EXPECT_EQ(big - empty, 1000);
  EXPECT_EQ(more_hashes - empty, kG * static_cast<int64_t>(sizeof(uint64_t)));
  EXPECT_EQ(index.bytes(), empty + big + more_hashes);
}

TEST(PrefixIndexTest, AnEntryIsRetainedExactlyWhileNobodyHoldsIt) {
  PrefixIndex index;
  const PrefixKey k{7, 7};
  const int64_t bytes = index.Insert(k, std::nullopt, Block(), Hashes(0), At(0));
  EXPECT_TRUE(index.Hold(k));  // two holders
  EXPECT_FALSE(index.Release(k));
  EXPECT_EQ(index.retained_bytes(), 0);
  EXPECT_TRUE(index.Release(k));  // none left
  EXPECT_EQ(index.retained_bytes(), bytes);
  EXPECT_EQ(index.Find(k)->refs, 0);
  EXPECT_TRUE(index.Hold(k));  // held again: no longer retained
  EXPECT_EQ(index.retained_bytes(), 0);
  EXPECT_FALSE(index.Hold({8, 8}));  // not indexed
  EXPECT_FALSE(index.Release({8, 8}));
  EXPECT_EQ(index.DropRetained(1), 0);  // nothing retained to drop
  EXPECT_EQ(index.entries(), 1);
}

TEST(PrefixIndexTest, DropTakesEveryExtensionAndLeavesThePrefix) {
  PrefixIndex index;
  const std::vector<uint32_t> ids = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12};
  const std::vector<PrefixKey> chain = InsertChain(index, ids, 3, At(0));
  // A sibling of the second group: another continuation of the first.
  const PrefixKey sibling{42, 42};
  index.Insert(sibling, chain[0], Block(), Hashes(9), At(0));
  const int64_t before = index.bytes();
  const int64_t dropped = index.Find(chain[1])->bytes + index.Find(chain[2])->bytes;
  for (const PrefixKey& k : chain) index.Release(k);
  index.Release(sibling);
  EXPECT_EQ(index.Drop(chain[1]), dropped);
  EXPECT_EQ(index.bytes(), before - dropped);
  EXPECT_EQ(index.retained_bytes(), index.bytes());
  EXPECT_EQ(index.Find(chain[1]), nullptr);
  EXPECT_EQ(index.Find(chain[2]), nullptr);
  ASSERT_NE(index.Find(chain[0]), nullptr);
  EXPECT_EQ(index.Find(chain[0])->children, std::vector<PrefixKey>{sibling});
  EXPECT_EQ(index.Drop(chain[1]), 0);  // already gone
}

TEST(PrefixIndexTest, PressureDropsTheLeastRecentlyUsedRetainedChainFirst) {
  PrefixIndex index;
  const std::vector<uint32_t> old_ids = {1, 2, 3, 4, 5, 6, 7, 8};
  const std::vector<uint32_t> new_ids = {9, 10, 11, 12, 13, 14, 15, 16};
  const std::vector<PrefixKey> old_chain = InsertChain(index, old_ids, 2, At(0));
  const std::vector<PrefixKey> new_chain = InsertChain(index, new_ids, 2, At(10));
  for (const PrefixKey& k : old_chain) index.Release(k);
  for (const PrefixKey& k : new_chain) index.Release(k);
  // One byte needed: the least recently used entry goes, with its extension.
  const int64_t old_bytes = index.Find(old_chain[0])->bytes + index.Find(old_chain[1])->bytes;
  EXPECT_EQ(index.DropRetained(1), old_bytes);
  EXPECT_EQ(index.Find(old_chain[1]), nullptr);
  EXPECT_NE(index.Find(new_chain[0]), nullptr);
  // By age: nothing idle since before t = 10 is left; everything is before t = 12.
  EXPECT_EQ(index.DropRetained(0, At(10)), 0);
  EXPECT_GT(index.DropRetained(0, At(12)), 0);
  EXPECT_EQ(index.entries(), 0);
  EXPECT_EQ(index.bytes(), 0);
  EXPECT_EQ(index.retained_bytes(), 0);
}

TEST(PrefixIndexTest, TouchingARetainedEntryMovesItToTheBackOfTheQueue) {
  PrefixIndex index;
  const PrefixKey a{1, 1}, b{2, 2};
  index.Insert(a, std::nullopt, Block(), Hashes(0), At(0));
  index.Insert(b, std::nullopt, Block(), Hashes(1), At(5));
  index.Release(a);
  index.Release(b);
  index.Touch(a, At(20));
  EXPECT_EQ(index.Find(a)->last_used, At(20));
  index.DropRetained(1);
  EXPECT_EQ(index.Find(b), nullptr);
  EXPECT_NE(index.Find(a), nullptr);
  EXPECT_EQ(index.retained_bytes(), index.Find(a)->bytes);
}

TEST(PrefixIndexTest, HoldRunPinsTheLongestIndexedRunWithinTheLimit) {
  PrefixIndex index;
  const std::vector<uint32_t> ids = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13};
  const std::vector<PrefixKey> chain = InsertChain(index, ids, 3, At(0));
  for (const PrefixKey& k : chain) index.Release(k);  // all retained
  // Every group the ids name, up to the limit: the 13th id is no whole group.
  PrefixIndex::Run all = index.HoldRun(kRoot, ids, kG, 10);
  EXPECT_EQ(all.keys, chain);
  ASSERT_EQ(all.blocks.size(), 3u);
  EXPECT_EQ(all.blocks[1], index.Find(chain[1])->block);
  std::vector<uint64_t> hashes = Hashes(0);
  for (int g = 1; g < 3; ++g) {
    const std::vector<uint64_t> h = Hashes(g);
    hashes.insert(hashes.end(), h.begin(), h.end());
  }
  EXPECT_EQ(all.hashes, hashes);
  EXPECT_EQ(index.retained_bytes(), 0);
  for (const PrefixKey& k : chain) EXPECT_EQ(index.Find(k)->refs, 1);
  // The limit, and a different id in the second group, stop the run.
  EXPECT_EQ(index.HoldRun(kRoot, ids, kG, 1).keys, std::vector<PrefixKey>{chain[0]});
  std::vector<uint32_t> other = ids;
  other[5] = 99;
  EXPECT_EQ(index.HoldRun(kRoot, other, kG, 10).keys, std::vector<PrefixKey>{chain[0]});
  EXPECT_EQ(index.Find(chain[0])->refs, 3);
  EXPECT_EQ(index.Find(chain[1])->refs, 1);
  // Another chain root finds nothing.
  EXPECT_TRUE(index.HoldRun({9, 9}, ids, kG, 10).keys.empty());
}

TEST(PrefixIndexTest, OnlyRetainedEntriesFailingTheirChecksumAreReportedCorrupt) {
  PrefixIndex index;
  const PrefixKey good{1, 1}, bad{2, 2}, bad_but_held{3, 3};
  index.Insert(good, std::nullopt, Block(), Hashes(0), At(0));
  index.Insert(bad, std::nullopt, Block(0, true), Hashes(1), At(0));
  index.Insert(bad_but_held, std::nullopt, Block(0, true), Hashes(2), At(0));
  index.Release(good);
  index.Release(bad);
  EXPECT_EQ(index.CorruptRetained(), std::vector<PrefixKey>{bad});
}

}  // namespace
}  // namespace kvq::core
