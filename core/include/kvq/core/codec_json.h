// codec.json: a registry entry's codec settings as JSON (the fields of CodecOptions that a
// registry entry stores; head_dim comes from the model). One reader and one writer for everyone who
// touches the file: the registry (Persist, LoadEntry), kvq-calibrate --bits (which writes the codec
// it chose) and kvq-eval --configs calibrated (which evaluates what the file names).
#pragma once

#include <string>

#include "absl/status/status.h"
#include "kvq/core/codec.h"
#include "nlohmann/json.hpp"

namespace kvq::core {

// Every stored field, so that the file names the codec exactly whatever the defaults become
// (those marked json_only_when_set in the schema only when they differ from the default).
nlohmann::json CodecToJson(const CodecOptions& c);

// codec.json over the defaults in *c (absent fields keep them); a field that is not in the
// codec schema, a field of the wrong type, or an unknown value_policy is INVALID_ARGUMENT
// naming `file` and the field. Ranges are not
// checked here: CodecOptions::Validate (and the registry's ValidateEntry) do that.
absl::Status CodecFromJson(const nlohmann::json& j, const std::string& file, CodecOptions* c);

// Reads the file at `path` (a JSON object, at most 1 MiB) over the defaults in *c.
absl::Status ReadCodecJson(const std::string& path, CodecOptions* c);

}  // namespace kvq::core
