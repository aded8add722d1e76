// Service tests of tenants: isolation with auth on, eviction by capacity and quota, many clients.
#include <atomic>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <thread>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "tests/server/server_fixture.h"
#include "tests/server/test_util.h"

namespace kvq::testing {
namespace {

using ::testing::HasSubstr;

// Every read path, paired: the owner's token reads its sequence; another tenant's token gets
// exactly what a sequence that does not exist gets (code and message, the id aside), and
// its Delete frees nothing of the owner's. The tenant comes from the token; x-kvq-tenant
// naming the owner changes nothing.
TEST(ServiceTest, EveryReadPathHitsForItsTenantAndMissesForAnother) {
  const std::string dir = TempDir("kvq-auth-paths");
  const std::string tokens = dir + "/tokens";
  const std::string alpha = "alpha-token-0123456789", beta = "beta-token-0123456789";
  std::ofstream(tokens) << alpha << " alpha\n" << beta << " beta\n";
  server::ServerOptions o;
  o.auth_tokens_file = tokens;
  o.admin_tenants = "alpha";
  TestServer ts(o);
  auto stub = ts.Stub();
  Shape s;
  Register(*stub, MakeRegister(s, kBasisSeed), alpha);
  const int kv = s.kv_heads, d = s.head_dim, qh = s.q_heads;
  const int64_t T = 40;
  v1::PutBlocksRequest m;
  *m.add_appends() =
      MakeAppend("secret", 0, 0, RandomKV(kv, T, d, 1), RandomKV(kv, T, d, 2), kv, T, d, "tiny");
  v1::PutBlocksResponse pr;
  ASSERT_TRUE(Put(*stub, {m}, &pr, "", alpha).ok());
  const auto q = RandomQueries(qh, 1, d, 3);
  std::vector<float> w(static_cast<size_t>(qh) * T, 1.0f / T);
  // Each path's (code, message) for a sequence id as `token` sees it.
  using Outcome = std::pair<int, std::string>;
  auto item = [](const auto& status) { return Outcome{status.code(), status.message()}; };
  auto rpc = [](const grpc::Status& st) { return Outcome{st.error_code(), st.error_message()}; };
  std::map<std::string, std::function<Outcome(const std::string&, const std::string&)>> paths;
  // An items call (one item for `id`, completed by `fill`): its item's outcome.
  auto one_item = [&](auto method, auto req, auto resp, const std::string& id,
                      const std::string& token, const auto& fill) {
    auto* it = req.add_items();
    it->set_sequence_id(id);
    fill(it);
    auto ctx = Ctx("alpha", token);
    grpc::Status st = ((*stub).*method)(ctx.get(), req, &resp);
    return st.ok() ? item(resp.results(0).status()) : rpc(st);
  };
  auto queries = [&](auto* it) { *it->mutable_queries() = TensorF32(q, {qh, 1, d}); };
  paths["Score"] = [&](const std::string& id, const std::string& token) {
    return one_item(&v1::Kvq::Stub::Score, v1::ScoreRequest(), v1::ScoreResponse(), id, token,
                    queries);
  };
  paths["Attend"] = [&](const std::string& id, const std::string& token) {
    return one_item(&v1::Kvq::Stub::Attend, v1::AttendRequest(), v1::AttendResponse(), id, token,
                    queries);
  };
  paths["Readout"] = [&](const std::string& id, const std::string& token) {
    return one_item(&v1::Kvq::Stub::Readout, v1::ReadoutRequest(), v1::ReadoutResponse(), id, token,
                    [&](auto* it) {
                      *it->mutable_weights() = TensorF32(w, {qh, 1, T});
                    });
  };
  paths["GetBlocks"] = [&](const std::string& id, const std::string& token) {
    v1::GetBlocksRequest req;
    req.set_sequence_id(id);
    auto ctx = Ctx("alpha", token);
    auto r = stub->GetBlocks(ctx.get(), req);
    v1::GetBlocksResponse one;
    while (r->Read(&one)) {
    }
    return rpc(r->Finish());
  };
  auto without_id = [](Outcome x, const std::string& id) {
    for (size_t at; (at = x.second.find(id)) != std::string::npos;)
      x.second.replace(at, id.size(), "ID");
    return x;
  };
  for (const auto& [name, call] : paths) {
    SCOPED_TRACE(name);
    EXPECT_EQ(call("secret", alpha).first, 0) << call("secret", alpha).second;
    const Outcome other = call("secret", beta), absent = call("no-such-sequence", beta);
    EXPECT_EQ(other.first, grpc::StatusCode::NOT_FOUND) << other.second;
    EXPECT_EQ(without_id(other, "secret"), without_id(absent, "no-such-sequence"));
    EXPECT_EQ(call("no-such-sequence", alpha), absent);  // the owner's miss looks the same
  }
  auto del = [&](const std::string& id, const std::string& token) {
    v1::DeleteSequenceRequest req;
    req.set_sequence_id(id);
    v1::DeleteSequenceResponse resp;
    auto ctx = Ctx("alpha", token);
    Outcome out = rpc(stub->DeleteSequence(ctx.get(), req, &resp));
    out.second += "|" + std::to_string(resp.bytes_freed());
    return out;
  };
  EXPECT_EQ(without_id(del("secret", beta), "secret"),
            without_id(del("no-such-sequence", beta), "no-such-sequence"));
  EXPECT_EQ(paths["Score"]("secret", alpha).first, 0);  // beta's Delete freed nothing of alpha's
  const Outcome mine = del("secret", alpha);
  EXPECT_EQ(mine.first, 0) << mine.second;
  EXPECT_EQ(paths["Score"]("secret", alpha).first, grpc::StatusCode::NOT_FOUND);
}

TEST(ServiceTest, TenantsAreIsolatedWithAuthOn) {
  const std::string dir = TempDir("kvq-auth");
  const std::string tokens = dir + "/tokens";
  std::ofstream(tokens)
      << "# token tenant\nalpha-token-0123456789 alpha\nbeta-token-0123456789 beta\n";
  server::ServerOptions o;
  o.auth_tokens_file = tokens;
  o.admin_tenants = "alpha";
  TestServer ts(o);
  auto stub = ts.Stub();
  Shape s;
  Register(*stub, MakeRegister(s, kBasisSeed), "alpha-token-0123456789");
  {  // Only admin tenants may add to the shared registry.
    Shape other = s;
    other.model = "beta-model";
    v1::RegisterBasisResponse rr;
    auto ctx = Ctx("", "beta-token-0123456789");
    grpc::Status st = stub->RegisterBasis(ctx.get(), MakeRegister(other, 1), &rr);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::PERMISSION_DENIED);
    EXPECT_THAT(st.error_message(), HasSubstr("--admin-tenants"));
  }
  const int kv = s.kv_heads, d = s.head_dim, qh = s.q_heads;
  auto k = RandomKV(kv, 40, d, 1), v = RandomKV(kv, 40, d, 2);
  v1::PutBlocksRequest m;
  *m.add_appends() = MakeAppend("secret", 0, 0, k, v, kv, 40, d, "tiny");
  v1::PutBlocksResponse r;
  ASSERT_TRUE(Put(*stub, {m}, &r, "", "alpha-token-0123456789").ok());

  // No token / bad token: UNAUTHENTICATED, nothing touched.
  EXPECT_EQ(Put(*stub, {m}, &r).error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_EQ(Put(*stub, {m}, &r, "alpha", "wrong-token-0123456789").error_code(),
            grpc::StatusCode::UNAUTHENTICATED);
  // x-kvq-tenant is ignored when auth is on.
  auto q = RandomQueries(qh, 1, d, 1);
  auto score = [&](const std::string& seq, const std::string& token) {
    v1::ScoreRequest req;
    auto* it = req.add_items();
    it->set_sequence_id(seq);
    *it->mutable_queries() = TensorF32(q, {qh, 1, d});
    v1::ScoreResponse resp;
    auto ctx = Ctx("alpha", token);
    grpc::Status st = stub->Score(ctx.get(), req, &resp);
    return std::make_pair(st, resp);
  };
  auto [st0, r0] = score("secret", "");
  EXPECT_EQ(st0.error_code(), grpc::StatusCode::UNAUTHENTICATED);
  auto [st1, r1] = score("secret", "beta-token-0123456789");
  auto [st2, r2] = score("no-such-sequence", "beta-token-0123456789");
  ASSERT_TRUE(st1.ok());
  // Beta cannot tell alpha's sequence from one that does not exist.
  EXPECT_EQ(r1.results(0).status().code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(r1.results(0).status().message(), "items[0]: sequence 'secret' not found");
  EXPECT_EQ(r2.results(0).status().message(), "items[0]: sequence 'no-such-sequence' not found");
  auto [st3, r3] = score("secret", "alpha-token-0123456789");
  EXPECT_EQ(r3.results(0).status().code(), 0);

  // Beta may use the same id for its own sequence; Delete and Stats are per tenant too.
  *m.mutable_appends(0) = MakeAppend("secret", 0, 0, v, k, kv, 40, d, "tiny");
  ASSERT_TRUE(Put(*stub, {m}, &r, "", "beta-token-0123456789").ok());
  EXPECT_EQ(r.tokens_written(), 40);  // not a conflict with alpha's
  v1::StatsResponse stats;
  auto ctx = Ctx("", "beta-token-0123456789");
  ASSERT_TRUE(stub->Stats(ctx.get(), {}, &stats).ok());
  EXPECT_EQ(stats.tenant(), "beta");
  EXPECT_EQ(stats.sequences(), 1);
  v1::DeleteSequenceRequest dreq;
  dreq.set_sequence_id("secret");
  v1::DeleteSequenceResponse dresp;
  auto ctx2 = Ctx("", "beta-token-0123456789");
  ASSERT_TRUE(stub->DeleteSequence(ctx2.get(), dreq, &dresp).ok());
  auto [st4, r4] = score("secret", "alpha-token-0123456789");
  EXPECT_EQ(r4.results(0).status().code(), 0) << "beta's delete removed alpha's sequence";
  std::filesystem::remove_all(dir);
}

TEST(ServiceTest, EvictionUnderCapacityAndQuotaKeepsWholeSequences) {
  Shape s = LegacyShape();
  s.layers = 2;
  const int kv = s.kv_heads, d = s.head_dim, qh = s.q_heads;
  const int64_t T = 64;
  auto k = RandomKV(kv, T, d, 1), v = RandomKV(kv, T, d, 2);
  v1::PutBlocksRequest one;
  for (int l = 0; l < s.layers; ++l)
    *one.add_appends() = MakeAppend("", l, 0, k, v, kv, T, d, "tiny");
  // Measure one sequence.
  int64_t seq_bytes = 0;
  {
    TestServer probe;
    auto stub = probe.Stub();
    Register(*stub, MakeRegister(s, kBasisSeed));
    for (auto& a : *one.mutable_appends()) a.set_sequence_id("m");
    v1::PutBlocksResponse r;
    ASSERT_TRUE(Put(*stub, {one}, &r).ok());
    seq_bytes = probe.server().store().TotalUsage().bytes;
    ASSERT_GT(seq_bytes, 0);
  }
  server::ServerOptions o;
  o.capacity_bytes = seq_bytes * 3 + seq_bytes / 2;      // three fit
  o.tenant_quota_bytes = seq_bytes * 2 + seq_bytes / 2;  // two per tenant
  TestServer ts(o);
  auto stub = ts.Stub();
  Register(*stub, MakeRegister(s, kBasisSeed));
  auto put = [&](const std::string& tenant, const std::string& id) {
    v1::PutBlocksRequest m = one;
    for (auto& a : *m.mutable_appends()) a.set_sequence_id(id);
    v1::PutBlocksResponse r;
    return Put(*stub, {m}, &r, tenant);
  };
  auto exists = [&](const std::string& tenant, const std::string& id) {
    return ts.server().store().Describe(tenant, id).ok();
  };
  auto q = RandomQueries(qh, 1, d, 1);
  ASSERT_TRUE(put("a", "a1").ok());
  ASSERT_TRUE(put("a", "a2").ok());
  ASSERT_TRUE(put("b", "b1").ok());
  // Quota: a's third sequence evicts a's least recently used one (a1), never b's.
  ScoreOne(*stub, "a1", 0, q, qh, 1, d, "a");  // touch a1: a2 is now a's LRU
  ASSERT_TRUE(put("a", "a3").ok());
  EXPECT_TRUE(exists("a", "a1"));
  EXPECT_FALSE(exists("a", "a2"));
  EXPECT_TRUE(exists("a", "a3"));
  EXPECT_TRUE(exists("b", "b1"));
  // Capacity (3): b's second sequence must evict; a holds more than its equal share (1.75
  // sequences), so a's LRU (a1... touched earlier than a3) goes, b1 stays.
  ASSERT_TRUE(put("b", "b2").ok());
  EXPECT_TRUE(exists("b", "b1"));
  EXPECT_TRUE(exists("b", "b2"));
  EXPECT_EQ(exists("a", "a1") + exists("a", "a3"), 1);
  EXPECT_GE(ts.server().store().TotalUsage().evictions, 2);
  EXPECT_LE(ts.server().store().TotalUsage().bytes, o.capacity_bytes);
  // Survivors are whole: every layer holds every token.
  for (auto [t, id] : std::vector<std::pair<std::string, std::string>>{
           {"a", "a1"}, {"a", "a3"}, {"b", "b1"}, {"b", "b2"}}) {
    auto info = ts.server().store().Describe(t, id);
    if (!info.ok()) continue;
    for (int64_t n : info->layer_tokens) EXPECT_EQ(n, T) << t << "/" << id;
  }
  // A write larger than the quota fails with RESOURCE_EXHAUSTED and evicts nothing.
  const int64_t big_T = 64 * 6;
  auto bk = RandomKV(kv, big_T, d, 3);
  v1::PutBlocksRequest big;
  *big.add_appends() = MakeAppend("huge", 0, 0, bk, bk, kv, big_T, d, "tiny");
  v1::PutBlocksResponse r;
  const int64_t before = ts.server().store().TotalUsage().sequences;
  grpc::Status st = Put(*stub, {big}, &r, "b");
  EXPECT_EQ(st.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_THAT(st.error_message(), HasSubstr("quota"));
  EXPECT_EQ(ts.server().store().TotalUsage().sequences, before);
}

TEST(ServiceTest, SixteenConcurrentClientsMixingWritesAndReads) {
  TestServer ts;
  Fixture f;
  const Shape& s = f.shape;
  {
    auto stub = ts.Stub();
    Register(*stub, MakeRegister(s, kBasisSeed));
  }
  const int kv = s.kv_heads, d = s.head_dim, qh = s.q_heads;
  const int kThreads = 16, kSteps = 12;
  const int64_t chunk = 11;
  const int64_t T = chunk * kSteps;
  std::atomic<int> failures{0};
  std::vector<std::thread> threads;
  auto channel = ts.Channel();
  for (int th = 0; th < kThreads; ++th) {
    threads.emplace_back([&, th] {
      auto stub = v1::Kvq::NewStub(th % 2 ? ts.Channel() : channel);
      const std::string id = absl::StrCat("seq", th);
      auto k = RandomKV(kv, T, d, 1000 + th), v = RandomKV(kv, T, d, 2000 + th);
      auto q = RandomQueries(qh, 1, d, th);
      for (int step = 0; step < kSteps; ++step) {
        v1::PutBlocksRequest m;
        *m.add_appends() = MakeAppend(id, 0, step * chunk, Slice(k, kv, T, d, step * chunk, chunk),
                                      Slice(v, kv, T, d, step * chunk, chunk), kv, chunk, d,
                                      step == 0 ? "tiny" : "");
        v1::PutBlocksResponse r;
        if (!Put(*stub, {m}, &r).ok()) ++failures;
        // Read own sequence and a neighbour's (which may not exist yet).
        v1::AttendRequest areq;
        for (int other : {th, (th + 1) % kThreads}) {
          auto* it = areq.add_items();
          it->set_sequence_id(absl::StrCat("seq", other));
          it->set_observe(false);
          *it->mutable_queries() = TensorF32(q, {qh, 1, d});
        }
        v1::AttendResponse aresp;
        auto ctx = Ctx();
        if (!stub->Attend(ctx.get(), areq, &aresp).ok() || aresp.results(0).status().code() != 0) {
          ++failures;
        }
        auto sc = ScoreOne(*stub, id, 0, q, qh, 1, d);
        if (sc.results_size() != 1 || sc.results(0).tokens() != (step + 1) * chunk) ++failures;
      }
      // Final state equals the in-process codec's.
      auto ref = f.Ref(0);
      for (int step = 0; step < kSteps; ++step) {
        RefAppend(*ref, Slice(k, kv, T, d, step * chunk, chunk),
                  Slice(v, kv, T, d, step * chunk, chunk), kv, chunk, d, step * chunk);
      }
      std::vector<float> want(qh * T);
      ASSERT_TRUE(ref->Score(q.data(), qh, 1, want.data()).ok());
      if (FloatsOf(ScoreOne(*stub, id, 0, q, qh, 1, d).results(0).logits()) != want) ++failures;
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(failures.load(), 0);
  EXPECT_EQ(ts.server().store().TotalUsage().sequences, kThreads);
}

}  // namespace
}  // namespace kvq::testing
