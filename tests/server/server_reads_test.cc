// Service tests of the reads: Score, Readout, Attend and GetBlocks against the in-process codec.
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <tuple>

#include "gmock/gmock.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "kvq/core/codec.h"
#include "kvq/core/metrics.h"
#include "kvq/wire/tensor.h"
#include "tests/server/server_fixture.h"
#include "tests/server/test_util.h"

namespace kvq::testing {
namespace {

using ::testing::HasSubstr;

TEST(ServiceTest, PutThenScoreReadoutAttendMatchInProcessCodec) {
  TestServer ts;
  auto stub = ts.Stub();
  Fixture f;
  const Shape& s = f.shape;
  Register(*stub, MakeRegister(s, kBasisSeed));
  const int64_t T = 111;  // three full groups of 32 and a tail of 15 in fp16
  const int kv = s.kv_heads, d = s.head_dim, qh = s.q_heads;
  std::map<std::pair<std::string, int>, std::unique_ptr<core::LayerCache>> ref;
  std::vector<v1::PutBlocksRequest> msgs;
  uint32_t seed = 100;
  for (const std::string seq : {"a", "b"}) {
    for (int l = 0; l < s.layers; ++l) {
      auto k = RandomKV(kv, T, d, ++seed), v = RandomKV(kv, T, d, ++seed);
      v1::PutBlocksRequest m;
      *m.add_appends() = MakeAppend(seq, l, 0, k, v, kv, T, d, "tiny");
      msgs.push_back(m);
      auto c = f.Ref(l);
      RefAppend(*c, k, v, kv, T, d, 0);
      ref[{seq, l}] = std::move(c);
    }
  }
  auto R = [&](const std::string& seq, int l) { return ref.at({seq, l}).get(); };
  v1::PutBlocksResponse put;
  grpc::Status st = Put(*stub, msgs, &put);
  ASSERT_TRUE(st.ok()) << st.error_message();
  EXPECT_EQ(put.tokens_written(), 4 * T);
  EXPECT_EQ(put.messages(), 4);

  // Score: a batch of two items, one with 3 queries, one with a 2-D [q_heads, d] query.
  auto q1 = RandomQueries(qh, 3, d, 1), q2 = RandomQueries(qh, 1, d, 2);
  v1::ScoreRequest sreq;
  auto* i1 = sreq.add_items();
  i1->set_sequence_id("a");
  i1->set_layer(0);
  *i1->mutable_queries() = TensorF32(q1, {qh, 3, d});
  auto* i2 = sreq.add_items();
  i2->set_sequence_id("b");
  i2->set_layer(1);
  *i2->mutable_queries() = TensorF32(q2, {qh, d});
  auto* i3 = sreq.add_items();  // corrections only
  i3->set_sequence_id("a");
  i3->set_layer(1);
  i3->set_corrections_only(true);
  *i3->mutable_queries() = TensorF32(q1, {qh, 3, d});
  v1::ScoreResponse sresp;
  auto ctx = Ctx();
  ASSERT_TRUE(stub->Score(ctx.get(), sreq, &sresp).ok());
  ASSERT_EQ(sresp.results_size(), 3);
  std::vector<float> want(qh * 3 * T);
  ASSERT_TRUE(R("a", 0)->Score(q1.data(), qh, 3, want.data()).ok());
  EXPECT_EQ(sresp.results(0).status().code(), 0) << sresp.results(0).status().message();
  EXPECT_EQ(FloatsOf(sresp.results(0).logits()), want);
  EXPECT_EQ(sresp.results(0).tokens(), T);
  std::vector<float> want2(qh * T);
  ASSERT_TRUE(R("b", 1)->Score(q2.data(), qh, 1, want2.data()).ok());
  EXPECT_EQ(FloatsOf(sresp.results(1).logits()), want2);
  std::vector<float> want3(qh * 3 * T);
  ASSERT_TRUE(R("a", 1)->Score(q1.data(), qh, 3, want3.data(), 0.0f, true).ok());
  EXPECT_EQ(FloatsOf(sresp.results(2).logits()), want3);

  // Readout: with weights, and with logits softmaxed server-side.
  std::vector<float> p(want.size());
  for (int r = 0; r < qh * 3; ++r) core::Softmax(want.data() + r * T, T, p.data() + r * T);
  v1::ReadoutRequest rreq;
  auto* r1 = rreq.add_items();
  r1->set_sequence_id("a");
  r1->set_layer(0);
  *r1->mutable_weights() = TensorF32(p, {qh, 3, T});
  auto* r2 = rreq.add_items();
  r2->set_sequence_id("a");
  r2->set_layer(0);
  r2->set_weights_are_logits(true);
  *r2->mutable_weights() = TensorF32(want, {qh, 3, T});
  v1::ReadoutResponse rresp;
  auto ctx2 = Ctx();
  ASSERT_TRUE(stub->Readout(ctx2.get(), rreq, &rresp).ok());
  std::vector<float> out(qh * 3 * d);
  ASSERT_TRUE(R("a", 0)->Readout(p.data(), qh, 3, out.data()).ok());
  EXPECT_EQ(FloatsOf(rresp.results(0).outputs()), out);
  EXPECT_EQ(FloatsOf(rresp.results(1).outputs()), out);

  // Attend: causal offset, read-only, then observing (the default) on both sides.
  for (bool observe : {false, true}) {
    v1::AttendRequest areq;
    for (const std::string seq : {"a", "b"}) {
      auto* it = areq.add_items();
      it->set_sequence_id(seq);
      it->set_layer(1);
      it->set_causal_offset(50);
      if (!observe) it->set_observe(false);
      *it->mutable_queries() = TensorF32(q1, {qh, 3, d});
    }
    v1::AttendResponse aresp;
    auto ctx3 = Ctx();
    ASSERT_TRUE(stub->Attend(ctx3.get(), areq, &aresp).ok());
    for (int i = 0; i < 2; ++i) {
      core::AttendOptions ao;
      ao.causal_offset = 50;
      ao.observe = observe;
      std::vector<float> o(qh * 3 * d);
      ASSERT_TRUE(R(i == 0 ? "a" : "b", 1)->Attend(q1.data(), qh, 3, ao, o.data()).ok());
      EXPECT_EQ(aresp.results(i).status().code(), 0) << aresp.results(i).status().message();
      EXPECT_EQ(FloatsOf(aresp.results(i).outputs()), o) << "observe=" << observe;
    }
  }

  // GetBlocks: what attention sees, in chunks.
  std::vector<float> dk, dv;
  ASSERT_TRUE(R("b", 0)->Decode(&dk, &dv).ok());
  auto got = GetAll(*stub, "b", 0, kv, d, /*chunk=*/40);
  EXPECT_EQ(got[0], dk);
  EXPECT_EQ(got[1], dv);
  // q . k_seen equals the HeadQ score.
  auto sc = ScoreOne(*stub, "b", 0, q2, qh, 1, d);
  std::vector<float> logits = FloatsOf(sc.results(0).logits());
  const int g = qh / kv;
  double max_err = 0;
  for (int h = 0; h < qh; ++h) {
    for (int64_t t = 0; t < T; ++t) {
      double dot = 0;
      for (int c = 0; c < d; ++c) dot += double(q2[h * d + c]) * got[0][((h / g) * T + t) * d + c];
      max_err = std::max(max_err, std::abs(dot / std::sqrt(double(d)) - logits[h * T + t]));
    }
  }
  EXPECT_LT(max_err, 1e-3);
}

TEST(ServiceTest, ObservingAttendsOnOneSequenceKeepTheirOrder) {
  TestServer ts;
  auto stub = ts.Stub();
  Fixture f;
  f.codec.value_policy = core::ValuePolicy::kA2;  // observations steer the value bits
  f.codec.window = 32;
  const Shape& s = f.shape;
  Register(*stub, MakeRegister(s, kBasisSeed));
  const int kv = s.kv_heads, d = s.head_dim, qh = s.q_heads;
  const int64_t T = 40;
  auto k = RandomKV(kv, 3 * T, d, 1), v = RandomKV(kv, 3 * T, d, 2);
  v1::PutBlocksRequest m;
  *m.add_appends() = MakeAppend("s", 0, 0, Slice(k, kv, 3 * T, d, 0, T),
                                Slice(v, kv, 3 * T, d, 0, T), kv, T, d, "tiny");
  auto* codec = m.mutable_appends(0)->mutable_codec();
  codec->set_value_policy(v1::CodecSettings::VALUE_POLICY_A2);
  codec->set_window(32);
  v1::PutBlocksResponse r;
  ASSERT_TRUE(Put(*stub, {m}, &r).ok());
  auto ref = f.Ref(0);
  RefAppend(*ref, Slice(k, kv, 3 * T, d, 0, T), Slice(v, kv, 3 * T, d, 0, T), kv, T, d, 0);
  // Four observing attends on one sequence in one batch, then more tokens get encoded.
  v1::AttendRequest areq;
  std::vector<std::vector<float>> qs;
  for (int i = 0; i < 4; ++i) {
    qs.push_back(RandomQueries(qh, 1, d, 50 + i));
    auto* it = areq.add_items();
    it->set_sequence_id("s");
    *it->mutable_queries() = TensorF32(qs.back(), {qh, 1, d});
  }
  v1::AttendResponse aresp;
  auto ctx = Ctx();
  ASSERT_TRUE(stub->Attend(ctx.get(), areq, &aresp).ok());
  for (int i = 0; i < 4; ++i) {
    std::vector<float> o(qh * d);
    ASSERT_TRUE(ref->Attend(qs[i].data(), qh, 1, {}, o.data()).ok());
    EXPECT_EQ(FloatsOf(aresp.results(i).outputs()), o) << i;
  }
  *m.mutable_appends(0) = MakeAppend("s", 0, T, Slice(k, kv, 3 * T, d, T, 2 * T),
                                     Slice(v, kv, 3 * T, d, T, 2 * T), kv, 2 * T, d);
  ASSERT_TRUE(Put(*stub, {m}, &r).ok());
  RefAppend(*ref, Slice(k, kv, 3 * T, d, T, 2 * T), Slice(v, kv, 3 * T, d, T, 2 * T), kv, 2 * T, d,
            T);
  std::vector<float> dk, dv;
  ASSERT_TRUE(ref->Decode(&dk, &dv).ok());
  auto got = GetAll(*stub, "s", 0, kv, d);
  EXPECT_EQ(got[1], dv);
}

TEST(ServiceTest, ProbeWeightsReachTheValuePolicy) {
  TestServer ts;
  auto stub = ts.Stub();
  Fixture f(LegacyShape());
  f.codec.value_policy = core::ValuePolicy::kA2;
  const Shape& s = f.shape;
  Register(*stub, MakeRegister(s, kBasisSeed));
  const int kv = s.kv_heads, d = s.head_dim;
  const int64_t T = 64;
  auto k = RandomKV(kv, T, d, 1), v = RandomKV(kv, T, d, 2);
  std::vector<float> w(kv * T);
  for (size_t i = 0; i < w.size(); ++i) w[i] = (i % 7 == 0) ? 5.0f : 0.01f;
  v1::PutBlocksRequest m;
  *m.add_appends() = MakeAppend("p", 0, 0, k, v, kv, T, d, "tiny");
  m.mutable_appends(0)->mutable_codec()->set_value_policy(v1::CodecSettings::VALUE_POLICY_A2);
  *m.mutable_appends(0)->mutable_probe_weights() = TensorF32(w, {kv, T});
  v1::PutBlocksResponse r;
  grpc::Status st = Put(*stub, {m}, &r);
  ASSERT_TRUE(st.ok()) << st.error_message();
  auto ref = f.Ref(0);
  std::string kb = ToF16Bytes(k), vb = ToF16Bytes(v);
  ASSERT_TRUE(ref->Append(core::TensorView::Contiguous(kb.data(), core::DType::kF16, {kv, T, d}),
                          core::TensorView::Contiguous(vb.data(), core::DType::kF16, {kv, T, d}), 0,
                          w.data())
                  .ok());
  std::vector<float> dk, dv;
  ASSERT_TRUE(ref->Decode(&dk, &dv).ok());
  EXPECT_EQ(GetAll(*stub, "p", 0, kv, d)[1], dv);
  // Without the weights the values decode differently: the weights were used.
  auto plain = f.Ref(0);
  ASSERT_TRUE(plain
                  ->Append(core::TensorView::Contiguous(kb.data(), core::DType::kF16, {kv, T, d}),
                           core::TensorView::Contiguous(vb.data(), core::DType::kF16, {kv, T, d}),
                           0)
                  .ok());
  std::vector<float> pk, pv;
  ASSERT_TRUE(plain->Decode(&pk, &pv).ok());
  EXPECT_NE(pv, dv);
  // A wrong probe shape is named.
  m.mutable_appends(0)->set_sequence_id("p2");
  *m.mutable_appends(0)->mutable_probe_weights() = TensorF32(w, {kv * T, 1});
  st = Put(*stub, {m}, &r);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(st.error_message(),
              HasSubstr("appends[0].probe_weights.shape must be [kv_heads, n]"));
}

// An all-layer GetBlocks reads every layer as it was when the call started: an append that
// lands while layer 0 is still streaming (the client holds the stream after one message;
// layer 0 is far beyond the transport's window, so the server is still in it) is not seen
// in layer 1, and every message names the same length.
TEST(ServiceTest, GetBlocksOfAllLayersIsOneSnapshotDespiteConcurrentAppends) {
  TestServer ts;
  auto stub = ts.Stub();
  Shape s;
  Register(*stub, MakeRegister(s, kBasisSeed));
  const int kv = s.kv_heads, d = s.head_dim;
  const int64_t T = 16384;  // 8 MiB of fp32 keys per layer
  v1::PutBlocksRequest m;
  for (int l = 0; l < s.layers; ++l)
    *m.add_appends() = MakeAppend("x", l, 0, RandomKV(kv, T, d, 80 + l), RandomKV(kv, T, d, 90 + l),
                                  kv, T, d, "tiny");
  v1::PutBlocksResponse pr;
  ASSERT_TRUE(Put(*stub, {m}, &pr).ok());
  v1::GetBlocksRequest req;
  req.set_sequence_id("x");
  req.set_max_tokens_per_message(256);
  auto ctx = Ctx();
  auto r = stub->GetBlocks(ctx.get(), req);
  v1::GetBlocksResponse one;
  ASSERT_TRUE(r->Read(&one));
  EXPECT_EQ(one.layer(), 0);
  // 256 more tokens on every layer while the read is under way.
  v1::PutBlocksRequest more;
  for (int l = 0; l < s.layers; ++l)
    *more.add_appends() =
        MakeAppend("x", l, T, RandomKV(kv, 256, d, 7), RandomKV(kv, 256, d, 8), kv, 256, d, "tiny");
  ASSERT_TRUE(Put(*stub, {more}, &pr).ok());
  std::vector<int64_t> seen(s.layers, 0);
  seen[0] = one.keys().shape(1);
  EXPECT_EQ(one.layer_tokens(), T);
  while (r->Read(&one)) {
    EXPECT_EQ(one.layer_tokens(), T) << "layer " << one.layer();
    seen[one.layer()] += one.keys().shape(1);
  }
  ASSERT_TRUE(r->Finish().ok());
  for (int l = 0; l < s.layers; ++l) EXPECT_EQ(seen[l], T) << "layer " << l;
  // A new call sees the appended tokens.
  EXPECT_EQ(GetAll(*stub, "x", 1, kv, d)[0].size(), static_cast<size_t>(kv) * (T + 256) * d);
}

// Registers model "tiny" of shape s and stores layer 0 of sequence "long", T random tokens.
void RegisterAndPutLong(v1::Kvq::Stub& stub, const Shape& s, int64_t T) {
  Register(stub, MakeRegister(s, kBasisSeed));
  const int kv = s.kv_heads, d = s.head_dim;
  v1::PutBlocksRequest m;
  *m.add_appends() =
      MakeAppend("long", 0, 0, RandomKV(kv, T, d, 5), RandomKV(kv, T, d, 6), kv, T, d, "tiny");
  v1::PutBlocksResponse pr;
  ASSERT_TRUE(Put(stub, {m}, &pr).ok());
}

// A layer longer than GetBlocks' decode window (1024 tokens) is decoded a window at a time, so
// that a stream holds a bounded copy however slowly it is read: small messages over several
// windows concatenate to exactly what one message of the whole layer carries, from any start.
TEST(ServiceTest, GetBlocksOfALongLayerStitchesItsDecodeWindows) {
  TestServer ts;
  auto stub = ts.Stub();
  const Shape s = LegacyShape();
  const int kv = s.kv_heads, d = s.head_dim;
  const int64_t T = 2600;
  RegisterAndPutLong(*stub, s, T);
  auto read = [&](int64_t from, int chunk) {
    v1::GetBlocksRequest req;
    req.set_sequence_id("long");
    req.add_layers(0);
    req.set_from_token(from);
    req.set_max_tokens_per_message(chunk);
    auto ctx = Ctx();
    auto r = stub->GetBlocks(ctx.get(), req);
    std::vector<std::vector<float>> k(kv), v(kv);
    v1::GetBlocksResponse one;
    int64_t next = from, messages = 0;
    while (r->Read(&one)) {
      EXPECT_EQ(one.start(), next);
      EXPECT_EQ(one.layer_tokens(), T);
      const int64_t n = one.keys().shape(1);
      const auto kf = FloatsOf(one.keys()), vf = FloatsOf(one.values());
      for (int h = 0; h < kv; ++h) {
        k[h].insert(k[h].end(), kf.begin() + h * n * d, kf.begin() + (h + 1) * n * d);
        v[h].insert(v[h].end(), vf.begin() + h * n * d, vf.begin() + (h + 1) * n * d);
      }
      next += n;
      ++messages;
    }
    EXPECT_TRUE(r->Finish().ok());
    EXPECT_EQ(next, T);
    return std::make_tuple(k, v, messages);
  };
  const auto [k_whole, v_whole, one_message] = read(0, 4096);
  EXPECT_EQ(one_message, 1);
  const auto [k_small, v_small, many] = read(0, 300);
  EXPECT_EQ(many, 9);  // 2600 = 8 x 300 + 200, over three windows of three messages
  EXPECT_EQ(k_small, k_whole);
  EXPECT_EQ(v_small, v_whole);
  const auto [k_tail, v_tail, tail_messages] = read(1000, 500);  // starts inside a window
  EXPECT_EQ(tail_messages, 4);
  for (int h = 0; h < kv; ++h) {
    EXPECT_EQ(k_tail[h], std::vector<float>(k_whole[h].begin() + 1000 * d, k_whole[h].end()));
    EXPECT_EQ(v_tail[h], std::vector<float>(v_whole[h].begin() + 1000 * d, v_whole[h].end()));
  }
}

// GetBlocks decodes straight into the requested dtype (Store::DecodeAs): in f32 (also when
// unspecified), f16 and bf16, over several decode windows and from a start inside one, every
// message's bytes are the store's fp32 decode of its range rounded to nearest even.
TEST(ServiceTest, GetBlocksInEachDtypeIsTheFloatDecodeRounded) {
  TestServer ts;
  auto stub = ts.Stub();
  const Shape s;
  const int64_t T = 2600;
  RegisterAndPutLong(*stub, s, T);
  for (const v1::DType dtype :
       {v1::DTYPE_UNSPECIFIED, v1::DTYPE_F32, v1::DTYPE_F16, v1::DTYPE_BF16}) {
    const v1::DType want_dtype = dtype == v1::DTYPE_UNSPECIFIED ? v1::DTYPE_F32 : dtype;
    const core::DType dt = *wire::FromProto(want_dtype, "");
    for (const int64_t from : {int64_t{0}, int64_t{1000}}) {
      SCOPED_TRACE(::testing::Message() << "dtype " << dtype << " from " << from);
      v1::GetBlocksRequest req;
      req.set_sequence_id("long");
      req.add_layers(0);
      req.set_from_token(from);
      req.set_dtype(dtype);
      req.set_max_tokens_per_message(700);  // messages across the 1024-token decode windows
      auto ctx = Ctx();
      auto r = stub->GetBlocks(ctx.get(), req);
      v1::GetBlocksResponse one;
      int64_t next = from;
      while (r->Read(&one)) {
        ASSERT_EQ(one.start(), next);
        const int64_t n = one.keys().shape(1);
        std::vector<float> k, v;
        ASSERT_TRUE(
            ts.server().store().Decode({"default", "long", 0, 0}, {next, next + n}, &k, &v).ok());
        for (const auto& [t, want] : {std::pair{&one.keys(), &k}, {&one.values(), &v}}) {
          EXPECT_EQ(t->dtype(), want_dtype);
          std::string bytes(want->size() * core::DTypeSize(dt), '\0');
          core::FromFloat(dt, want->data(), bytes.data(), want->size());
          EXPECT_TRUE(t->data() == bytes);
        }
        next += n;
      }
      EXPECT_TRUE(r->Finish().ok());
      EXPECT_EQ(next, T);
    }
  }
}

// GetBlocks of a token range: the chunks concatenate to the same slice of the whole layer;
// a range past the end gives one empty message (the layer's length); a corrupted block fails
// the ranges that read it, not the others.
TEST(ServiceTest, GetBlocksRangeIsTheSliceAndReadsOnlyItsBlocks) {
  TestServer ts;
  auto stub = ts.Stub();
  Fixture f(LegacyShape());
  const Shape& s = f.shape;
  Register(*stub, MakeRegister(s, kBasisSeed));
  const int kv = s.kv_heads, d = s.head_dim;
  const int64_t T = 100;
  v1::PutBlocksRequest m;
  for (int l = 0; l < s.layers; ++l) {
    *m.add_appends() = MakeAppend("x", l, 0, RandomKV(kv, T, d, 60 + l), RandomKV(kv, T, d, 70 + l),
                                  kv, T, d, "tiny");
  }
  v1::PutBlocksResponse pr;
  ASSERT_TRUE(Put(*stub, {m}, &pr).ok());
  auto range = [&](int layer, int64_t from, int64_t to, int chunk, grpc::Status* st) {
    v1::GetBlocksRequest req;
    req.set_sequence_id("x");
    req.add_layers(layer);
    req.set_from_token(from);
    req.set_to_token(to);
    req.set_max_tokens_per_message(chunk);
    auto ctx = Ctx();
    auto r = stub->GetBlocks(ctx.get(), req);
    std::vector<v1::GetBlocksResponse> msgs;
    v1::GetBlocksResponse one;
    while (r->Read(&one)) msgs.push_back(one);
    *st = r->Finish();
    return msgs;
  };
  const auto whole = GetAll(*stub, "x", 1, kv, d);
  grpc::Status st;
  const auto part = range(1, 40, 90, 16, &st);
  ASSERT_TRUE(st.ok()) << st.error_message();
  ASSERT_EQ(part.size(), 4u);  // 16 + 16 + 16 + 2
  int64_t next = 40;
  std::vector<std::vector<float>> k(kv);
  for (const auto& msg : part) {
    EXPECT_EQ(msg.start(), next);
    EXPECT_EQ(msg.layer_tokens(), T);
    const int64_t n = msg.keys().shape(1);
    const auto kf = FloatsOf(msg.keys());
    for (int h = 0; h < kv; ++h)
      k[h].insert(k[h].end(), kf.begin() + h * n * d, kf.begin() + (h + 1) * n * d);
    next += n;
  }
  EXPECT_EQ(next, 90);
  for (int h = 0; h < kv; ++h) {
    const std::vector<float> want(whole[0].begin() + (h * T + 40) * d,
                                  whole[0].begin() + (h * T + 90) * d);
    EXPECT_EQ(k[h], want) << "head " << h;
  }
  // Past the end: one empty message saying how long the layer is.
  const auto beyond = range(0, 120, 0, 0, &st);
  ASSERT_TRUE(st.ok());
  ASSERT_EQ(beyond.size(), 1u);
  EXPECT_EQ(beyond[0].keys().shape(1), 0);
  EXPECT_EQ(beyond[0].start(), T);
  EXPECT_EQ(beyond[0].layer_tokens(), T);
  range(0, 50, 10, 0, &st);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(st.error_message(), HasSubstr("from_token 50 and to_token 10"));
  // Corrupt layer 0, head 0, block 0 (tokens 0..31).
  core::LayerCache* c = ts.server().store().LayerForTest("default", "x", 0);
  ASSERT_NE(c, nullptr);
  c->key_blocks(0)[30] ^= 0x04;
  range(0, 0, 0, 0, &st);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::DATA_LOSS);
  range(0, 10, 20, 0, &st);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::DATA_LOSS);
  const auto tail = range(0, 64, 0, 0, &st);
  EXPECT_TRUE(st.ok()) << st.error_message();
  ASSERT_EQ(tail.size(), 1u);
  EXPECT_EQ(tail[0].keys().shape(1), T - 64);
}

// A decoding frontend's step in one round trip: Attend items carrying their layer's new token
// give exactly what a PutBlocks of the token followed by an Attend gives (observing attends,
// so the A^2 statistics follow the same path too), with the A^2 value policy on; a failed
// append fails only its item, names the field, and attends nothing.
TEST(ServiceTest, AttendCarryingItsAppendEqualsPutThenAttend) {
  TestServer ts;
  auto stub = ts.Stub();
  Fixture f;
  const Shape& s = f.shape;
  Register(*stub, MakeRegister(s, kBasisSeed));
  const int kv = s.kv_heads, d = s.head_dim, qh = s.q_heads;
  const int64_t T = 70;
  const LayerRows rows = RandomLayers(s, T, 30, 40);
  const auto &K = rows.k, &V = rows.v;
  auto step_append = [&](const std::string& seq, int l, int64_t t) {
    v1::Append a = MakeAppend(seq, l, t, Slice(K[l], kv, T, d, t, 1), Slice(V[l], kv, T, d, t, 1),
                              kv, 1, d, t == 0 ? "tiny" : "");
    if (t == 0) a.mutable_codec()->set_value_policy(v1::CodecSettings::VALUE_POLICY_A2);
    return a;
  };
  for (int64_t t = 0; t < T; ++t) {
    auto q = RandomQueries(qh, 1, d, 100 + t);
    // Two round trips per step: PutBlocks (every layer), then Attend (every layer).
    v1::PutBlocksRequest m;
    for (int l = 0; l < s.layers; ++l) *m.add_appends() = step_append("two", l, t);
    v1::PutBlocksResponse pr;
    ASSERT_TRUE(Put(*stub, {m}, &pr).ok());
    v1::AttendRequest a2, a1;
    for (int l = 0; l < s.layers; ++l) {
      for (auto* req : {&a2, &a1}) {
        auto* it = req->add_items();
        it->set_sequence_id(req == &a2 ? "two" : "one");
        it->set_layer(l);
        *it->mutable_queries() = TensorF32(q, {qh, 1, d});
        if (req == &a1) *it->mutable_append() = step_append("one", l, t);
      }
    }
    v1::AttendResponse r2, r1;
    auto c2 = Ctx(), c1 = Ctx();
    ASSERT_TRUE(stub->Attend(c2.get(), a2, &r2).ok());
    ASSERT_TRUE(stub->Attend(c1.get(), a1, &r1).ok());
    for (int l = 0; l < s.layers; ++l) {
      ASSERT_EQ(r1.results(l).status().code(), 0) << r1.results(l).status().message();
      EXPECT_EQ(r1.results(l).tokens(), t + 1);
      ASSERT_EQ(FloatsOf(r1.results(l).outputs()), FloatsOf(r2.results(l).outputs()))
          << "step " << t << " layer " << l;
    }
  }
  for (int l = 0; l < s.layers; ++l) {
    EXPECT_EQ(GetAll(*stub, "one", l, kv, d), GetAll(*stub, "two", l, kv, d));
  }
  // Failures: another sequence named in the append; a conflicting re-send; a gap. Each fails
  // its own item only; the good item in the same call is served.
  v1::AttendRequest bad;
  auto q = RandomQueries(qh, 1, d, 7);
  auto add = [&](v1::Append ap) {
    auto* it = bad.add_items();
    it->set_sequence_id("one");
    it->set_layer(0);
    *it->mutable_queries() = TensorF32(q, {qh, 1, d});
    *it->mutable_append() = std::move(ap);
  };
  add(step_append("two", 0, T - 1));
  v1::Append conflict = step_append("one", 0, T - 1);
  conflict.mutable_keys()->mutable_data()->at(3) ^= 0x11;
  add(conflict);
  v1::Append gap = step_append("one", 0, T - 1);  // token T-1's bytes, placed past the end
  gap.set_start(T + 5);
  add(gap);
  auto* good = bad.add_items();
  good->set_sequence_id("one");
  good->set_layer(1);
  good->set_observe(false);
  *good->mutable_queries() = TensorF32(q, {qh, 1, d});
  v1::AttendResponse br;
  auto bc = Ctx();
  ASSERT_TRUE(stub->Attend(bc.get(), bad, &br).ok());
  EXPECT_EQ(br.results(0).status().code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(br.results(0).status().message(), HasSubstr("items[0].append names sequence 'two'"));
  EXPECT_EQ(br.results(1).status().code(), grpc::StatusCode::ALREADY_EXISTS);
  EXPECT_THAT(br.results(1).status().message(), HasSubstr("items[1].append: token 69"));
  EXPECT_EQ(br.results(2).status().code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(br.results(2).status().message(), HasSubstr("items[2].append.start 75"));
  EXPECT_FALSE(br.results(2).has_outputs());
  EXPECT_EQ(br.results(3).status().code(), 0);
  EXPECT_EQ(br.results(3).tokens(), T);
}

// Score items carry their append too (keys-only frontends): the same logits as PutBlocks then
// Score, and two items of one sequence in one call apply in order.
TEST(ServiceTest, ScoreCarryingItsAppendEqualsPutThenScore) {
  TestServer ts;
  auto stub = ts.Stub();
  Fixture f;
  const Shape& s = f.shape;
  Register(*stub, MakeRegister(s, kBasisSeed));
  const int kv = s.kv_heads, d = s.head_dim, qh = s.q_heads;
  const int64_t T = 40;
  auto K = RandomKV(kv, T, d, 90), V = RandomKV(kv, T, d, 91);
  auto one = [&](const std::string& seq, int64_t t) {
    return MakeAppend(seq, 0, t, Slice(K, kv, T, d, t, 1), Slice(V, kv, T, d, t, 1), kv, 1, d,
                      t == 0 ? "tiny" : "");
  };
  for (int64_t t = 0; t < T; t += 2) {
    auto q = RandomQueries(qh, 1, d, 200 + t);
    v1::PutBlocksRequest m;
    *m.add_appends() = one("put", t);
    *m.add_appends() = one("put", t + 1);
    v1::PutBlocksResponse pr;
    ASSERT_TRUE(Put(*stub, {m}, &pr).ok());
    v1::ScoreRequest both;  // two items of "inline": token t, then token t + 1, then score
    for (int64_t u : {t, t + 1}) {
      auto* it = both.add_items();
      it->set_sequence_id("inline");
      *it->mutable_queries() = TensorF32(q, {qh, 1, d});
      *it->mutable_append() = one("inline", u);
    }
    auto* ref = both.add_items();
    ref->set_sequence_id("put");
    *ref->mutable_queries() = TensorF32(q, {qh, 1, d});
    v1::ScoreResponse r;
    auto ctx = Ctx();
    ASSERT_TRUE(stub->Score(ctx.get(), both, &r).ok());
    ASSERT_EQ(r.results(1).status().code(), 0) << r.results(1).status().message();
    EXPECT_EQ(r.results(0).tokens(), t + 1);
    EXPECT_EQ(r.results(1).tokens(), t + 2);
    EXPECT_EQ(FloatsOf(r.results(1).logits()), FloatsOf(r.results(2).logits())) << "step " << t;
  }
}

// A long layer's Attend splits across idle workers (ServerOptions::split_attend_min_tokens):
// the answer equals the store's own unsplit Attend within the split tolerance (2e-6 * max|v|,
// core/cache.h AttendOptions::parts) and kvq_attend_split_total counts it. A layer below the
// threshold, or the threshold 0 (off), runs the unsplit order (bit-identical) and counts
// nothing. Four workers: the Attend's own is busy, at most the previous calls' are still
// returning, so at least one is idle whenever the Attend starts.
TEST(ServiceTest, LongAttendSplitsAcrossIdleWorkersWithinTolerance) {
  const int64_t kThreshold = 2048, kLong = kThreshold + 45, kShort = kThreshold - 1;
  for (const int64_t min_tokens : {kThreshold, int64_t{0}}) {
    SCOPED_TRACE(::testing::Message() << "split_attend_min_tokens " << min_tokens);
    server::ServerOptions o = WithLocalMetrics();
    o.workers = 4;
    o.split_attend_min_tokens = min_tokens;
    TestServer ts(o);
    auto stub = ts.Stub();
    const Shape s;
    const int kv = s.kv_heads, qh = s.q_heads, d = s.head_dim;
    Register(*stub, MakeRegister(s, kBasisSeed));
    const std::vector<float> q = RandomQueries(qh, 1, d, 9);
    for (const auto& [seq, T] :
         {std::pair<std::string, int64_t>{"long", kLong}, {"short", kShort}}) {
      SCOPED_TRACE(seq);
      auto k = RandomKV(kv, T, d, 1), v = RandomKV(kv, T, d, 2);
      v1::PutBlocksRequest m;
      *m.add_appends() = MakeAppend(seq, 0, 0, k, v, kv, T, d, "tiny");
      v1::PutBlocksResponse pr;
      ASSERT_TRUE(Put(*stub, {m}, &pr).ok());
      v1::AttendRequest areq;
      auto* it = areq.add_items();
      it->set_sequence_id(seq);
      it->set_observe(false);
      *it->mutable_queries() = TensorF32(q, {qh, 1, d});
      v1::AttendResponse aresp;
      auto ctx = Ctx();
      ASSERT_TRUE(stub->Attend(ctx.get(), areq, &aresp).ok());
      ASSERT_EQ(aresp.results(0).status().code(), 0) << aresp.results(0).status().message();
      const std::vector<float> got = FloatsOf(aresp.results(0).outputs());
      core::AttendOptions unsplit;
      unsplit.observe = false;
      std::vector<float> want, dk, dv;
      const absl::StatusOr<int64_t> tokens =
          ts.server().store().Attend({"default", seq, 0, 0}, {q.data(), qh, 1, d}, unsplit, &want);
      ASSERT_TRUE(tokens.ok());
      ASSERT_EQ(*tokens, T);
      ASSERT_TRUE(ts.server().store().Decode({"default", seq, 0, 0}, {}, &dk, &dv).ok());
      float vmax = 0.0f;
      for (float x : dv) vmax = std::max(vmax, std::fabs(x));
      ASSERT_EQ(got.size(), want.size());
      const bool split = min_tokens > 0 && T >= min_tokens;
      if (split) {
        for (size_t i = 0; i < got.size(); ++i) EXPECT_NEAR(got[i], want[i], 2e-6f * vmax) << i;
      } else {
        EXPECT_EQ(got, want);
      }
    }
    const std::string text = HttpGet(ts.server().metrics_port(), "/metrics");
    EXPECT_EQ(MetricValue(text, "kvq_attend_split_total"), min_tokens > 0 ? 1 : 0);
  }
}

// A golden block: bytes committed to the repository must keep decoding to the committed
// values. KVQ_REGENERATE_GOLDEN=1 rewrites them (only on a deliberate format change): today's
// default k3g128r4s4 (128 tokens, format version 2). The older k2g32r4s8 pair is of format
// version 1, which this build no longer reads: it stays committed, byte for byte, to prove
// such blocks are refused as DATA_LOSS rather than misread (do not regenerate it).
void CheckGoldenBlocks(const core::CodecOptions& o, const std::string& key_name,
                       const std::string& value_name) {
  const std::string dir = KVQ_GOLDEN_DIR;
  const int T = o.key_group, d = o.head_dim;
  Shape s;
  s.layers = 1;
  s.kv_heads = 1;
  s.q_heads = 1;
  core::ModelBasis b = MakeBasis(s, 5);
  std::vector<float> u = LayerBasis(b, 0, 4);
  auto read = [](const std::string& p) {
    std::ifstream f(p, std::ios::binary);
    return std::vector<uint8_t>(std::istreambuf_iterator<char>(f), {});
  };
  auto write = [](const std::string& p, const void* data, size_t n) {
    std::ofstream(p, std::ios::binary).write(static_cast<const char*>(data), n);
  };
  const std::string key = dir + "/" + key_name, value = dir + "/" + value_name;
  if (std::getenv("KVQ_REGENERATE_GOLDEN")) {
    std::filesystem::create_directories(dir);
    auto k = RandomKV(1, T, d, 42), v = RandomKV(1, T, d, 43);
    std::vector<uint8_t> kb, vb;
    ASSERT_TRUE(core::EncodeKeyBlock(o, k.data(), d, u.data(), &kb).ok());
    ASSERT_TRUE(core::EncodeValueBlock(o, v.data(), d, nullptr, &vb).ok());
    write(key + ".block", kb.data(), kb.size());
    write(value + ".block", vb.data(), vb.size());
    write(dir + "/basis_d64r4.f32", u.data(), u.size() * 4);
    auto kview = core::ParseKeyBlock(kb, o, true);
    auto vview = core::ParseValueBlock(vb, o, true);
    std::vector<float> kd(T * d), vd(T * d);
    core::DecodeKeyBlock(*kview, u.data(), kd.data());
    core::DecodeValueBlock(*vview, vd.data());
    write(key + ".decoded.f32", kd.data(), kd.size() * 4);
    write(value + ".decoded.f32", vd.data(), vd.size() * 4);
  }
  const auto kb = read(key + ".block");
  const auto vb = read(value + ".block");
  const auto ub = read(dir + "/basis_d64r4.f32");
  const auto kd = read(key + ".decoded.f32");
  const auto vd = read(value + ".decoded.f32");
  ASSERT_FALSE(kb.empty());
  ASSERT_EQ(ub.size(), 64 * 4 * 4u);
  ASSERT_EQ(kd.size(), static_cast<size_t>(T) * d * 4);
  ASSERT_EQ(vd.size(), static_cast<size_t>(T) * d * 4);
  EXPECT_EQ(kb.size(), core::KeyBlockBytes(o));
  EXPECT_EQ(vb.size(), core::ValueBlockBytes(o));
  auto kview = core::ParseKeyBlock(kb, o, true);
  ASSERT_TRUE(kview.ok()) << kview.status();
  auto vview = core::ParseValueBlock(vb, o, true);
  ASSERT_TRUE(vview.ok()) << vview.status();
  std::vector<float> k(T * d), v(T * d);
  core::DecodeKeyBlock(*kview, reinterpret_cast<const float*>(ub.data()), k.data());
  core::DecodeValueBlock(*vview, v.data());
  EXPECT_EQ(0, std::memcmp(k.data(), kd.data(), kd.size()));
  EXPECT_EQ(0, std::memcmp(v.data(), vd.data(), vd.size()));
  // A flipped payload bit is DATA_LOSS, never data.
  auto bad = kb;
  bad[40] ^= 1;
  EXPECT_EQ(core::ParseKeyBlock(bad, o, true).status().code(), absl::StatusCode::kDataLoss);
}

// The legacy default and the server's default codec (3-bit keys in 128-token groups, 4-bit
// side code).
TEST(GoldenBlockTest, CommittedBlocksDecodeToCommittedValues) {
  core::BasisManifest m;
  m.head_dim = 64;
  m.rank = 4;
  const core::CodecOptions legacy = K2G32Codec(m, true);
  const core::CodecOptions now = core::Registry::DefaultCodec(m, true);
  ASSERT_EQ(legacy.ToString(), "k2g32 r4s8 v2g32 R0");
  ASSERT_EQ(now.ToString(), "k3g128 r4s4 v2g32 R0");
  CheckGoldenBlocks(now, "key_k3g128r4s4_d64", "value_v2g32_t128_d64");
  const std::string dir = KVQ_GOLDEN_DIR;
  for (const char* name : {"key_k2g32r4s8_d64", "value_v2g32_d64"}) {
    SCOPED_TRACE(name);
    std::ifstream f(dir + "/" + name + ".block", std::ios::binary);
    const std::vector<uint8_t> block(std::istreambuf_iterator<char>(f), {});
    ASSERT_GT(block.size(), 16u);
    ASSERT_EQ(block[2], 1);  // format version 1
    const absl::Status st = name[0] == 'k' ? core::ParseKeyBlock(block, legacy, true).status()
                                           : core::ParseValueBlock(block, legacy, true).status();
    EXPECT_EQ(st.code(), absl::StatusCode::kDataLoss);
    EXPECT_THAT(std::string(st.message()), HasSubstr("block version 1 unsupported"));
    EXPECT_EQ(core::VerifyBlock(block).code(), absl::StatusCode::kDataLoss);
  }
}

}  // namespace
}  // namespace kvq::testing
