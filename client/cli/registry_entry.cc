#include "client/cli/registry_entry.h"

#include <filesystem>
#include <fstream>

#include "absl/strings/str_cat.h"
#include "kvq/client/basis_request.h"
#include "kvq/core/basis.h"
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
    info->set_model(j->value("model", ""));
    info->set_version(j->value("version", 0));
    info->set_layers(j->value("layers", 0));
    info->set_kv_heads(j->value("kv_heads", 0));
    info->set_q_heads(j->value("q_heads", 0));
    info->set_head_dim(j->value("head_dim", 0));
    info->set_basis_rank(0);
    if (j->contains("rope_layout")) info->set_rope_layout(j->value("rope_layout", ""));
    if (j->contains("channel_order")) info->set_channel_order(j->value("channel_order", ""));
  } else {
    return absl::NotFoundError(
        absl::StrCat("'", dir, "' is not a registry entry: neither manifest.json nor model.json"));
  }
  if (fs::exists(p / "codec.json")) {
    auto j = ReadJson(p / "codec.json");
    if (!j.ok()) return j.status();
    v1::CodecSettings* c = info->mutable_codec();
    // In a request 0 means "the default"; -1 asks for a real 0 (rank, window).
    c->set_key_bits(j->value("key_bits", 0));
    c->set_key_group(j->value("key_group", 0));
    if (j->contains("rank")) c->set_rank(j->value("rank", 0) == 0 ? -1 : j->value("rank", 0));
    c->set_side_bits(j->value("side_bits", 0));
    c->set_value_bits(j->value("value_bits", 0));
    c->set_value_group(j->value("value_group", 0));
    if (j->contains("value_policy")) {
      c->set_value_policy(j->value("value_policy", std::string()) == "a2"
                              ? v1::CodecSettings::VALUE_POLICY_A2
                              : v1::CodecSettings::VALUE_POLICY_UNIFORM);
    }
    c->set_value_budget(j->value("value_budget", 0.0f));
    c->set_sink_tokens(j->value("sink_tokens", 0));
    if (j->contains("window")) {
      c->set_window(j->value("window", 0) == 0 ? -1 : j->value("window", 0));
    }
  }
  return req;
}

}  // namespace kvq::client
