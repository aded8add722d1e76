// Prefix sharing in core::Store (no gRPC): sealed groups indexed by a chained hash of token
// ids, stored once per tenant, attached without data, retained after delete, dropped first
// under pressure and never leaving an extension without its prefix.
#include <malloc.h>

#include <atomic>
#include <random>
#include <thread>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kvq/core/store.h"
#include "tests/core/test_util.h"

namespace kvq::core {
namespace {

constexpr int kKv = 2, kD = 64, kQ = 4;

ModelEntry Entry() {
  BasisManifest m;
  m.model = "m";
  m.version = 1;
  m.layers = 2;
  m.kv_heads = kKv;
  m.q_heads = kQ;
  m.head_dim = kD;
  m.rank = 8;
  m.kind = "random";
  ModelEntry e;
  e.manifest = m;
  e.has_basis = true;
  e.basis = RandomBasis(m, 3);
  // Query moments (E[q q^T] = I), so that sequences may ask for metric rounding.
  e.basis.query_moment.assign(static_cast<size_t>(m.layers) * kKv * kD * kD, 0.0f);
  for (int h = 0; h < m.layers * kKv; ++h)
    for (int c = 0; c < kD; ++c)
      e.basis.query_moment[(static_cast<size_t>(h) * kD + c) * kD + c] = 1;
  // The legacy default: the token counts below are written around 32-token prefix groups.
  e.codec = testing::K2G32Codec(m, true);
  return e;
}

// K/V of `n` tokens where token t's rows depend only on (t, ids[t]) and the seed: two
// sequences with the same ids carry the same bytes, as a deterministic prefill would.
struct Tokens {
  std::vector<uint32_t> ids;
  std::vector<float> k, v;
  Tokens(std::vector<uint32_t> token_ids, uint32_t seed) : ids(std::move(token_ids)) {
    const int64_t n = static_cast<int64_t>(ids.size());
    k.resize(kKv * n * kD);
    v.resize(kKv * n * kD);
    for (int h = 0; h < kKv; ++h) {
      for (int64_t t = 0; t < n; ++t) {
        std::mt19937 rng(seed * 1000003u + ids[t] * 7919u + static_cast<uint32_t>(t) * 31u + h);
        std::normal_distribution<float> nd;
        for (int c = 0; c < kD; ++c) {
          k[(h * n + t) * kD + c] = nd(rng);
          v[(h * n + t) * kD + c] = nd(rng);
        }
      }
    }
  }
  int64_t n() const { return static_cast<int64_t>(ids.size()); }
  // Tokens [from, from + count) as an append at position from.
  AppendSpec Spec(const std::string& id, int layer, int64_t from, int64_t count,
                  bool with_ids = true) const {
    AppendSpec s;
    s.sequence_id = id;
    s.layer = layer;
    s.start = from;
    s.model = "m";
    TensorView kt = TensorView::Contiguous(k.data(), DType::kF32, {kKv, n(), kD});
    TensorView vt = TensorView::Contiguous(v.data(), DType::kF32, {kKv, n(), kD});
    kt.data = k.data() + from * kD;
    vt.data = v.data() + from * kD;
    kt.shape[1] = vt.shape[1] = count;
    s.keys = kt;
    s.values = vt;
    if (with_ids) s.token_ids = std::span<const uint32_t>(ids.data() + from, count);
    return s;
  }
  // Both layers, every token, one message.
  std::vector<AppendSpec> All(const std::string& id, bool with_ids = true) const {
    return {Spec(id, 0, 0, n(), with_ids), Spec(id, 1, 0, n(), with_ids)};
  }
};

std::vector<uint32_t> Ids(int n, uint32_t base) {
  std::vector<uint32_t> ids(n);
  for (int i = 0; i < n; ++i) ids[i] = base + 17 * i;
  return ids;
}

AppendSpec AttachSpec(const std::string& id, int layer, int64_t start,
                      std::span<const uint32_t> ids) {
  AppendSpec s;
  s.sequence_id = id;
  s.layer = layer;
  s.start = start;
  s.model = "m";
  s.token_ids = ids;
  return s;
}

class PrefixTest : public ::testing::Test {
 protected:
  void SetUp() override { ASSERT_TRUE(registry_.Register(Entry(), nullptr).ok()); }

  std::vector<float> Scores(Store& store, const std::string& tenant, const std::string& id,
                            int layer) {
    std::vector<float> q(kQ * kD);
    for (size_t i = 0; i < q.size(); ++i) q[i] = std::sin(0.37f * i);
    std::vector<float> out;
    absl::Status st =
        store.Score({tenant, id, layer, 0}, {q.data(), kQ, 1, kD}, 0, false, &out).status();
    EXPECT_TRUE(st.ok()) << st;
    return out;
  }
  std::vector<float> Attention(Store& store, const std::string& id, int layer) {
    std::vector<float> q(kQ * kD);
    for (size_t i = 0; i < q.size(); ++i) q[i] = std::cos(0.11f * i);
    std::vector<float> out;
    AttendOptions ao;
    ao.observe = false;
    absl::Status st = store.Attend({"t", id, layer, 0}, {q.data(), kQ, 1, kD}, ao, &out).status();
    EXPECT_TRUE(st.ok()) << st;
    return out;
  }

  // Both sequences of tenant "t" decode to the same keys and values, bit for bit.
  void ExpectSameDecode(Store& store, const std::string& a, const std::string& b, int layer) {
    std::vector<float> ka, va, kb, vb;
    ASSERT_TRUE(store.Decode({"t", a, layer, 0}, {}, &ka, &va).ok());
    ASSERT_TRUE(store.Decode({"t", b, layer, 0}, {}, &kb, &vb).ok());
    EXPECT_EQ(ka, kb) << a << " vs " << b;
    EXPECT_EQ(va, vb) << a << " vs " << b;
  }

  // What one sequence of these tokens holds without sharing.
  int64_t BytesUnshared(const Tokens& a) {
    Store probe({}, &registry_);
    AppendOutcome out;
    EXPECT_TRUE(probe.Append("t", a.All("x", false), &out).ok());
    return probe.TotalUsage().bytes;
  }

  Registry registry_{""};
};

TEST_F(PrefixTest, SamePrefixIsStoredOnceAndReadsAreBitExact) {
  Store store({}, &registry_);
  Tokens a(Ids(100, 5), 1);
  AppendOutcome out;
  ASSERT_TRUE(store.Append("t", a.All("a"), &out).ok());
  EXPECT_EQ(out.tokens_written, 200);
  EXPECT_EQ(out.tokens_shared, 0);
  const UsageStats one = store.TotalUsage();
  EXPECT_EQ(one.prefix_blocks, 2 * 3);  // 3 whole groups of 32 per layer
  EXPECT_GT(one.prefix_bytes, 0);

  // The same tokens again: the 3 whole groups of each layer come from the index.
  ASSERT_TRUE(store.Append("t", a.All("b"), &out).ok());
  EXPECT_EQ(out.tokens_shared, 2 * 96);
  EXPECT_EQ(out.tokens_written, 2 * 4);
  const UsageStats two = store.TotalUsage();
  EXPECT_EQ(two.prefix_blocks, one.prefix_blocks);
  EXPECT_EQ(two.prefix_bytes, one.prefix_bytes);
  // The second sequence costs what the first holds outside the index (its window, token
  // hashes and structure) less the first's sealing bookkeeping (the vectors of the blocks it
  // sealed: under 2 KiB a layer, counted since the store counts its overheads).
  EXPECT_LE(two.bytes - one.bytes, one.bytes - one.prefix_bytes);
  EXPECT_GE(two.bytes - one.bytes, one.bytes - one.prefix_bytes - 2 * 2048);

  // Without token ids: nothing shared, everything encoded; same results bit for bit.
  ASSERT_TRUE(store.Append("t", a.All("c", /*with_ids=*/false), &out).ok());
  EXPECT_EQ(out.tokens_shared, 0);
  for (int layer = 0; layer < 2; ++layer) {
    EXPECT_EQ(Scores(store, "t", "a", layer), Scores(store, "t", "b", layer));
    EXPECT_EQ(Scores(store, "t", "a", layer), Scores(store, "t", "c", layer));
    EXPECT_EQ(Attention(store, "a", layer), Attention(store, "c", layer));
    EXPECT_EQ(Attention(store, "b", layer), Attention(store, "c", layer));
  }
  // The shared blocks are the same objects.
  EXPECT_EQ(store.LayerForTest("t", "a", 1)->sealed()[2].get(),
            store.LayerForTest("t", "b", 1)->sealed()[2].get());
  EXPECT_TRUE(store.LayerForTest("t", "c", 1)->sealed().empty());
}

// A window of R = 40 tokens at arrival precision and the A^2 value policy: sharing takes only
// groups the append would have encoded itself, so the window stays exact, and every read
// (score, attend, decode) equals the unshared copy's bit for bit.
TEST_F(PrefixTest, WindowAndA2PolicyReadTheSameShared) {
  Store store({}, &registry_);
  Tokens a(Ids(150, 2), 3);
  CodecOptions c = Entry().codec;
  c.window = 40;
  c.value_policy = ValuePolicy::kA2;
  c.value_budget = 2.0f;
  auto with_codec = [&](std::vector<AppendSpec> v) {
    for (auto& s : v) {
      s.has_codec = true;
      s.codec = c;
    }
    return v;
  };
  AppendOutcome out;
  ASSERT_TRUE(store.Append("t", with_codec(a.All("a")), &out).ok());
  ASSERT_TRUE(store.Append("t", with_codec(a.All("b")), &out).ok());
  EXPECT_EQ(out.tokens_shared, 2 * 96);  // (150 - 40) / 32 = 3 groups per layer
  ASSERT_TRUE(store.Append("t", with_codec(a.All("c", false)), &out).ok());
  EXPECT_EQ(store.LayerForTest("t", "b", 0)->Size().window_tokens, 54);
  // An attach of all 150 ids takes the same 3 groups, not 4: the window stays for data.
  std::vector<AppendSpec> attach = {AttachSpec("d", 0, 0, a.ids), AttachSpec("d", 1, 0, a.ids)};
  ASSERT_TRUE(store.Append("t", with_codec(attach), &out).ok());
  EXPECT_EQ(out.tokens_shared, 2 * 96);
  ASSERT_TRUE(
      store.Append("t", with_codec({a.Spec("d", 0, 96, 54), a.Spec("d", 1, 96, 54)}), &out).ok());
  for (int layer = 0; layer < 2; ++layer) {
    EXPECT_EQ(Attention(store, "d", layer), Attention(store, "c", layer));
  }
  for (int layer = 0; layer < 2; ++layer) {
    EXPECT_EQ(Scores(store, "t", "b", layer), Scores(store, "t", "c", layer));
    EXPECT_EQ(Attention(store, "b", layer), Attention(store, "c", layer));
    ExpectSameDecode(store, "b", "c", layer);
  }
}

// fp16 sinks travel with the first group: a sequence that shares it (by its ids, or by an
// attach without data) reads what an unshared copy reads, bit for bit, and the sinks' rows
// are counted once, with the group. The same tokens under the same codec but no sinks share
// nothing (the prefix seed names every codec.json field).
TEST_F(PrefixTest, Fp16SinksAreSharedWithTheFirstGroup) {
  Store store({}, &registry_);
  Tokens a(Ids(80, 4), 6);
  CodecOptions c = Entry().codec;
  c.fp16_sinks = 4;
  auto with_codec = [&](std::vector<AppendSpec> v, const CodecOptions& codec) {
    for (auto& s : v) {
      s.has_codec = true;
      s.codec = codec;
    }
    return v;
  };
  AppendOutcome out;
  ASSERT_TRUE(store.Append("t", with_codec(a.All("a"), c), &out).ok());
  const UsageStats one = store.TotalUsage();
  ASSERT_TRUE(store.Append("t", with_codec(a.All("b"), c), &out).ok());
  EXPECT_EQ(out.tokens_shared, 2 * 64);
  EXPECT_EQ(store.TotalUsage().prefix_bytes, one.prefix_bytes);
  std::vector<AppendSpec> attach = {AttachSpec("d", 0, 0, a.ids), AttachSpec("d", 1, 0, a.ids)};
  ASSERT_TRUE(store.Append("t", with_codec(attach, c), &out).ok());
  EXPECT_EQ(out.tokens_shared, 2 * 64);
  ASSERT_TRUE(
      store.Append("t", with_codec({a.Spec("d", 0, 64, 16), a.Spec("d", 1, 64, 16)}, c), &out)
          .ok());
  ASSERT_TRUE(store.Append("t", with_codec(a.All("u", /*with_ids=*/false), c), &out).ok());
  for (int layer = 0; layer < 2; ++layer) {
    const LayerCache* la = store.LayerForTest("t", "a", layer);
    ASSERT_NE(la->sinks(), nullptr);
    EXPECT_EQ(la->sinks(), store.LayerForTest("t", "d", layer)->sinks());
    EXPECT_EQ(la->sealed()[0]->sinks, la->sinks());
    for (const char* id : {"b", "d"}) {
      EXPECT_EQ(Scores(store, "t", id, layer), Scores(store, "t", "u", layer)) << id;
      EXPECT_EQ(Attention(store, id, layer), Attention(store, "u", layer)) << id;
    }
    ExpectSameDecode(store, "d", "u", layer);
  }
  // The prefix index counts each first group with its sinks (2 layers x 2 heads x 4 rows of
  // 64 fp16 keys and values, and per layer the SinkRows object and its three heap blocks).
  Store plain({}, &registry_);
  CodecOptions none = c;
  none.fp16_sinks = 0;
  ASSERT_TRUE(plain.Append("t", with_codec(a.All("a"), none), &out).ok());
  EXPECT_EQ(one.prefix_bytes - plain.TotalUsage().prefix_bytes,
            2 * kKv * 4 * kD * 2 * 2 + 2 * static_cast<int64_t>(sizeof(SinkRows) + 16 + 3 * 16));
  ASSERT_TRUE(store.Append("t", with_codec(a.All("n"), none), &out).ok());
  EXPECT_EQ(out.tokens_shared, 0);
}

// The prefix index's bookkeeping (its hash-map slots, the sealed group's object and vectors,
// the retained set's entries) is counted with each group, so that a workload of many short
// prompts stays within what the store counts.
TEST_F(PrefixTest, RetainedGroupsAreCountedAtTheMemoryTheyTake) {
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
  GTEST_SKIP() << "heap statistics need glibc's allocator";
#endif
  Store store({}, &registry_);
  constexpr int kPrompts = 4000;
  std::vector<Tokens> prompts;
  prompts.reserve(kPrompts);
  for (int i = 0; i < kPrompts; ++i) prompts.emplace_back(Ids(32, 7 + 40 * i), 2);
  const size_t heap_before = mallinfo2().uordblks;
  const int64_t counted_before = store.TotalUsage().bytes;
  for (int i = 0; i < kPrompts; ++i) {
    AppendOutcome out;
    const std::string id = absl::StrCat("p", i);
    ASSERT_TRUE(store.Append("t", prompts[i].All(id), &out).ok());
    ASSERT_TRUE(store.Delete("t", id).ok());  // its two groups stay, retained
  }
  EXPECT_EQ(store.TotalUsage().prefix_blocks, 2 * kPrompts);
  const double heap = static_cast<double>(mallinfo2().uordblks - heap_before) / kPrompts;
  const double counted = static_cast<double>(store.TotalUsage().bytes - counted_before) / kPrompts;
  std::printf("per retained one-group prompt (two layers): heap %.0f B, counted %.0f B\n", heap,
              counted);
  EXPECT_LE(heap, 1.02 * counted);
}

TEST_F(PrefixTest, SharingStopsAtTheFirstDifferentGroupAndNeverCrossesTenants) {
  Store store({}, &registry_);
  Tokens a(Ids(128, 5), 1);
  std::vector<uint32_t> other = a.ids;
  other[40] += 1;  // differs in the second group
  Tokens b(other, 1);
  AppendOutcome out;
  ASSERT_TRUE(store.Append("t", a.All("a"), &out).ok());
  ASSERT_TRUE(store.Append("t", b.All("b"), &out).ok());
  EXPECT_EQ(out.tokens_shared, 2 * 32);
  // Same ids, other tenant: nothing shared, nothing learnt.
  ASSERT_TRUE(store.Append("u", a.All("a"), &out).ok());
  EXPECT_EQ(out.tokens_shared, 0);
  EXPECT_EQ(store.TenantUsage("u").shared_tokens, 0);
  EXPECT_EQ(store.TenantUsage("t").shared_tokens, 64);
  // Other codec settings: other blocks, nothing shared.
  std::vector<AppendSpec> g64 = a.All("g64");
  for (auto& s : g64) {
    s.has_codec = true;
    s.codec = Entry().codec;
    s.codec.value_bits = 4;
  }
  ASSERT_TRUE(store.Append("t", g64, &out).ok());
  EXPECT_EQ(out.tokens_shared, 0);
  EXPECT_EQ(Scores(store, "t", "a", 0), Scores(store, "u", "a", 0));
}

// The codec levers are part of the chain's seed: a codec that differs only in a rotation or
// in metric rounding (encoder-only: its blocks would pass every layout check) never takes
// another's blocks, while sequences of one lever codec still share among themselves.
TEST_F(PrefixTest, CodecLeversNeverShareBlocksWithOtherCodecs) {
  Store store({}, &registry_);
  Tokens a(Ids(128, 9), 4);
  AppendOutcome out;
  ASSERT_TRUE(store.Append("t", a.All("plain"), &out).ok());
  using Lever = bool CodecOptions::*;
  for (Lever lever :
       {&CodecOptions::rotate_keys, &CodecOptions::rotate_values, &CodecOptions::metric_rounding}) {
    for (const std::string id : {"first", "second"}) {
      std::vector<AppendSpec> specs =
          a.All(id + std::to_string(lever == &CodecOptions::rotate_keys     ? 0
                                    : lever == &CodecOptions::rotate_values ? 1
                                                                            : 2));
      for (auto& s : specs) {
        s.has_codec = true;
        s.codec = Entry().codec;
        s.codec.*lever = true;
      }
      absl::Status st = store.Append("t", specs, &out);
      ASSERT_TRUE(st.ok()) << st;
      EXPECT_EQ(out.tokens_shared, id == "first" ? 0 : 2 * 128) << id;
    }
  }
}

TEST_F(PrefixTest, AttachWithoutDataThenContinue) {
  Store store({}, &registry_);
  Tokens a(Ids(100, 9), 2);
  AppendOutcome out;
  ASSERT_TRUE(store.Append("t", a.All("a"), &out).ok());
  // A frontend holding the same prompt asks for what is stored, by token ids only.
  std::span<const uint32_t> ids(a.ids);
  absl::Status st =
      store.Append("t", {AttachSpec("d", 0, 0, ids), AttachSpec("d", 1, 0, ids)}, &out);
  ASSERT_TRUE(st.ok()) << st;
  EXPECT_EQ(out.tokens_shared, 2 * 96);
  EXPECT_EQ(out.tokens_written, 0);
  ASSERT_EQ(out.lengths.size(), 2u);
  EXPECT_EQ(std::get<2>(out.lengths[0]), 96);
  // A retried attach is a duplicate; one naming other tokens is ALREADY_EXISTS.
  ASSERT_TRUE(store.Append("t", {AttachSpec("d", 0, 0, ids.subspan(0, 64))}, &out).ok());
  EXPECT_EQ(out.tokens_duplicate, 64);
  std::vector<uint32_t> wrong(a.ids.begin(), a.ids.begin() + 64);
  wrong[50] ^= 1;
  st = store.Append("t", {AttachSpec("d", 0, 0, wrong)}, &out);
  EXPECT_EQ(st.code(), absl::StatusCode::kAlreadyExists) << st;
  // The rest arrives with data; reads equal the donor's bit for bit.
  ASSERT_TRUE(store.Append("t", {a.Spec("d", 0, 96, 4), a.Spec("d", 1, 96, 4)}, &out).ok());
  EXPECT_EQ(out.tokens_written, 8);
  // Re-sending the attached tokens with their data is a duplicate (same arrival hashes).
  ASSERT_TRUE(store.Append("t", {a.Spec("d", 0, 0, 100)}, &out).ok());
  EXPECT_EQ(out.tokens_duplicate, 100);
  for (int layer = 0; layer < 2; ++layer) {
    EXPECT_EQ(Scores(store, "t", "a", layer), Scores(store, "t", "d", layer));
    EXPECT_EQ(Attention(store, "a", layer), Attention(store, "d", layer));
  }
  // Attaching what the index does not hold attaches nothing (and is not an error).
  std::vector<uint32_t> unknown = Ids(64, 777);
  ASSERT_TRUE(store.Append("t", {AttachSpec("e", 0, 0, unknown)}, &out).ok());
  EXPECT_EQ(out.tokens_shared, 0);
}

// IndexedPrefixTokens (MatchPrefix): what an attach would take now, in every layer, and
// nothing else: the store is the same afterwards.
TEST_F(PrefixTest, IndexedPrefixTokensIsWhatAnAttachTakesAndChangesNothing) {
  Store store({}, &registry_);
  Tokens a(Ids(100, 9), 2);
  AppendOutcome out;
  ASSERT_TRUE(store.Append("t", a.All("a"), &out).ok());
  PrefixProbe probe;
  probe.model = "m";
  probe.token_ids = a.ids;
  const UsageStats before = store.TotalUsage();
  absl::StatusOr<int64_t> got = store.IndexedPrefixTokens("t", probe);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(*got, 96);  // three whole groups of 32; the rest is never attached
  const UsageStats after = store.TotalUsage();
  EXPECT_EQ(after.sequences, before.sequences);
  EXPECT_EQ(after.bytes, before.bytes);
  EXPECT_EQ(after.shared_tokens, before.shared_tokens);
  // Another tenant's index is not this one's.
  EXPECT_EQ(*store.IndexedPrefixTokens("u", probe), 0);
  // A prompt that shares two groups, then differs.
  std::vector<uint32_t> fork = a.ids;
  fork[70] ^= 1;
  probe.token_ids = fork;
  EXPECT_EQ(*store.IndexedPrefixTokens("t", probe), 64);
  // The fewest over layers: a prompt stored in layer 0 only matches nothing.
  Tokens b(Ids(64, 300), 5);
  ASSERT_TRUE(store.Append("t", {b.Spec("b", 0, 0, 64)}, &out).ok());
  probe.token_ids = b.ids;
  EXPECT_EQ(*store.IndexedPrefixTokens("t", probe), 0);
  // Another codec's groups are not this codec's.
  probe.token_ids = a.ids;
  probe.has_codec = true;
  probe.codec = Entry().codec;
  EXPECT_EQ(*store.IndexedPrefixTokens("t", probe), 96);
  probe.codec.rotate_keys = true;
  EXPECT_EQ(*store.IndexedPrefixTokens("t", probe), 0);
  probe.has_codec = false;
  // Retained groups (no sequence holds them) are what an attach takes too.
  ASSERT_TRUE(store.Delete("t", "a").ok());
  EXPECT_EQ(*store.IndexedPrefixTokens("t", probe), 96);
  ASSERT_TRUE(
      store.Append("t", {AttachSpec("d", 0, 0, a.ids), AttachSpec("d", 1, 0, a.ids)}, &out).ok());
  EXPECT_EQ(out.tokens_shared, 2 * 96);
  // No ids: nothing to match, no model needed.
  EXPECT_EQ(*store.IndexedPrefixTokens("t", PrefixProbe{}), 0);
}

TEST_F(PrefixTest, IndexedPrefixTokensNamesTheBadField) {
  Store store({}, &registry_);
  std::vector<uint32_t> ids = Ids(64, 1);
  PrefixProbe probe;
  probe.token_ids = ids;
  absl::Status st = store.IndexedPrefixTokens("t", probe).status();
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(st.message()), ::testing::HasSubstr("model must be set"));
  probe.model = "nope";
  st = store.IndexedPrefixTokens("t", probe).status();
  EXPECT_EQ(st.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(st.message()), ::testing::StartsWith("model: "));
  probe.model = "m";
  probe.has_codec = true;
  probe.codec = Entry().codec;
  probe.codec.rank = 99;
  st = store.IndexedPrefixTokens("t", probe).status();
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(st.message()),
              ::testing::HasSubstr("codec.rank 99 exceeds the basis rank 8"));
  probe.has_codec = false;
  std::vector<uint32_t> many(65537, 3);
  probe.token_ids = many;
  st = store.IndexedPrefixTokens("t", probe).status();
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(st.message()),
              ::testing::HasSubstr("token_ids has 65537 ids; at most 65536"));
}

// DropAll (a shard that may hold stale copies, kvq-server --drop-after-probe-gap): no
// sequence of any tenant is left, no prefix group either (held or retained), the bytes all
// come back, and the store serves as if it had restarted: the same prompt attaches nothing.
TEST_F(PrefixTest, DropAllLeavesNoSequenceAndNoPrefixGroup) {
  Store store({}, &registry_);
  Tokens a(Ids(100, 21), 4), b(Ids(70, 500), 9);
  AppendOutcome out;
  ASSERT_TRUE(store.Append("t", a.All("a"), &out).ok());
  ASSERT_TRUE(store.Append("u", a.All("a"), &out).ok());
  ASSERT_TRUE(store.Append("u", b.All("b"), &out).ok());
  ASSERT_TRUE(store.Append("t", b.All("gone"), &out).ok());
  ASSERT_TRUE(store.Delete("t", "gone").ok());  // its groups stay retained
  const std::vector<float> before = Scores(store, "t", "a", 1);
  UsageStats u = store.TotalUsage();
  ASSERT_EQ(u.sequences, 3);
  ASSERT_GT(u.retained_bytes, 0);
  ASSERT_GT(u.prefix_blocks, 0);

  const Store::Dropped d = store.DropAll();
  EXPECT_EQ(d.sequences, 3);
  EXPECT_EQ(d.bytes, u.bytes);
  u = store.TotalUsage();
  EXPECT_EQ(u.sequences, 0);
  EXPECT_EQ(u.bytes, 0);
  EXPECT_EQ(u.prefix_blocks, 0);
  EXPECT_EQ(u.evictions, 0);
  EXPECT_EQ(u.expirations, 0);
  for (const auto& [tenant, id] : {std::pair{"t", "a"}, {"u", "a"}, {"u", "b"}}) {
    EXPECT_EQ(store.Describe(tenant, id).status().code(), absl::StatusCode::kNotFound) << id;
  }
  EXPECT_EQ(store.TenantUsage("u").bytes, 0);
  EXPECT_EQ(store.DropAll().sequences, 0);  // nothing left to drop

  // The same prompt attaches nothing now; written again, it reads as before.
  std::span<const uint32_t> ids(a.ids);
  ASSERT_TRUE(store.Append("t", {AttachSpec("c", 0, 0, ids)}, &out).ok());
  EXPECT_EQ(out.tokens_shared, 0);
  ASSERT_TRUE(store.Append("t", a.All("a"), &out).ok());
  EXPECT_EQ(out.tokens_shared, 0);
  EXPECT_EQ(out.tokens_written, 2 * a.n());
  EXPECT_EQ(Scores(store, "t", "a", 1), before);
}

TEST_F(PrefixTest, BadPrefixRequestsNameTheField) {
  Store store({}, &registry_);
  Tokens a(Ids(40, 1), 1);
  AppendOutcome out;
  AppendSpec s = a.Spec("a", 0, 0, 40);
  s.token_ids = s.token_ids.subspan(0, 39);
  absl::Status st = store.Append("t", {s}, &out);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(st.message()), ::testing::HasSubstr("token_ids has 39 ids"));
  st = store.Append("t", {AttachSpec("a", 0, 0, {})}, &out);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(st.message()), ::testing::HasSubstr("token_ids"));
  st = store.Append("t", {AttachSpec("a", 0, 5, a.ids)}, &out);
  EXPECT_THAT(std::string(st.message()), ::testing::HasSubstr("multiple of the group size"));
  EXPECT_EQ(store.TotalUsage().sequences, 0);
}

TEST_F(PrefixTest, DecodeStyleAppendsHoldTheIndexedCopy) {
  Store store({}, &registry_);
  Tokens a(Ids(96, 3), 4);
  AppendOutcome out;
  ASSERT_TRUE(store.Append("t", {a.Spec("a", 0, 0, 96)}, &out).ok());
  const UsageStats before = store.TotalUsage();
  for (int64_t t = 0; t < 70; ++t) {
    ASSERT_TRUE(store.Append("t", {a.Spec("f", 0, t, 1)}, &out).ok());
  }
  const UsageStats after = store.TotalUsage();
  EXPECT_EQ(after.prefix_blocks, before.prefix_blocks);
  EXPECT_EQ(after.shared_tokens, 64);
  const LayerCache* fa = store.LayerForTest("t", "a", 0);
  const LayerCache* ff = store.LayerForTest("t", "f", 0);
  ASSERT_EQ(ff->sealed().size(), 2u);
  EXPECT_EQ(fa->sealed()[1].get(), ff->sealed()[1].get());
  // Reference: the same 70 tokens without ids.
  ASSERT_TRUE(store.Append("t", {a.Spec("ref", 0, 0, 70, false)}, &out).ok());
  EXPECT_EQ(Scores(store, "t", "f", 0), Scores(store, "t", "ref", 0));
}

TEST_F(PrefixTest, RetainedPrefixesServeLaterSequencesAndGoFirstUnderPressure) {
  Tokens a(Ids(128, 11), 5);
  const int64_t one = BytesUnshared(a);
  StoreOptions o;
  // Three sequences, and room for the bookkeeping of the probe sequence below that attaches
  // the retained groups (which it pins, so they cannot make that room themselves).
  o.capacity_bytes = 3 * one + 4096;
  Store store(o, &registry_);
  AppendOutcome out;
  ASSERT_TRUE(store.Append("t", a.All("a"), &out).ok());
  ASSERT_TRUE(store.Delete("t", "a").ok());
  UsageStats u = store.TotalUsage();
  EXPECT_EQ(u.sequences, 0);
  EXPECT_EQ(u.prefix_blocks, 8);
  EXPECT_EQ(u.retained_bytes, u.prefix_bytes);
  EXPECT_EQ(u.bytes, u.prefix_bytes);
  // A later sequence with the same prompt takes the retained groups.
  ASSERT_TRUE(store.Append("t", {AttachSpec("b", 0, 0, a.ids)}, &out).ok());
  EXPECT_EQ(out.tokens_shared, 128);
  EXPECT_LT(store.TotalUsage().retained_bytes, u.retained_bytes);
  ASSERT_TRUE(store.Delete("t", "b").ok());
  // Fill with sequences that share nothing: the retained groups go before any sequence,
  // and never a group while a longer one extending it stays.
  for (int i = 0; i < 3; ++i) {
    Tokens other(Ids(128, 1000 + i), 50 + i);
    absl::Status st = store.Append("t", other.All(absl::StrCat("o", i), false), &out);
    ASSERT_TRUE(st.ok()) << st;
    u = store.TotalUsage();
    EXPECT_EQ(u.evictions, 0);
    EXPECT_LE(u.bytes, o.capacity_bytes);
    // What is left of both chains are prefixes of them (no group without the groups before
    // it): attaching the prompt reaches every indexed group.
    AppendOutcome probe_out;
    const std::string id = absl::StrCat("p", i);
    ASSERT_TRUE(
        store.Append("t", {AttachSpec(id, 0, 0, a.ids), AttachSpec(id, 1, 0, a.ids)}, &probe_out)
            .ok());
    EXPECT_EQ(probe_out.tokens_shared, u.prefix_blocks * 32);
    ASSERT_TRUE(store.Delete("t", id).ok());
  }
  u = store.TotalUsage();
  EXPECT_LT(u.prefix_blocks, 8);
}

// Under a tenant quota the writer's own retained groups go first, and another tenant's
// retained groups are never touched by it.
TEST_F(PrefixTest, QuotaDropsTheWritersRetainedGroupsOnly) {
  Tokens a(Ids(128, 41), 8);
  Tokens other(Ids(128, 9000), 61);
  const int64_t one = BytesUnshared(other);
  StoreOptions o;
  o.tenant_quota_bytes = 2 * one;
  Store store(o, &registry_);
  AppendOutcome out;
  for (const char* tenant : {"t", "u"}) {
    ASSERT_TRUE(store.Append(tenant, a.All("a"), &out).ok());
    ASSERT_TRUE(store.Delete(tenant, "a").ok());  // retained in both tenants
  }
  const int64_t u_before = store.TenantUsage("u").bytes;
  EXPECT_EQ(store.TenantUsage("t").retained_bytes, store.TenantUsage("t").prefix_bytes);
  ASSERT_TRUE(store.Append("t", other.All("x", false), &out).ok());
  ASSERT_TRUE(store.Append("t", other.All("y", false), &out).ok());  // needs t's retained room
  const UsageStats t = store.TenantUsage("t");
  EXPECT_EQ(t.evictions, 0);
  EXPECT_LE(t.bytes, o.tenant_quota_bytes);
  EXPECT_LT(t.prefix_blocks, 8);
  EXPECT_EQ(store.TenantUsage("u").bytes, u_before);  // the other tenant's cache untouched
  EXPECT_EQ(store.TenantUsage("u").prefix_blocks, 8);
}

TEST_F(PrefixTest, EvictingOneHolderKeepsBlocksOthersHold) {
  // 150 tokens: 4 shared groups per layer and 22 window tokens each sequence holds itself.
  Tokens a(Ids(150, 21), 6);
  Tokens other(Ids(128, 5000), 60);
  const int64_t one = BytesUnshared(other);
  int64_t both = 0, own = 0;  // a and b together; what one of them holds outside the index
  {
    Store probe({}, &registry_);
    AppendOutcome out;
    ASSERT_TRUE(probe.Append("t", a.All("a"), &out).ok());
    ASSERT_TRUE(probe.Append("t", a.All("b"), &out).ok());
    both = probe.TotalUsage().bytes;
    own = probe.Describe("t", "a")->bytes;
  }
  ASSERT_GT(own, 0);
  StoreOptions o;
  // Room for a, b and the other sequence minus half of what a holds itself: evicting the LRU
  // holder (a) frees enough; its groups stay because b holds them.
  o.capacity_bytes = both + one - own / 2;
  o.retain_prefixes = false;
  Store store(o, &registry_);
  AppendOutcome out;
  ASSERT_TRUE(store.Append("t", a.All("a"), &out).ok());
  ASSERT_TRUE(store.Append("t", a.All("b"), &out).ok());
  EXPECT_EQ(out.tokens_shared, 2 * 128);
  const std::vector<float> before = Scores(store, "t", "b", 1);
  Scores(store, "t", "b", 0);  // b is now more recently used than a
  ASSERT_TRUE(store.Append("t", other.All("o", false), &out).ok());
  UsageStats u = store.TotalUsage();
  EXPECT_EQ(u.evictions, 1);
  EXPECT_FALSE(store.Describe("t", "a").ok());
  EXPECT_EQ(u.prefix_blocks, 8);  // b still holds them
  EXPECT_EQ(Scores(store, "t", "b", 1), before);
  // Without retention, deleting the last holder frees the blocks at once.
  ASSERT_TRUE(store.Delete("t", "b").ok());
  u = store.TotalUsage();
  EXPECT_EQ(u.prefix_blocks, 0);
  EXPECT_EQ(u.prefix_bytes, 0);
  EXPECT_EQ(u.bytes, store.TenantUsage("t").bytes);
}

// A retained group that rots is found by the scrub and dropped with its extensions: a later
// attach stops before it instead of taking corrupted codes.
TEST_F(PrefixTest, ScrubDropsCorruptedRetainedGroups) {
  Store store({}, &registry_);
  Tokens a(Ids(128, 4), 9);
  AppendOutcome out;
  ASSERT_TRUE(store.Append("t", a.All("a"), &out).ok());
  // Corrupt group 1 of layer 0 (held through the cache; the block is immutable by contract,
  // which only a test may break).
  const SealedBlock& g1 = *store.LayerForTest("t", "a", 0)->sealed()[1];
  const_cast<SealedBlock&>(g1).bytes[40] ^= 0x20;
  ASSERT_TRUE(store.Delete("t", "a").ok());  // retained now
  EXPECT_EQ(store.Scrub(), 0);
  EXPECT_EQ(store.RetainedScrubDrops(), 1);
  EXPECT_EQ(store.TotalUsage().prefix_blocks, 4 + 1);  // layer 1 whole, layer 0 group 0
  ASSERT_TRUE(
      store.Append("t", {AttachSpec("b", 0, 0, a.ids), AttachSpec("b", 1, 0, a.ids)}, &out).ok());
  EXPECT_EQ(out.tokens_shared, 32 + 128);
  std::vector<float> k, v;
  EXPECT_TRUE(store.Decode({"t", "b", 0, 0}, {}, &k, &v).ok());
}

TEST_F(PrefixTest, TtlExpiresRetainedPrefixes) {
  absl::Time now = absl::FromUnixSeconds(1000);
  StoreOptions o;
  o.ttl = absl::Seconds(60);
  o.now = [&] { return now; };
  Store store(o, &registry_);
  Tokens a(Ids(64, 1), 1);
  AppendOutcome out;
  ASSERT_TRUE(store.Append("t", a.All("a"), &out).ok());
  ASSERT_TRUE(store.Delete("t", "a").ok());
  EXPECT_EQ(store.TotalUsage().prefix_blocks, 4);
  now += absl::Seconds(30);
  store.Sweep();
  EXPECT_EQ(store.TotalUsage().prefix_blocks, 4);
  now += absl::Seconds(31);
  store.Sweep();
  EXPECT_EQ(store.TotalUsage().prefix_blocks, 0);
  EXPECT_EQ(store.TotalUsage().bytes, 0);
}

// Threads sharing one prompt (write, attach, read, delete) under a capacity that forces
// evictions: afterwards every byte is accounted for (nothing leaks, nothing is freed twice),
// in the store's usage and in its block memory pool (a slab pool, as the pinned pool is).
TEST_F(PrefixTest, ConcurrentSharersLeaveExactAccounting) {
  for (bool retain : {false, true}) {
    Tokens prompt(Ids(150, 31), 7);
    StoreOptions o;
    o.capacity_bytes = 3 * BytesUnshared(prompt);
    o.retain_prefixes = retain;
    SlabBytePool slabs(kernels::Pool::kHost, size_t{1} << 20);
    o.byte_pool = &slabs;
    auto owned = std::make_unique<Store>(o, &registry_);
    Store& store = *owned;
    std::vector<std::thread> threads;
    std::atomic<int> errors{0};
    for (int th = 0; th < 6; ++th) {
      threads.emplace_back([&, th] {
        for (int j = 0; j < 25; ++j) {
          const std::string id = absl::StrCat("s", th, "-", j);
          AppendOutcome out;
          absl::Status st;
          if ((th + j) % 2 == 0) {
            st = store.Append("t", prompt.All(id), &out);
          } else {
            std::span<const uint32_t> ids(prompt.ids);
            st = store.Append("t", {AttachSpec(id, 0, 0, ids), AttachSpec(id, 1, 0, ids)}, &out);
            if (st.ok()) {
              std::vector<AppendSpec> rest;
              for (int layer = 0; layer < 2; ++layer) {
                const int64_t from = std::get<2>(out.lengths[layer]);
                if (from < prompt.n())
                  rest.push_back(prompt.Spec(id, layer, from, prompt.n() - from));
              }
              if (!rest.empty()) st = store.Append("t", rest, &out);
            }
          }
          // Evicted by another thread meanwhile (the rest then finds a new, empty sequence:
          // FAILED_PRECONDITION), aborted by a race, or no room: not errors.
          if (!st.ok() && st.code() != absl::StatusCode::kNotFound &&
              st.code() != absl::StatusCode::kFailedPrecondition &&
              st.code() != absl::StatusCode::kAborted &&
              st.code() != absl::StatusCode::kResourceExhausted) {
            ++errors;
            ADD_FAILURE() << st;
          }
          std::vector<float> q(kQ * kD, 0.01f), logits;
          (void)store.Score({"t", id, 1, 0}, {q.data(), kQ, 1, kD}, 0, false, &logits);
          if (j % 3 == 0) (void)store.Delete("t", id);
        }
      });
    }
    for (auto& t : threads) t.join();
    EXPECT_EQ(errors.load(), 0);
    UsageStats u = store.TotalUsage();
    EXPECT_LE(u.bytes, o.capacity_bytes);
    EXPECT_GT(u.shared_tokens, 0);
    EXPECT_GT(u.evictions, 0);  // the capacity did bite
    for (int th = 0; th < 6; ++th) {
      for (int j = 0; j < 25; ++j) (void)store.Delete("t", absl::StrCat("s", th, "-", j));
    }
    u = store.TotalUsage();
    EXPECT_EQ(u.sequences, 0);
    EXPECT_EQ(u.bytes, u.prefix_bytes) << "retain=" << retain;
    EXPECT_EQ(u.retained_bytes, u.prefix_bytes);
    if (retain) {
      EXPECT_GT(u.prefix_blocks, 0);
    } else {
      EXPECT_EQ(u.prefix_blocks, 0);
    }
    EXPECT_EQ(u.bytes, store.TenantUsage("t").bytes);
    // Only retained groups hold pool memory now: exactly their block bytes. A group's usage
    // also counts what is kept elsewhere, the same for every group of this codec: its
    // 2 kv_heads + 1 offsets, its G = 32 arrival hashes and the index's bookkeeping.
    if (u.prefix_blocks > 0) {
      const int64_t elsewhere = u.prefix_bytes - slabs.usage().requested_bytes;
      EXPECT_EQ(elsewhere % u.prefix_blocks, 0);
      EXPECT_GE(elsewhere / u.prefix_blocks, 4 * (2 * kKv + 1) + 8 * 32);
      EXPECT_LE(elsewhere / u.prefix_blocks, 4 * (2 * kKv + 1) + 8 * 32 + 1024);
    }
    EXPECT_EQ(slabs.usage().fallback_bytes, 0);
    // The store gone, the pool has every byte back.
    owned.reset();
    EXPECT_EQ(slabs.usage().requested_bytes, 0);
    EXPECT_EQ(slabs.usage().held_bytes, 0);
  }
}

}  // namespace
}  // namespace kvq::core
