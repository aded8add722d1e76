// Encoded groups from outside: the untrusted-input check (encoded_groups.h).
#include "kvq/core/encoded_groups.h"

#include <cmath>

#include "absl/strings/str_cat.h"
#include "kvq/core/status.h"
#include "kvq/format/block_format.h"

namespace kvq::core {

namespace {

float Half(const uint8_t* p) {
  return format::HalfToFloat(static_cast<uint16_t>(format::LoadU16(p)));
}

// n affine pairs (fp16 scale[n] at `scales`, zero[n] at `zeros`) of b-bit codes: finite, scales
// non-negative, every code's value zero + scale * code within the fp16 maximum plus one step.
// Names the first that is not as what[i].
absl::Status CheckAffine(const uint8_t* scales, const uint8_t* zeros, int n, int bits,
                         absl::string_view what) {
  // Accepted at once when every pair is inside a box the check below always passes, tested on
  // the fp16 bits as integers (no conversion; the decode's hot path): scales in [+0, 128)
  // (sign clear, exponent field <= 21) and zeros of magnitude below 32768 (exponent field
  // <= 29) decode within 32768 + 255 * 128 < kHalfMax for codes of up to 8 bits, all finite.
  static_assert(32768.0f + 255.0f * 128.0f < format::kHalfMax);
  if (bits <= 8) {
    unsigned outside = 0;
    for (int i = 0; i < n; ++i) {
      const uint16_t sb = format::LoadU16(scales + 2 * i), zb = format::LoadU16(zeros + 2 * i);
      outside += (sb >= 0x5800u) + ((zb & 0x7fffu) >= 0x7800u);
    }
    if (outside == 0) return absl::OkStatus();
  }
  const float top = static_cast<float>((1 << bits) - 1);
  for (int i = 0; i < n; ++i) {
    const float s = Half(scales + 2 * i), z = Half(zeros + 2 * i);
    if (!std::isfinite(s) || !std::isfinite(z) || s < 0.0f) {
      return absl::InvalidArgumentError(absl::StrCat(what, " scale/zero[", i, "] = ", s, "/", z,
                                                     ": must be finite with scale >= 0"));
    }
    const float lo = z, hi = z + s * top;
    if (std::fabs(lo) > format::kHalfMax + s || std::fabs(hi) > format::kHalfMax + s) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, " scale/zero[", i, "] = ", s, "/", z, " decode to [", lo, ", ", hi,
                       "], beyond the fp16 maximum ", format::kHalfMax));
    }
  }
  return absl::OkStatus();
}

absl::Status CheckSparseDeltas(const uint8_t* list, int n) {
  for (int e = 0; e < n; ++e) {
    const float delta = Half(list + format::kSparseEntryBytes * e + 2);
    if (!std::isfinite(delta)) {
      return absl::InvalidArgumentError(
          absl::StrCat("dense-and-sparse entry ", e, " has a non-finite delta"));
    }
  }
  return absl::OkStatus();
}

// A block's header version, when it is one this build does not read: FAILED_PRECONDITION
// naming both (the sender writes a block format this server does not know).
absl::Status CheckVersion(std::span<const uint8_t> b) {
  if (b.size() < format::kHeaderBytes) return absl::OkStatus();  // the parser says "truncated"
  if (format::LoadU16(b.data() + format::kMagicAt) != format::kMagic) return absl::OkStatus();
  const int v = b[format::kVersionAt];
  if (format::VersionReadable(static_cast<uint8_t>(v))) return absl::OkStatus();
  return absl::FailedPreconditionError(
      absl::StrCat("block format version ", v, "; this server reads versions ", format::kMinVersion,
                   " to ", format::kMaxVersion));
}

absl::Status CheckKey(const CodecOptions& o, std::span<const uint8_t> b) {
  RETURN_IF_ERROR(CheckVersion(b));
  absl::StatusOr<KeyBlockView> v = ParseKeyBlock(b, o, /*verify=*/false);
  if (!v.ok()) return absl::InvalidArgumentError(v.status().message());
  auto p = [](const uint16_t* x) { return reinterpret_cast<const uint8_t*>(x); };
  RETURN_IF_ERROR(CheckAffine(p(v->scale), p(v->zero), v->head_dim, v->bits, "channel"));
  if (v->rank > 0) {
    RETURN_IF_ERROR(
        CheckAffine(p(v->side_scale), p(v->side_zero), v->rank, v->side_bits, "side coefficient"));
  }
  if (v->sparse) RETURN_IF_ERROR(CheckSparseDeltas(v->sparse, v->sparse_count));
  return VerifyBlock(b);  // DATA_LOSS on a checksum mismatch
}

absl::Status CheckValue(const CodecOptions& o, std::span<const uint8_t> b) {
  RETURN_IF_ERROR(CheckVersion(b));
  absl::StatusOr<ValueBlockView> v = ParseValueBlock(b, o, /*verify=*/false);
  if (!v.ok()) return absl::InvalidArgumentError(v.status().message());
  const int ng = o.value_groups();
  const uint8_t* rec = v->payload;
  for (int t = 0; t < v->tokens; ++t) {
    // The token is named only on failure: a message built per token cost a third of a decode.
    if (absl::Status st = CheckAffine(rec, rec + 2 * ng, ng, v->token_bits[t], "channel group");
        !st.ok()) {
      return absl::Status(st.code(), absl::StrCat("token ", t, " ", st.message()));
    }
    rec += format::ValueRecordBytes(o.head_dim, o.value_group, v->token_bits[t]);
  }
  if (v->sparse) RETURN_IF_ERROR(CheckSparseDeltas(v->sparse, v->sparse_count));
  return VerifyBlock(b);
}

absl::Status CheckSinkRows(std::span<const uint8_t> rows, size_t elements, absl::string_view what,
                           const std::string& field) {
  if (rows.size() != 2 * elements) {
    return absl::InvalidArgumentError(absl::StrCat(field, ".", what, " holds ", rows.size(),
                                                   " bytes; the run starts at group 0 of a codec "
                                                   "with fp16 sinks, which needs ",
                                                   2 * elements,
                                                   " (fp16 [kv_heads, S, head_dim])"));
  }
  for (size_t i = 0; i < elements; ++i) {
    const float x = Half(rows.data() + 2 * i);
    if (!std::isfinite(x)) {
      return absl::InvalidArgumentError(absl::StrCat(field, ".", what, "[", i, "] is not finite"));
    }
  }
  return absl::OkStatus();
}

}  // namespace

EncodedGroupsView ViewOf(const EncodedGroups& g) {
  EncodedGroupsView v;
  v.first_group = g.first_group;
  v.groups = g.groups;
  v.basis_fingerprint = g.basis_fingerprint;
  v.bytes = {reinterpret_cast<const uint8_t*>(g.bytes.data()), g.bytes.size()};
  v.sizes = g.sizes;
  v.sink_keys = {reinterpret_cast<const uint8_t*>(g.sink_keys.data()), 2 * g.sink_keys.size()};
  v.sink_values = {reinterpret_cast<const uint8_t*>(g.sink_values.data()),
                   2 * g.sink_values.size()};
  return v;
}

std::vector<size_t> RunOffsets(const EncodedGroupsView& run) {
  std::vector<size_t> at(run.sizes.size() + 1, 0);
  for (size_t i = 0; i < run.sizes.size(); ++i) at[i + 1] = at[i] + run.sizes[i];
  return at;
}

absl::Status CheckEncodedGroups(const CodecOptions& o, int kv_heads, const EncodedGroupsView& run,
                                const std::string& field) {
  if (run.first_group < 0 || run.groups < 0) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": group ", run.first_group, " and ",
                                                   run.groups, " groups must be >= 0"));
  }
  const size_t blocks = static_cast<size_t>(run.groups) * 2 * kv_heads;
  if (run.sizes.size() != blocks) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, ".block_bytes has ", run.sizes.size(), " sizes; ", run.groups, " groups of ",
        kv_heads, " KV heads need ", blocks, " (a key and a value block per head)"));
  }
  uint64_t total = 0;
  for (uint32_t s : run.sizes) total += s;
  if (total != run.bytes.size()) {
    return absl::InvalidArgumentError(absl::StrCat(field, ".blocks holds ", run.bytes.size(),
                                                   " bytes; block_bytes sums to ", total));
  }
  const std::vector<size_t> at = RunOffsets(run);
  for (size_t i = 0; i < blocks; ++i) {
    const std::span<const uint8_t> b = run.bytes.subspan(at[i], run.sizes[i]);
    const bool value = i % 2 == 1;
    absl::Status st = value ? CheckValue(o, b) : CheckKey(o, b);
    if (!st.ok()) {
      const size_t gh = i / 2;
      return absl::Status(
          st.code(), absl::StrCat(field, ".blocks[", i, "] (group ",
                                  run.first_group + gh / kv_heads, ", head ", gh % kv_heads, ", ",
                                  value ? "value" : "key", "): ", st.message()));
    }
  }
  const bool sinks = run.first_group == 0 && run.groups > 0 && o.fp16_sinks > 0;
  if (!sinks) {
    if (!run.sink_keys.empty() || !run.sink_values.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, ": sink rows are sent only with group 0 of a codec with fp16_sinks"));
    }
    return absl::OkStatus();
  }
  const size_t elements = static_cast<size_t>(kv_heads) * o.fp16_sinks * o.head_dim;
  RETURN_IF_ERROR(CheckSinkRows(run.sink_keys, elements, "sink_keys", field));
  return CheckSinkRows(run.sink_values, elements, "sink_values", field);
}

absl::Status ForEachDecodedGroup(const CodecOptions& o, int kv_heads, const float* basis,
                                 const EncodedGroupsView& run, const DecodedGroupSink& emit,
                                 bool keys_by_channel) {
  const int G = o.key_group, d = o.head_dim, r = basis != nullptr ? o.rank : 0;
  if (run.groups < 0 || run.sizes.size() != static_cast<size_t>(run.groups) * 2 * kv_heads) {
    return absl::InvalidArgumentError("decode: unchecked run (sizes do not fit)");
  }
  const std::vector<size_t> at = RunOffsets(run);
  std::vector<float> kg(static_cast<size_t>(G) * d), vg(kg.size()), rows;
  if (keys_by_channel) rows.resize(kg.size());
  const size_t sink_rows = run.first_group == 0 && !run.sink_keys.empty()
                               ? run.sink_keys.size() / 2 / (static_cast<size_t>(kv_heads) * d)
                               : 0;
  for (int64_t g = 0; g < run.groups; ++g) {
    for (int h = 0; h < kv_heads; ++h) {
      const size_t i = static_cast<size_t>((g * kv_heads + h) * 2);
      // (checked whole by CheckEncodedGroups, checksums included: not verified again here)
      ASSIGN_OR_RETURN(KeyBlockView kv, ParseKeyBlock(run.bytes.subspan(at[i], run.sizes[i]), o,
                                                      /*verify=*/false));
      const float* U = r > 0 ? basis + static_cast<size_t>(h) * d * r : nullptr;
      if (!keys_by_channel) {
        DecodeKeyBlock(kv, U, kg.data());
      } else if (!DecodeKeyBlockByChannel(kv, U, kg.data())) {  // a dense-and-sparse list
        DecodeKeyBlock(kv, U, rows.data());
        for (int t = 0; t < G; ++t)
          for (int c = 0; c < d; ++c) kg[c * G + t] = rows[t * d + c];
      }
      ASSIGN_OR_RETURN(ValueBlockView vv,
                       ParseValueBlock(run.bytes.subspan(at[i + 1], run.sizes[i + 1]), o, false));
      DecodeValueBlock(vv, vg.data());
      if (g == 0) {  // the sinks' exact rows over their stand-ins
        for (size_t t = 0; t < sink_rows; ++t) {
          const size_t from = (static_cast<size_t>(h) * sink_rows + t) * d * 2;
          for (int c = 0; c < d; ++c) {
            kg[keys_by_channel ? c * G + t : t * d + c] = format::HalfToFloat(
                static_cast<uint16_t>(format::LoadU16(run.sink_keys.data() + from + 2 * c)));
            vg[t * d + c] = format::HalfToFloat(
                static_cast<uint16_t>(format::LoadU16(run.sink_values.data() + from + 2 * c)));
          }
        }
      }
      emit(g, h, kg.data(), vg.data());
    }
  }
  return absl::OkStatus();
}

absl::Status DecodeRun(const CodecOptions& o, int kv_heads, const float* basis,
                       const EncodedGroupsView& run, DType dtype, int64_t head_tokens,
                       uint8_t* keys, uint8_t* values, RowOrder order) {
  const int G = o.key_group, d = o.head_dim;
  if (head_tokens < run.groups * G) {
    return absl::InvalidArgumentError("decode: unchecked run (sizes do not fit)");
  }
  const size_t row = static_cast<size_t>(d) * DTypeSize(dtype);
  return ForEachDecodedGroup(
      o, kv_heads, basis, run, [&](int64_t g, int h, const float* kg, const float* vg) {
        if (order == RowOrder::kHeadMajor) {
          const size_t off = (static_cast<size_t>(h) * head_tokens + g * G) * row;
          const size_t n = static_cast<size_t>(G) * d;
          FromFloat(dtype, kg, keys + off, n);
          FromFloat(dtype, vg, values + off, n);
          return;
        }
        for (int t = 0; t < G; ++t) {  // token g * G + t, head h
          const size_t off = ((static_cast<size_t>(g) * G + t) * kv_heads + h) * row;
          FromFloat(dtype, kg + static_cast<size_t>(t) * d, keys + off, d);
          FromFloat(dtype, vg + static_cast<size_t>(t) * d, values + off, d);
        }
      });
}

absl::StatusOr<int64_t> WindowRowCount(int kv_heads, int head_dim, const TensorView* rows_keys,
                                       const TensorView* rows_values, const std::string& field) {
  if (rows_keys == nullptr && rows_values == nullptr) return 0;
  const TensorView* both[] = {rows_keys, rows_values};
  for (const TensorView* t : both) {
    if (t == nullptr || t->rank != 3 || t->shape[0] != kv_heads || t->shape[2] != head_dim ||
        t->shape[1] != rows_keys->shape[1]) {
      return absl::InvalidArgumentError(absl::StrCat(field, " keys/values: not both [kv_heads = ",
                                                     kv_heads, ", n, head_dim = ", head_dim, "]"));
    }
  }
  return rows_keys->shape[1];
}

absl::Status DecodeMessage(const CodecOptions& o, int kv_heads, const float* basis,
                           const EncodedGroupsView& run, const TensorView* rows_keys,
                           const TensorView* rows_values, DType dtype, const std::string& field,
                           std::vector<uint8_t>* keys, std::vector<uint8_t>* values,
                           RowOrder order) {
  const int d = o.head_dim;
  ASSIGN_OR_RETURN(const int64_t rows, WindowRowCount(kv_heads, d, rows_keys, rows_values, field));
  RETURN_IF_ERROR(CheckEncodedGroups(o, kv_heads, run, field));
  const int64_t n = run.groups * o.key_group + rows;
  const size_t row = static_cast<size_t>(d) * DTypeSize(dtype);
  keys->resize(static_cast<size_t>(kv_heads) * n * row);
  values->resize(keys->size());
  RETURN_IF_ERROR(
      DecodeRun(o, kv_heads, basis, run, dtype, n, keys->data(), values->data(), order));
  std::vector<float> f(static_cast<size_t>(d));
  for (int h = 0; h < kv_heads; ++h) {
    for (int64_t t = 0; t < rows; ++t) {
      const int64_t token = run.groups * o.key_group + t;
      const size_t at =
          (order == RowOrder::kHeadMajor ? static_cast<size_t>(h) * n + token
                                         : static_cast<size_t>(token) * kv_heads + h) *
          row;
      rows_keys->RowToFloat({h, t}, f.data());
      FromFloat(dtype, f.data(), keys->data() + at, d);
      rows_values->RowToFloat({h, t}, f.data());
      FromFloat(dtype, f.data(), values->data() + at, d);
    }
  }
  return absl::OkStatus();
}

}  // namespace kvq::core
