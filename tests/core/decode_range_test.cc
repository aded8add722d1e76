// LayerCache::Decode(from, to): every range equals the same slice of the whole decode, for
// unsealed and sealed caches, with a window, across block boundaries and inside one block;
// a corrupted block fails the ranges that touch it (DATA_LOSS) and only those.
#include <random>

#include "gtest/gtest.h"
#include "kvq/core/cache.h"
#include "test_util.h"

namespace kvq::core {
namespace {

std::vector<float> Slice(const std::vector<float>& x, int kv, int64_t T, int d, int64_t from,
                         int64_t to) {
  std::vector<float> out;
  for (int h = 0; h < kv; ++h) {
    out.insert(out.end(), x.begin() + (h * T + from) * d, x.begin() + (h * T + to) * d);
  }
  return out;
}

TEST(DecodeRange, EveryRangeIsTheSliceOfTheWholeDecode) {
  const int kv = 3, d = 64;
  const int64_t T = 150;
  CodecOptions o;
  o.head_dim = d;
  o.rank = 4;
  o.window = 20;
  const auto basis = testing::Gaussian(kv * d * 4, 5, 0.125f);  // [kv][d][r]: any U decodes
  const auto k = testing::Gaussian(kv * T * d, 1), v = testing::Gaussian(kv * T * d, 2);
  for (bool sealing : {false, true}) {
    LayerCache c(o, kv, basis.data());
    c.set_sealing(sealing);
    ASSERT_TRUE(c.Append(TensorView::Contiguous(k.data(), DType::kF32, {kv, T, d}),
                         TensorView::Contiguous(v.data(), DType::kF32, {kv, T, d}), 0)
                    .ok());
    ASSERT_EQ(c.Size().window_tokens, 150 - 128);
    EXPECT_EQ(c.sealed().size(), sealing ? 4u : 0u);
    std::vector<float> K, V;
    ASSERT_TRUE(c.Decode(&K, &V).ok());
    std::mt19937 rng(3);
    std::vector<std::pair<int64_t, int64_t>> ranges = {
        {0, T}, {0, 0}, {T, T}, {5, 9}, {31, 33}, {32, 64}, {100, 140}, {127, 129}, {140, T}};
    for (int i = 0; i < 40; ++i) {
      int64_t a = rng() % (T + 1), b = rng() % (T + 1);
      ranges.emplace_back(std::min(a, b), std::max(a, b));
    }
    for (auto [from, to] : ranges) {
      std::vector<float> k2, v2;
      ASSERT_TRUE(c.Decode(from, to, &k2, &v2).ok());
      EXPECT_EQ(k2, Slice(K, kv, T, d, from, to)) << from << ".." << to << " sealed " << sealing;
      EXPECT_EQ(v2, Slice(V, kv, T, d, from, to)) << from << ".." << to << " sealed " << sealing;
    }
    std::vector<float> k2, v2;
    EXPECT_EQ(c.Decode(-1, 3, &k2, &v2).code(), absl::StatusCode::kOutOfRange);
    EXPECT_EQ(c.Decode(4, 3, &k2, &v2).code(), absl::StatusCode::kOutOfRange);
    EXPECT_EQ(c.Decode(0, T + 1, &k2, &v2).code(), absl::StatusCode::kOutOfRange);
  }
  // Corruption in block 1 of head 2: ranges touching tokens 32..63 fail, others do not.
  LayerCache c(o, kv, basis.data());
  ASSERT_TRUE(c.Append(TensorView::Contiguous(k.data(), DType::kF32, {kv, T, d}),
                       TensorView::Contiguous(v.data(), DType::kF32, {kv, T, d}), 0)
                  .ok());
  c.key_blocks(2)[c.key_blocks(2).size() / 4 + 40] ^= 0x08;  // inside block 1 of 4
  std::vector<float> k2, v2;
  EXPECT_EQ(c.Decode(40, 41, &k2, &v2).code(), absl::StatusCode::kDataLoss);
  EXPECT_EQ(c.Decode(0, T, &k2, &v2).code(), absl::StatusCode::kDataLoss);
  EXPECT_TRUE(c.Decode(0, 32, &k2, &v2).ok());
  EXPECT_TRUE(c.Decode(64, T, &k2, &v2).ok());
}

}  // namespace
}  // namespace kvq::core
