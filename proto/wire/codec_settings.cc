// The wire's CodecSettings and core's CodecOptions, field by field from core's codec table
// (core/codec_schema.h): each table field is the proto field of the same name and number.
#include "kvq/wire/codec_settings.h"

#include "absl/strings/str_cat.h"
#include "kvq/core/codec_schema.h"
#include "kvq/core/status.h"

namespace kvq::wire {
namespace {

using google::protobuf::FieldDescriptor;
using google::protobuf::Reflection;

const FieldDescriptor* WireField(const core::CodecField& f) {
  return v1::CodecSettings::descriptor()->FindFieldByNumber(f.wire_number);
}

void SetWire(const core::CodecField& f, const core::CodecOptions& o, v1::CodecSettings* c) {
  const FieldDescriptor* d = WireField(f);
  const Reflection* r = c->GetReflection();
  switch (f.type) {
    case core::CodecFieldType::kInt:
      r->SetInt32(c, d, o.*f.int_member);
      return;
    case core::CodecFieldType::kFloat:
      r->SetFloat(c, d, o.*f.float_member);
      return;
    case core::CodecFieldType::kBool:
      r->SetBool(c, d, o.*f.bool_member);
      return;
    case core::CodecFieldType::kValuePolicy:
      r->SetEnumValue(c, d,
                      o.per_token_value_bits() ? v1::CodecSettings::VALUE_POLICY_A2
                                               : v1::CodecSettings::VALUE_POLICY_UNIFORM);
      return;
  }
}

// The set field's value as the table's double (the policy: 0 uniform, 1 a2), or
// INVALID_ARGUMENT for a policy that names none.
absl::StatusOr<double> GetWire(const core::CodecField& f, const v1::CodecSettings& c,
                               absl::string_view prefix) {
  const FieldDescriptor* d = WireField(f);
  const Reflection* r = c.GetReflection();
  switch (f.type) {
    case core::CodecFieldType::kInt:
      return r->GetInt32(c, d);
    case core::CodecFieldType::kFloat:
      return r->GetFloat(c, d);
    case core::CodecFieldType::kBool:
      return r->GetBool(c, d) ? 1.0 : 0.0;
    case core::CodecFieldType::kValuePolicy:
      break;
  }
  const int v = r->GetEnumValue(c, d);
  if (v == v1::CodecSettings::VALUE_POLICY_UNIFORM) return 0.0;
  if (v == v1::CodecSettings::VALUE_POLICY_A2) return 1.0;
  return absl::InvalidArgumentError(absl::StrCat(
      prefix, f.name, " = ", v, ": must be VALUE_POLICY_UNIFORM (1) or VALUE_POLICY_A2 (2)"));
}

}  // namespace

absl::StatusOr<v1::CodecSettings> CodecToWire(const core::CodecOptions& o) {
  RETURN_IF_ERROR(o.Validate());
  v1::CodecSettings c;
  for (const core::CodecField& f : core::CodecFields()) SetWire(f, o, &c);
  return c;
}

absl::StatusOr<v1::CodecSettings> CodecToWire(const core::CodecOptions& o,
                                              const nlohmann::json& present) {
  ASSIGN_OR_RETURN(v1::CodecSettings c, CodecToWire(o));
  const google::protobuf::Descriptor* d = c.GetDescriptor();
  for (int i = 0; i < d->field_count(); ++i) {
    const FieldDescriptor* f = d->field(i);
    if (!present.is_object() || !present.contains(f->name())) c.GetReflection()->ClearField(&c, f);
  }
  return c;
}

absl::StatusOr<core::CodecOptions> MergeCodec(const core::CodecOptions& base,
                                              const v1::CodecSettings& s, absl::string_view field) {
  const std::string prefix = absl::StrCat(field, ".");
  core::CodecOptions c = base;
  for (const core::CodecField& f : core::CodecFields()) {
    if (!s.GetReflection()->HasField(s, WireField(f))) continue;
    ASSIGN_OR_RETURN(const double v, GetWire(f, s, prefix));
    // Checked even where the codec would not use it (side_bits at rank 0, value_budget under
    // the uniform policy): a value no codec accepts is a client error either way.
    RETURN_IF_ERROR(core::CheckCodecField(f, v, c.head_dim, prefix));
    core::SetCodecField(f, v, &c);
  }
  absl::Status st = c.Validate();
  if (!st.ok()) return absl::InvalidArgumentError(absl::StrCat(field, ": ", st.message()));
  return c;
}

}  // namespace kvq::wire
