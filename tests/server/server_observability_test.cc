// Service tests of what operators watch: gRPC health, reflection, the port, /metrics, /healthz.
#include <unistd.h>

#include <cmath>
#include <thread>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "kvq/core/codec.h"
#include "tests/server/server_fixture.h"
#include "tests/server/test_util.h"

namespace kvq::testing {
namespace {

using ::testing::HasSubstr;

TEST(ServiceTest, HealthServingAndModelsListed) {
  TestServer ts;
  auto ch = ts.Channel();
  auto health = grpc::health::v1::Health::NewStub(ch);
  grpc::health::v1::HealthCheckRequest hreq;
  grpc::health::v1::HealthCheckResponse hresp;
  auto ctx = Ctx();
  ASSERT_TRUE(health->Check(ctx.get(), hreq, &hresp).ok());
  EXPECT_EQ(hresp.status(), grpc::health::v1::HealthCheckResponse::SERVING);
  hreq.set_service("kvq.v1.Kvq");
  auto ctx1 = Ctx();
  ASSERT_TRUE(health->Check(ctx1.get(), hreq, &hresp).ok());
  EXPECT_EQ(hresp.status(), grpc::health::v1::HealthCheckResponse::SERVING);

  auto stub = v1::Kvq::NewStub(ch);
  Shape s;
  Register(*stub, MakeRegister(s, kBasisSeed));
  v1::ListModelsResponse list;
  auto c2 = Ctx();
  ASSERT_TRUE(stub->ListModels(c2.get(), {}, &list).ok());
  ASSERT_EQ(list.models_size(), 1);
  EXPECT_EQ(list.models(0).model(), "tiny");
  EXPECT_TRUE(list.models(0).has_basis());
  EXPECT_EQ(list.models(0).codec().rank(), 4);
  // Registered without codec settings: the server's default, headq-kv3-g128-s4-v2.
  EXPECT_EQ(list.models(0).codec().key_bits(), 3);
  EXPECT_EQ(list.models(0).codec().key_group(), 128);
  EXPECT_EQ(list.models(0).codec().side_bits(), 4);
  EXPECT_EQ(list.models(0).codec().value_bits(), 2);
  EXPECT_EQ(list.models(0).codec().value_group(), 32);
  EXPECT_FALSE(list.models(0).fingerprint().empty());
}

// Health is NOT_SERVING from the moment the port is open until the registry is loaded (the
// hook runs right after the server starts listening), SERVING after, NOT_SERVING again while
// shutdown drains; a Watch stream sees each change.
TEST(ServiceTest, HealthIsNotServingUntilLoadedAndWhileDraining) {
  using grpc::health::v1::HealthCheckResponse;
  std::shared_ptr<grpc::Channel> ch;
  std::unique_ptr<grpc::health::v1::Health::Stub> health;
  grpc::ClientContext watch_ctx;
  std::unique_ptr<grpc::ClientReader<HealthCheckResponse>> watch;
  auto check = [&](const std::string& service, grpc::StatusCode want_code = grpc::StatusCode::OK) {
    grpc::health::v1::HealthCheckRequest req;
    req.set_service(service);
    HealthCheckResponse resp;
    auto ctx = Ctx();
    grpc::Status st = health->Check(ctx.get(), req, &resp);
    EXPECT_EQ(st.error_code(), want_code) << service << ": " << st.error_message();
    return resp.status();
  };
  HealthCheckResponse w;
  server::ServerOptions opts;
  bool hooked = false;
  opts.on_listening = [&](int port) {
    hooked = true;
    ch = grpc::CreateChannel(absl::StrCat("127.0.0.1:", port), grpc::InsecureChannelCredentials());
    health = grpc::health::v1::Health::NewStub(ch);
    EXPECT_EQ(check(""), HealthCheckResponse::NOT_SERVING);
    EXPECT_EQ(check("kvq.v1.Kvq"), HealthCheckResponse::NOT_SERVING);
    check("no.such.Service", grpc::StatusCode::NOT_FOUND);
    grpc::health::v1::HealthCheckRequest req;
    req.set_service("kvq.v1.Kvq");
    watch_ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    watch = health->Watch(&watch_ctx, req);
    ASSERT_TRUE(watch->Read(&w));
    EXPECT_EQ(w.status(), HealthCheckResponse::NOT_SERVING);
    // Calls that need the registry wait for it; Echo does not.
    auto stub = v1::Kvq::NewStub(ch);
    v1::ListModelsResponse list;
    auto c1 = Ctx();
    EXPECT_EQ(stub->ListModels(c1.get(), {}, &list).error_code(), grpc::StatusCode::UNAVAILABLE);
    v1::EchoResponse er;
    auto c2 = Ctx();
    EXPECT_TRUE(stub->Echo(c2.get(), {}, &er).ok());
  };
  TestServer ts(opts);
  ASSERT_TRUE(hooked);
  EXPECT_EQ(check(""), HealthCheckResponse::SERVING);
  EXPECT_EQ(check("kvq.v1.Kvq"), HealthCheckResponse::SERVING);
  ASSERT_TRUE(watch->Read(&w));
  EXPECT_EQ(w.status(), HealthCheckResponse::SERVING);

  // An open PutBlocks stream keeps the drain waiting while we look.
  auto stub = v1::Kvq::NewStub(ch);
  Shape s;
  Register(*stub, MakeRegister(s, kBasisSeed));
  OpenStream open;
  ASSERT_NO_FATAL_FAILURE(open.Open(*stub, s, "h", 3));
  std::thread stopper([&] { ts.server().Shutdown(); });
  ASSERT_TRUE(watch->Read(&w));
  EXPECT_EQ(w.status(), HealthCheckResponse::NOT_SERVING);
  EXPECT_EQ(check(""), HealthCheckResponse::NOT_SERVING);
  EXPECT_EQ(check("kvq.v1.Kvq"), HealthCheckResponse::NOT_SERVING);
  grpc::Status st = open.Close();
  EXPECT_TRUE(st.ok()) << st.error_message();
  stopper.join();
  // The server's shutdown ends the watch.
  EXPECT_FALSE(watch->Read(&w));
  EXPECT_FALSE(watch->Finish().ok());
}

// Server reflection, spoken with a generic stub (Debian ships no reflection.proto): a
// hand-encoded ServerReflectionRequest{list_services: ""} (field 7).
TEST(ServiceTest, ReflectionListsTheServices) {
  TestServer ts;
  grpc::GenericStub gs(ts.Channel());
  grpc::CompletionQueue cq;
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  auto call =
      gs.PrepareCall(&ctx, "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo", &cq);
  auto wait = [&](intptr_t want) {
    void* tag = nullptr;
    bool ok = false;
    EXPECT_TRUE(cq.Next(&tag, &ok));
    EXPECT_EQ(reinterpret_cast<intptr_t>(tag), want);
    return ok;
  };
  call->StartCall(reinterpret_cast<void*>(1));
  ASSERT_TRUE(wait(1));
  const std::string req("\x3a\x00", 2);
  grpc::Slice slice(req);
  grpc::ByteBuffer buf(&slice, 1);
  call->Write(buf, reinterpret_cast<void*>(2));
  ASSERT_TRUE(wait(2));
  call->WritesDone(reinterpret_cast<void*>(3));
  ASSERT_TRUE(wait(3));
  grpc::ByteBuffer resp;
  call->Read(&resp, reinterpret_cast<void*>(4));
  ASSERT_TRUE(wait(4));
  grpc::Status st;
  call->Finish(&st, reinterpret_cast<void*>(5));
  wait(5);
  EXPECT_TRUE(st.ok()) << st.error_message();
  std::vector<grpc::Slice> slices;
  ASSERT_TRUE(resp.Dump(&slices).ok());
  std::string text;
  for (const auto& sl : slices) text.append(reinterpret_cast<const char*>(sl.begin()), sl.size());
  EXPECT_THAT(text, HasSubstr("kvq.v1.Kvq"));
  EXPECT_THAT(text, HasSubstr("grpc.health.v1.Health"));
  cq.Shutdown();
  void* tag;
  bool ok;
  while (cq.Next(&tag, &ok)) {
  }
}

TEST(ServiceTest, TheListeningPortIsExclusive) {
  TestServer first;
  server::ServerOptions o;
  o.grpc_address = "127.0.0.1";
  o.grpc_port = first.server().grpc_port();
  o.metrics_port = -1;
  o.capacity_bytes = 1 << 20;
  server::KvqServer second(o);
  const absl::Status st = second.Start();
  EXPECT_EQ(st.code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(std::string(st.message()),
              HasSubstr(absl::StrCat("cannot listen on 127.0.0.1:", o.grpc_port)));
  EXPECT_THAT(std::string(st.message()), HasSubstr("in use"));
}

TEST(ServiceTest, PrometheusMetricsOnTheirOwnPort) {
  server::ServerOptions o;
  o.metrics_port = 0;
  o.metrics_address = "127.0.0.1";
  o.housekeeping_period = absl::Milliseconds(50);
  TestServer ts(o);
  ASSERT_GT(ts.server().metrics_port(), 0);
  auto stub = ts.Stub();
  Shape s = LegacyShape();
  Register(*stub, MakeRegister(s, kBasisSeed));
  auto k = RandomKV(s.kv_heads, 64, s.head_dim, 1);
  v1::PutBlocksRequest m;
  *m.add_appends() = MakeAppend("x", 0, 0, k, k, s.kv_heads, 64, s.head_dim, "tiny");
  v1::PutBlocksResponse r;
  ASSERT_TRUE(Put(*stub, {m}, &r, "t1").ok());
  ScoreOne(*stub, "missing", 0, RandomQueries(s.q_heads, 1, s.head_dim, 1), s.q_heads, 1,
           s.head_dim);
  // Stats: bits per element are the codec's block sizes (64 tokens = two full groups).
  v1::StatsResponse stats;
  auto sctx = Ctx("t1");
  ASSERT_TRUE(stub->Stats(sctx.get(), {}, &stats).ok());
  const core::CodecOptions codec = CodecOf(s);
  EXPECT_DOUBLE_EQ(stats.k_bits_per_element(),
                   8.0 * core::KeyBlockBytes(codec) / (codec.key_group * s.head_dim));
  EXPECT_DOUBLE_EQ(stats.v_bits_per_element(),
                   8.0 * core::ValueBlockBytes(codec) / (codec.key_group * s.head_dim));
  EXPECT_EQ(stats.tokens(), 64);
  EXPECT_EQ(stats.memory_pool(), "host");
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  const std::string text = HttpGet(ts.server().metrics_port(), "/metrics");
  for (const char* want :
       {"kvq_requests_total{code=\"OK\",method=\"PutBlocks\"} 1",
        "kvq_request_duration_seconds_bucket{method=\"Score\"", "kvq_received_bytes_total",
        "kvq_sent_bytes_total", "kvq_stored_bytes{pool=\"host\"}",
        "kvq_stored_blocks{pool=\"host\"} 8", "kvq_key_bits_per_element",
        "kvq_value_bits_per_element", "kvq_evictions_total", "kvq_cached_tokens 64",
        "kvq_sequences 1", "kvq_tenant_stored_bytes{tenant=\"t1\"}", "kvq_ready 1",
        "kvq_prefix_blocks 0", "kvq_prefix_bytes 0", "kvq_prefix_retained_bytes 0",
        "kvq_prefix_shared_tokens_total 0",
        "kvq_memory_pool_bytes{pool=\"host\",state=\"requested\"}",
        "kvq_memory_pool_bytes{pool=\"host\",state=\"fallback\"} 0"}) {
    EXPECT_THAT(text, HasSubstr(want));
  }
}

// Stats' k_bits_per_element / v_bits_per_element and their gauges count what docs/CODEC.md
// counts and stored_bytes holds: blocks, window and the fp16 sink rows (16 bits per element of
// the S sink rows, once per sequence). They once left the sink rows out (16 S / T too low).
TEST(ServiceTest, BitsPerElementCountTheFp16SinkRows) {
  server::ServerOptions o = WithLocalMetrics();
  o.housekeeping_period = absl::Milliseconds(50);
  TestServer ts(o);
  auto stub = ts.Stub();
  Shape s;
  Register(*stub, MakeRegister(s, kBasisSeed));
  constexpr int kSinks = 4;
  const int G = CodecOf(s).key_group, T = 2 * G;  // two whole groups, nothing in the window
  auto k = RandomKV(s.kv_heads, T, s.head_dim, 1);
  v1::PutBlocksRequest m;
  *m.add_appends() = MakeAppend("x", 0, 0, k, k, s.kv_heads, T, s.head_dim, "tiny");
  m.mutable_appends(0)->mutable_codec()->set_fp16_sinks(kSinks);
  v1::PutBlocksResponse r;
  ASSERT_TRUE(Put(*stub, {m}, &r).ok());
  const absl::StatusOr<core::SequenceInfo> info = ts.server().store().Describe("default", "x");
  ASSERT_TRUE(info.ok()) << info.status();
  ASSERT_EQ(info->codec.fp16_sinks, kSinks);
  ASSERT_EQ(info->codec.window, 0);
  const core::UsageStats u = ts.server().store().TotalUsage();
  EXPECT_EQ(u.size.key_sink_bytes, int64_t{2} * s.kv_heads * kSinks * s.head_dim);
  EXPECT_EQ(u.size.value_sink_bytes, int64_t{2} * s.kv_heads * kSinks * s.head_dim);
  // Per element: the blocks' bits plus 16 bits for S of the T rows.
  const double sink_bits = 16.0 * kSinks / T;
  const double want_k = 8.0 * core::KeyBlockBytes(info->codec) / (G * s.head_dim) + sink_bits;
  const double want_v = 8.0 * core::ValueBlockBytes(info->codec) / (G * s.head_dim) + sink_bits;
  v1::StatsResponse stats;
  auto ctx = Ctx();
  ASSERT_TRUE(stub->Stats(ctx.get(), {}, &stats).ok());
  EXPECT_NEAR(stats.k_bits_per_element(), want_k, 1e-9);
  EXPECT_NEAR(stats.v_bits_per_element(), want_v, 1e-9);
  // Multiplied back, they are the bytes the cache holds (stored_bytes adds the token hashes).
  EXPECT_EQ(
      std::llround((stats.k_bits_per_element() + stats.v_bits_per_element()) * u.elements / 8),
      u.size.total_bytes());
  EXPECT_GE(stats.stored_bytes(), u.size.total_bytes());
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  const std::string text = HttpGet(ts.server().metrics_port(), "/metrics");
  EXPECT_NEAR(MetricValue(text, "kvq_key_bits_per_element"), want_k, 1e-6);
  EXPECT_NEAR(MetricValue(text, "kvq_value_bits_per_element"), want_v, 1e-6);
}

// Silent TCP peers on the metrics port (one connected and quiet, one with half a request)
// must not block a scrape: civetweb's default two threads, each held up to 30 s by such a
// peer, did.
TEST(ServiceTest, MetricsScrapeIsNotBlockedByIdlePeers) {
  TestServer ts(WithLocalMetrics());
  const int port = ts.server().metrics_port();
  std::vector<int> idle;
  for (int i = 0; i < 4; ++i) {
    const int fd = ConnectLocal(port);
    ASSERT_GE(fd, 0);
    if (i % 2) (void)!write(fd, "GET /metr", 9);
    idle.push_back(fd);
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(200));  // accepted, threads taken
  const std::string text = HttpGet(port, "/metrics", /*timeout_s=*/5);
  EXPECT_THAT(text, HasSubstr("kvq_ready 1"));
  for (int fd : idle) close(fd);
}

// GET /healthz on the metrics port (HAProxy's httpchk): 503 until the registry is loaded,
// 200 while SERVING, 503 again once shutdown began; /metrics is still served alongside.
TEST(ServiceTest, HealthzOnTheMetricsPortFollowsServing) {
  server::ServerOptions o = WithLocalMetrics();
  o.grpc_address = "127.0.0.1";
  o.grpc_port = 0;
  o.capacity_bytes = int64_t{1} << 28;
  o.shutdown_grace = absl::Milliseconds(100);
  server::KvqServer* srv = nullptr;
  std::string before;
  o.on_listening = [&](int) { before = HttpGet(srv->metrics_port(), "/healthz", 5); };
  server::KvqServer server(o);
  srv = &server;
  ASSERT_TRUE(server.Start().ok());
  const int port = server.metrics_port();
  ASSERT_GT(port, 0);
  EXPECT_THAT(before, HasSubstr("HTTP/1.1 503"));
  EXPECT_THAT(before, HasSubstr("NOT_SERVING"));
  const std::string ok = HttpGet(port, "/healthz", 5);
  EXPECT_THAT(ok, HasSubstr("HTTP/1.1 200"));
  EXPECT_THAT(ok, HasSubstr("\r\n\r\nSERVING\n"));
  EXPECT_THAT(HttpGet(port, "/healthz?full=1", 5), HasSubstr("HTTP/1.1 200"));
  EXPECT_THAT(HttpGet(port, "/metrics", 5), HasSubstr("kvq_ready 1"));
  EXPECT_THAT(HttpGet(port, "/healthzz", 5), HasSubstr("404"));
  server.Shutdown();
  const std::string after = HttpGet(port, "/healthz", 5);
  EXPECT_THAT(after, HasSubstr("HTTP/1.1 503"));
  EXPECT_THAT(HttpGet(port, "/metrics", 5), HasSubstr("kvq_ready 0"));
}

}  // namespace
}  // namespace kvq::testing
