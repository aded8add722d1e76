// Consistent hashing: a sequence always lands on one server, the ring does not depend on the
// order servers are listed in, and adding or removing one of N servers moves only about 1/N
// of the sequences, all of them to (or from) that server.
#include "kvq/client/hash_ring.h"

#include <set>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

namespace kvq::client {
namespace {

std::vector<std::string> Servers(int n) {
  std::vector<std::string> s;
  for (int i = 0; i < n; ++i) s.push_back(absl::StrCat("kvq-", i, ".kvq.default.svc:50051"));
  return s;
}

constexpr int kKeys = 20011;

std::string Seq(int i) { return absl::StrCat("seq-", i * 7919 + 13); }

TEST(HashRing, SameKeySameServerWhateverTheOrder) {
  std::vector<std::string> a = Servers(5), b = {a[3], a[0], a[4], a[2], a[1]};
  HashRing ra(a), rb(b);
  for (int i = 0; i < 2000; ++i) {
    EXPECT_EQ(ra.servers()[ra.ShardOf("t", Seq(i))], rb.servers()[rb.ShardOf("t", Seq(i))]);
    EXPECT_EQ(ra.ShardOf("t", Seq(i)), ra.ShardOf("t", Seq(i)));
  }
}

TEST(HashRing, TenantIsPartOfTheKey) {
  HashRing r(Servers(8));
  int differ = 0;
  for (int i = 0; i < 1000; ++i) differ += r.ShardOf("alice", Seq(i)) != r.ShardOf("bob", Seq(i));
  EXPECT_GT(differ, 700);  // 7/8 expected when the tenant changes the key
  EXPECT_NE(HashRing::KeyOf("ab", "c"), HashRing::KeyOf("a", "bc"));
}

TEST(HashRing, LoadIsNearlyEven) {
  for (int n : {2, 3, 7}) {
    HashRing r(Servers(n));
    std::vector<int> count(n, 0);
    for (int i = 0; i < kKeys; ++i) ++count[r.ShardOf("t", Seq(i))];
    for (int c : count) {
      EXPECT_GT(c, 0.75 * kKeys / n) << n << " servers";
      EXPECT_LT(c, 1.25 * kKeys / n) << n << " servers";
    }
  }
}

TEST(HashRing, AddingAServerMovesAboutOneNthOnlyToIt) {
  for (int n : {3, 4, 9}) {
    std::vector<std::string> before = Servers(n), after = Servers(n + 1);
    HashRing r0(before), r1(after);
    int moved = 0;
    for (int i = 0; i < kKeys; ++i) {
      const std::string& s0 = r0.servers()[r0.ShardOf("t", Seq(i))];
      const std::string& s1 = r1.servers()[r1.ShardOf("t", Seq(i))];
      if (s0 != s1) {
        ++moved;
        EXPECT_EQ(s1, after.back()) << "a key moved between two servers that stayed";
      }
    }
    const double share = static_cast<double>(moved) / kKeys, ideal = 1.0 / (n + 1);
    EXPECT_GT(share, 0.6 * ideal) << n << " -> " << n + 1;
    EXPECT_LT(share, 1.4 * ideal) << n << " -> " << n + 1;
  }
}

TEST(HashRing, RemovingAServerMovesOnlyItsKeys) {
  const int n = 5;
  std::vector<std::string> all = Servers(n), rest = all;
  rest.erase(rest.begin() + 2);
  HashRing r0(all), r1(rest);
  int moved = 0;
  for (int i = 0; i < kKeys; ++i) {
    const std::string& s0 = r0.servers()[r0.ShardOf("t", Seq(i))];
    const std::string& s1 = r1.servers()[r1.ShardOf("t", Seq(i))];
    if (s0 != s1) {
      ++moved;
      EXPECT_EQ(s0, all[2]) << "a key of a surviving server moved";
    } else {
      EXPECT_NE(s0, all[2]);
    }
  }
  EXPECT_GT(moved, 0.6 * kKeys / n);
  EXPECT_LT(moved, 1.4 * kKeys / n);
}

TEST(HashRing, HashTagsKeepSequencesOfOnePromptTogether) {
  EXPECT_EQ(HashRing::HashTag("{sys-7}conv-1"), "sys-7");
  EXPECT_EQ(HashRing::HashTag("a{b}c{d}"), "b");
  EXPECT_EQ(HashRing::HashTag("{}conv"), "{}conv");  // empty tag: the whole id
  EXPECT_EQ(HashRing::HashTag("conv{open"), "conv{open");
  EXPECT_EQ(HashRing::HashTag("plain"), "plain");
  HashRing ring({"a:1", "b:1", "c:1", "d:1", "e:1"});
  std::set<int> tags_spread;
  for (int p = 0; p < 50; ++p) {
    const std::string tag = "{prompt-" + std::to_string(p) + "}";
    const int owner = ring.ShardOf("t", tag + "conv-0");
    for (int c = 1; c < 20; ++c)
      EXPECT_EQ(ring.ShardOf("t", tag + "conv-" + std::to_string(c)), owner);
    tags_spread.insert(owner);
  }
  EXPECT_EQ(tags_spread.size(), 5u);  // different prompts still spread over every server
  EXPECT_NE(HashRing::KeyOf("t", "{x}1"), HashRing::KeyOf("u", "{x}1"));  // tenant still counts
}

TEST(HashRing, OneServerOwnsEverything) {
  HashRing r({"only:1"});
  for (int i = 0; i < 100; ++i) EXPECT_EQ(r.ShardOf("t", Seq(i)), 0);
}

}  // namespace
}  // namespace kvq::client
