#include "kvq/frontend/model_files.h"

#include <cctype>
#include <cstdlib>
#include <fstream>
#include <regex>
#include <sstream>

#include "absl/strings/str_cat.h"

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

std::string DataDir() {
  if (const char* d = std::getenv("KVQ_DATA_DIR"); d && *d) return d;
  return kDefaultDataDir;
}

std::string DataFile(const std::string& name) { return DataDir() + "/" + name; }

absl::StatusOr<std::string> ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    const std::string dir = DataDir() + "/";
    if (path.compare(0, dir.size(), dir) != 0)
      return absl::NotFoundError(absl::StrCat("cannot read ", path));
    const char* set = std::getenv("KVQ_DATA_DIR");
    return absl::NotFoundError(absl::StrCat(
        "cannot read ", path, " (the data folder: ",
        set && *set ? absl::StrCat("KVQ_DATA_DIR=", set)
                    : absl::StrCat("KVQ_DATA_DIR unset, so ", kDefaultDataDir,
                                   " from the working directory"),
        "); set KVQ_DATA_DIR to the folder that holds wikitext-2/, or pass the file itself"));
  }
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
