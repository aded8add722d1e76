// Decoded rows into a paged cache's own layout (paged_rows.h).
#include "kvq/core/paged_rows.h"

#include <algorithm>
#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kvq/core/status.h"

namespace kvq::core {

namespace {

// For each within-block token row of an index: 1 when its head_dim offsets are consecutive (the
// row is one copy), else 0 (element by element).
std::vector<uint8_t> ConsecutiveRows(std::span<const int32_t> index, int64_t block_tokens, int d) {
  std::vector<uint8_t> out(static_cast<size_t>(block_tokens));
  for (int64_t t = 0; t < block_tokens; ++t) {
    const int32_t* row = index.data() + t * d;
    bool run = true;
    for (int c = 1; c < d && run; ++c) run = row[c] == row[0] + c;
    out[static_cast<size_t>(t)] = run ? 1 : 0;
  }
  return out;
}

// True when each channel's offsets run on with the token inside a block (a transposed [d][t]
// packing): a block's tokens of one channel are then one contiguous run.
bool TokenRuns(std::span<const int32_t> index, int64_t block_tokens, int d) {
  for (int64_t t = 0; t + 1 < block_tokens; ++t)
    for (int c = 0; c < d; ++c)
      if (index[(t + 1) * d + c] != index[t * d + c] + 1) return false;
  return true;
}

template <typename E>
void Scatter(const uint8_t* src, const int32_t* index, int d, uint8_t* block) {
  const E* s = reinterpret_cast<const E*>(src);
  E* b = reinterpret_cast<E*>(block);
  for (int c = 0; c < d; ++c) b[index[c]] = s[c];
}

// n rows [n][d] at src into channel runs: channel c's n values at block + index[c] onwards.
template <typename E>
void Transpose(const uint8_t* src, int64_t n, const int32_t* index, int d, uint8_t* block) {
  const E* s = reinterpret_cast<const E*>(src);
  E* b = reinterpret_cast<E*>(block);
  for (int c = 0; c < d; ++c) {
    E* out = b + index[c];
    for (int64_t j = 0; j < n; ++j) out[j] = s[j * d + c];
  }
}

// Writes rows of one head, K or V, token by token through the layout (checked beforehand).
class PagedWriter {
 public:
  PagedWriter(const PagedRows& p, int d)
      : p_(p),
        d_(d),
        size_(DTypeSize(p.dtype)),
        key_rows_(ConsecutiveRows(p.key_index, p.block_tokens, d)),
        value_rows_(ConsecutiveRows(p.value_index, p.block_tokens, d)),
        key_runs_(TokenRuns(p.key_index, p.block_tokens, d)),
        value_runs_(TokenRuns(p.value_index, p.block_tokens, d)) {}

  // Whether keys go to the cache channel by channel (a transposed [d][t] packing), so that
  // they are best decoded by channel (WriteKeyChannels).
  bool key_runs() const { return key_runs_; }

  // Keys of tokens [first, first + n), head h, as channel rows [d][n] fp32, into a packing with
  // token runs (key_runs()): each channel's run of a block converted straight into place.
  void WriteKeyChannels(int64_t first, int64_t n, int h, const float* channels) {
    const int64_t lo = std::max(first, p_.from_token), hi = std::min(first + n, p_.to_token);
    for (int64_t t = lo; t < hi;) {
      const int64_t slot = t % p_.block_tokens, run = std::min(hi - t, p_.block_tokens - slot);
      uint8_t* block = p_.base + (p_.block_offsets[static_cast<size_t>(t / p_.block_tokens)] +
                                  h * p_.head_stride) *
                                     static_cast<int64_t>(size_);
      const int32_t* at = p_.key_index.data() + slot * d_;
      for (int c = 0; c < d_; ++c)
        FromFloat(p_.dtype, channels + c * n + (t - first),
                  block + static_cast<int64_t>(at[c]) * static_cast<int64_t>(size_),
                  static_cast<size_t>(run));
      t += run;
    }
  }

  // Rows [n][d] fp32 of tokens [first, first + n), head h: those inside [from_token, to_token).
  void Write(int64_t first, int64_t n, int h, const float* rows, bool value) {
    const int64_t lo = std::max(first, p_.from_token), hi = std::min(first + n, p_.to_token);
    if (hi <= lo) return;
    const size_t row = static_cast<size_t>(d_) * size_;
    scratch_.resize(static_cast<size_t>(hi - lo) * row);
    FromFloat(p_.dtype, rows + (lo - first) * d_, scratch_.data(),
              static_cast<size_t>(hi - lo) * d_);
    const std::span<const int32_t> index = value ? p_.value_index : p_.key_index;
    const std::vector<uint8_t>& consecutive = value ? value_rows_ : key_rows_;
    if (value ? value_runs_ : key_runs_) {  // block by block, channel by channel
      for (int64_t t = lo; t < hi;) {
        const int64_t slot = t % p_.block_tokens, run = std::min(hi - t, p_.block_tokens - slot);
        uint8_t* block = p_.base + (p_.block_offsets[static_cast<size_t>(t / p_.block_tokens)] +
                                    h * p_.head_stride) *
                                       static_cast<int64_t>(size_);
        const uint8_t* src = scratch_.data() + static_cast<size_t>(t - lo) * row;
        if (size_ == 2) {
          Transpose<uint16_t>(src, run, index.data() + slot * d_, d_, block);
        } else {
          Transpose<uint32_t>(src, run, index.data() + slot * d_, d_, block);
        }
        t += run;
      }
      return;
    }
    for (int64_t t = lo; t < hi; ++t) {
      const int64_t slot = t % p_.block_tokens;
      uint8_t* block = p_.base + (p_.block_offsets[static_cast<size_t>(t / p_.block_tokens)] +
                                  h * p_.head_stride) *
                                     static_cast<int64_t>(size_);
      const int32_t* at = index.data() + slot * d_;
      const uint8_t* src = scratch_.data() + static_cast<size_t>(t - lo) * row;
      if (consecutive[static_cast<size_t>(slot)]) {
        std::memcpy(block + static_cast<int64_t>(at[0]) * static_cast<int64_t>(size_), src, row);
      } else if (size_ == 2) {
        Scatter<uint16_t>(src, at, d_, block);
      } else {
        Scatter<uint32_t>(src, at, d_, block);
      }
    }
  }

 private:
  const PagedRows& p_;
  const int d_;
  const size_t size_;
  const std::vector<uint8_t> key_rows_, value_rows_;
  const bool key_runs_, value_runs_;
  std::vector<uint8_t> scratch_;
};

}  // namespace

absl::Status CheckPagedRows(const PagedRows& p, int kv_heads, int head_dim,
                            const std::string& field) {
  auto invalid = [&](const std::string& why) {
    return absl::InvalidArgumentError(absl::StrCat(field, ".", why));
  };
  if (p.block_tokens <= 0)
    return invalid(absl::StrCat("block_size ", p.block_tokens, " must be > 0"));
  const size_t per_index = static_cast<size_t>(p.block_tokens) * head_dim;
  if (p.key_index.size() != per_index || p.value_index.size() != per_index) {
    return invalid(absl::StrCat("key_index/value_index: ", p.key_index.size(), "/",
                                p.value_index.size(),
                                " offsets, block_size x head_dim = ", per_index, " wanted"));
  }
  if (p.head_stride < 0)
    return invalid(absl::StrCat("head_stride ", p.head_stride, " must be >= 0"));
  if (p.from_token < 0 || p.to_token < p.from_token) {
    return invalid(absl::StrCat("tokens [", p.from_token, ", ", p.to_token, ") are not a range"));
  }
  if (p.to_token == p.from_token) return absl::OkStatus();
  if (p.base == nullptr) return invalid("cache: no memory");
  const int64_t blocks_needed = (p.to_token - 1) / p.block_tokens + 1;
  if (static_cast<int64_t>(p.block_offsets.size()) < blocks_needed) {
    return invalid(absl::StrCat("block_ids: ", p.block_offsets.size(), " blocks, token ",
                                p.to_token - 1, " needs ", blocks_needed));
  }
  int64_t top = 0;  // the largest in-block offset
  for (const std::span<const int32_t> index : {p.key_index, p.value_index}) {
    for (const int32_t i : index) {
      if (i < 0) return invalid(absl::StrCat("key_index/value_index: offset ", i, " < 0"));
      top = std::max<int64_t>(top, i);
    }
  }
  const int64_t reach = (kv_heads - 1) * p.head_stride + top;  // from a block's offset
  for (int64_t b = p.from_token / p.block_tokens; b < blocks_needed; ++b) {
    const int64_t at = p.block_offsets[static_cast<size_t>(b)];
    if (at < 0 || at > p.elements - 1 - reach) {
      return invalid(absl::StrCat("block_ids[", b, "]: the block's elements [", at, ", ",
                                  at + reach + 1, ") are outside the cache's ", p.elements));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<int64_t> DecodeMessageInto(const CodecOptions& o, int kv_heads, const float* basis,
                                          const EncodedGroupsView& run, int64_t start,
                                          const TensorView* rows_keys,
                                          const TensorView* rows_values, const std::string& field,
                                          const PagedRows& dst) {
  const int d = o.head_dim, G = o.key_group;
  ASSIGN_OR_RETURN(const int64_t rows, WindowRowCount(kv_heads, d, rows_keys, rows_values, field));
  if (start < 0 || (run.groups > 0 && start != run.first_group * G)) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, " start ", start, ": the run's groups start at token ", run.first_group * G));
  }
  RETURN_IF_ERROR(CheckEncodedGroups(o, kv_heads, run, field));
  // Only the message's own tokens are checked and written (to_token may lie past its end).
  const int64_t first_row = start + run.groups * G, end = first_row + rows;
  if (dst.from_token < 0 || dst.to_token < dst.from_token) {
    return CheckPagedRows(dst, kv_heads, d, "paged");  // not a range: refused as given
  }
  PagedRows span = dst;
  span.from_token = std::max(dst.from_token, start);
  span.to_token = std::max(span.from_token, std::min(dst.to_token, end));
  RETURN_IF_ERROR(CheckPagedRows(span, kv_heads, d, "paged"));
  PagedWriter writer(span, d);
  // Keys decoded by channel where the cache keeps them so (no transpose on either side).
  const bool by_channel = writer.key_runs();
  RETURN_IF_ERROR(ForEachDecodedGroup(
      o, kv_heads, basis, run,
      [&](int64_t g, int h, const float* kg, const float* vg) {
        if (by_channel) {
          writer.WriteKeyChannels(start + g * G, G, h, kg);
        } else {
          writer.Write(start + g * G, G, h, kg, /*value=*/false);
        }
        writer.Write(start + g * G, G, h, vg, /*value=*/true);
      },
      by_channel));
  std::vector<float> f(static_cast<size_t>(rows) * d);
  for (int h = 0; h < kv_heads && rows > 0; ++h) {
    const TensorView* both[] = {rows_keys, rows_values};
    for (int which = 0; which < 2; ++which) {
      for (int64_t t = 0; t < rows; ++t) both[which]->RowToFloat({h, t}, f.data() + t * d);
      writer.Write(first_row, rows, h, f.data(), /*value=*/which == 1);
    }
  }
  return span.to_token - span.from_token;
}

}  // namespace kvq::core
