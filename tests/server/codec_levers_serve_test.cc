// The codec levers (Hadamard rotation, metric rounding, the oblique encode/decode pair) through
// the whole server: RegisterBasis carries the encode basis and query moments, the codec
// switches travel on the wire both ways, and a sequence created through the store reads
// (Score, Readout, Attend, GetBlocks) exactly as an in-process LayerCache built from the same
// basis and codec.
#include <filesystem>
#include <optional>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "kvq/core/basis.h"
#include "kvq/core/cache.h"
#include "kvq/core/codec_json.h"
#include "kvq/core/metrics.h"
#include "kvq/wire/codec_settings.h"
#include "server/convert.h"
#include "tests/server/test_util.h"

namespace kvq::testing {
namespace {

using ::testing::HasSubstr;

constexpr uint64_t kSeed = 11;

grpc::Status RegisterStatus(v1::Kvq::Stub& stub, const v1::RegisterBasisRequest& req,
                            v1::RegisterBasisResponse* resp = nullptr) {
  v1::RegisterBasisResponse ignored;
  auto ctx = Ctx();
  return stub.RegisterBasis(ctx.get(), req, resp ? resp : &ignored);
}

// A new item of a Score / Readout / Attend request reading (seq, layer).
template <class Request>
auto* ItemFor(Request* req, const std::string& seq, int layer) {
  auto* it = req->add_items();
  it->set_sequence_id(seq);
  it->set_layer(layer);
  return it;
}

// The lever codec the server's new default is meant to use: rotated keys, metric rounding.
v1::RegisterBasisRequest LeverRegister(const core::ModelBasis& b) {
  v1::RegisterBasisRequest req = RegisterOf(b, 4);
  req.mutable_info()->mutable_codec()->set_rotate_keys(true);
  req.mutable_info()->mutable_codec()->set_metric_rounding(true);
  return req;
}

TEST(CodecLeversServeTest, RegisterBasisCarriesEncodeBasisAndQueryMoments) {
  TestServer ts;
  auto stub = ts.Stub();
  Shape s;
  s.model = "levers";
  const core::ModelBasis b = MakeLeverBasis(s, kSeed);
  v1::RegisterBasisResponse resp;
  grpc::Status st = RegisterStatus(*stub, LeverRegister(b), &resp);
  ASSERT_TRUE(st.ok()) << st.error_message();
  const v1::ModelInfo& info = resp.model();
  EXPECT_TRUE(info.oblique());
  EXPECT_TRUE(info.has_query_moment());
  EXPECT_EQ(info.kind(), "oblique_rrr");
  EXPECT_EQ(info.fingerprint(), core::BasisFingerprint(b));  // U, A and the moments
  EXPECT_TRUE(info.codec().rotate_keys());
  EXPECT_TRUE(info.codec().has_rotate_values());  // responses fill every field
  EXPECT_FALSE(info.codec().rotate_values());
  EXPECT_TRUE(info.codec().metric_rounding());

  // Persisted with the entry: the folder reads back with both tensors and the switches.
  const std::string entry = ts.registry_dir() + "/levers/v1";
  absl::StatusOr<core::ModelBasis> back = core::ReadBasis(entry);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->encode, b.encode);
  EXPECT_EQ(back->query_moment, b.query_moment);
  core::Registry reloaded(ts.registry_dir());
  ASSERT_TRUE(reloaded.LoadAll(nullptr, nullptr).ok());
  auto e = reloaded.Get("levers", 1);
  ASSERT_TRUE(e.ok()) << e.status();
  EXPECT_TRUE((*e)->codec.rotate_keys);
  EXPECT_TRUE((*e)->codec.metric_rounding);
  EXPECT_FALSE((*e)->codec.rotate_values);

  // The same again is "already registered"; without the moments it is another basis.
  ASSERT_TRUE(RegisterStatus(*stub, LeverRegister(b), &resp).ok());
  EXPECT_TRUE(resp.already_registered());
  v1::RegisterBasisRequest no_moment = LeverRegister(b);
  no_moment.clear_query_moment();
  no_moment.mutable_info()->mutable_codec()->set_metric_rounding(false);
  st = RegisterStatus(*stub, no_moment);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::ALREADY_EXISTS) << st.error_message();

  // GetModel says the same.
  v1::GetModelRequest g;
  g.set_model("levers");
  v1::ModelInfo got;
  auto ctx = Ctx();
  ASSERT_TRUE(stub->GetModel(ctx.get(), g, &got).ok());
  EXPECT_TRUE(got.oblique());
  EXPECT_TRUE(got.has_query_moment());
}

TEST(CodecLeversServeTest, BadEncodeBasesAndMomentsAreRefusedNamingWhat) {
  TestServer ts;
  auto stub = ts.Stub();
  Shape s;
  s.model = "bad";
  const core::ModelBasis b = MakeLeverBasis(s, kSeed);
  auto refused = [&](const v1::RegisterBasisRequest& req, const std::string& want) {
    grpc::Status st = RegisterStatus(*stub, req);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << want;
    EXPECT_THAT(st.error_message(), HasSubstr(want));
  };
  {  // A^T B != I: column 1 of the encode basis of layer 1 scaled.
    core::ModelBasis bad = b;
    for (int a = 0; a < s.head_dim; ++a)
      bad.encode[bad.HeadOffset(1, 0) + a * s.basis_rank + 1] *= 2;
    refused(RegisterOf(bad),
            "layer 1 head 0: encode column 1 and decode column 1 are not biorthogonal");
  }
  {  // An encode basis for one layer of two.
    v1::RegisterBasisRequest req = RegisterOf(b);
    req.mutable_encode_basis()->RemoveLast();
    refused(req, "encode_basis holds 1 tensors; expected one per layer (2)");
  }
  {  // A moment of the basis's shape instead of [kv, d, d].
    v1::RegisterBasisRequest req = RegisterOf(b);
    *req.mutable_query_moment(0) = req.basis(0);
    refused(req, "query_moment[0] must be DTYPE_F32 [kv_heads=2, head_dim=64, head_dim=64]");
  }
  {
    core::ModelBasis bad = b;
    bad.query_moment[5] = std::numeric_limits<float>::quiet_NaN();
    refused(RegisterOf(bad), "query moment holds a non-finite value");
  }
  {
    core::ModelBasis bad = b;
    bad.query_moment[1] += 1.0f;  // (0, 1) != (1, 0)
    refused(RegisterOf(bad), "query moment is not symmetric at (0, 1)");
  }
  {  // Metric rounding without moments, as a model default and as a sequence's override.
    core::ModelBasis plain = b;
    plain.query_moment.clear();
    v1::RegisterBasisRequest req = LeverRegister(plain);
    refused(req, "metric_rounding needs the basis's query moment");
    req.mutable_info()->mutable_codec()->set_metric_rounding(false);
    ASSERT_TRUE(RegisterStatus(*stub, req).ok());
    auto k = RandomKV(s.kv_heads, 40, s.head_dim, 1);
    v1::Append a = MakeAppend("x", 0, 0, k, k, s.kv_heads, 40, s.head_dim, "bad");
    a.mutable_codec()->set_metric_rounding(true);
    v1::PutBlocksRequest m;
    *m.add_appends() = a;
    v1::PutBlocksResponse put;
    grpc::Status st = Put(*stub, {m}, &put);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << st.error_message();
    EXPECT_THAT(st.error_message(), HasSubstr("metric_rounding needs query moments"));
  }
  {  // Encode basis or moments without a basis.
    v1::RegisterBasisRequest req = RegisterOf(b);
    req.mutable_info()->set_basis_rank(0);
    req.mutable_info()->clear_codec();
    req.clear_basis();
    refused(req, "basis, encode_basis and query_moment must be empty when info.basis_rank is 0");
  }
}

// One mapping for every crossing: CodecSettings' fields are codec.json's keys (both come from
// core's codec table; codec_schema_test holds the descriptor to it), and a codec sent in the
// request form and merged over any base is that codec again, every field of it.
TEST(CodecWireTest, FieldsAreCodecJsonKeysAndEveryCodecRoundTrips) {
  // codec.json writes the dense-and-sparse fields only when set (so older entries' files stay
  // as they were): a codec with them set names every key that has a wire form.
  core::CodecOptions all;
  all.sparse_keys = all.sparse_values = 1;
  const nlohmann::json keys = core::CodecToJson(all);
  const google::protobuf::Descriptor* d = v1::CodecSettings::descriptor();
  ASSERT_EQ(static_cast<size_t>(d->field_count()), keys.size());
  for (int i = 0; i < d->field_count(); ++i)
    EXPECT_TRUE(keys.contains(d->field(i)->name())) << d->field(i)->name();

  std::vector<core::CodecOptions> codecs(4);
  codecs[1].key_bits = 3, codecs[1].key_group = 128, codecs[1].rank = 4, codecs[1].side_bits = 4;
  codecs[1].fp16_sinks = 4, codecs[1].rotate_keys = true, codecs[1].metric_rounding = true;
  codecs[2].value_policy = core::ValuePolicy::kA2, codecs[2].value_budget = 2.5f;
  codecs[2].sink_tokens = 0, codecs[2].window = 64, codecs[2].value_group = 64;
  codecs[3].value_bits = 3, codecs[3].rotate_values = true, codecs[3].fp16_sinks = 16;
  codecs[2].sparse_keys = 5, codecs[2].sparse_values = 10, codecs[1].sparse_values = 3;
  core::CodecOptions base;
  base.rank = 8, base.window = 16, base.sink_tokens = 9, base.fp16_sinks = 2;
  base.rotate_keys = base.rotate_values = base.metric_rounding = true;
  for (const core::CodecOptions& o : codecs) {
    absl::StatusOr<v1::CodecSettings> w = wire::CodecToWire(o);
    ASSERT_TRUE(w.ok()) << w.status();
    absl::StatusOr<core::CodecOptions> back = wire::MergeCodec(base, *w, "codec");
    ASSERT_TRUE(back.ok()) << back.status();
    EXPECT_EQ(core::CodecToJson(*back), core::CodecToJson(o)) << o.ToString();
  }
  // Only the named fields: a codec.json naming rank 0 asks for a real 0, nothing else.
  absl::StatusOr<v1::CodecSettings> partial =
      wire::CodecToWire(codecs[0], nlohmann::json{{"rank", 0}, {"fp16_sinks", 0}});
  ASSERT_TRUE(partial.ok());
  v1::CodecSettings expect;
  expect.set_rank(0);
  expect.set_fp16_sinks(0);
  EXPECT_EQ(partial->SerializeAsString(), expect.SerializeAsString());
  v1::CodecSettings bad;
  bad.set_fp16_sinks(-1);  // once a real 0; now out of range like any other negative
  EXPECT_THAT(std::string(wire::MergeCodec(base, bad, "appends[0].codec").status().message()),
              HasSubstr("appends[0].codec.fp16_sinks = -1: must be in [0, 16]"));
  bad.set_fp16_sinks(17);
  EXPECT_THAT(std::string(wire::MergeCodec(base, bad, "codec").status().message()),
              HasSubstr("codec.fp16_sinks = 17: must be in [0, 16]"));
}

// proto3 presence on CodecSettings is the only "unset": a field left out keeps the base's
// value, a set one is taken as sent (0 and false included) and must be in range; the older
// forms (-1 for a real 0, 0 for "the default", tri-state switches) are gone.
TEST(CodecWireTest, PresenceIsTheOnlyUnsetAndSetValuesAreTakenAsSent) {
  core::CodecOptions base;
  base.head_dim = 64;
  base.rank = 8, base.window = 16, base.sink_tokens = 9, base.fp16_sinks = 2;
  base.rotate_values = true;
  auto merge = [&](const v1::CodecSettings& s) {
    v1::CodecSettings received;  // as the server parses it
    EXPECT_TRUE(received.ParseFromString(s.SerializeAsString()));
    return wire::MergeCodec(base, received, "codec");
  };
  const std::string want_base = core::CodecToJson(base).dump();

  // Nothing set: the model's defaults, and nothing on the wire.
  v1::CodecSettings unset;
  EXPECT_EQ(unset.ByteSizeLong(), 0u);
  absl::StatusOr<core::CodecOptions> got = merge(unset);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(core::CodecToJson(*got).dump(), want_base);

  // Zeros and false set explicitly: sent (two bytes each) and taken as sent.
  v1::CodecSettings zero;
  zero.set_rank(0);
  zero.set_window(0);
  zero.set_sink_tokens(0);
  zero.set_fp16_sinks(0);
  zero.set_rotate_values(false);
  EXPECT_EQ(zero.ByteSizeLong(), 10u);
  got = merge(zero);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->rank, 0);
  EXPECT_EQ(got->window, 0);
  EXPECT_EQ(got->sink_tokens, 0);
  EXPECT_EQ(got->fp16_sinks, 0);
  EXPECT_FALSE(got->rotate_values);
  EXPECT_EQ(got->key_bits, base.key_bits);  // the rest stays the model's

  // A 0 set where 0 is no setting, or the policy set to VALUE_POLICY_DEFAULT, is out of range.
  const struct {
    void (*set)(v1::CodecSettings*);
    const char* error;
  } refused[] = {
      {[](v1::CodecSettings* c) { c->set_rank(-1); }, "codec.rank = -1: must be in [0, head_dim]"},
      {[](v1::CodecSettings* c) { c->set_key_bits(0); },
       "codec.key_bits = 0: must be 2, 3, 4 or 8"},
      {[](v1::CodecSettings* c) { c->set_side_bits(0); }, "codec.side_bits = 0: must be 4 or 8"},
      {[](v1::CodecSettings* c) { c->set_value_group(0); },
       "codec.value_group = 0: must be in [1, head_dim]"},
      {[](v1::CodecSettings* c) { c->set_value_budget(0); },
       "codec.value_budget = 0: must be in [1, 4]"},
      {[](v1::CodecSettings* c) { c->set_value_policy(v1::CodecSettings::VALUE_POLICY_DEFAULT); },
       "codec.value_policy = 0: must be VALUE_POLICY_UNIFORM (1) or VALUE_POLICY_A2 (2)"},
  };
  for (const auto& r : refused) {
    v1::CodecSettings s;
    r.set(&s);
    got = merge(s);
    EXPECT_EQ(got.status().code(), absl::StatusCode::kInvalidArgument) << r.error;
    EXPECT_THAT(std::string(got.status().message()), HasSubstr(r.error));
  }

  // Answers set every field, a 0 as 0.
  core::CodecOptions c = base;
  c.rank = 0;
  c.window = 0;
  absl::StatusOr<v1::CodecSettings> out = wire::CodecToWire(c);
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_TRUE(out->has_rank());
  EXPECT_EQ(out->rank(), 0);
  EXPECT_TRUE(out->has_window());
  EXPECT_EQ(out->window(), 0);
  EXPECT_TRUE(out->has_rotate_keys());
  EXPECT_FALSE(out->rotate_keys());
}

// The same through the server: a sequence created with rank 0 set explicitly is encoded at
// rank 0 (KIVI-like); one that leaves rank out gets the model's 4; -1 is refused.
TEST(CodecLeversServeTest, AnExplicitZeroRankReachesTheSequence) {
  TestServer ts;
  auto stub = ts.Stub();
  Shape s;
  ASSERT_TRUE(RegisterStatus(*stub, MakeRegister(s, kSeed, 4)).ok());
  const auto k = RandomKV(s.kv_heads, 40, s.head_dim, 3);
  const struct {
    const char* seq;
    std::optional<int> rank;  // what the append's codec sets
    int want;
  } cases[] = {{"unset", std::nullopt, 4}, {"zero", 0, 0}, {"two", 2, 2}};
  for (const auto& c : cases) {
    v1::Append a = MakeAppend(c.seq, 0, 0, k, k, s.kv_heads, 40, s.head_dim, s.model);
    a.mutable_codec();  // present, possibly empty
    if (c.rank) a.mutable_codec()->set_rank(*c.rank);
    v1::PutBlocksRequest m;
    *m.add_appends() = a;
    v1::PutBlocksResponse put;
    grpc::Status st = Put(*stub, {m}, &put);
    ASSERT_TRUE(st.ok()) << c.seq << ": " << st.error_message();
    absl::StatusOr<core::SequenceInfo> info = ts.server().store().Describe("default", c.seq);
    ASSERT_TRUE(info.ok()) << info.status();
    EXPECT_EQ(info->codec.rank, c.want) << c.seq;
  }
  v1::Append a = MakeAppend("minus-one", 0, 0, k, k, s.kv_heads, 40, s.head_dim, s.model);
  a.mutable_codec()->set_rank(-1);
  v1::PutBlocksRequest m;
  *m.add_appends() = a;
  v1::PutBlocksResponse put;
  const grpc::Status st = Put(*stub, {m}, &put);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << st.error_message();
  EXPECT_THAT(st.error_message(), HasSubstr("codec.rank = -1"));
  EXPECT_FALSE(ts.server().store().Describe("default", "minus-one").ok());
}

TEST(CodecLeversServeTest, CodecSwitchesAreOptionalBools) {
  core::CodecOptions base;
  base.head_dim = 64;
  base.rotate_values = true;
  v1::CodecSettings s;
  s.set_rotate_keys(true);
  s.set_rotate_values(false);
  absl::StatusOr<core::CodecOptions> c = wire::MergeCodec(base, s, "codec");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_TRUE(c->rotate_keys);
  EXPECT_FALSE(c->rotate_values);
  EXPECT_FALSE(c->metric_rounding);  // unset: the base's
  s.clear_rotate_values();
  s.set_metric_rounding(true);
  c = wire::MergeCodec(base, s, "codec");
  ASSERT_TRUE(c.ok());
  EXPECT_TRUE(c->rotate_values);
  EXPECT_TRUE(c->metric_rounding);
  absl::StatusOr<v1::CodecSettings> out = wire::CodecToWire(*c);
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_TRUE(out->rotate_keys());
  EXPECT_TRUE(out->rotate_values());
  EXPECT_TRUE(out->metric_rounding());
  c->rotate_keys = false;
  out = wire::CodecToWire(*c);
  EXPECT_TRUE(out->has_rotate_keys());
  EXPECT_FALSE(out->rotate_keys());
  s.set_rotate_values(true);
  base.head_dim = 48;  // rotation needs a power of two
  c = wire::MergeCodec(base, s, "codec");
  EXPECT_THAT(std::string(c.status().message()), HasSubstr("power of two"));
}

// What a sequence made through the server reads equals an in-process cache of the same basis
// (U as decode basis, A as encode basis, the moments) and codec, for the model's lever codec
// and for a sequence overriding it (values rotated too, metric rounding off).
TEST(CodecLeversServeTest, SequencesReadAsAnInProcessLeverCache) {
  TestServer ts;
  auto stub = ts.Stub();
  Shape s;
  s.model = "levers";
  const core::ModelBasis b = MakeLeverBasis(s, kSeed);
  ASSERT_TRUE(RegisterStatus(*stub, LeverRegister(b)).ok());
  const int kv = s.kv_heads, d = s.head_dim, qh = s.q_heads;
  const int64_t T = 111;  // three groups of 32 and a tail
  core::CodecOptions model_codec = CodecOf(s, 4);
  model_codec.rotate_keys = true;
  model_codec.metric_rounding = true;
  core::CodecOptions override_codec = model_codec;
  override_codec.rotate_values = true;
  override_codec.metric_rounding = false;
  // Dense-and-sparse (not with rotated keys): its lists are read on every path.
  core::CodecOptions sparse_codec = model_codec;
  sparse_codec.rotate_keys = false;
  sparse_codec.sparse_keys = 10;
  sparse_codec.sparse_values = 20;

  for (const auto& [seq, codec] : {std::pair{std::string("model"), model_codec},
                                   std::pair{std::string("over"), override_codec},
                                   std::pair{std::string("sparse"), sparse_codec}}) {
    SCOPED_TRACE(seq);
    const int layer = 1;
    auto k = RandomKV(kv, T, d, 5), v = RandomKV(kv, T, d, 6);
    v1::Append a = MakeAppend(seq, layer, 0, k, v, kv, T, d, "levers");
    if (seq == "over") {
      a.mutable_codec()->set_rotate_values(true);
      a.mutable_codec()->set_metric_rounding(false);
    }
    if (seq == "sparse") {
      a.mutable_codec()->set_rotate_keys(false);
      a.mutable_codec()->set_sparse_keys(10);
      a.mutable_codec()->set_sparse_values(20);
    }
    v1::PutBlocksRequest m;
    *m.add_appends() = a;
    v1::PutBlocksResponse put;
    grpc::Status st = Put(*stub, {m}, &put);
    ASSERT_TRUE(st.ok()) << st.error_message();
    absl::StatusOr<core::SequenceInfo> info = ts.server().store().Describe("default", seq);
    ASSERT_TRUE(info.ok()) << info.status();
    EXPECT_EQ(core::CodecToJson(info->codec), core::CodecToJson(codec));

    const std::vector<float> u = LayerBasis(b, layer, codec.rank);
    const std::vector<float> enc = LayerBasis(b, layer, codec.rank, /*encode=*/true);
    core::LayerCache ref(codec, kv, u.data(), nullptr, enc.data(), b.query_moment_head(layer, 0));
    std::string kb = ToF16Bytes(k), vb = ToF16Bytes(v);
    ASSERT_TRUE(ref.Append(core::TensorView::Contiguous(kb.data(), core::DType::kF16, {kv, T, d}),
                           core::TensorView::Contiguous(vb.data(), core::DType::kF16, {kv, T, d}),
                           0)
                    .ok());

    auto q = RandomQueries(qh, 3, d, 9);
    v1::ScoreRequest sreq;
    *ItemFor(&sreq, seq, layer)->mutable_queries() = TensorF32(q, {qh, 3, d});
    v1::ScoreResponse sresp;
    auto c1 = Ctx();
    ASSERT_TRUE(stub->Score(c1.get(), sreq, &sresp).ok());
    ASSERT_EQ(sresp.results(0).status().code(), 0) << sresp.results(0).status().message();
    std::vector<float> want(qh * 3 * T);
    ASSERT_TRUE(ref.Score(q.data(), qh, 3, want.data()).ok());
    EXPECT_EQ(FloatsOf(sresp.results(0).logits()), want);

    std::vector<float> p(want.size());
    for (int r = 0; r < qh * 3; ++r) core::Softmax(want.data() + r * T, T, p.data() + r * T);
    v1::ReadoutRequest rreq;
    *ItemFor(&rreq, seq, layer)->mutable_weights() = TensorF32(p, {qh, 3, T});
    v1::ReadoutResponse rresp;
    auto c2 = Ctx();
    ASSERT_TRUE(stub->Readout(c2.get(), rreq, &rresp).ok());
    std::vector<float> out(qh * 3 * d);
    ASSERT_TRUE(ref.Readout(p.data(), qh, 3, out.data()).ok());
    EXPECT_EQ(FloatsOf(rresp.results(0).outputs()), out);

    v1::AttendRequest areq;
    auto* ai = ItemFor(&areq, seq, layer);
    ai->set_causal_offset(70);
    ai->set_observe(false);
    *ai->mutable_queries() = TensorF32(q, {qh, 3, d});
    v1::AttendResponse aresp;
    auto c3 = Ctx();
    ASSERT_TRUE(stub->Attend(c3.get(), areq, &aresp).ok());
    core::AttendOptions ao;
    ao.causal_offset = 70;
    ao.observe = false;
    std::vector<float> o(qh * 3 * d);
    ASSERT_TRUE(ref.Attend(q.data(), qh, 3, ao, o.data()).ok());
    EXPECT_EQ(FloatsOf(aresp.results(0).outputs()), o);

    // GetBlocks: the keys and values attention sees.
    v1::GetBlocksRequest greq;
    greq.set_sequence_id(seq);
    greq.add_layers(layer);
    greq.set_dtype(v1::DTYPE_F32);
    auto c4 = Ctx();
    auto reader = stub->GetBlocks(c4.get(), greq);
    v1::GetBlocksResponse gm;
    std::vector<float> gk, gv;
    while (reader->Read(&gm)) {
      ASSERT_EQ(gm.keys().shape(1), T) << "one message for the whole layer";
      gk = FloatsOf(gm.keys());
      gv = FloatsOf(gm.values());
    }
    ASSERT_TRUE(reader->Finish().ok());
    std::vector<float> dk, dv;
    ASSERT_TRUE(ref.Decode(&dk, &dv).ok());
    EXPECT_EQ(gk, dk);
    EXPECT_EQ(gv, dv);
  }
}

}  // namespace
}  // namespace kvq::testing
