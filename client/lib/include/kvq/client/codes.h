// Codes on the wire for C++ clients (docs/API.md, "Codes on the wire"): a model's encoder and
// decoder, made from its GetBasis answer, running core's own codec (a LayerCache to encode,
// core::DecodeMessage to decode), so that the blocks made here are the server's byte for byte and
// the rows decoded here are GetBlocks' decoded rows bit for bit. Immutable; thread-safe.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "kvq/core/cache.h"
#include "kvq/core/registry.h"
#include "kvq/core/tensor.h"
#include "kvq/v1/kvq.pb.h"

namespace kvq::client {

class LayerEncoder;

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

  // An encoder for one layer of a new sequence of `codec` (LayerEncoder). FAILED_PRECONDITION
  // for the A^2 value policy: its widths follow the attention the server observes, which a
  // client does not see, so only the server can encode such a sequence.
  absl::StatusOr<std::unique_ptr<LayerEncoder>> Encoder(int layer,
                                                        const core::CodecOptions& codec) const;

  // One GetBlocks message in codes, of a sequence of `codec`: its tokens [start, start + n),
  // the groups decoded then the rows, [kv_heads][n][head_dim] elements of `dtype` each.
  absl::Status Decode(const v1::GetBlocksResponse& msg, const core::CodecOptions& codec,
                      core::DType dtype, std::vector<uint8_t>* keys,
                      std::vector<uint8_t>* values) const;

 private:
  explicit ModelCodes(core::ModelEntry entry) : entry_(std::move(entry)) {}
  core::ModelEntry entry_;
};

// One layer of one sequence encoded on the client as its rows arrive, on the server's schedule
// (core::LayerCache: a group of G tokens is encoded once more than window + G - 1 wait), so that
// a frontend appending chunk by chunk sends each append in the form with fewer bytes while the
// server ends up holding exactly the blocks it would have made itself (docs/API.md, "Codes on
// the wire"). Not thread-safe.
class LayerEncoder {
 public:
  LayerEncoder(const core::ModelEntry& model, int layer, const core::CodecOptions& codec);

  // Takes the rows [tokens(), tokens() + n) (k, v: [kv_heads, n, head_dim], one dtype: what the
  // caller's append carries) and decides their form:
  //   * true: the groups made whole by these rows cover some of them, in fewer bytes than those
  //     rows (a prefill chunk), so the append goes in codes: `out`'s start, encoded and
  //     keys/values are set to the groups from the layer's encoded end on (replacing the
  //     window rows of earlier appends that they cover) and the rows after them, in k's dtype.
  //     The caller names the sequence and layer (and the model and codec when start is 0) and
  //     gives token ids from out->start(), if it sends any.
  //   * false: the rows go as they are (a decode step, a chunk about a group long): the server
  //     encodes the groups they complete into the same bytes this encoder made; `out` is
  //     untouched.
  // After an error, or when the append is not applied by the server, the encoder no longer
  // matches the sequence: drop it (later appends go as rows).
  absl::StatusOr<bool> Append(const core::TensorView& k, const core::TensorView& v,
                              v1::Append* out);

  int layer() const { return layer_; }
  int64_t tokens() const { return cache_.tokens(); }
  int64_t encoded_tokens() const { return cache_.encoded_tokens(); }

 private:
  const core::BasisManifest* manifest_;
  bool side_codes_;  // rank > 0 over a basis: runs carry the basis fingerprint
  int layer_;
  core::LayerCache cache_;
  int64_t exported_ = 0;  // groups the server holds (sent, or encoded by it from our rows)
};

}  // namespace kvq::client
