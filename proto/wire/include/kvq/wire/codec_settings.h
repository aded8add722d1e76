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

// The request form of a whole codec: every field set, a rank, window, sink_tokens or
// fp16_sinks of 0 sent as -1 (the form every server reads as 0, old ones included, which
// took a 0 for "the default"), so that MergeCodec over any base gives `o` back exactly.
// INVALID_ARGUMENT for a codec that fails Validate or has no wire form (the wrong-sign
// control, side_sign -1). head_dim is the model's, not a setting; verify_on_read is the
// server's.
absl::StatusOr<v1::CodecSettings> CodecToWire(const core::CodecOptions& o);

// The same with only the fields whose names `present` holds as keys (a codec.json object):
// the others stay unset, the receiver's defaults.
absl::StatusOr<v1::CodecSettings> CodecToWire(const core::CodecOptions& o,
                                              const nlohmann::json& present);

// `s` over `base` (the rules in kvq.proto's CodecSettings): a field not set keeps base's
// value. rank, window, sink_tokens and fp16_sinks set are taken as sent, 0 included, -1
// asking for 0 too (the form of clients without presence). The switches: 0 base's, 1 on, -1
// off. The other fields have no 0 setting: 0, set or not, keeps base's. Nothing is coerced: a
// value out of range is INVALID_ARGUMENT naming `field`.name and its limit.
absl::StatusOr<core::CodecOptions> MergeCodec(const core::CodecOptions& base,
                                              const v1::CodecSettings& s, absl::string_view field);

}  // namespace kvq::wire
