// Prefix sharing over real gRPC: token ids on PutBlocks, attach without data, per-tenant
// isolation, Stats, and reads equal to an unshared sequence's bit for bit.
#include <fstream>
#include <utility>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/server/test_util.h"

namespace kvq::testing {
namespace {

constexpr uint64_t kBasisSeed = 77;

class PrefixService : public ::testing::Test {
 protected:
  // The server's options; the auth fixture below turns bearer tokens on.
  virtual server::ServerOptions Options() { return {}; }
  // What a call made as `tenant` sends: the x-kvq-tenant metadata and a bearer token ("" = none).
  virtual std::pair<std::string, std::string> CallerOf(const std::string& tenant) {
    return {tenant, ""};
  }
  std::unique_ptr<grpc::ClientContext> CtxAs(const std::string& tenant = "") {
    const auto [meta, token] = CallerOf(tenant);
    return Ctx(meta, token);
  }

  void SetUp() override {
    ts_ = std::make_unique<TestServer>(Options());
    stub_ = ts_->Stub();
    v1::RegisterBasisResponse resp;
    auto ctx = CtxAs();
    grpc::Status st = stub_->RegisterBasis(ctx.get(), MakeRegister(shape_, kBasisSeed), &resp);
    ASSERT_TRUE(st.ok()) << st.error_message();
    for (int i = 0; i < kT; ++i) ids_.push_back(1000 + 3 * i);
    for (int l = 0; l < shape_.layers; ++l) {
      k_.push_back(RandomKV(shape_.kv_heads, kT, shape_.head_dim, 10 + l));
      v_.push_back(RandomKV(shape_.kv_heads, kT, shape_.head_dim, 20 + l));
    }
  }
  // Tokens [from, from + n) of every layer, with or without data and ids, one message.
  v1::PutBlocksRequest Msg(const std::string& seq, int64_t from, int64_t n, bool data,
                           bool with_ids) {
    v1::PutBlocksRequest m;
    const int kv = shape_.kv_heads, d = shape_.head_dim;
    for (int l = 0; l < shape_.layers; ++l) {
      v1::Append a;
      if (data) {
        a = MakeAppend(seq, l, from, Slice(k_[l], kv, kT, d, from, n),
                       Slice(v_[l], kv, kT, d, from, n), kv, n, d, "tiny");
      } else {
        a.set_sequence_id(seq);
        a.set_layer(l);
        a.set_start(from);
        a.set_model("tiny");
      }
      if (with_ids) {
        for (int64_t t = from; t < from + n; ++t) a.add_token_ids(ids_[t]);
      }
      *m.add_appends() = a;
    }
    return m;
  }
  v1::PutBlocksResponse PutOk(const v1::PutBlocksRequest& m, const std::string& tenant = "") {
    v1::PutBlocksResponse r;
    const auto [meta, token] = CallerOf(tenant);
    grpc::Status st = Put(*stub_, {m}, &r, meta, token);
    EXPECT_TRUE(st.ok()) << st.error_message();
    return r;
  }
  std::vector<float> Logits(const std::string& seq, int layer, const std::string& tenant = "") {
    v1::ScoreRequest req;
    auto* it = req.add_items();
    it->set_sequence_id(seq);
    it->set_layer(layer);
    *it->mutable_queries() = TensorF32(RandomQueries(shape_.q_heads, 2, shape_.head_dim, 5),
                                       {shape_.q_heads, 2, shape_.head_dim});
    v1::ScoreResponse resp;
    auto ctx = CtxAs(tenant);
    EXPECT_TRUE(stub_->Score(ctx.get(), req, &resp).ok());
    EXPECT_EQ(resp.results(0).status().code(), 0) << resp.results(0).status().message();
    return FloatsOf(resp.results(0).logits());
  }
  v1::StatsResponse Stats(const std::string& tenant = "") {
    v1::StatsResponse r;
    auto ctx = CtxAs(tenant);
    EXPECT_TRUE(stub_->Stats(ctx.get(), v1::StatsRequest(), &r).ok());
    return r;
  }

  static constexpr int64_t kT = 100;
  std::unique_ptr<TestServer> ts_;
  std::unique_ptr<v1::Kvq::Stub> stub_;
  // 100 tokens are three whole 32-token prefix groups of the legacy default codec.
  Shape shape_ = [] {
    Shape s;
    s.legacy_codec = true;
    return s;
  }();
  std::vector<uint32_t> ids_;
  std::vector<std::vector<float>> k_, v_;
};

TEST_F(PrefixService, AttachThenContinueReadsLikeAnUnsharedSequence) {
  v1::PutBlocksResponse r = PutOk(Msg("a", 0, kT, true, true));
  EXPECT_EQ(r.tokens_written(), 2 * kT);
  EXPECT_EQ(r.tokens_shared(), 0);
  const v1::StatsResponse s1 = Stats();
  EXPECT_EQ(s1.prefix_blocks(), 2 * 3);
  EXPECT_GT(s1.prefix_bytes(), 0);

  // Another request with the same prompt: ids only, then the rest with data.
  r = PutOk(Msg("b", 0, kT, false, true));
  EXPECT_EQ(r.tokens_shared(), 2 * 96);
  EXPECT_EQ(r.tokens_written(), 0);
  ASSERT_EQ(r.lengths_size(), 2);
  EXPECT_EQ(r.lengths(0).tokens(), 96);
  r = PutOk(Msg("b", 96, kT - 96, true, true));
  EXPECT_EQ(r.tokens_written(), 2 * 4);
  // The reference: the same tokens without ids, nothing shared.
  r = PutOk(Msg("c", 0, kT, true, false));
  EXPECT_EQ(r.tokens_shared(), 0);
  for (int l = 0; l < shape_.layers; ++l) {
    EXPECT_EQ(Logits("b", l), Logits("c", l));
    EXPECT_EQ(Logits("a", l), Logits("c", l));
  }
  const v1::StatsResponse s2 = Stats();
  EXPECT_EQ(s2.prefix_blocks(), s1.prefix_blocks());
  EXPECT_EQ(s2.shared_tokens(), 2 * 96);
  EXPECT_EQ(s2.retained_prefix_bytes(), 0);

  // Deleting every holder leaves the groups retained, reported as such.
  for (const char* seq : {"a", "b"}) {
    v1::DeleteSequenceRequest d;
    d.set_sequence_id(seq);
    v1::DeleteSequenceResponse dr;
    auto ctx = CtxAs();
    ASSERT_TRUE(stub_->DeleteSequence(ctx.get(), d, &dr).ok());
  }
  const v1::StatsResponse s3 = Stats();
  EXPECT_EQ(s3.retained_prefix_bytes(), s3.prefix_bytes());
  EXPECT_EQ(s3.prefix_blocks(), s1.prefix_blocks());
}

// MatchPrefix: the lookup of a serving engine, one round trip that moves and changes nothing.
TEST_F(PrefixService, MatchPrefixCountsWhatAnAttachWouldTakeAndChangesNothing) {
  PutOk(Msg("a", 0, kT, true, true));
  PutOk(Msg("short", 0, 40, true, false));
  const v1::StatsResponse before = Stats();
  auto match = [&](const std::string& tenant, v1::MatchPrefixRequest req, grpc::Status* st) {
    v1::MatchPrefixResponse r;
    auto ctx = CtxAs(tenant);
    *st = stub_->MatchPrefix(ctx.get(), req, &r);
    return r;
  };
  v1::MatchPrefixRequest req;
  req.set_model("tiny");
  for (uint32_t id : ids_) req.add_token_ids(id);
  for (const char* id : {"a", "short", "absent"}) req.add_sequence_ids(id);
  grpc::Status st;
  v1::MatchPrefixResponse r = match("", req, &st);
  ASSERT_TRUE(st.ok()) << st.error_message();
  EXPECT_EQ(r.indexed_tokens(), 96);
  EXPECT_THAT(r.sequence_tokens(), ::testing::ElementsAre(kT, 40, 0));
  const v1::StatsResponse after = Stats();
  EXPECT_EQ(after.sequences(), before.sequences());
  EXPECT_EQ(after.stored_bytes(), before.stored_bytes());
  EXPECT_EQ(after.shared_tokens(), before.shared_tokens());
  // Another tenant sees none of it.
  r = match("other", req, &st);
  ASSERT_TRUE(st.ok()) << st.error_message();
  EXPECT_EQ(r.indexed_tokens(), 0);
  EXPECT_THAT(r.sequence_tokens(), ::testing::ElementsAre(0, 0, 0));
  // Errors name the field.
  v1::MatchPrefixRequest bad = req;
  bad.set_sequence_ids(1, "");
  match("", bad, &st);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(st.error_message(), ::testing::HasSubstr("sequence_ids[1]"));
  bad = req;
  bad.set_model("nope");
  match("", bad, &st);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_THAT(st.error_message(), ::testing::HasSubstr("model"));
  bad = req;
  bad.mutable_codec()->set_key_bits(7);
  match("", bad, &st);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(st.error_message(), ::testing::HasSubstr("codec"));
}

TEST_F(PrefixService, TenantsShareNothing) {
  PutOk(Msg("a", 0, kT, true, true), "alpha");
  v1::PutBlocksResponse r = PutOk(Msg("a", 0, kT, false, true), "beta");
  EXPECT_EQ(r.tokens_shared(), 0);
  EXPECT_EQ(r.lengths(0).tokens(), 0);
  EXPECT_EQ(Stats("beta").prefix_blocks(), 0);
  EXPECT_EQ(Stats("alpha").prefix_blocks(), 6);
}

TEST_F(PrefixService, BadTokenIdsAreInvalidArgumentAndStoreNothing) {
  v1::PutBlocksRequest m = Msg("a", 0, 40, true, true);
  m.mutable_appends(1)->mutable_token_ids()->RemoveLast();
  v1::PutBlocksResponse r;
  grpc::Status st = Put(*stub_, {m}, &r);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(st.error_message(), ::testing::HasSubstr("appends[1].token_ids has 39 ids"));
  // Ids but no data at an unaligned start.
  m = Msg("a", 5, 40, false, true);
  st = Put(*stub_, {m}, &r);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(st.error_message(), ::testing::HasSubstr("multiple of the group size G = 32"));
  EXPECT_EQ(Stats().sequences(), 0);
  EXPECT_EQ(Stats().stored_bytes(), 0);
}

// With auth on, the tenant is the token's, never the x-kvq-tenant metadata: every call below
// claims to be "alpha" in the metadata, and only the bearer token says who calls.
class PrefixServiceWithAuth : public PrefixService {
 protected:
  server::ServerOptions Options() override {
    const std::string tokens = TempDir("kvq-prefix-auth") + "/tokens";
    std::ofstream(tokens) << kAlpha << " alpha\n" << kBeta << " beta\n";
    server::ServerOptions o;
    o.auth_tokens_file = tokens;
    o.admin_tenants = "alpha";
    return o;
  }
  std::pair<std::string, std::string> CallerOf(const std::string& tenant) override {
    return {"alpha", tenant == "beta" ? kBeta : kAlpha};
  }
  static constexpr const char* kAlpha = "alpha-token-0123456789";
  static constexpr const char* kBeta = "beta-token-0123456789";
};

// Paired: alpha's second request attaches alpha's prompt; beta, sending the same ids, gets
// exactly what ids nobody stored get (nothing shared, nothing attached), writes its own copy
// when it sends data, and leaves alpha's index as it was.
TEST_F(PrefixServiceWithAuth, TheTokensTenantAttachesAndAnotherTenantMisses) {
  PutOk(Msg("a", 0, kT, true, true), "alpha");
  const v1::StatsResponse alpha_before = Stats("alpha");
  EXPECT_EQ(alpha_before.prefix_blocks(), 2 * 3);

  v1::PutBlocksResponse hit = PutOk(Msg("b", 0, kT, false, true), "alpha");
  EXPECT_EQ(hit.tokens_shared(), 2 * 96);
  EXPECT_EQ(hit.lengths(0).tokens(), 96);

  const v1::PutBlocksResponse miss = PutOk(Msg("b", 0, kT, false, true), "beta");
  EXPECT_EQ(miss.tokens_shared(), 0);
  EXPECT_EQ(miss.lengths(0).tokens(), 0);
  // The same attach with ids that no tenant ever stored answers the same, field for field.
  for (uint32_t& id : ids_) id += 7;
  const v1::PutBlocksResponse absent = PutOk(Msg("b", 0, kT, false, true), "beta");
  EXPECT_EQ(miss.SerializeAsString(), absent.SerializeAsString());
  for (uint32_t& id : ids_) id -= 7;

  // Beta's own data with alpha's ids: stored in beta's index, shared with nobody.
  const v1::PutBlocksResponse own = PutOk(Msg("a", 0, kT, true, true), "beta");
  EXPECT_EQ(own.tokens_written(), 2 * kT);
  EXPECT_EQ(own.tokens_shared(), 0);
  EXPECT_EQ(Stats("beta").prefix_blocks(), 2 * 3);
  EXPECT_EQ(Stats("alpha").prefix_blocks(), alpha_before.prefix_blocks());
  EXPECT_EQ(Stats("alpha").shared_tokens(), 2 * 96);
  EXPECT_EQ(Stats("beta").shared_tokens(), 0);
  EXPECT_EQ(Stats("beta").tenant(), "beta");  // the token's tenant, not the metadata's claim
}

}  // namespace
}  // namespace kvq::testing
