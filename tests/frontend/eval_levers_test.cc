// The evaluation-only levers (eval_levers.h): dense-and-sparse trimming keeps the elements it
// takes out exactly and counts them; keys before RoPE come back rotated to where attention
// expects them; code books put each element on its group's nearest level and, fitted on the
// data, beat evenly spaced levels; the grammar refuses the combinations the levers cannot run
// with.
#include "kvq/frontend/eval_levers.h"

#include <algorithm>
#include <cmath>
#include <memory>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "kvq/frontend/attention_cache.h"
#include "kvq/frontend/eval_config.h"
#include "kvq/frontend/nuq.h"
#include "kvq/frontend/perplexity.h"
#include "tiny_model.h"

namespace kvq::frontend {
namespace {

constexpr int kHeads = 2, kDim = 64;

core::CodecOptions Kivi(int bits, int group = 32) {
  core::CodecOptions o;
  o.head_dim = kDim;
  o.rank = 0;
  o.key_bits = o.value_bits = bits;
  o.key_group = group;
  o.window = 0;
  return o;
}

Rope TestRope() {
  Rope r;
  r.halves = true;
  for (int j = 0; j < kDim / 2; ++j) r.inv_freq.push_back(std::pow(10000.0f, -2.0f * j / kDim));
  return r;
}

std::vector<float> Normal(size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> nd;
  std::vector<float> x(n);
  for (auto& e : x) e = nd(rng);
  return x;
}

// x [tokens][kv][d] -> [kv][tokens][d], the layout Read returns.
std::vector<float> HeadMajor(const std::vector<float>& x, int64_t T) {
  std::vector<float> y(x.size());
  for (int64_t t = 0; t < T; ++t)
    for (int h = 0; h < kHeads; ++h)
      std::copy_n(x.data() + (t * kHeads + h) * kDim, kDim, y.data() + (h * T + t) * kDim);
  return y;
}

double Mse(const std::vector<float>& a, const std::vector<float>& b, size_t n) {
  double s = 0;
  for (size_t i = 0; i < n; ++i) s += (a[i] - b[i]) * (a[i] - b[i]);
  return s / n;
}

TEST(TrimOutliers, TakesTheElementThatShrinksItsRangeMostAndClampsIt) {
  std::vector<float> x = {0, 1, 2, 100, 5, 6, 7, 8};
  const std::vector<std::vector<int64_t>> units = {{0, 1, 2, 3}, {4, 5, 6, 7}};
  std::vector<float> y = x;
  EXPECT_EQ(TrimOutliers(y.data(), units, 1), std::vector<int64_t>{3});
  EXPECT_EQ(y[3], 2.0f);
  // Then unit 1 (range 3 -> 2: gain 4 * 5) beats unit 0 (range 2 -> 1: gain 4 * 3).
  y = x;
  std::vector<int64_t> two = TrimOutliers(y.data(), units, 2);
  ASSERT_EQ(two.size(), 2u);
  EXPECT_EQ(two[0], 3);
  EXPECT_TRUE(two[1] == 4 || two[1] == 7);
  // Every unit keeps two elements, whatever the budget.
  y = x;
  EXPECT_EQ(TrimOutliers(y.data(), units, 100).size(), 4u);
}

TEST(Rope, InverseUndoesTheRotation) {
  const Rope r = TestRope();
  std::vector<float> x = Normal(5 * kHeads * kDim, 1), y = x;
  RotateRows(r, 300, 5, kHeads, kDim, y.data(), false);
  EXPECT_GT(Mse(x, y, x.size()), 0.1);
  RotateRows(r, 300, 5, kHeads, kDim, y.data(), true);
  EXPECT_LT(Mse(x, y, x.size()), 1e-10);
}

TEST(LeverFeed, KeysBeforeRopeComeBackRotated) {
  const core::CodecOptions o = Kivi(8);
  EvalLevers l;
  l.keys_before_rope = true;
  l.rope = TestRope();
  ASSERT_TRUE(CheckLevers(l, o).ok());
  core::LayerCache lc(o, kHeads, nullptr);
  LeverFeed f(l, o, kHeads, false, 0);
  const int T = 100;  // three groups fed, four rows waiting
  std::vector<float> k = Normal(T * kHeads * kDim, 2), v = Normal(k.size(), 3);
  ASSERT_TRUE(f.Append(lc, k.data(), v.data(), 0, 60).ok());
  ASSERT_TRUE(
      f.Append(lc, k.data() + 60 * kHeads * kDim, v.data() + 60 * kHeads * kDim, 60, 40).ok());
  EXPECT_EQ(lc.Size().encoded_tokens, 96);
  std::vector<float> K, V;
  ASSERT_TRUE(f.Read(lc, &K, &V).ok());
  const std::vector<float> want = HeadMajor(k, T);
  // 8-bit codes of the unrotated keys, rotated back: within the 8-bit step; without the
  // rotation back they would be O(1) away.
  EXPECT_LT(Mse(K, want, K.size()), 1e-3);
  EXPECT_LT(Mse(V, HeadMajor(v, T), V.size()), 1e-3);
}

TEST(LeverFeed, OutliersAreKeptExactAndCounted) {
  core::CodecOptions o = Kivi(2);
  o.fp16_sinks = 4;
  const int T = 96, G = 32;
  std::vector<float> k = Normal(T * kHeads * kDim, 4), v = Normal(k.size(), 5);
  std::mt19937_64 rng(6);
  for (int i = 0; i < 40; ++i) k[rng() % k.size()] += 30.0f;  // spikes, not whole channels
  for (int i = 0; i < 40; ++i) v[rng() % v.size()] -= 30.0f;
  k[0] = 500.0f;  // a sink: exact already, never a trimmed outlier
  auto run = [&](int permille, std::vector<float>* K, std::vector<float>* V) {
    EvalLevers l;
    l.key_outliers_permille = l.value_outliers_permille = permille;
    core::LayerCache lc(o, kHeads, nullptr);
    LeverFeed f(l, o, kHeads, false, 0);
    EXPECT_TRUE(f.Append(lc, k.data(), v.data(), 0, T).ok());
    EXPECT_TRUE(f.Read(lc, K, V).ok());
    return std::make_pair(f.key_outlier_bytes(), f.value_outlier_bytes());
  };
  std::vector<float> K0, V0, K1, V1;
  EXPECT_EQ(run(0, &K0, &V0), std::make_pair(int64_t{0}, int64_t{0}));
  const auto bytes = run(10, &K1, &V1);
  const int64_t per_group = std::llround(0.01 * G * kHeads * kDim);
  EXPECT_EQ(bytes.first, 3 * per_group * kOutlierBits / 8);
  EXPECT_EQ(bytes.second, 3 * per_group * kOutlierBits / 8);
  const std::vector<float> wk = HeadMajor(k, T), wv = HeadMajor(v, T);
  EXPECT_LT(Mse(K1, wk, wk.size()), 0.5 * Mse(K0, wk, wk.size()));
  EXPECT_LT(Mse(V1, wv, wv.size()), 0.5 * Mse(V0, wv, wv.size()));
  // The spikes come back exactly (the fp16 rounding of what was sent).
  EXPECT_EQ(K1[0], 500.0f);
  int exact = 0;
  for (size_t i = 0; i < wk.size(); ++i)
    exact += std::abs(wk[i]) > 20 && std::abs(K1[i] - wk[i]) < 0.02f;
  EXPECT_GE(exact, 38);
}

TEST(CodeBook, LloydPlacesLevelsWhereTheMassIsAndKeepsTheEnds) {
  EXPECT_EQ(FitCodeBook(UnitHistogram{}, 2), (std::vector<float>{0, 1.0f / 3, 2.0f / 3, 1}));
  UnitHistogram h;
  std::mt19937_64 rng(1);
  std::normal_distribution<double> nd(0.5, 0.12);
  for (int i = 0; i < 200000; ++i) h.Add(nd(rng));
  UnitHistogram ends;  // the fixed levels code the ends exactly: not counted
  for (double u : {0.0, 1.0, -0.5, std::nan("")}) ends.Add(u);
  EXPECT_EQ(ends.total(), 0.0);
  EXPECT_GT(h.total(), 199900.0);
  const std::vector<float> c = FitCodeBook(h, 2);
  ASSERT_EQ(c.size(), 4u);
  EXPECT_EQ(c.front(), 0.0f);
  EXPECT_EQ(c.back(), 1.0f);
  // The mass is near 0.5: the two free levels close in on it, symmetrically.
  EXPECT_GT(c[1], 0.36f);
  EXPECT_LT(c[2], 0.64f);
  EXPECT_NEAR(c[1] + c[2], 1.0f, 0.01f);
  // A fixed point of Lloyd's step: each free level is the mean of the mass nearest to it.
  double m = 0, w = 0;
  for (int b = 0; b < UnitHistogram::kBins; ++b) {
    const double u = (b + 0.5) / UnitHistogram::kBins;
    if (u > 0.5 * (c[0] + c[1]) && u <= 0.5 * (c[1] + c[2])) {
      m += h.count[b] * u;
      w += h.count[b];
    }
  }
  EXPECT_NEAR(m / w, c[1], 1e-4);
}

TEST(CodeBook, CompandSendsLevelsToCodesAndMidpointsToHalfCodes) {
  const std::vector<float> c = {0, 0.4f, 0.5f, 1};
  for (int k = 0; k < 4; ++k) EXPECT_FLOAT_EQ(Compand(c[k], c), k / 3.0f);
  for (int k = 0; k < 3; ++k) EXPECT_FLOAT_EQ(Compand(0.5f * (c[k] + c[k + 1]), c), (k + 0.5f) / 3);
  for (float u = 0; u <= 1.0f; u += 0.01f) EXPECT_NEAR(Expand(Compand(u, c), c), u, 1e-6f);
  EXPECT_EQ(Compand(-1.0f, c), 0.0f);
  EXPECT_EQ(Expand(2.0f, c), 1.0f);
}

TEST(LeverFeed, CodeBooksPutEachElementOnItsNearestLevel) {
  const core::CodecOptions o = Kivi(2);
  const int T = 64, G = 32;
  const std::vector<float> k = Normal(T * kHeads * kDim, 11), v = Normal(k.size(), 12);
  auto run = [&](std::shared_ptr<const CodeBooks> books, std::vector<float>* K,
                 std::vector<float>* V, UnitHistogram* keys_seen = nullptr) {
    EvalLevers l;
    l.nuq_keys = l.nuq_values = true;
    l.books = std::move(books);
    core::LayerCache lc(o, kHeads, nullptr);
    LeverFeed f(l, o, kHeads, false, /*layer=*/1);
    EXPECT_TRUE(f.Append(lc, k.data(), v.data(), 0, T).ok());
    EXPECT_TRUE(f.Read(lc, K, V).ok());
    if (keys_seen) *keys_seen = f.key_histogram();
  };
  // Counting (no books): the codec's uniform codes, and every element but the ends counted.
  std::vector<float> K0, V0;
  UnitHistogram seen;
  run(nullptr, &K0, &V0, &seen);
  EXPECT_EQ(seen.total(), T * kHeads * kDim - 2 * (T / G) * kHeads * kDim);
  // Hand-made books on layer 1 (layer 0's empty: that layer would stay uniform).
  auto hand = std::make_shared<CodeBooks>();
  hand->keys = {{}, {0, 0.3f, 0.45f, 1}};
  hand->values = {{}, {0, 0.2f, 0.9f, 1}};
  std::vector<float> K, V;
  run(hand, &K, &V);
  const std::vector<float> wk = HeadMajor(k, T);
  int off = 0;
  for (int h = 0; h < kHeads; ++h)
    for (int t0 = 0; t0 < T; t0 += G)
      for (int c = 0; c < kDim; ++c) {  // a key group: one channel over G tokens
        float lo = INFINITY, hi = -INFINITY;
        for (int t = t0; t < t0 + G; ++t) {
          lo = std::min(lo, wk[(h * T + t) * kDim + c]);
          hi = std::max(hi, wk[(h * T + t) * kDim + c]);
        }
        for (int t = t0; t < t0 + G; ++t) {
          const size_t i = (h * T + t) * kDim + c;
          float best = lo;
          for (float level : hand->keys[1]) {
            const float y = lo + level * (hi - lo);
            if (std::abs(y - wk[i]) < std::abs(best - wk[i])) best = y;
          }
          // fp16 zero and scale move the decoded levels by ~1e-3 of the range.
          off += std::abs(K[i] - best) > 0.01f * (hi - lo);
        }
      }
  EXPECT_LE(off, T * kHeads * kDim / 200);  // only elements within rounding of a midpoint
  // Books fitted on the data itself beat even levels on it (Gaussian groups: mass mid-range).
  auto fitted = std::make_shared<CodeBooks>();
  fitted->keys = {{}, FitCodeBook(seen, 2)};
  std::vector<float> K1, V1;
  run(fitted, &K1, &V1);
  EXPECT_LT(Mse(K1, wk, wk.size()), 0.95 * Mse(K0, wk, wk.size()));
  const std::vector<float> wv = HeadMajor(v, T);
  EXPECT_EQ(Mse(V1, wv, wv.size()), Mse(V0, wv, wv.size()));  // no value book: uniform
}

TEST(FitCodeBooks, FitsEachLayersBooksForWhatTheConfigPutsOnThem) {
  auto f = TinyModel();
  auto m = *LlamaModel::Load(*f);
  std::vector<int32_t> tokens(128);
  std::mt19937_64 rng(2);
  for (auto& t : tokens) t = static_cast<int32_t>(rng() % kVocab);
  // Values only, beside a side code (which needs no basis while counting).
  auto books = FitCodeBooks(*m, tokens, 64, *ParseEvalConfig("headq-kv2-nuqv"));
  ASSERT_TRUE(books.ok()) << books.status();
  EXPECT_TRUE(books->keys.empty());
  ASSERT_EQ(books->values.size(), static_cast<size_t>(kLayers));
  for (const auto& b : books->values) {
    ASSERT_EQ(b.size(), 4u);
    EXPECT_EQ(b.front(), 0.0f);
    EXPECT_EQ(b.back(), 1.0f);
    EXPECT_TRUE(b[0] < b[1] && b[1] < b[2] && b[2] < b[3]);
  }
  auto both = FitCodeBooks(*m, tokens, 64, *ParseEvalConfig("kivi-kv3-nuq"));
  ASSERT_TRUE(both.ok()) << both.status();
  EXPECT_EQ(both->keys.size(), static_cast<size_t>(kLayers));
  EXPECT_EQ(both->keys[0].size(), 8u);
  EXPECT_FALSE(FitCodeBooks(*m, tokens, 64, *ParseEvalConfig("kivi-kv2")).ok());
  EXPECT_FALSE(
      FitCodeBooks(*m, std::vector<int32_t>(10, 1), 64, *ParseEvalConfig("kivi-kv2-nuq")).ok());
}

TEST(CodecCache, LeversCountTheWaitingRowsAndTheOutliers) {
  const CacheShape s{1, 4, kHeads, kDim};
  const core::CodecOptions o = Kivi(2);
  auto plain = *CodecCache::Create(s, o, nullptr);
  auto trimmed = *CodecCache::Create(s, o, nullptr);
  EvalLevers l;
  l.key_outliers_permille = 10;
  ASSERT_TRUE(trimmed->SetLevers(l).ok());
  const int n = 70;
  std::vector<float> k = Normal(n * kHeads * kDim, 7), v = Normal(k.size(), 8);
  std::vector<float> q = Normal(static_cast<size_t>(s.q_heads) * n * kDim, 9), out(q.size());
  for (auto* c : {plain.get(), trimmed.get()})
    ASSERT_TRUE(c->AppendAndAttend(0, k.data(), v.data(), 0, n, q.data(), out.data()).ok());
  const core::SizeReport a = plain->Size(), b = trimmed->Size();
  EXPECT_EQ(trimmed->tokens(0), n);
  EXPECT_EQ(b.tokens, a.tokens);
  EXPECT_EQ(b.window_tokens, a.window_tokens);
  EXPECT_EQ(b.key_window_bytes, a.key_window_bytes);
  EXPECT_EQ(b.key_block_bytes - a.key_block_bytes, 2 * std::llround(0.01 * 32 * kHeads * kDim) * 4);
  EXPECT_EQ(b.value_block_bytes, a.value_block_bytes);
  // Fused reads are not what the levers feed.
  auto fused = *CodecCache::Create(s, o, nullptr, {.read = CodecRead::kAttend});
  EXPECT_FALSE(fused->SetLevers(l).ok());
}

TEST(EvalConfig, LeverGrammar) {
  auto pre = ParseEvalConfig("kivi-k2-g128-pre");
  ASSERT_TRUE(pre.ok()) << pre.status();
  EXPECT_TRUE(pre->levers.keys_before_rope);
  auto sp = ParseEvalConfig("headq-kv2-g128-vg64-obl-mr-sink4-spk10-spv5");
  ASSERT_TRUE(sp.ok()) << sp.status();
  EXPECT_EQ(sp->levers.key_outliers_permille, 10);
  EXPECT_EQ(sp->levers.value_outliers_permille, 5);
  EXPECT_EQ(sp->codec.fp16_sinks, 4);
  auto nuq = ParseEvalConfig("kivi-kv3-g128-nuq");
  ASSERT_TRUE(nuq.ok()) << nuq.status();
  EXPECT_TRUE(nuq->levers.nuq_keys && nuq->levers.nuq_values);
  auto nuqk = ParseEvalConfig("kivi-kv2-nuqk");
  ASSERT_TRUE(nuqk.ok()) << nuqk.status();
  EXPECT_TRUE(nuqk->levers.nuq_keys && !nuqk->levers.nuq_values);
  auto konly = ParseEvalConfig("kivi-k2-pre-spk10-nuq");  // KVQuant's recipe, keys only
  ASSERT_TRUE(konly.ok()) << konly.status();
  EXPECT_FALSE(konly->levers.nuq_values);
  EXPECT_TRUE(ParseEvalConfig("kivi-kv2-rotv-nuqk").ok());  // values rotated, keys on books
  // Values on books beside a side code, metric rounding and rotated keys.
  auto nuqv = ParseEvalConfig("headq-kv2-g128-s4-rotk-mr-sink4-nuqv");
  ASSERT_TRUE(nuqv.ok()) << nuqv.status();
  EXPECT_TRUE(!nuqv->levers.nuq_keys && nuqv->levers.nuq_values);
  for (const char* bad :
       {"headq-k2-pre", "kivi-k2-mr-pre", "kivi-kv2-rotk-spk10", "kivi-k2-spv5",
        "kivi-kv2-w32-spk10", "headq-kv2-a2-spk10", "kivi-kv2-spk101", "headq-k2-nuq",
        "kivi-k2-mr-nuq", "kivi-kv2-rotk-nuq", "kivi-kv2-vmr-nuq", "kivi-kv2-rotv-nuq"}) {
    EXPECT_FALSE(ParseEvalConfig(bad).ok()) << bad;
  }
}

}  // namespace
}  // namespace kvq::frontend
