#include "kvq/core/codec_json.h"

#include "absl/strings/str_cat.h"
#include "kvq/core/codec_schema.h"
#include "kvq/core/json_fields.h"
#include "kvq/core/status.h"

namespace kvq::core {

nlohmann::json CodecToJson(const CodecOptions& c) {
  nlohmann::json j = nlohmann::json::object();
  const CodecOptions defaults;
  for (const CodecField& f : CodecFields()) {
    const double v = GetCodecField(f, c);
    if (f.json_only_when_set && v == GetCodecField(f, defaults)) continue;
    const std::string key(f.name);
    switch (f.type) {
      case CodecFieldType::kInt:
        j[key] = c.*f.int_member;
        break;
      case CodecFieldType::kFloat:
        j[key] = c.*f.float_member;
        break;
      case CodecFieldType::kBool:
        j[key] = c.*f.bool_member;
        break;
      case CodecFieldType::kValuePolicy:
        j[key] = std::string(ValuePolicyName(c.value_policy));
        break;
    }
  }
  return j;
}

absl::Status CodecFromJson(const nlohmann::json& j, const std::string& file, CodecOptions* c) {
  // A field this build does not know (a typo, or a setting of another build) would otherwise
  // leave the default in its place: the entry would be served with another codec than it names.
  if (j.is_object())
    for (const auto& [key, value] : j.items())
      if (!FindCodecField(key))
        return absl::InvalidArgumentError(
            absl::StrCat(file, ": field '", Excerpt(key), "' is not a codec setting"));
  const JsonFields fields(j, file);
  for (const CodecField& f : CodecFields()) {
    const std::string key(f.name);
    switch (f.type) {
      case CodecFieldType::kInt:
        RETURN_IF_ERROR(fields.Int(key, &(c->*f.int_member)));
        break;
      case CodecFieldType::kFloat:
        RETURN_IF_ERROR(fields.Float(key, &(c->*f.float_member)));
        break;
      case CodecFieldType::kBool:
        RETURN_IF_ERROR(fields.Bool(key, &(c->*f.bool_member)));
        break;
      case CodecFieldType::kValuePolicy: {
        std::string policy(ValuePolicyName(c->value_policy));
        RETURN_IF_ERROR(fields.String(key, &policy));
        if (!ParseValuePolicy(policy, &c->value_policy))
          return absl::InvalidArgumentError(
              absl::StrCat(file, ": field 'value_policy' must be \"uniform\" or \"a2\" (got \"",
                           Excerpt(policy), "\")"));
        break;
      }
    }
  }
  return absl::OkStatus();
}

absl::Status ReadCodecJson(const std::string& path, CodecOptions* c) {
  ASSIGN_OR_RETURN(const nlohmann::json j, ReadJsonObject(path));
  return CodecFromJson(j, path, c);
}

}  // namespace kvq::core
