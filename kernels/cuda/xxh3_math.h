// XXH3-64 (xxHash's 64-bit hash, any length, any seed) and core's block checksum on top of it,
// as __host__ __device__ functions: the GPU verifies blocks with them (checksum.cu), the GPU
// encoder stamps its blocks with WriteBlockChecksum, and tests/kernels/cuda_checksum_test.cc runs
// the very same code on the CPU against libxxhash and against the checksums core writes.
//
// Written from the XXH3 specification (its primes and 192-byte default secret are the
// algorithm's constants); one thread hashes one buffer with the scalar variant, every multi-byte
// load through ReadLE (bytes, so any alignment: blocks sit at odd addresses in a pool).
#pragma once

#include <cstdint>

#include "kvq/format/block_format.h"
#include "kvq/kernels/cuda_checksum.h"

namespace kvq::kernels::cuda::xxh3_math {

inline constexpr uint64_t kPrime32_1 = 0x9E3779B1u;
inline constexpr uint64_t kPrime32_2 = 0x85EBCA77u;
inline constexpr uint64_t kPrime32_3 = 0xC2B2AE3Du;
inline constexpr uint64_t kPrime64_1 = 0x9E3779B185EBCA87ull;
inline constexpr uint64_t kPrime64_2 = 0xC2B2AE3D27D4EB4Full;
inline constexpr uint64_t kPrime64_3 = 0x165667B19E3779F9ull;
inline constexpr uint64_t kPrime64_4 = 0x85EBCA77C2B2AE63ull;
inline constexpr uint64_t kPrime64_5 = 0x27D4EB2F165667C5ull;
inline constexpr uint64_t kPrimeMx1 = 0x165667919E3779F9ull;
inline constexpr uint64_t kPrimeMx2 = 0x9FB21C651E98DF25ull;

inline constexpr int kSecretBytes = 192;
// Inputs longer than this take the striped long-input path.
inline constexpr uint64_t kMidSizeMax = 240;
inline constexpr uint64_t kStripeBytes = 64;
// Each stripe of a block starts 8 bytes further into the secret: 16 stripes (1 KiB) a block.
inline constexpr uint64_t kSecretConsumeRate = 8;
inline constexpr uint64_t kStripesPerBlock = (kSecretBytes - kStripeBytes) / kSecretConsumeRate;

// The default secret: every unseeded hash draws its keys from it; a seeded hash of more than
// kMidSizeMax bytes from a copy shifted by the seed (DeriveSecret).
KVQ_HD const uint8_t* DefaultSecret() {
  // 16 bytes a row, as the specification lists them.
  // clang-format off
  static constexpr uint8_t kSecret[kSecretBytes] = {
    0xb8, 0xfe, 0x6c, 0x39, 0x23, 0xa4, 0x4b, 0xbe, 0x7c, 0x01, 0x81, 0x2c, 0xf7, 0x21, 0xad, 0x1c,
    0xde, 0xd4, 0x6d, 0xe9, 0x83, 0x90, 0x97, 0xdb, 0x72, 0x40, 0xa4, 0xa4, 0xb7, 0xb3, 0x67, 0x1f,
    0xcb, 0x79, 0xe6, 0x4e, 0xcc, 0xc0, 0xe5, 0x78, 0x82, 0x5a, 0xd0, 0x7d, 0xcc, 0xff, 0x72, 0x21,
    0xb8, 0x08, 0x46, 0x74, 0xf7, 0x43, 0x24, 0x8e, 0xe0, 0x35, 0x90, 0xe6, 0x81, 0x3a, 0x26, 0x4c,
    0x3c, 0x28, 0x52, 0xbb, 0x91, 0xc3, 0x00, 0xcb, 0x88, 0xd0, 0x65, 0x8b, 0x1b, 0x53, 0x2e, 0xa3,
    0x71, 0x64, 0x48, 0x97, 0xa2, 0x0d, 0xf9, 0x4e, 0x38, 0x19, 0xef, 0x46, 0xa9, 0xde, 0xac, 0xd8,
    0xa8, 0xfa, 0x76, 0x3f, 0xe3, 0x9c, 0x34, 0x3f, 0xf9, 0xdc, 0xbb, 0xc7, 0xc7, 0x0b, 0x4f, 0x1d,
    0x8a, 0x51, 0xe0, 0x4b, 0xcd, 0xb4, 0x59, 0x31, 0xc8, 0x9f, 0x7e, 0xc9, 0xd9, 0x78, 0x73, 0x64,
    0xea, 0xc5, 0xac, 0x83, 0x34, 0xd3, 0xeb, 0xc3, 0xc5, 0x81, 0xa0, 0xff, 0xfa, 0x13, 0x63, 0xeb,
    0x17, 0x0d, 0xdd, 0x51, 0xb7, 0xf0, 0xda, 0x49, 0xd3, 0x16, 0x55, 0x26, 0x29, 0xd4, 0x68, 0x9e,
    0x2b, 0x16, 0xbe, 0x58, 0x7d, 0x47, 0xa1, 0xfc, 0x8f, 0xf8, 0xb8, 0xd1, 0x7a, 0xd0, 0x31, 0xce,
    0x45, 0xcb, 0x3a, 0x8f, 0x95, 0x16, 0x04, 0x28, 0xaf, 0xd7, 0xfb, 0xca, 0xbb, 0x4b, 0x40, 0x7e,
  };
  // clang-format on
  return kSecret;
}

// Little-endian loads and stores one byte at a time: valid at any address, on either side.
KVQ_HD uint32_t ReadLE32(const uint8_t* p) {
  return static_cast<uint32_t>(p[0]) | (static_cast<uint32_t>(p[1]) << 8) |
         (static_cast<uint32_t>(p[2]) << 16) | (static_cast<uint32_t>(p[3]) << 24);
}
KVQ_HD uint64_t ReadLE64(const uint8_t* p) {
  return static_cast<uint64_t>(ReadLE32(p)) | (static_cast<uint64_t>(ReadLE32(p + 4)) << 32);
}
KVQ_HD void WriteLE32(uint8_t* p, uint32_t v) {
  for (int i = 0; i < 4; ++i) p[i] = static_cast<uint8_t>(v >> (8 * i));
}
KVQ_HD void WriteLE64(uint8_t* p, uint64_t v) {
  for (int i = 0; i < 8; ++i) p[i] = static_cast<uint8_t>(v >> (8 * i));
}

KVQ_HD uint64_t Rotl64(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }
KVQ_HD uint32_t Swap32(uint32_t x) {
  return (x << 24) | ((x << 8) & 0x00FF0000u) | ((x >> 8) & 0x0000FF00u) | (x >> 24);
}
KVQ_HD uint64_t Swap64(uint64_t x) {
  return (static_cast<uint64_t>(Swap32(static_cast<uint32_t>(x))) << 32) |
         Swap32(static_cast<uint32_t>(x >> 32));
}

// The 128-bit product of a and b, its halves XOR-ed together.
KVQ_HD uint64_t Mul128Fold64(uint64_t a, uint64_t b) {
#ifdef __CUDA_ARCH__
  return (a * b) ^ __umul64hi(a, b);
#else
  const unsigned __int128 product = static_cast<unsigned __int128>(a) * b;
  return static_cast<uint64_t>(product) ^ static_cast<uint64_t>(product >> 64);
#endif
}

// XXH64's final mix (the 0-to-3-byte inputs end with it).
KVQ_HD uint64_t Avalanche64(uint64_t h) {
  h ^= h >> 33;
  h *= kPrime64_2;
  h ^= h >> 29;
  h *= kPrime64_3;
  return h ^ (h >> 32);
}

// XXH3's final mix.
KVQ_HD uint64_t Avalanche(uint64_t h) {
  h ^= h >> 37;
  h *= kPrimeMx1;
  return h ^ (h >> 32);
}

// The stronger final mix of the 4-to-8-byte inputs (fewer input bits, more mixing).
KVQ_HD uint64_t Rrmxmx(uint64_t h, uint64_t len) {
  h ^= Rotl64(h, 49) ^ Rotl64(h, 24);
  h *= kPrimeMx2;
  h ^= (h >> 35) + len;
  h *= kPrimeMx2;
  return h ^ (h >> 28);
}

KVQ_HD uint64_t HashLen1To3(const uint8_t* in, uint64_t len, const uint8_t* secret, uint64_t seed) {
  const uint32_t combined = (static_cast<uint32_t>(in[0]) << 16) |
                            (static_cast<uint32_t>(in[len >> 1]) << 24) |
                            static_cast<uint32_t>(in[len - 1]) | (static_cast<uint32_t>(len) << 8);
  const uint64_t bitflip = (ReadLE32(secret) ^ ReadLE32(secret + 4)) + seed;
  return Avalanche64(combined ^ bitflip);
}

KVQ_HD uint64_t HashLen4To8(const uint8_t* in, uint64_t len, const uint8_t* secret, uint64_t seed) {
  seed ^= static_cast<uint64_t>(Swap32(static_cast<uint32_t>(seed))) << 32;
  const uint64_t first = ReadLE32(in), last = ReadLE32(in + len - 4);
  const uint64_t bitflip = (ReadLE64(secret + 8) ^ ReadLE64(secret + 16)) - seed;
  return Rrmxmx((last + (first << 32)) ^ bitflip, len);
}

KVQ_HD uint64_t HashLen9To16(const uint8_t* in, uint64_t len, const uint8_t* secret,
                             uint64_t seed) {
  const uint64_t bitflip_lo = (ReadLE64(secret + 24) ^ ReadLE64(secret + 32)) + seed;
  const uint64_t bitflip_hi = (ReadLE64(secret + 40) ^ ReadLE64(secret + 48)) - seed;
  const uint64_t lo = ReadLE64(in) ^ bitflip_lo, hi = ReadLE64(in + len - 8) ^ bitflip_hi;
  return Avalanche(len + Swap64(lo) + hi + Mul128Fold64(lo, hi));
}

// 16 input bytes keyed by 16 secret bytes and the seed, multiplied down to 64 bits.
KVQ_HD uint64_t Mix16(const uint8_t* in, const uint8_t* secret, uint64_t seed) {
  return Mul128Fold64(ReadLE64(in) ^ (ReadLE64(secret) + seed),
                      ReadLE64(in + 8) ^ (ReadLE64(secret + 8) - seed));
}

// 17..128 bytes: pairs of 16-byte lanes from both ends towards the middle.
KVQ_HD uint64_t HashLen17To128(const uint8_t* in, uint64_t len, const uint8_t* secret,
                               uint64_t seed) {
  uint64_t acc = len * kPrime64_1;
  // Pair k (from 0) covers bytes [16k, 16k + 16) and [len - 16(k + 1), len - 16k) with secret
  // bytes [32k, 32k + 32); pairs 1, 2, 3 join above 32, 64, 96 bytes.
  const int pairs = len > 96 ? 4 : len > 64 ? 3 : len > 32 ? 2 : 1;
  for (int k = 0; k < pairs; ++k) {
    acc += Mix16(in + 16 * k, secret + 32 * k, seed);
    acc += Mix16(in + len - 16 * (k + 1), secret + 32 * k + 16, seed);
  }
  return Avalanche(acc);
}

// 129..240 bytes: 16-byte lanes in order, the first 8 avalanched before the rest join, the last
// 16 bytes keyed apart.
KVQ_HD uint64_t HashLen129To240(const uint8_t* in, uint64_t len, const uint8_t* secret,
                                uint64_t seed) {
  constexpr int kStartOffset = 3, kLastOffset = 17, kSecretSizeMin = 136;
  const int lanes = static_cast<int>(len / 16);
  uint64_t acc = len * kPrime64_1;
  for (int i = 0; i < 8; ++i) acc += Mix16(in + 16 * i, secret + 16 * i, seed);
  acc = Avalanche(acc);
  for (int i = 8; i < lanes; ++i)
    acc += Mix16(in + 16 * i, secret + 16 * (i - 8) + kStartOffset, seed);
  acc += Mix16(in + len - 16, secret + kSecretSizeMin - kLastOffset, seed);
  return Avalanche(acc);
}

// One 64-byte stripe into the 8 accumulators: lane i adds its 32x32 product of input ^ key and,
// to its neighbour, the input itself.
KVQ_HD void Accumulate512(uint64_t* acc, const uint8_t* in, const uint8_t* secret) {
  KVQ_UNROLL
  for (int i = 0; i < 8; ++i) {
    const uint64_t value = ReadLE64(in + 8 * i);
    const uint64_t keyed = value ^ ReadLE64(secret + 8 * i);
    acc[i ^ 1] += value;
    acc[i] += (keyed & 0xFFFFFFFFu) * (keyed >> 32);
  }
}

// After each block of kStripesPerBlock stripes: the accumulators' high bits folded back in.
KVQ_HD void ScrambleAcc(uint64_t* acc, const uint8_t* secret) {
  KVQ_UNROLL
  for (int i = 0; i < 8; ++i) {
    uint64_t a = acc[i];
    a ^= a >> 47;
    a ^= ReadLE64(secret + 8 * i);
    acc[i] = a * kPrime32_1;
  }
}

// More than kMidSizeMax bytes with a kSecretBytes secret.
KVQ_HD uint64_t HashLong(const uint8_t* in, uint64_t len, const uint8_t* secret) {
  constexpr uint64_t kLastStripeOffset = 7, kMergeOffset = 11;
  constexpr uint64_t kBlockBytes = kStripeBytes * kStripesPerBlock;
  uint64_t acc[8] = {kPrime32_3, kPrime64_1, kPrime64_2, kPrime64_3,
                     kPrime64_4, kPrime32_2, kPrime64_5, kPrime32_1};
  const uint64_t blocks = (len - 1) / kBlockBytes;
  for (uint64_t b = 0; b < blocks; ++b) {
    for (uint64_t s = 0; s < kStripesPerBlock; ++s)
      Accumulate512(acc, in + b * kBlockBytes + s * kStripeBytes, secret + s * kSecretConsumeRate);
    ScrambleAcc(acc, secret + kSecretBytes - kStripeBytes);
  }
  // The whole stripes of the last, partial block; then the last 64 bytes (overlapping them).
  const uint64_t stripes = ((len - 1) - blocks * kBlockBytes) / kStripeBytes;
  for (uint64_t s = 0; s < stripes; ++s)
    Accumulate512(acc, in + blocks * kBlockBytes + s * kStripeBytes,
                  secret + s * kSecretConsumeRate);
  Accumulate512(acc, in + len - kStripeBytes,
                secret + kSecretBytes - kStripeBytes - kLastStripeOffset);
  uint64_t result = len * kPrime64_1;
  for (int i = 0; i < 4; ++i)
    result += Mul128Fold64(acc[2 * i] ^ ReadLE64(secret + kMergeOffset + 16 * i),
                           acc[2 * i + 1] ^ ReadLE64(secret + kMergeOffset + 16 * i + 8));
  return Avalanche(result);
}

// The seeded long-input secret: the default one with the seed added to its even 8-byte words
// and subtracted from its odd ones.
KVQ_HD void DeriveSecret(uint64_t seed, uint8_t* out) {
  const uint8_t* base = DefaultSecret();
  for (int i = 0; i < kSecretBytes / 16; ++i) {
    WriteLE64(out + 16 * i, ReadLE64(base + 16 * i) + seed);
    WriteLE64(out + 16 * i + 8, ReadLE64(base + 16 * i + 8) - seed);
  }
}

// XXH3_64bits_withSeed(data, len, seed); seed 0 is XXH3_64bits(data, len).
KVQ_HD uint64_t Hash64(const uint8_t* data, uint64_t len, uint64_t seed) {
  const uint8_t* secret = DefaultSecret();
  if (len == 0) return Avalanche64(seed ^ ReadLE64(secret + 56) ^ ReadLE64(secret + 64));
  if (len <= 3) return HashLen1To3(data, len, secret, seed);
  if (len <= 8) return HashLen4To8(data, len, secret, seed);
  if (len <= 16) return HashLen9To16(data, len, secret, seed);
  if (len <= 128) return HashLen17To128(data, len, secret, seed);
  if (len <= kMidSizeMax) return HashLen129To240(data, len, secret, seed);
  if (seed == 0) return HashLong(data, len, secret);
  uint8_t derived[kSecretBytes];
  DeriveSecret(seed, derived);
  return HashLong(data, len, derived);
}

// The block checksum (kvq/format/block_format.h): header bytes 0..11 and the payload (bytes
// 16..size) hashed unseeded, mixed by format::MixChecksum. size >= 16.
KVQ_HD uint32_t BlockChecksum(const uint8_t* block, uint64_t size) {
  namespace f = kvq::format;
  return f::MixChecksum(Hash64(block + f::kHeaderBytes, size - f::kHeaderBytes, 0),
                        Hash64(block, f::kHashedHeaderBytes, 0));
}

// Stores BlockChecksum at header bytes 12..15 (little-endian): the last step of encoding a
// block whose other header fields and payload are written. size >= 16.
KVQ_HD void WriteBlockChecksum(uint8_t* block, uint64_t size) {
  WriteLE32(block + kvq::format::kChecksumAt, BlockChecksum(block, size));
}

// kVerifyOk, kVerifyBadHeader (not a block: null, shorter than the header, another magic, a
// version this build does not read) or kVerifyChecksum (the stored checksum differs).
KVQ_HD int VerifyOne(const uint8_t* block, uint64_t size) {
  namespace f = kvq::format;
  if (block == nullptr || size < static_cast<uint64_t>(f::kHeaderBytes)) return kVerifyBadHeader;
  if (f::LoadU16(block + f::kMagicAt) != f::kMagic) return kVerifyBadHeader;
  if (!f::VersionReadable(block[f::kVersionAt])) return kVerifyBadHeader;
  return ReadLE32(block + f::kChecksumAt) == BlockChecksum(block, size) ? kVerifyOk
                                                                        : kVerifyChecksum;
}

// The batched op's launch shape: thread t of thread block b verifies block b * kVerifyThreads
// + t (one thread per block; a block's ~1 KiB is hashed serially by its thread).
inline constexpr int kVerifyThreads = 128;
KVQ_HD int VerifyGrid(int blocks) { return (blocks + kVerifyThreads - 1) / kVerifyThreads; }
KVQ_HD void VerifyThread(const VerifyParams& p, int thread_block, int thread) {
  const int64_t i = static_cast<int64_t>(thread_block) * kVerifyThreads + thread;
  if (i < p.blocks) p.verdicts[i] = static_cast<uint8_t>(VerifyOne(p.block_ptrs[i], p.sizes[i]));
}

}  // namespace kvq::kernels::cuda::xxh3_math
