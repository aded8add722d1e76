#include "kvq/wire/codec_settings.h"

#include <tuple>
#include <utility>

#include "absl/strings/str_cat.h"
#include "kvq/core/status.h"

namespace kvq::wire {
namespace {

// 0 is "the default" on the wire: a real 0 travels as -1.
int32_t ZeroAsNone(int v) { return v == 0 ? -1 : v; }

}  // namespace

absl::StatusOr<v1::CodecSettings> CodecToWire(const core::CodecOptions& o) {
  RETURN_IF_ERROR(o.Validate());
  if (o.side_sign != 1.0f) {
    return absl::InvalidArgumentError(
        "the wrong-sign control (side_sign != 1) has no wire form; run it in-process");
  }
  v1::CodecSettings c;
  c.set_key_bits(o.key_bits);
  c.set_key_group(o.key_group);
  c.set_rank(ZeroAsNone(o.rank));
  c.set_side_bits(o.side_bits);
  c.set_value_bits(o.value_bits);
  c.set_value_group(o.value_group);
  c.set_value_policy(o.per_token_value_bits() ? v1::CodecSettings::VALUE_POLICY_A2
                                              : v1::CodecSettings::VALUE_POLICY_UNIFORM);
  c.set_value_budget(o.value_budget);
  c.set_sink_tokens(ZeroAsNone(o.sink_tokens));
  c.set_window(ZeroAsNone(o.window));
  c.set_rotate_keys(o.rotate_keys ? 1 : -1);
  c.set_rotate_values(o.rotate_values ? 1 : -1);
  c.set_metric_rounding(o.metric_rounding ? 1 : -1);
  c.set_fp16_sinks(ZeroAsNone(o.fp16_sinks));
  c.set_sparse_keys(ZeroAsNone(o.sparse_keys));
  c.set_sparse_values(ZeroAsNone(o.sparse_values));
  return c;
}

absl::StatusOr<v1::CodecSettings> CodecToWire(const core::CodecOptions& o,
                                              const nlohmann::json& present) {
  ASSIGN_OR_RETURN(v1::CodecSettings c, CodecToWire(o));
  const google::protobuf::Descriptor* d = c.GetDescriptor();
  for (int i = 0; i < d->field_count(); ++i) {
    const google::protobuf::FieldDescriptor* f = d->field(i);
    if (!present.is_object() || !present.contains(f->name())) c.GetReflection()->ClearField(&c, f);
  }
  return c;
}

absl::StatusOr<core::CodecOptions> MergeCodec(const core::CodecOptions& base,
                                              const v1::CodecSettings& s, absl::string_view field) {
  // The request-only values (unset: the default; -1: none) and the enum are checked here; the
  // rest of every range by CodecOptions::Validate below. Nothing out of range is coerced.
  auto bad = [field](absl::string_view name, double v, absl::string_view allowed) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ".", name, " = ", v, ": must be ", allowed));
  };
  for (const auto& [name, v, limit] :
       {std::tuple{"rank", s.rank(),
                   "-1 (none), 0 (none; unset: the model's default) or 1..basis rank"},
        std::tuple{"window", s.window(),
                   "-1 (none), 0 (none; unset: the model's default) or 1..65536"},
        std::tuple{"sink_tokens", s.sink_tokens(),
                   "-1 (none), 0 (none; unset: the model's default) or 1..1024"},
        std::tuple{"fp16_sinks", s.fp16_sinks(),
                   "-1 (none), 0 (none; unset: the model's default) or 1..16"},
        std::tuple{"sparse_keys", s.sparse_keys(),
                   "-1 (none), 0 (none; unset: the model's default) or 1..100 per mille"},
        std::tuple{"sparse_values", s.sparse_values(),
                   "-1 (none), 0 (none; unset: the model's default) or 1..100 per mille"}}) {
    if (v < -1) return bad(name, v, limit);
  }
  if (!v1::CodecSettings::ValuePolicy_IsValid(s.value_policy())) {
    return bad("value_policy", s.value_policy(),
               "VALUE_POLICY_DEFAULT (0), VALUE_POLICY_UNIFORM (1) or VALUE_POLICY_A2 (2)");
  }
  // Checked even where the codec would not use them (side_bits at rank 0, value_budget
  // under the uniform policy): a value no codec accepts is a client error either way.
  if (s.side_bits() != 0 && s.side_bits() != 4 && s.side_bits() != 8) {
    return bad("side_bits", s.side_bits(), "0 (the model's default), 4 or 8");
  }
  if (s.value_budget() != 0 && !(s.value_budget() >= 1.0f && s.value_budget() <= 4.0f)) {
    return bad("value_budget", s.value_budget(), "0 (the model's default) or in [1, 4]");
  }
  for (const auto& [name, v] :
       {std::pair{"rotate_keys", s.rotate_keys()}, std::pair{"rotate_values", s.rotate_values()},
        std::pair{"metric_rounding", s.metric_rounding()}}) {
    if (v < -1 || v > 1) return bad(name, v, "0 (the model's default), 1 (on) or -1 (off)");
  }
  core::CodecOptions c = base;
  // Where 0 is a setting (rank, window, sink_tokens, fp16_sinks, sparse_*): unset keeps base's, a
  // set value is taken as sent, -1 (the form of clients without presence) meaning 0 too.
  auto set = [](bool has, int32_t v, int* to) {
    if (has) *to = v == -1 ? 0 : v;
  };
  // Elsewhere 0 is no setting and keeps meaning "the default", set or not.
  if (s.key_bits()) c.key_bits = s.key_bits();
  if (s.key_group()) c.key_group = s.key_group();
  set(s.has_rank(), s.rank(), &c.rank);
  if (s.side_bits()) c.side_bits = s.side_bits();
  if (s.value_bits()) c.value_bits = s.value_bits();
  if (s.value_group()) c.value_group = s.value_group();
  if (s.value_policy() == v1::CodecSettings::VALUE_POLICY_UNIFORM) {
    c.value_policy = core::ValuePolicy::kUniform;
  } else if (s.value_policy() == v1::CodecSettings::VALUE_POLICY_A2) {
    c.value_policy = core::ValuePolicy::kA2;
  }
  if (s.value_budget() != 0) c.value_budget = s.value_budget();
  set(s.has_sink_tokens(), s.sink_tokens(), &c.sink_tokens);
  set(s.has_window(), s.window(), &c.window);
  set(s.has_fp16_sinks(), s.fp16_sinks(), &c.fp16_sinks);
  set(s.has_sparse_keys(), s.sparse_keys(), &c.sparse_keys);
  set(s.has_sparse_values(), s.sparse_values(), &c.sparse_values);
  auto set_switch = [](int32_t v, bool* on) {
    if (v != 0) *on = v > 0;
  };
  set_switch(s.rotate_keys(), &c.rotate_keys);
  set_switch(s.rotate_values(), &c.rotate_values);
  set_switch(s.metric_rounding(), &c.metric_rounding);
  absl::Status st = c.Validate();
  if (!st.ok()) return absl::InvalidArgumentError(absl::StrCat(field, ": ", st.message()));
  return c;
}

}  // namespace kvq::wire
