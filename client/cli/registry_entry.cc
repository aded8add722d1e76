#include "client/cli/registry_entry.h"

#include <filesystem>
#include <fstream>

#include "absl/strings/str_cat.h"
#include "kvq/client/basis_request.h"
#include "kvq/core/basis.h"
#include "kvq/core/json_fields.h"
#include "kvq/core/status.h"
#include "nlohmann/json.hpp"

namespace kvq::client {
namespace {

absl::StatusOr<nlohmann::json> ReadJson(const std::filesystem::path& p) {
  std::ifstream f(p);
  if (!f) return absl::NotFoundError(absl::StrCat("cannot read ", p.string()));
  nlohmann::json j = nlohmann::json::parse(f, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(p.string(), " is not a JSON object"));
  }
  return j;
}

}  // namespace

absl::StatusOr<v1::RegisterBasisRequest> ReadRegistryEntry(const std::string& dir) {
  namespace fs = std::filesystem;
  const fs::path p(dir);
  v1::RegisterBasisRequest req;
  v1::ModelInfo* info = req.mutable_info();
  if (fs::exists(p / "manifest.json")) {
    auto basis = core::ReadBasis(dir);
    if (!basis.ok()) return basis.status();
    client::FillBasisRequest(*basis, &req);
  } else if (fs::exists(p / "model.json")) {
    auto j = ReadJson(p / "model.json");
    if (!j.ok()) return j.status();
    // Checked reads (the registry loader's): a mistyped field is an error naming it. Absent
    // fields stay unset in the request (0 / empty: the server's defaults).
    core::BasisManifest m;
    m.version = 0;
    m.rope_layout.clear();
    m.channel_order.clear();
    RETURN_IF_ERROR(core::ReadModelShape(core::JsonFields(*j, (p / "model.json").string()), &m));
    client::FillModelShape(m, info);  // empty strings stay unset (proto3)
    info->set_basis_rank(0);
  } else {
    return absl::NotFoundError(
        absl::StrCat("'", dir, "' is not a registry entry: neither manifest.json nor model.json"));
  }
  if (fs::exists(p / "codec.json")) {
    auto j = ReadJson(p / "codec.json");
    if (!j.ok()) return j.status();
    v1::CodecSettings* c = info->mutable_codec();
    const core::JsonFields f(*j, (p / "codec.json").string());
    int key_bits = 0, key_group = 0, side_bits = 0, value_bits = 0, value_group = 0;
    int sink_tokens = 0, rank = 0, window = 0;
    float value_budget = 0;
    std::string policy;
    RETURN_IF_ERROR(f.Int("key_bits", &key_bits));
    RETURN_IF_ERROR(f.Int("key_group", &key_group));
    RETURN_IF_ERROR(f.Int("rank", &rank));
    RETURN_IF_ERROR(f.Int("side_bits", &side_bits));
    RETURN_IF_ERROR(f.Int("value_bits", &value_bits));
    RETURN_IF_ERROR(f.Int("value_group", &value_group));
    RETURN_IF_ERROR(f.String("value_policy", &policy));
    RETURN_IF_ERROR(f.Float("value_budget", &value_budget));
    RETURN_IF_ERROR(f.Int("sink_tokens", &sink_tokens));
    RETURN_IF_ERROR(f.Int("window", &window));
    // In a request 0 means "the default"; -1 asks for a real 0 (rank, window).
    c->set_key_bits(key_bits);
    c->set_key_group(key_group);
    if (j->contains("rank")) c->set_rank(rank == 0 ? -1 : rank);
    c->set_side_bits(side_bits);
    c->set_value_bits(value_bits);
    c->set_value_group(value_group);
    if (!policy.empty()) {
      if (policy != "a2" && policy != "uniform") {
        return absl::InvalidArgumentError(absl::StrCat(
            (p / "codec.json").string(), ": value_policy \"", policy, "\": must be uniform or a2"));
      }
      c->set_value_policy(policy == "a2" ? v1::CodecSettings::VALUE_POLICY_A2
                                         : v1::CodecSettings::VALUE_POLICY_UNIFORM);
    }
    c->set_value_budget(value_budget);
    c->set_sink_tokens(sink_tokens);
    if (j->contains("window")) c->set_window(window == 0 ? -1 : window);
    // Switches: present true / false is on / off (1 / -1), absent the server's default.
    for (const auto& [key, set] :
         {std::pair{"rotate_keys", &v1::CodecSettings::set_rotate_keys},
          std::pair{"rotate_values", &v1::CodecSettings::set_rotate_values},
          std::pair{"metric_rounding", &v1::CodecSettings::set_metric_rounding}}) {
      bool on = false;
      RETURN_IF_ERROR(f.Bool(key, &on));
      if (j->contains(key)) (c->*set)(on ? 1 : -1);
    }
  }
  return req;
}

}  // namespace kvq::client
