// A server whose store is what `--memory gpu` makes, on the host stand-in of a GPU (encoded
// blocks in a slab pool the CPU reads only by copies, attends on the host stand-in of the
// CUDA attend), against an ordinary server over real gRPC: the same writes, then attends that
// agree within the GPU attend's tolerance, scores and GetBlocks-style decodes that agree
// exactly; Stats and the metrics say which pool and backend serve.
#include <cmath>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kvq/core/attend_backend.h"
#include "kvq/core/byte_pool.h"
#include "kvq/kernels/kernels.h"
#include "tests/server/test_util.h"

namespace kvq::testing {
namespace {

using ::testing::HasSubstr;

// cuda_math_test's tolerance (of max|v|).
constexpr float kTolerance = 4e-6f;

class GpuStandInServer : public ::testing::Test {
 protected:
  void SetUp() override {
    // Both servers' CPU kernels are the scalar reference: the AVX-512 tables' int16 rounding
    // alone differs by more than the GPU attend's tolerance.
    kernels::SetActive(&kernels::Ref());
    plain_ = std::make_unique<TestServer>();
    server::ServerOptions o;
    o.byte_pool = &pool_;
    o.attend_backend = core::HostAttendBackend();
    o.metrics_port = 0;
    o.housekeeping_period = absl::Milliseconds(20);
    gpu_ = std::make_unique<TestServer>(o);
    for (TestServer* ts : {plain_.get(), gpu_.get()}) {
      auto stub = ts->Stub();
      v1::RegisterBasisResponse resp;
      auto ctx = Ctx();
      ASSERT_TRUE(stub->RegisterBasis(ctx.get(), MakeRegister(shape_, 5), &resp).ok());
    }
  }
  void TearDown() override { kernels::SetActive(nullptr); }

  // The same call on both servers.
  template <class Call>
  void Both(Call&& call) {
    for (TestServer* ts : {plain_.get(), gpu_.get()}) {
      auto stub = ts->Stub();
      call(*stub);
    }
  }

  Shape shape_;
  core::SlabBytePool pool_{kernels::Pool::kHost, size_t{1} << 20,
                           core::SlabBytePool::CpuAccess::kByCopy};
  std::unique_ptr<TestServer> plain_, gpu_;
};

TEST_F(GpuStandInServer, AttendsAgreeAndStatsNameThePoolAndBackend) {
  const int kv = shape_.kv_heads, d = shape_.head_dim, qh = shape_.q_heads;
  const int64_t T = 300;  // two groups of 128 and a window
  const auto k = RandomKV(kv, T, d, 1), v = RandomKV(kv, T, d, 2);
  float vmax = 0.0f;
  for (float x : F16RoundTrip(v)) vmax = std::max(vmax, std::fabs(x));
  v1::PutBlocksRequest put;
  for (int l = 0; l < shape_.layers; ++l)
    *put.add_appends() = MakeAppend("s", l, 0, k, v, kv, T, d, shape_.model);
  Both([&](v1::Kvq::Stub& stub) {
    v1::PutBlocksResponse r;
    grpc::Status st = Put(stub, {put}, &r);
    ASSERT_TRUE(st.ok()) << st.error_message();
  });
  const int64_t calls = core::HostAttendBackend()->calls();
  v1::AttendRequest attend;
  for (int l = 0; l < shape_.layers; ++l) {
    auto* it = attend.add_items();
    it->set_sequence_id("s");
    it->set_layer(l);
    *it->mutable_queries() = TensorF32(RandomQueries(qh, 1, d, 7 + l), {qh, 1, d});
  }
  std::vector<v1::AttendResponse> out;
  Both([&](v1::Kvq::Stub& stub) {
    v1::AttendResponse r;
    auto ctx = Ctx();
    grpc::Status st = stub.Attend(ctx.get(), attend, &r);
    ASSERT_TRUE(st.ok()) << st.error_message();
    out.push_back(r);
  });
  ASSERT_EQ(out.size(), 2u);
  for (int l = 0; l < shape_.layers; ++l) {
    ASSERT_EQ(out[0].results(l).status().code(), 0);
    ASSERT_EQ(out[1].results(l).status().code(), 0) << out[1].results(l).status().message();
    const auto a = FloatsOf(out[0].results(l).outputs()), b = FloatsOf(out[1].results(l).outputs());
    ASSERT_EQ(a.size(), b.size());
    float worst = 0.0f;
    for (size_t i = 0; i < a.size(); ++i) worst = std::max(worst, std::fabs(a[i] - b[i]));
    EXPECT_LE(worst, kTolerance * vmax) << "layer " << l;
  }
  EXPECT_EQ(core::HostAttendBackend()->calls(), calls + shape_.layers);

  // Scores read the blocks where they lie, on the backend's block ops: the same bits.
  v1::ScoreRequest score;
  auto* it = score.add_items();
  it->set_sequence_id("s");
  *it->mutable_queries() = TensorF32(RandomQueries(qh, 2, d, 9), {qh, 2, d});
  std::vector<std::vector<float>> logits;
  Both([&](v1::Kvq::Stub& stub) {
    v1::ScoreResponse r;
    auto ctx = Ctx();
    ASSERT_TRUE(stub.Score(ctx.get(), score, &r).ok());
    ASSERT_EQ(r.results(0).status().code(), 0) << r.results(0).status().message();
    logits.push_back(FloatsOf(r.results(0).logits()));
  });
  ASSERT_EQ(logits.size(), 2u);
  EXPECT_EQ(logits[0], logits[1]);

  auto stub = gpu_->Stub();
  v1::StatsResponse stats;
  auto ctx = Ctx();
  ASSERT_TRUE(stub->Stats(ctx.get(), v1::StatsRequest(), &stats).ok());
  EXPECT_EQ(stats.memory_pool(), "gpu");
  EXPECT_THAT(stats.compute_backend(), ::testing::StartsWith("cuda-host+"));
  // The metrics: the backend's attends and block reads, and no block copied back (the attends'
  // checksums are verified on the backend, the score ran there), refreshed by the housekeeping
  // thread every 20 ms, so polled until both counters have been published.
  std::string metrics;
  for (int i = 0; i < 250; ++i) {
    metrics = HttpGet(gpu_->server().metrics_port(), "/metrics", 5);
    if (metrics.find("kvq_attend_backend_calls_total{backend=\"cuda-host\"}") !=
            std::string::npos &&
        metrics.find("kvq_backend_block_ops_total{backend=\"cuda-host\"}") != std::string::npos)
      break;
    absl::SleepFor(absl::Milliseconds(20));
  }
  EXPECT_THAT(metrics, HasSubstr("kvq_attend_backend_calls_total{backend=\"cuda-host\"}"));
  EXPECT_THAT(metrics, HasSubstr("kvq_backend_block_ops_total{backend=\"cuda-host\"}"));
  EXPECT_THAT(metrics, HasSubstr("kvq_stored_bytes{pool=\"gpu\"}"));
  EXPECT_THAT(metrics, HasSubstr("kvq_block_copy_back_bytes_total 0\n"));
}

}  // namespace
}  // namespace kvq::testing
