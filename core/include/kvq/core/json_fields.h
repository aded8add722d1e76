// Checked reads of the fields of a registry file's JSON object. nlohmann's own accessors
// throw on a mistyped field (and get<int> silently truncates 2.5 or wraps 1e10); these
// answer INVALID_ARGUMENT naming the file and the field instead. An absent field leaves
// *out as it was (the caller's default).
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "kvq/core/basis.h"
#include "kvq/core/env.h"
#include "nlohmann/json.hpp"

namespace kvq::core {

class JsonFields {
 public:
  // `file` names the object in error messages (e.g. ".../v1/codec.json").
  JsonFields(const nlohmann::json& object, std::string file) : j_(object), file_(std::move(file)) {}

  absl::Status Int(absl::string_view key, int* out) const;
  absl::Status Int64(absl::string_view key, int64_t* out) const;
  absl::Status Float(absl::string_view key, float* out) const;
  absl::Status String(absl::string_view key, std::string* out) const;
  // true / false only (not 0 / 1 or "true"): a flag typed as a number is a mistake.
  absl::Status Bool(absl::string_view key, bool* out) const;

 private:
  absl::Status Mistyped(absl::string_view key, absl::string_view want) const;

  const nlohmann::json& j_;
  std::string file_;
};

// A string read from a file or a call, as an error message may quote it: at most its first 64
// bytes, control and non-ASCII bytes escaped (\n, \x01), "..." after a cut. Keeps every
// message one bounded line.
std::string Excerpt(absl::string_view s);

// A registry file as a JSON object, at most 1 MiB (never an exception: a garbage or
// truncated file is INVALID_ARGUMENT naming it, a missing one NOT_FOUND).
absl::StatusOr<nlohmann::json> ReadJsonObject(const std::string& path, Env* env = nullptr);

// The identity and shape fields that manifest.json (a basis) and model.json (no basis)
// share: model, version, layers, kv_heads, q_heads, head_dim, rope_layout, channel_order.
absl::Status ReadModelShape(const JsonFields& f, BasisManifest* m);

}  // namespace kvq::core
