// LayerCache::Decode(from, to): every range equals the same slice of the whole decode, for
// unsealed and sealed caches, with a window, across block boundaries and inside one block;
// a corrupted block fails the ranges that touch it (DATA_LOSS) and only those.
#include <random>

#include "gtest/gtest.h"
#include "kvq/core/cache.h"
#include "kvq/kernels/kernels.h"
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

// DecodeAs: every range in f16 / bf16 / f32 is the fp32 decode's slice rounded (FromFloat), for
// codecs with a window, fp16 sinks, A^2 value widths and rotations; outputs reused from a
// larger earlier call (no element is left from it: Decode does not zero-fill).
TEST(DecodeRange, DecodeAsIsTheFloatDecodeRounded) {
  const int kv = 2, d = 64;
  const int64_t T = 32 * 5 + 19;
  const auto basis = testing::Gaussian(kv * d * 4, 5, 0.125f);
  const auto k = testing::Gaussian(kv * T * d, 1), v = testing::Gaussian(kv * T * d, 2);
  std::vector<CodecOptions> codecs(4);
  for (auto& o : codecs) {
    o.head_dim = d;
    o.rank = 4;
    o.window = 20;
  }
  codecs[1].fp16_sinks = 4;
  codecs[2].value_policy = ValuePolicy::kA2;
  codecs[3].rotate_keys = codecs[3].rotate_values = true;
  codecs[3].key_bits = 3;
  for (size_t ci = 0; ci < codecs.size(); ++ci) {
    LayerCache c(codecs[ci], kv, basis.data());
    ASSERT_TRUE(c.Append(TensorView::Contiguous(k.data(), DType::kF32, {kv, T, d}),
                         TensorView::Contiguous(v.data(), DType::kF32, {kv, T, d}), 0)
                    .ok());
    std::vector<float> K, V, Kref, Vref;
    ASSERT_TRUE(c.Decode(&K, &V).ok());
    // The SIMD decode kernels equal the reference loops bit for bit.
    kernels::SetActive(&kernels::Ref());
    ASSERT_TRUE(c.Decode(&Kref, &Vref).ok());
    kernels::SetActive(nullptr);
    EXPECT_EQ(K, Kref) << "codec " << ci;
    EXPECT_EQ(V, Vref) << "codec " << ci;
    std::vector<float> kr(K.size(), 1e9f), vr(V.size(), 1e9f);  // garbage, reused below
    std::vector<uint8_t> k8, v8;
    for (auto [from, to] : std::vector<std::pair<int64_t, int64_t>>{
             {0, T}, {1, 3}, {3, 40}, {32, 160}, {150, T}, {0, 0}}) {
      ASSERT_TRUE(c.Decode(from, to, &kr, &vr).ok());
      EXPECT_EQ(kr, Slice(K, kv, T, d, from, to)) << "codec " << ci << " " << from << ".." << to;
      EXPECT_EQ(vr, Slice(V, kv, T, d, from, to)) << "codec " << ci << " " << from << ".." << to;
      for (DType dt : {DType::kF16, DType::kBF16, DType::kF32}) {
        ASSERT_TRUE(c.DecodeAs(from, to, dt, &k8, &v8).ok());
        for (const auto& [got, all] : {std::pair{&k8, &K}, std::pair{&v8, &V}}) {
          const auto want = Slice(*all, kv, T, d, from, to);
          std::vector<uint8_t> bytes(want.size() * DTypeSize(dt));
          FromFloat(dt, want.data(), bytes.data(), want.size());
          EXPECT_EQ(*got, bytes) << "codec " << ci << " " << DTypeName(dt) << " " << from << ".."
                                 << to;
        }
      }
    }
    EXPECT_EQ(c.DecodeAs(0, T + 1, DType::kF16, &k8, &v8).code(), absl::StatusCode::kOutOfRange);
  }
}

}  // namespace
}  // namespace kvq::core
