// Dense-and-sparse blocks (CodecOptions::sparse_keys / sparse_values): the chosen outliers come
// back exact on every read (decode, scores, readout, attend), the list is counted in the bytes,
// and blocks whose list disagrees with the codec or points outside the block are refused.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>

#include "kvq/core/basis.h"
#include "kvq/core/cache.h"
#include "kvq/core/codec.h"
#include "kvq/core/half.h"
#include "test_util.h"

namespace kvq::core {
namespace {
using kvq::testing::DenseAttend;
using kvq::testing::Gaussian;
using kvq::testing::View3;

CodecOptions Sparse(int sk, int sv, bool a2 = false) {
  CodecOptions o;
  o.head_dim = 64;
  o.key_group = 32;
  o.rank = 4;
  o.side_bits = 8;
  o.sparse_keys = sk;
  o.sparse_values = sv;
  if (a2) o.value_policy = ValuePolicy::kA2;
  return o;
}

// Rows [G][d] with `n` planted outliers (x40) at known places.
std::vector<float> WithOutliers(int G, int d, int n, uint32_t seed, std::vector<int>* where) {
  std::vector<float> x = Gaussian(static_cast<size_t>(G) * d, seed);
  std::mt19937 rng(seed + 7);
  for (int k = 0; k < n; ++k) {
    const int i = static_cast<int>(rng() % x.size());
    x[i] = 40.0f * (x[i] > 0 ? 1.0f : -1.0f) * (1.0f + 0.1f * k);
    where->push_back(i);
  }
  return x;
}

double SquaredError(const std::vector<float>& a, const std::vector<float>& b) {
  double e = 0;
  for (size_t i = 0; i < a.size(); ++i) e += (double(a[i]) - b[i]) * (double(a[i]) - b[i]);
  return e;
}

TEST(SparseCodec, OptionsAreValidatedAndNamed) {
  CodecOptions o = Sparse(101, 0);
  EXPECT_NE(o.Validate().message().find("sparse_keys"), std::string::npos);
  o = Sparse(0, 5);
  o.rotate_values = true;
  EXPECT_NE(o.Validate().message().find("sparse_values"), std::string::npos);
  EXPECT_TRUE(Sparse(10, 10).Validate().ok());
  EXPECT_EQ(Sparse(10, 5).ToString().find("spk10 spv5") != std::string::npos, true);
  EXPECT_EQ(SparseCount(Sparse(10, 5), true), 20);  // 1% of 32 x 64, rounded
  EXPECT_EQ(SparseCount(Sparse(10, 5), false), 10);
}

TEST(SparseCodec, KeysKeepTheirOutliersExactOnDecodeAndScores) {
  const CodecOptions o = Sparse(10, 0), plain = Sparse(0, 0);
  const int G = o.key_group, d = o.head_dim, r = o.rank;
  const ModelBasis basis = RandomBasis({"t", 1, 1, 1, 1, d, r}, 3);
  std::vector<int> where;
  const std::vector<float> keys = WithOutliers(G, d, 12, 5, &where);
  std::vector<uint8_t> with, without;
  ASSERT_TRUE(EncodeKeyBlock(o, keys.data(), d, basis.u.data(), &with).ok());
  ASSERT_TRUE(EncodeKeyBlock(plain, keys.data(), d, basis.u.data(), &without).ok());
  EXPECT_EQ(with.size(), without.size() + 4 * SparseCount(o, true));
  EXPECT_EQ(with.size(), KeyBlockBytes(o));
  auto kv = ParseKeyBlock(with, o, true);
  auto kp = ParseKeyBlock(without, plain, true);
  ASSERT_TRUE(kv.ok() && kp.ok()) << kv.status() << kp.status();
  ASSERT_NE(kv->sparse, nullptr);
  std::vector<float> dec(static_cast<size_t>(G) * d), dec_plain(dec.size());
  DecodeKeyBlock(*kv, basis.u.data(), dec.data());
  DecodeKeyBlock(*kp, basis.u.data(), dec_plain.data());
  // Every planted outlier is exact up to its delta's fp16 rounding.
  for (int i : where) EXPECT_NEAR(dec[i], keys[i], 2e-3f * std::fabs(keys[i])) << "element " << i;
  EXPECT_LT(SquaredError(dec, keys), 0.2 * SquaredError(dec_plain, keys));
  // Scores are those of the decoded keys (the list's terms included).
  const int n_q = 3;
  const std::vector<float> q = Gaussian(static_cast<size_t>(n_q) * d, 9);
  std::vector<float> uq(static_cast<size_t>(n_q) * r, 0.0f);
  for (int i = 0; i < n_q; ++i)
    for (int j = 0; j < r; ++j)
      for (int c = 0; c < d; ++c) uq[i * r + j] += q[i * d + c] * basis.u[c * r + j];
  std::vector<float> s(static_cast<size_t>(n_q) * G);
  ScoreKeyBlock(*kv, q.data(), uq.data(), n_q, 0.5f, s.data(), G, true, false);
  for (int i = 0; i < n_q; ++i)
    for (int t = 0; t < G; ++t) {
      double want = 0;
      for (int c = 0; c < d; ++c) want += double(q[i * d + c]) * dec[t * d + c];
      EXPECT_NEAR(s[i * G + t], 0.5 * want, 1e-3 * (1 + std::fabs(0.5 * want))) << i << "," << t;
    }
  // The reader's fast path gives the same view as the parser.
  KeyBlockView fast;
  ASSERT_TRUE(BlockReader(o, true).Key(with, &fast).ok());
  EXPECT_EQ(fast.sparse, kv->sparse);
  EXPECT_EQ(fast.sparse_count, kv->sparse_count);
}

TEST(SparseCodec, ValuesKeepTheirOutliersOnDecodeAndReadout) {
  for (bool a2 : {false, true}) {
    SCOPED_TRACE(a2 ? "A^2 widths" : "uniform");
    const CodecOptions o = Sparse(0, 10, a2), plain = Sparse(0, 0, a2);
    const int G = o.key_group, d = o.head_dim;
    std::vector<int> where;
    const std::vector<float> values = WithOutliers(G, d, 12, 15, &where);
    std::vector<uint8_t> widths(G);
    for (int t = 0; t < G; ++t) widths[t] = static_cast<uint8_t>(1 + t % 4);
    std::vector<uint8_t> with, without;
    ASSERT_TRUE(EncodeValueBlock(o, values.data(), d, a2 ? widths.data() : nullptr, &with).ok());
    ASSERT_TRUE(
        EncodeValueBlock(plain, values.data(), d, a2 ? widths.data() : nullptr, &without).ok());
    EXPECT_EQ(with.size(), without.size() + 4 * SparseCount(o, false));
    auto vv = ParseValueBlock(with, o, true);
    auto vp = ParseValueBlock(without, plain, true);
    ASSERT_TRUE(vv.ok() && vp.ok()) << vv.status() << vp.status();
    std::vector<float> dec(static_cast<size_t>(G) * d), dec_plain(dec.size());
    DecodeValueBlock(*vv, dec.data());
    DecodeValueBlock(*vp, dec_plain.data());
    for (int i : where) EXPECT_NEAR(dec[i], values[i], 2e-3f * std::fabs(values[i]));
    EXPECT_LT(SquaredError(dec, values), 0.5 * SquaredError(dec_plain, values));
    const int n_q = 2;
    const std::vector<float> p = Gaussian(static_cast<size_t>(n_q) * G, 21);
    std::vector<float> out(static_cast<size_t>(n_q) * d, 0.0f);
    ReadoutValueBlock(*vv, p.data(), G, n_q, out.data(), d, false);
    for (int i = 0; i < n_q; ++i)
      for (int c = 0; c < d; ++c) {
        double want = 0;
        for (int t = 0; t < G; ++t) want += double(p[i * G + t]) * dec[t * d + c];
        EXPECT_NEAR(out[i * d + c], want, 1e-3 * (1 + std::fabs(want)));
      }
  }
}

TEST(SparseCodec, ListsThatDisagreeWithTheCodecOrPointOutsideAreDataLoss) {
  const CodecOptions o = Sparse(10, 10), plain = Sparse(0, 0);
  const ModelBasis basis = RandomBasis({"t", 1, 1, 1, 1, 64, 4}, 3);
  const std::vector<float> keys = Gaussian(32 * 64, 1);
  std::vector<uint8_t> block;
  ASSERT_TRUE(EncodeKeyBlock(o, keys.data(), 64, basis.u.data(), &block).ok());
  EXPECT_EQ(ParseKeyBlock(block, plain, true).status().code(), absl::StatusCode::kDataLoss);
  std::vector<uint8_t> plain_block;
  ASSERT_TRUE(EncodeKeyBlock(plain, keys.data(), 64, basis.u.data(), &plain_block).ok());
  EXPECT_EQ(ParseKeyBlock(plain_block, o, true).status().code(), absl::StatusCode::kDataLoss);
  // A position beyond G x d: the checksum catches it, and without verification the list check.
  std::vector<uint8_t> bad = block;
  const size_t first = bad.size() - 4 * SparseCount(o, true);
  const uint16_t far = 32 * 64;
  std::memcpy(bad.data() + first, &far, 2);
  EXPECT_EQ(ParseKeyBlock(bad, o, true).status().code(), absl::StatusCode::kDataLoss);
  const absl::Status unverified = ParseKeyBlock(bad, o, false).status();
  EXPECT_EQ(unverified.code(), absl::StatusCode::kDataLoss);
  EXPECT_NE(unverified.message().find("dense-and-sparse"), std::string::npos) << unverified;
  // A reader that skips verification never writes outside the rows for such an entry.
  KeyBlockView v;
  ASSERT_TRUE(BlockReader(o, false).Key(bad, &v).ok());
  std::vector<float> rows(32 * 64 + 1, 0.0f);
  rows.back() = 123.0f;
  DecodeKeyBlock(v, basis.u.data(), rows.data());
  EXPECT_EQ(rows.back(), 123.0f);
}

// A cache of a dense-and-sparse codec attends exactly as dense attention over what it decodes,
// and with fp16 sinks (whose stand-in rows are never chosen).
TEST(SparseCodec, CacheAttendsOverWhatItDecodes) {
  for (int sinks : {0, 4}) {
    SCOPED_TRACE(sinks);
    CodecOptions o = Sparse(10, 10);
    o.fp16_sinks = sinks;
    o.window = 8;
    const int kv = 2, gq = 3, qh = kv * gq, nq = 1, d = o.head_dim;
    const int64_t T = 3 * o.key_group + 11;
    const ModelBasis basis = RandomBasis({"t", 1, 1, kv, qh, d, o.rank}, 11);
    LayerCache cache(o, kv, basis.u.data());
    std::vector<float> k = Gaussian(kv * T * d, 1), v = Gaussian(kv * T * d, 2);
    for (size_t i = 0; i < k.size(); i += 97) k[i] *= 30.0f;
    for (size_t i = 0; i < v.size(); i += 89) v[i] *= 30.0f;
    ASSERT_TRUE(cache.Append(View3(k, kv, T, d), View3(v, kv, T, d), 0).ok());
    const std::vector<float> q = Gaussian(static_cast<size_t>(qh) * nq * d, 3);
    std::vector<float> out(static_cast<size_t>(qh) * nq * d);
    ASSERT_TRUE(cache.Attend(q.data(), qh, nq, AttendOptions{}, out.data()).ok());
    std::vector<float> kd, vd;
    ASSERT_TRUE(cache.Decode(&kd, &vd).ok());
    const auto ref = DenseAttend(kd, vd, q, kv, qh, nq, T, d);
    for (size_t i = 0; i < out.size(); ++i) ASSERT_NEAR(out[i], ref[i], 5e-4f) << i;
    // The outliers came back: decoded keys are far closer to the input than without the list.
    CodecOptions plain = o;
    plain.sparse_keys = plain.sparse_values = 0;
    LayerCache other(plain, kv, basis.u.data());
    ASSERT_TRUE(other.Append(View3(k, kv, T, d), View3(v, kv, T, d), 0).ok());
    std::vector<float> kp, vp;
    ASSERT_TRUE(other.Decode(&kp, &vp).ok());
    EXPECT_LT(SquaredError(kd, k), 0.5 * SquaredError(kp, k));
    EXPECT_LT(SquaredError(vd, v), 0.8 * SquaredError(vp, v));
    EXPECT_TRUE(cache.VerifyAll().ok());
  }
}

}  // namespace
}  // namespace kvq::core
