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
// The shared/ folder (docs and data): $KVQ_SHARED_DIR, else the path configured at build time.
std::string SharedDir();
absl::StatusOr<std::string> ReadFile(const std::string& path);

}  // namespace kvq::frontend
