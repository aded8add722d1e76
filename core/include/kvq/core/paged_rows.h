// Decoded K/V written straight into a serving engine's paged KV cache, in the engine's own
// layout: what a remote-store connector does with a GetBlocks message in codes, with no
// intermediate tensor and no second pass through the engine's writer.
#pragma once

#include <cstdint>
#include <span>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kvq/core/codec.h"
#include "kvq/core/encoded_groups.h"
#include "kvq/core/tensor.h"

namespace kvq::core {

// Where a paged cache keeps a sequence's rows, in elements of `dtype` from `base`: channel c of
// token t, KV head h of K is at
//   block_offsets[t / block_tokens] + h * head_stride + key_index[(t % block_tokens) * d + c]
// and of V at the same with value_index. The indices are the engine's within-block packing
// (transposed, tiled, ...) as a permutation; block_offsets name the sequence's blocks in order
// from its token 0. Only tokens [from_token, to_token) are written; the rest of the cache is
// left as it is.
struct PagedRows {
  uint8_t* base = nullptr;
  DType dtype = DType::kF32;
  int64_t elements = 0;  // of the cache at base: every write is checked to fall inside
  int64_t block_tokens = 0;
  int64_t head_stride = 0;
  std::span<const int64_t> block_offsets;
  std::span<const int32_t> key_index, value_index;
  int64_t from_token = 0, to_token = 0;
};

// Checks that every element the tokens [from_token, to_token) of kv_heads heads of head_dim
// channels can reach lies inside the cache (and the shapes agree), naming `field`'s part and
// the limit: INVALID_ARGUMENT.
absl::Status CheckPagedRows(const PagedRows& p, int kv_heads, int head_dim,
                            const std::string& field);

// One GetBlocks message into a paged cache: the run (checked as untrusted, CheckEncodedGroups,
// errors naming `field`) decoded as DecodeMessage decodes it, bit for bit, its groups as tokens
// [start, start + groups * G), the window rows after them (rows_keys/rows_values [kv_heads, n,
// d] of any dtype; null: none) converted as the server converts them; start must be
// run.first_group * G when the run has groups. Returns how many tokens were written (those
// inside [from_token, to_token)). Nothing is written when a check fails.
absl::StatusOr<int64_t> DecodeMessageInto(const CodecOptions& o, int kv_heads, const float* basis,
                                          const EncodedGroupsView& run, int64_t start,
                                          const TensorView* rows_keys,
                                          const TensorView* rows_values, const std::string& field,
                                          const PagedRows& dst);

}  // namespace kvq::core
