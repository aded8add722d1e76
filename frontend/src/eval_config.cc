#include "kvq/frontend/eval_config.h"

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "kvq/core/status.h"

namespace kvq::frontend {
namespace {

bool ParseSuffixInt(const std::string& s, const std::string& prefix, int* out) {
  if (s.size() <= prefix.size() || s.compare(0, prefix.size(), prefix) != 0) return false;
  return absl::SimpleAtoi(s.substr(prefix.size()), out);
}

}  // namespace

absl::StatusOr<EvalConfig> ParseEvalConfig(const std::string& name) {
  EvalConfig c;
  c.name = name;
  if (name == "dense") {
    c.dense = true;
    c.family = "dense";
    return c;
  }
  if (name == kCalibratedConfig) {
    return absl::InvalidArgumentError(
        "config 'calibrated' evaluates the codec that the basis folder's codec.json names "
        "(kvq-calibrate --bits writes it): give --basis DIR");
  }
  std::vector<std::string> parts = absl::StrSplit(name, '-');
  auto bad = [&](const std::string& why) {
    return absl::InvalidArgumentError(
        absl::StrCat("config '", name, "': ", why, " (see kvq-eval --help for the grammar)"));
  };
  if (parts.size() < 2) return bad("expected <family>-<target><bits>");
  c.family = parts[0];
  if (c.family != "kivi" && c.family != "headq") return bad("family must be kivi or headq");
  const std::string& tb = parts[1];
  int bits = 0;
  if (ParseSuffixInt(tb, "kv", &bits)) {
    c.keys_only = false;
  } else if (ParseSuffixInt(tb, "k", &bits)) {
    c.keys_only = true;
  } else {
    return bad("target must be k<bits> or kv<bits>");
  }
  core::CodecOptions& o = c.codec;
  o.head_dim = 64;
  o.key_bits = bits;
  o.value_bits = bits;
  o.rank = c.family == "headq" ? 4 : 0;
  o.key_group = 32;
  o.value_group = 32;
  o.window = 0;
  bool a2 = false, g_set = false, vg_set = false;
  int value_bits = bits;  // v<N>: values at other bits than keys
  for (size_t i = 2; i < parts.size(); ++i) {
    const std::string& p = parts[i];
    int v = 0;
    if (p == "a2") {
      a2 = true;
    } else if (p == "probe") {
      c.probe = true;
    } else if (p == "adapt") {
      c.adaptive_rank = true;
    } else if (p == "hadapt") {
      c.head_adaptive_rank = true;
    } else if (p == "fused") {
      c.fused = true;
    } else if (p == "random") {
      c.basis = BasisKind::kRandom;
    } else if (p == "wrongsign") {
      c.wrong_sign = true;
    } else if (p == "centred") {
      c.basis = BasisKind::kCentred;
    } else if (p == "oracle") {
      c.basis = BasisKind::kOracle;
    } else if (p == "mr") {
      o.metric_rounding = true;
    } else if (p == "vmr") {
      if (c.keys_only) return bad("vmr rounds values; use a kv target");
      c.value_metric_rounding = true;
    } else if (p == "pre") {
      c.levers.keys_before_rope = true;
    } else if (p == "nuq" || p == "nuqk") {
      c.levers.nuq_keys = true;
      c.levers.nuq_values = p == "nuq" && !c.keys_only;
    } else if (p == "nuqv") {
      if (c.keys_only) return bad("nuqv puts values on code books; use a kv target");
      c.levers.nuq_values = true;
    } else if (ParseSuffixInt(p, "spk", &v)) {
      c.levers.key_outliers_permille = v;
    } else if (ParseSuffixInt(p, "spv", &v)) {
      if (c.keys_only) return bad("spv trims values; use a kv target");
      c.levers.value_outliers_permille = v;
    } else if (ParseSuffixInt(p, "sk", &v)) {
      o.sparse_keys = v;  // the codec's dense-and-sparse keys (Validate checks the range)
    } else if (ParseSuffixInt(p, "sv", &v)) {
      if (c.keys_only) return bad("sv<N> keeps value elements exact; use a kv target");
      o.sparse_values = v;
    } else if (p == "obl") {
      c.basis = BasisKind::kOblique;
    } else if (p == "resw") {
      c.basis = BasisKind::kResidualWeighted;
    } else if (p == "rot" || p == "rotk" || p == "rotv") {
      if (p != "rotv") o.rotate_keys = true;
      if (p != "rotk") o.rotate_values = true;
    } else if (ParseSuffixInt(p, "sink", &v)) {
      if (v < 1 || v > core::kMaxFp16Sinks)
        return bad(absl::StrCat("sink<N> needs N in 1..", core::kMaxFp16Sinks));
      o.fp16_sinks = v;
    } else if (ParseSuffixInt(p, "vg", &v)) {
      o.value_group = v;
      vg_set = true;
    } else if (ParseSuffixInt(p, "v", &v)) {
      if (c.keys_only) return bad("v<bits> sets the value bits; use a kv target");
      value_bits = v;
    } else if (ParseSuffixInt(p, "r", &v)) {
      if (c.family != "headq") return bad("rank is for headq only");
      o.rank = v;
    } else if (ParseSuffixInt(p, "g", &v)) {
      o.key_group = v;
      g_set = true;
    } else if (ParseSuffixInt(p, "w", &v)) {
      o.window = v;
    } else if (ParseSuffixInt(p, "s", &v)) {
      o.side_bits = v;
    } else {
      return bad(absl::StrCat("unknown option '", p, "'"));
    }
  }
  if (a2) {
    if (c.keys_only) return bad("a2 is a value policy; use a kv target");
    o.value_policy = core::ValuePolicy::kA2;
    o.value_budget = static_cast<float>(value_bits);
    if (value_bits > 4) return bad("a2 needs value bits <= 4");
    if (c.family == "headq") {
      if (!g_set) o.key_group = 128;
      (void)vg_set;  // value group stays 32 unless given
    }
  }
  if (!a2) o.value_bits = value_bits;
  if (c.probe && !a2) return bad("probe needs the a2 value policy");
  if (c.adaptive_rank && c.head_adaptive_rank) return bad("adapt or hadapt, not both");

  if (c.family == "kivi" &&
      (c.basis != BasisKind::kQuery || c.wrong_sign || c.adaptive_rank || c.head_adaptive_rank)) {
    return bad("basis controls apply to headq only");
  }
  if (c.levers.nuq_values && c.value_metric_rounding)
    return bad("nuq values: vmr chooses among uniform codes (not with vmr)");
  if (c.keys_only) o.value_bits = 8;  // unused: values are read dense
  absl::Status s = o.Validate();
  if (!s.ok()) return bad(std::string(s.message()));
  s = CheckLevers(c.levers, o);
  if (!s.ok()) return bad(std::string(s.message()));
  return c;
}

absl::StatusOr<EvalConfig> EvalConfigFromCodec(const std::string& name,
                                               const core::CodecOptions& codec) {
  absl::Status s = codec.Validate();
  if (!s.ok())
    return absl::InvalidArgumentError(absl::StrCat("config '", name, "': ", s.message()));
  EvalConfig c;
  c.name = name;
  c.codec = codec;
  c.family = codec.rank > 0 ? "headq" : "kivi";
  return c;
}

bool NamesCalibratedConfig(const std::string& comma_list) {
  for (absl::string_view n : absl::StrSplit(comma_list, ',', absl::SkipEmpty())) {
    if (n == kCalibratedConfig) return true;
  }
  return false;
}

absl::StatusOr<std::vector<EvalConfig>> ParseEvalConfigList(const std::string& comma_list,
                                                            const core::CodecOptions* calibrated) {
  std::vector<EvalConfig> out;
  for (absl::string_view n : absl::StrSplit(comma_list, ',', absl::SkipEmpty())) {
    if (n == kCalibratedConfig && calibrated) {
      ASSIGN_OR_RETURN(EvalConfig c, EvalConfigFromCodec(kCalibratedConfig, *calibrated));
      out.push_back(std::move(c));
      continue;
    }
    ASSIGN_OR_RETURN(EvalConfig c, ParseEvalConfig(std::string(n)));
    out.push_back(std::move(c));
  }
  if (out.empty()) return absl::InvalidArgumentError("no configurations given");
  return out;
}

}  // namespace kvq::frontend
