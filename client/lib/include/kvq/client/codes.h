// Codes on the wire for C++ clients (docs/API.md, "Codes on the wire"): a model's encoder and
// decoder, made from its GetBasis answer, running core's own codec (a LayerCache to encode,
// core::DecodeRun to decode), so that the blocks made here are the server's byte for byte and
// the rows decoded here are GetBlocks' decoded rows bit for bit. Immutable; thread-safe.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "kvq/core/registry.h"
#include "kvq/core/tensor.h"
#include "kvq/v1/kvq.pb.h"

namespace kvq::client {

class ModelCodes {
 public:
  // basis: GetBasis's answer for the model version the sequences are pinned to.
  static absl::StatusOr<std::unique_ptr<ModelCodes>> Create(const v1::RegisterBasisRequest& basis);

  const core::ModelEntry& entry() const { return entry_; }
  // The codec a stream names (GetBlocksResponse.codec, every field set) or a sequence is made
  // with, over the model's defaults.
  absl::StatusOr<core::CodecOptions> CodecOf(const v1::CodecSettings& settings) const;

  // Tokens [0, n) of one layer of a new sequence (k, v: [kv_heads, n, head_dim] of any dtype),
  // encoded with `codec`: appends of at most max_tokens whole groups each (at least one group),
  // the last one also carrying the rows that stay rows (the incomplete group and the window, in
  // k's dtype). The first names the model, its version and the codec (every field), so that the
  // server's sequence takes exactly this codec.
  absl::StatusOr<std::vector<v1::Append>> EncodeLayer(const std::string& sequence_id, int layer,
                                                      const core::CodecOptions& codec,
                                                      const core::TensorView& k,
                                                      const core::TensorView& v,
                                                      int64_t max_tokens) const;

  // One GetBlocks message in codes, of a sequence of `codec`: its tokens [start, start + n),
  // the groups decoded then the rows, [kv_heads][n][head_dim] elements of `dtype` each.
  absl::Status Decode(const v1::GetBlocksResponse& msg, const core::CodecOptions& codec,
                      core::DType dtype, std::vector<uint8_t>* keys,
                      std::vector<uint8_t>* values) const;

 private:
  explicit ModelCodes(core::ModelEntry entry) : entry_(std::move(entry)) {}
  core::ModelEntry entry_;
};

}  // namespace kvq::client
