// --drop-after-probe-gap (docs/ROUTER.md): a router's probe (GET /healthz with x-kvq-probe)
// that comes after a longer gap than the option since the same router's previous one drops
// every sequence and is answered 503; probes within it, other routers' probes and checks
// without the header change nothing. Time is a fake clock: no test here sleeps.
#include "server/probe_gap.h"

#include <atomic>
#include <optional>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/server/test_util.h"

namespace kvq::testing {
namespace {

using ::testing::HasSubstr;

struct FakeClock {
  std::atomic<int64_t> ms{1'000'000'000};
  std::function<absl::Time()> Fn() {
    return [this] { return absl::FromUnixMillis(ms.load()); };
  }
  void Advance(absl::Duration d) { ms += absl::ToInt64Milliseconds(d); }
};

TEST(ProbeGapWatchTest, OnlyAGapOverTheLimitSinceTheSameProbersLastProbeCounts) {
  FakeClock clock;
  server::ProbeGapWatch w(absl::Seconds(2), clock.Fn());
  EXPECT_EQ(w.Probe("a"), std::nullopt);  // a prober's first probe
  clock.Advance(absl::Seconds(2));
  EXPECT_EQ(w.Probe("a"), std::nullopt);  // the limit itself is no gap over it
  clock.Advance(absl::Milliseconds(1500));
  EXPECT_EQ(w.Probe("b"), std::nullopt);
  clock.Advance(absl::Milliseconds(1500));  // a: 3 s since its last probe, b: 1.5 s
  EXPECT_EQ(w.Probe("b"), std::nullopt);    // b's probes do not stand in for a's
  EXPECT_EQ(w.Probe("a"), absl::Seconds(3));
  EXPECT_EQ(w.Probe("a"), std::nullopt);  // measured from the last probe, gap or not
}

TEST(ProbeGapWatchTest, ANewProberBeyondTheLimitReplacesTheLeastRecentOne) {
  FakeClock clock;
  server::ProbeGapWatch w(absl::Seconds(1), clock.Fn());
  for (size_t i = 0; i < server::ProbeGapWatch::kMaxProbers; ++i) {
    EXPECT_EQ(w.Probe(absl::StrCat("p", i)), std::nullopt);
    clock.Advance(absl::Milliseconds(1));
  }
  EXPECT_EQ(w.Probe("new"), std::nullopt);  // p0 goes
  clock.Advance(absl::Seconds(5));
  EXPECT_EQ(w.Probe("p1"), absl::Milliseconds(5000 + server::ProbeGapWatch::kMaxProbers - 1));
  EXPECT_EQ(w.Probe("p0"), std::nullopt);  // forgotten: a first probe again
}

class ProbeGapServerTest : public ::testing::Test {
 protected:
  // A server on a fake clock with /metrics and /healthz on 127.0.0.1, the model registered.
  void Start(absl::Duration drop_after) {
    server::ServerOptions o;
    o.metrics_port = 0;
    o.metrics_address = "127.0.0.1";
    o.now = clock_.Fn();
    o.drop_after_probe_gap = drop_after;
    ts_.emplace(o);
    port_ = ts_->server().metrics_port();
    ASSERT_GT(port_, 0);
    stub_ = ts_->Stub();
    auto ctx = Ctx();
    v1::RegisterBasisResponse r;
    ASSERT_TRUE(stub_->RegisterBasis(ctx.get(), MakeRegister(shape_, 7), &r).ok());
  }
  void PutOne(const std::string& tenant, const std::string& id) {
    const auto k = RandomKV(shape_.kv_heads, 40, shape_.head_dim, 3);
    v1::PutBlocksRequest m;
    *m.add_appends() = MakeAppend(id, 0, 0, k, k, shape_.kv_heads, 40, shape_.head_dim, "tiny");
    v1::PutBlocksResponse r;
    grpc::Status st = Put(*stub_, {m}, &r, tenant);
    ASSERT_TRUE(st.ok()) << st.error_message();
  }
  std::string Probe(const std::string& router) {
    return HttpGet(port_, "/healthz", 5, "X-Kvq-Probe: " + router + "\r\n");
  }
  int64_t Held() { return ts_->server().store().TotalUsage().sequences; }

  FakeClock clock_;
  Shape shape_;
  std::optional<TestServer> ts_;
  std::unique_ptr<v1::Kvq::Stub> stub_;
  int port_ = -1;
};

TEST_F(ProbeGapServerTest, AProbeAfterAGapDropsEverySequenceAndIsAnswered503) {
  Start(absl::Seconds(2));
  PutOne("t1", "x");
  PutOne("t2", "y");
  // The router's probes at its check interval: nothing happens.
  for (int i = 0; i < 3; ++i) {
    EXPECT_THAT(Probe("r1"), HasSubstr("HTTP/1.1 200"));
    clock_.Advance(absl::Milliseconds(1900));
  }
  // Checks without the header (an operator's curl, another balancer) are no router's probes,
  // however far apart; a second router's first probe is no gap either.
  clock_.Advance(absl::Minutes(5));
  EXPECT_THAT(HttpGet(port_, "/healthz", 5), HasSubstr("HTTP/1.1 200"));
  EXPECT_THAT(Probe("r2"), HasSubstr("HTTP/1.1 200"));
  EXPECT_EQ(Held(), 2);

  // r1 comes back after 5 minutes: it may have marked this shard down and moved its keys.
  const std::string dropped = Probe("r1");
  EXPECT_THAT(dropped, HasSubstr("HTTP/1.1 503"));
  EXPECT_THAT(dropped, HasSubstr("NOT_SERVING"));
  EXPECT_EQ(Held(), 0);
  EXPECT_EQ(ts_->server().store().Describe("t1", "x").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(ts_->server().store().Describe("t2", "y").status().code(), absl::StatusCode::kNotFound);
  const std::string metrics = HttpGet(port_, "/metrics", 5);
  EXPECT_THAT(metrics, HasSubstr("kvq_probe_gap_drops_total 1\n"));
  EXPECT_THAT(metrics, HasSubstr("kvq_probe_gap_dropped_sequences_total 2\n"));
  // Its next probe, within the limit, passes: the router's rise checks count from here. The
  // shard serves writes as before.
  clock_.Advance(absl::Seconds(1));
  EXPECT_THAT(Probe("r1"), HasSubstr("HTTP/1.1 200"));
  PutOne("t1", "x");
  EXPECT_EQ(Held(), 1);
  EXPECT_THAT(HttpGet(port_, "/metrics", 5), HasSubstr("kvq_probe_gap_drops_total 1\n"));
}

TEST_F(ProbeGapServerTest, OffByDefault) {
  Start(absl::ZeroDuration());
  PutOne("t1", "x");
  EXPECT_THAT(Probe("r1"), HasSubstr("HTTP/1.1 200"));
  clock_.Advance(absl::Hours(1));
  EXPECT_THAT(Probe("r1"), HasSubstr("HTTP/1.1 200"));
  EXPECT_EQ(Held(), 1);
  EXPECT_THAT(HttpGet(port_, "/metrics", 5), HasSubstr("kvq_probe_gap_drops_total 0\n"));
}

}  // namespace
}  // namespace kvq::testing
