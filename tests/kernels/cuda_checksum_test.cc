// The GPU's checksum code (kernels/cuda/xxh3_math.h) on the CPU: its XXH3-64 against
// libxxhash for every short length and the boundaries of the long path, at odd addresses and
// several seeds; its block checksum against the one core writes into real blocks of every
// version; and the batched verify op's host run (VerifyBlocksOnHost, the same per-thread
// program the kernel runs) against core's own verification of good and corrupted blocks.
// cuda_parity_test runs the kernel itself on a device against VerifyBlocksOnHost.
#include "kvq/kernels/cuda_checksum.h"

#include <gtest/gtest.h>
#include <xxhash.h>

#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "kernels/cuda/xxh3_math.h"
#include "tests/kernels/cuda_checksum_cases.h"

namespace kvq::testing {
namespace {

namespace xm = kernels::cuda::xxh3_math;
using kernels::cuda::kVerifyBadHeader;
using kernels::cuda::kVerifyChecksum;
using kernels::cuda::kVerifyOk;
using kernels::cuda::VerifyParams;

std::vector<uint8_t> RandomBytes(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<uint8_t> v(n);
  for (auto& b : v) b = static_cast<uint8_t>(rng());
  return v;
}

TEST(Xxh3Math, MatchesLibxxhashAtEveryLengthSeedAndAlignment) {
  std::vector<uint64_t> lengths;
  for (uint64_t n = 0; n <= 2100; ++n) lengths.push_back(n);
  for (uint64_t n : {4095, 4096, 4097, 16383, 16384, 16385}) lengths.push_back(n);
  std::mt19937_64 rng(7);
  const std::vector<uint64_t> seeds = {0, rng(), rng(), rng(), 1, ~0ull};
  const std::vector<uint8_t> bytes = RandomBytes(16385 + 8, 11);
  ASSERT_EQ(reinterpret_cast<uintptr_t>(bytes.data()) % 8, 0u);  // so offsets 1, 3 are odd
  int compared = 0;
  for (uint64_t seed : seeds)
    for (size_t offset : {1, 3, 8})  // odd addresses, and one 8-byte aligned
      for (uint64_t n : lengths) {
        const uint8_t* p = bytes.data() + offset;
        ASSERT_EQ(xm::Hash64(p, n, seed), XXH3_64bits_withSeed(p, n, seed))
            << "length " << n << " seed " << seed << " offset " << offset;
        ++compared;
      }
  EXPECT_EQ(compared, 6 * 3 * 2107);
}

TEST(Xxh3Math, BlockChecksumIsTheOneCoreWrites) {
  const std::vector<ChecksumCase> blocks = CoreBlocks();
  int versions[4] = {};
  for (const ChecksumCase& b : blocks) {
    SCOPED_TRACE(b.name);
    ASSERT_TRUE(CoreAccepts(b));
    ASSERT_GE(b.bytes[2], 2);
    ASSERT_LE(b.bytes[2], 3);
    ++versions[b.bytes[2]];
    PackedBlocks packed = Pack({b});  // at an odd address
    uint8_t* at = packed.bytes.data() + packed.offsets[0];
    uint32_t stored;
    std::memcpy(&stored, b.bytes.data() + 12, 4);
    EXPECT_EQ(xm::BlockChecksum(at, b.bytes.size()), stored);
    // WriteBlockChecksum over a zeroed checksum gives core's bytes back.
    std::memset(at + 12, 0, 4);
    xm::WriteBlockChecksum(at, b.bytes.size());
    EXPECT_EQ(std::vector<uint8_t>(at, at + b.bytes.size()), b.bytes);
  }
  EXPECT_EQ(versions[1], 0);
  EXPECT_GT(versions[2], 0);
  EXPECT_EQ(versions[3], 2);  // the rotated codec's key and value blocks
}

// Runs the batched op on the host over the packed blocks; pointer `null_at` is null.
std::vector<uint8_t> VerifyOnHost(const PackedBlocks& packed, size_t null_at = ~size_t{0}) {
  const size_t n = packed.sizes.size();
  std::vector<const uint8_t*> ptrs(n);
  for (size_t i = 0; i < n; ++i)
    ptrs[i] = i == null_at ? nullptr : packed.bytes.data() + packed.offsets[i];
  std::vector<uint8_t> verdicts(n, 0xEE);
  VerifyParams p{static_cast<int>(n), ptrs.data(), packed.sizes.data(), verdicts.data()};
  EXPECT_EQ(kernels::cuda::VerifyBlocksOnHost(p), 0);
  return verdicts;
}

TEST(VerifyBlocksOnHost, PassesGoodBlocksAndFlagsEachCorruption) {
  const std::vector<ChecksumCase> cases = VerifyCases();
  ASSERT_GT(cases.size(), static_cast<size_t>(xm::kVerifyThreads));
  const std::vector<uint8_t> got = VerifyOnHost(Pack(cases));
  ASSERT_EQ(got.size(), cases.size());
  for (size_t i = 0; i < got.size(); ++i) {
    SCOPED_TRACE(cases[i].name);
    EXPECT_EQ(static_cast<int>(got[i]), static_cast<int>(cases[i].verdict));
    EXPECT_EQ(CoreAccepts(cases[i]), cases[i].verdict == kVerifyOk);
  }
}

TEST(VerifyBlocksOnHost, NotABlockIsABadHeader) {
  const ChecksumCase good = CoreBlocks()[0];
  ChecksumCase truncated = good, version0 = good, version1 = good, empty = good;
  truncated.bytes.resize(15);
  version0.bytes[2] = 0;
  version1.bytes[2] = 1;  // no longer read, whatever its checksum
  empty.bytes.clear();
  const std::vector<uint8_t> got =
      VerifyOnHost(Pack({good, truncated, version0, version1, empty, good}), 5);
  EXPECT_EQ(got, (std::vector<uint8_t>{kVerifyOk, kVerifyBadHeader, kVerifyBadHeader,
                                       kVerifyBadHeader, kVerifyBadHeader, kVerifyBadHeader}));
}

TEST(VerifyBlocksOnHost, RefusesParamsItCannotRun) {
  std::vector<uint8_t> verdicts(1, 0xEE);
  const uint64_t size = 16;
  VerifyParams p{1, nullptr, &size, verdicts.data()};
  EXPECT_EQ(kernels::cuda::VerifyBlocksOnHost(p), 1);
  p.blocks = -1;
  EXPECT_EQ(kernels::cuda::VerifyBlocksOnHost(p), 1);
  EXPECT_EQ(verdicts[0], 0xEE);
  p = VerifyParams{};  // no blocks: nothing to read, nothing written
  EXPECT_EQ(kernels::cuda::VerifyBlocksOnHost(p), 0);
}

}  // namespace
}  // namespace kvq::testing
