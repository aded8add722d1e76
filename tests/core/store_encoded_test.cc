// Store appends and reads in codes: a client's encoder (a LayerCache over the model entry's
// tables) and the store agree byte for byte; chunked puts replace window rows; re-sends are
// duplicates or ALREADY_EXISTS; a refused run stores nothing; prefix sharing works on codes.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <random>

#include "kvq/core/encoded_groups.h"
#include "kvq/core/store.h"

namespace kvq::core {
namespace {

using ::testing::HasSubstr;

constexpr int kHeads = 2, kDim = 64;

class StoreEncodedTest : public ::testing::Test {
 protected:
  void SetUp() override {
    BasisManifest m;
    m.model = "m";
    m.version = 1;
    m.layers = 1;
    m.kv_heads = kHeads;
    m.q_heads = 4;
    m.head_dim = kDim;
    m.rank = 8;
    m.kind = "random";
    ModelEntry e;
    e.manifest = m;
    e.has_basis = true;
    e.basis = RandomBasis(m, 3);
    e.codec = Registry::DefaultCodec(m, true);
    e.codec.key_group = 32;
    ASSERT_TRUE(registry_.Register(e, nullptr).ok());
    entry_ = *registry_.Get("m", 1);
    codec_ = entry_->codec;
    codec_.head_dim = kDim;
  }

  // [kv_heads][n][d] rows, seeded.
  static std::vector<float> Rows(int64_t n, uint32_t seed) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> nd;
    std::vector<float> x(static_cast<size_t>(kHeads) * n * kDim);
    for (auto& v : x) v = nd(rng);
    return x;
  }
  static TensorView View(const std::vector<float>& x, int64_t n) {
    return TensorView::Contiguous(x.data(), DType::kF32, {kHeads, n, kDim});
  }
  // What a client's encoder makes of the first n rows: its groups and its window rows.
  struct Encoded {
    EncodedGroups run;
    std::vector<float> wk, wv;
    int64_t window = 0;
  };
  Encoded Encode(const std::vector<float>& k, const std::vector<float>& v, int64_t n,
                 int64_t from_group = 0) {
    LayerCache c(codec_, kHeads, MakeLayerCodecTables(*entry_, 0, codec_));
    Encoded out;
    EXPECT_TRUE(c.Append(View(k, n), View(v, n), 0).ok());
    EXPECT_TRUE(c.ExportGroups(from_group, c.encoded_tokens() / codec_.key_group, &out.run).ok());
    out.run.basis_fingerprint = entry_->manifest.fingerprint;
    EXPECT_TRUE(c.Decode(c.encoded_tokens(), n, &out.wk, &out.wv).ok());
    out.window = n - c.encoded_tokens();
    return out;
  }
  AppendSpec Spec(const std::string& id, const Encoded& e, const EncodedGroupsView& view) {
    AppendSpec s;
    s.sequence_id = id;
    s.model = "m";
    s.start = view.first_group * codec_.key_group;
    s.encoded = &view;
    if (e.window > 0) {
      s.keys = View(e.wk, e.window);
      s.values = View(e.wv, e.window);
    }
    return s;
  }
  std::vector<uint8_t> Decoded(const std::string& id) {
    std::vector<float> k, v;
    EXPECT_TRUE(store_.Decode({"t", id, 0, 0}, {}, &k, &v).ok());
    std::vector<uint8_t> out(reinterpret_cast<uint8_t*>(k.data()),
                             reinterpret_cast<uint8_t*>(k.data() + k.size()));
    out.insert(out.end(), reinterpret_cast<uint8_t*>(v.data()),
               reinterpret_cast<uint8_t*>(v.data() + v.size()));
    return out;
  }

  Registry registry_{""};
  Store store_{StoreOptions{}, &registry_};
  std::shared_ptr<const ModelEntry> entry_;
  CodecOptions codec_;
};

TEST_F(StoreEncodedTest, CodesAppendedEqualRowsAppendedAndReadBackAsTheSameCodes) {
  const int64_t T = 300;
  const auto k = Rows(T, 1), v = Rows(T, 2);
  AppendOutcome out;
  AppendSpec rows;
  rows.sequence_id = "rows";
  rows.model = "m";
  rows.keys = View(k, T);
  rows.values = View(v, T);
  ASSERT_TRUE(store_.Append("t", {rows}, &out).ok());
  const Encoded e = Encode(k, v, T);
  const EncodedGroupsView view = ViewOf(e.run);
  ASSERT_TRUE(store_.Append("t", {Spec("codes", e, view)}, &out).ok()) << out.tokens_written;
  EXPECT_EQ(out.tokens_written, T);
  EXPECT_EQ(Decoded("codes"), Decoded("rows"));
  // Read back in codes: the same blocks, then the window rows.
  EncodedGroups back;
  std::vector<uint8_t> wk, wv;
  const absl::StatusOr<RangeRead> read =
      store_.ReadEncoded({"t", "rows", 0, 0}, {40, -1}, DType::kF32, &back, &wk, &wv);
  ASSERT_TRUE(read.ok());
  EXPECT_EQ(read->first, 32);  // 40 rounded down to its group's start
  EXPECT_EQ(read->tokens, T);
  EXPECT_EQ(back.first_group, 1);
  const size_t skip = 2 * kHeads;  // group 0's blocks
  EXPECT_EQ(back.sizes, std::vector<uint32_t>(e.run.sizes.begin() + skip, e.run.sizes.end()));
  EXPECT_EQ(wk.size(), static_cast<size_t>(kHeads) * e.window * kDim * 4);
  // A re-send is a duplicate; other blocks for a stored group are ALREADY_EXISTS.
  {
    auto st = store_.Append("t", {Spec("codes", e, view)}, &out);
    ASSERT_TRUE(st.ok()) << st;
  }
  EXPECT_EQ(out.tokens_duplicate, T);
  Encoded other = Encode(Rows(T, 9), v, T);
  const EncodedGroupsView other_view = ViewOf(other.run);
  const absl::Status st = store_.Append("t", {Spec("codes", other, other_view)}, &out);
  EXPECT_EQ(st.code(), absl::StatusCode::kAlreadyExists);
  EXPECT_THAT(st.message(), HasSubstr("appends[0].encoded: group 0 of layer 0"));
}

// A put in chunks: the first chunk's rows wait in the window; the next chunk's groups cover
// them and replace them. The result is the one-shot put's, byte for byte.
TEST_F(StoreEncodedTest, ChunkedPutsReplaceTheWindowRowsTheirGroupsCover) {
  const int64_t T = 200, first = 50;
  const auto k = Rows(T, 3), v = Rows(T, 4);
  AppendOutcome out;
  // Chunk 1: 50 tokens, a group and 18 window rows.
  std::vector<float> k1, v1;
  for (int h = 0; h < kHeads; ++h) {
    k1.insert(k1.end(), k.begin() + h * T * kDim, k.begin() + (h * T + first) * kDim);
    v1.insert(v1.end(), v.begin() + h * T * kDim, v.begin() + (h * T + first) * kDim);
  }
  const Encoded c1 = Encode(k1, v1, first);
  const EncodedGroupsView v1view = ViewOf(c1.run);
  ASSERT_TRUE(store_.Append("t", {Spec("chunked", c1, v1view)}, &out).ok());
  // Chunk 2: every group from the layer's encoded end on, then the new window.
  const Encoded c2 = Encode(k, v, T, /*from_group=*/1);
  const EncodedGroupsView v2view = ViewOf(c2.run);
  ASSERT_TRUE(store_.Append("t", {Spec("chunked", c2, v2view)}, &out).ok());
  EXPECT_EQ(out.tokens_written, T - first);
  const Encoded all = Encode(k, v, T);
  const EncodedGroupsView all_view = ViewOf(all.run);
  ASSERT_TRUE(store_.Append("t", {Spec("whole", all, all_view)}, &out).ok());
  EXPECT_EQ(Decoded("chunked"), Decoded("whole"));
  // Groups that would leave window rows before them are refused.
  const Encoded late = Encode(k, v, T, /*from_group=*/3);
  AppendSpec s = Spec("short", c1, v1view);
  ASSERT_TRUE(store_.Append("t", {s}, &out).ok());
  const EncodedGroupsView late_view = ViewOf(late.run);
  const absl::Status st = store_.Append("t", {Spec("short", late, late_view)}, &out);
  EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(st.message(), HasSubstr("must start at or before token 32"));
}

TEST_F(StoreEncodedTest, ARefusedRunStoresNothingOfItsMessage) {
  const int64_t T = 96;
  const auto k = Rows(T, 5), v = Rows(T, 6);
  const Encoded good = Encode(k, v, T);
  Encoded bad = good;
  bad.run.bytes[100] ^= 1;
  const EncodedGroupsView gv = ViewOf(good.run), bv = ViewOf(bad.run);
  AppendSpec a = Spec("a", good, gv), b = Spec("b", bad, bv);
  AppendOutcome out;
  const absl::Status st = store_.Append("t", {a, b}, &out);
  EXPECT_EQ(st.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(st.message(), HasSubstr("appends[1].encoded.blocks[0] (group 0, head 0, key)"));
  EXPECT_EQ(store_.Describe("t", "a").status().code(), absl::StatusCode::kNotFound);
  // Another basis's side codes.
  Encoded stranger = good;
  stranger.run.basis_fingerprint = "0123456789abcdef";
  const EncodedGroupsView sv = ViewOf(stranger.run);
  const absl::Status fp = store_.Append("t", {Spec("a", stranger, sv)}, &out);
  EXPECT_EQ(fp.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(fp.message(), HasSubstr("appends[0].encoded.basis_fingerprint '0123456789abcdef'"));
}

TEST_F(StoreEncodedTest, CodesWithTokenIdsShareTheirPrefix) {
  const int64_t T = 128;
  const auto k = Rows(T, 7), v = Rows(T, 8);
  const Encoded e = Encode(k, v, T);
  const EncodedGroupsView view = ViewOf(e.run);
  std::vector<uint32_t> ids(T);
  for (int64_t t = 0; t < T; ++t) ids[t] = static_cast<uint32_t>(1000 + t);
  AppendOutcome out;
  AppendSpec first = Spec("first", e, view);
  first.token_ids = ids;
  ASSERT_TRUE(store_.Append("t", {first}, &out).ok());
  EXPECT_EQ(out.tokens_shared, 0);
  AppendSpec second = Spec("second", e, view);
  second.token_ids = ids;
  ASSERT_TRUE(store_.Append("t", {second}, &out).ok());
  EXPECT_EQ(out.tokens_shared, T);  // every group taken from the index
  EXPECT_EQ(Decoded("second"), Decoded("first"));
  EXPECT_EQ(store_.TenantUsage("t").prefix_blocks, T / 32);
}

}  // namespace
}  // namespace kvq::core
