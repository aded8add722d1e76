// The blocks of the GPU checksum op's tests (cuda_checksum_test on the CPU, cuda_parity_test on
// a device): real blocks encoded by core in every version, each also corrupted in the ways a
// verification must catch, with the verdict VerifyBlocks must give and core's own reading.
#pragma once

#include <gtest/gtest.h>
#include <xxhash.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/xxh3_math.h"
#include "kvq/core/basis.h"
#include "kvq/core/codec.h"
#include "kvq/kernels/cuda_checksum.h"
#include "tests/core/test_util.h"

namespace kvq::testing {

// A block, the codec that reads it, the verdict it must get and its name in failure messages.
struct ChecksumCase {
  std::string name;
  core::CodecOptions o;
  bool key = true;
  std::vector<uint8_t> bytes;
  uint8_t verdict = kernels::cuda::kVerifyOk;
};

inline core::CodecOptions ChecksumCodec(int d, int G, int rank, int value_bits) {
  core::CodecOptions o;
  o.head_dim = d;
  o.key_group = G;
  o.key_bits = 3;
  o.rank = rank;
  o.side_bits = 4;
  o.value_bits = value_bits;
  o.value_group = 32;
  return o;
}

// Key and value blocks encoded by core: rank 0, 4 and 8, G 32, 64 and 128, uniform and A^2
// per-token value widths, rotations (version 3).
inline std::vector<ChecksumCase> CoreBlocks() {
  std::vector<core::CodecOptions> codecs = {
      ChecksumCodec(64, 32, 0, 2), ChecksumCodec(64, 128, 4, 2), ChecksumCodec(128, 32, 4, 4),
      ChecksumCodec(96, 64, 8, 1)};
  core::CodecOptions a2 = ChecksumCodec(64, 128, 4, 2);
  a2.value_policy = core::ValuePolicy::kA2;
  codecs.push_back(a2);
  core::CodecOptions rotated = ChecksumCodec(128, 128, 4, 3);
  rotated.rotate_keys = rotated.rotate_values = true;
  codecs.push_back(rotated);

  std::vector<ChecksumCase> blocks;
  uint32_t seed = 1;
  for (const core::CodecOptions& o : codecs) {
    const int G = o.key_group, d = o.head_dim;
    const auto keys = Gaussian(static_cast<size_t>(G) * d, ++seed);
    const auto values = Gaussian(static_cast<size_t>(G) * d, ++seed);
    const core::ModelBasis basis =
        core::RandomBasis({"t", 1, 1, 1, 1, d, std::max(o.rank, 1)}, ++seed);
    ChecksumCase k{absl::StrCat("key ", o.ToString()), o, true, {}};
    EXPECT_TRUE(
        core::EncodeKeyBlock(o, keys.data(), d, o.rank > 0 ? basis.u.data() : nullptr, &k.bytes)
            .ok());
    ChecksumCase v{absl::StrCat("value ", o.ToString()), o, false, {}};
    std::vector<uint8_t> widths(G);
    for (int t = 0; t < G; ++t) widths[t] = static_cast<uint8_t>(1 + (t * 7 + 3) % 4);
    EXPECT_TRUE(core::EncodeValueBlock(o, values.data(), d,
                                       o.per_token_value_bits() ? widths.data() : nullptr, &v.bytes)
                    .ok());
    blocks.push_back(std::move(k));
    blocks.push_back(std::move(v));
  }
  return blocks;
}

// Whether core accepts the block, checksum verified: the reference for every verdict.
inline bool CoreAccepts(const ChecksumCase& b) {
  return b.key ? core::ParseKeyBlock(b.bytes, b.o, true).ok()
               : core::ParseValueBlock(b.bytes, b.o, true).ok();
}

// CoreBlocks, each followed by six corruptions of it (a payload bit, the last byte, a header
// field, the stored checksum: kVerifyChecksum; the magic, the version: kVerifyBadHeader), then
// repeated until there are more than one thread block (kVerifyThreads) of them.
inline std::vector<ChecksumCase> VerifyCases() {
  namespace cu = kernels::cuda;
  std::vector<ChecksumCase> cases;
  std::mt19937 rng(5);
  for (const ChecksumCase& b : CoreBlocks()) {
    cases.push_back(b);
    auto corrupt = [&](const std::string& what, size_t at, uint8_t mask, uint8_t verdict) {
      ChecksumCase c = b;
      c.name = absl::StrCat(b.name, " ", what, " (byte ", at, ")");
      c.bytes[at] ^= mask;
      c.verdict = verdict;
      cases.push_back(std::move(c));
    };
    corrupt("payload bit", 16 + rng() % (b.bytes.size() - 16), 1u << (rng() % 8),
            cu::kVerifyChecksum);
    corrupt("last byte", b.bytes.size() - 1, 0x80, cu::kVerifyChecksum);
    corrupt("header field", 4 + rng() % 8, 0x01, cu::kVerifyChecksum);  // bits..extra
    corrupt("stored checksum", 12 + rng() % 4, 0x10, cu::kVerifyChecksum);
    corrupt("magic", rng() % 2, 0x04, cu::kVerifyBadHeader);
    corrupt("version", 2, 0x04, cu::kVerifyBadHeader);  // 5, 6 or 7
  }
  const size_t distinct = cases.size();
  for (size_t i = 0; cases.size() <= static_cast<size_t>(cu::xxh3_math::kVerifyThreads); ++i) {
    ChecksumCase repeat = cases[i % distinct];
    cases.push_back(std::move(repeat));
  }
  return cases;
}

// Blocks packed into one buffer, each at an odd offset (allocations are aligned, so at an odd
// address), as blocks sit in a pool.
struct PackedBlocks {
  std::vector<uint8_t> bytes;
  std::vector<uint64_t> offsets, sizes;
};
inline PackedBlocks Pack(const std::vector<ChecksumCase>& cases) {
  PackedBlocks p;
  for (const ChecksumCase& c : cases) {
    if (p.bytes.size() % 2 == 0) p.bytes.push_back(0xA5);
    p.offsets.push_back(p.bytes.size());
    p.sizes.push_back(c.bytes.size());
    p.bytes.insert(p.bytes.end(), c.bytes.begin(), c.bytes.end());
  }
  return p;
}

}  // namespace kvq::testing
