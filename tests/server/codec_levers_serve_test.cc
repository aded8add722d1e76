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
  req.mutable_info()->mutable_codec()->set_rotate_keys(1);
  req.mutable_info()->mutable_codec()->set_metric_rounding(1);
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
  EXPECT_EQ(info.codec().rotate_keys(), 1);
  EXPECT_EQ(info.codec().rotate_values(), -1);  // responses fill every switch
  EXPECT_EQ(info.codec().metric_rounding(), 1);

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
  no_moment.mutable_info()->mutable_codec()->set_metric_rounding(-1);
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
    req.mutable_info()->mutable_codec()->set_metric_rounding(0);
    ASSERT_TRUE(RegisterStatus(*stub, req).ok());
    auto k = RandomKV(s.kv_heads, 40, s.head_dim, 1);
    v1::Append a = MakeAppend("x", 0, 0, k, k, s.kv_heads, 40, s.head_dim, "bad");
    a.mutable_codec()->set_metric_rounding(1);
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

// One mapping for every crossing: CodecSettings' fields are codec.json's keys (a field added
// to one and not the other fails here), and a codec sent in the request form and merged over
// any base is that codec again, every field of it.
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
  expect.set_rank(-1);
  expect.set_fp16_sinks(-1);
  EXPECT_EQ(partial->SerializeAsString(), expect.SerializeAsString());
  v1::CodecSettings bad;
  bad.set_fp16_sinks(-2);
  EXPECT_THAT(std::string(wire::MergeCodec(base, bad, "appends[0].codec").status().message()),
              HasSubstr("appends[0].codec.fp16_sinks = -2: must be -1 (none)"));
  bad.set_fp16_sinks(17);
  EXPECT_THAT(std::string(wire::MergeCodec(base, bad, "codec").status().message()),
              HasSubstr("codec: codec.fp16_sinks = 17: must be in [0, 16]"));
}

// proto3 presence on CodecSettings: a 0 set explicitly travels and arrives as 0, while the
// forms of clients built before it (a field left out: the default; -1: a real 0; a 0 of a field
// that has no 0 setting: the default) mean what they meant, byte for byte the same messages.
TEST(CodecWireTest, AnExplicitZeroArrivesAsZeroAndOldFormsKeepTheirMeaning) {
  core::CodecOptions base;
  base.head_dim = 64;
  base.rank = 8, base.window = 16, base.sink_tokens = 9, base.fp16_sinks = 2;
  base.rotate_values = true;
  auto merged = [&](const v1::CodecSettings& s) {
    v1::CodecSettings received;  // as the server parses it
    EXPECT_TRUE(received.ParseFromString(s.SerializeAsString()));
    absl::StatusOr<core::CodecOptions> c = wire::MergeCodec(base, received, "codec");
    EXPECT_TRUE(c.ok()) << c.status();
    return c.ok() ? *c : core::CodecOptions{};
  };
  const std::string want_base = core::CodecToJson(base).dump();

  // Nothing set: the model's defaults, and nothing on the wire.
  v1::CodecSettings unset;
  EXPECT_EQ(unset.ByteSizeLong(), 0u);
  EXPECT_EQ(core::CodecToJson(merged(unset)).dump(), want_base);

  // Zeros set explicitly: sent (two bytes each) and taken as 0.
  v1::CodecSettings zero;
  zero.set_rank(0);
  zero.set_window(0);
  zero.set_sink_tokens(0);
  zero.set_fp16_sinks(0);
  EXPECT_EQ(zero.ByteSizeLong(), 8u);
  core::CodecOptions c = merged(zero);
  EXPECT_EQ(c.rank, 0);
  EXPECT_EQ(c.window, 0);
  EXPECT_EQ(c.sink_tokens, 0);
  EXPECT_EQ(c.fp16_sinks, 0);
  EXPECT_EQ(c.key_bits, base.key_bits);  // the rest stays the model's
  EXPECT_TRUE(c.rotate_values);

  // The older form of a real 0, -1, as a client without presence writes it (field 3, varint
  // -1: ten bytes), still asks for 0.
  v1::CodecSettings legacy;
  legacy.set_rank(-1);
  EXPECT_EQ(legacy.SerializeAsString(),
            std::string("\x18\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01", 11));
  EXPECT_EQ(merged(legacy).rank, 0);
  EXPECT_EQ(merged(legacy).window, base.window);

  // A 0 of a field with no 0 setting, even set, is the model's default as it always was.
  v1::CodecSettings no_zero_setting;
  no_zero_setting.set_key_bits(0);
  no_zero_setting.set_key_group(0);
  no_zero_setting.set_side_bits(0);
  no_zero_setting.set_value_bits(0);
  no_zero_setting.set_value_group(0);
  no_zero_setting.set_value_policy(v1::CodecSettings::VALUE_POLICY_DEFAULT);
  no_zero_setting.set_value_budget(0);
  no_zero_setting.set_rotate_values(0);
  EXPECT_EQ(core::CodecToJson(merged(no_zero_setting)).dump(), want_base);

  // Answers keep the older request form (-1 for a real 0), which every server reads alike.
  absl::StatusOr<v1::CodecSettings> out = wire::CodecToWire(c);
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_TRUE(out->has_rank());
  EXPECT_EQ(out->rank(), -1);
  EXPECT_EQ(out->window(), -1);
}

// The same through the server: a sequence created with rank 0 set explicitly is encoded at
// rank 0 (KIVI-like), as one created with the older -1; one that leaves rank out gets the
// model's 4.
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
  } cases[] = {{"unset", std::nullopt, 4}, {"zero", 0, 0}, {"legacy", -1, 0}, {"two", 2, 2}};
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
}

TEST(CodecLeversServeTest, CodecSwitchesAreTriStateOnTheWire) {
  core::CodecOptions base;
  base.head_dim = 64;
  base.rotate_values = true;
  v1::CodecSettings s;
  s.set_rotate_keys(1);
  s.set_rotate_values(-1);
  absl::StatusOr<core::CodecOptions> c = wire::MergeCodec(base, s, "codec");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_TRUE(c->rotate_keys);
  EXPECT_FALSE(c->rotate_values);
  EXPECT_FALSE(c->metric_rounding);  // 0: the base's
  s.set_rotate_values(0);
  s.set_metric_rounding(1);
  c = wire::MergeCodec(base, s, "codec");
  ASSERT_TRUE(c.ok());
  EXPECT_TRUE(c->rotate_values);
  EXPECT_TRUE(c->metric_rounding);
  absl::StatusOr<v1::CodecSettings> out = wire::CodecToWire(*c);
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_EQ(out->rotate_keys(), 1);
  EXPECT_EQ(out->rotate_values(), 1);
  EXPECT_EQ(out->metric_rounding(), 1);
  c->rotate_keys = false;
  out = wire::CodecToWire(*c);
  EXPECT_EQ(out->rotate_keys(), -1);
  s.set_rotate_values(2);
  c = wire::MergeCodec(base, s, "appends[0].codec");
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(c.status().message()),
              HasSubstr("appends[0].codec.rotate_values = 2: must be 0 (the model's default), "
                        "1 (on) or -1 (off)"));
  s.set_rotate_values(1);
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
      a.mutable_codec()->set_rotate_values(1);
      a.mutable_codec()->set_metric_rounding(-1);
    }
    if (seq == "sparse") {
      a.mutable_codec()->set_rotate_keys(-1);
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
