// Per-head HeadQ ranks (rank_allocation.h): the score error each rank leaves, measured through
// second moments, equals the error summed over every query and key of the window; the greedy
// allocation spends exactly its budget where the error falls most; a cache with per-head
// ranks codes each head as a cache of that head's rank would and counts it at that rank.
#include "kvq/frontend/rank_allocation.h"

#include <cmath>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "kvq/core/cache.h"
#include "kvq/core/tensor.h"
#include "kvq/frontend/attention_cache.h"
#include "kvq/frontend/eval_config.h"
#include "tiny_model.h"

namespace kvq::frontend {
namespace {

// Keys [n][kv][d] as a frontend sends them (fp16: *sent, same layout) and as a LayerCache of
// codec `o` (basis `u`, [kv][d][rank], or null) decodes them (*decoded, [kv][n][d]).
void SendAndDecode(const core::CodecOptions& o, int kv_heads, const float* k, int n, const float* u,
                   std::vector<float>* sent, std::vector<float>* decoded) {
  std::vector<uint16_t> kh(static_cast<size_t>(n) * kv_heads * o.head_dim), vh(kh.size(), 0);
  core::FromFloat(core::DType::kF16, k, kh.data(), kh.size());
  sent->resize(kh.size());
  core::ToFloat(core::DType::kF16, kh.data(), sent->data(), kh.size());
  core::TensorView kv, vv;
  for (auto* t : {&kv, &vv}) {
    t->dtype = core::DType::kF16;
    t->rank = 3;
    t->shape = {kv_heads, n, o.head_dim, 0};
    t->stride = {o.head_dim, static_cast<int64_t>(kv_heads) * o.head_dim, 1, 0};
  }
  kv.data = kh.data();
  vv.data = vh.data();
  core::LayerCache lc(o, kv_heads, u);
  ASSERT_TRUE(lc.Append(kv, vv, 0).ok());
  std::vector<float> V;
  ASSERT_TRUE(lc.Decode(decoded, &V).ok());
}

TEST(HeadScoreError, EqualsTheSumOverEveryQueryAndKeyOfTheWindow) {
  auto f = TinyModel();
  auto m = *LlamaModel::Load(*f);
  const LlamaConfig& c = m->config();
  const int D = c.head_dim, W = 64, R = 6;
  std::vector<int32_t> tokens(2 * W);
  std::mt19937_64 rng(3);
  for (auto& t : tokens) t = static_cast<int32_t>(rng() % kVocab);
  const core::ModelBasis basis = core::RandomBasis(
      {.layers = c.layers, .kv_heads = c.kv_heads, .q_heads = c.q_heads, .head_dim = D, .rank = R},
      5);
  core::CodecOptions o;
  o.head_dim = D;
  o.rank = 0;
  o.key_bits = 2;
  o.key_group = 32;
  o.window = 0;
  auto err = MeasureHeadScoreError(*m, tokens, W, basis, o);
  ASSERT_TRUE(err.ok()) << err.status();
  ASSERT_EQ(err->size(), static_cast<size_t>(c.layers));

  // The same sum, query by query and key by key.
  std::vector<std::vector<std::vector<double>>> want(
      c.layers, std::vector<std::vector<double>>(c.kv_heads, std::vector<double>(R + 1, 0.0)));
  const int gq = c.q_heads / c.kv_heads;
  auto hook = [&](int l, int64_t, int n, const float* q, const float* k, const float*) {
    std::vector<float> sent, K;
    SendAndDecode(o, c.kv_heads, k, n, nullptr, &sent, &K);
    for (int qh = 0; qh < c.q_heads; ++qh) {
      const int h = qh / gq;
      const float* U = basis.head(l, h);
      for (int t = 0; t < n; ++t) {
        std::vector<double> e(D);
        for (int a = 0; a < D; ++a)
          e[a] = sent[(static_cast<size_t>(t) * c.kv_heads + h) * D + a] -
                 K[(static_cast<size_t>(h) * n + t) * D + a];
        for (int r = 0; r <= R; ++r) {
          std::vector<double> er = e;  // e - U_r U_r^T e
          for (int j = 0; j < r; ++j) {
            double p = 0;
            for (int a = 0; a < D; ++a) p += U[a * R + j] * e[a];
            for (int a = 0; a < D; ++a) er[a] -= p * U[a * R + j];
          }
          for (int i = 0; i < n; ++i) {
            const float* qi = q + (static_cast<size_t>(qh) * n + i) * D;
            double s = 0;
            for (int a = 0; a < D; ++a) s += qi[a] * er[a];
            want[l][h][r] += s * s;
          }
        }
      }
    }
  };
  for (int w = 0; w < 2; ++w) {
    DenseCache cache(c.cache_shape());
    ASSERT_TRUE(m->Forward(tokens.data() + w * W, W, 0, &cache, W, nullptr, hook).ok());
  }
  for (int l = 0; l < c.layers; ++l)
    for (int h = 0; h < c.kv_heads; ++h) {
      EXPECT_GT(want[l][h][0], 0.0);
      for (int r = 0; r <= R; ++r)
        EXPECT_NEAR((*err)[l][h][r], want[l][h][r], 1e-6 * want[l][h][0]) << l << " " << r;
    }
  EXPECT_FALSE(MeasureHeadScoreError(*m, std::vector<int32_t>(W - 1, 1), W, basis, {}).ok());
}

// The score error, over every query and key of each window, of keys coded by a real rank-r
// codec (LayerCache with the basis's first r columns), summed over layers and heads.
double RealScoreError(const LlamaModel& m, const std::vector<int32_t>& tokens, int W,
                      const core::ModelBasis& basis, core::CodecOptions o, int r) {
  const LlamaConfig& c = m.config();
  const int D = c.head_dim, R = basis.manifest.rank, gq = c.q_heads / c.kv_heads;
  o.rank = r;
  o.side_bits = 8;
  double total = 0;
  auto hook = [&](int l, int64_t, int n, const float* q, const float* k, const float*) {
    std::vector<float> u(static_cast<size_t>(c.kv_heads) * D * std::max(r, 1));
    for (int h = 0; h < c.kv_heads; ++h)
      for (int a = 0; a < D; ++a)
        for (int j = 0; j < r; ++j) u[(h * D + a) * r + j] = basis.head(l, h)[a * R + j];
    std::vector<float> sent, K;
    SendAndDecode(o, c.kv_heads, k, n, r > 0 ? u.data() : nullptr, &sent, &K);
    for (int qh = 0; qh < c.q_heads; ++qh) {
      const int h = qh / gq;
      for (int t = 0; t < n; ++t)
        for (int i = 0; i < n; ++i) {
          double s = 0;
          for (int a = 0; a < D; ++a)
            s += q[(static_cast<size_t>(qh) * n + i) * D + a] *
                 (sent[(static_cast<size_t>(t) * c.kv_heads + h) * D + a] -
                  K[(static_cast<size_t>(h) * n + t) * D + a]);
          total += s * s;
        }
    }
  };
  for (size_t w = 0; w + W <= tokens.size(); w += W) {
    DenseCache cache(c.cache_shape());
    EXPECT_TRUE(m.Forward(tokens.data() + w, W, 0, &cache, W, nullptr, hook).ok());
  }
  return total;
}

TEST(HeadScoreError, PredictsARealSideCodesErrorWithKeysRotatedOrNot) {
  auto f = TinyModel();
  auto m = *LlamaModel::Load(*f);
  const LlamaConfig& c = m->config();
  const int W = 64, R = 6;
  std::vector<int32_t> tokens(2 * W);
  std::mt19937_64 rng(8);
  for (auto& t : tokens) t = static_cast<int32_t>(rng() % kVocab);
  const core::ModelBasis basis = core::RandomBasis({.layers = c.layers,
                                                    .kv_heads = c.kv_heads,
                                                    .q_heads = c.q_heads,
                                                    .head_dim = c.head_dim,
                                                    .rank = R},
                                                   6);
  for (bool rotate : {false, true}) {
    core::CodecOptions o;
    o.head_dim = c.head_dim;
    o.key_bits = 2;
    o.key_group = 32;
    o.window = 0;
    o.rotate_keys = rotate;  // the side code then works in rotated coordinates (H U)
    auto err = MeasureHeadScoreError(*m, tokens, W, basis, o);
    ASSERT_TRUE(err.ok()) << err.status();
    for (int r : {0, 3, 6}) {
      double predicted = 0;
      for (const auto& layer : *err)
        for (const auto& head : layer) predicted += head[r];
      const double real = RealScoreError(*m, tokens, W, basis, o, r);
      // Only the side code's own 8-bit rounding is not modelled.
      EXPECT_NEAR(predicted, real, 0.02 * real) << "rotate " << rotate << " rank " << r;
    }
  }
}

TEST(AllocateHeadRanks, SpendsTheBudgetWhereTheErrorFallsMost) {
  // Layer 0: head 0 gains a lot per rank, head 1 nothing after rank 1; layer 1: steady gains.
  const std::vector<std::vector<std::vector<double>>> e = {
      {{100, 60, 30, 15, 8, 4}, {10, 1, 1, 1, 1, 1}},
      {{20, 14, 9, 6, 4, 3}, {12, 9, 7, 5, 4, 3.5}}};
  const auto r = AllocateHeadRanks(e, 2, 5);
  int sum = 0;
  for (const auto& row : r)
    for (int x : row) sum += x;
  EXPECT_EQ(sum, 8);
  EXPECT_EQ(r[0][1], 1);  // its second rank gains nothing
  EXPECT_GE(r[0][0], 4);
  EXPECT_EQ(AllocateHeadRanks(e, 5, 5), (std::vector<std::vector<int>>{{5, 5}, {5, 5}}));
  EXPECT_EQ(AllocateHeadRanks(e, 9, 3), (std::vector<std::vector<int>>{{3, 3}, {3, 3}}));
}

TEST(CodecCache, PerHeadRanksCodeEachHeadAtItsRankAndCountIt) {
  const CacheShape s{1, 4, 2, 64};
  const core::ModelBasis basis =
      core::RandomBasis({.layers = 1, .kv_heads = 2, .q_heads = 4, .head_dim = 64, .rank = 4}, 9);
  core::CodecOptions o;
  o.head_dim = 64;
  o.key_bits = 2;
  o.rank = 4;
  o.window = 0;
  const int n = 64;
  std::mt19937_64 rng(4);
  std::normal_distribution<float> nd;
  std::vector<float> k(static_cast<size_t>(n) * 2 * 64), v(k.size()), q(4 * n * 64), out(q.size());
  for (auto* x : {&k, &v, &q})
    for (auto& e : *x) e = nd(rng);
  const std::vector<std::vector<int>> ranks = {{4, 1}};
  auto mixed = *CodecCache::Create(s, o, &basis, {.head_ranks = &ranks});
  auto four = *CodecCache::Create(s, o, &basis);
  core::CodecOptions o1 = o;
  o1.rank = 1;
  auto one = *CodecCache::Create(s, o1, &basis);
  std::vector<std::vector<float>> outs;
  for (auto* c : {mixed.get(), four.get(), one.get()}) {
    ASSERT_TRUE(c->AppendAndAttend(0, k.data(), v.data(), 0, n, q.data(), out.data()).ok());
    outs.push_back(out);
  }
  // Query heads 0-1 read KV head 0 (rank 4), 2-3 KV head 1 (rank 1): [QH][n][d].
  const size_t half = out.size() / 2;
  double d4 = 0, d1 = 0, apart = 0;
  for (size_t i = 0; i < half; ++i) {
    d4 = std::max(d4, static_cast<double>(std::abs(outs[0][i] - outs[1][i])));
    d1 = std::max(d1, static_cast<double>(std::abs(outs[0][half + i] - outs[2][half + i])));
    apart = std::max(apart, static_cast<double>(std::abs(outs[1][half + i] - outs[2][half + i])));
  }
  EXPECT_LT(d4, 1e-6);
  EXPECT_LT(d1, 1e-6);
  EXPECT_GT(apart, 1e-3);  // the ranks do differ in what they read
  // Key bytes: each head at its own rank, the mean of the two uniform caches.
  EXPECT_EQ(2 * mixed->Size().key_block_bytes,
            four->Size().key_block_bytes + one->Size().key_block_bytes);
  EXPECT_EQ(mixed->Size().value_block_bytes, four->Size().value_block_bytes);
  const std::vector<std::vector<int>> short_row = {{4}};
  EXPECT_FALSE(CodecCache::Create(s, o, &basis, {.head_ranks = &short_row}).ok());
}

TEST(EvalConfig, HeadAdaptGrammar) {
  auto c = ParseEvalConfig("headq-k2-r4-obl-mr-hadapt");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_TRUE(c->head_adaptive_rank);
  EXPECT_TRUE(ParseEvalConfig("headq-k2-r4-g128-rotk-mr-hadapt").ok());
  for (const char* bad : {"kivi-k2-hadapt", "headq-k2-adapt-hadapt"})
    EXPECT_FALSE(ParseEvalConfig(bad).ok()) << bad;
}

}  // namespace
}  // namespace kvq::frontend
