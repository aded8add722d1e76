// PlanEviction alone, on hand-made LRU orders: who goes over the quota and over the capacity,
// what shared prefix blocks free, that a write that cannot fit gets no victims, and that
// planning many victims stays linear.
#include "core/src/store/eviction_planner.h"

#include <deque>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kvq::core {
namespace {

using ::testing::ElementsAre;
using ::testing::IsEmpty;

// Candidates in LRU order; handles are their indices + 1.
struct Lru {
  std::vector<EvictionCandidate> c;
  std::deque<std::string> tenants;  // the names the candidates view (a deque: they stay put)
  void Add(const std::string& tenant, int64_t bytes,
           std::vector<EvictionCandidate::Block> blocks = {}) {
    tenants.push_back(tenant);
    EvictionCandidate e;
    e.handle = reinterpret_cast<const void*>(c.size() + 1);
    e.tenant = tenants.back();
    e.bytes = bytes;
    e.blocks = std::move(blocks);
    c.push_back(std::move(e));
  }
  EvictionPlan Plan(const EvictionRequest& r) const {
    return PlanEviction(r, [&](size_t i) { return i < c.size() ? &c[i] : nullptr; });
  }
};

std::vector<size_t> Victims(const EvictionPlan& p) {
  std::vector<size_t> v;
  for (const void* h : p.victims) v.push_back(reinterpret_cast<size_t>(h) - 1);
  return v;
}

EvictionRequest Request(std::string_view writer, int64_t write, int64_t quota, int64_t cap) {
  EvictionRequest r;
  r.writer = writer;
  r.write_bytes = write;
  r.quota = quota;
  r.capacity = cap;
  return r;
}

TEST(EvictionPlanner, OverTheQuotaTheWritersOwnOldestGo) {
  Lru lru;
  lru.Add("a", 10);
  lru.Add("b", 10);
  lru.Add("a", 10);
  lru.Add("a", 10);
  EvictionRequest r = Request("a", 15, /*quota=*/40, 0);
  r.tenant_bytes = {{"a", 30}, {"b", 10}};
  r.used_bytes = 40;
  const EvictionPlan p = lru.Plan(r);
  EXPECT_TRUE(p.fits);
  EXPECT_THAT(Victims(p), ElementsAre(0));  // 30 - 10 + 15 <= 40; b is never touched
}

TEST(EvictionPlanner, OverTheCapacityTenantsAboveAnEqualShareGoFirst) {
  Lru lru;
  lru.Add("small", 10);
  lru.Add("big", 30);
  lru.Add("w", 10);
  lru.Add("big", 30);
  lru.Add("big", 30);
  // Three active tenants, capacity 120: a share is 40. big holds 90, small 10, the writer 10.
  EvictionRequest r = Request("w", 20, 0, /*capacity=*/120);
  r.tenant_bytes = {{"small", 10}, {"big", 90}, {"w", 10}};
  r.used_bytes = 110;
  EvictionPlan p = lru.Plan(r);
  EXPECT_TRUE(p.fits);
  EXPECT_THAT(Victims(p), ElementsAre(1));  // big's oldest; small (under its share) stays
  // Needing more than big's surplus: big down to its share, then the writer's own.
  r.write_bytes = 80;
  p = lru.Plan(r);
  EXPECT_TRUE(p.fits);
  EXPECT_THAT(Victims(p), ElementsAre(1, 3, 2));
}

TEST(EvictionPlanner, AWriteThatCannotFitIsRefused) {
  Lru lru;
  lru.Add("other", 50);
  lru.Add("w", 10);
  // Share 50: other is not above it, and the writer's own 10 bytes are not enough.
  EvictionRequest r = Request("w", 95, 0, /*capacity=*/100);
  r.tenant_bytes = {{"other", 50}, {"w", 10}};
  r.used_bytes = 60;
  EXPECT_FALSE(lru.Plan(r).fits);
  // Over the quota with nothing of its own left to evict.
  r = Request("w", 45, /*quota=*/40, 0);
  r.tenant_bytes = {{"w", 10}};
  EXPECT_FALSE(lru.Plan(r).fits);
}

TEST(EvictionPlanner, ASharedBlockIsFreedWithItsLastHolder) {
  int block = 0;
  const EvictionCandidate::Block shared{&block, 100, 2};
  Lru lru;
  lru.Add("w", 10, {shared});
  lru.Add("w", 10, {shared});
  lru.Add("w", 10);
  EvictionRequest r = Request("w", 50, 0, /*capacity=*/150);
  r.tenant_bytes = {{"w", 130}};
  r.used_bytes = 130;
  // Freed: 10 (the block still held), then 10 + 100 (its last holder): 30 needed, two go.
  EvictionPlan p = lru.Plan(r);
  EXPECT_TRUE(p.fits);
  EXPECT_THAT(Victims(p), ElementsAre(0, 1));
  // With a third holder outside the candidates (the write keeps it), the block never frees.
  lru.c[0].blocks[0].holders = lru.c[1].blocks[0].holders = 3;
  p = lru.Plan(r);
  EXPECT_TRUE(p.fits);
  EXPECT_THAT(Victims(p), ElementsAre(0, 1, 2));
}

TEST(EvictionPlanner, ManyVictimsArePlannedInLinearSteps) {
  // One in four sequences belongs to a tenant under its share (skipped, never re-read).
  Lru lru;
  const int n = 20000;
  for (int i = 0; i < n; ++i) lru.Add(i % 4 == 0 ? "small" : "other", 1);
  EvictionRequest r = Request("w", 8000, 0, /*capacity=*/n);
  r.tenant_bytes = {{"small", n / 4}, {"other", 3 * n / 4}};  // share n / 3 with the writer
  r.used_bytes = n;
  const EvictionPlan p = lru.Plan(r);
  EXPECT_TRUE(p.fits);
  EXPECT_EQ(p.victims.size(), 8000u);
  EXPECT_LE(p.steps, n);
}

TEST(EvictionPlanner, NothingOverNothingGoes) {
  Lru lru;
  lru.Add("w", 10);
  EvictionRequest r = Request("w", 10, 100, 100);
  r.tenant_bytes = {{"w", 10}};
  r.used_bytes = 10;
  const EvictionPlan p = lru.Plan(r);
  EXPECT_TRUE(p.fits);
  EXPECT_THAT(p.victims, IsEmpty());
}

}  // namespace
}  // namespace kvq::core
