// What every frontend tool loads first: a GGUF model (file, tokenizer, forward pass) and the
// token ids of a text file.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "kvq/core/basis.h"
#include "kvq/frontend/gguf.h"
#include "kvq/frontend/llama.h"
#include "kvq/frontend/tokenizer.h"

namespace kvq::frontend {

struct ModelAndText {
  std::unique_ptr<GgufFile> file;  // outlives what was read from it
  std::unique_ptr<Tokenizer> tokenizer;
  std::unique_ptr<LlamaModel> model;
  std::vector<int32_t> ids;  // the text, tokenized
};

// Errors name the file that failed (GGUF, tokenizer, weights or text).
absl::StatusOr<ModelAndText> LoadModelAndText(const std::string& model_path,
                                              const std::string& text_path);

// The registry entry in `dir` (kvq-calibrate's output), refused with InvalidArgument naming
// the folder when its rope_layout is not the one `model` rotates with: a basis fitted to the
// other RoPE pairing runs and gives wrong scores.
absl::StatusOr<core::ModelBasis> ReadBasisFor(const LlamaConfig& model, const std::string& dir);

}  // namespace kvq::frontend
