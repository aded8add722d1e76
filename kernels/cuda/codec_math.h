// The block codec ops' per-thread programs (codec_kernels.cu launches them, kernels/src/
// codec_host.cc runs them on the CPU over the whole grid): each function is one thread's work
// at one grid index, reading what earlier launches wrote and never what another thread of the
// same launch writes, so a host loop over the indices computes exactly what the GPU does.
//
// Bit-exact with core's codec on the scalar reference kernels (kernels/src/ref.cc): the same
// operations in the same order, fp16 rounding to nearest even, IEEE division and square root,
// no contraction (the kernels build with -ffp-contract=off on the host and -fmad=false on the
// device), rint as nearbyint in the default rounding mode.
#pragma once

#include <cstdint>
#include <cstring>
#include <initializer_list>

#include "kvq/format/block_format.h"
#include "kvq/kernels/cuda_codec.h"
#include "xxh3_math.h"

#ifndef __CUDA_ARCH__
#include <cmath>
#endif

namespace kvq::kernels::cuda::codec_math {

using format::FloatBits;
using format::FloatToHalf;
using format::HalfToFloat;
using format::KeyLayout;
using format::kHeaderBytes;
using format::kKindKey;
using format::kKindValue;
using format::LoadU16;
using format::MakeKeyLayout;
using format::RowBytes;
using format::StoreU16;
using format::TokenWidth;
using format::ValueBlockBytes;
using format::ValueGroups;
using format::ValueRecordBytes;
using format::ValueRecordOffset;
using format::ValueTagBytes;
inline constexpr float kMaxStorable = format::kHalfMax;

KVQ_HD bool IsFinite(float f) { return (FloatBits(f) & 0x7f800000u) != 0x7f800000u; }
KVQ_HD float RoundEven(float v) {
#ifdef __CUDA_ARCH__
  return rintf(v);
#else
  return std::nearbyint(v);
#endif
}
KVQ_HD float Sqrt(float v) {
#ifdef __CUDA_ARCH__
  return sqrtf(v);
#else
  return std::sqrt(v);
#endif
}
KVQ_HD float MinF(float a, float b) { return b < a ? b : a; }  // std::min's rule
KVQ_HD float MaxF(float a, float b) { return a < b ? b : a; }  // std::max's rule

// Code i of b bits in an LSB-first row (ref.cc's GetCode / PutCode, any alignment).
KVQ_HD int GetCode(const uint8_t* row, int b, int64_t i) {
  const int64_t bit = i * b;
  const uint8_t* p = row + (bit >> 3);
  const uint32_t w = p[0] | (b + (bit & 7) > 8 ? (static_cast<uint32_t>(p[1]) << 8) : 0u);
  return static_cast<int>((w >> (bit & 7)) & ((1u << b) - 1u));
}
KVQ_HD void PutCode(uint8_t* row, int b, int64_t i, int code) {
  const int64_t bit = i * b;
  uint8_t* p = row + (bit >> 3);
  const uint32_t v = static_cast<uint32_t>(code) << (bit & 7);
  p[0] |= static_cast<uint8_t>(v);
  if (b + (bit & 7) > 8) p[1] |= static_cast<uint8_t>(v >> 8);
}

// Quantization parameters as stored (common.h's MakeParams / QuantizeOne).
struct QParams {
  float scale, zero, inv;
};
KVQ_HD QParams MakeParams(float lo, float hi, int bits, uint16_t* s16, uint16_t* z16) {
  const float levels = static_cast<float>((1 << bits) - 1);
  *z16 = FloatToHalf(lo);
  const float zero = HalfToFloat(*z16);
  const float scale = (hi - zero) / levels;
  *s16 = FloatToHalf(scale);
  float s = HalfToFloat(*s16);
  if (s > 0 && zero + s * levels < hi) {  // fp16 rounding shrank the range below hi
    *s16 = static_cast<uint16_t>(*s16 + 1);
    s = HalfToFloat(*s16);
  }
  if (!(s > 0) || !IsFinite(s)) {
    *s16 = 0;
    s = 0;
  }
  return {s, zero, s > 0 ? 1.0f / s : 0.0f};
}
KVQ_HD int QuantizeOne(float x, const QParams& p, int maxq) {
  const int q = static_cast<int>(RoundEven((x - p.zero) * p.inv));
  return q < 0 ? 0 : (q > maxq ? maxq : q);
}

// x <- H x, H the normalized Walsh-Hadamard matrix (core's Rotate: the same butterflies,
// then one scaling pass).
KVQ_HD void Rotate(float* x, int d) {
  for (int h = 1; h < d; h *= 2)
    for (int i = 0; i < d; i += 2 * h)
      for (int j = i; j < i + h; ++j) {
        const float a = x[j], b = x[j + h];
        x[j] = a + b;
        x[j + h] = a - b;
      }
  const float norm = 1.0f / Sqrt(static_cast<float>(d));
  for (int i = 0; i < d; ++i) x[i] *= norm;
}

// Whether a block's header is what codec `c` writes for `kind` (a readable version, the
// rotation flag and no other). The checksum is not read here (xxh3_math.h's VerifyOne is).
KVQ_HD bool HeaderMatches(const uint8_t* p, const BlockCodec& c, uint8_t kind) {
  const bool key = kind == kKindKey;
  const format::Header h = format::ReadHeader(p);
  return h.magic == format::kMagic && format::VersionReadable(h.version) &&
         format::FlagsValid(h.version, h.flags) && h.kind == kind &&
         h.flags == ((key ? c.rotate_keys : c.rotate_values) ? format::kFlagRotated : 0) &&
         h.bits == (key ? c.key_bits : c.value_bits) &&
         h.side_bits == (key && c.rank > 0 ? c.side_bits : 0) && h.tokens == c.key_group &&
         h.head_dim == c.head_dim && h.extra == (key ? c.rank : c.value_group);
}

// ---- Encode keys: five launches, each a grid over (block, index) ----

// Workspace floats per block: rotated keys [G][d], their base decode [G][d], side
// coefficients [G][r], rotated U^T [r][d].
struct KeyWork {
  float *x, *deq, *coef, *ut;
};
KVQ_HD int64_t KeyWorkFloats(const BlockCodec& c) {
  const int64_t d = c.head_dim, G = c.key_group, r = c.rank;
  return 2 * G * d + G * r + r * d;
}
KVQ_HD KeyWork KeyWorkOf(const EncodeKeyParams& p, int b) {
  const BlockCodec& c = p.codec;
  float* w = static_cast<float*>(p.workspace) + b * KeyWorkFloats(c);
  const int64_t d = c.head_dim, G = c.key_group, r = c.rank;
  return {w, w + G * d, w + 2 * G * d, w + 2 * G * d + G * r};
}
// The keys the base code quantizes and their stride: the caller's, or their rotation.
KVQ_HD const float* EncodedKeys(const EncodeKeyParams& p, int b, int64_t* ld) {
  if (p.codec.rotate_keys) {
    *ld = p.codec.head_dim;
    return KeyWorkOf(p, b).x;
  }
  *ld = p.ld;
  return p.keys[b];
}
KVQ_HD const float* EncodedBasis(const EncodeKeyParams& p, int b) {
  return p.codec.rotate_keys ? KeyWorkOf(p, b).ut : p.basis_t[b];
}

// Launch 1 (only when rotating), index i < G + r: token row i, or basis row i - G, rotated.
KVQ_HD void EncodeKeyRotate(const EncodeKeyParams& p, int b, int i) {
  const BlockCodec& c = p.codec;
  const int d = c.head_dim, G = c.key_group;
  const KeyWork w = KeyWorkOf(p, b);
  const float* src = i < G ? p.keys[b] + i * p.ld : p.basis_t[b] + static_cast<int64_t>(i - G) * d;
  float* dst = i < G ? w.x + static_cast<int64_t>(i) * d : w.ut + static_cast<int64_t>(i - G) * d;
  for (int k = 0; k < d; ++k) dst[k] = src[k];
  Rotate(dst, d);
}

// One channel of `tokens` rows quantized over the tokens (ref.cc's QuantizeChannelRange for one
// channel): fp16 scale and zero, its zeroed-then-filled code row, and (when deq) the decoded
// values at deq[t * deq_ld + ch].
KVQ_HD void QuantizeChannel(const float* x, int64_t ld, int tokens, int ch, int bits,
                            uint8_t* scale, uint8_t* zero, uint8_t* row, float* deq,
                            int64_t deq_ld) {
  const int maxq = (1 << bits) - 1;
  float lo = x[ch], hi = x[ch];
  for (int t = 1; t < tokens; ++t) {
    lo = MinF(lo, x[t * ld + ch]);
    hi = MaxF(hi, x[t * ld + ch]);
  }
  uint16_t s16, z16;
  const QParams q = MakeParams(lo, hi, bits, &s16, &z16);
  StoreU16(scale, s16);
  StoreU16(zero, z16);
  const int64_t bytes = RowBytes(tokens, bits);
  for (int64_t k = 0; k < bytes; ++k) row[k] = 0;
  for (int t = 0; t < tokens; ++t) {
    const int code = QuantizeOne(x[t * ld + ch], q, maxq);
    PutCode(row, bits, t, code);
    if (deq) deq[t * deq_ld + ch] = q.zero + q.scale * static_cast<float>(code);
  }
}

// Launch 2, index ch < d: the base code's channel ch.
KVQ_HD void EncodeKeyChannel(const EncodeKeyParams& p, int b, int ch) {
  const KeyLayout k = MakeKeyLayout(p.codec);
  int64_t ld = 0;
  const float* x = EncodedKeys(p, b, &ld);
  uint8_t* out = p.out[b];
  QuantizeChannel(x, ld, k.G, ch, k.bits, out + k.scale + 2 * ch, out + k.zero + 2 * ch,
                  out + k.codes + ch * k.row, k.r > 0 ? KeyWorkOf(p, b).deq : nullptr, k.d);
}

// Launch 3 (rank > 0), index t < G: token t's coefficients j < r, each the sum over c in
// order of (k_c - k_base_c) u_jc (ref.cc's project_residual), clamped to fp16's range as core's
// encoder does. A thread per token reads the token's keys and dequantized base once for 8
// coefficients at a time.
KVQ_HD void EncodeKeyProject(const EncodeKeyParams& p, int b, int t) {
  constexpr int kAtOnce = 8;
  const int d = p.codec.head_dim, r = p.codec.rank;
  int64_t ld = 0;
  const float* x = EncodedKeys(p, b, &ld) + t * ld;
  const KeyWork w = KeyWorkOf(p, b);
  const float* deq = w.deq + static_cast<int64_t>(t) * d;
  const float* basis = EncodedBasis(p, b);
  for (int j0 = 0; j0 < r; j0 += kAtOnce) {
    const int n = r - j0 < kAtOnce ? r - j0 : kAtOnce;
    float acc[kAtOnce] = {};
    for (int c = 0; c < d; ++c) {
      const float e = x[c] - deq[c];
      KVQ_UNROLL
      for (int j = 0; j < kAtOnce; ++j)
        if (j < n) acc[j] += e * basis[static_cast<int64_t>(j0 + j) * d + c];
    }
    KVQ_UNROLL
    for (int j = 0; j < kAtOnce; ++j)
      if (j < n) w.coef[t * r + j0 + j] = MinF(MaxF(acc[j], -kMaxStorable), kMaxStorable);
  }
}

// Launch 4 (rank > 0), index j < r: the side code's coefficient j over the G tokens.
KVQ_HD void EncodeKeySide(const EncodeKeyParams& p, int b, int j) {
  const KeyLayout k = MakeKeyLayout(p.codec);
  uint8_t* out = p.out[b];
  QuantizeChannel(KeyWorkOf(p, b).coef, k.r, k.G, j, k.side_bits, out + k.side_scale + 2 * j,
                  out + k.side_zero + 2 * j, out + k.side_codes + j * k.side_row, nullptr, 0);
}

// Launch 5, one index per block: the header and its checksum over the finished payload.
KVQ_HD void EncodeKeyHeader(const EncodeKeyParams& p, int b, int /*one index*/) {
  const KeyLayout k = MakeKeyLayout(p.codec);
  const uint8_t kind = format::KindByte(kKindKey, p.codec.rotate_keys, false);
  format::WriteHeaderFields(p.out[b], kind, k.bits, k.side_bits, k.G, k.d, k.r);
  xxh3_math::WriteBlockChecksum(p.out[b], static_cast<uint64_t>(k.bytes));
}

// ---- Encode values: two launches ----

KVQ_HD int64_t ValueWorkFloats(const BlockCodec& c) {
  return c.rotate_values ? static_cast<int64_t>(c.key_group) * c.head_dim : 0;
}

// Launch 1, index t < G: token t's record (ref.cc's QuantizeRowScalar: groups of value_group
// channels, fp16 scale and zero per group, then the codes), rotated first when the codec
// rotates values; the thread of every fourth token also writes its byte of width tags.
KVQ_HD void EncodeValueToken(const EncodeValueParams& p, int b, int t) {
  const BlockCodec& c = p.codec;
  const int d = c.head_dim, group = c.value_group, ng = ValueGroups(c);
  const float* x = p.values[b] + t * p.ld;
  if (c.rotate_values) {
    float* row =
        static_cast<float*>(p.workspace) + b * ValueWorkFloats(c) + static_cast<int64_t>(t) * d;
    for (int k = 0; k < d; ++k) row[k] = x[k];
    Rotate(row, d);
    x = row;
  }
  uint8_t* out = p.out[b];
  if (c.value_bits == 0 && t % 4 == 0) {
    uint8_t tag = 0;
    for (int u = t; u < t + 4 && u < c.key_group; ++u)
      tag |= static_cast<uint8_t>((p.widths[b][u] - 1) << (2 * (u % 4)));
    out[kHeaderBytes + t / 4] = tag;
  }
  const int bits = c.value_bits != 0 ? c.value_bits : p.widths[b][t];
  // The record's offset: fixed records, or from the widths (the tags may not be written yet).
  int64_t at = kHeaderBytes + ValueTagBytes(c);
  if (c.value_bits != 0) {
    at += t * ValueRecordBytes(c, c.value_bits);
  } else {
    for (int u = 0; u < t; ++u) at += ValueRecordBytes(c, p.widths[b][u]);
  }
  uint8_t* rec = out + at;
  uint8_t* codes = rec + 4 * ng;
  const int maxq = (1 << bits) - 1;
  const int64_t bytes = RowBytes(d, bits);
  for (int64_t k = 0; k < bytes; ++k) codes[k] = 0;
  for (int g = 0, c0 = 0; c0 < d; ++g, c0 += group) {
    const int c1 = c0 + group < d ? c0 + group : d;
    float lo = x[c0], hi = x[c0];
    for (int ch = c0 + 1; ch < c1; ++ch) {
      lo = MinF(lo, x[ch]);
      hi = MaxF(hi, x[ch]);
    }
    uint16_t s16, z16;
    const QParams q = MakeParams(lo, hi, bits, &s16, &z16);
    StoreU16(rec + 2 * g, s16);
    StoreU16(rec + 2 * (ng + g), z16);
    for (int ch = c0; ch < c1; ++ch) PutCode(codes, bits, ch, QuantizeOne(x[ch], q, maxq));
  }
}

// Launch 2, one index per block: header and checksum.
KVQ_HD void EncodeValueHeader(const EncodeValueParams& p, int b, int /*one index*/) {
  const BlockCodec& c = p.codec;
  const uint8_t kind = format::KindByte(kKindValue, c.rotate_values, false);
  format::WriteHeaderFields(p.out[b], kind, c.value_bits, 0, c.key_group, c.head_dim,
                            c.value_group);
  xxh3_math::WriteBlockChecksum(p.out[b], static_cast<uint64_t>(ValueBlockBytes(c, p.out[b])));
}

// ---- Reads: one launch each, a thread per (block, token), (block, channel) or output element ----

KVQ_HD void RaiseFlag(int* flags, int bit) {
  if (flags == nullptr) return;
#ifdef __CUDA_ARCH__
  atomicOr(flags, bit);
#else
  *flags |= bit;
#endif
}
// Whether block b may be read as `kind`; the first token's thread of a block that may not
// raises kBlockHeaderMismatch.
KVQ_HD bool Readable(const uint8_t* block, const BlockCodec& c, uint8_t kind, int t, int* flags) {
  if (HeaderMatches(block, c, kind)) return true;
  if (t == 0) RaiseFlag(flags, kBlockHeaderMismatch);
  return false;
}

// Channel ch's side-code term of token t: sum over j in order of u_cj z_hat_j(t)
// (ref.cc's add_low_rank), shared by both key decodes so they stay bit for bit the same.
KVQ_HD float SideTerm(const DecodeKeyParams& p, const KeyLayout& k, const uint8_t* in,
                      const float* basis, int ch, int t) {
  float acc = 0;
  for (int j = 0; j < k.r; ++j) {
    const float z =
        (HalfToFloat(static_cast<uint16_t>(LoadU16(in + k.side_zero + 2 * j))) +
         HalfToFloat(static_cast<uint16_t>(LoadU16(in + k.side_scale + 2 * j))) *
             static_cast<float>(GetCode(in + k.side_codes + j * k.side_row, k.side_bits, t)));
    acc += basis[static_cast<int64_t>(ch) * k.r + j] * z;
  }
  return acc;
}

// Decode key block b's token t into its row (core's DecodeKeyBlock: dequantize, rotate back,
// then add U z_hat with the sum over j in order, ref.cc's add_low_rank).
KVQ_HD void DecodeKeyToken(const DecodeKeyParams& p, int b, int t) {
  const KeyLayout k = MakeKeyLayout(p.codec);
  const uint8_t* in = p.in[b];
  if (!Readable(in, p.codec, kKindKey, t, p.error_flags)) return;
  float* out = p.out[b] + t * p.ld;
  for (int ch = 0; ch < k.d; ++ch)
    out[ch] = HalfToFloat(static_cast<uint16_t>(LoadU16(in + k.zero + 2 * ch))) +
              HalfToFloat(static_cast<uint16_t>(LoadU16(in + k.scale + 2 * ch))) *
                  static_cast<float>(GetCode(in + k.codes + ch * k.row, k.bits, t));
  if (p.codec.rotate_keys) Rotate(out, k.d);
  const float* basis = p.basis ? p.basis[b] : nullptr;
  if (k.r == 0 || basis == nullptr) return;
  for (int ch = 0; ch < k.d; ++ch) out[ch] += SideTerm(p, k, in, basis, ch, t);
}

// Decode key block b's channel ch for every token: DecodeKeyToken's arithmetic element for
// element (the same operations in the same order), a thread per channel so that a warp's
// stores of a token's row are contiguous. Unrotated keys only (a rotation mixes a row's
// channels); the thread of channel 0 raises the header flag.
KVQ_HD void DecodeKeyChannel(const DecodeKeyParams& p, int b, int ch) {
  const KeyLayout k = MakeKeyLayout(p.codec);
  const uint8_t* in = p.in[b];
  if (!Readable(in, p.codec, kKindKey, ch, p.error_flags)) return;
  const float zero = HalfToFloat(static_cast<uint16_t>(LoadU16(in + k.zero + 2 * ch)));
  const float scale = HalfToFloat(static_cast<uint16_t>(LoadU16(in + k.scale + 2 * ch)));
  const float* basis = p.basis ? p.basis[b] : nullptr;
  const bool side = k.r > 0 && basis != nullptr;
  float* out = p.out[b] + ch;
  for (int t = 0; t < k.G; ++t) {
    float v = zero + scale * static_cast<float>(GetCode(in + k.codes + ch * k.row, k.bits, t));
    if (side) v += SideTerm(p, k, in, basis, ch, t);
    out[t * p.ld] = v;
  }
}

// Decode value block b's channel ch for every token: DecodeValueToken's arithmetic element for
// element, a thread per channel (contiguous stores); unrotated values only.
KVQ_HD void DecodeValueChannel(const DecodeValueParams& p, int b, int ch) {
  const BlockCodec& c = p.codec;
  const uint8_t* in = p.in[b];
  if (!Readable(in, c, kKindValue, ch, p.error_flags)) return;
  const int ng = ValueGroups(c), g = ch / c.value_group;
  float* out = p.out[b] + ch;
  int64_t at = ValueRecordOffset(c, in, 0);
  for (int t = 0; t < c.key_group; ++t) {
    const int bits = TokenWidth(c, in, t);
    const uint8_t* rec = in + at;
    out[t * p.ld] = HalfToFloat(static_cast<uint16_t>(LoadU16(rec + 2 * (ng + g)))) +
                    HalfToFloat(static_cast<uint16_t>(LoadU16(rec + 2 * g))) *
                        static_cast<float>(GetCode(rec + 4 * ng, bits, ch));
    at += ValueRecordBytes(c, bits);
  }
}

// Decode value block b's token t (core's DecodeValueBlock: dequantize, rotate back).
KVQ_HD void DecodeValueToken(const DecodeValueParams& p, int b, int t) {
  const BlockCodec& c = p.codec;
  const uint8_t* in = p.in[b];
  if (!Readable(in, c, kKindValue, t, p.error_flags)) return;
  const int ng = ValueGroups(c), bits = TokenWidth(c, in, t);
  const uint8_t* rec = in + ValueRecordOffset(c, in, t);
  float* out = p.out[b] + t * p.ld;
  for (int ch = 0; ch < c.head_dim; ++ch) {
    const int g = ch / c.value_group;
    out[ch] = HalfToFloat(static_cast<uint16_t>(LoadU16(rec + 2 * (ng + g)))) +
              HalfToFloat(static_cast<uint16_t>(LoadU16(rec + 2 * g))) *
                  static_cast<float>(GetCode(rec + 4 * ng, bits, ch));
  }
  if (c.rotate_values) Rotate(out, c.head_dim);
}

// Score of query i against token t of key block b, written to out (core's ScoreKeyBlock on
// ref.cc's score_codes: the base sum over channels, then the side sum over coefficients added
// with multiplier scale).
KVQ_HD void ScoreToken(const ScoreBlocksParams& p, int b, int i, int t) {
  const KeyLayout k = MakeKeyLayout(p.codec);
  const uint8_t* in = p.key_blocks[b];
  if (!Readable(in, p.codec, kKindKey, i == 0 ? t : 1, p.error_flags)) return;
  float* dst = p.out + i * p.out_stride + static_cast<int64_t>(b) * k.G + t;
  const float* q = p.q + static_cast<int64_t>(i) * k.d;
  float acc = 0;
  for (int ch = 0; ch < k.d; ++ch)
    acc += q[ch] * (HalfToFloat(static_cast<uint16_t>(LoadU16(in + k.scale + 2 * ch))) *
                        static_cast<float>(GetCode(in + k.codes + ch * k.row, k.bits, t)) +
                    HalfToFloat(static_cast<uint16_t>(LoadU16(in + k.zero + 2 * ch))));
  const float base = 0.0f + p.scale * acc;
  if (k.r == 0 || p.uq == nullptr) {
    *dst = base;
    return;
  }
  const float* uq = p.uq + static_cast<int64_t>(i) * k.r;
  float side = 0;
  for (int j = 0; j < k.r; ++j)
    side += uq[j] *
            (HalfToFloat(static_cast<uint16_t>(LoadU16(in + k.side_scale + 2 * j))) *
                 static_cast<float>(GetCode(in + k.side_codes + j * k.side_row, k.side_bits, t)) +
             HalfToFloat(static_cast<uint16_t>(LoadU16(in + k.side_zero + 2 * j))));
  *dst = base + p.scale * side;
}

// Output element (i, ch) of a readout: the weights of every token of every block in order
// (ref.cc's readout_rows block after block), added to out. Blocks whose header does not match
// are skipped (the caller sees the flag).
KVQ_HD void ReadoutChannel(const ReadoutBlocksParams& p, int i, int ch) {
  const BlockCodec& c = p.codec;
  const int G = c.key_group, ng = ValueGroups(c), g = ch / c.value_group;
  float acc = p.out[i * p.out_stride + ch];
  for (int b = 0; b < p.blocks; ++b) {
    const uint8_t* in = p.value_blocks[b];
    if (!Readable(in, c, kKindValue, i == 0 && ch == 0 ? 0 : 1, p.error_flags)) continue;
    int64_t at = kHeaderBytes + ValueTagBytes(c);
    for (int t = 0; t < G; ++t) {
      const int bits = TokenWidth(c, in, t);
      const uint8_t* rec = in + at;
      const float v = HalfToFloat(static_cast<uint16_t>(LoadU16(rec + 2 * g))) *
                          static_cast<float>(GetCode(rec + 4 * ng, bits, ch)) +
                      HalfToFloat(static_cast<uint16_t>(LoadU16(rec + 2 * (ng + g))));
      acc += p.p[i * p.p_stride + static_cast<int64_t>(b) * G + t] * v;
      at += ValueRecordBytes(c, bits);
    }
  }
  p.out[i * p.out_stride + ch] = acc;
}

// Grid index (block b, index w < n_q G) of a score launch.
KVQ_HD void ScoreAt(const ScoreBlocksParams& p, int b, int w) {
  ScoreToken(p, b, w / p.codec.key_group, w % p.codec.key_group);
}

// ---- The launches of each op, in order: run.Step<F>(outer, inner) runs F(p, o, i) for every
// o < outer, i < inner (a kernel launch on the GPU, two loops on the CPU) ----

template <class Run>
void EncodeKeySteps(const EncodeKeyParams& p, Run& run) {
  const BlockCodec& c = p.codec;
  if (c.rotate_keys) run.template Step<EncodeKeyRotate>(p, p.blocks, c.key_group + c.rank);
  run.template Step<EncodeKeyChannel>(p, p.blocks, c.head_dim);
  if (c.rank > 0) {
    run.template Step<EncodeKeyProject>(p, p.blocks, c.key_group);
    run.template Step<EncodeKeySide>(p, p.blocks, c.rank);
  }
  run.template Step<EncodeKeyHeader>(p, p.blocks, 1);
}
template <class Run>
void EncodeValueSteps(const EncodeValueParams& p, Run& run) {
  run.template Step<EncodeValueToken>(p, p.blocks, p.codec.key_group);
  run.template Step<EncodeValueHeader>(p, p.blocks, 1);
}
template <class Run>
void DecodeKeySteps(const DecodeKeyParams& p, Run& run) {
  if (p.codec.rotate_keys)
    run.template Step<DecodeKeyToken>(p, p.blocks, p.codec.key_group);
  else
    run.template Step<DecodeKeyChannel>(p, p.blocks, p.codec.head_dim);
}
template <class Run>
void DecodeValueSteps(const DecodeValueParams& p, Run& run) {
  if (p.codec.rotate_values)
    run.template Step<DecodeValueToken>(p, p.blocks, p.codec.key_group);
  else
    run.template Step<DecodeValueChannel>(p, p.blocks, p.codec.head_dim);
}
template <class Run>
void ScoreSteps(const ScoreBlocksParams& p, Run& run) {
  run.template Step<ScoreAt>(p, p.blocks, p.n_q * p.codec.key_group);
}
template <class Run>
void ReadoutSteps(const ReadoutBlocksParams& p, Run& run) {
  run.template Step<ReadoutChannel>(p, p.n_q, p.codec.head_dim);
}

// ---- Parameter checks (host), shared by the launchers and the stand-ins: the reason, naming
// the field and its limit, or null ----

inline const char* CodecReason(const BlockCodec& c) {
  auto one_of = [](int v, std::initializer_list<int> allowed) {
    for (int a : allowed)
      if (v == a) return true;
    return false;
  };
  if (c.head_dim < 1 || c.head_dim > 512) return "head_dim: must be in [1, 512]";
  if (!one_of(c.key_group, {32, 64, 128})) return "key_group: must be 32, 64 or 128";
  if (!one_of(c.key_bits, {2, 3, 4, 8})) return "key_bits: must be 2, 3, 4 or 8";
  if (c.rank < 0 || c.rank > c.head_dim) return "rank: must be in [0, head_dim]";
  if (c.rank > 0 && !one_of(c.side_bits, {4, 8})) return "side_bits: must be 4 or 8";
  if (!one_of(c.value_bits, {0, 1, 2, 3, 4, 8}))
    return "value_bits: must be 1, 2, 3, 4 or 8 (0: per-token widths)";
  if (c.value_group < 1 || c.value_group > c.head_dim || ValueGroups(c) > 64)
    return "value_group: must be in [1, head_dim], at most 64 groups";
  if (c.key_sparse != 0 || c.value_sparse != 0)
    return "key_sparse, value_sparse: dense-and-sparse blocks are read on the CPU";
  if ((c.rotate_keys || c.rotate_values) && (c.head_dim & (c.head_dim - 1)) != 0)
    return "head_dim: must be a power of two to rotate keys or values";
  return nullptr;
}
inline const char* Reason(const EncodeKeyParams& p) {
  if (const char* why = CodecReason(p.codec)) return why;
  if (p.blocks < 0) return "blocks: must be >= 0";
  if (p.blocks > 0 && (!p.keys || !p.out || (p.codec.rank > 0 && !p.basis_t)))
    return "keys, out (and basis_t when rank > 0): null";
  if (p.ld < p.codec.head_dim) return "ld: must be >= head_dim";
  if (p.workspace_bytes < 4 * static_cast<size_t>(p.blocks) * KeyWorkFloats(p.codec) ||
      (p.blocks > 0 && !p.workspace))
    return "workspace: smaller than EncodeKeyWorkspaceBytes";
  return nullptr;
}
inline const char* Reason(const EncodeValueParams& p) {
  if (const char* why = CodecReason(p.codec)) return why;
  if (p.blocks < 0) return "blocks: must be >= 0";
  if (p.blocks > 0 && (!p.values || !p.out || (p.codec.value_bits == 0 && !p.widths)))
    return "values, out (and widths when value_bits is 0): null";
  if (p.ld < p.codec.head_dim) return "ld: must be >= head_dim";
  if (p.workspace_bytes < 4 * static_cast<size_t>(p.blocks) * ValueWorkFloats(p.codec) ||
      (p.blocks > 0 && ValueWorkFloats(p.codec) > 0 && !p.workspace))
    return "workspace: smaller than EncodeValueWorkspaceBytes";
  return nullptr;
}
inline const char* Reason(const DecodeKeyParams& p) {
  if (const char* why = CodecReason(p.codec)) return why;
  if (p.blocks < 0) return "blocks: must be >= 0";
  if (p.blocks > 0 && (!p.in || !p.out)) return "in, out: null";
  if (p.ld < p.codec.head_dim) return "ld: must be >= head_dim";
  return nullptr;
}
inline const char* Reason(const DecodeValueParams& p) {
  if (const char* why = CodecReason(p.codec)) return why;
  if (p.blocks < 0) return "blocks: must be >= 0";
  if (p.blocks > 0 && (!p.in || !p.out)) return "in, out: null";
  if (p.ld < p.codec.head_dim) return "ld: must be >= head_dim";
  return nullptr;
}
inline const char* Reason(const ScoreBlocksParams& p) {
  if (const char* why = CodecReason(p.codec)) return why;
  if (p.blocks < 0 || p.n_q < 0) return "blocks, n_q: must be >= 0";
  if (p.blocks > 0 && p.n_q > 0 && (!p.key_blocks || !p.q || !p.out))
    return "key_blocks, q, out: null";
  if (p.out_stride < static_cast<int64_t>(p.blocks) * p.codec.key_group)
    return "out_stride: must be >= blocks * key_group";
  return nullptr;
}
inline const char* Reason(const ReadoutBlocksParams& p) {
  if (const char* why = CodecReason(p.codec)) return why;
  if (p.blocks < 0 || p.n_q < 0) return "blocks, n_q: must be >= 0";
  if (p.blocks > 0 && p.n_q > 0 && (!p.value_blocks || !p.p || !p.out))
    return "value_blocks, p, out: null";
  if (p.p_stride < static_cast<int64_t>(p.blocks) * p.codec.key_group)
    return "p_stride: must be >= blocks * key_group";
  if (p.out_stride < p.codec.head_dim) return "out_stride: must be >= head_dim";
  return nullptr;
}

}  // namespace kvq::kernels::cuda::codec_math
