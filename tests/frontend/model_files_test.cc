// Model file helpers: the registry name kvq-calibrate derives from a GGUF file name.
#include "kvq/frontend/model_files.h"

#include "gtest/gtest.h"

namespace kvq::frontend {
namespace {

TEST(ModelFiles, NameDropsFolderExtensionAndQuantTag) {
  EXPECT_EQ(ModelNameFromPath("/root/.cache/kvq/models/SmolLM2-135M-Instruct.Q4_1.gguf"),
            "smollm2-135m-instruct");
  EXPECT_EQ(ModelNameFromPath("qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"),
            "qwen2.5-coder-0.5b-instruct");
  EXPECT_EQ(ModelNameFromPath("m/Llama-3-8B.IQ4_NL.gguf"), "llama-3-8b");
  EXPECT_EQ(ModelNameFromPath("x/phi-2-f16.gguf"), "phi-2");
}

TEST(ModelFiles, NameKeepsWhatIsNotAQuantTag) {
  // "0.5b" and "instruct" are part of the name; a file without a tag keeps its whole stem.
  EXPECT_EQ(ModelNameFromPath("qwen2.5-0.5b.gguf"), "qwen2.5-0.5b");
  EXPECT_EQ(ModelNameFromPath("model"), "model");
}

}  // namespace
}  // namespace kvq::frontend
