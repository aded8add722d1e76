// Fuzzes the registry folder as core's Registry reads it: the input is a small tree of files
// (model.json, manifest.json, basis.safetensors, codec.json, in folders of any name), written
// into a fresh folder and loaded with Registry::LoadAll. Loading never crashes, throws or
// fails as a whole; every entry it skips comes with a clean reason (one line, bounded, naming
// a file or a field); every entry it loads passes ValidateEntry, serves a sequence (append,
// decode, score) and writes back (Register into an empty registry) to files that load back
// to the same entry.
//
// The input: records "@@<path>\n<bytes>", each starting the input or following a newline;
// <path> is relative (1..3 parts of 1..64 bytes, no '/' or NUL, not "." or ".."; others are
// ignored), the last part a file. An input without a leading "@@" is all m/v1/model.json.
// KVQ_FUZZ_REGISTRY_VERBOSE=1 prints what each input loads and skips.
#include <unistd.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <string_view>
#include <vector>

#include "absl/strings/escaping.h"
#include "kvq/core/codec_json.h"
#include "kvq/core/env.h"
#include "kvq/core/registry.h"
#include "kvq/core/store.h"
#include "kvq/core/tensor.h"

namespace {

namespace fs = std::filesystem;
using kvq::core::ModelEntry;
using kvq::core::Registry;

struct File {
  std::string path, bytes;
};

constexpr size_t kMaxFiles = 16;

bool UsablePath(std::string_view path) {
  int parts = 0;
  size_t from = 0;
  while (from <= path.size()) {
    const size_t slash = std::min(path.find('/', from), path.size());
    const std::string_view part = path.substr(from, slash - from);
    if (part.empty() || part.size() > 64 || part == "." || part == ".." ||
        part.find('\0') != std::string_view::npos || ++parts > 3) {
      return false;
    }
    from = slash + 1;
  }
  return true;
}

std::vector<File> Split(std::string_view in) {
  if (in.substr(0, 2) != "@@") return {{"m/v1/model.json", std::string(in)}};
  std::vector<File> files;
  size_t at = 0;
  while (at != std::string_view::npos && files.size() < kMaxFiles) {
    const size_t next = in.find("\n@@", at + 2);
    const std::string_view record =
        in.substr(at + 2, next == std::string_view::npos ? std::string_view::npos : next - at - 2);
    const size_t eol = record.find('\n');
    const std::string_view path = record.substr(0, eol);
    const std::string_view bytes =
        eol == std::string_view::npos ? std::string_view() : record.substr(eol + 1);
    if (UsablePath(path)) files.push_back({std::string(path), std::string(bytes)});
    at = next == std::string_view::npos ? next : next + 1;
  }
  return files;
}

// The registry's writes are real files in a folder of its own (its listing is
// std::filesystem's), without the fsyncs, which would make a run a few inputs a second on a
// disk and prove nothing here.
class NoSyncEnv : public kvq::core::Env {
 public:
  absl::Status Sync(const std::string&) override { return absl::OkStatus(); }
};

const fs::path& Scratch() {
  static const fs::path dir = [] {
    const fs::path base = fs::exists("/dev/shm") ? fs::path("/dev/shm") : fs::temp_directory_path();
    return base / ("kvq-fuzz-registry-" + std::to_string(getpid()));
  }();
  static const bool cleanup = [] {
    return std::atexit([] {
             std::error_code ec;
             fs::remove_all(dir, ec);
           }) == 0;
  }();
  (void)cleanup;
  return dir;
}

// What a skip reason must mention (besides the entry's path, which the line starts with): the
// file it comes from or the field it is about.
bool NamesAFileOrField(const std::string& reason) {
  static const std::vector<std::string> names = [] {
    std::vector<std::string> n = {
        "model.json",       "manifest.json", "codec.json",     "safetensors",
        "folder",           "model name",    "manifest names", "version",
        "layers",           "kv_heads",      "q_heads",        "head_dim",
        "rope_layout",      "channel_order", "kind",           "calibration_tokens",
        "calibration_text", "basis_rank",    "rank",           "basis",
        "tensor",           "codec",         "fingerprint"};
    const nlohmann::json codec = kvq::core::CodecToJson(kvq::core::CodecOptions{});
    for (const auto& [key, value] : codec.items()) {
      n.push_back(key);
    }
    return n;
  }();
  for (const std::string& n : names) {
    if (reason.find(n) != std::string::npos) return true;
  }
  return false;
}

void CheckSkipped(const std::string& dir, const std::string& line) {
  // "<path>: <reason>": the path is a folder's, C-escaped (its name may hold any bytes, ": "
  // too, and another folder's name may be its prefix), the reason ours: the path is the longest
  // escaped folder under `dir` that the line starts with, followed by ": ".
  if (line.compare(0, dir.size() + 1, dir + "/") != 0) std::abort();
  std::error_code ec;
  size_t colon = std::string::npos;
  for (auto it = fs::recursive_directory_iterator(dir, ec); !ec && it != fs::end(it);
       it.increment(ec)) {
    if (!it->is_directory(ec)) continue;
    const std::string escaped = absl::CHexEscape(it->path().string());
    if (line.compare(0, escaped.size(), escaped) == 0 &&
        line.compare(escaped.size(), 2, ": ") == 0 &&
        (colon == std::string::npos || escaped.size() > colon)) {
      colon = escaped.size();
    }
  }
  if (colon == std::string::npos) {
    fprintf(stderr, "skip line names no folder: %s\n", absl::CHexEscape(line).c_str());
    std::abort();
  }
  const std::string reason = line.substr(colon + 2);
  if (reason.empty() || reason.size() > 512) {
    fprintf(stderr, "skip reason of %zu bytes: %.200s\n", reason.size(), reason.c_str());
    std::abort();
  }
  for (unsigned char c : reason) {
    if (c < 0x20 || c == 0x7f) {
      fprintf(stderr, "control byte in a skip reason: %s\n", reason.c_str());
      std::abort();
    }
  }
  if (!NamesAFileOrField(reason)) {
    fprintf(stderr, "skip reason names no file or field: %s\n", reason.c_str());
    std::abort();
  }
}

// A loaded entry serves a sequence: three tokens appended to layer 0, decoded back (all
// finite) and scored.
void CheckServes(Registry& registry, const ModelEntry& e) {
  kvq::core::Store store({}, &registry);
  const kvq::core::BasisManifest& m = e.manifest;
  const int64_t n = 3;
  std::vector<float> k(static_cast<size_t>(m.kv_heads) * n * m.head_dim);
  uint32_t x = 12345;
  for (float& f : k) {
    x = x * 1664525u + 1013904223u;
    f = static_cast<float>(static_cast<int32_t>(x >> 8) % 2001 - 1000) / 250.0f;
  }
  kvq::core::AppendSpec a;
  a.sequence_id = "s";
  a.model = m.model;
  a.basis_version = m.version;
  a.keys = kvq::core::TensorView::Contiguous(k.data(), kvq::core::DType::kF32,
                                             {m.kv_heads, n, m.head_dim});
  a.values = a.keys;
  kvq::core::AppendOutcome out;
  if (absl::Status st = store.Append("t", {a}, &out); !st.ok()) {
    fprintf(stderr, "append to %s v%d: %s\n", m.model.c_str(), m.version,
            std::string(st.message()).c_str());
    std::abort();
  }
  std::vector<float> keys, values;
  const absl::StatusOr<kvq::core::RangeRead> read =
      store.Decode({"t", "s", 0, m.version}, {}, &keys, &values);
  if (!read.ok() || read->tokens != n || keys.size() != k.size() || values.size() != k.size()) {
    std::abort();
  }
  for (size_t i = 0; i < keys.size(); ++i) {
    if (!std::isfinite(keys[i]) || !std::isfinite(values[i])) std::abort();
  }
  std::vector<float> q(static_cast<size_t>(m.q_heads) * m.head_dim, 0.5f), logits;
  if (!store
           .Score({"t", "s", 0, m.version}, {q.data(), m.q_heads, 1, m.head_dim}, 0, false, &logits)
           .ok() ||
      logits.size() != static_cast<size_t>(m.q_heads) * n) {
    std::abort();
  }
}

// Written back into an empty registry and loaded from there: the same entry (Register of what
// loads back is "already registered", which compares shape, basis fingerprint, codec and the
// manifest's strings), with the same tensors.
void CheckWritesBack(NoSyncEnv& env, const ModelEntry& e) {
  const std::string dir = (Scratch() / "out").string();
  std::error_code ec;
  fs::remove_all(dir, ec);
  Registry out(dir, &env);
  bool already = true;
  if (!out.Register(e, &already).ok() || already) std::abort();
  Registry again(dir, &env);
  std::vector<std::string> loaded, skipped;
  if (!again.LoadAll(&loaded, &skipped).ok() || loaded.size() != 1 || !skipped.empty()) {
    for (const auto& s : skipped) fprintf(stderr, "write-back skipped %s\n", s.c_str());
    std::abort();
  }
  auto back = again.Get(e.manifest.model, e.manifest.version);
  if (!back.ok()) std::abort();
  if (!out.Register(**back, &already).ok() || !already) std::abort();
  const ModelEntry& b = **back;
  if (kvq::core::CodecToJson(b.codec) != kvq::core::CodecToJson(e.codec) ||
      b.has_basis != e.has_basis || b.basis.u != e.basis.u || b.basis.encode != e.basis.encode ||
      b.basis.query_moment != e.basis.query_moment) {
    std::abort();
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::vector<File> files =
      Split(std::string_view(reinterpret_cast<const char*>(data), size));
  const fs::path in = Scratch() / "in";
  std::error_code ec;
  fs::remove_all(in, ec);
  fs::create_directories(in, ec);
  for (const File& f : files) {
    const fs::path p = in / f.path;
    fs::create_directories(p.parent_path(), ec);  // may clash with a file: then not written
    std::ofstream(p, std::ios::binary | std::ios::trunc) << f.bytes;
  }
  NoSyncEnv env;
  Registry registry(in.string(), &env);
  std::vector<std::string> loaded, skipped;
  if (!registry.LoadAll(&loaded, &skipped).ok()) std::abort();
  static const bool verbose = std::getenv("KVQ_FUZZ_REGISTRY_VERBOSE") != nullptr;
  if (verbose) {
    for (const std::string& s : loaded) fprintf(stderr, "loaded %s\n", s.c_str());
    for (const std::string& s : skipped) fprintf(stderr, "skipped %s\n", s.c_str());
  }
  for (const std::string& s : skipped) CheckSkipped(in.string(), s);
  const auto entries = registry.List();
  if (entries.size() != loaded.size()) std::abort();
  for (const auto& e : entries) {
    if (!Registry::ValidateEntry(*e).ok()) std::abort();
    auto got = registry.Get(e->manifest.model, e->manifest.version);
    if (!got.ok() || *got != e) std::abort();
    CheckServes(registry, *e);
    CheckWritesBack(env, *e);
  }
  return 0;
}
