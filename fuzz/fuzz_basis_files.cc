// Fuzzes the registry's basis files: arbitrary bytes as an entry's manifest.json and
// basis.safetensors, read by ReadBasis through an in-memory Env (the input: a 4-byte
// little-endian manifest length, the manifest, then the tensor file). Reading never crashes or
// throws; a basis that reads has every tensor readable at the manifest's shape, passes or
// fails the registry's entry checks like any other, and writes back to files that read back
// to the same tensors.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <map>
#include <string>

#include "kvq/core/basis.h"
#include "kvq/core/env.h"
#include "kvq/core/registry.h"

namespace {

using kvq::core::Env;

// Files in a map: no disk, so a run is thousands of inputs a second.
class MemoryEnv : public Env {
 public:
  absl::Status WriteFile(const std::string& path, absl::string_view bytes) override {
    files[path] = std::string(bytes);
    return absl::OkStatus();
  }
  absl::StatusOr<std::string> ReadFile(const std::string& path, size_t limit) override {
    auto f = files.find(path);
    if (f == files.end()) return absl::NotFoundError(path);
    if (f->second.size() > limit) return absl::InvalidArgumentError(path + " over its limit");
    return f->second;
  }
  absl::Status Sync(const std::string&) override { return absl::OkStatus(); }
  absl::Status Rename(const std::string& from, const std::string& to) override {
    auto f = files.find(from);
    if (f == files.end()) return absl::NotFoundError(from);
    files[to] = std::move(f->second);
    files.erase(from);
    return absl::OkStatus();
  }
  absl::Status CreateDirs(const std::string&) override { return absl::OkStatus(); }
  absl::Status RemoveAll(const std::string&) override { return absl::OkStatus(); }
  std::map<std::string, std::string> files;
};

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 4) return 0;
  uint32_t n;
  std::memcpy(&n, data, 4);
  const size_t manifest = std::min<size_t>(n, size - 4);
  MemoryEnv env;
  env.files["/e/manifest.json"] = std::string(reinterpret_cast<const char*>(data) + 4, manifest);
  env.files["/e/basis.safetensors"] =
      std::string(reinterpret_cast<const char*>(data) + 4 + manifest, size - 4 - manifest);
  absl::StatusOr<kvq::core::ModelBasis> b = kvq::core::ReadBasis("/e", &env);
  if (!b.ok()) return 0;
  const kvq::core::BasisManifest& m = b->manifest;
  // Every head's columns are there (ASan stops a read past the tensors).
  volatile float sum = 0;
  for (int l = 0; l < m.layers; ++l)
    for (int h = 0; h < m.kv_heads; ++h) {
      const size_t cols = static_cast<size_t>(m.head_dim) * m.rank;
      sum = sum + b->head(l, h)[0] + b->head(l, h)[cols - 1];
      if (b->oblique()) sum = sum + b->encode_head(l, h)[cols - 1];
      if (!b->query_moment.empty()) {
        sum = sum + b->query_moment_head(l, h)[static_cast<size_t>(m.head_dim) * m.head_dim - 1];
      }
    }
  kvq::core::ModelEntry e;
  e.manifest = m;
  e.has_basis = true;
  e.basis = *b;
  e.codec = kvq::core::Registry::DefaultCodec(m, true);
  (void)kvq::core::Registry::ValidateEntry(e);
  // Written back and read again: the same tensors.
  MemoryEnv out;
  kvq::core::ModelBasis copy = *b;
  if (!kvq::core::WriteBasis("/w", copy, &out).ok()) std::abort();
  absl::StatusOr<kvq::core::ModelBasis> again = kvq::core::ReadBasis("/w", &out);
  if (!again.ok() || again->u != b->u || again->encode != b->encode ||
      again->query_moment != b->query_moment) {
    std::abort();
  }
  return 0;
}
