// The codec's field table (codec_schema.h) and the accessors derived from it.
#include "kvq/core/codec_schema.h"

#include <array>

#include "absl/strings/str_cat.h"

namespace kvq::core {
namespace {

constexpr std::array<int, 4> kKeyBits = {2, 3, 4, 8};
constexpr std::array<int, 3> kKeyGroups = {32, 64, 128};
constexpr std::array<int, 2> kSideBits = {4, 8};
constexpr std::array<int, 5> kValueBits = {1, 2, 3, 4, 8};
static_assert(kMaxFp16Sinks == 16, "fp16_sinks' limit text names 16");

CodecField Int(absl::string_view name, int number, int CodecOptions::*m, double min, double max,
               absl::string_view limit) {
  CodecField f{name, number, CodecFieldType::kInt};
  f.int_member = m;
  f.min = min;
  f.max = max;
  f.limit = limit;
  return f;
}
CodecField OneOf(absl::string_view name, int number, int CodecOptions::*m,
                 std::span<const int> allowed, absl::string_view limit) {
  CodecField f{name, number, CodecFieldType::kInt};
  f.int_member = m;
  f.allowed = allowed;
  f.limit = limit;
  return f;
}
CodecField Switch(absl::string_view name, int number, bool CodecOptions::*m) {
  CodecField f{name, number, CodecFieldType::kBool};
  f.bool_member = m;
  return f;
}

std::array<CodecField, 16> MakeFields() {
  using O = CodecOptions;
  CodecField rank = Int("rank", 3, &O::rank, 0, 0, "must be in [0, head_dim]");
  rank.max_is_head_dim = true;
  CodecField side_bits = OneOf("side_bits", 4, &O::side_bits, kSideBits, "must be 4 or 8");
  side_bits.applies = [](const O& o) { return o.rank > 0; };
  CodecField value_group = Int("value_group", 6, &O::value_group, 1, 0, "must be in [1, head_dim]");
  value_group.max_is_head_dim = true;
  CodecField policy{"value_policy", 7, CodecFieldType::kValuePolicy};
  CodecField budget{"value_budget", 8, CodecFieldType::kFloat};
  budget.float_member = &O::value_budget;
  budget.min = 1.0;
  budget.max = 4.0;
  budget.limit = "must be in [1, 4]";
  budget.applies = [](const O& o) { return o.value_policy == ValuePolicy::kA2; };
  CodecField sparse_keys =
      Int("sparse_keys", 15, &O::sparse_keys, 0, 100, "must be in [0, 100] per mille");
  CodecField sparse_values =
      Int("sparse_values", 16, &O::sparse_values, 0, 100, "must be in [0, 100] per mille");
  sparse_keys.json_only_when_set = sparse_values.json_only_when_set = true;
  return {
      OneOf("key_bits", 1, &O::key_bits, kKeyBits, "must be 2, 3, 4 or 8"),
      OneOf("key_group", 2, &O::key_group, kKeyGroups, "must be 32, 64 or 128"),
      rank,
      side_bits,
      OneOf("value_bits", 5, &O::value_bits, kValueBits, "must be 1, 2, 3, 4 or 8"),
      value_group,
      policy,
      budget,
      Int("sink_tokens", 9, &O::sink_tokens, 0, 1024, "must be in [0, 1024]"),
      Int("window", 10, &O::window, 0, 65536, "must be in [0, 65536]"),
      Switch("rotate_keys", 11, &O::rotate_keys),
      Switch("rotate_values", 12, &O::rotate_values),
      Switch("metric_rounding", 13, &O::metric_rounding),
      Int("fp16_sinks", 14, &O::fp16_sinks, 0, kMaxFp16Sinks, "must be in [0, 16]"),
      sparse_keys,
      sparse_values,
  };
}

}  // namespace

std::span<const CodecField> CodecFields() {
  static const std::array<CodecField, 16> fields = MakeFields();
  return fields;
}

const CodecField* FindCodecField(absl::string_view name) {
  for (const CodecField& f : CodecFields())
    if (f.name == name) return &f;
  return nullptr;
}

double GetCodecField(const CodecField& f, const CodecOptions& o) {
  switch (f.type) {
    case CodecFieldType::kInt:
      return o.*f.int_member;
    case CodecFieldType::kFloat:
      return o.*f.float_member;
    case CodecFieldType::kBool:
      return o.*f.bool_member ? 1 : 0;
    case CodecFieldType::kValuePolicy:
      return o.value_policy == ValuePolicy::kA2 ? 1 : 0;
  }
  return 0;
}

void SetCodecField(const CodecField& f, double v, CodecOptions* o) {
  switch (f.type) {
    case CodecFieldType::kInt:
      o->*f.int_member = static_cast<int>(v);
      return;
    case CodecFieldType::kFloat:
      o->*f.float_member = static_cast<float>(v);
      return;
    case CodecFieldType::kBool:
      o->*f.bool_member = v != 0;
      return;
    case CodecFieldType::kValuePolicy:
      o->value_policy = v != 0 ? ValuePolicy::kA2 : ValuePolicy::kUniform;
      return;
  }
}

absl::string_view ValuePolicyName(ValuePolicy p) {
  return p == ValuePolicy::kA2 ? "a2" : "uniform";
}

bool ParseValuePolicy(absl::string_view name, ValuePolicy* p) {
  if (name == "uniform") *p = ValuePolicy::kUniform;
  if (name == "a2") *p = ValuePolicy::kA2;
  return name == "uniform" || name == "a2";
}

absl::Status CheckCodecField(const CodecField& f, double v, int head_dim,
                             absl::string_view prefix) {
  bool ok = true;
  if (!f.allowed.empty()) {
    ok = false;
    for (int a : f.allowed) ok |= v == a;
  } else if (f.type == CodecFieldType::kInt || f.type == CodecFieldType::kFloat) {
    const double max = f.max_is_head_dim ? head_dim : f.max;
    ok = v >= f.min && v <= max;  // false for NaN
  }
  if (ok) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(prefix, f.name, " = ", v, ": ", f.limit));
}

}  // namespace kvq::core
