// The HeadQ block format: the one definition of a stored block's bytes. Core's encoder and
// readers, the CUDA kernels and their CPU stand-ins, and the checksum code all take the magic,
// versions, flags, header layout, payload offsets and fp16 conversions from here; nothing else
// defines them. Header-only and __host__ __device__, so CUDA code compiles it as it is.
//
// A block holds G consecutive tokens of one KV head (G = the codec's key_group), little-endian,
// every byte counted in the bits-per-element figures:
//
//   header (16 bytes): u16 magic 0x514b "KQ" | u8 version | u8 kind (low nibble: 1 key,
//                      2 value; high nibble: flags) | u8 bits (values: 0 = per-token widths)
//                      | u8 side_bits | u16 tokens | u16 head_dim | u16 rank (keys) or
//                      value_group (values) | u32 checksum
//   checksum:          low 32 bits of XXH3-64(payload) ^ kHeaderHashMultiplier *
//                      XXH3-64(header bytes 0..11) (both unseeded)
//   key payload:       fp16 scale[d] | fp16 zero[d] | codes[d][G*bits/8] (channel-major)
//                      | fp16 side_scale[r] | fp16 side_zero[r] | side codes[r][G*side_bits/8]
//                      | sparse list (kFlagSparse only)
//   value payload:     (per-token widths only) u8 tags[ceil(G/4)] (2 bits a token: 0..3 ->
//                      1..4 bits) | per token: fp16 scale[ng] | fp16 zero[ng]
//                      | codes[ceil(d*bits/8)] (token-major, tight) | sparse list (kFlagSparse)
//   sparse list:       n entries of u16 position (t * head_dim + c) | fp16 delta (the exact
//                      element minus what the codes decode to there), sorted by position;
//                      unused entries are position 0, delta 0.
//
// Codes of b bits are packed LSB-first: code i occupies bits [i*b, i*b+b) of its row.
// Version 2 is written for blocks without flags, version 3 (the same layout) for blocks with a
// flag, so that codecs without flags keep writing version-2 bytes. Version 1 (a seeded payload
// hash) was never written outside tests and is not read.
#pragma once

#include <cstdint>
#include <cstring>

#include "kvq/format/hd.h"

#ifdef __CUDACC__
#include <cuda_fp16.h>
#elif defined(__F16C__)
#include <immintrin.h>
#endif

namespace kvq::format {

// ---- Header ----

inline constexpr uint16_t kMagic = 0x514b;
inline constexpr uint8_t kVersion = 2;       // written for blocks without flags
inline constexpr uint8_t kVersionFlags = 3;  // written for blocks with a flag
inline constexpr uint8_t kMinVersion = kVersion, kMaxVersion = kVersionFlags;  // read

inline constexpr uint8_t kKindKey = 1, kKindValue = 2;
inline constexpr uint8_t kKindMask = 0x0F, kFlagMask = 0xF0;
// The rows were rotated by the normalized Walsh-Hadamard matrix H before quantization.
inline constexpr uint8_t kFlagRotated = 0x10;
// The block ends with a dense-and-sparse list.
inline constexpr uint8_t kFlagSparse = 0x20;

inline constexpr int kHeaderBytes = 16;
inline constexpr int kHashedHeaderBytes = 12;  // bytes 0..11: everything but the checksum
inline constexpr uint64_t kHeaderHashMultiplier = 0x9E3779B97F4A7C15ull;
inline constexpr int kSparseEntryBytes = 4;
// The largest finite fp16 magnitude: every stored scale, zero point and delta is within it.
inline constexpr float kHalfMax = 65504.0f;
// Header field offsets.
inline constexpr int kMagicAt = 0, kVersionAt = 2, kKindAt = 3, kBitsAt = 4, kSideBitsAt = 5,
                     kTokensAt = 6, kHeadDimAt = 8, kExtraAt = 10, kChecksumAt = 12;
// The most tokens a block holds (the largest key_group); value tags and views are sized by it.
inline constexpr int kMaxBlockTokens = 128;

// ---- Bit casts and little-endian fields (any alignment: blocks sit at odd addresses) ----

KVQ_HD uint32_t FloatBits(float f) {
#ifdef __CUDA_ARCH__
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
#endif
}
KVQ_HD float BitsToFloat(uint32_t u) {
#ifdef __CUDA_ARCH__
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, 4);
  return f;
#endif
}
KVQ_HD uint32_t LoadU16(const uint8_t* p) { return p[0] | (static_cast<uint32_t>(p[1]) << 8); }
KVQ_HD void StoreU16(uint8_t* p, uint32_t v) {
  p[0] = static_cast<uint8_t>(v);
  p[1] = static_cast<uint8_t>(v >> 8);
}
KVQ_HD uint32_t LoadU32(const uint8_t* p) { return LoadU16(p) | (LoadU16(p + 2) << 16); }
KVQ_HD void StoreU32(uint8_t* p, uint32_t v) {
  StoreU16(p, v & 0xffffu);
  StoreU16(p + 2, v >> 16);
}

// ---- fp16 (IEEE binary16) <-> fp32, exact, rounding to nearest even ----
// The same bits on every side: the GPU's conversions, F16C where the host translation unit is
// compiled for it, else bit manipulation. fp32 beyond fp16's range rounds to Inf; a NaN stays a
// NaN (to fp16: its payload's top bits kept and the quiet bit set, as F16C does).
// The two host forms live in different inline namespaces, so that translation units compiled
// with and without F16C never share one definition (the linker could otherwise pick the F16C
// one for code that runs where the CPU lacks it).
#if defined(__F16C__) && !defined(__CUDA_ARCH__)
inline namespace f16c {
#else
inline namespace portable {
#endif

KVQ_HD float HalfToFloat(uint16_t h) {
#ifdef __CUDA_ARCH__
  return __half2float(__ushort_as_half(h));
#elif defined(__F16C__)
  return _cvtsh_ss(h);
#else
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu;
  if (exp == 0) {  // zero or subnormal: mant * 2^-24
    const float f = static_cast<float>(mant) * 5.9604644775390625e-8f;
    return sign ? -f : f;
  }
  if (exp == 31) return BitsToFloat(sign | 0x7f800000u | (mant << 13));
  return BitsToFloat(sign | ((exp + 112) << 23) | (mant << 13));
#endif
}

KVQ_HD uint16_t FloatToHalf(float f) {
#ifdef __CUDA_ARCH__
  return __half_as_ushort(__float2half_rn(f));
#elif defined(__F16C__)
  return _cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT);
#else
  uint32_t x = FloatBits(f);
  const uint32_t sign = (x >> 16) & 0x8000u;
  x &= 0x7fffffffu;
  if (x > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u | ((x >> 13) & 0x3ffu));
  if (x >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // >= 65520 or Inf: Inf
  if (x < 0x38800000u) {  // below 2^-14: a subnormal half (units of 2^-24) or zero
    if (x < 0x33000000u) return static_cast<uint16_t>(sign);  // below 2^-25 (ties: even, 0)
    const int shift = 126 - static_cast<int>(x >> 23);        // 14..24
    const uint32_t m = (x & 0x7fffffu) | 0x800000u;
    uint32_t q = m >> shift;
    const uint32_t rem = m & ((1u << shift) - 1u), half = 1u << (shift - 1);
    if (rem > half || (rem == half && (q & 1u))) ++q;
    return static_cast<uint16_t>(sign | q);
  }
  x += 0xfffu + ((x >> 13) & 1u);  // round the 13 dropped bits to nearest even
  return static_cast<uint16_t>(sign | ((x - (112u << 23)) >> 13));
#endif
}
}  // inline namespace

// ---- The header ----

// The fields of a header as stored (no check made).
struct Header {
  uint16_t magic;
  uint8_t version, kind, flags, bits, side_bits;
  uint16_t tokens, head_dim, extra;  // extra: rank (keys) or value_group (values)
  uint32_t checksum;
};
KVQ_HD Header ReadHeader(const uint8_t* p) {
  Header h{};
  h.magic = static_cast<uint16_t>(LoadU16(p + kMagicAt));
  h.version = p[kVersionAt];
  h.kind = p[kKindAt] & kKindMask;
  h.flags = p[kKindAt] & kFlagMask;
  h.bits = p[kBitsAt];
  h.side_bits = p[kSideBitsAt];
  h.tokens = static_cast<uint16_t>(LoadU16(p + kTokensAt));
  h.head_dim = static_cast<uint16_t>(LoadU16(p + kHeadDimAt));
  h.extra = static_cast<uint16_t>(LoadU16(p + kExtraAt));
  h.checksum = LoadU32(p + kChecksumAt);
  return h;
}

// The kind byte of a block: kind (kKindKey, kKindValue) with its flags.
KVQ_HD uint8_t KindByte(uint8_t kind, bool rotated, bool sparse) {
  return static_cast<uint8_t>(kind | (rotated ? kFlagRotated : 0) | (sparse ? kFlagSparse : 0));
}
// The version written for a block with this kind byte.
KVQ_HD uint8_t VersionFor(uint8_t kind_byte) {
  return (kind_byte & kFlagMask) != 0 ? kVersionFlags : kVersion;
}
KVQ_HD bool VersionReadable(uint8_t version) {
  return version >= kMinVersion && version <= kMaxVersion;
}
// Flags known to this build, and present exactly when the version says so.
KVQ_HD bool FlagsValid(uint8_t version, uint8_t flags) {
  return (version == kVersionFlags) == (flags != 0) && (flags & ~(kFlagRotated | kFlagSparse)) == 0;
}

// Header bytes 0..11 (everything but the checksum, which goes in after the payload).
KVQ_HD void WriteHeaderFields(uint8_t* p, uint8_t kind_byte, int bits, int side_bits, int tokens,
                              int head_dim, int extra) {
  StoreU16(p + kMagicAt, kMagic);
  p[kVersionAt] = VersionFor(kind_byte);
  p[kKindAt] = kind_byte;
  p[kBitsAt] = static_cast<uint8_t>(bits);
  p[kSideBitsAt] = static_cast<uint8_t>(side_bits);
  StoreU16(p + kTokensAt, static_cast<uint32_t>(tokens));
  StoreU16(p + kHeadDimAt, static_cast<uint32_t>(head_dim));
  StoreU16(p + kExtraAt, static_cast<uint32_t>(extra));
}
// The checksum from the two hashes: XXH3-64 of the payload and of header bytes 0..11.
KVQ_HD uint32_t MixChecksum(uint64_t payload_hash, uint64_t header_hash) {
  return static_cast<uint32_t>(payload_hash ^ (header_hash * kHeaderHashMultiplier));
}

// ---- What a codec makes of a block: the fields that fix its layout ----

// The codec fields a block's layout depends on (core's CodecOptions carries them, the kernels
// take them as they are).
struct BlockCodec {
  int head_dim = 0;     // d, 1..512 (a power of two when rotating)
  int key_group = 0;    // G, tokens per block: 32, 64 or 128
  int key_bits = 0;     // 2, 3, 4 or 8
  int rank = 0;         // HeadQ rank, 0..d
  int side_bits = 0;    // 4 or 8 when rank > 0
  int value_bits = 0;   // 1, 2, 3, 4 or 8; 0: per-token widths (1..4, the A^2 policy)
  int value_group = 0;  // channels per value scale group, 1..d, at most 64 groups
  bool rotate_keys = false, rotate_values = false;
  // Dense-and-sparse list entries of each key and value block (0: no list, no kFlagSparse).
  int key_sparse = 0, value_sparse = 0;
};

// Bytes of a row of n codes of `bits` bits.
KVQ_HD int64_t RowBytes(int64_t n, int bits) { return (n * bits + 7) / 8; }

// Byte offsets of a key block's fields from the block's start.
struct KeyLayout {
  int d, G, r, bits, side_bits;
  int64_t scale, zero, codes, row;            // base code: row = bytes of one channel's codes
  int64_t side_scale, side_zero, side_codes;  // side code (rank > 0)
  int64_t side_row;                           // bytes of one coefficient's codes (0: rank 0)
  int64_t sparse;                             // the sparse list
  int64_t bytes;                              // the whole block
};
KVQ_HD KeyLayout MakeKeyLayout(int head_dim, int tokens, int bits, int rank, int side_bits,
                               int sparse_entries) {
  KeyLayout k{};
  k.d = head_dim;
  k.G = tokens;
  k.r = rank;
  k.bits = bits;
  k.side_bits = rank > 0 ? side_bits : 0;
  k.scale = kHeaderBytes;
  k.zero = k.scale + 2 * k.d;
  k.codes = k.zero + 2 * k.d;
  k.row = RowBytes(k.G, k.bits);
  k.side_scale = k.codes + k.d * k.row;
  k.side_zero = k.side_scale + 2 * k.r;
  k.side_codes = k.side_zero + 2 * k.r;
  k.side_row = k.r > 0 ? RowBytes(k.G, k.side_bits) : 0;
  k.sparse = k.side_codes + k.r * k.side_row;
  k.bytes = k.sparse + static_cast<int64_t>(kSparseEntryBytes) * sparse_entries;
  return k;
}
KVQ_HD KeyLayout MakeKeyLayout(const BlockCodec& c) {
  return MakeKeyLayout(c.head_dim, c.key_group, c.key_bits, c.rank, c.side_bits, c.key_sparse);
}

// Value blocks: ng scale groups a token; a record per token (fp16 scale[ng] | fp16 zero[ng] |
// codes); per-token widths add a tag area before the records.
KVQ_HD int ValueGroups(int head_dim, int value_group) {
  return (head_dim + value_group - 1) / value_group;
}
KVQ_HD int64_t ValueRecordBytes(int head_dim, int value_group, int bits) {
  return 4 * ValueGroups(head_dim, value_group) + RowBytes(head_dim, bits);
}
KVQ_HD int64_t ValueTagBytes(int tokens) { return (tokens + 3) / 4; }
// Width of token t from a per-token block's tags (the bytes after the header): 1..4 bits.
KVQ_HD int TagWidth(const uint8_t* tags, int t) {
  return ((tags[t >> 2] >> (2 * (t & 3))) & 3) + 1;
}
// The tag of a width 1..4.
KVQ_HD uint8_t WidthTag(int bits, int t) {
  return static_cast<uint8_t>((bits - 1) << (2 * (t & 3)));
}
// Bytes of a value block whose tokens all have `bits` (uniform widths: no tag area).
KVQ_HD int64_t UniformValueBlockBytes(int head_dim, int tokens, int value_group, int bits,
                                      int sparse_entries) {
  return kHeaderBytes + tokens * ValueRecordBytes(head_dim, value_group, bits) +
         static_cast<int64_t>(kSparseEntryBytes) * sparse_entries;
}
// The largest value block of per-token widths (every token at 4 bits, with the tag area).
KVQ_HD int64_t MaxPerTokenValueBlockBytes(int head_dim, int tokens, int value_group,
                                          int sparse_entries) {
  return UniformValueBlockBytes(head_dim, tokens, value_group, 4, sparse_entries) +
         ValueTagBytes(tokens);
}

// The same for a codec's value blocks, walking a block's tags where widths are per token.
KVQ_HD int ValueGroups(const BlockCodec& c) { return ValueGroups(c.head_dim, c.value_group); }
KVQ_HD int64_t ValueRecordBytes(const BlockCodec& c, int bits) {
  return ValueRecordBytes(c.head_dim, c.value_group, bits);
}
// Bytes of the tag area: 0 with uniform widths.
KVQ_HD int64_t ValueTagBytes(const BlockCodec& c) {
  return c.value_bits == 0 ? ValueTagBytes(c.key_group) : 0;
}
// Width of token t of a value block: from its tags (per-token widths) or the codec.
KVQ_HD int TokenWidth(const BlockCodec& c, const uint8_t* block, int t) {
  return c.value_bits != 0 ? c.value_bits : TagWidth(block + kHeaderBytes, t);
}
// Byte offset of token t's record in a value block (t = key_group: the end of the records).
KVQ_HD int64_t ValueRecordOffset(const BlockCodec& c, const uint8_t* block, int t) {
  if (c.value_bits != 0) return kHeaderBytes + t * ValueRecordBytes(c, c.value_bits);
  int64_t at = kHeaderBytes + ValueTagBytes(c);
  for (int u = 0; u < t; ++u) at += ValueRecordBytes(c, TagWidth(block + kHeaderBytes, u));
  return at;
}
// Bytes of a value block (its sparse list included).
KVQ_HD int64_t ValueBlockBytes(const BlockCodec& c, const uint8_t* block) {
  return ValueRecordOffset(c, block, c.key_group) +
         static_cast<int64_t>(kSparseEntryBytes) * c.value_sparse;
}
// The largest value block of the codec (per-token widths: every token at 4 bits).
KVQ_HD int64_t MaxValueBlockBytes(const BlockCodec& c) {
  return c.value_bits != 0
             ? UniformValueBlockBytes(c.head_dim, c.key_group, c.value_group, c.value_bits,
                                      c.value_sparse)
             : MaxPerTokenValueBlockBytes(c.head_dim, c.key_group, c.value_group, c.value_sparse);
}

}  // namespace kvq::format
