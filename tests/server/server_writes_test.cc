// Service tests of the writes: PutBlocks streams, re-sends, atomic messages, basis versions.
#include <filesystem>
#include <thread>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "kvq/core/codec.h"
#include "tests/server/server_fixture.h"
#include "tests/server/test_util.h"

namespace kvq::testing {
namespace {

using ::testing::HasSubstr;

TEST(ServiceTest, OneTokenAppendsEqualOneBigAppend) {
  TestServer ts;
  auto stub = ts.Stub();
  Fixture f;
  const Shape& s = f.shape;
  Register(*stub, MakeRegister(s, kBasisSeed));
  const int kv = s.kv_heads, d = s.head_dim, qh = s.q_heads;
  const int64_t T = 77;
  const LayerRows rows = RandomLayers(s, T, 10, 20);
  const auto &K = rows.k, &V = rows.v;
  std::vector<v1::PutBlocksRequest> big(1), steps;
  for (int l = 0; l < s.layers; ++l) {
    *big[0].add_appends() = MakeAppend("big", l, 0, K[l], V[l], kv, T, d, "tiny");
  }
  for (int64_t t = 0; t < T; ++t) {
    v1::PutBlocksRequest m;  // one decode step: every layer, one token
    for (int l = 0; l < s.layers; ++l) {
      *m.add_appends() = MakeAppend("step", l, t, Slice(K[l], kv, T, d, t, 1),
                                    Slice(V[l], kv, T, d, t, 1), kv, 1, d, t == 0 ? "tiny" : "");
    }
    steps.push_back(m);
  }
  v1::PutBlocksResponse r1, r2;
  ASSERT_TRUE(Put(*stub, big, &r1).ok());
  grpc::Status st = Put(*stub, steps, &r2);
  ASSERT_TRUE(st.ok()) << st.error_message();
  EXPECT_EQ(r2.messages(), T);
  ASSERT_EQ(r2.lengths_size(), s.layers);
  EXPECT_EQ(r2.lengths(0).tokens(), T);

  auto q = RandomQueries(qh, 2, d, 5);
  for (int l = 0; l < s.layers; ++l) {
    auto a = ScoreOne(*stub, "big", l, q, qh, 2, d), b = ScoreOne(*stub, "step", l, q, qh, 2, d);
    ASSERT_EQ(a.results(0).status().code(), 0);
    EXPECT_EQ(FloatsOf(a.results(0).logits()), FloatsOf(b.results(0).logits())) << "layer " << l;
    EXPECT_EQ(GetAll(*stub, "big", l, kv, d), GetAll(*stub, "step", l, kv, d));
    v1::AttendRequest areq;
    for (const std::string seq : {"big", "step"}) {
      auto* it = areq.add_items();
      it->set_sequence_id(seq);
      it->set_layer(l);
      it->set_observe(false);
      *it->mutable_queries() = TensorF32(q, {qh, 2, d});
    }
    v1::AttendResponse aresp;
    auto ctx = Ctx();
    ASSERT_TRUE(stub->Attend(ctx.get(), areq, &aresp).ok());
    EXPECT_EQ(FloatsOf(aresp.results(0).outputs()), FloatsOf(aresp.results(1).outputs()));
  }
}

TEST(ServiceTest, IdempotentResendsConflictsAndGaps) {
  TestServer ts;
  auto stub = ts.Stub();
  Shape s;
  Register(*stub, MakeRegister(s, kBasisSeed));
  const int kv = s.kv_heads, d = s.head_dim, qh = s.q_heads;
  const int64_t T = 96;
  auto k = RandomKV(kv, T, d, 1), v = RandomKV(kv, T, d, 2);
  auto put = [&](int64_t from, int64_t n, const std::vector<float>& kk, v1::PutBlocksResponse* r) {
    v1::PutBlocksRequest m;
    *m.add_appends() = MakeAppend("s", 0, from, Slice(kk, kv, T, d, from, n),
                                  Slice(v, kv, T, d, from, n), kv, n, d, "tiny");
    return Put(*stub, {m}, r);
  };
  v1::PutBlocksResponse r;
  ASSERT_TRUE(put(0, 64, k, &r).ok());
  EXPECT_EQ(r.tokens_written(), 64);
  auto q = RandomQueries(qh, 1, d, 3);
  auto before = FloatsOf(ScoreOne(*stub, "s", 0, q, qh, 1, d).results(0).logits());

  ASSERT_TRUE(put(0, 64, k, &r).ok());  // identical re-send
  EXPECT_EQ(r.tokens_written(), 0);
  EXPECT_EQ(r.tokens_duplicate(), 64);
  EXPECT_EQ(FloatsOf(ScoreOne(*stub, "s", 0, q, qh, 1, d).results(0).logits()), before);

  auto k2 = k;
  k2[(0 * T + 20) * d + 5] += 1.0f;  // token 20 differs
  grpc::Status st = put(10, 20, k2, &r);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::ALREADY_EXISTS);
  EXPECT_THAT(st.error_message(), HasSubstr("token 20"));
  EXPECT_EQ(FloatsOf(ScoreOne(*stub, "s", 0, q, qh, 1, d).results(0).logits()), before);

  st = put(80, 10, k, &r);  // gap: layer holds 64
  EXPECT_EQ(st.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(st.error_message(), HasSubstr("appends[0].start 80 must be in 0..64"));

  ASSERT_TRUE(put(32, 64, k, &r).ok());  // straddles the end: 32 duplicates, 32 new
  EXPECT_EQ(r.tokens_duplicate(), 32);
  EXPECT_EQ(r.tokens_written(), 32);
  ASSERT_EQ(r.lengths_size(), 1);
  EXPECT_EQ(r.lengths(0).tokens(), 96);
}

TEST(ServiceTest, FailedMessageIsAtomicAndEarlierMessagesStay) {
  TestServer ts;
  auto stub = ts.Stub();
  Shape s;
  Register(*stub, MakeRegister(s, kBasisSeed));
  const int kv = s.kv_heads, d = s.head_dim;
  const int64_t T = 64;
  auto k = RandomKV(kv, T, d, 1), v = RandomKV(kv, T, d, 2);
  std::vector<v1::PutBlocksRequest> msgs(4);
  for (int i = 0; i < 4; ++i) {
    *msgs[i].add_appends() = MakeAppend("s", 0, 16 * i, Slice(k, kv, T, d, 16 * i, 16),
                                        Slice(v, kv, T, d, 16 * i, 16), kv, 16, d, "tiny");
  }
  // Message 2 also appends to layer 1, then carries a broken append: nothing of it applies.
  *msgs[2].add_appends() =
      MakeAppend("s", 1, 0, Slice(k, kv, T, d, 0, 16), Slice(v, kv, T, d, 0, 16), kv, 16, d);
  v1::Append bad =
      MakeAppend("s", 1, 16, Slice(k, kv, T, d, 0, 16), Slice(v, kv, T, d, 0, 16), kv, 16, d);
  bad.mutable_values()->mutable_data()->resize(10);
  *msgs[2].add_appends() = bad;
  v1::PutBlocksResponse r;
  grpc::Status st = Put(*stub, msgs, &r);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(st.error_message(), HasSubstr("appends[2].values.data holds 10 bytes"));
  auto info = ts.server().store().Describe("default", "s");
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->layer_tokens[0], 32);  // messages 0 and 1
  EXPECT_EQ(info->layer_tokens[1], 0);   // message 2 applied nothing

  // The client re-sends everything (fixed): duplicates accepted, the rest appended.
  msgs[2].mutable_appends()->RemoveLast();
  st = Put(*stub, msgs, &r);
  ASSERT_TRUE(st.ok()) << st.error_message();
  EXPECT_EQ(r.tokens_duplicate(), 32);
  EXPECT_EQ(r.tokens_written(), 32 + 16);
}

TEST(ServiceTest, UnparsableStreamMessageFailsTheStreamNamingItsIndex) {
  TestServer ts;
  auto stub = ts.Stub();
  Shape s;
  Register(*stub, MakeRegister(s, kBasisSeed));
  const int kv = s.kv_heads, d = s.head_dim;
  auto k = RandomKV(kv, 32, d, 1);
  v1::PutBlocksRequest first, third;
  *first.add_appends() = MakeAppend("s", 0, 0, Slice(k, kv, 32, d, 0, 16),
                                    Slice(k, kv, 32, d, 0, 16), kv, 16, d, "tiny");
  *third.add_appends() =
      MakeAppend("s", 0, 16, Slice(k, kv, 32, d, 16, 16), Slice(k, kv, 32, d, 16, 16), kv, 16, d);
  // [valid, not a protobuf message (a varint that never ends), valid], sent as raw bytes.
  const std::vector<std::string> messages = {first.SerializeAsString(), std::string(11, '\xff'),
                                             third.SerializeAsString()};
  auto channel = ts.Channel();
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
  grpc::ByteBuffer resp;
  const grpc::internal::RpcMethod method("/kvq.v1.Kvq/PutBlocks",
                                         grpc::internal::RpcMethod::CLIENT_STREAMING);
  std::unique_ptr<grpc::ClientWriter<grpc::ByteBuffer>> w(
      grpc::internal::ClientWriterFactory<grpc::ByteBuffer>::Create(channel.get(), method, &ctx,
                                                                    &resp));
  for (const std::string& m : messages) {
    grpc::Slice slice(m);
    if (!w->Write(grpc::ByteBuffer(&slice, 1))) break;  // the server may have failed already
  }
  w->WritesDone();
  const grpc::Status st = w->Finish();
  EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << st.error_message();
  EXPECT_THAT(st.error_message(), HasSubstr("message 1 of the stream"));
  // The message before it stays applied (documented), the one after it was not read.
  auto info = ts.server().store().Describe("default", "s");
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->layer_tokens[0], 16);
}

TEST(ServiceTest, StreamCutPartWayLeavesWholeMessages) {
  TestServer ts;
  auto stub = ts.Stub();
  Shape s;
  Register(*stub, MakeRegister(s, kBasisSeed));
  const int kv = s.kv_heads, d = s.head_dim;
  const int64_t n = 32, msgs = 40;
  auto k = RandomKV(kv, n * msgs, d, 1), v = RandomKV(kv, n * msgs, d, 2);
  {
    grpc::ClientContext ctx;
    v1::PutBlocksResponse resp;
    auto w = stub->PutBlocks(&ctx, &resp);
    for (int64_t i = 0; i < msgs; ++i) {
      v1::PutBlocksRequest m;
      for (int l = 0; l < s.layers; ++l) {
        *m.add_appends() =
            MakeAppend("cut", l, i * n, Slice(k, kv, n * msgs, d, i * n, n),
                       Slice(v, kv, n * msgs, d, i * n, n), kv, n, d, i == 0 ? "tiny" : "");
      }
      w->Write(m);
      if (i == msgs / 2) ctx.TryCancel();  // the client goes away mid-stream
    }
    EXPECT_FALSE(w->Finish().ok());
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  auto info = ts.server().store().Describe("default", "cut");
  if (info.ok()) {
    // Whole messages only: both layers equal and on a message boundary.
    EXPECT_EQ(info->layer_tokens[0], info->layer_tokens[1]);
    EXPECT_EQ(info->layer_tokens[0] % n, 0);
    EXPECT_LE(info->layer_tokens[0], n * (msgs / 2 + 1));
  } else {
    EXPECT_EQ(info.status().code(), absl::StatusCode::kNotFound);
  }
}

// Cancelled streams end their calls: afterwards nothing is in flight, so shutdown does not
// wait for its grace period.
TEST(ServiceTest, CancelledStreamsReleaseTheirCalls) {
  server::ServerOptions o;
  o.shutdown_grace = absl::Seconds(20);
  TestServer ts(o);
  auto stub = ts.Stub();
  Shape s;
  Register(*stub, MakeRegister(s, kBasisSeed));
  const int kv = s.kv_heads, d = s.head_dim;
  const int64_t T = 300;
  auto k = RandomKV(kv, T, d, 1);
  v1::PutBlocksRequest m;
  *m.add_appends() = MakeAppend("g", 0, 0, k, k, kv, T, d, "tiny");
  v1::PutBlocksResponse r;
  ASSERT_TRUE(Put(*stub, {m}, &r).ok());
  for (int round = 0; round < 5; ++round) {
    grpc::ClientContext ctx;
    v1::GetBlocksRequest req;
    req.set_sequence_id("g");
    req.set_max_tokens_per_message(1);
    auto reader = stub->GetBlocks(&ctx, req);
    v1::GetBlocksResponse msg;
    for (int i = 0; i < 3; ++i) ASSERT_TRUE(reader->Read(&msg));
    EXPECT_EQ(msg.start(), 2);
    ctx.TryCancel();
    while (reader->Read(&msg)) {
    }
    EXPECT_EQ(reader->Finish().error_code(), grpc::StatusCode::CANCELLED);
    grpc::ClientContext pctx;
    v1::PutBlocksResponse presp;
    auto w = stub->PutBlocks(&pctx, &presp);
    m.mutable_appends(0)->set_sequence_id(absl::StrCat("c", round));
    w->Write(m);
    pctx.TryCancel();
    w->Finish();
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  const auto t0 = std::chrono::steady_clock::now();
  ts.server().Shutdown();
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(5));
}

TEST(ServiceTest, NewBasisVersionWhileSequencesAreLive) {
  Fixture f(LegacyShape());
  std::string dir;
  const int kv = f.shape.kv_heads, d = f.shape.head_dim, qh = f.shape.q_heads;
  {
    TestServer ts({}, /*keep_registry_dir=*/true);
    dir = ts.registry_dir();
    auto stub = ts.Stub();
    Register(*stub, MakeRegister(f.shape, kBasisSeed));
    const int64_t T = 70;
    auto k = RandomKV(kv, T, d, 1), v = RandomKV(kv, T, d, 2);
    v1::PutBlocksRequest m;
    *m.add_appends() = MakeAppend("old", 0, 0, k, v, kv, T, d, "tiny");
    v1::PutBlocksResponse r;
    ASSERT_TRUE(Put(*stub, {m}, &r).ok());
    auto q = RandomQueries(qh, 1, d, 9);
    auto before = FloatsOf(ScoreOne(*stub, "old", 0, q, qh, 1, d).results(0).logits());

    Shape s2 = f.shape;
    s2.version = 2;
    Register(*stub, MakeRegister(s2, /*seed=*/99));
    // Re-registering v2 identically is fine; with another basis it is ALREADY_EXISTS.
    v1::RegisterBasisResponse rr;
    auto c1 = Ctx();
    ASSERT_TRUE(stub->RegisterBasis(c1.get(), MakeRegister(s2, 99), &rr).ok());
    EXPECT_TRUE(rr.already_registered());
    auto c2 = Ctx();
    EXPECT_EQ(stub->RegisterBasis(c2.get(), MakeRegister(s2, 100), &rr).error_code(),
              grpc::StatusCode::ALREADY_EXISTS);

    // The live sequence keeps v1 and its exact results; a new one gets v2.
    EXPECT_EQ(FloatsOf(ScoreOne(*stub, "old", 0, q, qh, 1, d).results(0).logits()), before);
    *m.mutable_appends(0) = MakeAppend("new", 0, 0, k, v, kv, T, d, "tiny");
    ASSERT_TRUE(Put(*stub, {m}, &r).ok());
    auto info = ts.server().store().Describe("default", "new");
    ASSERT_TRUE(info.ok());
    EXPECT_EQ(info->model->manifest.version, 2);
    EXPECT_NE(FloatsOf(ScoreOne(*stub, "new", 0, q, qh, 1, d).results(0).logits()), before);

    v1::ScoreRequest sreq;
    auto* it = sreq.add_items();
    it->set_sequence_id("old");
    it->set_basis_version(2);
    *it->mutable_queries() = TensorF32(q, {qh, 1, d});
    v1::ScoreResponse sresp;
    auto c3 = Ctx();
    ASSERT_TRUE(stub->Score(c3.get(), sreq, &sresp).ok());
    EXPECT_EQ(sresp.results(0).status().code(), grpc::StatusCode::FAILED_PRECONDITION);

    // Appending to the old sequence while naming v2 is refused too.
    *m.mutable_appends(0) =
        MakeAppend("old", 0, T, Slice(k, kv, T, d, 0, 1), Slice(v, kv, T, d, 0, 1), kv, 1, d);
    m.mutable_appends(0)->set_basis_version(2);
    EXPECT_EQ(Put(*stub, {m}, &r).error_code(), grpc::StatusCode::FAILED_PRECONDITION);

    v1::GetModelRequest gm;
    gm.set_model("tiny");
    gm.set_version(1);
    v1::ModelInfo mi;
    auto c4 = Ctx();
    ASSERT_TRUE(stub->GetModel(c4.get(), gm, &mi).ok());
    EXPECT_EQ(mi.live_sequences(), 1);
    gm.set_version(0);
    auto c5 = Ctx();
    ASSERT_TRUE(stub->GetModel(c5.get(), gm, &mi).ok());
    EXPECT_EQ(mi.version(), 2);
    gm.set_version(3);
    auto c6 = Ctx();
    EXPECT_EQ(stub->GetModel(c6.get(), gm, &mi).error_code(), grpc::StatusCode::NOT_FOUND);
  }
  // Both versions were persisted and load at the next start.
  EXPECT_TRUE(std::filesystem::exists(dir + "/tiny/v1/manifest.json"));
  EXPECT_TRUE(std::filesystem::exists(dir + "/tiny/v2/basis.safetensors"));
  // Whole entries only: no temporary folder is left behind, every file is complete.
  std::vector<std::string> top;
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    top.push_back(e.path().filename().string());
  }
  EXPECT_THAT(top, ::testing::ElementsAre("tiny"));
  for (const char* v : {"v1", "v2"}) {
    std::vector<std::string> files;
    for (const auto& e : std::filesystem::directory_iterator(absl::StrCat(dir, "/tiny/", v))) {
      files.push_back(e.path().filename().string());
      EXPECT_GT(e.file_size(), 0u) << e.path();
    }
    EXPECT_THAT(
        files, ::testing::UnorderedElementsAre("manifest.json", "basis.safetensors", "codec.json"));
  }
  server::ServerOptions o;
  o.registry_dir = dir;
  TestServer again(o);
  auto stub = again.Stub();
  v1::ListModelsResponse list;
  auto c = Ctx();
  ASSERT_TRUE(stub->ListModels(c.get(), {}, &list).ok());
  EXPECT_EQ(list.models_size(), 2);
  std::filesystem::remove_all(dir);
}

TEST(ServiceTest, ModelWithoutBasisIsServedKiviLike) {
  TestServer ts;
  auto stub = ts.Stub();
  Shape s;
  s.model = "plain";
  s.basis_rank = 0;
  v1::RegisterBasisResponse rr;
  auto c = Ctx();
  ASSERT_TRUE(stub->RegisterBasis(c.get(), MakeRegister(s, 1), &rr).ok());
  EXPECT_FALSE(rr.model().has_basis());
  EXPECT_TRUE(rr.model().codec().has_rank());  // set, as responses set every field
  EXPECT_EQ(rr.model().codec().rank(), 0);
  EXPECT_EQ(rr.model().kind(), "none");
  const int kv = s.kv_heads, d = s.head_dim, qh = s.q_heads;
  auto k = RandomKV(kv, 40, d, 1), v = RandomKV(kv, 40, d, 2);
  v1::PutBlocksRequest m;
  *m.add_appends() = MakeAppend("p", 0, 0, k, v, kv, 40, d, "plain");
  v1::PutBlocksResponse r;
  ASSERT_TRUE(Put(*stub, {m}, &r).ok());
  core::CodecOptions codec = CodecOf(s);
  core::LayerCache ref(codec, kv, nullptr);
  RefAppend(ref, k, v, kv, 40, d, 0);
  auto q = RandomQueries(qh, 1, d, 2);
  std::vector<float> want(qh * 40);
  ASSERT_TRUE(ref.Score(q.data(), qh, 1, want.data()).ok());
  EXPECT_EQ(FloatsOf(ScoreOne(*stub, "p", 0, q, qh, 1, d).results(0).logits()), want);
}

}  // namespace
}  // namespace kvq::testing
