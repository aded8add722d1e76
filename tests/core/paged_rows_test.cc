// Paged rows: a GetBlocks message decoded straight into a paged cache lands, bit for bit, where
// the cache's layout puts each (token, head, channel) of DecodeMessage's decode, for transposed
// and tiled layouts, every dtype, blocks in any order and ranges cut mid-block; nothing else is
// touched; and a bad layout or a corrupt run is refused naming the field, with nothing written.
#include "kvq/core/paged_rows.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "kvq/core/cache.h"
#include "test_util.h"

namespace kvq::core {
namespace {

using testing::Gaussian;
using ::testing::HasSubstr;
using testing::View3;

constexpr int kHeads = 2, kDim = 64, kRank = 4, kBlock = 32, kBlocks = 16;
constexpr int64_t kHeadStride = 2 * kBlock * kDim;  // a head's K half then V half
constexpr int64_t kBlockStride = kHeads * kHeadStride;

std::vector<CodecOptions> Codecs() {
  CodecOptions c;
  c.head_dim = kDim;
  c.key_bits = 2;
  c.key_group = 32;
  c.rank = kRank;
  c.side_bits = 8;
  c.fp16_sinks = 4;
  CodecOptions rot = c;
  rot.rotate_keys = rot.rotate_values = true;
  rot.key_group = 64;
  rot.fp16_sinks = 0;
  rot.window = 16;
  // 3-bit keys, 4-bit side codes and a dense-and-sparse key list (keys decoded by channel
  // through their token rows).
  CodecOptions sparse = c;
  sparse.key_bits = 3;
  sparse.key_group = 64;
  sparse.side_bits = 4;
  sparse.sparse_keys = 8;
  sparse.fp16_sinks = 0;
  return {c, rot, sparse};
}

// K transposed [d][t] in the block (a vector CPU backend's), V token-major.
std::vector<int32_t> Transposed(bool value) {
  std::vector<int32_t> i(static_cast<size_t>(kBlock) * kDim);
  for (int t = 0; t < kBlock; ++t)
    for (int c = 0; c < kDim; ++c)
      i[t * kDim + c] = value ? kBlock * kDim + t * kDim + c : c * kBlock + t;
  return i;
}
// VNNI-like tiles [t/16][d/2][16][2] (an AMX backend's K).
std::vector<int32_t> Tiled(bool value) {
  std::vector<int32_t> i(static_cast<size_t>(kBlock) * kDim);
  for (int t = 0; t < kBlock; ++t)
    for (int c = 0; c < kDim; ++c)
      i[t * kDim + c] = (value ? kBlock * kDim : 0) + (t / 16) * (kDim / 2 * 32) + (c / 2) * 32 +
                        (t % 16) * 2 + c % 2;
  return i;
}

struct Layer {
  std::vector<float> k, v;  // [kHeads][T][kDim]
  LayerCache cache;
  EncodedGroups run;
  int64_t E = 0, T = 0;
  Layer(const CodecOptions& o, const std::vector<float>& basis, int64_t tokens)
      : cache(o, kHeads, basis.data()), T(tokens) {
    k = Gaussian(static_cast<size_t>(kHeads) * T * kDim, 1);
    v = Gaussian(k.size(), 2);
    EXPECT_TRUE(cache.Append(View3(k, kHeads, T, kDim), View3(v, kHeads, T, kDim), 0).ok());
    E = cache.encoded_tokens();
    EXPECT_TRUE(cache.ExportGroups(0, E / o.key_group, &run).ok());
  }
  const float* basis() const {
    return cache.tables()->basis.empty() ? nullptr : cache.tables()->basis.data();
  }
};

std::vector<float> Basis() {
  std::vector<float> u(static_cast<size_t>(kHeads) * kDim * kRank, 0.0f);
  for (int h = 0; h < kHeads; ++h)
    for (int j = 0; j < kRank; ++j) u[(static_cast<size_t>(h) * kDim + j * 5) * kRank + j] = 1.0f;
  return u;
}

TEST(PagedRowsTest, EachRowLandsWhereTheLayoutPutsItAndNothingElseIsTouched) {
  const std::vector<float> basis = Basis();
  // Blocks in a scrambled order, as an engine's free list hands them out.
  std::vector<int64_t> offsets;
  for (int b = 0; b < kBlocks; ++b) offsets.push_back(((b * 7 + 3) % kBlocks) * kBlockStride);
  for (const CodecOptions& o : Codecs()) {
    Layer layer(o, basis, 300);
    const std::vector<float> rows = [&] {
      std::vector<float> k, v;
      EXPECT_TRUE(layer.cache.Decode(layer.E, layer.T, &k, &v).ok());
      k.insert(k.end(), v.begin(), v.end());
      return k;
    }();
    const int64_t W = layer.T - layer.E;
    const std::vector<float> wk(rows.begin(), rows.begin() + rows.size() / 2),
        wv(rows.begin() + rows.size() / 2, rows.end());
    const TensorView rk = View3(wk, kHeads, W, kDim), rv = View3(wv, kHeads, W, kDim);
    for (const DType dt : {DType::kF32, DType::kF16, DType::kBF16}) {
      std::vector<uint8_t> want_k, want_v;  // token-major [T][kHeads][kDim]
      ASSERT_TRUE(DecodeMessage(o, kHeads, layer.basis(), ViewOf(layer.run), &rk, &rv, dt, "m",
                                &want_k, &want_v, RowOrder::kTokenMajor)
                      .ok());
      const size_t size = DTypeSize(dt);
      for (const bool tiled : {false, true}) {
        const std::vector<int32_t> ki = tiled ? Tiled(false) : Transposed(false),
                                   vi = tiled ? Tiled(true) : Transposed(true);
        for (const auto& [from, to] :
             std::vector<std::pair<int64_t, int64_t>>{{0, layer.T},
                                                      {45, 250},
                                                      {0, 32},
                                                      {290, 300},
                                                      {100, 100},
                                                      {45, int64_t{1} << 50}}) {
          SCOPED_TRACE(::testing::Message() << "dtype " << static_cast<int>(dt) << " tiled "
                                            << tiled << " [" << from << ", " << to << ")");
          std::vector<uint8_t> cache(static_cast<size_t>(kBlocks) * kBlockStride * size, 0xA5);
          const std::vector<uint8_t> before = cache;
          PagedRows p{
              cache.data(), dt, kBlocks * kBlockStride, kBlock, kHeadStride, offsets, ki, vi,
              from,         to};
          absl::StatusOr<int64_t> n =
              DecodeMessageInto(o, kHeads, layer.basis(), ViewOf(layer.run), 0, &rk, &rv, "m", p);
          ASSERT_TRUE(n.ok()) << n.status();
          const int64_t end = std::min(to, layer.T);  // a range may run past the message
          EXPECT_EQ(*n, end - from);
          std::vector<uint8_t> expect = before;
          for (int64_t t = from; t < end; ++t)
            for (int h = 0; h < kHeads; ++h)
              for (int c = 0; c < kDim; ++c) {
                const int64_t base = offsets[t / kBlock] + h * kHeadStride;
                const size_t src = ((t * kHeads + h) * kDim + c) * size;
                std::memcpy(&expect[(base + ki[(t % kBlock) * kDim + c]) * size], &want_k[src],
                            size);
                std::memcpy(&expect[(base + vi[(t % kBlock) * kDim + c]) * size], &want_v[src],
                            size);
              }
          ASSERT_EQ(cache, expect);  // the decode bit for bit, every other byte as it was
        }
      }
    }
    // A run cut after its groups (a later message starting at the window rows only).
    std::vector<uint8_t> cache(static_cast<size_t>(kBlocks) * kBlockStride * 4, 0);
    const std::vector<int32_t> ki = Transposed(false), vi = Transposed(true);
    PagedRows p{
        cache.data(), DType::kF32, kBlocks * kBlockStride, kBlock, kHeadStride, offsets, ki, vi, 0,
        layer.T};
    EncodedGroupsView none;
    none.first_group = layer.E / o.key_group;
    absl::StatusOr<int64_t> n =
        DecodeMessageInto(o, kHeads, layer.basis(), none, layer.E, &rk, &rv, "m", p);
    ASSERT_TRUE(n.ok()) << n.status();
    EXPECT_EQ(*n, W);
    float got = 0;
    const int64_t t = layer.E,
                  at = offsets[t / kBlock] + 1 * kHeadStride + vi[(t % kBlock) * kDim + 5];
    std::memcpy(&got, &cache[at * 4], 4);
    EXPECT_EQ(got, wv[(static_cast<size_t>(1) * W + 0) * kDim + 5]);
  }
}

TEST(PagedRowsTest, ABadLayoutOrACorruptRunIsRefusedAndWritesNothing) {
  const std::vector<float> basis = Basis();
  const CodecOptions o = Codecs()[0];
  Layer layer(o, basis, 256);
  std::vector<int64_t> offsets;
  for (int b = 0; b < kBlocks; ++b) offsets.push_back(b * kBlockStride);
  const std::vector<int32_t> ki = Transposed(false), vi = Transposed(true);
  std::vector<uint8_t> cache(static_cast<size_t>(kBlocks) * kBlockStride * 2, 0x5A);
  const std::vector<uint8_t> before = cache;
  const PagedRows good{
      cache.data(), DType::kBF16, kBlocks * kBlockStride, kBlock, kHeadStride, offsets, ki, vi, 0,
      layer.E};
  auto refused = [&](const PagedRows& p, const EncodedGroups& run) {
    const absl::StatusOr<int64_t> n =
        DecodeMessageInto(o, kHeads, layer.basis(), ViewOf(run), 0, nullptr, nullptr, "m", p);
    if (!n.ok()) {
      EXPECT_EQ(cache, before);
    }
    return n.ok() ? std::string("ok") : std::string(n.status().message());
  };
  PagedRows p = good;
  p.block_offsets = std::span<const int64_t>(offsets).first(3);
  EXPECT_THAT(refused(p, layer.run), HasSubstr("paged.block_ids: 3 blocks, token 255 needs 8"));
  std::vector<int64_t> far = offsets;
  far[5] = (kBlocks - 1) * kBlockStride + 1;
  p = good;
  p.block_offsets = far;
  EXPECT_THAT(refused(p, layer.run), HasSubstr("paged.block_ids[5]"));
  far[5] = -kBlockStride;
  EXPECT_THAT(refused(p, layer.run), HasSubstr("outside the cache"));
  p = good;
  p.key_index = std::span<const int32_t>(ki).first(10);
  EXPECT_THAT(refused(p, layer.run), HasSubstr("paged.key_index/value_index: 10/2048 offsets"));
  std::vector<int32_t> negative = vi;
  negative[77] = -1;
  p = good;
  p.value_index = negative;
  EXPECT_THAT(refused(p, layer.run), HasSubstr("offset -1 < 0"));
  p = good;
  p.to_token = -1;
  EXPECT_THAT(refused(p, layer.run), HasSubstr("are not a range"));
  // A flipped code byte: the checksum (DATA_LOSS), before anything is written.
  EncodedGroups corrupt = layer.run;
  corrupt.bytes[corrupt.sizes[0] / 2] ^= 0x10;  // inside the first key block's codes
  const absl::StatusOr<int64_t> n =
      DecodeMessageInto(o, kHeads, layer.basis(), ViewOf(corrupt), 0, nullptr, nullptr, "m", good);
  EXPECT_EQ(n.status().code(), absl::StatusCode::kDataLoss) << n.status();
  EXPECT_EQ(cache, before);
  // And the good layout writes (the checks above are not what refuses everything).
  EXPECT_EQ(refused(good, layer.run), "ok");
}

}  // namespace
}  // namespace kvq::core
