// Attention sinks kept at fp16 (CodecOptions::fp16_sinks): the first group's blocks encode a
// stand-in for positions [0, S) and every read path uses the exact rows instead.
#include <gtest/gtest.h>

#include <cmath>

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

constexpr int kKv = 2, kGq = 3, kQh = kKv * kGq, kD = 64, kS = 4;

float Fp16(float x) {
  uint16_t h;
  FromFloat(DType::kF16, &x, &h, 1);
  ToFloat(DType::kF16, &h, &x, 1);
  return x;
}

// Keys and values [kv][T][d] whose first position is an outlier (as real sinks are).
struct Rows {
  int64_t T;
  std::vector<float> k, v;
  Rows(int64_t tokens, uint32_t seed, float sink_size) : T(tokens) {
    k = Gaussian(kKv * T * kD, seed);
    v = Gaussian(kKv * T * kD, seed + 1);
    for (int h = 0; h < kKv; ++h)
      for (int c = 0; c < kD; ++c) {
        k[(h * T) * kD + c] *= sink_size;
        v[(h * T) * kD + c] *= sink_size;
      }
  }
  // The rows a plain cache gets in place of a sink cache's input: positions < S replaced by
  // the stand-in (position S).
  Rows StandIns() const {
    Rows r = *this;
    for (int h = 0; h < kKv; ++h)
      for (int t = 0; t < kS; ++t)
        for (int c = 0; c < kD; ++c) {
          r.k[(h * T + t) * kD + c] = k[(h * T + kS) * kD + c];
          r.v[(h * T + t) * kD + c] = v[(h * T + kS) * kD + c];
        }
    return r;
  }
};

CodecOptions Codec(int sinks) {
  CodecOptions o;
  o.key_bits = 2;
  o.key_group = 32;
  o.rank = 4;
  o.value_bits = 2;
  o.fp16_sinks = sinks;
  return o;
}

// The reference: a plain cache of the stand-ins, its decoded rows < S overwritten by the
// exact rows at fp16 (what the frontend's evaluation-only sink lever does).
TEST(Fp16Sinks, ReadsEqualStandInBlocksWithTheExactRowsPutBack) {
  for (bool rotate : {false, true})
    for (bool a2 : {false, true}) {
      SCOPED_TRACE(::testing::Message() << "rotate=" << rotate << " a2=" << a2);
      const Rows in(75, 7, 8.0f);  // two groups and an 11-token window
      auto basis = RandomBasis({"t", 1, 1, kKv, kQh, kD, 4}, 11);
      CodecOptions o = Codec(kS);
      o.rotate_keys = o.rotate_values = rotate;
      if (a2) o.value_policy = ValuePolicy::kA2;
      CodecOptions plain_o = o;
      plain_o.fp16_sinks = 0;
      LayerCache sink(o, kKv, basis.u.data()), plain(plain_o, kKv, basis.u.data());
      ASSERT_TRUE(sink.Append(View3(in.k, kKv, in.T, kD), View3(in.v, kKv, in.T, kD), 0).ok());
      const Rows stand = in.StandIns();
      ASSERT_TRUE(
          plain.Append(View3(stand.k, kKv, in.T, kD), View3(stand.v, kKv, in.T, kD), 0).ok());
      std::vector<float> kd, vd, kr, vr;
      ASSERT_TRUE(sink.Decode(&kd, &vd).ok());
      ASSERT_TRUE(plain.Decode(&kr, &vr).ok());
      for (int h = 0; h < kKv; ++h)
        for (int t = 0; t < kS; ++t)
          for (int c = 0; c < kD; ++c) {
            const size_t i = (h * in.T + t) * kD + c;
            kr[i] = Fp16(in.k[i]);
            vr[i] = Fp16(in.v[i]);
          }
      ASSERT_EQ(kd, kr);
      ASSERT_EQ(vd, vr);
      // A range that cuts the sinks: the same rows.
      std::vector<float> kp, vp;
      ASSERT_TRUE(sink.Decode(2, 40, &kp, &vp).ok());
      for (int h = 0; h < kKv; ++h)
        for (int64_t t = 2; t < 40; ++t)
          for (int c = 0; c < kD; ++c)
            ASSERT_EQ(kp[(h * 38 + t - 2) * kD + c], kd[(h * in.T + t) * kD + c]);

      const int nq = 2;
      auto q = Gaussian(static_cast<size_t>(kQh) * nq * kD, 3);
      std::vector<float> out(static_cast<size_t>(kQh) * nq * kD);
      AttendOptions ao;
      ao.observe = false;
      ASSERT_TRUE(sink.Attend(q.data(), kQh, nq, ao, out.data()).ok());
      const auto ref = DenseAttend(kd, vd, q, kKv, kQh, nq, in.T, kD);
      for (size_t i = 0; i < out.size(); ++i) ASSERT_NEAR(out[i], ref[i], 5e-4f) << i;
      std::vector<float> s(static_cast<size_t>(kQh) * nq * in.T);
      ASSERT_TRUE(sink.Score(q.data(), kQh, nq, s.data(), 1.0f).ok());
      for (int h = 0; h < kQh; ++h)
        for (int i = 0; i < nq; ++i)
          for (int64_t t = 0; t < in.T; ++t) {
            double dot = 0;
            for (int c = 0; c < kD; ++c)
              dot += double(q[(h * nq + i) * kD + c]) * kd[((h / kGq) * in.T + t) * kD + c];
            ASSERT_NEAR(s[(h * nq + i) * in.T + t], dot, 2e-3 * (1 + std::fabs(dot))) << t;
          }
      // Readout of arbitrary weights (a sink's weight reads its exact value).
      auto p = Gaussian(s.size(), 5);
      for (float& x : p) x = std::fabs(x) / static_cast<float>(in.T);
      std::vector<float> ro(out.size());
      ASSERT_TRUE(sink.Readout(p.data(), kQh, nq, ro.data()).ok());
      for (int h = 0; h < kQh; ++h)
        for (int i = 0; i < nq; ++i)
          for (int c = 0; c < kD; ++c) {
            double acc = 0;
            for (int64_t t = 0; t < in.T; ++t)
              acc += double(p[(h * nq + i) * in.T + t]) * vd[((h / kGq) * in.T + t) * kD + c];
            ASSERT_NEAR(ro[(h * nq + i) * kD + c], acc, 2e-3 * (1 + std::fabs(acc)));
          }
    }
}

// The point of the lever: an outlier sink no longer widens the ranges of its group.
TEST(Fp16Sinks, AnOutlierSinkNoLongerSpoilsItsGroup) {
  const Rows in(64, 9, 30.0f);
  double err[2] = {0, 0};
  for (int sinks : {0, kS}) {
    LayerCache c(Codec(sinks), kKv, nullptr);
    ASSERT_TRUE(c.Append(View3(in.k, kKv, in.T, kD), View3(in.v, kKv, in.T, kD), 0).ok());
    std::vector<float> kd, vd;
    const absl::Status st = c.Decode(&kd, &vd);
    ASSERT_TRUE(st.ok()) << st;
    for (int h = 0; h < kKv; ++h)
      for (int64_t t = kS; t < 32; ++t)  // the first group's ordinary rows
        for (int c2 = 0; c2 < kD; ++c2) {
          const size_t i = (h * in.T + t) * kD + c2;
          err[sinks > 0] +=
              (kd[i] - in.k[i]) * (kd[i] - in.k[i]) + (vd[i] - in.v[i]) * (vd[i] - in.v[i]);
        }
  }
  EXPECT_LT(err[1], 0.1 * err[0]) << err[0] << " " << err[1];
}

TEST(Fp16Sinks, CountedValidatedAndCorruptionIsDetected) {
  CodecOptions o = Codec(kMaxFp16Sinks + 1);
  absl::Status st = o.Validate();
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("fp16_sinks = 17: must be in [0, 16]"), std::string::npos) << st;
  EXPECT_NE(Codec(2).ToString().find("sink2"), std::string::npos);

  const Rows in(40, 3, 4.0f);
  LayerCache c(Codec(kS), kKv, nullptr);
  ASSERT_TRUE(c.Append(View3(in.k, kKv, 20, kD), View3(in.v, kKv, 20, kD), 0).ok());
  EXPECT_EQ(c.Size().key_sink_bytes, 0);  // still in the window: nothing held apart
  EXPECT_EQ(c.sinks(), nullptr);
  const Rows more(40, 4, 1.0f);
  ASSERT_TRUE(c.Append(View3(more.k, kKv, 20, kD), View3(more.v, kKv, 20, kD), 20).ok());
  const SizeReport sz = c.Size();
  EXPECT_EQ(sz.key_sink_bytes, kKv * kS * kD * 2);
  EXPECT_EQ(sz.value_sink_bytes, kKv * kS * kD * 2);
  EXPECT_EQ(sz.total_bytes(), sz.key_block_bytes + sz.value_block_bytes + sz.key_window_bytes +
                                  sz.value_window_bytes + 2 * kKv * kS * kD * 2);
  // Whole logits only: the blocks hold stand-ins, so a correction term alone means nothing.
  auto q = Gaussian(kQh * kD, 1);
  std::vector<float> s(static_cast<size_t>(kQh) * 40);
  EXPECT_EQ(c.Score(q.data(), kQh, 1, s.data(), 0.0f, true).code(),
            absl::StatusCode::kFailedPrecondition);
  ASSERT_TRUE(c.Score(q.data(), kQh, 1, s.data()).ok());
  // One flipped bit in a sink row: every read that touches it fails with DATA_LOSS.
  ASSERT_NE(c.sinks(), nullptr);
  const_cast<SinkRows&>(*c.sinks()).values[5] ^= 1;
  EXPECT_EQ(c.Score(q.data(), kQh, 1, s.data()).code(), absl::StatusCode::kDataLoss);
  std::vector<float> kd, vd;
  EXPECT_EQ(c.Decode(&kd, &vd).code(), absl::StatusCode::kDataLoss);
  EXPECT_EQ(c.VerifyAll().code(), absl::StatusCode::kDataLoss);
}

// A sealed first group carries its sinks to the cache that attaches it; a first group
// without them cannot be attached to a codec that keeps sinks.
TEST(Fp16Sinks, SealedFirstGroupCarriesItsSinks) {
  const Rows in(64, 5, 10.0f);
  LayerCache a(Codec(kS), kKv, nullptr);
  a.set_sealing(true);
  ASSERT_TRUE(a.Append(View3(in.k, kKv, in.T, kD), View3(in.v, kKv, in.T, kD), 0).ok());
  ASSERT_EQ(a.sealed().size(), 2u);
  EXPECT_EQ(a.sealed()[0]->sinks, a.sinks());
  EXPECT_EQ(a.sealed()[1]->sinks, nullptr);
  EXPECT_EQ(a.Size().sealed_block_bytes,
            a.sealed()[0]->stored_bytes() + a.sealed()[1]->stored_bytes() -
                static_cast<int64_t>(
                    4 * (a.sealed()[0]->offsets.size() + a.sealed()[1]->offsets.size())));
  EXPECT_TRUE(a.sealed()[0]->Verify().ok());

  LayerCache b(Codec(kS), kKv, nullptr);
  ASSERT_TRUE(b.AttachSealed(a.sealed()).ok());
  std::vector<float> ka, va, kb, vb;
  ASSERT_TRUE(a.Decode(&ka, &va).ok());
  ASSERT_TRUE(b.Decode(&kb, &vb).ok());
  EXPECT_EQ(ka, kb);
  EXPECT_EQ(va, vb);

  LayerCache plain(Codec(0), kKv, nullptr);
  plain.set_sealing(true);
  ASSERT_TRUE(plain.Append(View3(in.k, kKv, in.T, kD), View3(in.v, kKv, in.T, kD), 0).ok());
  LayerCache c(Codec(kS), kKv, nullptr);
  EXPECT_EQ(c.AttachSealed(plain.sealed()).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(plain.AttachSealed({}).code(), absl::StatusCode::kOk);
  LayerCache d(Codec(0), kKv, nullptr);
  EXPECT_EQ(d.AttachSealed(a.sealed()).code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace kvq::core
