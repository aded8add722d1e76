// Default locations of the model and data files used by the tools and tests.
#pragma once

#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace kvq::frontend {

// $KVQ_MODEL if set, else $KVQ_MODEL_CACHE (default ~/.cache/kvq/models) +
// /SmolLM2-135M-Instruct.Q4_1.gguf (where scripts/fetch-model.sh puts it).
std::string DefaultModelPath();
// $KVQ_MODEL_CACHE (default ~/.cache/kvq/models): where scripts/fetch-model.sh caches models.
std::string ModelCacheDir();
// The evaluation data folder (the WikiText files: wikitext-2/wiki.test.raw, ...): the one
// setting $KVQ_DATA_DIR, else kDefaultDataDir relative to the working directory (the
// repository's sibling shared/data when run from the repository root, as the docs' commands
// and the tests under ctest are). Nothing is compiled in.
inline constexpr char kDefaultDataDir[] = "../shared/data";
std::string DataDir();
// DataDir() + "/" + name.
std::string DataFile(const std::string& name);
// The file's bytes; NOT_FOUND naming the path, and KVQ_DATA_DIR for a path under DataDir().
absl::StatusOr<std::string> ReadFile(const std::string& path);
// A registry model name from a GGUF file name: the base name, lower case, without ".gguf"
// and a trailing llama.cpp quantization tag (".Q4_1", "-q4_k_m", "-f16", ...):
// "SmolLM2-135M-Instruct.Q4_1.gguf" -> "smollm2-135m-instruct",
// "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf" -> "qwen2.5-coder-0.5b-instruct".
std::string ModelNameFromPath(const std::string& gguf_path);

}  // namespace kvq::frontend
