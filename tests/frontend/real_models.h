// The two real models the suites run on: where each GGUF lives, how to fetch it, its llama.cpp
// reference fixture and committed basis, and the layer count the tests' arithmetic assumes.
#ifndef KVQ_TESTS_FRONTEND_REAL_MODELS_H_
#define KVQ_TESTS_FRONTEND_REAL_MODELS_H_

#include <cstdlib>
#include <string>

#include "kvq/frontend/model_files.h"

namespace kvq::frontend {

// SmolLM2-135M-Instruct (llama), Q4_1: $KVQ_MODEL or the fetch script's cache.
struct SmolLM2File {
  static std::string Path() { return DefaultModelPath(); }
  static std::string FetchHint() { return "run scripts/fetch-model.sh"; }
  static std::string Reference() { return "reference.json"; }
  static std::string Basis() { return "basis-r4"; }
  static constexpr int kLayers = 30;
};

// Qwen2.5-Coder-0.5B-Instruct (qwen2), Q4_K_M: $KVQ_QWEN_MODEL or the fetch script's cache.
struct QwenFile {
  static std::string Path() {
    if (const char* m = std::getenv("KVQ_QWEN_MODEL"); m && *m) return m;
    return ModelCacheDir() + "/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf";
  }
  static std::string FetchHint() { return "run scripts/fetch-model.sh qwen2.5-coder-0.5b"; }
  static std::string Reference() { return "reference_qwen.json"; }
  static std::string Basis() { return "qwen-basis-r8"; }
  static constexpr int kLayers = 24;
};

}  // namespace kvq::frontend

#endif  // KVQ_TESTS_FRONTEND_REAL_MODELS_H_
