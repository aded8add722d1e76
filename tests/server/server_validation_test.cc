// Service tests of refused input: each error names its field and limit; damage is harmless.
#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <random>

#include "gmock/gmock.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "kvq/core/codec.h"
#include "kvq/wire/codec_settings.h"
#include "server/auth.h"
#include "tests/server/server_fixture.h"
#include "tests/server/test_util.h"

namespace kvq::testing {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::StartsWith;

TEST(ServiceTest, ValidationErrorsNameFieldAndLimit) {
  server::ServerOptions o;
  o.max_message_bytes = 4 << 20;
  TestServer ts(o);
  auto stub = ts.Stub();
  Shape s;
  Register(*stub, MakeRegister(s, kBasisSeed));
  const int kv = s.kv_heads, d = s.head_dim, qh = s.q_heads;
  auto k = RandomKV(kv, 8, d, 1);
  auto put1 = [&](v1::Append a) {
    v1::PutBlocksRequest m;
    *m.add_appends() = a;
    v1::PutBlocksResponse r;
    return Put(*stub, {m}, &r);
  };
  grpc::Status st = put1(MakeAppend("x", 0, 0, k, k, kv, 8, d, "nope"));
  EXPECT_EQ(st.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_THAT(st.error_message(), HasSubstr("model 'nope' is not registered"));
  st = put1(MakeAppend("x", 0, 0, k, k, kv, 8, d));
  EXPECT_EQ(st.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_THAT(st.error_message(), HasSubstr("must name a model"));
  st = put1(MakeAppend("x", 5, 0, k, k, kv, 8, d, "tiny"));
  EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(st.error_message(), HasSubstr("appends[0].layer 5 must be in 0..1"));
  auto k1 = RandomKV(1, 8, d, 1);
  st = put1(MakeAppend("x", 0, 0, k1, k1, 1, 8, d, "tiny"));
  EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(st.error_message(), HasSubstr("appends[0].keys.shape [1,8,64] must be [kv_heads=2"));
  v1::Append a = MakeAppend("x", 0, 0, k, k, kv, 8, d, "tiny");
  a.mutable_keys()->set_dtype(v1::DTYPE_UNSPECIFIED);
  st = put1(a);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(st.error_message(), HasSubstr("appends[0].keys.dtype must be"));
  a = MakeAppend("", 0, 0, k, k, kv, 8, d, "tiny");
  st = put1(a);
  EXPECT_THAT(st.error_message(), HasSubstr("appends[0].sequence_id must be 1..256 bytes"));
  a = MakeAppend("x", 0, 0, k, k, kv, 8, d, "tiny");
  a.mutable_codec()->set_key_bits(5);
  st = put1(a);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(st.error_message(), HasSubstr("appends[0].codec"));
  // Nothing was created by any of these.
  EXPECT_EQ(ts.server().store().TotalUsage().sequences, 0);

  // A valid sequence, then read errors per item.
  ASSERT_TRUE(put1(MakeAppend("x", 0, 0, k, k, kv, 8, d, "tiny")).ok());
  v1::ScoreRequest sreq;
  auto q = RandomQueries(qh, 1, d, 1);
  auto add = [&](const std::string& seq, int layer, int version, v1::Tensor qt) {
    auto* it = sreq.add_items();
    it->set_sequence_id(seq);
    it->set_layer(layer);
    it->set_basis_version(version);
    *it->mutable_queries() = qt;
  };
  add("x", 0, 0, TensorF32(q, {qh, 1, d}));                         // ok
  add("never", 0, 0, TensorF32(q, {qh, 1, d}));                     // NOT_FOUND
  add("x", 0, 2, TensorF32(q, {qh, 1, d}));                         // FAILED_PRECONDITION
  add("x", 1, 0, TensorF32(q, {qh, 1, d}));                         // layer 1 empty
  add("x", 0, 0, TensorF32(RandomQueries(3, 1, d, 1), {3, 1, d}));  // 3 q_heads, 2 kv_heads
  auto q32 = RandomQueries(qh, 1, 32, 1);
  add("x", 0, 0, TensorF32(q32, {qh, 1, 32}));  // wrong head_dim
  v1::ScoreResponse sresp;
  auto ctx = Ctx();
  ASSERT_TRUE(stub->Score(ctx.get(), sreq, &sresp).ok());
  ASSERT_EQ(sresp.results_size(), 6);
  EXPECT_EQ(sresp.results(0).status().code(), 0);
  EXPECT_EQ(sresp.results(1).status().code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(sresp.results(2).status().code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(sresp.results(2).status().message(), HasSubstr("pinned to version 1"));
  EXPECT_EQ(sresp.results(3).status().code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_EQ(sresp.results(4).status().code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(sresp.results(4).status().message(), HasSubstr("items[4]: queries.shape[0]"));
  EXPECT_EQ(sresp.results(5).status().code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(sresp.results(5).status().message(), HasSubstr("head_dim 32"));

  v1::ScoreRequest empty;
  auto ctx2 = Ctx();
  st = stub->Score(ctx2.get(), empty, &sresp);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(st.error_message(), HasSubstr("expected 1..4096"));

  // Readout with a stale token count.
  v1::ReadoutRequest rreq;
  auto* ri = rreq.add_items();
  ri->set_sequence_id("x");
  ri->set_layer(0);
  *ri->mutable_weights() = TensorF32(std::vector<float>(qh * 7, 0.1f), {qh, 1, 7});
  v1::ReadoutResponse rresp;
  auto ctx3 = Ctx();
  ASSERT_TRUE(stub->Readout(ctx3.get(), rreq, &rresp).ok());
  EXPECT_EQ(rresp.results(0).status().code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(rresp.results(0).status().message(), HasSubstr("weights.shape[2] 7 must equal"));

  // A message over the limit is RESOURCE_EXHAUSTED, answered by gRPC itself.
  v1::EchoRequest big;
  big.set_payload(std::string(5 << 20, 'x'));
  v1::EchoResponse er;
  auto ctx4 = Ctx();
  st = stub->Echo(ctx4.get(), big, &er);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);

  // Delete: NOT_FOUND for an unknown id, then frees.
  v1::DeleteSequenceRequest dreq;
  dreq.set_sequence_id("never");
  v1::DeleteSequenceResponse dresp;
  auto ctx5 = Ctx();
  EXPECT_EQ(stub->DeleteSequence(ctx5.get(), dreq, &dresp).error_code(),
            grpc::StatusCode::NOT_FOUND);
  dreq.set_sequence_id("x");
  auto ctx6 = Ctx();
  ASSERT_TRUE(stub->DeleteSequence(ctx6.get(), dreq, &dresp).ok());
  EXPECT_GT(dresp.bytes_freed(), 0);
  EXPECT_EQ(ts.server().store().TotalUsage().bytes, 0);
}

TEST(ConvertTest, OutOfRangeCodecOverridesAreRejectedNamingFieldAndRange) {
  const core::CodecOptions base = CodecOf(Shape{});
  struct Case {
    std::function<void(v1::CodecSettings*)> set;
    std::string want;
  };
  const std::vector<Case> cases = {
      {[](auto* c) { c->set_window(-1); }, "c.window = -1: must be in [0, 65536]"},
      {[](auto* c) { c->set_window(70000); }, "c.window = 70000: must be in [0, 65536]"},
      {[](auto* c) { c->set_rank(-1); }, "c.rank = -1: must be in [0, head_dim]"},
      {[](auto* c) { c->set_rank(65); }, "c.rank = 65: must be in [0, head_dim]"},
      {[](auto* c) { c->set_value_policy(static_cast<v1::CodecSettings::ValuePolicy>(9)); },
       "c.value_policy = 9: must be VALUE_POLICY_UNIFORM (1) or VALUE_POLICY_A2 (2)"},
      {[](auto* c) { c->set_side_bits(5); }, "c.side_bits = 5: must be 4 or 8"},
      {[](auto* c) { c->set_rank(0), c->set_side_bits(7); }, "c.side_bits = 7"},
      {[](auto* c) { c->set_value_budget(9); }, "c.value_budget = 9: must be in [1, 4]"},
      {[](auto* c) { c->set_value_budget(std::nanf("")); }, "c.value_budget = nan"},
      {[](auto* c) { c->set_key_bits(-1); }, "c.key_bits = -1: must be 2, 3, 4 or 8"},
      {[](auto* c) { c->set_key_group(48); }, "c.key_group = 48: must be 32, 64 or 128"},
      {[](auto* c) { c->set_value_bits(9); }, "c.value_bits = 9"},
      {[](auto* c) { c->set_value_group(-3); }, "c.value_group = -3: must be in [1, head_dim]"},
      {[](auto* c) { c->set_value_group(65); }, "c.value_group = 65"},
      {[](auto* c) { c->set_sink_tokens(-1); }, "c.sink_tokens = -1: must be in [0, 1024]"},
      {[](auto* c) { c->set_sink_tokens(2000); }, "c.sink_tokens = 2000: must be in [0, 1024]"},
      {[](auto* c) { c->set_fp16_sinks(-3); }, "c.fp16_sinks = -3: must be in [0, 16]"},
      {[](auto* c) { c->set_fp16_sinks(20); }, "c.fp16_sinks = 20: must be in [0, 16]"},
  };
  for (const Case& c : cases) {
    v1::CodecSettings settings;
    c.set(&settings);
    const absl::StatusOr<core::CodecOptions> got = wire::MergeCodec(base, settings, "c");
    EXPECT_EQ(got.status().code(), absl::StatusCode::kInvalidArgument) << c.want;
    EXPECT_THAT(std::string(got.status().message()), HasSubstr(c.want));
  }
  // The documented request values: 0 is none for rank and window; a value group need not
  // divide head_dim (the last group is shorter).
  v1::CodecSettings ok;
  ok.set_rank(0);
  ok.set_window(0);
  ok.set_value_group(7);
  absl::StatusOr<core::CodecOptions> got = wire::MergeCodec(base, ok, "c");
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->rank, 0);
  EXPECT_EQ(got->window, 0);
  EXPECT_EQ(got->value_group, 7);

  // On the wire: at sequence creation and in a registration.
  TestServer ts;
  auto stub = ts.Stub();
  Shape s;
  Register(*stub, MakeRegister(s, kBasisSeed));
  auto k = RandomKV(s.kv_heads, 8, s.head_dim, 1);
  v1::PutBlocksRequest m;
  *m.add_appends() = MakeAppend("x", 0, 0, k, k, s.kv_heads, 8, s.head_dim, "tiny");
  m.mutable_appends(0)->mutable_codec()->set_window(-2);
  v1::PutBlocksResponse r;
  grpc::Status st = Put(*stub, {m}, &r);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(st.error_message(), HasSubstr("appends[0].codec.window = -2"));
  EXPECT_EQ(ts.server().store().TotalUsage().sequences, 0);
  Shape other = s;
  other.model = "other";
  v1::RegisterBasisRequest reg = MakeRegister(other, kBasisSeed);
  reg.mutable_info()->mutable_codec()->set_rank(-2);
  v1::RegisterBasisResponse rr;
  auto ctx = Ctx();
  st = stub->RegisterBasis(ctx.get(), reg, &rr);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(st.error_message(), HasSubstr("info.codec.rank = -2"));
  reg = MakeRegister(other, kBasisSeed);
  reg.mutable_info()->set_rope_layout("spiral");
  auto ctx2 = Ctx();
  st = stub->RegisterBasis(ctx2.get(), reg, &rr);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(st.error_message(), HasSubstr("rope_layout"));
}

// value_group leaves at most 64 groups per head (the kernels' limit, core/codec.h): value_group
// 1 on a head_dim-128 model is refused at sequence creation and in a registration, naming the
// field, the limit and the smallest group at that head_dim; 2 is served.
TEST(ConvertTest, ValueGroupsBeyond64PerHeadAreRefusedNamingTheSmallestGroup) {
  TestServer ts;
  auto stub = ts.Stub();
  Shape s;
  s.model = "wide";
  s.head_dim = 128;
  Register(*stub, MakeRegister(s, kBasisSeed));
  const std::string limit =
      "value_group = 1: at most 64 groups per head, so value_group >= 2 "
      "at head_dim 128";
  auto k = RandomKV(s.kv_heads, 8, s.head_dim, 1);
  for (int group : {1, 2}) {
    v1::PutBlocksRequest m;
    *m.add_appends() = MakeAppend("x", 0, 0, k, k, s.kv_heads, 8, s.head_dim, s.model);
    m.mutable_appends(0)->mutable_codec()->set_value_group(group);
    v1::PutBlocksResponse r;
    const grpc::Status st = Put(*stub, {m}, &r);
    if (group == 2) {
      EXPECT_TRUE(st.ok()) << st.error_message();
      continue;
    }
    EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_THAT(st.error_message(), AllOf(StartsWith("appends[0].codec"), HasSubstr(limit)));
    EXPECT_EQ(ts.server().store().TotalUsage().sequences, 0);
  }
  Shape other = s;
  other.model = "wide-registered";
  v1::RegisterBasisRequest reg = MakeRegister(other, kBasisSeed);
  reg.mutable_info()->mutable_codec()->set_value_group(1);
  v1::RegisterBasisResponse rr;
  auto ctx = Ctx();
  const grpc::Status st = stub->RegisterBasis(ctx.get(), reg, &rr);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(st.error_message(), AllOf(StartsWith("info.codec"), HasSubstr(limit)));
}

TEST(AuthTest, ATokenListedForTwoTenantsIsRefusedNamingItsLinesNotTheToken) {
  const std::string dir = TempDir("kvq-auth");
  const std::string file = dir + "/tokens";
  const std::string token = "secret-token-0123456789";
  std::ofstream(file) << "# tokens\n"
                      << token << " alice\n"
                      << "another-token-0123456789 bob\n"
                      << token << " alice\n"  // the same pair again: harmless
                      << token << " bob\n";
  absl::StatusOr<server::Authenticator> a = server::Authenticator::Load(file);
  EXPECT_EQ(a.status().code(), absl::StatusCode::kInvalidArgument);
  const std::string msg(a.status().message());
  EXPECT_THAT(msg, HasSubstr(file + ":5:"));
  EXPECT_THAT(msg, HasSubstr("already listed on line 2 for tenant 'alice'"));
  EXPECT_THAT(msg, ::testing::Not(HasSubstr(token)));
  std::ofstream(file) << token << " alice\n" << token << " alice\n";
  a = server::Authenticator::Load(file);
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(a->tokens(), 1u);
  std::filesystem::remove_all(dir);
}

// Randomly damaged requests (fixed seed): the server answers every one with a status, never
// crashes, and never changes what is stored unless the request was valid.
TEST(ServiceTest, RandomlyDamagedRequestsAreRejectedCleanly) {
  TestServer ts;
  auto stub = ts.Stub();
  Shape s;
  Register(*stub, MakeRegister(s, kBasisSeed));
  const int kv = s.kv_heads, d = s.head_dim, qh = s.q_heads;
  auto k = RandomKV(kv, 48, d, 1), v = RandomKV(kv, 48, d, 2);
  v1::PutBlocksRequest good;
  *good.add_appends() = MakeAppend("z", 0, 0, k, v, kv, 48, d, "tiny");
  v1::PutBlocksResponse r;
  ASSERT_TRUE(Put(*stub, {good}, &r).ok());
  auto q = RandomQueries(qh, 1, d, 1);
  const auto before = FloatsOf(ScoreOne(*stub, "z", 0, q, qh, 1, d).results(0).logits());
  std::mt19937 rng(1234);
  auto pick = [&](int n) { return static_cast<int>(rng() % n); };
  int ok_count = 0;
  for (int iter = 0; iter < 300; ++iter) {
    v1::PutBlocksRequest m = good;
    v1::Append* a = m.mutable_appends(0);
    a->set_sequence_id(pick(4) ? "z" : std::string(pick(2) ? 300 : 0, 'x'));
    v1::Tensor* t = pick(2) ? a->mutable_keys() : a->mutable_values();
    switch (pick(8)) {
      case 0:
        t->set_dtype(static_cast<v1::DType>(pick(6)));
        break;
      case 1:
        t->set_shape(pick(3), static_cast<int64_t>(rng()) - (1ll << 31));
        break;
      case 2:
        t->add_shape(pick(3));
        break;
      case 3:
        t->mutable_data()->resize(pick(40000));
        break;
      case 4:
        a->set_layer(pick(5) - 2);
        break;
      case 5:
        a->set_start(std::vector<int64_t>{-5, 49, 100, int64_t{1} << 40}[pick(4)]);
        break;
      case 6:
        (*t->mutable_data())[pick(static_cast<int>(t->data().size()))] ^= 0x55;
        break;
      case 7:
        a->mutable_codec()->set_key_bits(pick(10));
        break;
    }
    grpc::Status st = Put(*stub, {m}, &r);
    ok_count += st.ok();
    v1::ScoreRequest sreq;
    auto* it = sreq.add_items();
    it->set_sequence_id("z");
    it->set_layer(pick(3) - 1);
    *it->mutable_queries() = TensorF32(q, {qh, 1, d});
    if (pick(2)) it->mutable_queries()->set_shape(pick(2), pick(100) - 10);
    if (pick(4) == 0) it->mutable_queries()->set_dtype(static_cast<v1::DType>(pick(6)));
    v1::ScoreResponse sresp;
    auto ctx = Ctx();
    ASSERT_TRUE(stub->Score(ctx.get(), sreq, &sresp).ok());
    ASSERT_EQ(sresp.results_size(), 1);
  }
  // Only identical re-sends (duplicates) can have succeeded; layer 0 is unchanged.
  auto info = ts.server().store().Describe("default", "z");
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->layer_tokens[0], 48);
  EXPECT_EQ(FloatsOf(ScoreOne(*stub, "z", 0, q, qh, 1, d).results(0).logits()), before);
  EXPECT_GT(ok_count, 0);
}

}  // namespace
}  // namespace kvq::testing
