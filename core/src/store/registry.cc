// The model registry: a folder of basis entries, loaded at start and extended atomically.
#include "kvq/core/registry.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "kvq/core/codec_json.h"
#include "kvq/core/json_fields.h"
#include "kvq/core/status.h"
#include "nlohmann/json.hpp"

namespace kvq::core {
namespace fs = std::filesystem;
namespace {

bool ValidModelName(const std::string& s) {
  if (s.empty() || s.size() > 128 || s[0] == '.') return false;
  for (char c : s) {
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '_' || c == '-')) {
      return false;
    }
  }
  return true;
}

// A string field of a manifest: at most `max` bytes of printable ASCII (these are
// identifiers, written into JSON files and logs).
absl::Status CheckIdentifier(absl::string_view field, const std::string& v, size_t max) {
  bool printable = true;
  for (char ch : v) printable &= ch >= 0x20 && ch <= 0x7e;
  if (v.size() > max || !printable) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, " must be at most ", max, " bytes of printable ASCII (got ", v.size(), " bytes)"));
  }
  return absl::OkStatus();
}

// Every file of a freshly written entry folder, then the folder itself.
absl::Status SyncEntry(Env& env, const fs::path& dir) {
  std::error_code ec;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    if (it->is_regular_file(ec)) RETURN_IF_ERROR(env.Sync(it->path().string()));
  }
  if (ec) {
    return absl::InternalError(absl::StrCat("cannot list ", dir.string(), ": ", ec.message()));
  }
  return env.Sync(dir.string());
}

// The first field in which two entries of one (model, version) differ ("" when none).
// calibration_text is descriptive only (and not on the wire), so it is not compared.
std::string FirstDifference(const ModelEntry& old, const ModelEntry& now) {
  const BasisManifest &a = old.manifest, &b = now.manifest;
  if (old.has_basis != now.has_basis) return "basis (present or not)";
  if (a.layers != b.layers || a.kv_heads != b.kv_heads || a.q_heads != b.q_heads ||
      a.head_dim != b.head_dim || a.rank != b.rank) {
    return "shape (layers, kv_heads, q_heads, head_dim or basis_rank)";
  }
  if (a.fingerprint != b.fingerprint) return "basis (fingerprint)";
  if (CodecToJson(old.codec) != CodecToJson(now.codec)) return "codec";
  if (a.rope_layout != b.rope_layout) return "rope_layout";
  if (a.channel_order != b.channel_order) return "channel_order";
  if (a.kind != b.kind) return "kind";
  if (a.calibration_tokens != b.calibration_tokens) return "calibration_tokens";
  return "";
}

// The folders directly in `dir`, sorted, without those starting with '.' (the temporary
// folders of registrations in progress or interrupted).
absl::StatusOr<std::vector<fs::path>> Subfolders(const fs::path& dir) {
  std::vector<fs::path> out;
  std::error_code ec;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    std::error_code type_ec;
    if (!name.empty() && name[0] != '.' && it->is_directory(type_ec)) out.push_back(it->path());
  }
  if (ec) {
    return absl::InternalError(absl::StrCat("cannot list ", dir.string(), ": ", ec.message()));
  }
  std::sort(out.begin(), out.end());
  return out;
}

}  // namespace

CodecOptions Registry::DefaultCodec(const BasisManifest& m, bool has_basis) {
  // headq-kv3-g128-s4-v2 (3.27 bits per element at head_dim 64): on both evaluation models'
  // quality frontiers (docs/RESULTS.md), and it needs neither the basis's query moments nor
  // a rotation, so that it serves any registered basis.
  CodecOptions c;
  c.head_dim = m.head_dim;
  c.key_bits = 3;
  c.key_group = 128;
  c.rank = has_basis ? std::min(4, m.rank) : 0;
  c.side_bits = 4;
  c.value_bits = 2;
  c.value_group = std::min(32, m.head_dim);
  c.window = 0;
  return c;
}

Registry::Registry(std::string dir, Env* env)
    : dir_(std::move(dir)), env_(env ? env : Env::Default()) {}

absl::Status Registry::ValidateEntry(const ModelEntry& e) {
  const BasisManifest& m = e.manifest;
  if (!ValidModelName(m.model)) {
    return absl::InvalidArgumentError(
        absl::StrCat("model name '", Excerpt(m.model), "' (", m.model.size(),
                     " bytes) must be 1..128 characters of [A-Za-z0-9._-]"));
  }
  if (m.version < 1 || m.version > 1000000) {
    return absl::InvalidArgumentError(
        absl::StrCat("version ", m.version, " must be in 1..1000000"));
  }
  if (m.layers < 1 || m.layers > 1024) {
    return absl::InvalidArgumentError(absl::StrCat("layers ", m.layers, " must be in 1..1024"));
  }
  if (m.kv_heads < 1 || m.kv_heads > 256) {
    return absl::InvalidArgumentError(absl::StrCat("kv_heads ", m.kv_heads, " must be in 1..256"));
  }
  if (m.q_heads < m.kv_heads || m.q_heads % m.kv_heads != 0 || m.q_heads > 4096) {
    return absl::InvalidArgumentError(absl::StrCat(
        "q_heads ", m.q_heads, " must be a multiple of kv_heads ", m.kv_heads, " (<= 4096)"));
  }
  if (m.head_dim < 1 || m.head_dim > 512) {
    return absl::InvalidArgumentError(absl::StrCat("head_dim ", m.head_dim, " must be in 1..512"));
  }
  if (m.rope_layout != "adjacent_pairs" && m.rope_layout != "halves") {
    return absl::InvalidArgumentError(absl::StrCat(
        "rope_layout must be 'adjacent_pairs' or 'halves' (got '", Excerpt(m.rope_layout), "')"));
  }
  RETURN_IF_ERROR(CheckIdentifier("channel_order", m.channel_order, kMaxManifestString));
  RETURN_IF_ERROR(CheckIdentifier("kind", m.kind, kMaxManifestString));
  if (m.calibration_tokens < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("calibration_tokens ", m.calibration_tokens, " must be >= 0"));
  }
  if (m.calibration_text.size() > kMaxCalibrationText) {
    return absl::InvalidArgumentError(absl::StrCat("calibration_text holds ",
                                                   m.calibration_text.size(), " bytes; at most ",
                                                   kMaxCalibrationText));
  }
  try {  // what the manifest writer will meet: it refuses strings that are not UTF-8
    (void)nlohmann::json(m.calibration_text).dump();
  } catch (const nlohmann::json::exception&) {
    return absl::InvalidArgumentError("calibration_text must be UTF-8");
  }
  if (m.rank < 0 || m.rank > m.head_dim || (e.has_basis && m.rank < 1) ||
      (!e.has_basis && m.rank != 0)) {
    return absl::InvalidArgumentError(absl::StrCat("basis_rank ", m.rank,
                                                   " must be in 1..head_dim (", m.head_dim,
                                                   ") with a basis and 0 without"));
  }
  if (e.has_basis) {
    RETURN_IF_ERROR(CheckBasisTensors(m, e.basis));
  } else if (e.basis.oblique() || !e.basis.query_moment.empty() || !e.basis.value_metric.empty()) {
    return absl::InvalidArgumentError(
        "an encode basis, query moment or value metric needs a basis");
  }
  CodecOptions c = e.codec;
  if (c.head_dim != m.head_dim) {
    return absl::InvalidArgumentError(
        absl::StrCat("codec head_dim ", c.head_dim, " differs from the model's ", m.head_dim));
  }
  if (c.rank > m.rank) {
    return absl::InvalidArgumentError(
        absl::StrCat("codec rank ", c.rank, " exceeds the basis rank ", m.rank));
  }
  RETURN_IF_ERROR(c.Validate());
  if (c.metric_rounding && e.basis.query_moment.empty()) {
    return absl::InvalidArgumentError(
        "codec metric_rounding needs the basis's query moment (kvq-calibrate --query-moment)");
  }
  return absl::OkStatus();
}

absl::StatusOr<ModelEntry> Registry::LoadEntry(const std::string& path) const {
  ModelEntry e;
  const fs::path p(path);
  std::error_code ec;
  if (fs::exists(p / "manifest.json", ec)) {
    ASSIGN_OR_RETURN(e.basis, ReadBasis(path, env_));
    e.manifest = e.basis.manifest;
    e.has_basis = true;
  } else if (fs::exists(p / "model.json", ec)) {
    ASSIGN_OR_RETURN(const nlohmann::json j, ReadJsonObject((p / "model.json").string(), env_));
    const JsonFields f(j, "model.json");
    BasisManifest& m = e.manifest;
    m.model.clear();
    m.version = 0;
    RETURN_IF_ERROR(ReadModelShape(f, &m));
    m.rank = 0;
    m.kind = "none";
    e.has_basis = false;
  } else {
    return absl::NotFoundError("neither manifest.json nor model.json");
  }
  e.codec = DefaultCodec(e.manifest, e.has_basis);
  if (fs::exists(p / "codec.json", ec)) {
    ASSIGN_OR_RETURN(const nlohmann::json j, ReadJsonObject((p / "codec.json").string(), env_));
    RETURN_IF_ERROR(CodecFromJson(j, "codec.json", &e.codec));
  }
  RETURN_IF_ERROR(ValidateEntry(e));
  return e;
}

absl::Status Registry::LoadAll(std::vector<std::string>* loaded,
                               std::vector<std::string>* skipped) {
  if (dir_.empty()) return absl::OkStatus();
  std::error_code ec;
  fs::create_directories(dir_, ec);
  if (ec) return absl::InternalError(absl::StrCat("cannot create ", dir_, ": ", ec.message()));
  // Folder names are whatever bytes the file system holds: escaped (absl::CHexEscape; plain
  // paths come out unchanged), so that a newline or control byte in one cannot split or forge
  // the server's log line.
  auto skip = [skipped](const fs::path& p, absl::string_view why) {
    if (skipped) skipped->push_back(absl::StrCat(absl::CHexEscape(p.string()), ": ", why));
  };
  ASSIGN_OR_RETURN(const std::vector<fs::path> models, Subfolders(dir_));
  // Only <dir>/<model>/v<version>/ is an entry, and it must be the one its manifest names:
  // a folder elsewhere, or one whose manifest names another model or version, would
  // otherwise stand in for (or shadow) the real entry.
  for (const fs::path& model_dir : models) {
    const std::string model = model_dir.filename().string();
    if (!ValidModelName(model)) {
      skip(model_dir, "not a model folder (names are 1..128 characters of [A-Za-z0-9._-])");
      continue;
    }
    absl::StatusOr<std::vector<fs::path>> versions = Subfolders(model_dir);
    if (!versions.ok()) {
      skip(model_dir, versions.status().message());
      continue;
    }
    for (const fs::path& c : *versions) {
      const std::string folder = c.filename().string();
      int version = 0;
      if (folder.size() < 2 || folder[0] != 'v' ||
          !absl::SimpleAtoi(absl::string_view(folder).substr(1), &version) ||
          folder != absl::StrCat("v", version)) {
        skip(c, "not a version folder (v<version>, e.g. v1)");
        continue;
      }
      absl::StatusOr<ModelEntry> e = LoadEntry(c.string());
      if (!e.ok()) {
        skip(c, e.status().message());
        continue;
      }
      if (e->manifest.model != model || e->manifest.version != version) {
        skip(c, absl::StrCat("its manifest names model '", e->manifest.model, "' version ",
                             e->manifest.version, "; an entry must sit in <registry>/",
                             e->manifest.model, "/v", e->manifest.version, "/"));
        continue;
      }
      MutexLock l(&mu_);
      if (loaded) loaded->push_back(absl::StrCat(model, " v", version));
      models_[model][version] = std::make_shared<const ModelEntry>(*std::move(e));
    }
  }
  return absl::OkStatus();
}

absl::Status Registry::Persist(const ModelEntry& e) const {
  if (dir_.empty()) return absl::OkStatus();
  static std::atomic<int> counter{0};
  const fs::path final_dir =
      fs::path(dir_) / e.manifest.model / absl::StrCat("v", e.manifest.version);
  const fs::path tmp =
      fs::path(dir_) / absl::StrCat(".tmp-", e.manifest.model, "-v", e.manifest.version, "-",
                                    getpid(), "-", counter.fetch_add(1));
  RETURN_IF_ERROR(env_->CreateDirs(tmp.string()));
  auto cleanup = [&] { (void)env_->RemoveAll(tmp.string()); };
  absl::Status st;
  if (e.has_basis) {
    ModelBasis b = e.basis;
    b.manifest = e.manifest;
    st = WriteBasis(tmp.string(), b, env_);
  } else {
    const BasisManifest& m = e.manifest;
    nlohmann::json j = {{"model", m.model},
                        {"version", m.version},
                        {"layers", m.layers},
                        {"kv_heads", m.kv_heads},
                        {"q_heads", m.q_heads},
                        {"head_dim", m.head_dim},
                        {"rope_layout", m.rope_layout},
                        {"channel_order", m.channel_order}};
    st = env_->WriteFile((tmp / "model.json").string(), j.dump(2));
  }
  if (st.ok()) st = env_->WriteFile((tmp / "codec.json").string(), CodecToJson(e.codec).dump(2));
  // Durable before it becomes visible: the files and the folder reach the disk, then the
  // rename, then the folders holding the old and the new name.
  if (st.ok()) st = SyncEntry(*env_, tmp);
  if (!st.ok()) {
    cleanup();
    return st;
  }
  // The model's folder, when this registration makes it, goes again on any failure below.
  std::error_code ec;
  const fs::path model_dir = final_dir.parent_path();
  const bool made_model_dir = !fs::exists(model_dir, ec);
  auto undo = [&] {
    cleanup();
    if (made_model_dir) (void)env_->RemoveAll(model_dir.string());
  };
  st = env_->CreateDirs(model_dir.string());
  if (!st.ok()) {
    undo();
    return st;
  }
  if (fs::exists(final_dir, ec)) {
    cleanup();
    return absl::AlreadyExistsError(
        absl::StrCat(final_dir.string(), " already exists on disk but was not loaded"));
  }
  st = env_->Rename(tmp.string(), final_dir.string());
  if (!st.ok()) {
    undo();
    return st;
  }
  // The rename is not known durable until the folders holding it are synced: on a failure
  // there the entry is taken back out, so that a failed registration leaves nothing behind
  // that the next start would load.
  st = env_->Sync(model_dir.string());
  if (st.ok()) st = env_->Sync(dir_);
  if (!st.ok()) {
    (void)env_->RemoveAll(final_dir.string());
    undo();
  }
  return st;
}

absl::StatusOr<std::shared_ptr<const ModelEntry>> Registry::Register(ModelEntry entry,
                                                                     bool* already) {
  if (already) *already = false;
  RETURN_IF_ERROR(ValidateEntry(entry));
  if (entry.has_basis) {
    entry.basis.manifest = entry.manifest;
    entry.manifest.fingerprint = BasisFingerprint(entry.basis);
    entry.basis.manifest.fingerprint = entry.manifest.fingerprint;
  } else {  // what model.json holds and LoadEntry reads back
    entry.manifest.fingerprint.clear();
    entry.manifest.kind = "none";
    entry.manifest.calibration_tokens = 0;
    entry.manifest.calibration_text.clear();
    entry.basis = ModelBasis{};
  }
  MutexLock l(&mu_);
  auto& versions = models_[entry.manifest.model];
  auto it = versions.find(entry.manifest.version);
  if (it != versions.end()) {
    const std::string diff = FirstDifference(*it->second, entry);
    if (!diff.empty()) {
      return absl::AlreadyExistsError(absl::StrCat(
          "model '", entry.manifest.model, "' version ", entry.manifest.version,
          " is already registered with a different ", diff, "; register a new version"));
    }
    if (already) *already = true;
    return it->second;
  }
  if (absl::Status st = Persist(entry); !st.ok()) {
    if (versions.empty()) models_.erase(entry.manifest.model);
    return st;
  }
  auto p = std::make_shared<const ModelEntry>(std::move(entry));
  versions[p->manifest.version] = p;
  return p;
}

absl::StatusOr<std::shared_ptr<const ModelEntry>> Registry::Get(const std::string& model,
                                                                int version) const {
  MutexLock l(&mu_);
  auto it = models_.find(model);
  if (it == models_.end() || it->second.empty()) {
    return absl::NotFoundError(absl::StrCat("model '", model, "' is not registered"));
  }
  if (version == 0) return it->second.rbegin()->second;
  auto v = it->second.find(version);
  if (v == it->second.end()) {
    return absl::NotFoundError(absl::StrCat("model '", model, "' has no version ", version,
                                            " (latest is ", it->second.rbegin()->first, ")"));
  }
  return v->second;
}

std::vector<std::shared_ptr<const ModelEntry>> Registry::List() const {
  MutexLock l(&mu_);
  std::vector<std::shared_ptr<const ModelEntry>> out;
  for (const auto& [name, versions] : models_) {
    for (const auto& [v, e] : versions) out.push_back(e);
  }
  return out;
}

namespace {

// The first `rank` columns of one layer of a basis-shaped tensor (U, or an oblique pair's
// encode basis A: the leading columns of a pair are the lower-rank pair), [kv][d][rank];
// empty when the tensor is (no basis, not oblique) or rank is 0.
std::vector<float> LayerBasis(const ModelEntry& m, const std::vector<float>& tensor, int layer,
                              int rank) {
  if (rank == 0 || !m.has_basis || tensor.empty()) return {};
  const int kv = m.manifest.kv_heads, d = m.manifest.head_dim, R = m.manifest.rank;
  std::vector<float> out(static_cast<size_t>(kv) * d * rank);
  for (int h = 0; h < kv; ++h) {
    const float* u = tensor.data() + m.basis.HeadOffset(layer, h);
    for (int i = 0; i < d; ++i) {
      for (int j = 0; j < rank; ++j) {
        out[(static_cast<size_t>(h) * d + i) * rank + j] = u[i * R + j];
      }
    }
  }
  return out;
}

}  // namespace

std::shared_ptr<const LayerCodecTables> MakeLayerCodecTables(const ModelEntry& model, int layer,
                                                             const CodecOptions& codec) {
  std::vector<float> basis = LayerBasis(model, model.basis.u, layer, codec.rank);
  std::vector<float> encode = LayerBasis(model, model.basis.encode, layer, codec.rank);
  const float* moment = model.basis.query_moment_head(layer, 0);
  return MakeLayerCodecTables(
      codec, model.manifest.kv_heads, basis.empty() ? nullptr : basis.data(),
      encode.empty() ? nullptr : encode.data(), codec.metric_rounding ? moment : nullptr);
}

}  // namespace kvq::core
