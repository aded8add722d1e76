// Every optimized kernel table against the scalar reference, on odd shapes (ggml's
// test-backend-ops habit): tables this CPU lacks are skipped, never silently passed.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <tuple>
#include <vector>

#include "kvq/core/half.h"
#include "kvq/kernels/kernels.h"
#include "tests/core/test_util.h"

namespace kvq::kernels {
namespace {

std::vector<const KernelTable*> Optimized() {
  std::vector<const KernelTable*> t;
  if (Avx2()) t.push_back(Avx2());
  if (Avx512()) t.push_back(Avx512());
  return t;
}

int64_t RowBytes(int64_t n, int b) { return (n * b + 7) / 8; }

TEST(KernelParity, AtLeastOneOptimizedTableOnThisMachine) {
  // This machine (and CI's) has AVX-512; a build that lost its SIMD tables must fail here.
  EXPECT_FALSE(Optimized().empty());
  EXPECT_STRNE(Best().name, "ref");
}

TEST(KernelParity, QuantizeChannels) {
  for (const KernelTable* kt : Optimized())
    for (int bits : {1, 2, 3, 4, 8})
      for (int tokens : {1, 7, 21, 22, 32, 33, 64, 96, 128})  // partial words too
        for (int n_ch : {4, 5, 19, 64, 80, 128})
          for (bool with_deq : {true, false}) {  // without: the side code's own paths
            SCOPED_TRACE(::testing::Message() << kt->name << " bits=" << bits << " T=" << tokens
                                              << " ch=" << n_ch << " deq=" << with_deq);
            const int ld = n_ch + 3;  // non-contiguous rows
            auto x = kvq::testing::Gaussian(static_cast<size_t>(tokens) * ld, bits * 1000 + n_ch);
            const size_t cb = RowBytes(tokens, bits) * n_ch;
            std::vector<uint16_t> s0(n_ch), z0(n_ch), s1(n_ch), z1(n_ch);
            std::vector<uint8_t> c0(cb, 0xAA), c1(cb, 0x55);
            std::vector<float> d0(tokens * n_ch), d1(tokens * n_ch);
            Ref().quantize_channels(x.data(), ld, tokens, n_ch, bits, s0.data(), z0.data(),
                                    c0.data(), with_deq ? d0.data() : nullptr);
            kt->quantize_channels(x.data(), ld, tokens, n_ch, bits, s1.data(), z1.data(), c1.data(),
                                  with_deq ? d1.data() : nullptr);
            EXPECT_EQ(s0, s1);
            EXPECT_EQ(z0, z1);
            EXPECT_EQ(c0, c1);
            for (size_t i = 0; i < d0.size(); ++i)
              ASSERT_NEAR(d0[i], d1[i], 1e-5f * (1 + std::fabs(d0[i])));
          }
}

TEST(KernelParity, QuantizeRow) {
  for (const KernelTable* kt : Optimized())
    for (int bits : {1, 2, 3, 4, 8})
      for (int n : {64, 80, 128})
        for (int group : {16, 32, 64, n}) {
          SCOPED_TRACE(::testing::Message()
                       << kt->name << " bits=" << bits << " n=" << n << " g=" << group);
          auto x = kvq::testing::Gaussian(n, bits * 7 + n + group);
          const int ng = (n + group - 1) / group;
          std::vector<uint16_t> s0(ng), z0(ng), s1(ng), z1(ng);
          std::vector<uint8_t> c0(RowBytes(n, bits)), c1(RowBytes(n, bits));
          Ref().quantize_row(x.data(), n, group, bits, s0.data(), z0.data(), c0.data());
          kt->quantize_row(x.data(), n, group, bits, s1.data(), z1.data(), c1.data());
          EXPECT_EQ(s0, s1);
          EXPECT_EQ(z0, z1);
          EXPECT_EQ(c0, c1);
        }
}

// The HeadQ side code: r = 4 contiguous channels of 8 bits, no dequantized copy.
TEST(KernelParity, QuantizeSideChannels) {
  for (const KernelTable* kt : Optimized())
    for (int bits : {4, 8})
      for (int tokens : {32, 64, 128}) {
        SCOPED_TRACE(::testing::Message() << kt->name << " bits=" << bits << " T=" << tokens);
        auto x = kvq::testing::Gaussian(static_cast<size_t>(tokens) * 4, bits + tokens);
        for (int t = 0; t < tokens; ++t) x[t * 4 + 2] = 0.25f;  // a constant channel
        const size_t cb = RowBytes(tokens, bits) * 4;
        std::vector<uint16_t> s0(4), z0(4), s1(4), z1(4);
        std::vector<uint8_t> c0(cb, 0xAA), c1(cb, 0x55);
        Ref().quantize_channels(x.data(), 4, tokens, 4, bits, s0.data(), z0.data(), c0.data(),
                                nullptr);
        kt->quantize_channels(x.data(), 4, tokens, 4, bits, s1.data(), z1.data(), c1.data(),
                              nullptr);
        EXPECT_EQ(s0, s1);
        EXPECT_EQ(z0, z1);
        EXPECT_EQ(c0, c1);
      }
}

TEST(KernelParity, QuantizeRowsEqualsRowByRow) {
  for (const KernelTable* kt : Optimized())
    for (int bits : {1, 2, 3, 4, 8})
      for (int n : {64, 80, 128})
        for (int group : {16, 32, n})
          for (int rows : {19, 32, 64}) {
            SCOPED_TRACE(::testing::Message() << kt->name << " bits=" << bits << " n=" << n
                                              << " g=" << group << " rows=" << rows);
            const int ld = n + 3, ng = (n + group - 1) / group;
            const int64_t rec = 4 * ng + RowBytes(n, bits) + 1;  // odd record size
            auto x = kvq::testing::Gaussian(static_cast<size_t>(rows) * ld, bits + n + rows);
            for (int t = 0; t < rows; t += 7) x[t * ld + t % n] = 0.0f;  // equal min and max
            std::vector<uint8_t> r0(rows * rec, 0xAA), r1(rows * rec, 0xAA), r2(rows * rec, 0xAA);
            Ref().quantize_rows(x.data(), ld, rows, n, group, bits, r0.data(), rec);
            kt->quantize_rows(x.data(), ld, rows, n, group, bits, r1.data(), rec);
            for (int t = 0; t < rows; ++t) {
              std::vector<uint16_t> s(ng), z(ng);
              kt->quantize_row(x.data() + t * ld, n, group, bits, s.data(), z.data(),
                               r2.data() + t * rec + 4 * ng);
              std::memcpy(r2.data() + t * rec, s.data(), 2 * ng);
              std::memcpy(r2.data() + t * rec + 2 * ng, z.data(), 2 * ng);
            }
            EXPECT_EQ(r0, r1);
            EXPECT_EQ(r0, r2);
          }
}

TEST(KernelParity, ScoreCodesAndReadoutRows) {
  for (const KernelTable* kt : Optimized())
    for (int bits : {1, 2, 3, 4, 8})
      for (int n_q : {1, 3, 8, 131})
        for (int d : {64, 80, 128}) {
          SCOPED_TRACE(::testing::Message()
                       << kt->name << " bits=" << bits << " nq=" << n_q << " d=" << d);
          const int tokens = 64;
          std::vector<uint8_t> codes(RowBytes(tokens, bits) * d);
          std::mt19937 rng(bits * 31 + n_q + d);
          for (auto& c : codes) c = static_cast<uint8_t>(rng());
          auto w = kvq::testing::Gaussian(n_q * (d + 5), 5 + d);  // query stride d + 5
          std::vector<uint16_t> sc(d), ze(d);
          for (int c = 0; c < d; ++c) {
            sc[c] = static_cast<uint16_t>(0x2c00 + rng() % 0x800);
            ze[c] = static_cast<uint16_t>(0xb000 + rng() % 0x800);
          }
          for (bool acc : {false, true}) {
            std::vector<float> o0(n_q * tokens, 0.5f), o1(n_q * tokens, 0.5f);
            Ref().score_codes(codes.data(), bits, d, tokens, sc.data(), ze.data(), w.data(), d + 5,
                              n_q, 0.125f, acc, o0.data(), tokens);
            kt->score_codes(codes.data(), bits, d, tokens, sc.data(), ze.data(), w.data(), d + 5,
                            n_q, 0.125f, acc, o1.data(), tokens);
            for (size_t i = 0; i < o0.size(); ++i)
              ASSERT_NEAR(o0[i], o1[i], 1e-4f * (1 + std::fabs(o0[i])));
          }

          // Token rows: fp16 scale/zero per group then codes; varying widths per row, or
          // one width (the int16 path of 2- and 3-bit rows): odd and whole row counts, and
          // the blocks of G = 32, 64 and 128 in groups of 32 and 64 channels (the fixed shapes
          // at d = 64 and 128, the run-time shape at d = 80).
          for (auto [group, rows, uniform] :
               {std::tuple{16, 19, false}, std::tuple{16, 19, true}, std::tuple{32, 32, true},
                std::tuple{16, 37, true}, std::tuple{32, 128, true}, std::tuple{64, 128, true},
                std::tuple{64, 32, true}, std::tuple{32, 64, true}, std::tuple{64, 64, true}}) {
            SCOPED_TRACE(::testing::Message()
                         << "group=" << group << " rows=" << rows << " uniform=" << uniform);
            const int ng = (d + group - 1) / group;
            std::vector<uint8_t> rb(rows), buf;
            for (int t = 0; t < rows; ++t) {
              rb[t] = static_cast<uint8_t>(bits == 8 || uniform ? bits : 1 + (t + bits) % 4);
              std::vector<uint8_t> rec(4 * ng + RowBytes(d, rb[t]));
              for (int g = 0; g < 2 * ng; ++g) {
                const uint16_t h = static_cast<uint16_t>(0x3000 + rng() % 0x800);  // modest fp16
                std::memcpy(rec.data() + 2 * g, &h, 2);
              }
              for (size_t j = 4 * ng; j < rec.size(); ++j) rec[j] = static_cast<uint8_t>(rng());
              buf.insert(buf.end(), rec.begin(), rec.end());
            }
            auto p = kvq::testing::Gaussian(n_q * rows, 9);
            std::vector<float> r0(n_q * d, 0.25f), r1(n_q * d, 0.25f);
            Ref().readout_rows(buf.data(), rb.data(), rows, d, group, p.data(), rows, n_q,
                               r0.data(), d);
            kt->readout_rows(buf.data(), rb.data(), rows, d, group, p.data(), rows, n_q, r1.data(),
                             d);
            // The int16 paths round each coefficient to 2^-15 of its (query, group) maximum; the
            // error of a sum of Gaussian weights grows as the square root of the rows summed:
            // 1e-3 per 32 rows.
            const float tol = 1e-3f * std::sqrt(std::max(1.0f, rows / 32.0f));
            for (size_t i = 0; i < r0.size(); ++i)
              ASSERT_NEAR(r0[i], r1[i], tol * (1 + std::fabs(r0[i])));
          }
        }
}

// The int16 paths of 2- and 3-bit keys over every block length they take (16-token tiles,
// pairs of tiles, the constant shapes G = 32, 64 and 128 at d = 64 / 128): the codes are the
// last bytes of their buffer, so a read past a row's end shows under a sanitizer.
TEST(KernelParity, ScoreCodesEveryBlockLength) {
  for (const KernelTable* kt : Optimized())
    for (int bits : {2, 3})
      for (int tokens : {16, 32, 48, 64, 128})
        for (int d : {2, 64, 80, 128})
          for (int n_q : {1, 4, 9}) {
            SCOPED_TRACE(::testing::Message() << kt->name << " bits=" << bits << " T=" << tokens
                                              << " d=" << d << " nq=" << n_q);
            std::mt19937 rng(bits * 131 + tokens * 7 + d + n_q);
            auto codes = std::make_unique<uint8_t[]>(RowBytes(tokens, bits) * d);
            for (int64_t i = 0; i < RowBytes(tokens, bits) * d; ++i)
              codes[i] = static_cast<uint8_t>(rng());
            auto q = kvq::testing::Gaussian(n_q * d, 3 + d);
            std::vector<uint16_t> sc(d), ze(d);
            for (int c = 0; c < d; ++c) {
              sc[c] = static_cast<uint16_t>(0x2c00 + rng() % 0x800);
              ze[c] = static_cast<uint16_t>(0xb000 + rng() % 0x800);
            }
            std::vector<float> o0(n_q * tokens), o1(n_q * tokens);
            Ref().score_codes(codes.get(), bits, d, tokens, sc.data(), ze.data(), q.data(), d, n_q,
                              0.125f, false, o0.data(), tokens);
            kt->score_codes(codes.get(), bits, d, tokens, sc.data(), ze.data(), q.data(), d, n_q,
                            0.125f, false, o1.data(), tokens);
            for (size_t i = 0; i < o0.size(); ++i)
              ASSERT_NEAR(o0[i], o1[i], 1e-4f * (1 + std::fabs(o0[i]))) << i;
          }
}

// The HeadQ side code: rank-4 rows of 4 or 8 bits, contiguous projected queries (stride 4).
TEST(KernelParity, ScoreSideCode) {
  for (const KernelTable* kt : Optimized())
    for (int bits : {4, 8})
      for (int tokens : {32, 64})
        for (int n_q : {1, 3, 8}) {
          SCOPED_TRACE(::testing::Message()
                       << kt->name << " bits=" << bits << " T=" << tokens << " nq=" << n_q);
          std::vector<uint8_t> codes(RowBytes(tokens, bits) * 4);
          std::mt19937 rng(bits + tokens + n_q);
          for (auto& c : codes) c = static_cast<uint8_t>(rng());
          const std::vector<uint16_t> sc = {0x2c00, 0x2e13, 0x3001, 0x2a7f},
                                      ze = {0xb000, 0xb211, 0x3400, 0xae00};
          auto u = kvq::testing::Gaussian(n_q * 4, 21 + n_q);
          for (bool acc : {false, true}) {
            std::vector<float> o0(n_q * tokens, 0.5f), o1(n_q * tokens, 0.5f);
            Ref().score_codes(codes.data(), bits, 4, tokens, sc.data(), ze.data(), u.data(), 4, n_q,
                              -0.125f, acc, o0.data(), tokens);
            kt->score_codes(codes.data(), bits, 4, tokens, sc.data(), ze.data(), u.data(), 4, n_q,
                            -0.125f, acc, o1.data(), tokens);
            for (size_t i = 0; i < o0.size(); ++i)
              ASSERT_NEAR(o0[i], o1[i], 1e-5f * (1 + std::fabs(o0[i])));
          }
        }
}

// A non-finite query or weight must not come out finite from any table (the int16 paths
// round weights on a per-block scale: an infinite or NaN scale makes NaN), in each of their
// shapes: fixed (d = 64 / 128, G = 32 / 64 / 128, groups of 32 / 64) and run-time (d = 80).
TEST(KernelParity, NonFiniteInputsStayNonFinite) {
  for (const KernelTable* kt : Optimized())
    for (auto [bits, d, tokens, group] :
         {std::tuple{2, 64, 32, 32}, std::tuple{2, 128, 128, 64}, std::tuple{3, 64, 64, 32},
          std::tuple{3, 128, 64, 64}, std::tuple{2, 64, 128, 64}, std::tuple{3, 80, 48, 16}})
      for (float bad : {NAN, INFINITY}) {
        SCOPED_TRACE(::testing::Message() << kt->name << " bits=" << bits << " d=" << d << " T="
                                          << tokens << " group=" << group << " bad=" << bad);
        const int n_q = 3;
        std::vector<uint8_t> codes(RowBytes(tokens, bits) * d, 0x6c);
        std::vector<uint16_t> sc(d, 0x2c00), ze(d, 0xb000);
        auto q = kvq::testing::Gaussian(n_q * d, 4);
        q[d + 7] = bad;  // query 1
        std::vector<float> o(n_q * tokens);
        kt->score_codes(codes.data(), bits, d, tokens, sc.data(), ze.data(), q.data(), d, n_q,
                        0.125f, false, o.data(), tokens);
        for (int t = 0; t < tokens; ++t) {
          EXPECT_TRUE(std::isfinite(o[t])) << t;
          EXPECT_FALSE(std::isfinite(o[tokens + t])) << t;
        }
        const int ng = (d + group - 1) / group, rec = 4 * ng + RowBytes(d, bits);
        std::vector<uint8_t> rows(tokens * rec, 0x39);
        std::vector<uint8_t> rb(tokens, bits);
        std::vector<float> p(n_q * tokens, 0.03f), r(n_q * d, 0.0f);
        p[tokens + 5] = bad;
        kt->readout_rows(rows.data(), rb.data(), tokens, d, group, p.data(), tokens, n_q, r.data(),
                         d);
        for (int c = 0; c < d; ++c) {
          EXPECT_TRUE(std::isfinite(r[c])) << c;
          EXPECT_FALSE(std::isfinite(r[d + c])) << c;
        }
      }
}

TEST(KernelParity, DenseAndExp) {
  for (const KernelTable* kt : Optimized())
    for (int d : {64, 80, 128})
      for (int n_q : {1, 3, 8, 19}) {
        SCOPED_TRACE(::testing::Message() << kt->name << " d=" << d << " nq=" << n_q);
        const int T = 111;
        auto kf = kvq::testing::Gaussian(T * d, d + n_q);
        std::vector<uint16_t> k(T * d);
        for (int i = 0; i < T * d; ++i) k[i] = kvq::core::FloatToHalf(kf[i]);
        auto q = kvq::testing::Gaussian(n_q * d, 3);
        std::vector<float> s0(n_q * T), s1(n_q * T);
        Ref().dense_scores_f16(k.data(), T, d, q.data(), n_q, s0.data(), T);
        kt->dense_scores_f16(k.data(), T, d, q.data(), n_q, s1.data(), T);
        for (size_t i = 0; i < s0.size(); ++i)
          ASSERT_NEAR(s0[i], s1[i], 1e-3f * (1 + std::fabs(s0[i])));
        std::vector<float> f0(n_q * T), f1(n_q * T);
        Ref().dense_scores_f32(kf.data(), T, d, q.data(), n_q, f0.data(), T);
        kt->dense_scores_f32(kf.data(), T, d, q.data(), n_q, f1.data(), T);
        for (size_t i = 0; i < f0.size(); ++i)
          ASSERT_NEAR(f0[i], f1[i], 1e-3f * (1 + std::fabs(f0[i])));
        std::vector<float> o0(n_q * d, 0), o1(n_q * d, 0);
        Ref().dense_readout_f16(k.data(), T, d, s0.data(), T, n_q, o0.data(), d);
        kt->dense_readout_f16(k.data(), T, d, s0.data(), T, n_q, o1.data(), d);
        for (size_t i = 0; i < o0.size(); ++i)
          ASSERT_NEAR(o0[i], o1[i], 1e-3f * (1 + std::fabs(o0[i])));
        // The fp32 readout accumulates onto what out holds (here the fp16 readout's result),
        // in order, with the reference's bits on every table (kernels.h).
        std::vector<float> r0(o0), r1(o0), want(o0);
        for (int i = 0; i < n_q; ++i)
          for (int t = 0; t < T; ++t)
            for (int c = 0; c < d; ++c) want[i * d + c] += s0[i * T + t] * kf[t * d + c];
        Ref().dense_readout_f32(kf.data(), T, d, s0.data(), T, n_q, r0.data(), d);
        kt->dense_readout_f32(kf.data(), T, d, s0.data(), T, n_q, r1.data(), d);
        ASSERT_EQ(r0, want);
        ASSERT_EQ(r1, want);
        std::vector<float> e0(s0), e1(s0);
        for (auto& x : e0) x *= 3;
        for (auto& x : e1) x *= 3;
        e0[5] = e1[5] = -1e30f;                                    // underflow must give exactly 0
        const float mx = *std::max_element(e0.begin(), e0.end());  // softmax's shift
        const float sum0 = Ref().exp_sum(e0.data(), e0.size(), mx);
        const float sum1 = kt->exp_sum(e1.data(), e1.size(), mx);
        EXPECT_NEAR(sum0, sum1, 1e-5f * sum0);
        EXPECT_EQ(e1[5], 0.0f);
        for (size_t i = 0; i < e0.size(); ++i) ASSERT_NEAR(e0[i], e1[i], 2e-6f * (1 + e0[i]));
        std::vector<float> m0(s0.begin(), s0.begin() + 37), m1(m0);
        Ref().softmax(m0.data(), 37);
        kt->softmax(m1.data(), 37);
        for (int i = 0; i < 37; ++i) ASSERT_NEAR(m0[i], m1[i], 1e-6f);
      }
}

// U^T q: the reference's bits on every table, each coefficient the in-order sum over channels.
TEST(KernelParity, ProjectQueries) {
  for (int d : {64, 80, 128})
    for (int r : {1, 4, 8}) {
      const int n_q = 5;
      auto q = kvq::testing::Gaussian(n_q * d, d + r);
      auto u = kvq::testing::Gaussian(d * r, 2 * d + r);
      std::vector<float> want(n_q * r);
      for (int i = 0; i < n_q; ++i)
        for (int j = 0; j < r; ++j) {
          float acc = 0;
          for (int c = 0; c < d; ++c) acc += q[i * d + c] * u[c * r + j];
          want[i * r + j] = acc;
        }
      std::vector<float> got(n_q * r, -1.0f);
      Ref().project_queries(q.data(), n_q, d, u.data(), r, got.data());
      EXPECT_EQ(got, want) << "ref d=" << d << " r=" << r;
      for (const KernelTable* kt : Optimized()) {
        std::fill(got.begin(), got.end(), -1.0f);
        kt->project_queries(q.data(), n_q, d, u.data(), r, got.data());
        EXPECT_EQ(got, want) << kt->name << " d=" << d << " r=" << r;
      }
    }
}

// The partial softmax's shift: exact (a max has no rounding), the maximum at every position
// of odd lengths, -inf entries (masked logits) ignored unless all are.
TEST(KernelParity, MaxValue) {
  const float inf = std::numeric_limits<float>::infinity();
  for (const KernelTable* kt : Optimized())
    for (int n : {1, 2, 15, 16, 17, 31, 33, 111, 989}) {
      auto x = kvq::testing::Gaussian(n, n);
      for (int at : {0, n / 2, n - 1}) {
        std::vector<float> y(x);
        y[at] = 50.0f;
        EXPECT_EQ(kt->max_value(y.data(), n), 50.0f) << kt->name << " n=" << n << " at=" << at;
        EXPECT_EQ(kt->max_value(y.data(), n), Ref().max_value(y.data(), n));
      }
      std::vector<float> z(n, -inf);
      z[n - 1] = -3.0f;
      EXPECT_EQ(kt->max_value(z.data(), n), -3.0f) << kt->name << " n=" << n;
      z[n - 1] = -inf;
      EXPECT_EQ(kt->max_value(z.data(), n), -inf) << kt->name << " n=" << n;
    }
}

std::vector<uint8_t> RandomBytes(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<uint8_t> b(n);
  for (auto& x : b) x = static_cast<uint8_t>(rng());
  return b;
}
std::vector<uint16_t> RandomHalves(size_t n, uint32_t seed) {
  auto f = kvq::testing::Gaussian(n, seed);
  std::vector<uint16_t> h(n);
  for (size_t i = 0; i < n; ++i) h[i] = kvq::core::FloatToHalf(f[i]);
  return h;
}

// The decode kernels are bit-identical to the reference (same products and sums in the same
// order), so the floats are compared exactly; rows are written with a stride (ld > n) and the
// cells between them must stay untouched. by_channel writes the same values transposed.
TEST(KernelParity, DequantizeChannels) {
  for (const KernelTable* kt : Optimized())
    for (int bits : {1, 2, 3, 4, 8})
      for (int tokens : {32, 64, 128})
        for (int n_ch : {4, 19, 64, 80, 111, 128})
          for (const bool by_channel : {false, true}) {
            SCOPED_TRACE(::testing::Message() << kt->name << " bits=" << bits << " T=" << tokens
                                              << " ch=" << n_ch << " by_channel=" << by_channel);
            const int64_t ld = (by_channel ? tokens : n_ch) + 3;
            auto codes = RandomBytes(RowBytes(tokens, bits) * n_ch, bits * 100 + n_ch);
            auto sc = RandomHalves(n_ch, 1 + n_ch), ze = RandomHalves(n_ch, 2 + n_ch);
            std::vector<float> o0((by_channel ? n_ch : tokens) * ld, 7.0f), o1(o0);
            Ref().dequantize_channels(codes.data(), bits, n_ch, tokens, sc.data(), ze.data(),
                                      o0.data(), ld, by_channel);
            kt->dequantize_channels(codes.data(), bits, n_ch, tokens, sc.data(), ze.data(),
                                    o1.data(), ld, by_channel);
            ASSERT_EQ(o0, o1);
            EXPECT_EQ(o1[ld - 1], 7.0f);  // between rows
            if (!by_channel) continue;
            std::vector<float> rows(static_cast<size_t>(tokens) * n_ch);
            Ref().dequantize_channels(codes.data(), bits, n_ch, tokens, sc.data(), ze.data(),
                                      rows.data(), n_ch, false);
            for (int t = 0; t < tokens; ++t)
              for (int c = 0; c < n_ch; ++c)
                ASSERT_EQ(o1[c * ld + t], rows[static_cast<size_t>(t) * n_ch + c]) << t << "," << c;
          }
}

TEST(KernelParity, AddLowRank) {
  for (const KernelTable* kt : Optimized())
    for (int bits : {4, 8})
      for (int r : {1, 4, 8, 17})
        for (int d : {19, 64, 80, 128})
          for (float sign : {1.0f, -1.0f})
            for (const bool by_channel : {false, true}) {
              SCOPED_TRACE(::testing::Message()
                           << kt->name << " bits=" << bits << " r=" << r << " d=" << d
                           << " sign=" << sign << " by_channel=" << by_channel);
              const int tokens = r == 4 ? 128 : 32;
              const int64_t ld = (by_channel ? tokens : d) + 5;
              auto codes = RandomBytes(RowBytes(tokens, bits) * r, bits + r + d);
              auto sc = RandomHalves(r, 3 + r), ze = RandomHalves(r, 4 + r);
              auto basis = kvq::testing::Gaussian(d * r, 5 + d, 0.2f);
              auto o0 = kvq::testing::Gaussian((by_channel ? d : tokens) * ld, 6 + d), o1 = o0;
              Ref().add_low_rank(codes.data(), bits, r, tokens, sc.data(), ze.data(), sign,
                                 basis.data(), d, o0.data(), ld, by_channel);
              kt->add_low_rank(codes.data(), bits, r, tokens, sc.data(), ze.data(), sign,
                               basis.data(), d, o1.data(), ld, by_channel);
              ASSERT_EQ(o0, o1);
              if (!by_channel) continue;
              // The same sums as token rows: start both from zero and compare transposed.
              std::vector<float> cm(static_cast<size_t>(d) * tokens, 0.0f),
                  tm(static_cast<size_t>(tokens) * d, 0.0f);
              kt->add_low_rank(codes.data(), bits, r, tokens, sc.data(), ze.data(), sign,
                               basis.data(), d, cm.data(), tokens, true);
              kt->add_low_rank(codes.data(), bits, r, tokens, sc.data(), ze.data(), sign,
                               basis.data(), d, tm.data(), d, false);
              for (int t = 0; t < tokens; ++t)
                for (int c = 0; c < d; ++c)
                  ASSERT_EQ(cm[static_cast<size_t>(c) * tokens + t],
                            tm[static_cast<size_t>(t) * d + c]);
            }
}

TEST(KernelParity, DequantizeRows) {
  for (const KernelTable* kt : Optimized())
    for (int n : {19, 64, 80, 128})
      for (int group : {16, 19, 32, 64, 128})
        for (int n_rows : {1, 31, 128}) {
          if (group > n) continue;
          SCOPED_TRACE(::testing::Message()
                       << kt->name << " n=" << n << " group=" << group << " rows=" << n_rows);
          const int ng = (n + group - 1) / group;
          std::mt19937 rng(n * 7 + group + n_rows);
          const int widths[] = {1, 2, 3, 4, 8};
          std::vector<uint8_t> bits(n_rows), rec;
          for (int t = 0; t < n_rows; ++t) {
            bits[t] = static_cast<uint8_t>(widths[rng() % 5]);
            auto sz = RandomHalves(2 * ng, rng());
            const size_t at = rec.size();
            rec.resize(at + 4 * ng);
            std::memcpy(rec.data() + at, sz.data(), 4 * ng);  // odd record sizes: odd addresses
            auto codes = RandomBytes(RowBytes(n, bits[t]), rng());
            rec.insert(rec.end(), codes.begin(), codes.end());
          }
          const int64_t ld = n + 1;
          std::vector<float> o0(n_rows * ld, 7.0f), o1(o0);
          Ref().dequantize_rows(rec.data(), bits.data(), n_rows, n, group, o0.data(), ld);
          kt->dequantize_rows(rec.data(), bits.data(), n_rows, n, group, o1.data(), ld);
          ASSERT_EQ(o0, o1);
          EXPECT_EQ(o1[n], 7.0f);
        }
}

TEST(KernelParity, ChecksumsAgree) {
  std::vector<uint8_t> buf(5000);
  std::mt19937 rng(3);
  for (auto& b : buf) b = static_cast<uint8_t>(rng());
  for (const KernelTable* kt : Optimized())
    for (size_t n : {size_t{0}, size_t{1}, size_t{17}, size_t{240}, size_t{241}, size_t{4999}})
      EXPECT_EQ(kt->xxh3(buf.data(), n, 42), Ref().xxh3(buf.data(), n, 42)) << kt->name << n;
}

}  // namespace
}  // namespace kvq::kernels
