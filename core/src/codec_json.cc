#include "kvq/core/codec_json.h"

#include "absl/strings/str_cat.h"
#include "kvq/core/json_fields.h"
#include "kvq/core/status.h"

namespace kvq::core {

nlohmann::json CodecToJson(const CodecOptions& c) {
  nlohmann::json j = {{"key_bits", c.key_bits},
                      {"key_group", c.key_group},
                      {"rank", c.rank},
                      {"side_bits", c.side_bits},
                      {"value_bits", c.value_bits},
                      {"value_group", c.value_group},
                      {"value_policy", c.value_policy == ValuePolicy::kA2 ? "a2" : "uniform"},
                      {"value_budget", c.value_budget},
                      {"sink_tokens", c.sink_tokens},
                      {"fp16_sinks", c.fp16_sinks},
                      {"window", c.window},
                      {"rotate_keys", c.rotate_keys},
                      {"rotate_values", c.rotate_values},
                      {"metric_rounding", c.metric_rounding}};
  // Written only when set, so that every codec.json written before the field existed (and
  // what this build writes for those codecs) stays byte for byte the same.
  if (c.value_metric_rounding) j["value_metric_rounding"] = true;
  if (c.sparse_keys > 0) j["sparse_keys"] = c.sparse_keys;
  if (c.sparse_values > 0) j["sparse_values"] = c.sparse_values;
  return j;
}

absl::Status CodecFromJson(const nlohmann::json& j, const std::string& file, CodecOptions* c) {
  const JsonFields f(j, file);
  RETURN_IF_ERROR(f.Int("key_bits", &c->key_bits));
  RETURN_IF_ERROR(f.Int("key_group", &c->key_group));
  RETURN_IF_ERROR(f.Int("rank", &c->rank));
  RETURN_IF_ERROR(f.Int("side_bits", &c->side_bits));
  RETURN_IF_ERROR(f.Int("value_bits", &c->value_bits));
  RETURN_IF_ERROR(f.Int("value_group", &c->value_group));
  std::string policy = c->value_policy == ValuePolicy::kA2 ? "a2" : "uniform";
  RETURN_IF_ERROR(f.String("value_policy", &policy));
  if (policy != "uniform" && policy != "a2") {
    return absl::InvalidArgumentError(
        absl::StrCat(file, ": field 'value_policy' must be \"uniform\" or \"a2\" (got \"",
                     Excerpt(policy), "\")"));
  }
  c->value_policy = policy == "a2" ? ValuePolicy::kA2 : ValuePolicy::kUniform;
  RETURN_IF_ERROR(f.Float("value_budget", &c->value_budget));
  RETURN_IF_ERROR(f.Int("sink_tokens", &c->sink_tokens));
  RETURN_IF_ERROR(f.Int("fp16_sinks", &c->fp16_sinks));
  RETURN_IF_ERROR(f.Int("window", &c->window));
  RETURN_IF_ERROR(f.Bool("rotate_keys", &c->rotate_keys));
  RETURN_IF_ERROR(f.Bool("rotate_values", &c->rotate_values));
  RETURN_IF_ERROR(f.Bool("metric_rounding", &c->metric_rounding));
  RETURN_IF_ERROR(f.Bool("value_metric_rounding", &c->value_metric_rounding));
  RETURN_IF_ERROR(f.Int("sparse_keys", &c->sparse_keys));
  RETURN_IF_ERROR(f.Int("sparse_values", &c->sparse_values));
  return absl::OkStatus();
}

absl::Status ReadCodecJson(const std::string& path, CodecOptions* c) {
  ASSIGN_OR_RETURN(const nlohmann::json j, ReadJsonObject(path));
  return CodecFromJson(j, path, c);
}

}  // namespace kvq::core
