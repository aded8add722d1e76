// The codec's quality levers: the Hadamard rotation of keys and values (version-3 blocks) and
// the oblique encode/decode basis pair of the side code.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <string>
#include <utility>

#include "core/src/codec/hadamard.h"
#include "kvq/core/basis.h"
#include "kvq/core/cache.h"
#include "kvq/core/calibration.h"
#include "kvq/core/codec.h"
#include "kvq/kernels/kernels.h"
#include "test_util.h"

namespace kvq::core {
namespace {
using kvq::testing::DenseAttend;
using kvq::testing::Gaussian;
using kvq::testing::View3;

// Keys and values with one outlier channel (what RoPE'd keys and many values look like).
std::vector<float> WithOutlierChannel(size_t tokens, int d, uint32_t seed, int channel,
                                      float size) {
  auto x = Gaussian(tokens * d, seed);
  for (size_t t = 0; t < tokens; ++t) x[t * d + channel] += size * (1.0f + 0.1f * (t % 3));
  return x;
}

double Mse(const std::vector<float>& a, const std::vector<float>& b) {
  double s = 0;
  for (size_t i = 0; i < a.size(); ++i) s += (a[i] - b[i]) * (a[i] - b[i]);
  return s / a.size();
}

// The rotation every rotated block is encoded and read with gives, on every path (16-lane
// vectors where the CPU has AVX-512, 8-lane where it has AVX2, the dispatch among them, and
// rows held by channel),
// the bits of the butterfly loop that defines it (hadamard::Scalar): blocks written on one
// machine read the same on another.
TEST(Rotation, EveryPathGivesTheDefiningLoopsBits) {
  int vector_paths = 0;
  for (const int d : {2, 4, 8, 16, 32, 64, 128, 256, 512}) {
    SCOPED_TRACE(d);
    const int rows = 7;
    std::vector<float> x = Gaussian(static_cast<size_t>(rows) * d, d);
    for (size_t i = 0; i < x.size(); i += 5) x[i] *= 1e4f;  // mixed magnitudes: rounding matters
    std::vector<float> want = x;                            // the defining loop, row by row
    for (int t = 0; t < rows; ++t) hadamard::Scalar(want.data() + static_cast<size_t>(t) * d, d);
    std::vector<float> back = want;  // H is its own inverse
    for (int t = 0; t < rows; ++t) hadamard::Scalar(back.data() + static_cast<size_t>(t) * d, d);
    for (size_t i = 0; i < back.size(); ++i) ASSERT_NEAR(back[i], x[i], 1e-5f * 1e4f) << i;
    std::vector<float> got = x;
    HadamardRotateRows(got.data(), d, rows, d);  // the dispatched path
    for (size_t i = 0; i < got.size(); ++i) ASSERT_EQ(got[i], want[i]) << "element " << i;
    std::vector<float> by_channel(x.size());  // the rows held by channel: [d][rows]
    for (int t = 0; t < rows; ++t)
      for (int c = 0; c < d; ++c) by_channel[static_cast<size_t>(c) * rows + t] = x[t * d + c];
    hadamard::RotateColumns(by_channel.data(), d, rows);
    for (int t = 0; t < rows; ++t)
      for (int c = 0; c < d; ++c)
        ASSERT_EQ(by_channel[static_cast<size_t>(c) * rows + t], want[t * d + c]) << t << "," << c;
    using Path = bool (*)(float*, int);
    const std::pair<const char*, Path> paths[] = {{"avx2", hadamard::Avx2},
                                                  {"avx512", hadamard::Avx512}};
    for (const auto& [name, path] : paths) {
      SCOPED_TRACE(name);
      got = x;
      bool ran = true;
      for (int t = 0; t < rows && ran; ++t) ran = path(got.data() + static_cast<size_t>(t) * d, d);
      if (!ran) {
        ASSERT_EQ(got, x) << "a path that does not run leaves the row untouched";
        continue;
      }
      ++vector_paths;
      for (size_t i = 0; i < got.size(); ++i) ASSERT_EQ(got[i], want[i]) << "element " << i;
    }
  }
  // Every CI machine has AVX2 (the x86-64 hosts this project targets): a path that silently
  // never ran would make this test vacuous.
  EXPECT_GT(vector_paths, 0);
}

TEST(Rotation, NeedsAPowerOfTwoHeadDim) {
  CodecOptions o;
  o.head_dim = 80;
  o.rotate_values = true;
  const absl::Status s = o.Validate();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("head_dim"), std::string::npos) << s;
  o.head_dim = 128;
  EXPECT_TRUE(o.Validate().ok());
}

// Per-token value groups see the outlier channel's range in every token; rotated, the outlier
// is spread over all channels and the same bits reconstruct the values far better.
TEST(Rotation, RotatedValuesReconstructOutlierChannelsBetter) {
  const int d = 64, G = 32;
  CodecOptions o;
  o.value_bits = 2;
  o.value_group = 32;
  auto v = WithOutlierChannel(G, d, 3, 5, 20.0f);
  std::vector<float> plain(v.size()), rotated(v.size());
  for (bool rot : {false, true}) {
    o.rotate_values = rot;
    std::vector<uint8_t> blk;
    ASSERT_TRUE(EncodeValueBlock(o, v.data(), d, nullptr, &blk).ok());
    EXPECT_EQ(blk.size(), ValueBlockBytes(o));  // the rotation costs no bytes
    EXPECT_EQ(blk[2], rot ? format::kVersionFlags : format::kVersion);
    auto view = ParseValueBlock(blk, o, true);
    ASSERT_TRUE(view.ok()) << view.status();
    DecodeValueBlock(*view, rot ? rotated.data() : plain.data());
  }
  EXPECT_LT(Mse(rotated, v), 0.5 * Mse(plain, v));
}

// Scores, readouts and the fused attend over rotated blocks equal dense attention over the
// cache's own decoded keys and values (the rotation is undone exactly where it must be).
TEST(Rotation, ReadPathsAgreeWithDecodedKeysAndValues) {
  for (bool rk : {false, true})
    for (bool rv : {false, true})
      for (int rank : {0, 4}) {
        SCOPED_TRACE(::testing::Message()
                     << "rotate_keys=" << rk << " rotate_values=" << rv << " rank=" << rank);
        const int kv = 2, gq = 3, qh = kv * gq, d = 64, nq = 2;
        const int64_t T = 75;
        CodecOptions o;
        o.rank = rank;
        o.rotate_keys = rk;
        o.rotate_values = rv;
        auto basis = RandomBasis({"t", 1, 1, kv, qh, d, 4}, 11);
        LayerCache cache(o, kv, rank > 0 ? basis.u.data() : nullptr);
        auto k = WithOutlierChannel(kv * T, d, 1, 7, 6.0f), v = Gaussian(kv * T * d, 2);
        ASSERT_TRUE(cache.Append(View3(k, kv, T, d), View3(v, kv, T, d), 0).ok());
        auto q = Gaussian(static_cast<size_t>(qh) * nq * d, 3);
        std::vector<float> kd, vd;
        ASSERT_TRUE(cache.Decode(&kd, &vd).ok());
        // Decoded keys are near the originals (rotated back), not in rotated coordinates.
        EXPECT_LT(Mse(kd, k), 0.2);
        std::vector<float> out(static_cast<size_t>(qh) * nq * d);
        AttendOptions ao;
        ASSERT_TRUE(cache.Attend(q.data(), qh, nq, ao, out.data()).ok());
        auto ref = DenseAttend(kd, vd, q, kv, qh, nq, T, d, -1);
        for (size_t i = 0; i < out.size(); ++i) ASSERT_NEAR(out[i], ref[i], 5e-4f) << i;
        std::vector<float> s(static_cast<size_t>(qh) * nq * T);
        ASSERT_TRUE(cache.Score(q.data(), qh, nq, s.data(), 1.0f).ok());
        for (int h = 0; h < qh; ++h)
          for (int i = 0; i < nq; ++i)
            for (int64_t t = 0; t < T; ++t) {
              double dot = 0;
              const float* qi = q.data() + (static_cast<size_t>(h) * nq + i) * d;
              const float* kt = kd.data() + (static_cast<size_t>(h / gq) * T + t) * d;
              for (int c = 0; c < d; ++c) dot += double(qi[c]) * kt[c];
              ASSERT_NEAR(s[(static_cast<size_t>(h) * nq + i) * T + t], dot,
                          2e-3 * (1 + std::fabs(dot)));
            }
      }
}

// LayerCache rotates the queries once per call and the summed readout once per call; the
// standalone block functions rotate per block. Both give the same scores (bit for bit: the
// same rotation of the same queries) and the same readouts (up to float summation order),
// and the standalone functions given pre-rotated input / asked for rotated output agree too.
TEST(Rotation, HoistedRotationMatchesThePerBlockPath) {
  const int kv = 2, gq = 2, qh = kv * gq, d = 64, nq = 3, G = 32, rank = 4;
  const int64_t T = 96;  // three blocks, no window: every token is read from blocks
  CodecOptions o;
  o.rank = rank;
  o.rotate_keys = true;
  o.rotate_values = true;
  auto basis = RandomBasis({"t", 1, 1, kv, qh, d, rank}, 5);
  LayerCache cache(o, kv, basis.u.data());
  auto k = WithOutlierChannel(kv * T, d, 8, 3, 6.0f),
       v = WithOutlierChannel(kv * T, d, 9, 11, 4.0f);
  ASSERT_TRUE(cache.Append(View3(k, kv, T, d), View3(v, kv, T, d), 0).ok());
  auto q = Gaussian(static_cast<size_t>(qh) * nq * d, 10);
  auto p = Gaussian(static_cast<size_t>(qh) * nq * T, 11, 0.1f, 0.02f);
  std::vector<float> scores(static_cast<size_t>(qh) * nq * T),
      outs(static_cast<size_t>(qh) * nq * d);
  ASSERT_TRUE(cache.Score(q.data(), qh, nq, scores.data(), 1.0f).ok());
  ASSERT_TRUE(cache.Readout(p.data(), qh, nq, outs.data()).ok());
  const int rows = gq * nq;
  for (int h = 0; h < kv; ++h) {
    const float* qh_rows = q.data() + static_cast<size_t>(h) * rows * d;
    std::vector<float> uq(static_cast<size_t>(rows) * rank, 0.0f);
    const float* U = basis.head(0, h);
    for (int i = 0; i < rows; ++i)
      for (int c = 0; c < d; ++c)
        for (int j = 0; j < rank; ++j) uq[i * rank + j] += qh_rows[i * d + c] * U[c * rank + j];
    std::vector<float> rq(qh_rows, qh_rows + static_cast<size_t>(rows) * d);
    HadamardRotateRows(rq.data(), d, rows, d);
    std::vector<float> per_block(static_cast<size_t>(rows) * T), pre_rotated(per_block.size());
    std::vector<float> out_per_block(static_cast<size_t>(rows) * d, 0.0f),
        out_rotated(out_per_block);
    const float* ph = p.data() + static_cast<size_t>(h) * rows * T;
    int64_t voff = 0;
    for (int b = 0; b < T / G; ++b) {
      const Bytes& kb = cache.key_blocks(h);
      auto kview = ParseKeyBlock({kb.data() + b * KeyBlockBytes(o), KeyBlockBytes(o)}, o, true);
      ASSERT_TRUE(kview.ok()) << kview.status();
      ScoreKeyBlock(*kview, qh_rows, uq.data(), rows, 1.0f, per_block.data() + b * G, T);
      ScoreKeyBlock(*kview, rq.data(), uq.data(), rows, 1.0f, pre_rotated.data() + b * G, T, true,
                    /*q_rotated=*/true);
      const Bytes& vb = cache.value_blocks(h);
      auto vview = ParseValueBlock({vb.data() + voff, ValueBlockBytes(o)}, o, true);
      ASSERT_TRUE(vview.ok()) << vview.status();
      voff += ValueBlockBytes(o);
      ReadoutValueBlock(*vview, ph + b * G, T, rows, out_per_block.data(), d);
      ReadoutValueBlock(*vview, ph + b * G, T, rows, out_rotated.data(), d, /*out_rotated=*/true);
    }
    HadamardRotateRows(out_rotated.data(), d, rows, d);
    const std::vector<float> got(scores.begin() + h * rows * T,
                                 scores.begin() + (h + 1) * rows * T);
    EXPECT_EQ(got, per_block);
    EXPECT_EQ(pre_rotated, per_block);
    for (int i = 0; i < rows * d; ++i) {
      const float cached = outs[static_cast<size_t>(h) * rows * d + i];
      ASSERT_NEAR(cached, out_per_block[i], 1e-5f * (1 + std::fabs(out_per_block[i])))
          << h << " " << i;
      ASSERT_NEAR(out_rotated[i], out_per_block[i], 1e-5f * (1 + std::fabs(out_per_block[i])));
    }
  }
}

TEST(Rotation, FlagMismatchAndUnknownFlagsAreRejected) {
  CodecOptions o;
  o.rotate_keys = true;
  auto k = Gaussian(32 * 64, 4);
  std::vector<uint8_t> blk;
  ASSERT_TRUE(EncodeKeyBlock(o, k.data(), 64, nullptr, &blk).ok());
  ASSERT_TRUE(ParseKeyBlock(blk, o, true).ok());
  CodecOptions plain;
  auto s = ParseKeyBlock(blk, plain, true);
  EXPECT_EQ(s.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_NE(s.status().message().find("rotated"), std::string::npos) << s.status();
  // An unknown flag, or a flag in a version-2 header, is corruption, never a silent read.
  auto bad = blk;
  bad[3] |= 0x20;
  EXPECT_EQ(VerifyBlock(bad).code(), absl::StatusCode::kDataLoss);
  bad = blk;
  bad[2] = format::kVersion;
  EXPECT_EQ(ParseKeyBlock(bad, o, false).status().code(), absl::StatusCode::kDataLoss);
  EXPECT_TRUE(VerifyBlock(blk).ok());
}

// Reduced-rank regression: with an anisotropic residual (one channel carries most of the
// quantization error) the oblique pair has a lower mean squared score error than the query
// PCA of the same rank, and keeps A^T B = I.
TEST(Oblique, BeatsQueryPcaWhenTheResidualIsAnisotropic) {
  const int d = 16, n = 4000, r = 2;
  QueryStats st(1, 1, 1, d);
  auto q = Gaussian(static_cast<size_t>(n) * d, 5);
  for (int i = 0; i < n; ++i) {  // queries: most energy on channels 0 and 1
    q[i * d + 0] *= 4.0f;
    q[i * d + 1] *= 3.0f;
  }
  st.Add(0, 0, q.data(), n);
  auto e = Gaussian(static_cast<size_t>(n) * d, 6, 0.1f);
  for (int i = 0; i < n; ++i) e[i * d + 9] *= 40.0f;  // the residual: large on channel 9
  st.AddResidual(0, 0, e.data(), n);
  CalibrationOptions oo;
  oo.oblique = true;
  auto obl = st.Basis(r, oo, BasisManifest{"m"});
  auto pca = st.Basis(r, {}, BasisManifest{"m"});
  ASSERT_TRUE(obl.ok() && pca.ok()) << obl.status();
  EXPECT_EQ(obl->manifest.kind, "oblique_rrr");
  ASSERT_TRUE(obl->oblique());
  const float* B = obl->head(0, 0);
  const float* A = obl->encode_head(0, 0);
  for (int i = 0; i < r; ++i)
    for (int j = 0; j < r; ++j) {
      double dot = 0;
      for (int c = 0; c < d; ++c) dot += double(A[c * r + i]) * B[c * r + j];
      EXPECT_NEAR(dot, i == j ? 1.0 : 0.0, 1e-4);
    }
  // Mean squared score error of what the side code leaves: q . (e - B A^T e).
  auto score_error = [&](const float* dec, const float* enc) {
    double s = 0;
    for (int t = 0; t < n; ++t) {
      std::vector<double> left(e.begin() + t * d, e.begin() + (t + 1) * d);
      for (int j = 0; j < r; ++j) {
        double c = 0;
        for (int a = 0; a < d; ++a) c += enc[a * r + j] * double(e[t * d + a]);
        for (int a = 0; a < d; ++a) left[a] -= dec[a * r + j] * c;
      }
      double dot = 0;
      for (int a = 0; a < d; ++a) dot += q[t * d + a] * left[a];
      s += dot * dot;
    }
    return s / n;
  };
  const double pca_err = score_error(pca->head(0, 0), pca->head(0, 0));
  const double obl_err = score_error(B, A);
  EXPECT_LT(obl_err, 0.8 * pca_err) << "oblique " << obl_err << " vs PCA " << pca_err;
  // Without residual statistics there is nothing to weigh: a clear error.
  QueryStats none(1, 1, 1, d);
  none.Add(0, 0, q.data(), n);
  EXPECT_EQ(none.Basis(r, oo, BasisManifest{"m"}).status().code(),
            absl::StatusCode::kFailedPrecondition);
}

// The pair survives the registry's files and truncation, and a cache encodes with A and
// scores/decodes with B: Score equals q . decoded keys.
TEST(Oblique, FilesTruncationAndCacheReadPaths) {
  const int d = 16, n = 3000, kv = 1;
  QueryStats st(1, 2, kv, d);
  auto q = Gaussian(static_cast<size_t>(n) * d, 8);
  for (int i = 0; i < n; ++i) q[i * d + 3] *= 5.0f;
  st.Add(0, 0, q.data(), n);
  st.Add(0, 1, q.data(), n);
  auto e = Gaussian(static_cast<size_t>(n) * d, 9, 0.2f);
  for (int i = 0; i < n; ++i) e[i * d + 4] *= 10.0f;
  st.AddResidual(0, 0, e.data(), n);
  CalibrationOptions oo;
  oo.oblique = true;
  oo.keep_query_moment = true;
  auto b = st.Basis(4, oo, BasisManifest{"m", 1, 1, kv, 2, d, 4});
  ASSERT_TRUE(b.ok()) << b.status();
  ASSERT_EQ(b->query_moment.size(), static_cast<size_t>(d) * d);
  EXPECT_NEAR(b->query_moment[3 * d + 3], 25.0, 2.5);  // E[q_3^2] of the 5x channel
  ASSERT_TRUE(b.ok()) << b.status();
  const std::string dir = ::testing::TempDir() + "/kvq_oblique_" + std::to_string(::getpid());
  ASSERT_TRUE(WriteBasis(dir, *b).ok());
  auto back = ReadBasis(dir);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->u, b->u);
  EXPECT_EQ(back->encode, b->encode);
  EXPECT_EQ(back->query_moment, b->query_moment);
  EXPECT_EQ(back->manifest.fingerprint, b->manifest.fingerprint);
  ModelBasis t = back->Truncated(2);
  ASSERT_TRUE(t.oblique());
  EXPECT_EQ(t.encode.size(), t.u.size());
  // A corrupted encode basis (fingerprint rewritten to match) fails the biorthogonality check.
  ModelBasis broken = *b;
  for (float& x : broken.encode) x *= 1.5f;
  ASSERT_TRUE(WriteBasis(dir, broken).ok());
  auto rb = ReadBasis(dir);
  EXPECT_EQ(rb.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(rb.status().message().find("biorthogonal"), std::string::npos) << rb.status();

  CodecOptions o;
  o.head_dim = d;
  o.rank = 4;
  o.side_bits = 8;
  o.value_group = d;
  LayerCache cache(o, kv, b->head(0, 0), nullptr, b->encode_head(0, 0));
  const int64_t T = 64;
  auto k = Gaussian(T * d, 10);
  const absl::Status appended = cache.Append(View3(k, kv, T, d), View3(k, kv, T, d), 0);
  ASSERT_TRUE(appended.ok()) << appended;
  std::vector<float> kd, vd, s(T);
  ASSERT_TRUE(cache.Decode(&kd, &vd).ok());
  ASSERT_TRUE(cache.Score(q.data(), 1, 1, s.data(), 1.0f).ok());
  for (int64_t t = 0; t < T; ++t) {
    double dot = 0;
    for (int c = 0; c < d; ++c) dot += double(q[c]) * kd[t * d + c];
    EXPECT_NEAR(s[t], dot, 1e-3 * (1 + std::fabs(dot)));
  }
  std::filesystem::remove_all(dir);
}

// Metric rounding: the same block layout and read paths, and a lower score error for
// queries of the metric's distribution (at a higher plain key MSE: the error is moved where
// queries do not look), with and without a side code and rotation.
TEST(MetricRounding, LowersTheScoreErrorInTheQueryMetric) {
  const int d = 64, G = 32, n_q = 400;
  // Queries concentrated on a few random directions (like real heads).
  auto dirs = Gaussian(static_cast<size_t>(6) * d, 21);
  auto coef = Gaussian(static_cast<size_t>(n_q) * 6, 22);
  std::vector<float> q(static_cast<size_t>(n_q) * d, 0.0f),
      moment(static_cast<size_t>(d) * d, 0.0f);
  auto noise = Gaussian(q.size(), 23, 0.05f);
  for (int i = 0; i < n_q; ++i)
    for (int c = 0; c < d; ++c) {
      float x = noise[i * d + c];
      for (int j = 0; j < 6; ++j) x += coef[i * 6 + j] * dirs[j * d + c] * (6 - j);
      q[i * d + c] = x;
    }
  double energy = 0;  // unit mean |q|^2, so that logits are O(1) like the other tests'
  for (float x : q) energy += double(x) * x;
  for (float& x : q) x /= std::sqrt(energy / n_q);
  for (int i = 0; i < n_q; ++i)
    for (int a = 0; a < d; ++a)
      for (int c = 0; c < d; ++c) moment[a * d + c] += q[i * d + a] * q[i * d + c] / n_q;
  auto basis = RandomBasis({"t", 1, 1, 1, 1, d, 4}, 3);
  for (bool rotate : {false, true})
    for (int rank : {0, 4}) {
      SCOPED_TRACE(::testing::Message() << "rotate=" << rotate << " rank=" << rank);
      const int64_t T = 4 * G;
      auto k = WithOutlierChannel(T, d, 30, 2, 4.0f);
      double err[2], mse[2];
      for (int mr = 0; mr < 2; ++mr) {
        CodecOptions o;
        o.rank = rank;
        o.rotate_keys = rotate;
        o.metric_rounding = mr == 1;
        LayerCache cache(o, 1, rank > 0 ? basis.u.data() : nullptr, nullptr, nullptr,
                         moment.data());
        ASSERT_TRUE(cache.Append(View3(k, 1, T, d), View3(k, 1, T, d), 0).ok());
        std::vector<float> kd, vd, s(static_cast<size_t>(n_q) * T);
        ASSERT_TRUE(cache.Decode(&kd, &vd).ok());
        ASSERT_TRUE(cache.Score(q.data(), 1, n_q, s.data(), 1.0f).ok());
        err[mr] = mse[mr] = 0;
        for (int64_t t = 0; t < T; ++t)
          for (int c = 0; c < d; ++c)
            mse[mr] += (kd[t * d + c] - k[t * d + c]) * (kd[t * d + c] - k[t * d + c]);
        for (int i = 0; i < n_q; ++i)
          for (int64_t t = 0; t < T; ++t) {
            double exact = 0, decoded = 0;
            for (int c = 0; c < d; ++c) {
              exact += double(q[i * d + c]) * k[t * d + c];
              decoded += double(q[i * d + c]) * kd[t * d + c];
            }
            // The read path scores exactly the decoded keys (the layout is unchanged).
            ASSERT_NEAR(s[i * T + t], decoded, 5e-4 * (1 + std::fabs(decoded)));
            err[mr] += (exact - decoded) * (exact - decoded);
          }
      }
      EXPECT_LT(err[1], 0.7 * err[0]) << "metric rounding " << err[1] << " vs nearest " << err[0];
      EXPECT_GT(mse[1], mse[0]);
    }
}

// Value metric rounding with a diagonal metric has no error feedback: every code is the
// nearest level, exactly the codes nearest rounding writes (the invariant that says the rule
// only ever departs from nearest rounding where the metric couples channels), for uniform and
// A^2 per-token widths, rotated or not.
TEST(ValueMetricRounding, ADiagonalMetricWritesNearestRoundingsBlock) {
  const int d = 64, G = 32;
  auto v = WithOutlierChannel(G, d, 50, 5, 3.0f);
  std::vector<float> diag(static_cast<size_t>(d) * d, 0.0f);
  for (int c = 0; c < d; ++c) diag[c * d + c] = 1.0f + 0.5f * (c % 7);  // diagonal, not I
  std::vector<uint8_t> widths(G);
  for (int t = 0; t < G; ++t) widths[t] = static_cast<uint8_t>(1 + t % 4);
  for (bool a2 : {false, true})
    for (bool rotate : {false, true})
      for (int bits : {2, 3}) {
        SCOPED_TRACE(::testing::Message()
                     << "a2=" << a2 << " rotate=" << rotate << " bits=" << bits);
        CodecOptions o;
        o.value_bits = bits;
        o.rotate_values = rotate;
        if (a2) o.value_policy = ValuePolicy::kA2;
        // A rotated diagonal metric is no longer diagonal; H D H's factor would couple them,
        // so the rotated case uses the identity (H I H = I).
        std::vector<float> m = diag;
        if (rotate)
          for (int c = 0; c < d; ++c) m[c * d + c] = 1.0f;
        const std::vector<float> f = ValueRoundingFactor(m.data(), d, rotate);
        std::vector<uint8_t> nearest, rounded;
        ASSERT_TRUE(EncodeValueBlock(o, v.data(), d, a2 ? widths.data() : nullptr, &nearest).ok());
        ASSERT_TRUE(
            EncodeValueBlock(o, v.data(), d, a2 ? widths.data() : nullptr, &rounded, f.data())
                .ok());
        EXPECT_EQ(rounded, nearest);
      }
}

// With a metric that couples channels (a few strong directions, as W_o^T W_o has), value
// metric rounding lowers the value error measured in that metric, at a higher plain MSE,
// through the cache's encode path (the same block layout and decoder), for uniform widths
// and the A^2 policy's per-token widths.
TEST(ValueMetricRounding, LowersTheValueErrorInASkewedMetric) {
  const int d = 64, G = 32, dirs_n = 6;
  auto dirs = Gaussian(static_cast<size_t>(dirs_n) * d, 61);
  std::vector<float> metric(static_cast<size_t>(d) * d, 0.0f);
  for (int j = 0; j < dirs_n; ++j)
    for (int a = 0; a < d; ++a)
      for (int c = 0; c < d; ++c)
        metric[a * d + c] += dirs[j * d + a] * dirs[j * d + c] * float((dirs_n - j) * (dirs_n - j));
  for (int c = 0; c < d; ++c) metric[c * d + c] += 0.05f;
  auto metric_error = [&](const std::vector<float>& x, const std::vector<float>& y, int64_t T) {
    double s = 0;
    std::vector<double> e(d);
    for (int64_t t = 0; t < T; ++t) {
      for (int c = 0; c < d; ++c) e[c] = double(x[t * d + c]) - y[t * d + c];
      for (int a = 0; a < d; ++a)
        for (int c = 0; c < d; ++c) s += e[a] * metric[a * d + c] * e[c];
    }
    return s;
  };
  for (bool a2 : {false, true})
    for (int bits : {2, 3}) {
      SCOPED_TRACE(::testing::Message() << "a2=" << a2 << " bits=" << bits);
      const int64_t T = 4 * G;
      auto v = WithOutlierChannel(T, d, 70, 9, 2.0f);
      double err[2], mse[2];
      for (int vmr = 0; vmr < 2; ++vmr) {
        CodecOptions o;
        o.value_bits = bits;
        if (a2) {
          o.value_policy = ValuePolicy::kA2;
          o.value_budget = static_cast<float>(bits);
        }
        LayerCache cache(o, 1, nullptr, nullptr, nullptr, nullptr,
                         vmr == 1 ? metric.data() : nullptr);
        ASSERT_TRUE(cache.Append(View3(v, 1, T, d), View3(v, 1, T, d), 0).ok());
        std::vector<float> kd, vd;
        ASSERT_TRUE(cache.Decode(&kd, &vd).ok());
        err[vmr] = metric_error(v, vd, T);
        mse[vmr] = Mse(v, vd);
      }
      EXPECT_LT(err[1], 0.8 * err[0])
          << "value metric rounding " << err[1] << " vs nearest " << err[0];
      EXPECT_GT(mse[1], mse[0]);
    }
}

// The value metric given to the cache is the whole switch: without one the encoder rounds to
// nearest, with one it rounds in its metric, and the codec settings are the same either way.
TEST(ValueMetricRounding, TheMetricAloneSwitchesIt) {
  const int d = 64, G = 32;
  auto v = WithOutlierChannel(2 * G, d, 80, 1, 2.0f);
  std::vector<float> metric(static_cast<size_t>(d) * d, 0.5f);
  for (int c = 0; c < d; ++c) metric[c * d + c] = 1.0f;
  auto decoded = [&](const float* m) {
    CodecOptions o;
    LayerCache cache(o, 1, nullptr, nullptr, nullptr, nullptr, m);
    EXPECT_TRUE(cache.Append(View3(v, 1, 2 * G, d), View3(v, 1, 2 * G, d), 0).ok());
    std::vector<float> kd, vd;
    EXPECT_TRUE(cache.Decode(&kd, &vd).ok());
    return vd;
  };
  const auto nearest = decoded(nullptr);
  EXPECT_EQ(decoded(nullptr), nearest);
  EXPECT_NE(decoded(metric.data()), nearest);
}

}  // namespace
}  // namespace kvq::core
