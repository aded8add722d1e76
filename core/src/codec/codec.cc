// Block encode, parse/verify, score, readout and decode.
#include "kvq/core/codec.h"

#include <xxhash.h>

#include <Eigen/Dense>
#include <algorithm>
#include <cmath>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/src/codec/hadamard.h"
#include "core/src/codec/sparse_list.h"
#include "kvq/core/codec_schema.h"
#include "kvq/core/half.h"
#include "kvq/core/status.h"
#include "kvq/kernels/kernels.h"

namespace kvq::core {
namespace {

using format::RowBytes;

// The block checksum (kvq/format/block_format.h), the header's hash given: the payload is
// hashed unseeded (libxxhash then skips deriving a secret per call, ~2.5x faster on blocks of
// about 1 KiB).
uint32_t Checksum(const uint8_t* block, size_t size, uint64_t header_hash) {
  return format::MixChecksum(
      kernels::Active().xxh3(block + format::kHeaderBytes, size - format::kHeaderBytes, 0),
      header_hash);
}
uint32_t BlockChecksum(const uint8_t* block, size_t size) {
  return Checksum(block, size, XXH3_64bits(block, format::kHashedHeaderBytes));
}

void WriteHeader(uint8_t* p, uint8_t kind_byte, int bits, int side_bits, int tokens, int head_dim,
                 int extra, size_t size) {
  format::WriteHeaderFields(p, kind_byte, bits, side_bits, tokens, head_dim, extra);
  format::StoreU32(p + format::kChecksumAt, BlockChecksum(p, size));
}

// The header of a block of `kind`: magic, a readable version, kind, known flags and (when
// verify) the checksum. A block that fails is DATA_LOSS, never guessed at.
absl::StatusOr<format::Header> ReadHeader(std::span<const uint8_t> b, uint8_t kind, bool verify) {
  if (b.size() < format::kHeaderBytes)
    return absl::DataLossError(
        absl::StrCat("block truncated: ", b.size(), " bytes, shorter than the 16-byte header"));
  const format::Header h = format::ReadHeader(b.data());
  if (h.magic != format::kMagic)
    return absl::DataLossError(
        absl::StrFormat("block magic 0x%04x, expected 0x%04x", h.magic, format::kMagic));
  if (!format::VersionReadable(h.version))
    return absl::DataLossError(absl::StrCat("block version ", h.version,
                                            " unsupported (this build reads versions ",
                                            format::kMinVersion, " to ", format::kMaxVersion, ")"));
  if (h.kind != kind)
    return absl::DataLossError(absl::StrCat("block kind ", h.kind, ", expected ", kind));
  if (!format::FlagsValid(h.version, h.flags))
    return absl::DataLossError(
        absl::StrFormat("block flags 0x%02x invalid for version %d", h.flags, h.version));
  if (verify && h.checksum != BlockChecksum(b.data(), b.size()))
    return absl::DataLossError("block checksum mismatch: the stored block is corrupted");
  return h;
}

const kernels::KernelTable& K() { return kernels::Active(); }

using hadamard::Rotate;

// Rows [n][d] of x (row stride ld) rotated into out [n][d].
void RotateRows(const float* x, int64_t ld, int n, int d, std::vector<float>* out) {
  out->resize(static_cast<size_t>(n) * d);
  for (int t = 0; t < n; ++t) {
    float* row = out->data() + static_cast<size_t>(t) * d;
    std::copy_n(x + t * ld, d, row);
    Rotate(row, d);
  }
}

void SetCode(uint8_t* row, int bits, int64_t i, int code) {
  const int64_t bit = i * bits;
  const uint32_t mask = ((1u << bits) - 1) << (bit & 7), v = static_cast<uint32_t>(code)
                                                             << (bit & 7);
  row[bit >> 3] = static_cast<uint8_t>((row[bit >> 3] & ~mask) | v);
  if (bits + (bit & 7) > 8)
    row[(bit >> 3) + 1] = static_cast<uint8_t>((row[(bit >> 3) + 1] & ~(mask >> 8)) | (v >> 8));
}

// Re-chooses the base codes of a key block token by token (the per-channel scales and zero
// points stay): channel c is rounded to its grid, and its error, scaled by the metric factor
// U (upper Cholesky factor of H^-1), is fed into the channels after it. This is GPTQ's
// sequential rule with the keys as weights and the queries as inputs: it minimizes the
// error e^T H e greedily, i.e. the mean squared score error for queries with E[q q^T] = H.
// deq receives the dequantized keys the decoder will see.
void MetricRound(const float* keys, int64_t ld, int G, int d, int bits, const uint16_t* scale,
                 const uint16_t* zero, const float* U, uint8_t* codes, float* deq) {
  const int maxq = (1 << bits) - 1;
  const int64_t rb = RowBytes(G, bits);
  thread_local std::vector<float> w, s, z;
  w.resize(d);
  s.resize(d);
  z.resize(d);
  for (int c = 0; c < d; ++c) {
    s[c] = HalfToFloat(scale[c]);
    z[c] = HalfToFloat(zero[c]);
  }
  for (int t = 0; t < G; ++t) {
    std::copy_n(keys + t * ld, d, w.data());
    float* out = deq + static_cast<size_t>(t) * d;
    for (int c = 0; c < d; ++c) {
      int q = 0;
      if (s[c] > 0) q = std::clamp(static_cast<int>(std::nearbyint((w[c] - z[c]) / s[c])), 0, maxq);
      SetCode(codes + c * rb, bits, t, q);
      out[c] = z[c] + s[c] * static_cast<float>(q);
      const float err = (w[c] - out[c]) / U[static_cast<size_t>(c) * d + c];
      const float* row = U + static_cast<size_t>(c) * d;
      for (int j = c + 1; j < d; ++j) w[j] -= err * row[j];
    }
  }
}

// Re-chooses the codes of one value token record (fp16 scale[ng] | zero[ng] | codes, as the
// kernels wrote it) by the same rule as MetricRound, along the token's channels: channel c is
// rounded to its group's grid and its error, scaled by the factor U (upper Cholesky factor of
// M^-1), is fed into the channels after it, so that the token's error is small in the metric
// M rather than per channel. The level is computed as QuantizeOne does ((x - zero) * (1 /
// scale)), so with a diagonal M (no feedback) the codes are exactly nearest rounding's.
// rec: the record's first byte (fp16 scale[ng], fp16 zero[ng], codes), possibly unaligned.
void ValueMetricRound(const float* x, int d, int group, int bits, const float* U, uint8_t* rec) {
  const int maxq = (1 << bits) - 1, ng = (d + group - 1) / group;
  uint8_t* codes = rec + 4 * ng;
  thread_local std::vector<float> w;
  w.assign(x, x + d);
  for (int c = 0; c < d; ++c) {
    const int g = c / group;
    uint16_t s16, z16;
    std::memcpy(&s16, rec + 2 * g, 2);  // records of odd sizes: unaligned
    std::memcpy(&z16, rec + 2 * (ng + g), 2);
    const float s = HalfToFloat(s16), z = HalfToFloat(z16), inv = s > 0 ? 1.0f / s : 0.0f;
    const int q = std::clamp(static_cast<int>(std::nearbyint((w[c] - z) * inv)), 0, maxq);
    SetCode(codes, bits, c, q);
    const float err = (w[c] - (z + s * static_cast<float>(q))) / U[static_cast<size_t>(c) * d + c];
    const float* row = U + static_cast<size_t>(c) * d;
    for (int j = c + 1; j < d; ++j) w[j] -= err * row[j];
  }
}

}  // namespace

absl::Status CodecOptions::Validate() const {
  auto bad = [](absl::string_view field, double v, absl::string_view limit) {
    return absl::InvalidArgumentError(absl::StrCat("codec.", field, " = ", v, ": ", limit));
  };
  if (head_dim < 1 || head_dim > 512) return bad("head_dim", head_dim, "must be in [1, 512]");
  for (const CodecField& f : CodecFields()) {
    if (f.applies && !f.applies(*this)) continue;
    RETURN_IF_ERROR(CheckCodecField(f, GetCodecField(f, *this), head_dim, "codec."));
  }
  // What one field's range cannot say.
  if (value_groups() > kMaxValueGroups)
    return bad("value_group", value_group,
               absl::StrCat("at most ", kMaxValueGroups, " groups per head, so value_group >= ",
                            (head_dim + kMaxValueGroups - 1) / kMaxValueGroups, " at head_dim ",
                            head_dim));
  if (sparse_keys > 0 && rotate_keys)
    return bad("sparse_keys", sparse_keys,
               "must be 0 with rotate_keys (a rotation spreads outliers)");
  if (sparse_values > 0 && rotate_values)
    return bad("sparse_values", sparse_values,
               "must be 0 with rotate_values (a rotation spreads outliers)");
  if ((rotate_keys || rotate_values) && (head_dim & (head_dim - 1)) != 0)
    return bad("head_dim", head_dim, "must be a power of two to rotate keys or values");
  return absl::OkStatus();
}

std::string CodecOptions::ToString() const {
  std::string s = absl::StrFormat("k%dg%d", key_bits, key_group);
  if (rank > 0) absl::StrAppendFormat(&s, " r%ds%d", rank, side_bits);
  if (value_policy == ValuePolicy::kA2)
    absl::StrAppendFormat(&s, " v-a2(%.2f)g%d", value_budget, value_group);
  else
    absl::StrAppendFormat(&s, " v%dg%d", value_bits, value_group);
  absl::StrAppendFormat(&s, " R%d", window);
  if (fp16_sinks > 0) absl::StrAppendFormat(&s, " sink%d", fp16_sinks);
  if (sparse_keys > 0) absl::StrAppendFormat(&s, " spk%d", sparse_keys);
  if (sparse_values > 0) absl::StrAppendFormat(&s, " spv%d", sparse_values);
  if (rotate_keys) s += " rotk";
  if (rotate_values) s += " rotv";
  if (metric_rounding) s += " mr";  // encoder only, but a different codec's blocks
  return s;
}

int SparseCount(const CodecOptions& o, bool keys) {
  const int permille = keys ? o.sparse_keys : o.sparse_values;
  return static_cast<int>(
      std::llround(static_cast<double>(permille) / 1000.0 * o.key_group * o.head_dim));
}

format::BlockCodec BlockCodecOf(const CodecOptions& o) {
  format::BlockCodec c;
  c.head_dim = o.head_dim;
  c.key_group = o.key_group;
  c.key_bits = o.key_bits;
  c.rank = o.rank;
  c.side_bits = o.side_bits;
  c.value_bits = o.per_token_value_bits() ? 0 : o.value_bits;
  c.value_group = o.value_group;
  c.rotate_keys = o.rotate_keys;
  c.rotate_values = o.rotate_values;
  c.key_sparse = SparseCount(o, true);
  c.value_sparse = SparseCount(o, false);
  return c;
}

size_t KeyBlockBytes(const CodecOptions& o) {
  return static_cast<size_t>(format::MakeKeyLayout(BlockCodecOf(o)).bytes);
}

size_t ValueBlockBytes(const CodecOptions& o) {
  return static_cast<size_t>(format::UniformValueBlockBytes(o.head_dim, o.key_group, o.value_group,
                                                            o.value_bits, SparseCount(o, false)));
}

size_t MaxValueBlockBytes(const CodecOptions& o) {
  return static_cast<size_t>(format::MaxValueBlockBytes(BlockCodecOf(o)));
}

namespace {

// The fields of a key block of codec o at `block` (unchecked): Parse, the reader's fast path
// and the encoder's own decode read through it.
// The fields of a key block of codec o, without its pointers (SetKeyPointers adds them).
KeyBlockView KeyFields(const CodecOptions& o) {
  KeyBlockView v;
  v.rotated = o.rotate_keys;
  v.bits = o.key_bits;
  v.side_bits = o.rank > 0 ? o.side_bits : 0;
  v.tokens = o.key_group;
  v.head_dim = o.head_dim;
  v.rank = o.rank;
  v.sparse_count = SparseCount(o, true);
  return v;
}

// The pointers of v (KeyFields of the codec) into the `size`-byte key block at `block`
// (unchecked): integer offsets only, so the reader's fast path takes it per block.
void SetKeyPointers(const uint8_t* block, size_t size, KeyBlockView* v) {
  const format::KeyLayout k =
      format::MakeKeyLayout(v->head_dim, v->tokens, v->bits, v->rank, v->side_bits, 0);
  v->scale = reinterpret_cast<const uint16_t*>(block + k.scale);
  v->zero = reinterpret_cast<const uint16_t*>(block + k.zero);
  v->codes = block + k.codes;
  if (k.r > 0) {
    v->side_scale = reinterpret_cast<const uint16_t*>(block + k.side_scale);
    v->side_zero = reinterpret_cast<const uint16_t*>(block + k.side_zero);
    v->side_codes = block + k.side_codes;
  }
  if (v->sparse_count > 0) v->sparse = block + size - format::kSparseEntryBytes * v->sparse_count;
}

// Both: the view Parse and the encoder's own decode read through.
KeyBlockView KeyViewAt(const CodecOptions& o, const uint8_t* block) {
  KeyBlockView v = KeyFields(o);
  SetKeyPointers(block, KeyBlockBytes(o), &v);
  return v;
}

// U [d][r] from U^T [r][d].
void Transpose(const float* ut, int r, int d, std::vector<float>* u) {
  u->resize(static_cast<size_t>(d) * r);
  for (int j = 0; j < r; ++j)
    for (int c = 0; c < d; ++c) (*u)[static_cast<size_t>(c) * r + j] = ut[j * d + c];
}

// Rows [G][d] (stride ld) copied contiguous.
void CopyRows(const float* x, int64_t ld, int G, int d, std::vector<float>* out) {
  out->resize(static_cast<size_t>(G) * d);
  for (int t = 0; t < G; ++t) std::copy_n(x + t * ld, d, out->data() + static_cast<size_t>(t) * d);
}

}  // namespace

template <class ByteVec>
absl::Status EncodeKeyBlock(const CodecOptions& o, const float* keys, int64_t ld,
                            const float* basis, ByteVec* out) {
  const int d = o.head_dim, r = o.rank;
  if (r > 0 && basis == nullptr) return absl::InvalidArgumentError("rank > 0 needs a basis");
  thread_local std::vector<float> ut;
  if (r > 0) {
    ut.resize(static_cast<size_t>(r) * d);
    for (int c = 0; c < d; ++c)
      for (int j = 0; j < r; ++j) ut[static_cast<size_t>(j) * d + c] = basis[c * r + j];
  }
  return EncodeKeyBlockT(o, keys, ld, r > 0 ? ut.data() : nullptr, out);
}

template <class ByteVec>
absl::Status EncodeKeyBlockT(const CodecOptions& o, const float* keys, int64_t ld,
                             const float* basis_t, ByteVec* out, const float* rounding,
                             const SparseEncode* sparse) {
  const int d = o.head_dim, G = o.key_group, r = o.rank;
  if (r > 0 && basis_t == nullptr) return absl::InvalidArgumentError("rank > 0 needs a basis");
  // Dense-and-sparse: the codes are of the rows with the chosen outliers clamped.
  const int n_sparse = SparseCount(o, true);
  thread_local std::vector<float> trimmed;
  sparse::Chosen chosen;
  if (n_sparse > 0) {
    CopyRows(keys, ld, G, d, &trimmed);
    chosen = sparse::Choose(o, true, n_sparse, sparse ? sparse->skip_rows : 0, trimmed.data());
    keys = trimmed.data();
    ld = d;
  }
  thread_local std::vector<float> rotated_keys, rotated_basis;
  if (o.rotate_keys) {  // quantize H k with the basis H U (rows of U^T rotated)
    RotateRows(keys, ld, G, d, &rotated_keys);
    keys = rotated_keys.data();
    ld = d;
    if (r > 0) {
      RotateRows(basis_t, d, r, d, &rotated_basis);
      basis_t = rotated_basis.data();
    }
  }
  const size_t size = KeyBlockBytes(o);
  const size_t at = out->size();
  out->resize(at + size);
  uint8_t* p = out->data() + at;
  const format::KeyLayout k = format::MakeKeyLayout(BlockCodecOf(o));
  uint16_t* scale = reinterpret_cast<uint16_t*>(p + k.scale);
  uint16_t* zero = reinterpret_cast<uint16_t*>(p + k.zero);
  uint8_t* codes = p + k.codes;
  thread_local std::vector<float> deq, coef;
  if (r > 0) deq.resize(static_cast<size_t>(G) * d);
  if (r > 0 || rounding) deq.resize(static_cast<size_t>(G) * d);
  K().quantize_channels(keys, ld, G, d, o.key_bits, scale, zero, codes,
                        r > 0 || rounding ? deq.data() : nullptr);
  if (rounding) MetricRound(keys, ld, G, d, o.key_bits, scale, zero, rounding, codes, deq.data());
  if (r > 0) {
    // c_t = U^T (k_t - k_base_t): r coefficients per token.
    coef.resize(static_cast<size_t>(G) * r);
    K().project_residual(keys, ld, deq.data(), G, d, basis_t, r, coef.data());
    // A coefficient sums up to d residuals, so keys within kMaxStorableMagnitude can still
    // project beyond fp16 (an infinite side zero point: the group decodes to Inf/NaN).
    // Clamped, such a group keeps a finite if coarser correction.
    for (float& c : coef) c = std::clamp(c, -kMaxStorableMagnitude, kMaxStorableMagnitude);
    uint16_t* sscale = reinterpret_cast<uint16_t*>(p + k.side_scale);
    uint16_t* szero = reinterpret_cast<uint16_t*>(p + k.side_zero);
    uint8_t* scodes = p + k.side_codes;
    K().quantize_channels(coef.data(), r, G, r, o.side_bits, sscale, szero, scodes, nullptr);
  }
  if (n_sparse > 0) {  // deltas against what reads decode without the list
    KeyBlockView v = KeyViewAt(o, p);
    v.sparse = nullptr;
    v.sparse_count = 0;
    thread_local std::vector<float> decoded, u;
    decoded.resize(static_cast<size_t>(G) * d);
    const float* B = sparse && sparse->decode_basis ? sparse->decode_basis : nullptr;
    if (r > 0 && !B) {
      Transpose(basis_t, r, d, &u);
      B = u.data();
    }
    DecodeKeyBlock(v, B, decoded.data());
    sparse::WriteList(chosen, decoded.data(), n_sparse, p + k.sparse);
  }
  WriteHeader(p, format::KindByte(format::kKindKey, o.rotate_keys, n_sparse > 0), o.key_bits,
              r > 0 ? o.side_bits : 0, G, d, r, size);
  return absl::OkStatus();
}

template <class ByteVec>
absl::Status EncodeValueBlock(const CodecOptions& o, const float* values, int64_t ld,
                              const uint8_t* bits_per_token, ByteVec* out, const float* rounding,
                              const SparseEncode* sparse) {
  const int d = o.head_dim, G = o.key_group, ng = o.value_groups();
  const bool per_token = o.per_token_value_bits();
  if (per_token && bits_per_token == nullptr)
    return absl::InvalidArgumentError("the A^2 value policy needs per-token widths");
  const int n_sparse = SparseCount(o, false);
  thread_local std::vector<float> trimmed;
  sparse::Chosen chosen;
  if (n_sparse > 0) {
    CopyRows(values, ld, G, d, &trimmed);
    chosen = sparse::Choose(o, false, n_sparse, sparse ? sparse->skip_rows : 0, trimmed.data());
    values = trimmed.data();
    ld = d;
  }
  thread_local std::vector<float> rotated_values;
  if (o.rotate_values) {
    RotateRows(values, ld, G, d, &rotated_values);
    values = rotated_values.data();
    ld = d;
  }
  size_t size = format::kHeaderBytes;
  if (per_token) {
    size += format::ValueTagBytes(G);
    for (int t = 0; t < G; ++t) {
      const int b = bits_per_token[t];
      if (b < 1 || b > 4) return absl::InvalidArgumentError(absl::StrCat("value width ", b));
      size += format::ValueRecordBytes(d, o.value_group, b);
    }
    size += format::kSparseEntryBytes * n_sparse;
  } else {
    size = ValueBlockBytes(o);
  }
  const size_t at = out->size();
  out->resize(at + size);
  uint8_t* p = out->data() + at;
  uint8_t* rec = p + format::kHeaderBytes;
  if (per_token) {
    std::memset(rec, 0, format::ValueTagBytes(G));
    for (int t = 0; t < G; ++t) rec[t / 4] |= format::WidthTag(bits_per_token[t], t);
    rec += format::ValueTagBytes(G);
  }
  if (!per_token) {
    const int64_t rec_bytes = format::ValueRecordBytes(d, o.value_group, o.value_bits);
    K().quantize_rows(values, ld, G, d, o.value_group, o.value_bits, rec, rec_bytes);
    if (rounding)
      for (int t = 0; t < G; ++t)
        ValueMetricRound(values + t * ld, d, o.value_group, o.value_bits, rounding,
                         rec + t * rec_bytes);
  } else {
    uint16_t sz[2 * kMaxValueGroups];  // an aligned copy (odd-sized records); Validate
    for (int t = 0; t < G; ++t) {
      const int b = bits_per_token[t];
      K().quantize_row(values + t * ld, d, o.value_group, b, sz, sz + ng, rec + 4 * ng);
      std::memcpy(rec, sz, 4 * ng);
      if (rounding) ValueMetricRound(values + t * ld, d, o.value_group, b, rounding, rec);
      rec += format::ValueRecordBytes(d, o.value_group, b);
    }
  }
  if (n_sparse > 0) {  // deltas against what reads decode without the list
    ValueBlockView v;
    v.bits = per_token ? 0 : o.value_bits;
    v.tokens = G;
    v.head_dim = d;
    v.value_group = o.value_group;
    v.payload = p + format::kHeaderBytes + (per_token ? format::ValueTagBytes(G) : 0);
    for (int t = 0; t < G; ++t)
      v.token_bits[t] = static_cast<uint8_t>(per_token ? bits_per_token[t] : o.value_bits);
    thread_local std::vector<float> decoded;
    decoded.resize(static_cast<size_t>(G) * d);
    DecodeValueBlock(v, decoded.data());
    sparse::WriteList(chosen, decoded.data(), n_sparse,
                      p + size - format::kSparseEntryBytes * n_sparse);
  }
  WriteHeader(p, format::KindByte(format::kKindValue, o.rotate_values, n_sparse > 0),
              per_token ? 0 : o.value_bits, 0, G, d, o.value_group, size);
  return absl::OkStatus();
}

#define KVQ_INSTANTIATE_ENCODERS(ByteVec)                                                         \
  template absl::Status EncodeKeyBlock(const CodecOptions&, const float*, int64_t, const float*,  \
                                       ByteVec*);                                                 \
  template absl::Status EncodeKeyBlockT(const CodecOptions&, const float*, int64_t, const float*, \
                                        ByteVec*, const float*, const SparseEncode*);             \
  template absl::Status EncodeValueBlock(const CodecOptions&, const float*, int64_t,              \
                                         const uint8_t*, ByteVec*, const float*,                  \
                                         const SparseEncode*);
KVQ_INSTANTIATE_ENCODERS(std::vector<uint8_t>)
#undef KVQ_INSTANTIATE_ENCODERS

absl::StatusOr<KeyBlockView> ParseKeyBlock(std::span<const uint8_t> block, const CodecOptions& o,
                                           bool verify) {
  auto h = ReadHeader(block, format::kKindKey, verify);
  if (!h.ok()) return h.status();
  if (h->bits != o.key_bits || h->tokens != o.key_group || h->head_dim != o.head_dim ||
      h->extra != o.rank || (o.rank > 0 && h->side_bits != o.side_bits))
    return absl::DataLossError(absl::StrFormat(
        "key block layout k%d g%d d%d r%d s%d does not match the sequence's codec %s", h->bits,
        h->tokens, h->head_dim, h->extra, h->side_bits, o.ToString()));
  if (((h->flags & format::kFlagRotated) != 0) != o.rotate_keys)
    return absl::DataLossError(absl::StrCat("key block ", o.rotate_keys ? "not " : "",
                                            "rotated, unlike the sequence's codec ", o.ToString()));
  if (((h->flags & format::kFlagSparse) != 0) != (o.sparse_keys > 0))
    return absl::DataLossError(
        absl::StrCat("key block ", o.sparse_keys > 0 ? "without" : "with",
                     " a dense-and-sparse list, unlike the sequence's codec ", o.ToString()));
  if (block.size() != KeyBlockBytes(o))
    return absl::DataLossError(absl::StrCat("key block is ", block.size(), " bytes, expected ",
                                            KeyBlockBytes(o), " (truncated or padded)"));
  const KeyBlockView v = KeyViewAt(o, block.data());
  if (v.sparse && !sparse::ListValid(v.sparse, v.sparse_count, o.key_group, o.head_dim))
    return absl::DataLossError("key block's dense-and-sparse list names a position outside it");
  return v;
}

absl::StatusOr<ValueBlockView> ParseValueBlock(std::span<const uint8_t> block,
                                               const CodecOptions& o, bool verify) {
  auto h = ReadHeader(block, format::kKindValue, verify);
  if (!h.ok()) return h.status();
  const bool per_token = o.per_token_value_bits();
  if (h->tokens != o.key_group || h->head_dim != o.head_dim || h->extra != o.value_group ||
      h->bits != (per_token ? 0 : o.value_bits))
    return absl::DataLossError(absl::StrFormat(
        "value block layout v%d g%d d%d vg%d does not match the sequence's codec %s", h->bits,
        h->tokens, h->head_dim, h->extra, o.ToString()));
  if (((h->flags & format::kFlagRotated) != 0) != o.rotate_values)
    return absl::DataLossError(absl::StrCat("value block ", o.rotate_values ? "not " : "",
                                            "rotated, unlike the sequence's codec ", o.ToString()));
  if (((h->flags & format::kFlagSparse) != 0) != (o.sparse_values > 0))
    return absl::DataLossError(
        absl::StrCat("value block ", o.sparse_values > 0 ? "without" : "with",
                     " a dense-and-sparse list, unlike the sequence's codec ", o.ToString()));
  const int n_sparse = SparseCount(o, false);
  const int d = o.head_dim, G = o.key_group;
  ValueBlockView v;
  v.rotated = o.rotate_values;
  v.bits = h->bits;
  v.tokens = G;
  v.head_dim = d;
  v.value_group = o.value_group;
  size_t need = format::kHeaderBytes;
  const uint8_t* p = block.data() + format::kHeaderBytes;
  if (per_token) {
    need += format::ValueTagBytes(G);
    if (block.size() < need) return absl::DataLossError("value block truncated in its width tags");
    for (int t = 0; t < G; ++t) {
      v.token_bits[t] = static_cast<uint8_t>(format::TagWidth(p, t));
      need += format::ValueRecordBytes(d, o.value_group, v.token_bits[t]);
    }
    need += format::kSparseEntryBytes * n_sparse;
    p += format::ValueTagBytes(G);
  } else {
    for (int t = 0; t < G; ++t) v.token_bits[t] = static_cast<uint8_t>(o.value_bits);
    need = ValueBlockBytes(o);
  }
  if (block.size() != need)
    return absl::DataLossError(absl::StrCat("value block is ", block.size(), " bytes, expected ",
                                            need, " (truncated or padded)"));
  v.payload = p;
  if (n_sparse > 0) {
    v.sparse = block.data() + block.size() - format::kSparseEntryBytes * n_sparse;
    v.sparse_count = n_sparse;
    if (!sparse::ListValid(v.sparse, n_sparse, G, d))
      return absl::DataLossError("value block's dense-and-sparse list names a position outside it");
  }
  return v;
}

BlockReader::BlockReader(const CodecOptions& o, bool verify)
    : o_(o),
      verify_(verify),
      value_fast_(!o.per_token_value_bits()),
      key_bytes_(KeyBlockBytes(o)),
      value_bytes_(ValueBlockBytes(o)) {
  const int r = o.rank;
  format::WriteHeaderFields(key_head_,
                            format::KindByte(format::kKindKey, o.rotate_keys, o.sparse_keys > 0),
                            o.key_bits, r > 0 ? o.side_bits : 0, o.key_group, o.head_dim, r);
  format::WriteHeaderFields(
      value_head_, format::KindByte(format::kKindValue, o.rotate_values, o.sparse_values > 0),
      o.value_bits, 0, o.key_group, o.head_dim, o.value_group);
  key_hash_ = XXH3_64bits(key_head_, format::kHashedHeaderBytes);
  value_hash_ = XXH3_64bits(value_head_, format::kHashedHeaderBytes);
  const int d = o.head_dim, G = o.key_group;
  key_view_ = KeyFields(o);
  ValueBlockView& v = value_view_;
  v.bits = o.value_bits;
  v.tokens = G;
  v.head_dim = d;
  v.value_group = o.value_group;
  v.rotated = o.rotate_values;
  for (int t = 0; t < G; ++t) v.token_bits[t] = static_cast<uint8_t>(o.value_bits);
  v.sparse_count = SparseCount(o, false);
}

bool BlockReader::Matches(std::span<const uint8_t> b, const uint8_t* head, uint64_t head_hash,
                          size_t size) const {
  if (b.size() != size || std::memcmp(b.data(), head, format::kHashedHeaderBytes) != 0)
    return false;
  if (!verify_) return true;
  return format::LoadU32(b.data() + format::kChecksumAt) == Checksum(b.data(), b.size(), head_hash);
}

absl::Status BlockReader::Key(std::span<const uint8_t> b, KeyBlockView* v) const {
  if (!Matches(b, key_head_, key_hash_, key_bytes_)) {
    ASSIGN_OR_RETURN(*v, ParseKeyBlock(b, o_, verify_));
    return absl::OkStatus();
  }
  *v = key_view_;
  SetKeyPointers(b.data(), b.size(), v);
  return absl::OkStatus();
}

absl::Status BlockReader::Value(std::span<const uint8_t> b, ValueBlockView* v) const {
  if (!value_fast_ || !Matches(b, value_head_, value_hash_, value_bytes_)) {
    ASSIGN_OR_RETURN(*v, ParseValueBlock(b, o_, verify_));
    return absl::OkStatus();
  }
  *v = value_view_;
  v->payload = b.data() + format::kHeaderBytes;
  if (v->sparse_count > 0)
    v->sparse = b.data() + b.size() - format::kSparseEntryBytes * v->sparse_count;
  return absl::OkStatus();
}

absl::Status VerifyBlock(std::span<const uint8_t> block) {
  if (block.size() < format::kHeaderBytes) return absl::DataLossError("block truncated");
  auto h = ReadHeader(block, block[format::kKindAt] & format::kKindMask, true);
  return h.ok() ? absl::OkStatus() : h.status();
}

std::vector<float> KeyRoundingFactor(const float* moment, int d, const float* decode_basis,
                                     const float* encode_basis, int r, bool rotated) {
  Eigen::MatrixXd m(d, d);
  for (int a = 0; a < d; ++a)
    for (int c = 0; c < d; ++c) m(a, c) = 0.5 * (double(moment[a * d + c]) + moment[c * d + a]);
  std::vector<float> rb, ra;
  if (rotated) {  // H M H, and the bases' columns rotated (H is symmetric)
    std::vector<float> col(d);
    for (int pass = 0; pass < 2; ++pass) {  // rows, then columns
      for (int a = 0; a < d; ++a) {
        for (int c = 0; c < d; ++c) col[c] = static_cast<float>(pass == 0 ? m(a, c) : m(c, a));
        Rotate(col.data(), d);
        for (int c = 0; c < d; ++c) (pass == 0 ? m(a, c) : m(c, a)) = col[c];
      }
    }
    auto rotate_columns = [&](const float* basis, std::vector<float>* to) {
      to->assign(basis, basis + static_cast<size_t>(d) * r);
      for (int j = 0; j < r; ++j) {
        for (int c = 0; c < d; ++c) col[c] = (*to)[c * r + j];
        Rotate(col.data(), d);
        for (int c = 0; c < d; ++c) (*to)[c * r + j] = col[c];
      }
    };
    if (r > 0) {
      rotate_columns(decode_basis, &rb);
      rotate_columns(encode_basis, &ra);
      decode_basis = rb.data();
      encode_basis = ra.data();
    }
  }
  // Damping as GPTQ does (1% of the mean diagonal) keeps H invertible where P or the
  // queries leave directions unweighted.
  const double damp = 0.01 * m.trace() / d + 1e-12;
  if (r > 0) {
    Eigen::MatrixXd p = Eigen::MatrixXd::Identity(d, d);
    for (int a = 0; a < d; ++a)
      for (int c = 0; c < d; ++c)
        for (int j = 0; j < r; ++j)
          p(a, c) -= double(decode_basis[a * r + j]) * encode_basis[c * r + j];
    m = p.transpose() * m * p;
  }
  m += damp * Eigen::MatrixXd::Identity(d, d);
  const Eigen::MatrixXd inv = m.llt().solve(Eigen::MatrixXd::Identity(d, d));
  const Eigen::MatrixXd u = inv.llt().matrixU();
  std::vector<float> out(static_cast<size_t>(d) * d);
  for (int a = 0; a < d; ++a)
    for (int c = 0; c < d; ++c) out[static_cast<size_t>(a) * d + c] = static_cast<float>(u(a, c));
  return out;
}

std::vector<float> ValueRoundingFactor(const float* metric, int d, bool rotated) {
  // The key factor without a side code (P = I) is exactly this: H M H when rotated, GPTQ's
  // damping, the upper Cholesky factor of the inverse.
  return KeyRoundingFactor(metric, d, nullptr, nullptr, 0, rotated);
}

void HadamardRotateRows(float* x, int64_t ld, int n, int d) {
  for (int t = 0; t < n; ++t) Rotate(x + t * ld, d);
}

void ScoreKeyBlock(const KeyBlockView& b, const float* q, const float* uq, int n_q, float scale,
                   float* out, int64_t out_stride, bool include_base, bool q_rotated) {
  const int d = b.head_dim, G = b.tokens, r = b.rank;
  thread_local std::vector<float> rotated_q;
  if (include_base && b.rotated && !q_rotated) {  // the base code holds H k: score H q against it
    RotateRows(q, d, n_q, d, &rotated_q);
    q = rotated_q.data();
  }
  if (include_base)
    K().score_codes(b.codes, b.bits, d, G, b.scale, b.zero, q, d, n_q, scale, false, out,
                    out_stride);
  if (r > 0 && uq != nullptr)
    K().score_codes(b.side_codes, b.side_bits, r, G, b.side_scale, b.side_zero, uq, r, n_q, scale,
                    include_base, out, out_stride);
  else if (!include_base)
    for (int i = 0; i < n_q; ++i) std::fill(out + i * out_stride, out + i * out_stride + G, 0.0f);
  if (include_base && b.sparse)
    sparse::AddToScores(b.sparse, b.sparse_count, G, d, q, n_q, scale, out, out_stride);
}

void ReadoutValueBlock(const ValueBlockView& b, const float* p, int64_t p_stride, int n_q,
                       float* out, int64_t out_stride, bool out_rotated) {
  if (b.rotated &&
      !out_rotated) {  // sum_t p_t H v_t = H (sum_t p_t v_t): rotate the block's partial output
    const int d = b.head_dim;
    thread_local std::vector<float> part;
    part.assign(static_cast<size_t>(n_q) * d, 0.0f);
    K().readout_rows(b.payload, b.token_bits, b.tokens, d, b.value_group, p, p_stride, n_q,
                     part.data(), d);
    for (int i = 0; i < n_q; ++i) {
      float* row = part.data() + static_cast<size_t>(i) * d;
      Rotate(row, d);
      for (int c = 0; c < d; ++c) out[i * out_stride + c] += row[c];
    }
    return;
  }
  K().readout_rows(b.payload, b.token_bits, b.tokens, b.head_dim, b.value_group, p, p_stride, n_q,
                   out, out_stride);
  if (b.sparse)
    sparse::AddToReadout(b.sparse, b.sparse_count, b.tokens, b.head_dim, p, p_stride, n_q, out,
                         out_stride);
}

void DecodeKeyBase(const KeyBlockView& b, float* out) {
  const int d = b.head_dim, G = b.tokens;
  K().dequantize_channels(b.codes, b.bits, d, G, b.scale, b.zero, out, d, /*by_channel=*/false);
  if (b.rotated)
    for (int t = 0; t < G; ++t) Rotate(out + static_cast<size_t>(t) * d, d);
}
void DecodeKeyBlock(const KeyBlockView& b, const float* basis, float* out) {
  DecodeKeyBase(b, out);
  if (b.rank > 0 && basis != nullptr)
    K().add_low_rank(b.side_codes, b.side_bits, b.rank, b.tokens, b.side_scale, b.side_zero, 1.0f,
                     basis, b.head_dim, out, b.head_dim, /*by_channel=*/false);
  if (b.sparse) sparse::AddToRows(b.sparse, b.sparse_count, b.tokens, b.head_dim, out, b.head_dim);
}
bool DecodeKeyBlockByChannel(const KeyBlockView& b, const float* basis, float* out) {
  if (b.sparse) return false;
  const int d = b.head_dim, G = b.tokens;
  K().dequantize_channels(b.codes, b.bits, d, G, b.scale, b.zero, out, G, /*by_channel=*/true);
  if (b.rotated) hadamard::RotateColumns(out, d, G);
  if (b.rank > 0 && basis != nullptr)
    K().add_low_rank(b.side_codes, b.side_bits, b.rank, G, b.side_scale, b.side_zero, 1.0f, basis,
                     d, out, G, /*by_channel=*/true);
  return true;
}

void DecodeValueBlock(const ValueBlockView& b, float* out) {
  const int d = b.head_dim;
  K().dequantize_rows(b.payload, b.token_bits, b.tokens, d, b.value_group, out, d);
  if (b.rotated)
    for (int t = 0; t < b.tokens; ++t) Rotate(out + static_cast<size_t>(t) * d, d);
  if (b.sparse) sparse::AddToRows(b.sparse, b.sparse_count, b.tokens, d, out, d);
}

}  // namespace kvq::core
