// Model file helpers: the data folder (KVQ_DATA_DIR), the registry name kvq-calibrate derives
// from a GGUF file name, and the basis check every tool makes (its RoPE layout must be the
// model's).
#include "kvq/frontend/model_files.h"

#include <cstdlib>
#include <string>

#include "gtest/gtest.h"
#include "kvq/frontend/model_and_text.h"

namespace kvq::frontend {
namespace {

TEST(ModelFiles, NameDropsFolderExtensionAndQuantTag) {
  EXPECT_EQ(ModelNameFromPath("/models/kvq/SmolLM2-135M-Instruct.Q4_1.gguf"),
            "smollm2-135m-instruct");
  EXPECT_EQ(ModelNameFromPath("qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"),
            "qwen2.5-coder-0.5b-instruct");
  EXPECT_EQ(ModelNameFromPath("m/Llama-3-8B.IQ4_NL.gguf"), "llama-3-8b");
  EXPECT_EQ(ModelNameFromPath("x/phi-2-f16.gguf"), "phi-2");
}

// The evaluation data come from one setting, KVQ_DATA_DIR (default ../shared/data from the
// working directory, nothing compiled in); a missing data file's error names the setting.
TEST(ModelFiles, DataFilesComeFromKvqDataDirWhoseErrorNamesIt) {
  const char* was = std::getenv("KVQ_DATA_DIR");
  const std::string saved = was ? was : "";
  unsetenv("KVQ_DATA_DIR");
  EXPECT_EQ(DataDir(), "../shared/data");
  EXPECT_EQ(DataFile("wikitext-2/wiki.test.raw"), "../shared/data/wikitext-2/wiki.test.raw");
  setenv("KVQ_DATA_DIR", "/nonexistent-kvq-data", 1);
  EXPECT_EQ(DataFile("wikitext-2/wiki.test.raw"), "/nonexistent-kvq-data/wikitext-2/wiki.test.raw");
  absl::StatusOr<std::string> text = ReadFile(DataFile("wikitext-2/wiki.test.raw"));
  EXPECT_EQ(text.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(text.status().message().find("(the data folder: KVQ_DATA_DIR=/nonexistent-kvq-data); "
                                         "set KVQ_DATA_DIR to the folder that holds wikitext-2/"),
            std::string::npos)
      << text.status();
  // A file outside the data folder: no word of it.
  text = ReadFile("/nonexistent-kvq-elsewhere/x.txt");
  EXPECT_EQ(text.status().message(), "cannot read /nonexistent-kvq-elsewhere/x.txt");
  if (was) {
    setenv("KVQ_DATA_DIR", saved.c_str(), 1);
  } else {
    unsetenv("KVQ_DATA_DIR");
  }
}

TEST(ModelFiles, NameKeepsWhatIsNotAQuantTag) {
  // "0.5b" and "instruct" are part of the name; a file without a tag keeps its whole stem.
  EXPECT_EQ(ModelNameFromPath("qwen2.5-0.5b.gguf"), "qwen2.5-0.5b");
  EXPECT_EQ(ModelNameFromPath("model"), "model");
}

TEST(ModelFiles, BasisOfTheOtherRopeLayoutIsRefused) {
  // basis-r4 was calibrated on SmolLM2 (llama: adjacent pairs).
  const std::string dir = std::string(KVQ_FE_FIXTURES) + "/basis-r4";
  LlamaConfig llama;
  llama.arch = "llama";
  llama.rope_layout = RopeLayout::kAdjacentPairs;
  ASSERT_TRUE(ReadBasisFor(llama, dir).ok());
  LlamaConfig qwen = llama;
  qwen.arch = "qwen2";
  qwen.rope_layout = RopeLayout::kHalves;
  auto b = ReadBasisFor(qwen, dir);
  ASSERT_EQ(b.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(b.status().message().find("rope_layout adjacent_pairs"), std::string::npos);
  EXPECT_NE(b.status().message().find("needs halves"), std::string::npos);
  EXPECT_NE(b.status().message().find(dir), std::string::npos);
}

}  // namespace
}  // namespace kvq::frontend
