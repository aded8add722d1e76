#include "kvq/frontend/model_files.h"

#include <cstdlib>
#include <fstream>
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

}  // namespace kvq::frontend
