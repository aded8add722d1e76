// The model registry: the registered (model, version) entries, loaded from and persisted to
// a folder (registry.cc), which sequences are pinned to. No gRPC here.
#pragma once

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kvq/core/basis.h"
#include "kvq/core/cache.h"
#include "kvq/core/codec.h"
#include "kvq/core/env.h"
#include "kvq/core/mutex.h"

namespace kvq::core {

// One registered (model, version).
struct ModelEntry {
  // Shape and identity; manifest.rank is the basis rank (0: no basis).
  BasisManifest manifest;
  bool has_basis = false;
  ModelBasis basis;  // empty when !has_basis
  // Defaults for new sequences: key_bits 2, G 32, rank min(4, basis rank) (0 without
  // basis: KIVI-like base only), side_bits 8, value_bits 2, value_group min(32, head_dim),
  // window 0, unless the entry's codec.json says otherwise.
  CodecOptions codec;
};

// The model registry: a folder of entries, `<dir>/<model>/v<version>/` each holding
// manifest.json + basis.safetensors (what kvq-calibrate writes, read with ReadBasis) or,
// for a model without basis, model.json; an optional codec.json holds codec defaults.
// Every version stays loaded (sequences keep theirs alive through shared_ptr anyway).
class Registry {
 public:
  // dir "" keeps entries in memory only. env: the file system it writes and reads (null:
  // Env::Default(); tests pass one that fails on purpose).
  explicit Registry(std::string dir, Env* env = nullptr);

  // Loads every entry under dir: the folders <dir>/<model>/v<version>/ whose manifest names
  // that model and version. Anything else (a broken, mistyped or misplaced entry) is skipped
  // and reported in `skipped` as "path: reason" (the path C-escaped: absl::CHexEscape);
  // folders starting with '.' are ignored.
  // Creates dir when it does not exist; fails only when dir cannot be listed.
  absl::Status LoadAll(std::vector<std::string>* loaded, std::vector<std::string>* skipped);

  // Adds an entry and persists it (written into a temporary folder, then renamed into
  // place, so a crash never leaves half an entry). An identical existing entry is OK
  // (*already_registered = true); the same (model, version) with other contents (shape,
  // basis, codec, rope_layout, channel_order, kind, calibration_tokens) is ALREADY_EXISTS
  // naming the first difference. `entry.manifest.fingerprint` is recomputed; an entry
  // without basis is stored as loading would read it back (kind "none", no calibration).
  absl::StatusOr<std::shared_ptr<const ModelEntry>> Register(ModelEntry entry,
                                                             bool* already_registered);

  // version 0: the latest. NOT_FOUND names what is missing.
  absl::StatusOr<std::shared_ptr<const ModelEntry>> Get(const std::string& model,
                                                        int version) const;
  std::vector<std::shared_ptr<const ModelEntry>> List() const;
  const std::string& dir() const { return dir_; }

  // Checks a model entry's shape, string fields and basis: everything loading it back from
  // the registry folder checks, so Register never accepts an entry the next start cannot
  // load (used by Register and LoadAll).
  static absl::Status ValidateEntry(const ModelEntry& e);
  // Longest kind and channel_order (printable ASCII), and calibration_text (a file path).
  static constexpr size_t kMaxManifestString = 256;
  static constexpr size_t kMaxCalibrationText = 4096;
  // The default codec settings of a model shape (see ModelEntry::codec): 3-bit keys in
  // groups of 128 with the rank-4 4-bit side code, 2-bit values in groups of 32 channels
  // (kvq-eval's headq-kv3-g128-s4-v2; kivi-kv3-g128-v2 without a basis).
  static CodecOptions DefaultCodec(const BasisManifest& m, bool has_basis);

 private:
  absl::Status Persist(const ModelEntry& e) const;
  absl::StatusOr<ModelEntry> LoadEntry(const std::string& path) const;

  std::string dir_;
  Env* env_;
  mutable Mutex mu_;
  std::map<std::string, std::map<int, std::shared_ptr<const ModelEntry>>> models_
      ABSL_GUARDED_BY(mu_);
};

// The codec tables (cache.h) of one layer of a model entry under `codec`: its basis cut to the
// codec's rank, the oblique pair's encode basis, and the rounding factors the codec asks for.
// What a store builds for its sequences and a client for its own encoder and decoder.
std::shared_ptr<const LayerCodecTables> MakeLayerCodecTables(const ModelEntry& model, int layer,
                                                             const CodecOptions& codec);

}  // namespace kvq::core
