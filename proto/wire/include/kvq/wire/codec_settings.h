// The one mapping between core's codec (core::CodecOptions) and the wire's
// (v1::CodecSettings), for everyone who crosses it: the server (requests in, ModelInfo out),
// the CLI (a registry folder's codec.json into RegisterBasis) and the frontends (the codec a
// remote cache asks for). Both are described by core's codec table (kvq/core/codec_schema.h);
// a test holds CodecSettings' descriptor to it.
#pragma once

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "kvq/core/codec.h"
#include "kvq/v1/kvq.pb.h"
#include "nlohmann/json.hpp"

namespace kvq::wire {

// The request form of a whole codec: every field set, so that MergeCodec over any base gives
// `o` back exactly. INVALID_ARGUMENT for a codec that fails Validate.
// head_dim is the model's, not a setting; checksum verification is the store's read
// policy (core::ReadPolicy).
absl::StatusOr<v1::CodecSettings> CodecToWire(const core::CodecOptions& o);

// The same with only the fields whose names `present` holds as keys (a codec.json object):
// the others stay unset, the receiver's defaults.
absl::StatusOr<v1::CodecSettings> CodecToWire(const core::CodecOptions& o,
                                              const nlohmann::json& present);

// `s` over `base`: a field not set keeps base's value; a set one is taken as sent (0 and false
// included) and must be in its range (core's codec table), checked even where the codec would
// not use it; the result must pass CodecOptions::Validate. Nothing is coerced: a value out of
// range is INVALID_ARGUMENT naming `field`.name and its limit.
absl::StatusOr<core::CodecOptions> MergeCodec(const core::CodecOptions& base,
                                              const v1::CodecSettings& s, absl::string_view field);

}  // namespace kvq::wire
