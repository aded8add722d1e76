// LayerCache::Attend on an attend backend (attend_backend.h): the host stand-in of the GPU
// attend, which runs the CUDA kernel's own thread-block programs, against the CPU kernels'
// attend over the same cache on every codec and shape of the CUDA attend's cases, sealed and
// unsealed blocks on a slab pool, more query rows than the kernel takes at once; the reads a
// backend cannot take, corrupted blocks, the A^2 statistics an observing attend records, the
// block ops (encode, score, readout, decode) a store runs there, and the probe that decides
// whether a backend serves.
#include "kvq/core/attend_backend.h"

#include <gtest/gtest.h>

#include <cstdio>

#include "kvq/core/byte_pool.h"
#include "kvq/kernels/device.h"
#include "tests/kernels/cuda_attend_cases.h"

namespace kvq::testing {
namespace {

using core::AttendOptions;
using core::LayerCache;

// cuda_math_test's tolerance: the kernel sums in other orders and folds scales and zero
// points (observed there up to 2.6e-6 of max|v|).
constexpr float kTolerance = 4e-6f;

// A case's layer on a slab pool (as a store's), its rows appended in one go.
struct Layer {
  core::SlabBytePool pool{kernels::Pool::kHost, size_t{1} << 20};
  std::unique_ptr<LayerCache> cache;
  std::vector<float> k, v;
  int64_t T = 0;
  float vmax = 0.0f;
};

std::unique_ptr<Layer> Build(const AttendCase& cs, bool sealing, int extra_window = 0) {
  auto L = std::make_unique<Layer>();
  const core::CodecOptions& o = cs.o;
  const int d = o.head_dim, kv = cs.kv;
  L->T = static_cast<int64_t>(cs.nb) * o.key_group + cs.W + extra_window;
  const core::ModelBasis b =
      core::RandomBasis({"t", 1, 1, kv, kv * cs.gq, d, std::max(o.rank, 1)}, 3);
  L->cache = std::make_unique<LayerCache>(o, kv, o.rank > 0 ? b.u.data() : nullptr, &L->pool);
  L->cache->set_sealing(sealing);
  L->k = Gaussian(kv * L->T * d, 11);
  L->v = Gaussian(kv * L->T * d, 12);
  for (float x : L->v) L->vmax = std::max(L->vmax, std::fabs(x));
  EXPECT_TRUE(L->cache->Append(View3(L->k, kv, L->T, d), View3(L->v, kv, L->T, d), 0).ok());
  return L;
}

// Attend on the scalar reference kernels (the definition of correct), with or without the
// host stand-in for the blocks.
std::vector<float> AttendOn(LayerCache& cache, const std::vector<float>& q, int q_heads, int n_q,
                            AttendOptions ao, const core::AttendBackend* backend,
                            absl::Status* st = nullptr) {
  ao.backend = backend;
  std::vector<float> out(q.size(), std::nanf(""));
  kernels::SetActive(&kernels::Ref());
  const absl::Status s = cache.Attend(q.data(), q_heads, n_q, ao, out.data());
  kernels::SetActive(nullptr);
  if (st) {
    *st = s;
  } else {
    EXPECT_TRUE(s.ok()) << s;
  }
  return out;
}

TEST(AttendBackend, HostStandInMatchesTheCpuAttendOnEveryCase) {
  const core::AttendBackend* host = core::HostAttendBackend();
  for (const AttendCase& cs : AttendCases()) {
    for (bool sealing : {true, false}) {
      for (int n_q : {1, 2}) {  // gq 12 x 2 queries: 24 rows, two chunks of the kernel's 16
        SCOPED_TRACE(::testing::Message()
                     << cs.name << (sealing ? " sealed" : "") << " n_q " << n_q);
        auto L = Build(cs, sealing);
        const int qh = cs.kv * cs.gq;
        const auto q = Gaussian(static_cast<size_t>(qh) * n_q * cs.o.head_dim, 13, 2.0f);
        AttendOptions ao;
        ao.observe = false;
        const auto want = AttendOn(*L->cache, q, qh, n_q, ao, nullptr);
        const int64_t before = host->calls();
        const auto got = AttendOn(*L->cache, q, qh, n_q, ao, host);
        EXPECT_EQ(host->calls(), before + 1) << "the backend did not serve";
        const float worst = WorstError(got, want);
        EXPECT_LE(worst, kTolerance * L->vmax);
        printf("%-40s %s n_q %d: worst %.3g of max|v|\n", cs.name.c_str(),
               sealing ? "sealed  " : "unsealed", n_q, worst / L->vmax);
      }
    }
  }
}

// A causal offset that leaves every encoded token visible to every query (a decode step's
// queries) is the backend's; one inside the blocks (a prefill's) runs on the CPU kernels, with
// the CPU's very bits.
TEST(AttendBackend, CausalOffsetsInsideTheBlocksStayOnTheCpu) {
  const core::AttendBackend* host = core::HostAttendBackend();
  const AttendCase cs = AttendCases()[2];  // legacy d64, 31 blocks, window 5
  auto L = Build(cs, false);
  const int qh = cs.kv * cs.gq, n_q = 3;
  const auto q = Gaussian(static_cast<size_t>(qh) * n_q * cs.o.head_dim, 21, 2.0f);
  AttendOptions ao;
  ao.observe = false;
  ao.causal_offset = L->T - n_q;  // the last three tokens' queries: window only masked
  int64_t before = host->calls();
  auto want = AttendOn(*L->cache, q, qh, n_q, ao, nullptr);
  auto got = AttendOn(*L->cache, q, qh, n_q, ao, host);
  EXPECT_EQ(host->calls(), before + 1);
  EXPECT_LE(WorstError(got, want), kTolerance * L->vmax);

  ao.causal_offset = 40;  // query 0 sees 41 tokens of 31 * 32 encoded
  before = host->calls();
  want = AttendOn(*L->cache, q, qh, n_q, ao, nullptr);
  got = AttendOn(*L->cache, q, qh, n_q, ao, host);
  EXPECT_EQ(host->calls(), before);
  EXPECT_EQ(got, want);
}

// The kernel checks headers, not checksums: with verify_checksums the cache verifies every
// block before the backend runs (DATA_LOSS, the backend never called); without it, a header
// that disagrees with the codec comes back as the kernel's error flag, also DATA_LOSS.
TEST(AttendBackend, CorruptedBlocksAreDataLossNeverData) {
  const core::AttendBackend* host = core::HostAttendBackend();
  AttendCase cs = AttendCases()[2];
  const int qh = cs.kv * cs.gq, d = cs.o.head_dim;
  const auto q = Gaussian(static_cast<size_t>(qh) * d, 23, 2.0f);
  AttendOptions ao;
  ao.observe = false;
  {
    auto L = Build(cs, false);
    L->cache->key_blocks(1)[5 * core::KeyBlockBytes(cs.o) + 100] ^= 0x10;  // a code byte
    const int64_t before = host->calls();
    absl::Status st;
    AttendOn(*L->cache, q, qh, 1, ao, host, &st);
    EXPECT_EQ(st.code(), absl::StatusCode::kDataLoss) << st;
    EXPECT_EQ(host->calls(), before);
  }
  {
    auto L = Build(cs, false);
    L->cache->set_read_policy({.verify_checksums = false});
    L->cache->key_blocks(1)[30 * core::KeyBlockBytes(cs.o) + 4] ^= 0x40;  // bits
    absl::Status st;
    AttendOn(*L->cache, q, qh, 1, ao, host, &st);
    EXPECT_EQ(st.code(), absl::StatusCode::kDataLoss) << st;
    EXPECT_NE(st.message().find("header"), std::string::npos) << st;
  }
}

// An observing attend on the backend records the window's A^2 statistics as the CPU's does:
// two identical layers, one observed through the backend, encode their next group with the
// same per-token widths.
TEST(AttendBackend, ObservingAttendRecordsTheWindowsA2Statistics) {
  const AttendCase cs = AttendCases()[4];  // A^2 values, G 128, 5 blocks, window 3
  const core::CodecOptions& o = cs.o;
  const int d = o.head_dim, kv = cs.kv, qh = kv * cs.gq, G = o.key_group;
  auto a = Build(cs, false, 100), b = Build(cs, false, 100);  // a window of 103 tokens
  for (int step = 0; step < 4; ++step) {
    const auto q = Gaussian(static_cast<size_t>(qh) * d, 30 + step, 3.0f);
    AttendOptions ao;  // observe
    AttendOn(*a->cache, q, qh, 1, ao, nullptr);
    AttendOn(*b->cache, q, qh, 1, ao, core::HostAttendBackend());
  }
  // Fill the group: both encode it with widths from what they observed.
  const int64_t more = G - (a->T - static_cast<int64_t>(cs.nb) * G);
  const auto k = Gaussian(kv * more * d, 41), v = Gaussian(kv * more * d, 42);
  for (auto* L : {a.get(), b.get()})
    ASSERT_TRUE(L->cache->Append(View3(k, kv, more, d), View3(v, kv, more, d), L->T).ok());
  std::vector<float> ka, va, kb, vb;
  ASSERT_TRUE(a->cache->Decode(&ka, &va).ok());
  ASSERT_TRUE(b->cache->Decode(&kb, &vb).ok());
  EXPECT_EQ(ka, kb);
  EXPECT_EQ(va, vb);
  EXPECT_EQ(a->cache->Size().value_block_bytes, b->cache->Size().value_block_bytes);
}

// The CUDA attend never gets pointers into pageable host memory (a device read there faults
// its context): a cache on host memory fails the attend, naming backend and pool.
// The block ops a store puts on its backend when its blocks are in device memory
// (LayerCache::set_block_ops), on the host stand-in of a gpu pool (host slabs the CPU reads
// only by copies): every case's layer encoded there, sealed and unsealed, in one append and
// its last group token by token (A^2 widths from observed weights, a group sealed from the
// window),
// then scored, read out and decoded there, gives the bits of the same layer encoded and read on
// the CPU (both on the reference kernels), and copies no block back.
TEST(AttendBackend, BlockOpsEncodeAndReadEveryCaseAsTheCpu) {
  kernels::SetActive(&kernels::Ref());
  const core::AttendBackend* ops = core::HostAttendBackend();
  for (const AttendCase& cs : AttendCases()) {
    for (const bool sealing : {false, true}) {
      SCOPED_TRACE(cs.name + (sealing ? " sealed" : ""));
      const core::CodecOptions& o = cs.o;
      const int d = o.head_dim, kv = cs.kv, qh = kv * cs.gq;
      const int64_t T = static_cast<int64_t>(cs.nb) * o.key_group + cs.W;
      const core::ModelBasis b = core::RandomBasis({"t", 1, 1, kv, qh, d, std::max(o.rank, 1)}, 3);
      core::SlabBytePool by_copy(kernels::Pool::kHost, size_t{1} << 20,
                                 core::SlabBytePool::CpuAccess::kByCopy);
      LayerCache cpu(o, kv, o.rank > 0 ? b.u.data() : nullptr);
      LayerCache dev(o, kv, o.rank > 0 ? b.u.data() : nullptr, &by_copy);
      dev.set_block_ops(ops);
      const auto k = Gaussian(kv * T * d, 11), v = Gaussian(kv * T * d, 12);
      const auto q = Gaussian(static_cast<size_t>(qh) * d, 13);
      const int64_t ops_before = ops->block_op_calls(), copied = core::CopiedBackBytes();
      // All but the last group and two tokens in one append, those token by token with an
      // observing attend every 8 (its weights choose A^2 widths when that group is encoded).
      const int64_t half = std::max<int64_t>(0, T - o.key_group - 2);
      // Tokens [t0, t1) of every head: a view into [kv][T][d].
      auto tokens = [&](const std::vector<float>& x, int64_t t0, int64_t t1) {
        core::TensorView view = View3(x, kv, T, d);
        view.data = x.data() + t0 * d;
        view.shape[1] = t1 - t0;
        return view;
      };
      for (LayerCache* c : {&cpu, &dev}) {
        c->set_sealing(sealing);
        ASSERT_TRUE(c->Append(tokens(k, 0, half), tokens(v, 0, half), 0).ok());
        for (int64_t t = half; t < T; ++t) {
          ASSERT_TRUE(c->Append(tokens(k, t, t + 1), tokens(v, t, t + 1), t).ok());
          if (t % 8 != 0) continue;
          std::vector<float> out(q.size());
          ASSERT_TRUE(c->Attend(q.data(), qh, 1, AttendOptions{}, out.data()).ok());
        }
      }
      if (cs.nb > 0) {
        EXPECT_GT(ops->block_op_calls(), ops_before) << "the stand-in encoded the groups";
      }
      std::vector<float> sa(static_cast<size_t>(qh) * T), sb(sa.size());
      ASSERT_TRUE(cpu.Score(q.data(), qh, 1, sa.data()).ok());
      ASSERT_TRUE(dev.Score(q.data(), qh, 1, sb.data()).ok());
      EXPECT_EQ(sa, sb);
      std::vector<float> ra(static_cast<size_t>(qh) * d), rb(ra.size());
      ASSERT_TRUE(cpu.Readout(sa.data(), qh, 1, ra.data()).ok());
      ASSERT_TRUE(dev.Readout(sa.data(), qh, 1, rb.data()).ok());
      EXPECT_EQ(ra, rb);
      std::vector<float> ka, va, kb, vb;
      ASSERT_TRUE(cpu.Decode(&ka, &va).ok());
      ASSERT_TRUE(dev.Decode(&kb, &vb).ok());
      EXPECT_EQ(ka, kb);
      EXPECT_EQ(va, vb);
      EXPECT_EQ(cpu.Size().key_block_bytes, dev.Size().key_block_bytes);
      EXPECT_EQ(cpu.Size().value_block_bytes, dev.Size().value_block_bytes);
      EXPECT_EQ(core::CopiedBackBytes(), copied) << "nothing read through copies";
    }
  }
  kernels::SetActive(nullptr);
}

// A device that refuses an encode fails the append with its reason and keeps no block of it.
TEST(AttendBackend, AnEncodeTheDeviceRefusesFailsTheAppend) {
  class Refusing final : public core::HostStandInBackend {
   protected:
    int RunEncodeValues(const kernels::cuda::EncodeValueParams&) const override { return 700; }
  } refusing;
  const AttendCase cs = AttendCases()[1];
  const int d = cs.o.head_dim, kv = cs.kv;
  const int64_t T = cs.o.key_group;
  const core::ModelBasis b = core::RandomBasis({"t", 1, 1, kv, kv * cs.gq, d, cs.o.rank}, 3);
  core::SlabBytePool by_copy(kernels::Pool::kHost, size_t{1} << 20,
                             core::SlabBytePool::CpuAccess::kByCopy);
  LayerCache c(cs.o, kv, b.u.data(), &by_copy);
  c.set_block_ops(&refusing);
  const auto k = Gaussian(kv * T * d, 11), v = Gaussian(kv * T * d, 12);
  const absl::Status st = c.Append(View3(k, kv, T, d), View3(v, kv, T, d), 0);
  EXPECT_EQ(st.code(), absl::StatusCode::kInternal) << st;
  EXPECT_EQ(st.message(), "attend backend 'cuda-host': encode values error 700");
  for (int h = 0; h < kv; ++h) {
    EXPECT_EQ(c.key_blocks(h).size(), 0u);
    EXPECT_EQ(c.value_blocks(h).size(), 0u);
  }
}

TEST(AttendBackend, ABackendIsNeverHandedMemoryItCannotRead) {
  const PreparedAttend pa = Prepare(AttendCases()[2]);  // its cache is on host memory
  ASSERT_FALSE(pa.want.empty());
  AttendOptions ao;
  ao.observe = false;
  absl::Status st;
  AttendOn(*pa.cache, pa.q, pa.cs.kv * pa.cs.gq, 1, ao, core::CudaAttendBackend(), &st);
  EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition) << st;
  EXPECT_EQ(st.message(), "attend backend 'cuda' cannot read blocks in memory pool 'host'");
  EXPECT_FALSE(core::HostAttendBackend()->CanRead(kernels::Pool::kGpu));
  EXPECT_TRUE(core::CudaAttendBackend()->CanRead(kernels::Pool::kPinned));
}

TEST(AttendBackend, ProbeAnswersForTheHostStandInAndSaysWhyNotForAnAbsentDevice) {
  core::SlabBytePool pool(kernels::Pool::kHost, size_t{1} << 20);
  const core::AttendBackend* host = core::HostAttendBackend();
  EXPECT_EQ(std::string(host->name()), "cuda-host");
  EXPECT_TRUE(core::ProbeAttendBackend(*host, &pool).ok());
  if (kernels::CudaAvailable()) GTEST_SKIP() << "a CUDA device answers here";
  // Without a device the CUDA attend is UNAVAILABLE before it reads anything.
  const PreparedAttend pa = Prepare(AttendCases()[2]);
  std::vector<const uint8_t*> kp(pa.key_at.size()), vp(pa.value_at.size());
  for (size_t i = 0; i < kp.size(); ++i) {
    kp[i] = pa.pool.data() + pa.key_at[i];
    vp[i] = pa.pool.data() + pa.value_at[i];
  }
  std::vector<float> out(pa.q.size()), mx(pa.cs.kv * pa.cs.gq), sum(mx.size());
  const kernels::cuda::AttendParams p = ParamsFor(pa, kp.data(), vp.data(), pa.q_base.data(),
                                                  pa.uq.data(), out.data(), mx.data(), sum.data());
  const absl::Status st = core::CudaAttendBackend()->AttendBlocks(p);
  EXPECT_EQ(st.code(), absl::StatusCode::kUnavailable) << st;
  EXPECT_EQ(st.message(), "attend backend 'cuda': no CUDA device");
}

}  // namespace
}  // namespace kvq::testing
