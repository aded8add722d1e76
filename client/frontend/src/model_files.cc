#include "kvq/frontend/model_files.h"

#include <cctype>
#include <cstdlib>
#include <fstream>
#include <regex>
#include <sstream>

#include "absl/strings/str_cat.h"

#ifndef KVQ_SHARED_DIR_DEFAULT
#define KVQ_SHARED_DIR_DEFAULT "../shared"
#endif

namespace kvq::frontend {

std::string ModelCacheDir() {
  if (const char* c = std::getenv("KVQ_MODEL_CACHE"); c && *c) return c;
  const char* home = std::getenv("HOME");
  return absl::StrCat(home ? home : ".", "/.cache/kvq/models");
}

std::string DefaultModelPath() {
  if (const char* m = std::getenv("KVQ_MODEL"); m && *m) return m;
  return ModelCacheDir() + "/SmolLM2-135M-Instruct.Q4_1.gguf";
}

std::string SharedDir() {
  if (const char* s = std::getenv("KVQ_SHARED_DIR"); s && *s) return s;
  return KVQ_SHARED_DIR_DEFAULT;
}

absl::StatusOr<std::string> ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read ", path));
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::string ModelNameFromPath(const std::string& gguf_path) {
  std::string name = gguf_path.substr(gguf_path.find_last_of('/') + 1);
  for (char& ch : name) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
  if (name.size() > 5 && name.compare(name.size() - 5, 5, ".gguf") == 0)
    name.resize(name.size() - 5);
  // llama.cpp's file types: q4_0, q4_k_m, iq4_nl, f16, bf16, ... after a '.' or '-'.
  static const std::regex kQuantTag(R"([.-](i?q[0-9][a-z0-9_]*|f16|f32|bf16)$)");
  return std::regex_replace(name, kQuantTag, "");
}

}  // namespace kvq::frontend
