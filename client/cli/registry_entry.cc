#include "client/cli/registry_entry.h"

#include <filesystem>
#include <fstream>

#include "absl/strings/str_cat.h"
#include "kvq/core/basis.h"
#include "kvq/core/codec_json.h"
#include "kvq/core/json_fields.h"
#include "kvq/core/status.h"
#include "kvq/core/store.h"
#include "kvq/wire/codec_settings.h"
#include "kvq/wire/model.h"
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
  core::BasisManifest manifest;  // the shape the entry's default codec follows
  bool has_basis = false;
  if (fs::exists(p / "manifest.json")) {
    auto basis = core::ReadBasis(dir);
    if (!basis.ok()) return basis.status();
    wire::BasisToWire(*basis, &req);
    manifest = basis->manifest;
    has_basis = true;
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
    wire::ModelShapeToWire(m, info);  // empty strings stay unset (proto3)
    info->set_basis_rank(0);
    manifest = m;
  } else {
    return absl::NotFoundError(
        absl::StrCat("'", dir, "' is not a registry entry: neither manifest.json nor model.json"));
  }
  if (fs::exists(p / "codec.json")) {
    // Read as the registry loader reads it (over the entry's default codec), sent with only
    // the fields the file names: the others stay the server's defaults.
    auto j = ReadJson(p / "codec.json");
    if (!j.ok()) return j.status();
    core::CodecOptions c = core::Registry::DefaultCodec(manifest, has_basis);
    RETURN_IF_ERROR(core::CodecFromJson(*j, (p / "codec.json").string(), &c));
    absl::StatusOr<v1::CodecSettings> wire = wire::CodecToWire(c, *j);
    if (!wire.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat((p / "codec.json").string(), ": ", wire.status().message()));
    }
    *info->mutable_codec() = *std::move(wire);
  }
  return req;
}

}  // namespace kvq::client
