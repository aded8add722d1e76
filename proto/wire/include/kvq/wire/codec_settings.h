// The one mapping between core's codec (core::CodecOptions) and the wire's
// (v1::CodecSettings), for everyone who crosses it: the server (requests in, ModelInfo out),
// the CLI (a registry folder's codec.json into RegisterBasis) and the frontends (the codec a
// remote cache asks for). CodecSettings' fields carry codec.json's names (core/codec_json.h);
// a test keeps the two lists equal, so a field added to one cannot be forgotten in the other.
#pragma once

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "kvq/core/codec.h"
#include "kvq/v1/kvq.pb.h"
#include "nlohmann/json.hpp"

namespace kvq::wire {

// The request form of a whole codec: every field set, a value 0 that would read as "the
// default" sent as -1, so that MergeCodec over any base gives `o` back exactly.
// INVALID_ARGUMENT for a codec that fails Validate or has no wire form (the wrong-sign
// control, side_sign -1). head_dim is the model's, not a setting; verify_on_read is the
// server's.
absl::StatusOr<v1::CodecSettings> CodecToWire(const core::CodecOptions& o);

// The same with only the fields whose names `present` holds as keys (a codec.json object):
// the others stay 0, the receiver's defaults.
absl::StatusOr<v1::CodecSettings> CodecToWire(const core::CodecOptions& o,
                                              const nlohmann::json& present);

// `s` over `base`: 0 keeps base's value, -1 asks for 0 (rank, window, sink_tokens,
// fp16_sinks) or off (the switches). Nothing is coerced: a value out of range is
// INVALID_ARGUMENT naming `field`.name and its limit.
absl::StatusOr<core::CodecOptions> MergeCodec(const core::CodecOptions& base,
                                              const v1::CodecSettings& s, absl::string_view field);

}  // namespace kvq::wire
