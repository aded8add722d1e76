// The block format (kvq/format/block_format.h) on its own: fp16 conversions against the
// compiler's half type and the F16C instructions, bit for bit over every half and many floats;
// header fields written and read back; versions and flags; key and value layouts against
// sizes worked out by hand from the format's description.
#include "kvq/format/block_format.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

namespace kvq::testing {

uint16_t F16cFloatToHalf(float f);  // block_format_f16c.cc
float F16cHalfToFloat(uint16_t h);

namespace {

// The compiler's conversion (libgcc's or compiler-rt's soft-float code here: this file builds
// without F16C): the independent reference.
#if defined(__clang__) && __clang_major__ < 15
using CompilerHalf = __fp16;
#else
using CompilerHalf = _Float16;
#endif
uint16_t CompilerFloatToHalf(float f) {
  CompilerHalf h = static_cast<CompilerHalf>(f);
  uint16_t u;
  std::memcpy(&u, &h, 2);
  return u;
}
float CompilerHalfToFloat(uint16_t u) {
  CompilerHalf h;
  std::memcpy(&h, &u, 2);
  return static_cast<float>(h);
}
uint32_t Bits(float f) { return format::FloatBits(f); }

bool HasF16c() {
  __builtin_cpu_init();
#if defined(__clang__) && __clang_major__ < 15
  return __builtin_cpu_supports("avx2");
#else
  return __builtin_cpu_supports("f16c");
#endif
}

TEST(BlockFormat, HalfToFloatIsExactForEveryHalf) {
  const bool f16c = HasF16c();
  for (uint32_t u = 0; u < 65536; ++u) {
    const uint16_t h = static_cast<uint16_t>(u);
    const float got = format::HalfToFloat(h);
    if (std::isnan(got)) {
      ASSERT_TRUE(std::isnan(CompilerHalfToFloat(h))) << "half 0x" << std::hex << u;
      ASSERT_EQ(Bits(got) >> 31, static_cast<uint32_t>(h >> 15));
      continue;
    }
    ASSERT_EQ(Bits(got), Bits(CompilerHalfToFloat(h))) << "half 0x" << std::hex << u;
    if (f16c) {
      ASSERT_EQ(Bits(got), Bits(F16cHalfToFloat(h))) << "half 0x" << std::hex << u;
    }
    // Every half survives the round trip.
    ASSERT_EQ(format::FloatToHalf(got), h) << "half 0x" << std::hex << u;
  }
}

TEST(BlockFormat, FloatToHalfRoundsToNearestEvenAsTheReferences) {
  std::vector<float> xs = {0.0f,     -0.0f,         1.0f,          65504.0f,      65519.9f,
                           65520.0f, -65520.0f,     6.1035156e-5f, 6.1035152e-5f, 2.9802322e-8f,
                           2.98e-8f, 5.9604645e-8f, 1e-10f,        0.33333334f,   -1234.567f,
                           INFINITY, -INFINITY,     1e30f,         -1e30f};
  std::mt19937 rng(7);
  for (int k = 0; k < 400000; ++k) {
    const uint32_t u = rng();
    float f;
    std::memcpy(&f, &u, 4);
    xs.push_back(f);
  }
  // Dense around the half subnormals and the rounding ties of normal halves.
  for (float f = 1e-8f; f < 1e-4f; f *= 1.0001f) xs.push_back(f);
  for (float f = 1.0f; f < 1.01f; f = std::nextafter(f, 2.0f)) xs.push_back(f);
  const bool f16c = HasF16c();
  int mismatches = 0;
  for (float f : xs) {
    const uint16_t got = format::FloatToHalf(f);
    const uint16_t want = CompilerFloatToHalf(f);
    const bool nan = std::isnan(f);
    if (nan) {  // a NaN stays a NaN of the same sign (payload bits may differ between forms)
      EXPECT_EQ(got & 0x7c00u, 0x7c00u);
      EXPECT_NE(got & 0x3ffu, 0u);
      EXPECT_EQ(got >> 15, want >> 15);
    } else if (got != want && ++mismatches < 5) {
      ADD_FAILURE() << "FloatToHalf(" << f << ") = " << got << ", compiler " << want;
    }
    if (f16c && !nan && got != F16cFloatToHalf(f) && ++mismatches < 5)
      ADD_FAILURE() << "FloatToHalf(" << f << ") = " << got << ", F16C " << F16cFloatToHalf(f);
    if (f16c && nan) {
      EXPECT_EQ(got, F16cFloatToHalf(f)) << "NaN payloads as F16C keeps them";
    }
  }
  EXPECT_EQ(mismatches, 0);
}

TEST(BlockFormat, HeaderFieldsRoundTrip) {
  uint8_t b[format::kHeaderBytes] = {};
  format::WriteHeaderFields(b, format::KindByte(format::kKindKey, false, false), 3, 8, 64, 128, 5);
  format::StoreU32(b + format::kChecksumAt, 0xA1B2C3D4u);
  const format::Header h = format::ReadHeader(b);
  EXPECT_EQ(b[0], 0x4b);  // "KQ", little-endian
  EXPECT_EQ(b[1], 0x51);
  EXPECT_EQ(h.magic, format::kMagic);
  EXPECT_EQ(h.version, format::kVersion);
  EXPECT_EQ(h.kind, format::kKindKey);
  EXPECT_EQ(h.flags, 0);
  EXPECT_EQ(h.bits, 3);
  EXPECT_EQ(h.side_bits, 8);
  EXPECT_EQ(h.tokens, 64);
  EXPECT_EQ(h.head_dim, 128);
  EXPECT_EQ(h.extra, 5);
  EXPECT_EQ(h.checksum, 0xA1B2C3D4u);
  EXPECT_EQ(b[12], 0xD4);

  // A flag makes the block version 3; the kind keeps its low nibble.
  format::WriteHeaderFields(b, format::KindByte(format::kKindValue, true, true), 0, 0, 32, 64, 32);
  const format::Header v = format::ReadHeader(b);
  EXPECT_EQ(v.version, format::kVersionFlags);
  EXPECT_EQ(v.kind, format::kKindValue);
  EXPECT_EQ(v.flags, format::kFlagRotated | format::kFlagSparse);
  EXPECT_TRUE(format::FlagsValid(v.version, v.flags));
}

TEST(BlockFormat, VersionsAndFlags) {
  EXPECT_FALSE(format::VersionReadable(0));
  EXPECT_FALSE(format::VersionReadable(1));  // the seeded checksum: never read
  EXPECT_TRUE(format::VersionReadable(2));
  EXPECT_TRUE(format::VersionReadable(3));
  EXPECT_FALSE(format::VersionReadable(4));
  EXPECT_TRUE(format::FlagsValid(2, 0));
  EXPECT_FALSE(format::FlagsValid(2, format::kFlagRotated));  // a flag needs version 3
  EXPECT_FALSE(format::FlagsValid(3, 0));                     // version 3 needs a flag
  EXPECT_FALSE(format::FlagsValid(3, 0x40));                  // unknown flag
  EXPECT_EQ(format::VersionFor(format::kKindKey), format::kVersion);
  EXPECT_EQ(format::VersionFor(format::kKindKey | format::kFlagSparse), format::kVersionFlags);
}

TEST(BlockFormat, KeyLayoutByHand) {
  // d 64, G 32, 2-bit codes, rank 4 with 8-bit side codes, 10 sparse entries:
  // 16 header + 64*2 scale + 64*2 zero + 64*(32*2/8) codes + 4*2 + 4*2 + 4*(32*8/8) + 10*4.
  format::BlockCodec c;
  c.head_dim = 64;
  c.key_group = 32;
  c.key_bits = 2;
  c.rank = 4;
  c.side_bits = 8;
  c.key_sparse = 10;
  const format::KeyLayout k = format::MakeKeyLayout(c);
  EXPECT_EQ(k.scale, 16);
  EXPECT_EQ(k.zero, 16 + 128);
  EXPECT_EQ(k.codes, 16 + 256);
  EXPECT_EQ(k.row, 8);
  EXPECT_EQ(k.side_scale, 16 + 256 + 512);
  EXPECT_EQ(k.side_zero, k.side_scale + 8);
  EXPECT_EQ(k.side_codes, k.side_scale + 16);
  EXPECT_EQ(k.side_row, 32);
  EXPECT_EQ(k.sparse, k.side_codes + 128);
  EXPECT_EQ(k.bytes, 16 + 256 + 512 + 16 + 128 + 40);
  // Rank 0: no side code, whatever side_bits says; 3-bit codes over 64 tokens (24 bytes a row).
  c.rank = 0;
  c.key_bits = 3;
  c.key_group = 64;
  c.key_sparse = 0;
  const format::KeyLayout k0 = format::MakeKeyLayout(c);
  EXPECT_EQ(k0.side_bits, 0);
  EXPECT_EQ(k0.side_row, 0);
  EXPECT_EQ(k0.bytes, 16 + 256 + 64 * 24);
}

TEST(BlockFormat, ValueLayoutByHand) {
  format::BlockCodec c;
  c.head_dim = 128;
  c.key_group = 32;
  c.value_group = 48;  // 3 groups, the last one short
  c.value_bits = 3;
  // Uniform: 32 records of 3*2 scale + 3*2 zero + 128*3/8 codes.
  EXPECT_EQ(format::ValueGroups(c), 3);
  EXPECT_EQ(format::ValueRecordBytes(c, 3), 12 + 48);
  EXPECT_EQ(format::ValueTagBytes(c), 0);
  std::vector<uint8_t> block(format::kHeaderBytes + 32 * 60, 0);
  EXPECT_EQ(format::ValueBlockBytes(c, block.data()), 16 + 32 * 60);
  EXPECT_EQ(format::MaxValueBlockBytes(c), 16 + 32 * 60);
  // Per-token widths: tags (2 bits a token) then records of each token's width.
  c.value_bits = 0;
  c.value_sparse = 2;
  std::vector<uint8_t> tagged(format::kHeaderBytes + format::ValueTagBytes(32), 0);
  int64_t want = format::kHeaderBytes + 8;
  for (int t = 0; t < 32; ++t) {
    const int w = 1 + t % 4;
    tagged[format::kHeaderBytes + t / 4] |= format::WidthTag(w, t);
    want += 12 + 128 * w / 8;
  }
  for (int t = 0; t < 32; ++t) EXPECT_EQ(format::TokenWidth(c, tagged.data(), t), 1 + t % 4);
  EXPECT_EQ(format::ValueRecordOffset(c, tagged.data(), 1), 16 + 8 + 12 + 16);
  EXPECT_EQ(format::ValueBlockBytes(c, tagged.data()), want + 2 * 4);
  EXPECT_EQ(format::MaxValueBlockBytes(c), 16 + 8 + 32 * (12 + 64) + 8);
}

}  // namespace
}  // namespace kvq::testing
