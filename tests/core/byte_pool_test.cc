// The block memory pools: SlabBytePool hands out disjoint, aligned, reusable chunks with
// exact accounting from many threads; a LayerCache on a pool puts every block byte there
// (and nothing in host memory) and reads exactly as on host memory; a pool whose driver
// refuses falls back to host memory and says so; the gpu and pinned pools exist only where a
// device answers. Bytes on a pool the CPU reaches only by copies (device memory, or the host
// stand-in of it) keep their contents through growth, copies and moves, and a cache on such a
// pool reads exactly as on host memory, every block through CpuView.
//
// The slab pool is tested here on host slabs (the pinned and gpu pools are the same code over
// cudaHostAlloc and cudaMalloc slabs, which need a CUDA device: scripts/device-check.sh runs
// this test there).
#include "kvq/core/byte_pool.h"

#include <algorithm>
#include <cstring>
#include <random>
#include <thread>

#include "gtest/gtest.h"
#include "kvq/core/cache.h"
#include "kvq/kernels/device.h"
#include "test_util.h"

namespace kvq::core {
namespace {

// Two caches holding the same tokens attend 3 queries per head and decode alike, bit for bit.
void ExpectSameAttendAndDecode(LayerCache& x, LayerCache& y, const std::vector<float>& q,
                               int q_heads, int d) {
  std::vector<float> a(static_cast<size_t>(q_heads) * 3 * d), b(a.size());
  AttendOptions ao;
  ao.observe = false;
  ASSERT_TRUE(x.Attend(q.data(), q_heads, 3, ao, a.data()).ok());
  ASSERT_TRUE(y.Attend(q.data(), q_heads, 3, ao, b.data()).ok());
  EXPECT_EQ(a, b);
  std::vector<float> ka, va, kb, vb;
  ASSERT_TRUE(x.Decode(&ka, &va).ok());
  ASSERT_TRUE(y.Decode(&kb, &vb).ok());
  EXPECT_EQ(ka, kb);
  EXPECT_EQ(va, vb);
}

using kernels::Pool;

TEST(SlabBytePool, DisjointAlignedReusedAndCountedFromManyThreads) {
  constexpr size_t kSlab = size_t{1} << 20;  // small slabs: many are needed, leftovers carved
  SlabBytePool pool(Pool::kHost, kSlab);
  std::vector<std::thread> threads;
  std::atomic<int> bad{0};
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937 rng(t);
      std::vector<std::pair<uint8_t*, size_t>> live;
      for (int i = 0; i < 3000; ++i) {
        if (!live.empty() && rng() % 3 == 0) {  // free a random live chunk after checking it
          const size_t j = rng() % live.size();
          auto [p, n] = live[j];
          const uint8_t tag = static_cast<uint8_t>(reinterpret_cast<uintptr_t>(p) >> 6);
          if (std::any_of(p, p + n, [&](uint8_t b) { return b != tag; })) ++bad;
          pool.Free(p, n);
          live[j] = live.back();
          live.pop_back();
          continue;
        }
        // Mostly block-sized requests, some beyond a size class (dedicated allocations).
        const size_t n = rng() % 10 == 0 ? kSlab / 8 + 1 + rng() % kSlab : 1 + rng() % 20000;
        auto* p = static_cast<uint8_t*>(pool.Allocate(n));
        if (n <= kSlab / 8 && reinterpret_cast<uintptr_t>(p) % SlabBytePool::kMinChunk != 0) ++bad;
        std::memset(p, static_cast<uint8_t>(reinterpret_cast<uintptr_t>(p) >> 6), n);
        live.emplace_back(p, n);
      }
      for (auto [p, n] : live) {
        const uint8_t tag = static_cast<uint8_t>(reinterpret_cast<uintptr_t>(p) >> 6);
        if (std::any_of(p, p + n, [&](uint8_t b) { return b != tag; })) ++bad;
        pool.Free(p, n);
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(bad.load(), 0) << "overlapping or misaligned chunks";
  BytePool::Usage u = pool.usage();
  EXPECT_EQ(u.requested_bytes, 0);
  EXPECT_EQ(u.held_bytes, 0);
  EXPECT_EQ(u.fallback_bytes, 0);
  EXPECT_GT(u.reserved_bytes, 0);
  EXPECT_EQ(u.reserved_bytes % kSlab, 0) << "dedicated allocations must be returned";

  // Freed chunks are reused: the same requests again take no new slab (chunks are not
  // merged, so only requests of a size class seen before are served from its list).
  std::vector<void*> again;
  for (int i = 0; i < 200; ++i) again.push_back(pool.Allocate(1000));
  for (void* p : again) pool.Free(p, 1000);
  const int64_t reserved = pool.usage().reserved_bytes;
  again.clear();
  for (int i = 0; i < 200; ++i) again.push_back(pool.Allocate(1000));
  EXPECT_EQ(pool.usage().reserved_bytes, reserved);
  EXPECT_EQ(pool.usage().requested_bytes, 200 * 1000);
  EXPECT_EQ(pool.usage().held_bytes, 200 * 1024);
  for (void* p : again) pool.Free(p, 1000);
}

// Memory freed in one size class serves requests of a smaller class (split) before the
// pool asks the driver for another slab.
TEST(SlabBytePool, FreedLargeChunksServeSmallerRequestsBeforeANewSlab) {
  SlabBytePool pool(Pool::kHost, size_t{1} << 20);
  std::vector<void*> big;
  for (int i = 0; i < 24; ++i) big.push_back(pool.Allocate(size_t{64} << 10));
  for (void* p : big) pool.Free(p, size_t{64} << 10);
  const int64_t reserved = pool.usage().reserved_bytes;
  ASSERT_GE(reserved, int64_t{24} << 16);
  std::vector<std::pair<void*, size_t>> small;
  for (int i = 0; i < 300; ++i) {  // 300 x ~4 KiB: well under the 1.5 MiB freed
    const size_t n = 3000 + 97 * (i % 11);
    small.emplace_back(pool.Allocate(n), n);
    std::memset(small.back().first, i & 0xff, n);
  }
  EXPECT_EQ(pool.usage().reserved_bytes, reserved) << "a new slab while freed memory sufficed";
  for (int i = 0; i < 300; ++i) {
    auto* p = static_cast<uint8_t*>(small[i].first);
    EXPECT_TRUE(std::all_of(p, p + small[i].second, [&](uint8_t b) { return b == (i & 0xff); }))
        << "chunk " << i << " overlaps another";
    pool.Free(small[i].first, small[i].second);
  }
  EXPECT_EQ(pool.usage().held_bytes, 0);
}

#if defined(__SANITIZE_ADDRESS__)
// Under AddressSanitizer a freed chunk, and bytes past a chunk's readable end (the request
// rounded up to 16 bytes, BytePool::Allocate), are poisoned: the slab pool hides no
// use-after-free that operator new memory would show.
TEST(SlabBytePoolDeathTest, AsanSeesUseAfterFreeAndOverflowInSlabs) {
  SlabBytePool pool(Pool::kHost, size_t{1} << 20);
  auto* p = static_cast<volatile uint8_t*>(pool.Allocate(100));
  p[99] = 1;
  (void)p[111];  // within the 16-byte word the GPU attend may read
  EXPECT_DEATH(p[112] = 1, "use-after-poison");
  pool.Free(const_cast<uint8_t*>(p), 100);
  EXPECT_DEATH((void)p[0], "use-after-poison");
}
#endif

// A pool whose memory cannot be had here (pinned without a CUDA driver) still serves every
// request, from host memory, and reports the fallback bytes.
TEST(SlabBytePool, FallsBackToHostMemoryWhenThePoolRefuses) {
  if (kernels::CudaAvailable()) GTEST_SKIP() << "pinned memory works here: nothing refuses";
  SlabBytePool pool(Pool::kPinned, size_t{1} << 20);
  EXPECT_EQ(pool.Probe().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(pool.Probe().message().find("pinned"), std::string::npos) << pool.Probe();
  void* a = pool.Allocate(100);
  void* b = pool.Allocate(size_t{1} << 20);
  std::memset(a, 1, 100);
  std::memset(b, 2, size_t{1} << 20);
  EXPECT_EQ(pool.usage().fallback_bytes, 100 + (int64_t{1} << 20));
  EXPECT_EQ(pool.usage().reserved_bytes, 0);
  pool.Free(a, 100);
  pool.Free(b, size_t{1} << 20);
  EXPECT_EQ(pool.usage().fallback_bytes, 0);
  EXPECT_EQ(pool.usage().requested_bytes, 0);
}

TEST(SharedBytePool, HostAlwaysGpuAndPinnedOnlyWithADevice) {
  absl::StatusOr<BytePool*> host = SharedBytePool(Pool::kHost);
  ASSERT_TRUE(host.ok());
  EXPECT_EQ(*host, HostBytePool());
  EXPECT_TRUE(HostBytePool()->cpu_readable());
  absl::StatusOr<BytePool*> gpu = SharedBytePool(Pool::kGpu);
  EXPECT_EQ(gpu.ok(), kernels::CudaAvailable()) << gpu.status();
  if (gpu.ok()) {
    EXPECT_EQ((*gpu)->pool(), Pool::kGpu);
    EXPECT_FALSE((*gpu)->cpu_readable());
  } else {
    EXPECT_EQ(gpu.status().code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_NE(gpu.status().message().find("'gpu'"), std::string::npos) << gpu.status();
  }
  absl::StatusOr<BytePool*> pinned = SharedBytePool(Pool::kPinned);
  EXPECT_EQ(pinned.ok(), kernels::CudaAvailable()) << pinned.status();
  if (pinned.ok()) {
    EXPECT_EQ((*pinned)->pool(), Pool::kPinned);
    EXPECT_EQ(*SharedBytePool(Pool::kPinned), *pinned) << "one pool per process";
  }
}

// Every block byte of a cache on a pool lives in that pool: while the cache grows, host
// memory holds none of its blocks, and reads equal those of a host-memory cache bit for bit.
TEST(SlabBytePool, LayerCacheBlocksLiveInThePoolAndReadTheSame) {
  const int kv = 2, d = 64, q_heads = 4;
  const int64_t T = 300;
  CodecOptions o;
  o.head_dim = d;
  o.rank = 4;
  o.window = 16;
  o.value_policy = ValuePolicy::kA2;
  const auto basis = testing::Gaussian(kv * d * 4, 5, 0.125f);
  const auto k = testing::Gaussian(kv * T * d, 1), v = testing::Gaussian(kv * T * d, 2);
  const auto q = testing::Gaussian(q_heads * 3 * d, 3);
  // The cache on a slab pool: a real pinned pool where a driver answers, host slabs here.
  SlabBytePool slabs(kernels::CudaAvailable() ? Pool::kPinned : Pool::kHost);
  auto fill = [&](LayerCache* c) {
    for (int64_t at = 0; at < T;) {  // uneven appends: many vector growths
      const int64_t n = std::min<int64_t>(T - at, 1 + (at * 7) % 45);
      TensorView kt = TensorView::Contiguous(k.data() + at * d, DType::kF32, {kv, n, d});
      TensorView vt = TensorView::Contiguous(v.data() + at * d, DType::kF32, {kv, n, d});
      kt.stride[0] = vt.stride[0] = T * d;
      ASSERT_TRUE(c->Append(kt, vt, at).ok());
      at += n;
    }
  };
  for (bool sealing : {false, true}) {
    LayerCache on_host(o, kv, basis.data());
    on_host.set_sealing(sealing);
    fill(&on_host);
    ASSERT_GT(HostBytePool()->usage().requested_bytes, 0) << "host caches draw on the host pool";
    const int64_t host_before = HostBytePool()->usage().requested_bytes;
    {
      LayerCache in_pool(o, kv, basis.data(), &slabs);
      in_pool.set_sealing(sealing);
      fill(&in_pool);
      EXPECT_EQ(in_pool.sealed().empty(), !sealing);
      const SizeReport s = in_pool.Size();
      ASSERT_GT(s.key_block_bytes, 0);
      EXPECT_GE(slabs.usage().requested_bytes, s.key_block_bytes + s.value_block_bytes);
      EXPECT_EQ(slabs.usage().fallback_bytes, 0);
      EXPECT_EQ(HostBytePool()->usage().requested_bytes, host_before)
          << "a block byte of the pooled cache went to host memory";
      EXPECT_EQ(in_pool.byte_pool(), &slabs);
      for (int h = 0; h < kv; ++h) {
        EXPECT_EQ(std::vector<uint8_t>(in_pool.key_blocks(h).begin(), in_pool.key_blocks(h).end()),
                  std::vector<uint8_t>(on_host.key_blocks(h).begin(), on_host.key_blocks(h).end()));
        EXPECT_EQ(
            std::vector<uint8_t>(in_pool.value_blocks(h).begin(), in_pool.value_blocks(h).end()),
            std::vector<uint8_t>(on_host.value_blocks(h).begin(), on_host.value_blocks(h).end()));
      }
      ExpectSameAttendAndDecode(in_pool, on_host, q, q_heads, d);
    }
    EXPECT_EQ(slabs.usage().requested_bytes, 0) << "a destroyed cache returns every byte";
  }
}

// The CPU's view of bytes in a pool it reaches only by copies.
std::vector<uint8_t> Contents(const Bytes& b) {
  std::vector<uint8_t> scratch;
  absl::StatusOr<std::span<const uint8_t>> v = CpuView(*b.pool(), {b.data(), b.size()}, &scratch);
  EXPECT_TRUE(v.ok()) << v.status();
  return v.ok() ? std::vector<uint8_t>(v->begin(), v->end()) : std::vector<uint8_t>{};
}

TEST(Bytes, KeepTheirContentsThroughGrowthCopiesAndMovesOnEveryKindOfPool) {
  SlabBytePool direct(Pool::kHost, size_t{1} << 20);
  SlabBytePool by_copy(Pool::kHost, size_t{1} << 20, SlabBytePool::CpuAccess::kByCopy);
  EXPECT_TRUE(direct.cpu_readable());
  EXPECT_FALSE(by_copy.cpu_readable());
  for (BytePool* pool :
       {HostBytePool(), static_cast<BytePool*>(&direct), static_cast<BytePool*>(&by_copy)}) {
    std::vector<uint8_t> want;
    Bytes b(pool);
    std::mt19937 rng(3);
    for (int i = 0; i < 40; ++i) {  // appends of odd sizes: many growths
      std::vector<uint8_t> chunk(1 + rng() % 300);
      for (auto& x : chunk) x = static_cast<uint8_t>(rng());
      ASSERT_TRUE(b.Append(chunk.data(), chunk.size()).ok());
      want.insert(want.end(), chunk.begin(), chunk.end());
      ASSERT_EQ(Contents(b), want);
    }
    b.resize(want.size() - 7);  // shrink, then grow by zeros
    want.resize(want.size() - 7);
    b.resize(want.size() + 5);
    want.resize(want.size() + 5, 0);
    EXPECT_EQ(Contents(b), want);
    const Bytes copy(b);
    EXPECT_EQ(copy.pool(), pool);
    EXPECT_EQ(Contents(copy), want);
    Bytes moved(std::move(b));
    EXPECT_EQ(Contents(moved), want);
    moved.assign(9, 0xAB);
    EXPECT_EQ(Contents(moved), std::vector<uint8_t>(9, 0xAB));
  }
  EXPECT_EQ(direct.usage().requested_bytes, 0);
  EXPECT_EQ(by_copy.usage().requested_bytes, 0);
}

// A cache on the host stand-in of device memory (a slab pool the CPU reads only by copies)
// serves every read as a host-memory cache does, bit for bit, through CpuView's copies.
TEST(Bytes, ACacheOnAPoolReadByCopiesReadsAsOnHostMemory) {
  const int kv = 2, d = 64, q_heads = 4;
  const int64_t T = 300;
  CodecOptions o;
  o.head_dim = d;
  o.rank = 4;
  o.window = 16;
  o.fp16_sinks = 2;
  const auto basis = testing::Gaussian(kv * d * 4, 5, 0.125f);
  const auto k = testing::Gaussian(kv * T * d, 1), v = testing::Gaussian(kv * T * d, 2);
  const auto q = testing::Gaussian(q_heads * 3 * d, 3);
  SlabBytePool by_copy(Pool::kHost, size_t{1} << 20, SlabBytePool::CpuAccess::kByCopy);
  for (bool sealing : {false, true}) {
    SCOPED_TRACE(sealing);
    LayerCache on_host(o, kv, basis.data()), far(o, kv, basis.data(), &by_copy);
    for (LayerCache* c : {&on_host, &far}) {
      c->set_sealing(sealing);
      for (int64_t at = 0; at < T;) {
        const int64_t n = std::min<int64_t>(T - at, 1 + (at * 7) % 45);
        TensorView kt = TensorView::Contiguous(k.data() + at * d, DType::kF32, {kv, n, d});
        TensorView vt = TensorView::Contiguous(v.data() + at * d, DType::kF32, {kv, n, d});
        kt.stride[0] = vt.stride[0] = T * d;
        ASSERT_TRUE(c->Append(kt, vt, at).ok());
        at += n;
      }
    }
    const int64_t copied = CopiedBackBytes();
    const int64_t nt = far.tokens();
    std::vector<float> sa(q_heads * 3 * nt), sb(sa.size());
    ASSERT_TRUE(far.Score(q.data(), q_heads, 3, sa.data()).ok());
    ASSERT_TRUE(on_host.Score(q.data(), q_heads, 3, sb.data()).ok());
    EXPECT_EQ(sa, sb);
    std::vector<float> a(q_heads * 3 * d), b(a.size());
    ASSERT_TRUE(far.Readout(sa.data(), q_heads, 3, a.data()).ok());
    ASSERT_TRUE(on_host.Readout(sb.data(), q_heads, 3, b.data()).ok());
    EXPECT_EQ(a, b);
    ExpectSameAttendAndDecode(far, on_host, q, q_heads, d);
    EXPECT_TRUE(far.VerifyAll().ok());
    const SizeReport s = far.Size();
    EXPECT_GE(CopiedBackBytes() - copied, 4 * (s.key_block_bytes + s.value_block_bytes))
        << "the reads did not copy the blocks back";
    EXPECT_EQ(s.key_block_bytes, on_host.Size().key_block_bytes);
  }
}

}  // namespace
}  // namespace kvq::core
