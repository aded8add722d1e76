// CodecCache's two read paths (local attention over LayerCache::Decode, and the codec's fused
// LayerCache::Attend) must agree, and both must match DenseCache when quantization is nearly
// lossless; the decode-faithful chunking must cut at the encode boundaries.
#include <cmath>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "kvq/frontend/attention_cache.h"

namespace kvq::frontend {
namespace {

struct Data {
  std::vector<float> k, v, q;
};

Data Random(const CacheShape& s, int n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> nd;
  Data d;
  d.k.resize(static_cast<size_t>(n) * s.kv_heads * s.head_dim);
  d.v.resize(d.k.size());
  d.q.resize(static_cast<size_t>(n) * s.q_heads * s.head_dim);
  for (auto& x : d.k) x = nd(rng);
  for (auto& x : d.v) x = nd(rng);
  for (auto& x : d.q) x = 0.5f * nd(rng);
  for (size_t i = 0; i < d.k.size(); i += s.head_dim) d.k[i] += 3.0f;  // an outlier channel
  return d;
}

// Runs n tokens through `c` in chunks of `chunk`, returning outputs [QH][n][d] per chunk
// concatenated in [chunk][QH][len][d] order.
std::vector<float> RunChunks(AttentionCache* c, const CacheShape& s, const Data& d, int n,
                             int chunk) {
  std::vector<float> all;
  const int D = s.head_dim;
  for (int p = 0; p < n; p += chunk) {
    const int len = std::min(chunk, n - p);
    std::vector<float> q(static_cast<size_t>(s.q_heads) * len * D), out(q.size());
    for (int h = 0; h < s.q_heads; ++h)
      for (int i = 0; i < len; ++i)
        std::copy_n(d.q.data() + (static_cast<size_t>(p + i) * s.q_heads + h) * D, D,
                    q.data() + (static_cast<size_t>(h) * len + i) * D);
    const size_t kv = static_cast<size_t>(p) * s.kv_heads * D;
    EXPECT_TRUE(
        c->AppendAndAttend(0, d.k.data() + kv, d.v.data() + kv, p, len, q.data(), out.data()).ok());
    all.insert(all.end(), out.begin(), out.end());
  }
  return all;
}

double MaxDiff(const std::vector<float>& a, const std::vector<float>& b) {
  double m = 0;
  for (size_t i = 0; i < a.size(); ++i) m = std::max(m, static_cast<double>(std::abs(a[i] - b[i])));
  return m;
}

TEST(CodecCache, DecodePathMatchesFusedAttend) {
  const CacheShape s{1, 6, 2, 64};
  const int n = 111;
  Data d = Random(s, n, 3);
  for (int rank : {0, 4}) {
    core::CodecOptions o;
    o.rank = rank;
    o.key_bits = 2;
    o.value_bits = 2;
    o.key_group = 32;
    o.window = 0;
    core::ModelBasis basis =
        core::RandomBasis({.layers = 1, .kv_heads = 2, .q_heads = 6, .head_dim = 64, .rank = 4}, 9);
    for (int chunk : {37, 31, 1}) {
      auto a = CodecCache::Create(s, o, &basis, {.read = CodecRead::kDecode});
      auto b = CodecCache::Create(s, o, &basis, {.read = CodecRead::kAttend});
      ASSERT_TRUE(a.ok() && b.ok());
      auto ra = RunChunks(a->get(), s, d, n, chunk);
      auto rb = RunChunks(b->get(), s, d, n, chunk);
      EXPECT_LT(MaxDiff(ra, rb), 2e-3) << "rank " << rank << " chunk " << chunk;
    }
  }
}

TEST(CodecCache, EightBitCodecIsCloseToDense) {
  const CacheShape s{1, 6, 2, 64};
  const int n = 100;
  Data d = Random(s, n, 5);
  core::CodecOptions o;
  o.key_bits = 8;
  o.value_bits = 8;
  auto c = CodecCache::Create(s, o, nullptr);
  ASSERT_TRUE(c.ok());
  DenseCache dense(s);
  auto rc = RunChunks(c->get(), s, d, n, 100);
  auto rd = RunChunks(&dense, s, d, n, 100);
  EXPECT_LT(MaxDiff(rc, rd), 0.05);
  // Two-bit keys are visibly worse: the comparison above is not vacuous.
  o.key_bits = 2;
  auto c2 = CodecCache::Create(s, o, nullptr);
  ASSERT_TRUE(c2.ok());
  EXPECT_GT(MaxDiff(RunChunks(c2->get(), s, d, n, 100), rd), 0.05);
}

TEST(CodecCache, ProbesNeedTheA2PolicyAndKeepDecodeSemantics) {
  const CacheShape s{1, 6, 2, 64};
  core::CodecOptions o;
  o.key_bits = 2;
  o.value_bits = 2;
  EXPECT_FALSE(CodecCache::Create(s, o, nullptr, {.read = CodecRead::kAttend, .probe = true}).ok());
  o.value_policy = core::ValuePolicy::kA2;
  o.value_budget = 2.0f;
  auto with = CodecCache::Create(s, o, nullptr, {.read = CodecRead::kAttend, .probe = true});
  auto without = CodecCache::Create(s, o, nullptr, {.read = CodecRead::kAttend});
  ASSERT_TRUE(with.ok() && without.ok()) << with.status();
  Data d = Random(s, 96, 8);
  // Chunks as the decode-faithful driver cuts them at G = 32, R = 0: 31, then 32 from 31, ...
  auto a = RunChunks(with->get(), s, d, 31, 31);
  auto b = RunChunks(without->get(), s, d, 31, 31);
  EXPECT_LT(MaxDiff(a, b), 1e-5);  // nothing encoded yet: probes cannot change outputs
  EXPECT_EQ((*with)->tokens(0), 31);
  EXPECT_EQ((*with)->Size().encoded_tokens, 0);
}

TEST(CodecCache, EncodeBoundaryFollowsWindowAndGroup) {
  const CacheShape s{1, 2, 1, 64};
  core::CodecOptions o;
  o.key_group = 32;
  o.window = 16;
  auto c = CodecCache::Create(s, o, nullptr);
  ASSERT_TRUE(c.ok());
  EXPECT_EQ((*c)->NextEncodeBoundary(0), 48);
  Data d = Random(s, 48, 1);
  RunChunks(c->get(), s, d, 48, 48);
  EXPECT_EQ((*c)->Size().encoded_tokens, 32);
  EXPECT_EQ((*c)->NextEncodeBoundary(48), 80);
}

// Attention sinks (the codec's fp16_sinks): the first positions come back exactly and no
// longer widen their group's ranges, on the Decode and the fused Attend read paths alike;
// their fp16 rows are counted in the at-context bits.
TEST(CodecCache, SinkTokensAreExactAndSpareTheirGroup) {
  const CacheShape s{1, 4, 2, 64};
  const int n = 64, kSinks = 2;
  Data d = Random(s, n, 9);
  for (int t = 0; t < kSinks; ++t)
    for (int i = 0; i < s.kv_heads * s.head_dim; ++i) {
      d.k[t * s.kv_heads * s.head_dim + i] *= 30.0f;  // outliers far beyond the other rows
      d.v[t * s.kv_heads * s.head_dim + i] *= 30.0f;
    }
  core::CodecOptions o;
  o.key_bits = 2;
  o.value_bits = 2;
  DenseCache dense(s);
  const auto rd = RunChunks(&dense, s, d, n, n);
  auto plain = CodecCache::Create(s, o, nullptr);
  core::CodecOptions with = o;
  with.fp16_sinks = kSinks;
  auto sunk = CodecCache::Create(s, with, nullptr);
  auto fused = CodecCache::Create(s, with, nullptr, {.read = CodecRead::kAttend});
  ASSERT_TRUE(plain.ok() && sunk.ok() && fused.ok());
  const double e_plain = MaxDiff(RunChunks(plain->get(), s, d, n, n), rd);
  const auto r_sunk = RunChunks(sunk->get(), s, d, n, n);
  const double e_sunk = MaxDiff(r_sunk, rd);
  EXPECT_LT(e_sunk, 0.25 * e_plain) << e_sunk << " vs " << e_plain;
  EXPECT_LT(MaxDiff(RunChunks(fused->get(), s, d, n, n), r_sunk), 2e-3);
  // Two fp16 rows of keys and of values per head on top of the codes: 2 * 16 / 64 bits.
  const core::SizeReport a = (*plain)->Size(), b = (*sunk)->Size();
  EXPECT_NEAR(b.k_bits_effective() - a.k_bits_effective(), 2.0 * 16 / n, 1e-9);
  EXPECT_NEAR(b.v_bits_effective() - a.v_bits_effective(), 2.0 * 16 / n, 1e-9);
  EXPECT_EQ(b.k_bits_steady(), a.k_bits_steady());
  with.fp16_sinks = core::kMaxFp16Sinks + 1;
  EXPECT_FALSE(CodecCache::Create(s, with, nullptr).ok());
}

}  // namespace
}  // namespace kvq::frontend
