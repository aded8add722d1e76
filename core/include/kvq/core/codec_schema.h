// The codec's settings, described once: every field a model's codec.json and the wire's
// CodecSettings carry, with its name (the JSON key and the proto field's name), its wire field
// number, its type, its range and when it applies. CodecOptions::Validate, codec.json's reader
// and writer (codec_json.h) and the wire mapping (kvq/wire/codec_settings.h) are derived from
// this table; tests hold the proto descriptor and the Python client's CodecSettings to it, so a
// field added here cannot be forgotten elsewhere.
//
// Not in the table: head_dim (the model's shape, not a setting).
#pragma once

#include <span>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "kvq/core/codec.h"

namespace kvq::core {

enum class CodecFieldType { kInt, kFloat, kBool, kValuePolicy };

struct CodecField {
  absl::string_view name;  // codec.json's key, CodecSettings' field name
  int wire_number;         // CodecSettings' field number
  CodecFieldType type;
  // The member (the one matching `type`; the others null).
  int CodecOptions::*int_member = nullptr;
  float CodecOptions::*float_member = nullptr;
  bool CodecOptions::*bool_member = nullptr;
  // The allowed values of an int field: one of `allowed` (when any), else [min, max] where
  // max_is_head_dim takes max from the codec's head_dim. Floats: [min, max].
  std::span<const int> allowed = {};
  double min = 0, max = 0;
  bool max_is_head_dim = false;
  // What an error says after "must be" (e.g. "2, 3, 4 or 8", "in [0, 1024]").
  absl::string_view limit = {};
  // Whether the field constrains the codec (others are not checked by Validate, whatever their
  // value: side_bits at rank 0, value_budget under the uniform policy).
  bool (*applies)(const CodecOptions&) = nullptr;
  // codec.json: written only when it differs from the default (fields added after files were
  // written, so that those files and what this build writes for their codecs stay the same).
  bool json_only_when_set = false;
};

// Every field, in wire-number order.
std::span<const CodecField> CodecFields();
// The field of that name, or null.
const CodecField* FindCodecField(absl::string_view name);

// The field's value in `o` as a double (bools 0 / 1, the policy 0 uniform / 1 a2), and set from
// one (no check: see CheckCodecField).
double GetCodecField(const CodecField& f, const CodecOptions& o);
void SetCodecField(const CodecField& f, double v, CodecOptions* o);
// "uniform" / "a2" and back (false: neither).
absl::string_view ValuePolicyName(ValuePolicy p);
bool ParseValuePolicy(absl::string_view name, ValuePolicy* p);

// Whether value `v` is in the field's range for a codec of `head_dim`: OK, or INVALID_ARGUMENT
// "<prefix><name> = <v>: must be <limit>".
absl::Status CheckCodecField(const CodecField& f, double v, int head_dim, absl::string_view prefix);

}  // namespace kvq::core
