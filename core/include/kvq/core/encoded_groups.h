// Encoded groups: a run of a layer's encoded groups as they travel between a client and the
// store (PutBlocks and GetBlocks in codes), and the check every such run from outside passes
// before a byte of it is stored.
//
// A run holds groups [first_group, first_group + groups) of one layer: for each group, for each
// KV head, its key block then its value block (the block format, kvq/format/block_format.h),
// concatenated in that order; sizes[2 * (g * kv_heads + h)] and [... + 1] are the key and value
// block's bytes. A run that starts at group 0 under a codec with fp16_sinks = S > 0 also
// carries the sinks' exact rows, fp16 [kv_heads][S][head_dim] keys and values (the blocks hold
// stand-ins for them, CodecOptions::fp16_sinks).
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kvq/core/codec.h"
#include "kvq/core/tensor.h"

namespace kvq::core {

// A run the caller owns (what a layer exports).
struct EncodedGroups {
  int64_t first_group = 0;
  int64_t groups = 0;
  // The fingerprint (BasisManifest::fingerprint) of the basis whose side codes the blocks hold;
  // "" without side codes. A store refuses a run made with another basis.
  std::string basis_fingerprint;
  // The blocks (a string, so that a message can take them without a copy: EncodedToWire).
  std::string bytes;
  std::vector<uint32_t> sizes;
  // fp16 bits, little-endian in memory order of the host (x86: the wire's).
  std::vector<uint16_t> sink_keys, sink_values;
};

// A run in someone else's memory (a request's bytes): nothing is copied. The sinks are fp16
// little-endian bytes, 2 per element, at any alignment.
struct EncodedGroupsView {
  int64_t first_group = 0;
  int64_t groups = 0;
  std::string basis_fingerprint;
  std::span<const uint8_t> bytes;
  std::span<const uint32_t> sizes;
  std::span<const uint8_t> sink_keys, sink_values;
};
EncodedGroupsView ViewOf(const EncodedGroups& g);

// Checks a run from an untrusted sender against the codec of the sequence it is for, without
// trusting any byte of it: the sizes (2 * kv_heads a group, summing to the bytes), each block's
// magic, version (a version this build does not read is FAILED_PRECONDITION naming both),
// kind, layout fields equal to the codec's (bits, tokens = G, head_dim, rank and side bits or
// value group, the rotation and dense-and-sparse flags), exact size, dense-and-sparse positions
// inside the block, every fp16 scale, zero point, side scale and delta finite, every scale
// non-negative and every decodable value within the fp16 maximum plus one step (what the
// encoder's rounding of a scale can reach), and the checksum (DATA_LOSS); the sinks' presence,
// shape and finite values. Errors are INVALID_ARGUMENT unless said otherwise, and name the
// field from `field` on: "<field>.blocks[i] (group g, head h, key): why".
absl::Status CheckEncodedGroups(const CodecOptions& o, int kv_heads, const EncodedGroupsView& run,
                                const std::string& field);

// How decoded rows are laid out: [kv_heads][tokens][d] (GetBlocks' tensors), or
// [tokens][kv_heads][d] (a paged cache's writer takes a token's heads together).
enum class RowOrder { kHeadMajor, kTokenMajor };

// Decodes a checked run (CheckEncodedGroups; checksums are not verified again) group by group
// and head by head as a layer's reads do: emit(g, h, keys, values) gets the G x head_dim fp32
// rows of the run's group g (from 0) and KV head h, keys as attention sees them (k_base + B
// z_hat with the decode basis `basis` [kv_heads][d][rank], null at rank 0), the sinks' exact
// rows over their stand-ins when the run starts at group 0. With keys_by_channel the keys come
// as channel rows instead, [d][G] (the same values transposed: DecodeKeyBlockByChannel). The
// rows live until emit returns.
using DecodedGroupSink =
    absl::FunctionRef<void(int64_t g, int h, const float* keys, const float* values)>;
absl::Status ForEachDecodedGroup(const CodecOptions& o, int kv_heads, const float* basis,
                                 const EncodedGroupsView& run, const DecodedGroupSink& emit,
                                 bool keys_by_channel = false);

// Decodes a checked run (CheckEncodedGroups) as a layer's reads do (LayerCache::DecodeAs): keys
// as attention sees them (k_base + B z_hat with the decode basis `basis` [kv_heads][d][rank],
// null at rank 0) and values, in `dtype`, into keys/values laid out [kv_heads][head_tokens][d]
// (or [head_tokens][kv_heads][d], `order`): the groups fill tokens [0, groups * G) (head_tokens
// >= groups * G), the other rows are left as they are. The sinks' exact rows replace their
// stand-ins when the run starts at group 0. The run must have passed CheckEncodedGroups (checksums
// included; they are not verified again). Bit for bit the server's decode.
absl::Status DecodeRun(const CodecOptions& o, int kv_heads, const float* basis,
                       const EncodedGroupsView& run, DType dtype, int64_t head_tokens,
                       uint8_t* keys, uint8_t* values, RowOrder order = RowOrder::kHeadMajor);

// How many window rows a message carries after its groups: rows_keys/rows_values [kv_heads, n,
// head_dim] (both null: 0), else INVALID_ARGUMENT naming `field`.
absl::StatusOr<int64_t> WindowRowCount(int kv_heads, int head_dim, const TensorView* rows_keys,
                                       const TensorView* rows_values, const std::string& field);

// What a client does with one GetBlocks message in codes: the run checked as untrusted
// (CheckEncodedGroups, errors naming `field`), its groups decoded (DecodeRun) and followed by
// the window rows after them (rows_keys/rows_values [kv_heads, n, d] of any dtype; null: none),
// into keys/values [kv_heads][groups * G + n][d] of `dtype` (resized; token-major with
// `order`). The rows are converted as the server converts its window rows (core::FromFloat of
// their fp32 values).
absl::Status DecodeMessage(const CodecOptions& o, int kv_heads, const float* basis,
                           const EncodedGroupsView& run, const TensorView* rows_keys,
                           const TensorView* rows_values, DType dtype, const std::string& field,
                           std::vector<uint8_t>* keys, std::vector<uint8_t>* values,
                           RowOrder order = RowOrder::kHeadMajor);

// Where each block of a run starts (block i = 2 * (g * kv_heads + h) + (value ? 1 : 0)), and
// the end: sizes.size() + 1 offsets.
std::vector<size_t> RunOffsets(const EncodedGroupsView& run);

}  // namespace kvq::core
