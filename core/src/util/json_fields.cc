#include "kvq/core/json_fields.h"

#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "kvq/core/status.h"

namespace kvq::core {

std::string Excerpt(absl::string_view s) {
  constexpr size_t kMax = 64;
  std::string out = absl::CHexEscape(s.substr(0, kMax));
  if (s.size() > kMax) out += "...";
  return out;
}

absl::Status JsonFields::Mistyped(absl::string_view key, absl::string_view want) const {
  const auto it = j_.find(std::string(key));
  const std::string got =
      it->dump(-1, ' ', true, nlohmann::json::error_handler_t::replace).substr(0, 64);
  return absl::InvalidArgumentError(absl::StrCat(file_, ": field '", key, "' is mistyped: must be ",
                                                 want, " (got ", it->type_name(), " ", got, ")"));
}

absl::Status JsonFields::Int64(absl::string_view key, int64_t* out) const {
  const auto it = j_.find(std::string(key));
  if (it == j_.end()) return absl::OkStatus();
  if (it->is_number_integer() &&
      !(it->is_number_unsigned() && it->get<uint64_t>() > uint64_t{INT64_MAX})) {
    *out = it->get<int64_t>();
    return absl::OkStatus();
  }
  return Mistyped(key, "a 64-bit integer");
}

absl::Status JsonFields::Int(absl::string_view key, int* out) const {
  int64_t v = *out;
  if (absl::Status st = Int64(key, &v); !st.ok()) return Mistyped(key, "a 32-bit integer");
  if (v < std::numeric_limits<int>::min() || v > std::numeric_limits<int>::max()) {
    return Mistyped(key, "a 32-bit integer");
  }
  *out = static_cast<int>(v);
  return absl::OkStatus();
}

absl::Status JsonFields::Float(absl::string_view key, float* out) const {
  const auto it = j_.find(std::string(key));
  if (it == j_.end()) return absl::OkStatus();
  if (it->is_number()) {
    const double v = it->get<double>();
    if (std::isfinite(v) && std::abs(v) <= std::numeric_limits<float>::max()) {
      *out = static_cast<float>(v);
      return absl::OkStatus();
    }
  }
  return Mistyped(key, "a finite number");
}

absl::Status JsonFields::String(absl::string_view key, std::string* out) const {
  const auto it = j_.find(std::string(key));
  if (it == j_.end()) return absl::OkStatus();
  if (!it->is_string()) return Mistyped(key, "a string");
  *out = it->get<std::string>();
  return absl::OkStatus();
}

absl::Status JsonFields::Bool(absl::string_view key, bool* out) const {
  const auto it = j_.find(std::string(key));
  if (it == j_.end()) return absl::OkStatus();
  if (!it->is_boolean()) return Mistyped(key, "true or false");
  *out = it->get<bool>();
  return absl::OkStatus();
}

absl::StatusOr<nlohmann::json> ReadJsonObject(const std::string& path, Env* env) {
  if (env == nullptr) env = Env::Default();
  ASSIGN_OR_RETURN(const std::string text, env->ReadFile(path, size_t{1} << 20));
  nlohmann::json j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(path, " is not a JSON object"));
  }
  return j;
}

absl::Status ReadModelShape(const JsonFields& f, BasisManifest* m) {
  RETURN_IF_ERROR(f.String("model", &m->model));
  RETURN_IF_ERROR(f.Int("version", &m->version));
  RETURN_IF_ERROR(f.Int("layers", &m->layers));
  RETURN_IF_ERROR(f.Int("kv_heads", &m->kv_heads));
  RETURN_IF_ERROR(f.Int("q_heads", &m->q_heads));
  RETURN_IF_ERROR(f.Int("head_dim", &m->head_dim));
  RETURN_IF_ERROR(f.String("rope_layout", &m->rope_layout));
  return f.String("channel_order", &m->channel_order);
}

}  // namespace kvq::core
