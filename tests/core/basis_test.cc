// Basis files: round trip, and every malformed variant rejected with a clear error.
#include "kvq/core/basis.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "kvq/core/calibration.h"
#include "test_util.h"

namespace kvq::core {
namespace {
namespace fs = std::filesystem;

class BasisFiles : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("kvq_basis_" + std::to_string(::getpid()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    BasisManifest m{"tiny-llama", 2, 3, 2, 6, 16, 4};
    basis_ = RandomBasis(m, 7);
    basis_.manifest.kind = "query_pca_uncentred";
    ASSERT_TRUE(WriteBasis(dir_.string(), basis_).ok());
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string Slurp(const std::string& name) {
    std::ifstream f(dir_ / name, std::ios::binary);
    return {std::istreambuf_iterator<char>(f), {}};
  }
  void Spit(const std::string& name, const std::string& s) {
    std::ofstream f(dir_ / name, std::ios::binary | std::ios::trunc);
    f << s;
  }
  fs::path dir_;
  ModelBasis basis_;
};

TEST_F(BasisFiles, RoundTrip) {
  auto b = ReadBasis(dir_.string());
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(b->manifest.model, "tiny-llama");
  EXPECT_EQ(b->manifest.version, 2);
  EXPECT_EQ(b->manifest.layers, 3);
  EXPECT_EQ(b->manifest.rank, 4);
  EXPECT_EQ(b->u, basis_.u);
  EXPECT_EQ(b->manifest.fingerprint, BasisFingerprint(basis_));
  EXPECT_FALSE(fs::exists(dir_ / "manifest.json.tmp"));
  auto t = b->Truncated(2);
  EXPECT_EQ(t.u.size(), basis_.u.size() / 2);
  EXPECT_EQ(t.head(1, 1)[3 * 2 + 1], basis_.head(1, 1)[3 * 4 + 1]);
}

// The value metric (value metric rounding's [layers][kv][d][d] tensor, stored after the query
// moments) round-trips beside them, enters the fingerprint, and a malformed one is refused
// naming it.
TEST_F(BasisFiles, ValueMetricRoundTripsAndIsChecked) {
  const int d = basis_.manifest.head_dim;
  const size_t n = static_cast<size_t>(basis_.manifest.layers) * basis_.manifest.kv_heads * d * d;
  auto g = kvq::testing::Gaussian(n, 41);
  ModelBasis b = basis_;
  b.query_moment.assign(n, 0.0f);
  b.value_metric.assign(n, 0.0f);
  for (size_t h = 0; h < n / (d * d); ++h)
    for (int a = 0; a < d; ++a)
      for (int c = 0; c < d; ++c) {
        b.query_moment[(h * d + a) * d + c] = a == c ? 1.0f : 0.0f;
        // A Gram-like matrix: symmetric, positive diagonal, and unlike the query moment.
        const float x = g[(h * d + std::min(a, c)) * d + std::max(a, c)];
        b.value_metric[(h * d + a) * d + c] = a == c ? 2.0f + x * x : 0.1f * x;
      }
  const std::string fp_without = BasisFingerprint(basis_);
  ASSERT_TRUE(WriteBasis(dir_.string(), b).ok());
  EXPECT_NE(b.manifest.fingerprint, fp_without);
  EXPECT_EQ(nlohmann::json::parse(Slurp("manifest.json"))["format_version"], 2);
  auto r = ReadBasis(dir_.string());
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->value_metric, b.value_metric);
  EXPECT_EQ(r->query_moment, b.query_moment);
  EXPECT_EQ(r->value_metric_head(2, 1), r->value_metric.data() + (2 * 2 + 1) * d * d);
  EXPECT_EQ(r->Truncated(2).value_metric, b.value_metric);
  // Only the value metric changed on disk: the fingerprint catches a flipped byte of it
  // (the last tensor in the file).
  const std::string good = Slurp("basis.safetensors");
  std::string flipped = good;
  flipped[flipped.size() - 5] ^= 0x40;
  Spit("basis.safetensors", flipped);
  EXPECT_EQ(ReadBasis(dir_.string()).status().code(), absl::StatusCode::kDataLoss);
  // The checks name the tensor, its layer and head.
  ModelBasis bad = b;
  bad.value_metric[(1 * 2 + 0) * d * d + 0 * d + 1] += 1.0f;  // layer 1 head 0 not symmetric
  absl::Status st = CheckBasisTensors(bad.manifest, bad);
  EXPECT_NE(st.message().find("layer 1 head 0: value metric is not symmetric"), std::string::npos)
      << st;
  bad = b;
  bad.value_metric[(2 * 2 + 1) * d * d + 3 * d + 3] = -1.0f;
  st = CheckBasisTensors(bad.manifest, bad);
  EXPECT_NE(st.message().find("layer 2 head 1: value metric diagonal 3 is negative"),
            std::string::npos)
      << st;
  bad = b;
  bad.value_metric.resize(n - d);
  st = CheckBasisTensors(bad.manifest, bad);
  EXPECT_NE(st.message().find("value metric holds"), std::string::npos) << st;
  // A header whose value metric tensor has the wrong shape is refused naming it.
  uint64_t hn;
  std::memcpy(&hn, good.data(), 8);
  auto hj = nlohmann::json::parse(good.substr(8, hn));
  hj["layer.1.value_metric"]["shape"] = {2, d, 4};
  std::string h = hj.dump();
  h.resize(hn, ' ');
  ASSERT_EQ(h.size(), hn);
  Spit("basis.safetensors", good.substr(0, 8) + h + good.substr(8 + hn));
  auto shaped = ReadBasis(dir_.string());
  ASSERT_FALSE(shaped.ok());
  EXPECT_NE(shaped.status().message().find("layer.1.value_metric: shape"), std::string::npos)
      << shaped.status();
}

TEST_F(BasisFiles, RejectsMalformedManifest) {
  const std::string good = Slurp("manifest.json");
  auto expect_bad = [&](const std::string& text, const std::string& needle) {
    Spit("manifest.json", text);
    auto b = ReadBasis(dir_.string());
    ASSERT_FALSE(b.ok()) << text;
    EXPECT_NE(b.status().message().find(needle), std::string::npos) << b.status();
  };
  expect_bad("not json", "not a JSON object");
  auto j = nlohmann::json::parse(good);
  auto with = [&](const char* key, nlohmann::json v) {
    auto c = j;
    c[key] = v;
    return c.dump();
  };
  expect_bad(with("rank", 0), "rank");
  expect_bad(with("rank", 5), "");  // shape no longer matches the tensor data
  expect_bad(with("q_heads", 5), "q_heads");
  expect_bad(with("rope_layout", "sideways"), "rope_layout");
  expect_bad(with("version", 0), "version");
  expect_bad(with("layers", "three"), "mistyped");
  expect_bad(with("fingerprint", "0000000000000000"), "fingerprint");
  auto c = j;
  c.erase("head_dim");
  expect_bad(c.dump(), "missing");
}

TEST_F(BasisFiles, RejectsMalformedTensors) {
  const std::string good = Slurp("basis.safetensors");
  auto expect_bad = [&](const std::string& bytes) {
    Spit("basis.safetensors", bytes);
    EXPECT_FALSE(ReadBasis(dir_.string()).ok());
  };
  expect_bad("");
  expect_bad(good.substr(0, 4));
  expect_bad(good.substr(0, good.size() - 4));  // truncated data
  std::string flipped = good;
  flipped[flipped.size() - 3] ^= 0x40;  // data corrupted: fingerprint catches it
  Spit("basis.safetensors", flipped);
  EXPECT_EQ(ReadBasis(dir_.string()).status().code(), absl::StatusCode::kDataLoss);
  std::string huge_len = good;
  huge_len[7] = 0x7f;  // header length past the end
  expect_bad(huge_len);
  fs::remove(dir_ / "basis.safetensors");
  EXPECT_EQ(ReadBasis(dir_.string()).status().code(), absl::StatusCode::kNotFound);
}

TEST(Calibration, GroupedQueryHeadsFeedTheirKvHead) {
  const int d = 8;
  QueryStats st(1, 4, 2, d);  // query heads 0,1 -> kv 0; 2,3 -> kv 1
  std::vector<float> e0(d, 0.0f), e1(d, 0.0f);
  e0[2] = 1;
  e1[5] = 1;
  for (int i = 0; i < 10; ++i) {
    st.Add(0, 1, e0.data(), 1);
    st.Add(0, 3, e1.data(), 1);
  }
  EXPECT_EQ(st.count(0, 0), 10);  // query rows
  auto b2 = st.Basis(1, {}, BasisManifest{"m"});
  ASSERT_TRUE(b2.ok());
  EXPECT_EQ(b2->manifest.calibration_tokens, 5);  // 10 rows over 2 query heads per KV head
  auto b = st.Basis(1, {}, BasisManifest{"m"});
  ASSERT_TRUE(b.ok());
  EXPECT_NEAR(std::fabs(b->head(0, 0)[2]), 1.0f, 1e-6);
  EXPECT_NEAR(std::fabs(b->head(0, 1)[5]), 1.0f, 1e-6);
  EXPECT_EQ(st.Basis(0, {}, BasisManifest{"m"}).status().code(),
            absl::StatusCode::kInvalidArgument);
}

// One sign convention for every fit: each column's entry of largest magnitude is positive (an
// eigensolver returns either sign, and the side code's rounding depends on it), so a fit of
// the same queries in another channel order is the same basis with its rows permuted, and the
// oblique pair's encode columns flip with their decode columns (A^T B = I is kept).
TEST(Calibration, ColumnSignsFollowTheLargestEntryInEveryChannelOrder) {
  const int d = 16, n = 3000, r = 4;
  std::vector<float> scale(d);
  for (int c = 0; c < d; ++c) scale[c] = 4.0f / (1.0f + c);  // distinct eigenvalues
  auto q = kvq::testing::Gaussian(static_cast<size_t>(n) * d, 11);
  auto e = kvq::testing::Gaussian(static_cast<size_t>(n) * d, 12);
  for (int i = 0; i < n; ++i)
    for (int c = 0; c < d; ++c) {
      q[i * d + c] *= scale[c];
      e[i * d + c] *= 0.5f + 0.1f * (c % 5);
    }
  std::vector<int> perm(d);  // channel c of the permuted rows is channel perm[c] of these
  for (int c = 0; c < d; ++c) perm[c] = (c * 7 + 3) % d;
  std::vector<float> qp(q.size()), ep(e.size());
  for (int i = 0; i < n; ++i)
    for (int c = 0; c < d; ++c) {
      qp[i * d + c] = q[i * d + perm[c]];
      ep[i * d + c] = e[i * d + perm[c]];
    }
  QueryStats st(1, 1, 1, d), sp(1, 1, 1, d);
  st.Add(0, 0, q.data(), n);
  st.AddResidual(0, 0, e.data(), n);
  sp.Add(0, 0, qp.data(), n);
  sp.AddResidual(0, 0, ep.data(), n);
  CalibrationOptions centred, weighted, oblique;
  centred.centred = true;
  weighted.residual_weighted = true;
  oblique.oblique = true;
  for (const CalibrationOptions& o : {CalibrationOptions{}, centred, weighted, oblique}) {
    auto b = st.Basis(r, o, BasisManifest{"m"});
    auto bp = sp.Basis(r, o, BasisManifest{"m"});
    ASSERT_TRUE(b.ok() && bp.ok());
    SCOPED_TRACE(b->manifest.kind);
    for (int j = 0; j < r; ++j) {
      int at = 0;
      for (int c = 1; c < d; ++c)
        if (std::fabs(b->u[c * r + j]) > std::fabs(b->u[at * r + j])) at = c;
      EXPECT_GT(b->u[at * r + j], 0.0f) << "column " << j;
      for (int c = 0; c < d; ++c) {
        EXPECT_NEAR(bp->u[c * r + j], b->u[perm[c] * r + j], 1e-5) << "column " << j;
        if (o.oblique) {
          EXPECT_NEAR(bp->encode[c * r + j], b->encode[perm[c] * r + j], 1e-4) << "column " << j;
        }
      }
    }
  }
}

TEST(Calibration, CentredDiffersFromUncentredWhenQueriesHaveAMean) {
  const int d = 16, n = 2000;
  QueryStats st(1, 1, 1, d);
  auto q = kvq::testing::Gaussian(static_cast<size_t>(n) * d, 3, 0.1f);
  for (int i = 0; i < n; ++i) q[i * d + 0] += 5.0f;  // a large common mean along channel 0
  st.Add(0, 0, q.data(), n);
  auto un = st.Basis(1, {}, BasisManifest{"m"});
  CalibrationOptions c;
  c.centred = true;
  auto ce = st.Basis(1, c, BasisManifest{"m"});
  ASSERT_TRUE(un.ok() && ce.ok());
  EXPECT_GT(std::fabs(un->u[0]), 0.99f);  // uncentred: the mean direction dominates
  EXPECT_LT(std::fabs(ce->u[0]), 0.5f);   // centred: the mean is removed
  EXPECT_EQ(ce->manifest.kind, "query_pca_centred");
}

}  // namespace
}  // namespace kvq::core
