// A store configured as `--memory gpu` configures it: on the host stand-in of a GPU (blocks in
// a slab pool the CPU reads only by copies, as device memory, attends on the host stand-in of
// the CUDA attend) everywhere, and on the device itself (the gpu pool and the CUDA attend)
// where one answers (skipped otherwise, unless KVQ_REQUIRE_CUDA is set: scripts/device-check.sh);
// and as `--memory pinned --attend gpu` does (blocks in memory the CPU reads in place and the
// device reads over the bus: a direct host slab on the stand-in, the pinned pool on a device).
// Against an ordinary store fed the same workload: prefills, then decode steps that append a token
// and attend (observing), scores, GetBlocks-style decodes, a prefill's causal attend and a
// scrub. Scores, decodes, the prefill and usage agree exactly (the backend's block ops are
// core's codec bit for bit on the reference kernels, on the stand-in and on a device); the
// decode steps' attend agrees within the GPU attend's tolerance; and the backend is seen to
// serve every read of device blocks without copying one back.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <span>
#include <string>

#include "kvq/core/attend_backend.h"
#include "kvq/core/byte_pool.h"
#include "kvq/core/registry.h"
#include "kvq/core/store.h"
#include "kvq/kernels/device.h"
#include "kvq/kernels/kernels.h"

namespace kvq::core {
namespace {

constexpr int kKv = 2, kQ = 6, kD = 64;
// Of max|v|: cuda_math_test's for the CPU stand-in (the kernel sums in other orders and folds
// scales), cuda_parity_test's on a device (FMA contraction and the device's expf besides).
constexpr float kStandInTolerance = 4e-6f, kDeviceTolerance = 2e-5f;

std::vector<float> Normal(size_t n, uint32_t seed, float sigma = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, sigma);
  std::vector<float> v(n);
  for (float& x : v) x = nd(rng);
  return v;
}

// The parameter: on the device or on its host stand-in; device memory or pinned memory.
struct Where {
  bool device;
  bool pinned;
};

class StoreBackendTest : public ::testing::TestWithParam<Where> {
 protected:
  // Both stores' CPU kernels are the scalar reference (the definition of correct): the AVX-512
  // tables round attention weights to int16 on some paths (docs/CODEC.md), which alone
  // differs by more than the GPU attend's tolerance.
  void TearDown() override { kernels::SetActive(nullptr); }
  void SetUp() override {
    kernels::SetActive(&kernels::Ref());
    BasisManifest m;
    m.model = "m";
    m.version = 1;
    m.layers = 2;
    m.kv_heads = kKv;
    m.q_heads = kQ;
    m.head_dim = kD;
    m.rank = 8;
    m.kind = "random";
    ModelEntry e;
    e.manifest = m;
    e.has_basis = true;
    e.basis = RandomBasis(m, 1);
    e.codec = Registry::DefaultCodec(m, true);
    ASSERT_TRUE(registry_.Register(e, nullptr).ok());
    StoreOptions with;
    with.byte_pool = pool_ = GetParam().pinned ? &pinned_stand_in_ : &stand_in_;
    with.attend_backend = backend_of_ = HostAttendBackend();
    tolerance_ = kStandInTolerance;
    if (GetParam().device) {
      absl::StatusOr<BytePool*> gpu =
          SharedBytePool(GetParam().pinned ? kernels::Pool::kPinned : kernels::Pool::kGpu);
      if (!gpu.ok() || !kernels::CudaAvailable()) {
        if (std::getenv("KVQ_REQUIRE_CUDA") != nullptr)
          FAIL() << "KVQ_REQUIRE_CUDA set; " << gpu.status();
        GTEST_SKIP() << gpu.status();
      }
      with.byte_pool = pool_ = *gpu;
      with.attend_backend = backend_of_ = CudaAttendBackend();
      tolerance_ = kDeviceTolerance;
    }
    plain_ = std::make_unique<Store>(StoreOptions{}, &registry_);
    backend_ = std::make_unique<Store>(with, &registry_);
  }

  // The same append on both stores.
  // token_ids: the ids of the n tokens (prefix sharing), or empty.
  void Append(const std::string& seq, int layer, int64_t start, int64_t n, uint32_t seed,
              const CodecOptions* codec = nullptr, std::span<const uint32_t> token_ids = {}) {
    const auto k = Normal(kKv * n * kD, seed), v = Normal(kKv * n * kD, seed + 1);
    for (float x : v) vmax_ = std::max(vmax_, std::fabs(x));
    AppendSpec s;
    s.sequence_id = seq;
    s.layer = layer;
    s.start = start;
    s.keys = TensorView::Contiguous(k.data(), DType::kF32, {kKv, n, kD});
    s.values = TensorView::Contiguous(v.data(), DType::kF32, {kKv, n, kD});
    s.model = "m";
    s.token_ids = token_ids;
    if (codec) {
      s.has_codec = true;
      s.codec = *codec;
    }
    for (Store* st : {plain_.get(), backend_.get()}) {
      AppendOutcome out;
      ASSERT_TRUE(st->Append("t", {s}, &out).ok());
    }
  }

  // Attend on both stores; returns the largest difference.
  float AttendBoth(const std::string& seq, int layer, int n_q, const AttendOptions& ao,
                   uint32_t seed) {
    const auto q = Normal(static_cast<size_t>(kQ) * n_q * kD, seed, 2.0f);
    std::vector<float> a, b;
    const absl::StatusOr<int64_t> ta =
        plain_->Attend({"t", seq, layer, 0}, {q.data(), kQ, n_q, kD}, ao, &a);
    const absl::StatusOr<int64_t> tb =
        backend_->Attend({"t", seq, layer, 0}, {q.data(), kQ, n_q, kD}, ao, &b);
    EXPECT_TRUE(ta.ok());
    EXPECT_TRUE(tb.ok());
    EXPECT_EQ(ta.value_or(0), tb.value_or(0));
    float worst = a.size() == b.size() ? 0.0f : INFINITY;
    for (size_t i = 0; i < a.size() && i < b.size(); ++i)
      worst = std::max(worst, std::isfinite(b[i]) ? std::fabs(a[i] - b[i]) : INFINITY);
    return worst;
  }

  void ExpectSameScoresAndBlocks(const std::string& seq, int layer) {
    const auto q = Normal(static_cast<size_t>(kQ) * kD, 99, 2.0f);
    std::vector<float> sa, sb;
    ASSERT_TRUE(plain_->Score({"t", seq, layer, 0}, {q.data(), kQ, 1, kD}, 0.0f, false, &sa).ok());
    ASSERT_TRUE(
        backend_->Score({"t", seq, layer, 0}, {q.data(), kQ, 1, kD}, 0.0f, false, &sb).ok());
    EXPECT_EQ(sa, sb);
    // Readout of the scores' softmax (width: the layer's tokens).
    const int64_t T = static_cast<int64_t>(sa.size()) / kQ;
    std::vector<float> ra, rb;
    ASSERT_TRUE(plain_->Readout({"t", seq, layer, 0}, {sa.data(), kQ, 1, T}, true, &ra).ok());
    ASSERT_TRUE(backend_->Readout({"t", seq, layer, 0}, {sa.data(), kQ, 1, T}, true, &rb).ok());
    EXPECT_EQ(ra, rb);
    std::vector<uint8_t> ka, va, kb, vb;
    ASSERT_TRUE(plain_->DecodeAs({"t", seq, layer, 0}, {}, DType::kF16, &ka, &va).ok());
    ASSERT_TRUE(backend_->DecodeAs({"t", seq, layer, 0}, {}, DType::kF16, &kb, &vb).ok());
    EXPECT_EQ(ka, kb);
    EXPECT_EQ(va, vb);
  }

  Registry registry_{""};
  SlabBytePool stand_in_{kernels::Pool::kHost, size_t{1} << 20, SlabBytePool::CpuAccess::kByCopy};
  SlabBytePool pinned_stand_in_{kernels::Pool::kHost, size_t{1} << 20};
  BytePool* pool_ = &stand_in_;
  const AttendBackend* backend_of_ = nullptr;
  float tolerance_ = 0.0f;
  std::unique_ptr<Store> plain_, backend_;
  float vmax_ = 0.0f;
};

TEST_P(StoreBackendTest, DecodeStepsAgreeWithTheOrdinaryStore) {
  CodecOptions levers = Registry::DefaultCodec(registry_.Get("m", 1).value()->manifest, true);
  levers.fp16_sinks = 4;
  levers.rotate_keys = true;
  levers.rotate_values = true;
  const int64_t encodes = backend_of_->block_op_calls();
  Append("a", 0, 0, 300, 1);  // 2 groups of 128 and a window of 44
  Append("a", 1, 0, 300, 3);
  Append("b", 0, 0, 200, 5, &levers);
  // Device blocks are encoded where they lie (keys and values per head and append); the pinned
  // pool's are encoded on the CPU, which reads them in place.
  if (GetParam().pinned) {
    EXPECT_EQ(backend_of_->block_op_calls(), encodes);
  } else {
    EXPECT_EQ(backend_of_->block_op_calls(), encodes + 3 * kKv * 2);
  }
  const int64_t calls = backend_of_->calls(), verifies = backend_of_->verify_calls();
  const int64_t copied_before_steps = CopiedBackBytes();
  float worst = 0.0f;
  for (int64_t step = 0; step < 90; ++step) {  // crosses a group boundary: a third block each
    SCOPED_TRACE(step);
    const uint32_t seed = static_cast<uint32_t>(100 + 10 * step);
    Append("a", 0, 300 + step, 1, seed);
    Append("a", 1, 300 + step, 1, seed + 2);
    Append("b", 0, 200 + step, 1, seed + 4);
    AttendOptions ao;  // observing, as a server's decode step
    for (const auto& [seq, layer] : {std::pair{"a", 0}, {"a", 1}, {"b", 0}}) {
      const float e = AttendBoth(seq, layer, 1, ao, seed + 6 + layer);
      EXPECT_LE(e, tolerance_ * vmax_) << seq << " layer " << layer;
      worst = std::max(worst, e);
    }
  }
  printf("attend: worst %.3g of max|v| over the decode steps\n", worst / vmax_);
  // ReadPolicy::verify_checksums checked every attend's blocks on the backend, where they lie: no
  // block was copied back to the host for it.
  EXPECT_EQ(CopiedBackBytes(), copied_before_steps);
  EXPECT_GE(backend_of_->verify_calls(), verifies + 3 * 90);
  // A prefill's queries (each sees the tokens up to its own): on the CPU in both stores.
  AttendOptions prefill;
  prefill.causal_offset = 100;
  const int64_t before = backend_of_->calls();
  EXPECT_EQ(AttendBoth("a", 0, 3, prefill, 7), 0.0f);
  EXPECT_EQ(backend_of_->calls(), before);
  EXPECT_GE(backend_of_->calls(), calls + 3 * 90);
  const int64_t ops = backend_of_->block_op_calls();
  for (int layer : {0, 1}) ExpectSameScoresAndBlocks("a", layer);
  ExpectSameScoresAndBlocks("b", 0);
  EXPECT_EQ(plain_->Scrub(), 0);
  EXPECT_EQ(backend_->Scrub(), 0);
  // Scores, readouts, decodes and the scrub read device blocks where they lie, on the
  // backend's block ops (LayerCache::set_block_ops); the CPU reads pinned memory in place. Either
  // way the whole workload copied no block back (kvq_block_copy_back_bytes_total stays 0).
  EXPECT_EQ(CopiedBackBytes(), copied_before_steps);
  if (GetParam().pinned) {
    EXPECT_EQ(backend_of_->block_op_calls(), ops);
  } else {
    EXPECT_GE(backend_of_->block_op_calls(), ops + 3 * 4 * kKv)
        << "score, readout and the two decodes per head";
  }
  EXPECT_EQ(plain_->TotalUsage().bytes, backend_->TotalUsage().bytes);
  EXPECT_GT(pool_->usage().requested_bytes, 0) << "the blocks live in the store's pool";
}

// Prefix sharing on the GPU store: a second sequence with the same first two groups takes
// them from the index (their headers checked through copies) and attends over the shared
// blocks as the ordinary store does.
TEST_P(StoreBackendTest, SharedPrefixesAttendAsTheOrdinaryStore) {
  std::vector<uint32_t> ids(300);
  for (size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<uint32_t>(7 * i + 1);
  Append("p1", 0, 0, 256, 11, nullptr, std::span<const uint32_t>(ids).first(256));
  Append("p2", 0, 0, 256, 11, nullptr, std::span<const uint32_t>(ids).first(256));
  Append("p2", 0, 256, 44, 13, nullptr, std::span<const uint32_t>(ids).subspan(256));
  EXPECT_GT(backend_->TotalUsage().prefix_blocks, 0);
  EXPECT_EQ(backend_->TotalUsage().prefix_blocks, plain_->TotalUsage().prefix_blocks);
  EXPECT_EQ(backend_->TotalUsage().bytes, plain_->TotalUsage().bytes);
  AttendOptions ao;
  ao.observe = false;
  const int64_t calls = backend_of_->calls();
  EXPECT_LE(AttendBoth("p2", 0, 1, ao, 17), tolerance_ * vmax_);
  EXPECT_LE(AttendBoth("p1", 0, 1, ao, 19), tolerance_ * vmax_);
  EXPECT_EQ(backend_of_->calls(), calls + 2);
  ExpectSameScoresAndBlocks("p2", 0);
}

// A corrupted block of the stand-in store is DATA_LOSS on the backend's attend (its checksum
// checked by the backend before the attend, the message the CPU reader's) and found by a
// scrub, never served.
TEST_P(StoreBackendTest, CorruptionIsFoundBeforeTheAttend) {
  if (GetParam().device) GTEST_SKIP() << "the fault is injected by writing the stand-in's memory";
  Append("a", 0, 0, 300, 1);
  LayerCache* c = backend_->LayerForTest("t", "a", 0);
  ASSERT_NE(c, nullptr);
  c->key_blocks(1)[100] ^= 0x10;  // the stand-in's memory is host memory: fault injection
  const auto q = Normal(static_cast<size_t>(kQ) * kD, 5);
  std::vector<float> out;
  const int64_t calls = HostAttendBackend()->calls();
  const int64_t verifies = HostAttendBackend()->verify_calls();
  const absl::Status st =
      backend_->Attend({"t", "a", 0, 0}, {q.data(), kQ, 1, kD}, AttendOptions{}, &out).status();
  EXPECT_EQ(st.code(), absl::StatusCode::kDataLoss) << st;
  EXPECT_NE(st.message().find("checksum"), std::string::npos) << st;
  EXPECT_EQ(HostAttendBackend()->calls(), calls);
  EXPECT_EQ(HostAttendBackend()->verify_calls(), verifies + 1);
  // Scores and decodes of the stand-in's blocks verify them where they lie first: the same
  // DATA_LOSS (on the pinned stand-in, the CPU's reader finds it), nothing served.
  std::vector<float> scores;
  const absl::Status sst =
      backend_->Score({"t", "a", 0, 0}, {q.data(), kQ, 1, kD}, 0.0f, false, &scores).status();
  EXPECT_EQ(sst.code(), absl::StatusCode::kDataLoss) << sst;
  std::vector<uint8_t> k, v;
  const absl::Status dst = backend_->DecodeAs({"t", "a", 0, 0}, {}, DType::kF16, &k, &v).status();
  EXPECT_EQ(dst.code(), absl::StatusCode::kDataLoss) << dst;
  EXPECT_NE(dst.message().find("checksum"), std::string::npos) << dst;
  EXPECT_EQ(backend_->Scrub(), 1);
}

// A codec the block ops do not read (dense-and-sparse lists) is read through copies of the
// blocks (and encoded on the CPU): the same scores and rows, the copies counted.
TEST_P(StoreBackendTest, ACodecTheBlockOpsDoNotReadIsReadThroughCopies) {
  if (GetParam().device) GTEST_SKIP() << "the stand-in's fallback; the device takes the same";
  CodecOptions sparse = Registry::DefaultCodec(registry_.Get("m", 1).value()->manifest, true);
  sparse.sparse_keys = 2;
  Append("s", 0, 0, 300, 21, &sparse);
  const int64_t copied = CopiedBackBytes(), ops = backend_of_->block_op_calls();
  ExpectSameScoresAndBlocks("s", 0);
  EXPECT_EQ(backend_of_->block_op_calls(), ops);
  if (GetParam().pinned) {
    EXPECT_EQ(CopiedBackBytes(), copied) << "the CPU reads pinned memory in place";
  } else {
    EXPECT_GT(CopiedBackBytes(), copied);
  }
}

INSTANTIATE_TEST_SUITE_P(StandInAndDevice, StoreBackendTest,
                         ::testing::Values(Where{false, false}, Where{false, true},
                                           Where{true, false}, Where{true, true}),
                         [](const ::testing::TestParamInfo<Where>& i) {
                           return std::string(i.param.pinned ? "Pinned" : "") +
                                  (i.param.device ? "OnTheDevice" : "OnTheHostStandIn");
                         });

}  // namespace
}  // namespace kvq::core
