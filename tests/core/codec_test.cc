// Codec behaviour: error budgets, HeadQ's properties, accounting, corruption.
#include "kvq/core/codec.h"

#include <gtest/gtest.h>
#include <xxhash.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>

#include "absl/strings/str_cat.h"
#include "core/src/codec/value_policy.h"
#include "kvq/core/basis.h"
#include "kvq/core/cache.h"
#include "kvq/core/calibration.h"
#include "kvq/core/half.h"
#include "kvq/core/metrics.h"
#include "kvq/kernels/kernels.h"
#include "test_util.h"

namespace kvq::core {
namespace {
using kvq::testing::DenseAttend;
using kvq::testing::Gaussian;
using kvq::testing::View3;

TEST(Half, RoundTripsAndRounding) {
  EXPECT_EQ(FloatToHalf(1.0f), 0x3c00);
  EXPECT_EQ(HalfToFloat(0x7bff), 65504.0f);
  EXPECT_EQ(HalfToFloat(FloatToHalf(1.0f + 1.0f / 4096)), 1.0f);  // ties to even
  EXPECT_EQ(BF16ToFloat(FloatToBF16(3.0f)), 3.0f);
  EXPECT_EQ(FloatToBF16(1.00390625f), 0x3f80);  // tie 1 + 2^-8 rounds to even (1.0)
  std::vector<uint16_t> h(19);
  std::vector<float> f(19), back(19);
  for (int i = 0; i < 19; ++i) f[i] = 0.37f * i - 3;
  FloatToHalfN(f.data(), h.data(), 19);
  HalfToFloatN(h.data(), back.data(), 19);
  for (int i = 0; i < 19; ++i) EXPECT_NEAR(back[i], f[i], 2e-3f);
}

// The bulk bf16 conversion (vectorized where the CPU allows) gives FloatToBF16's bits for every
// class of input: ties, NaNs of both signs (quieted, never rounded into infinity), infinities,
// subnormals, the largest finite values (rounding up to infinity), and a tail shorter than a
// vector.
TEST(Half, BulkBF16MatchesTheScalarRule) {
  std::vector<uint32_t> bits = {0x3f808000u, 0x3f818000u, 0x7fc00000u, 0xffc00001u, 0x7f800001u,
                                0xff800001u, 0x7f800000u, 0xff800000u, 0x00000001u, 0x807fffffu,
                                0x7f7fffffu, 0xff7fffffu, 0x00000000u, 0x80000000u, 0x7fffffffu};
  uint32_t x = 12345;
  while (bits.size() < 4096 + 13) bits.push_back(x = x * 1664525u + 1013904223u);
  std::vector<float> f(bits.size());
  std::memcpy(f.data(), bits.data(), 4 * bits.size());
  std::vector<uint16_t> bulk(f.size());
  FloatToBF16N(f.data(), bulk.data(), f.size());
  for (size_t i = 0; i < f.size(); ++i)
    ASSERT_EQ(bulk[i], FloatToBF16(f[i])) << "input bits 0x" << std::hex << bits[i];
  EXPECT_EQ(FloatToBF16(std::numeric_limits<float>::quiet_NaN()) & 0x7fc0, 0x7fc0);
  EXPECT_EQ(bulk[4], 0x7fc0);   // a signalling NaN comes back quiet
  EXPECT_EQ(bulk[10], 0x7f80);  // the largest float rounds to infinity, as in hardware
}

// The converting checks (what the encoder reads its input with) give the plain conversion's
// values and flag one bad element wherever it is: in a vector's lanes or the scalar tail, for
// f16 (non-finite), bf16 and f32 (beyond 65504, or non-finite); the bounds themselves pass.
TEST(Half, ConvertingChecksFlagEveryPositionAndKeepTheValues) {
  const size_t n = 16 * 3 + 5;
  std::vector<float> f(n);
  for (size_t i = 0; i < n; ++i) f[i] = std::ldexp(static_cast<float>(i) - 26.0f, -3);
  f[7] = 65280.0f;  // the largest bf16 within the bound
  f[8] = -65280.0f;
  std::vector<uint16_t> h(n), b(n);
  FloatToHalfN(f.data(), h.data(), n);
  FloatToBF16N(f.data(), b.data(), n);
  f[9] = 65504.0f;  // the largest fp16, and the f32 bound
  h[9] = 0x7bff;
  std::vector<float> want(n), got(n);
  for (DType dt : {DType::kF16, DType::kBF16, DType::kF32}) {
    const void* src = dt == DType::kF16    ? static_cast<const void*>(h.data())
                      : dt == DType::kBF16 ? static_cast<const void*>(b.data())
                                           : static_cast<const void*>(f.data());
    ToFloat(dt, src, want.data(), n);
    ASSERT_TRUE(ToFloatStorable(dt, src, got.data(), n)) << DTypeName(dt);
    EXPECT_EQ(want, got) << DTypeName(dt);
    for (size_t at : {size_t{0}, size_t{15}, size_t{33}, n - 1}) {
      SCOPED_TRACE(::testing::Message() << DTypeName(dt) << " at " << at);
      auto h2 = h, b2 = b;
      auto f2 = f;
      h2[at] = 0x7c00;  // +Inf
      b2[at] = 0x4780;  // 65536
      f2[at] = -70000.0f;
      const void* bad = dt == DType::kF16    ? static_cast<const void*>(h2.data())
                        : dt == DType::kBF16 ? static_cast<const void*>(b2.data())
                                             : static_cast<const void*>(f2.data());
      EXPECT_FALSE(ToFloatStorable(dt, bad, got.data(), n));
    }
  }
}

TEST(Codec, OptionsValidationNamesTheField) {
  CodecOptions o;
  o.key_bits = 5;
  auto s = o.Validate();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("key_bits"), std::string::npos);
  o = CodecOptions();
  o.key_group = 48;
  EXPECT_NE(o.Validate().message().find("key_group"), std::string::npos);
  o = CodecOptions();
  o.rank = 65;
  EXPECT_NE(o.Validate().message().find("rank"), std::string::npos);
  EXPECT_TRUE(CodecOptions().Validate().ok());
}

// value_group: any of 1..head_dim that leaves at most 64 groups per head (the kernels' limit,
// codec.h); a refusal names the field, the limit and the smallest group at this head_dim.
TEST(Codec, ValueGroupLeavesAtMost64GroupsPerHead) {
  const struct {
    int head_dim, smallest;
  } cases[] = {{32, 1}, {64, 1}, {80, 2}, {128, 2}, {256, 4}, {512, 8}};
  for (const auto& c : cases) {
    SCOPED_TRACE(::testing::Message() << "head_dim " << c.head_dim);
    CodecOptions o;
    o.head_dim = c.head_dim;
    o.value_group = c.smallest;
    EXPECT_TRUE(o.Validate().ok()) << o.Validate();
    EXPECT_LE(o.value_groups(), kMaxValueGroups);
    o.value_group = c.head_dim;
    EXPECT_TRUE(o.Validate().ok()) << o.Validate();
    if (c.smallest == 1) continue;
    o.value_group = c.smallest - 1;
    const absl::Status s = o.Validate();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(s.message(), absl::StrCat("codec.value_group = ", c.smallest - 1,
                                        ": at most 64 groups per head, so value_group >= ",
                                        c.smallest, " at head_dim ", c.head_dim));
  }
}

// Every reconstructed key is within half a quantization step (plus fp16 rounding of the
// zero point) of the original: the per-bit-width error budget.
TEST(Codec, KeyRoundTripWithinHalfStep) {
  for (int bits : {2, 3, 4, 8})
    for (int G : {32, 64, 128}) {
      SCOPED_TRACE(::testing::Message() << "bits=" << bits << " G=" << G);
      CodecOptions o;
      o.key_bits = bits;
      o.key_group = G;
      o.head_dim = 80;
      auto k = Gaussian(static_cast<size_t>(G) * 80, bits + G, 2.0f, 0.5f);
      std::vector<uint8_t> blk;
      ASSERT_TRUE(EncodeKeyBlock(o, k.data(), 80, nullptr, &blk).ok());
      auto v = ParseKeyBlock(blk, o, true);
      ASSERT_TRUE(v.ok()) << v.status();
      std::vector<float> out(k.size());
      DecodeKeyBase(*v, out.data());
      double mse = 0, budget = 0;
      for (int c = 0; c < 80; ++c) {
        const float step = HalfToFloat(v->scale[c]);
        budget += 1.3 * step * step / 12 * G;  // uniform-error variance, 30% slack
        for (int t = 0; t < G; ++t) {
          const float e = std::fabs(out[t * 80 + c] - k[t * 80 + c]);
          ASSERT_LE(e, 0.5f * step * 1.001f + 2e-3f * std::fabs(k[t * 80 + c]) + 1e-3f);
          mse += e * e;
        }
      }
      EXPECT_LT(mse, budget);
      // And the width matters: the step shrinks as 1 / (2^bits - 1).
      EXPECT_LT(HalfToFloat(v->scale[0]), 2.2f * 12.0f / ((1 << bits) - 1));
    }
}

TEST(Codec, ValueRoundTripPerWidth) {
  for (int bits : {1, 2, 3, 4, 8}) {
    CodecOptions o;
    o.value_bits = bits;
    o.head_dim = 128;
    o.value_group = 32;
    auto x = Gaussian(32 * 128, 40 + bits);
    std::vector<uint8_t> blk;
    ASSERT_TRUE(EncodeValueBlock(o, x.data(), 128, nullptr, &blk).ok());
    EXPECT_EQ(blk.size(), ValueBlockBytes(o));
    auto v = ParseValueBlock(blk, o, true);
    ASSERT_TRUE(v.ok());
    std::vector<float> out(x.size());
    DecodeValueBlock(*v, out.data());
    double mse = 0, budget = 0;
    const uint8_t* rec = v->payload;
    const size_t rec_bytes = 16 + (128 * bits + 7) / 8;
    for (int t = 0; t < 32; ++t, rec += rec_bytes)
      for (int g = 0; g < 4; ++g) {
        uint16_t h;
        std::memcpy(&h, rec + 2 * g, 2);
        const double step = HalfToFloat(h);
        // 1 bit: two levels, the worst case (half a step) bounds every error.
        budget += (bits == 1 ? 0.25 : 1.3 / 12) * step * step * 32;
      }
    for (size_t i = 0; i < x.size(); ++i) mse += (out[i] - x[i]) * (out[i] - x[i]);
    EXPECT_LT(mse, budget) << "bits=" << bits;
  }
}

// Optimized cache path vs a double-precision dense reference over the cache's own decoded
// K/V, on odd shapes and grouped-query ratios.
TEST(Codec, AttendMatchesReferenceOnOddShapes) {
  for (int d : {64, 80, 128})
    for (int64_t T : {1, 19, 111, 989})
      for (int gq : {1, 3, 8}) {
        SCOPED_TRACE(::testing::Message() << "d=" << d << " T=" << T << " gq=" << gq);
        const int kv = 2, qh = kv * gq, nq = 2;
        CodecOptions o;
        o.head_dim = d;
        o.rank = 4;
        auto basis = RandomBasis({"t", 1, 1, kv, qh, d, 4}, 11);
        LayerCache cache(o, kv, basis.u.data());
        auto k = Gaussian(kv * T * d, 1 + d), v = Gaussian(kv * T * d, 2 + d);
        ASSERT_TRUE(cache.Append(View3(k, kv, T, d), View3(v, kv, T, d), 0).ok());
        auto q = Gaussian(static_cast<size_t>(qh) * nq * d, 3);
        std::vector<float> out(static_cast<size_t>(qh) * nq * d);
        AttendOptions ao;
        ao.causal_offset = T - 2;  // the last query sees everything, the first one token less
        ASSERT_TRUE(cache.Attend(q.data(), qh, nq, ao, out.data()).ok());
        std::vector<float> kd, vd;
        ASSERT_TRUE(cache.Decode(&kd, &vd).ok());
        auto ref = DenseAttend(kd, vd, q, kv, qh, nq, T, d, T - 2);
        for (size_t i = 0; i < out.size(); ++i) ASSERT_NEAR(out[i], ref[i], 2e-4f) << i;
        // The same cache on the scalar reference kernels (scores and attend).
        std::vector<float> s_opt(static_cast<size_t>(qh) * nq * T), s_ref(s_opt.size());
        std::vector<float> out_ref(out.size());
        ASSERT_TRUE(cache.Score(q.data(), qh, nq, s_opt.data()).ok());
        kernels::SetActive(&kernels::Ref());
        const bool ok = cache.Score(q.data(), qh, nq, s_ref.data()).ok() &&
                        cache.Attend(q.data(), qh, nq, ao, out_ref.data()).ok();
        kernels::SetActive(nullptr);
        ASSERT_TRUE(ok);
        // Where the CPU has AVX512-VNNI/VBMI, 2-bit codes are scored and read out with int16
        // weights rounded per (block, query) to the block's largest (docs/CODEC.md): up to
        // ~3.3e-4 of a logit here (fp32 kernels: ~3e-6) and ~9e-5 of an output. The budgets
        // below leave 1.5x of margin and stay >100x under the 2-bit codes' own error (a
        // logit is off by ~0.1-0.4 from the unquantized keys) and >5x under bf16 rounding.
        for (size_t i = 0; i < s_opt.size(); ++i)
          ASSERT_NEAR(s_opt[i], s_ref[i], 5e-4f * (1 + std::fabs(s_ref[i]))) << i;
        for (size_t i = 0; i < out.size(); ++i) ASSERT_NEAR(out[i], out_ref[i], 1.5e-4f) << i;
      }
}

TEST(Codec, OneTokenAppendsEqualOneBigAppend) {
  const int kv = 3, d = 64, T = 150;
  CodecOptions o;
  o.rank = 4;
  o.window = 16;
  auto basis = RandomBasis({"t", 1, 1, kv, 9, d, 4}, 5);
  LayerCache big(o, kv, basis.u.data()), small(o, kv, basis.u.data());
  auto k = Gaussian(kv * T * d, 8), v = Gaussian(kv * T * d, 9);
  ASSERT_TRUE(big.Append(View3(k, kv, T, d), View3(v, kv, T, d), 0).ok());
  for (int t = 0; t < T; ++t) {
    TensorView kt = View3(k, kv, T, d), vt = View3(v, kv, T, d);
    kt.data = k.data() + t * d;
    vt.data = v.data() + t * d;
    kt.shape[1] = vt.shape[1] = 1;  // strided view of token t of every head
    ASSERT_TRUE(small.Append(kt, vt, t).ok());
  }
  auto q = Gaussian(9 * d, 10);
  std::vector<float> a(9 * T), b(9 * T);
  ASSERT_TRUE(big.Score(q.data(), 9, 1, a.data()).ok());
  ASSERT_TRUE(small.Score(q.data(), 9, 1, b.data()).ok());
  EXPECT_EQ(a, b);
  EXPECT_EQ(big.Size().total_bytes(), small.Size().total_bytes());
  EXPECT_EQ(big.Size().window_tokens, 150 - 128);  // 16 <= window < 16 + 32
}

TEST(Codec, AppendRejectsBadInputAndKeepsState) {
  const int kv = 2, d = 64;
  LayerCache c(CodecOptions(), kv, nullptr);
  auto k = Gaussian(kv * 40 * d, 1), v = Gaussian(kv * 40 * d, 2);
  ASSERT_TRUE(c.Append(View3(k, kv, 40, d), View3(v, kv, 40, d), 0).ok());
  const int64_t bytes = c.Size().total_bytes();
  auto bad = k;
  bad[100] = std::nanf("");
  auto s = c.Append(View3(bad, kv, 40, d), View3(v, kv, 40, d), 40);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("keys["), std::string::npos);
  EXPECT_EQ(c.Append(View3(k, kv, 40, d), View3(v, kv, 40, d), 7).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(c.Append(View3(k, 3, 40, d), View3(v, 3, 40, d), 40).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(c.tokens(), 40);
  EXPECT_EQ(c.Size().total_bytes(), bytes);
}

// A rank-4 codec at d = 64 over a random basis, and Gaussian keys and values [kv][T][64].
struct Rank4 {
  CodecOptions o;
  ModelBasis basis;
  std::vector<float> k, v;
};
Rank4 Rank4Input(int kv, int T) {
  Rank4 r{CodecOptions{}, RandomBasis({"t", 1, 1, kv, kv, 64, 4}, 7), Gaussian(kv * T * 64, 3),
          Gaussian(kv * T * 64, 4)};
  r.o.rank = 4;
  return r;
}

// An append into an empty window encodes its groups straight from the input, a few at a
// time, checking each before encoding it: a bad value anywhere (a later head, a later chunk,
// the rows left for the window) must still leave nothing behind and report the first bad
// element in the order of the up-front check.
TEST(Codec, DirectAppendRejectsBadInputAnywhereAndKeepsState) {
  const int kv = 3, d = 64, T = 700;
  auto [o, basis, k, v] = Rank4Input(kv, T);
  std::vector<uint16_t> kh(k.size()), vh(v.size());
  FloatToHalfN(k.data(), kh.data(), k.size());
  FloatToHalfN(v.data(), vh.data(), v.size());
  auto half3 = [&](const std::vector<uint16_t>& x) {
    return TensorView::Contiguous(x.data(), DType::kF16, {kv, T, d});
  };
  LayerCache good(o, kv, basis.u.data());
  ASSERT_TRUE(good.Append(half3(kh), half3(vh), 0).ok());
  struct Bad {
    bool keys;
    int h, t, c;
  };
  for (Bad b :
       {Bad{true, 0, 5, 1}, Bad{false, 1, 300, 7}, Bad{true, 2, 650, 63}, Bad{false, 2, 699, 0}}) {
    for (bool seal : {false, true}) {
      SCOPED_TRACE(::testing::Message()
                   << (b.keys ? "keys " : "values ") << b.h << " " << b.t << " seal=" << seal);
      auto bk = kh, bv = vh;
      (b.keys ? bk : bv)[(static_cast<size_t>(b.h) * T + b.t) * d + b.c] = 0x7e00;  // NaN
      LayerCache c(o, kv, basis.u.data());
      c.set_sealing(seal);
      auto s = c.Append(half3(bk), half3(bv), 0);
      ASSERT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
      EXPECT_NE(s.message().find(
                    absl::StrCat(b.keys ? "keys[" : "values[", b.h, ", ", b.t, ", ", b.c, "]")),
                std::string::npos)
          << s.message();
      EXPECT_EQ(c.tokens(), 0);
      EXPECT_EQ(c.Size().total_bytes(), 0);
      EXPECT_TRUE(c.sealed().empty());
      // The same cache then takes the good rows and holds exactly what a fresh one holds.
      ASSERT_TRUE(c.Append(half3(kh), half3(vh), 0).ok());
      EXPECT_EQ(c.Size().total_bytes(), good.Size().total_bytes());
      std::vector<float> k0, v0, k1, v1;
      ASSERT_TRUE(good.Decode(&k0, &v0).ok());
      ASSERT_TRUE(c.Decode(&k1, &v1).ok());
      EXPECT_EQ(k0, k1);
      EXPECT_EQ(v0, v1);
    }
  }
}

// The same for elements beyond the fp16 range in f32 and bf16 input (the encoder checks a
// group's rows once converted to fp32): in a later chunk and head, and in the window's rows.
TEST(Codec, DirectAppendRejectsOutOfRangeF32AndBF16InALaterChunk) {
  const int kv = 3, d = 64, T = 700;
  auto [o, basis, k, v] = Rank4Input(kv, T);
  for (DType dt : {DType::kF32, DType::kBF16}) {
    for (auto [keys, h, t, x] :
         {std::tuple{true, 1, 420, 70000.0f}, {false, 2, 333, -3e38f}, {true, 2, 698, 65536.0f}}) {
      SCOPED_TRACE(::testing::Message() << DTypeName(dt) << " " << keys << " " << h << " " << t);
      auto bk = k, bv = v;
      (keys ? bk : bv)[(static_cast<size_t>(h) * T + t) * d + 9] = x;
      std::vector<uint16_t> hk(bk.size()), hv(bv.size());
      for (size_t i = 0; i < bk.size(); ++i) hk[i] = FloatToBF16(bk[i]), hv[i] = FloatToBF16(bv[i]);
      auto view = [&](const std::vector<float>& f, const std::vector<uint16_t>& hb) {
        return dt == DType::kF32 ? View3(f, kv, T, d)
                                 : TensorView::Contiguous(hb.data(), dt, {kv, T, d});
      };
      LayerCache c(o, kv, basis.u.data());
      const absl::Status s = c.Append(view(bk, hk), view(bv, hv), 0);
      ASSERT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
      EXPECT_NE(s.message().find(absl::StrCat(keys ? "keys[" : "values[", h, ", ", t, ", 9]")),
                std::string::npos)
          << s.message();
      EXPECT_EQ(c.tokens(), 0);
      EXPECT_EQ(c.Size().total_bytes(), 0);
    }
  }
}

// One element beyond the fp16 range (the block's zero points are fp16) would make its group's
// zero point infinite and every token of the group decode to Inf/NaN: the append is rejected
// naming the element and the limit, for keys and values, f32 and bf16, and nothing is kept.
TEST(Codec, AppendRejectsElementsBeyondTheFp16RangeAndKeepsState) {
  const int kv = 2, d = 64, T = 40;
  auto [o, basis, k, v] = Rank4Input(kv, T);
  struct Bad {
    bool keys;
    int h, t, c;
    float x;
  };
  for (DType dt : {DType::kF32, DType::kBF16}) {
    for (Bad b : {Bad{true, 1, 3, 5, 4e6f}, Bad{true, 0, 39, 0, -3e38f},
                  Bad{false, 1, 0, 63, 3e38f}, Bad{false, 0, 20, 9, -70000.0f}}) {
      SCOPED_TRACE(::testing::Message()
                   << DTypeName(dt) << (b.keys ? " keys " : " values ") << b.x);
      auto bk = k, bv = v;
      (b.keys ? bk : bv)[(static_cast<size_t>(b.h) * T + b.t) * d + b.c] = b.x;
      std::vector<uint16_t> hk(bk.size()), hv(bv.size());
      for (size_t i = 0; i < bk.size(); ++i) hk[i] = FloatToBF16(bk[i]), hv[i] = FloatToBF16(bv[i]);
      auto view = [&](const std::vector<float>& f, const std::vector<uint16_t>& h) {
        return dt == DType::kF32 ? View3(f, kv, T, d)
                                 : TensorView::Contiguous(h.data(), dt, {kv, T, d});
      };
      LayerCache c(o, kv, basis.u.data());
      const absl::Status s = c.Append(view(bk, hk), view(bv, hv), 0);
      ASSERT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
      EXPECT_NE(s.message().find(
                    absl::StrCat(b.keys ? "keys[" : "values[", b.h, ", ", b.t, ", ", b.c, "]")),
                std::string::npos)
          << s.message();
      EXPECT_NE(s.message().find("65504"), std::string::npos) << s.message();
      EXPECT_EQ(c.tokens(), 0);
      EXPECT_EQ(c.Size().total_bytes(), 0);
      EXPECT_EQ(CheckStorable(view(bk, hk), "keys").ok(), !b.keys);
      EXPECT_EQ(CheckStorable(view(bv, hv), "values").ok(), b.keys);
    }
  }
  // The limit itself is accepted and decodes finite.
  auto ek = k;
  ek[0] = kMaxStorableMagnitude;
  ek[1] = -kMaxStorableMagnitude;
  LayerCache c(o, kv, basis.u.data());
  ASSERT_TRUE(c.Append(View3(ek, kv, T, d), View3(v, kv, T, d), 0).ok());
  std::vector<float> dk, dv;
  ASSERT_TRUE(c.Decode(&dk, &dv).ok());
  for (float x : dk) ASSERT_TRUE(std::isfinite(x));
}

// Keys within the fp16 range can still project beyond it in the side code (a coefficient sums
// d residuals): every channel half a step off its level gives a coefficient of about
// 8 * 21800 at d = 64, whose fp16 zero point would be -Inf. The block must decode finite.
TEST(Codec, SideCodeOfExtremeKeysStaysFinite) {
  CodecOptions o;
  o.head_dim = 64;
  o.rank = 1;
  const int d = o.head_dim, G = o.key_group;
  std::vector<float> basis(d, 1.0f / 8.0f);  // [d][1], unit norm
  std::vector<float> keys(static_cast<size_t>(G) * d, 100.0f);
  for (int c = 0; c < d; ++c) {
    keys[c] = -kMaxStorableMagnitude;     // levels -65504, -21824, 21856, 65536:
    keys[d + c] = kMaxStorableMagnitude;  // 100 rounds to 21856, residual -21756
  }
  std::vector<uint8_t> block;
  ASSERT_TRUE(EncodeKeyBlock(o, keys.data(), d, basis.data(), &block).ok());
  auto view = ParseKeyBlock(block, o, true);
  ASSERT_TRUE(view.ok()) << view.status();
  std::vector<float> out(keys.size());
  DecodeKeyBlock(*view, basis.data(), out.data());
  for (float x : out) ASSERT_TRUE(std::isfinite(x)) << x;
  std::vector<float> q(d, 1.0f), uq(1, 8.0f), scores(G);
  ScoreKeyBlock(*view, q.data(), uq.data(), 1, 1.0f, scores.data(), G);
  for (float x : scores) ASSERT_TRUE(std::isfinite(x)) << x;
}

// A constant vector added to every key is softmax-null: attention and the Fisher metric
// are unchanged (the asymmetric base code is shift-equivariant up to fp16 zero points).
TEST(Codec, SoftmaxNullShift) {
  const int kv = 1, d = 64, T = 256;
  auto k = Gaussian(T * d, 21), v = Gaussian(T * d, 22), q = Gaussian(d, 23);
  auto k2 = k;
  for (int t = 0; t < T; ++t)
    for (int c = 0; c < d; ++c) k2[t * d + c] += 3.0f + 0.5f * (c % 5);
  CodecOptions o;
  LayerCache a(o, kv, nullptr), b(o, kv, nullptr);
  ASSERT_TRUE(a.Append(View3(k, kv, T, d), View3(v, kv, T, d), 0).ok());
  ASSERT_TRUE(b.Append(View3(k2, kv, T, d), View3(v, kv, T, d), 0).ok());
  std::vector<float> sa(T), sb(T), oa(d), ob(d), ea(T), eb(T);
  ASSERT_TRUE(a.Score(q.data(), 1, 1, sa.data()).ok());
  ASSERT_TRUE(b.Score(q.data(), 1, 1, sb.data()).ok());
  for (int t = 0; t < T; ++t) {
    float x = 0, y = 0;
    for (int c = 0; c < d; ++c) {
      x += q[c] * k[t * d + c];
      y += q[c] * k2[t * d + c];
    }
    ea[t] = x / 8;
    eb[t] = y / 8;
  }
  // The shift moves every score by (nearly) the same amount: what remains comes from fp16
  // rounding of the shifted zero points and is far below the quantization damage itself.
  const double kl_quant = AttentionKL(ea.data(), sa.data(), T);
  EXPECT_LT(AttentionKL(sa.data(), sb.data(), T), 0.05 * kl_quant);
  EXPECT_NEAR(FisherScoreError(ea.data(), sa.data(), T), FisherScoreError(eb.data(), sb.data(), T),
              0.02 * FisherScoreError(ea.data(), sa.data(), T));
  // The metric itself ignores constants; the raw score MSE does not. (x + 5 rounds in fp32,
  // by up to half an ulp of 5 + x: the metric sees that rounding, about 1e-8 for some kernel
  // tables, e.g. KVQ_KERNELS=ref, against Fisher errors of 1e-2 and up for real damage.)
  std::vector<float> shifted(sa);
  for (auto& x : shifted) x += 5;
  EXPECT_NEAR(FisherScoreError(sa.data(), shifted.data(), T), 0.0, 1e-6);
  EXPECT_GT(MeanSquaredError(sa.data(), shifted.data(), T), 24.0);
  ASSERT_TRUE(a.Attend(q.data(), 1, 1, {}, oa.data()).ok());
  ASSERT_TRUE(b.Attend(q.data(), 1, 1, {}, ob.data()).ok());
  std::vector<float> ex_out(d);
  {
    std::vector<float> p(T);
    Softmax(ea.data(), T, p.data());
    for (int t = 0; t < T; ++t)
      for (int c = 0; c < d; ++c) ex_out[c] += p[t] * v[t * d + c];
  }
  EXPECT_LT(RelativeOutputError(oa.data(), ob.data(), d),
            0.1 * RelativeOutputError(ex_out.data(), oa.data(), d));
}

TEST(Codec, FullRankEightBitSideCodeIsNearExact) {
  const int kv = 1, d = 64, T = 128;
  auto k = Gaussian(T * d, 31), v = Gaussian(T * d, 32), q = Gaussian(d, 33);
  auto eye = RandomBasis({"t", 1, 1, 1, 1, d, d}, 3);  // any orthonormal basis of full rank
  CodecOptions base;
  CodecOptions full = base;
  full.rank = d;
  full.side_bits = 8;
  LayerCache a(base, kv, nullptr), b(full, kv, eye.u.data());
  ASSERT_TRUE(a.Append(View3(k, kv, T, d), View3(v, kv, T, d), 0).ok());
  ASSERT_TRUE(b.Append(View3(k, kv, T, d), View3(v, kv, T, d), 0).ok());
  std::vector<float> sa(T), sb(T), ex(T);
  ASSERT_TRUE(a.Score(q.data(), 1, 1, sa.data()).ok());
  ASSERT_TRUE(b.Score(q.data(), 1, 1, sb.data()).ok());
  for (int t = 0; t < T; ++t) {
    float x = 0;
    for (int c = 0; c < d; ++c) x += q[c] * k[t * d + c];
    ex[t] = x / 8;
  }
  const double e_base = MeanSquaredError(ex.data(), sa.data(), T);
  const double e_full = MeanSquaredError(ex.data(), sb.data(), T);
  EXPECT_LT(e_full, 1e-3 * e_base) << e_base << " " << e_full;
}

// Queries living in a 4-dimensional subspace: the query-PCA basis removes most of the
// Fisher score error, a random basis of the same rank little, and the wrong sign hurts.
TEST(Codec, QueryPcaVsRandomVsWrongSign) {
  const int d = 64, T = 1024, r = 4, nq = 64, kv = 1;
  std::mt19937 rng(41);
  std::normal_distribution<float> nd;
  std::vector<float> A(d * r);
  for (auto& x : A) x = nd(rng);
  auto sample_q = [&](int n) {
    std::vector<float> q(static_cast<size_t>(n) * d);
    for (int i = 0; i < n; ++i) {
      float z[4];
      for (float& x : z) x = 3 * nd(rng);
      for (int c = 0; c < d; ++c) {
        float acc = 0.05f * nd(rng);
        for (int j = 0; j < r; ++j) acc += A[c * r + j] * z[j];
        q[static_cast<size_t>(i) * d + c] = acc;
      }
    }
    return q;
  };
  QueryStats stats(1, 1, 1, d);
  auto cal = sample_q(4000);
  stats.Add(0, 0, cal.data(), 4000);
  BasisManifest m{"synthetic", 1, 1, 1, 1, d, r};
  auto pca = stats.Basis(r, {}, m);
  ASSERT_TRUE(pca.ok());
  EXPECT_GT(stats.CapturedEnergy(*pca)[0], 0.99);
  auto rnd = RandomBasis(pca->manifest, 99);

  auto k = Gaussian(T * d, 42), v = Gaussian(T * d, 43);
  auto q = sample_q(nq);
  // encode: the oblique pair's encode basis A (null: U).
  auto fisher = [&](const CodecOptions& o, const float* U, const float* encode = nullptr) {
    LayerCache c(o, kv, U, nullptr, encode);
    EXPECT_TRUE(c.Append(View3(k, kv, T, d), View3(v, kv, T, d), 0).ok());
    std::vector<float> s(static_cast<size_t>(nq) * T);
    EXPECT_TRUE(c.Score(q.data(), 1, nq, s.data()).ok());
    double f = 0;
    std::vector<float> ex(T);
    for (int i = 0; i < nq; ++i) {
      for (int t = 0; t < T; ++t) {
        float x = 0;
        for (int ch = 0; ch < d; ++ch) x += q[i * d + ch] * k[t * d + ch];
        ex[t] = x / 8;
      }
      f += FisherScoreError(ex.data(), s.data() + static_cast<size_t>(i) * T, T);
    }
    return f / nq;
  };
  CodecOptions base;
  CodecOptions hq = base;
  hq.rank = r;
  // The wrong-sign control: encoded with U, decoded with -U.
  std::vector<float> minus_u = pca->u;
  for (float& x : minus_u) x = -x;
  const double f_base = fisher(base, nullptr);
  const double f_pca = fisher(hq, pca->u.data());
  const double f_rnd = fisher(hq, rnd.u.data());
  const double f_wrong = fisher(hq, minus_u.data(), pca->u.data());
  EXPECT_LT(f_pca, 0.2 * f_base) << f_base << " " << f_pca;
  EXPECT_GT(f_rnd, 0.7 * f_base) << f_base << " " << f_rnd;
  EXPECT_GT(f_wrong, 1.5 * f_base) << f_base << " " << f_wrong;
}

TEST(Codec, BitFiguresEqualBytesStored) {
  for (int rank : {0, 4})
    for (int G : {32, 128}) {
      const int kv = 3, d = 64, T = 1000;
      CodecOptions o;
      o.rank = rank;
      o.key_group = G;
      o.window = 64;
      auto basis = RandomBasis({"t", 1, 1, kv, 9, d, 4}, 1);
      LayerCache c(o, kv, rank ? basis.u.data() : nullptr);
      auto k = Gaussian(kv * T * d, 1), v = Gaussian(kv * T * d, 2);
      std::vector<uint16_t> kh(k.size()), vh(v.size());
      FloatToHalfN(k.data(), kh.data(), k.size());
      FloatToHalfN(v.data(), vh.data(), v.size());
      ASSERT_TRUE(c.Append(TensorView::Contiguous(kh.data(), DType::kF16, {kv, T, d}),
                           TensorView::Contiguous(vh.data(), DType::kF16, {kv, T, d}), 0)
                      .ok());
      SizeReport s = c.Size();
      const int64_t blocks = s.encoded_tokens / G;
      EXPECT_EQ(s.encoded_tokens + s.window_tokens, T);
      EXPECT_GE(s.window_tokens, 64);
      EXPECT_LT(s.window_tokens, 64 + G);
      // Block bytes: exactly the per-block layout, nothing hidden.
      EXPECT_EQ(s.key_block_bytes, static_cast<int64_t>(KeyBlockBytes(o)) * blocks * kv);
      EXPECT_EQ(s.value_block_bytes, static_cast<int64_t>(ValueBlockBytes(o)) * blocks * kv);
      EXPECT_EQ(s.key_window_bytes, s.window_tokens * kv * d * 2);  // fp16 as it arrived
      size_t stored_k = 0, stored_v = 0;
      for (int h = 0; h < kv; ++h) {
        stored_k += c.key_blocks(h).size();
        stored_v += c.value_blocks(h).size();
      }
      EXPECT_DOUBLE_EQ(s.k_bits_steady() * s.encoded_tokens * kv * d / 8, stored_k);
      EXPECT_DOUBLE_EQ(s.v_bits_steady() * s.encoded_tokens * kv * d / 8, stored_v);
      EXPECT_NEAR(s.k_bits_effective() * T * kv * d / 8, stored_k + s.key_window_bytes, 1e-6);
      // The documented formula: 2 bits + 32/G bits of scale+zero + header + side code.
      const double expect_k = 2.0 + 32.0 / G + 128.0 / (G * d) +
                              (rank ? (8.0 * rank / d + 32.0 * rank / (G * d)) : 0.0);
      EXPECT_NEAR(s.k_bits_steady(), expect_k, 1e-9);
    }
}

// Reports of caches of different shapes add up by elements, not by the first shape.
TEST(Codec, SizeReportsOfDifferentShapesAddUp) {
  CodecOptions a, b;
  b.head_dim = 128;
  LayerCache ca(a, 3, nullptr), cb(b, 8, nullptr);
  auto ka = Gaussian(3 * 64 * 64, 1), kb = Gaussian(8 * 64 * 128, 2);
  ASSERT_TRUE(ca.Append(View3(ka, 3, 64, 64), View3(ka, 3, 64, 64), 0).ok());
  ASSERT_TRUE(cb.Append(View3(kb, 8, 64, 128), View3(kb, 8, 64, 128), 0).ok());
  SizeReport sum = ca.Size();
  sum += cb.Size();
  const double want = 8.0 * (ca.Size().key_block_bytes + cb.Size().key_block_bytes) /
                      (64.0 * 3 * 64 + 64.0 * 8 * 128);
  EXPECT_DOUBLE_EQ(sum.k_bits_steady(), want);
  EXPECT_EQ(sum.elements, 64 * 3 * 64 + 64 * 8 * 128);
}

TEST(Codec, CorruptedAndTruncatedBlocksAreRejected) {
  const int kv = 1, d = 64, T = 64;
  CodecOptions o;
  o.rank = 4;
  auto basis = RandomBasis({"t", 1, 1, 1, 1, d, 4}, 1);
  auto k = Gaussian(T * d, 1), v = Gaussian(T * d, 2), q = Gaussian(d, 3);
  LayerCache c(o, kv, basis.u.data());
  ASSERT_TRUE(c.Append(View3(k, kv, T, d), View3(v, kv, T, d), 0).ok());
  std::vector<float> s(T), out(d);
  ASSERT_TRUE(c.Score(q.data(), 1, 1, s.data()).ok());
  // Flip one bit anywhere in a key block: every read path reports DATA_LOSS.
  std::mt19937 rng(5);
  for (int trial = 0; trial < 200; ++trial) {
    auto& kb = trial % 2 ? c.key_blocks(0) : c.value_blocks(0);
    const size_t at = rng() % kb.size();
    const uint8_t bit = static_cast<uint8_t>(1u << (rng() % 8));
    kb[at] ^= bit;
    EXPECT_EQ(c.Score(q.data(), 1, 1, s.data()).code() == absl::StatusCode::kDataLoss ||
                  c.Attend(q.data(), 1, 1, {}, out.data()).code() == absl::StatusCode::kDataLoss,
              true);
    EXPECT_EQ(c.VerifyAll().code(), absl::StatusCode::kDataLoss);
    kb[at] ^= bit;
  }
  EXPECT_TRUE(c.VerifyAll().ok());
  // Truncated and garbage blocks.
  const auto& kb = c.key_blocks(0);
  for (size_t n : {size_t{0}, size_t{5}, size_t{16}, KeyBlockBytes(o) - 1})
    EXPECT_EQ(ParseKeyBlock({kb.data(), n}, o, true).status().code(), absl::StatusCode::kDataLoss);
  std::vector<uint8_t> junk(KeyBlockBytes(o));
  for (int trial = 0; trial < 100; ++trial) {
    for (auto& b : junk) b = static_cast<uint8_t>(rng());
    EXPECT_FALSE(ParseKeyBlock(junk, o, true).ok());
    EXPECT_FALSE(ParseValueBlock(junk, o, true).ok());
  }
  // A valid block read with another codec's options is refused, not misread.
  CodecOptions other = o;
  other.key_bits = 4;
  EXPECT_EQ(ParseKeyBlock({kb.data(), KeyBlockBytes(o)}, other, true).status().code(),
            absl::StatusCode::kDataLoss);
}

// Version 1 (a seeded payload checksum, never written outside tests) is refused as DATA_LOSS,
// even with a checksum valid under its own rule; a future version is refused, not guessed at.
TEST(Codec, Version1AndFutureVersionsAreRefused) {
  CodecOptions o;
  o.rank = 4;
  auto basis = RandomBasis({"t", 1, 1, 1, 1, 64, 4}, 1);
  auto k = Gaussian(32 * 64, 4);
  std::vector<uint8_t> v2;
  ASSERT_TRUE(EncodeKeyBlock(o, k.data(), 64, basis.u.data(), &v2).ok());
  EXPECT_EQ(v2[2], 2);
  auto v1 = v2;
  v1[2] = 1;
  const uint64_t head = XXH3_64bits(v1.data(), 12);
  const uint32_t sum =
      static_cast<uint32_t>(XXH3_64bits_withSeed(v1.data() + 16, v1.size() - 16, head));
  std::memcpy(v1.data() + 12, &sum, 4);
  ASSERT_TRUE(ParseKeyBlock(v2, o, true).ok());
  for (bool verify : {true, false}) {
    const auto a = ParseKeyBlock(v1, o, verify);
    EXPECT_EQ(a.status().code(), absl::StatusCode::kDataLoss);
    EXPECT_NE(std::string(a.status().message()).find("block version 1"), std::string::npos)
        << a.status();
  }
  EXPECT_EQ(VerifyBlock(v1).code(), absl::StatusCode::kDataLoss);
  v2[2] = 4;
  EXPECT_EQ(ParseKeyBlock(v2, o, true).status().code(), absl::StatusCode::kDataLoss);
}

TEST(ValuePolicy, SpendsBitsOnHeavyTokensWithinBudget) {
  CodecOptions o;
  o.value_policy = ValuePolicy::kA2;
  o.value_budget = 2.0f;
  o.sink_tokens = 4;
  const int n = 32, d = 64;
  auto v = Gaussian(n * d, 3);
  std::vector<float> w(n, 0.001f);
  w[10] = w[20] = 1.0f;
  std::vector<uint8_t> bits(n);
  ChooseValueBits(o, v.data(), d, w.data(), n, 0, bits.data());
  int sum = 0;
  for (int t = 0; t < n; ++t) sum += bits[t];
  EXPECT_LE(sum, 2 * n);
  EXPECT_EQ(bits[0], 4);  // sink
  EXPECT_EQ(bits[10], 4);
  EXPECT_EQ(bits[20], 4);
  ChooseValueBits(o, v.data(), d, w.data(), n, 100, bits.data());  // past the sinks
  EXPECT_LT(bits[0], 4);
}

// The A^2 policy beats uniform 2-bit values on the A^2-weighted distortion at the same mean
// code width when the weights are informative.
TEST(ValuePolicy, LowersA2DistortionAtEqualBits) {
  const int d = 64, G = 32, n = 32 * 8;
  auto v = Gaussian(static_cast<size_t>(n) * d, 77);
  std::vector<float> w(n);
  std::mt19937 rng(3);
  std::exponential_distribution<float> ex(1.0f);
  for (auto& x : w) x = std::pow(ex(rng), 4.0f);  // heavy-tailed, like attention
  CodecOptions uni;
  uni.value_bits = 2;
  CodecOptions a2 = uni;
  a2.value_policy = ValuePolicy::kA2;
  a2.value_budget = 2.0f;
  a2.sink_tokens = 0;
  double du = 0, da = 0;
  size_t bytes_u = 0, bytes_a = 0;
  for (int b = 0; b < n / G; ++b) {
    const float* vb = v.data() + static_cast<size_t>(b) * G * d;
    std::vector<uint8_t> bu, ba, widths(G);
    ASSERT_TRUE(EncodeValueBlock(uni, vb, d, nullptr, &bu).ok());
    ChooseValueBits(a2, vb, d, w.data() + b * G, G, 1000, widths.data());
    ASSERT_TRUE(EncodeValueBlock(a2, vb, d, widths.data(), &ba).ok());
    bytes_u += bu.size();
    bytes_a += ba.size();
    std::vector<float> ou(G * d), oa(G * d);
    DecodeValueBlock(*ParseValueBlock(bu, uni, true), ou.data());
    DecodeValueBlock(*ParseValueBlock(ba, a2, true), oa.data());
    du += A2ValueDistortion(w.data() + b * G, vb, ou.data(), G, d);
    da += A2ValueDistortion(w.data() + b * G, vb, oa.data(), G, d);
  }
  EXPECT_LT(da, 0.5 * du) << du << " " << da;
  EXPECT_LE(bytes_a, bytes_u + (n / G) * ((G + 3) / 4));  // only the width tags extra
}

// Probe weights sent with an append steer the A^2 policy: the weighted tokens decode closer.
TEST(ValuePolicy, ProbeWeightsThroughTheCache) {
  const int kv = 2, d = 64, T = 64;
  CodecOptions o;
  o.value_policy = ValuePolicy::kA2;
  o.value_budget = 2.0f;
  o.sink_tokens = 0;
  auto k = Gaussian(kv * T * d, 61), v = Gaussian(kv * T * d, 62);
  std::vector<float> probe(kv * T, 0.01f);
  for (int h = 0; h < kv; ++h)
    for (int t = 5; t < T; t += 9) probe[h * T + t] = 1.0f;  // a few heavy tokens per head
  LayerCache c(o, kv, nullptr);
  ASSERT_TRUE(c.Append(View3(k, kv, T, d), View3(v, kv, T, d), 0, probe.data()).ok());
  std::vector<float> kd, vd;
  ASSERT_TRUE(c.Decode(&kd, &vd).ok());
  double heavy = 0, light = 0;
  int nh = 0, nl = 0;
  for (int h = 0; h < kv; ++h)
    for (int t = 0; t < T; ++t) {
      double e = 0;
      for (int ch = 0; ch < d; ++ch) {
        const size_t i = (static_cast<size_t>(h) * T + t) * d + ch;
        e += (vd[i] - v[i]) * (vd[i] - v[i]);
      }
      if (probe[h * T + t] > 0.5f)
        heavy += e, ++nh;
      else
        light += e, ++nl;
    }
  EXPECT_LT(heavy / nh, 0.2 * light / nl);
  // The mean width stays within the budget (plus the 2-bit tags): same bytes as uniform 2-bit.
  CodecOptions uni;
  EXPECT_LE(c.Size().value_block_bytes,
            static_cast<int64_t>(ValueBlockBytes(uni) + (o.key_group + 3) / 4) * kv * (T / 32));
}

// Probe queries sent with an append: tokens they attend to get the wide value codes.
TEST(ValuePolicy, ProbeQueriesThroughTheCache) {
  const int kv = 1, qh = 3, d = 64, T = 32;
  CodecOptions o;
  o.value_policy = ValuePolicy::kA2;
  o.sink_tokens = 0;
  auto k = Gaussian(T * d, 71), v = Gaussian(T * d, 72);
  const int targets[qh] = {3, 17, 29};
  std::vector<float> q(qh * d);
  for (int h = 0; h < qh; ++h)
    for (int c = 0; c < d; ++c) q[h * d + c] = 3.0f * k[targets[h] * d + c];  // peaks on target
  LayerCache c(o, kv, nullptr);
  ProbeQueries pq{q.data(), qh, 1, -1};
  ASSERT_TRUE(c.Append(View3(k, kv, T, d), View3(v, kv, T, d), 0, pq).ok());
  EXPECT_EQ(c.Size().encoded_tokens, 32);
  std::vector<float> kd, vd;
  ASSERT_TRUE(c.Decode(&kd, &vd).ok());
  auto err = [&](int t) {
    double e = 0;
    for (int ch = 0; ch < d; ++ch)
      e += (vd[t * d + ch] - v[t * d + ch]) * (vd[t * d + ch] - v[t * d + ch]);
    return e;
  };
  double others = 0;
  for (int t = 0; t < T; ++t) others += err(t) / T;
  for (int t : targets) EXPECT_LT(err(t), 0.2 * others) << t;
  // Bad probes are rejected before anything is stored.
  ProbeQueries bad{q.data(), 2, 1, -1};  // 2 query heads over 1 KV head is fine ...
  bad.q_heads = 0;                       // ... 0 is not
  EXPECT_EQ(c.Append(View3(k, kv, T, d), View3(v, kv, T, d), T, bad).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(c.tokens(), T);
}

// Observe(p) records the same statistics as an observing Attend: the next encode matches.
TEST(ValuePolicy, ObserveMatchesObservingAttend) {
  const int kv = 1, qh = 3, d = 64, T = 20;
  CodecOptions o;
  o.value_policy = ValuePolicy::kA2;
  o.sink_tokens = 0;
  auto k = Gaussian(T * d, 81), v = Gaussian(T * d, 82), q = Gaussian(qh * d, 83, 2.0f);
  LayerCache a(o, kv, nullptr), b(o, kv, nullptr);
  ASSERT_TRUE(a.Append(View3(k, kv, T, d), View3(v, kv, T, d), 0).ok());
  ASSERT_TRUE(b.Append(View3(k, kv, T, d), View3(v, kv, T, d), 0).ok());
  std::vector<float> out(qh * d), p(qh * T);
  ASSERT_TRUE(a.Attend(q.data(), qh, 1, {}, out.data()).ok());
  ASSERT_TRUE(b.Score(q.data(), qh, 1, p.data()).ok());
  for (int h = 0; h < qh; ++h) Softmax(p.data() + h * T, T, p.data() + h * T);
  auto bad = p;
  bad[5] = 2.0f;  // a weight that is not a probability is refused, and records nothing
  EXPECT_EQ(b.Observe(bad.data(), qh, 1).code(), absl::StatusCode::kInvalidArgument);
  ASSERT_TRUE(b.Observe(p.data(), qh, 1).ok());
  auto k2 = Gaussian(12 * d, 84), v2 = Gaussian(12 * d, 85);  // fills the group: encode
  ASSERT_TRUE(a.Append(View3(k2, kv, 12, d), View3(v2, kv, 12, d), T).ok());
  ASSERT_TRUE(b.Append(View3(k2, kv, 12, d), View3(v2, kv, 12, d), T).ok());
  EXPECT_EQ(a.value_blocks(0), b.value_blocks(0));
}

TEST(Metrics, FisherApproximatesKLForSmallErrors) {
  auto s = Gaussian(500, 1, 2.0f);
  auto ds = Gaussian(500, 2, 0.01f);
  std::vector<float> s2(500);
  for (int i = 0; i < 500; ++i) s2[i] = s[i] + ds[i];
  const double kl = AttentionKL(s.data(), s2.data(), 500);
  const double f = FisherScoreError(s.data(), s2.data(), 500);
  EXPECT_NEAR(kl, f, 0.05 * f);
  EXPECT_NEAR(SpearmanRho({1, 2, 3, 4}, {10, 20, 30, 40}), 1.0, 1e-12);
  EXPECT_NEAR(SpearmanRho({1, 2, 3, 4}, {4, 3, 2, 1}), -1.0, 1e-12);
}

}  // namespace
}  // namespace kvq::core
