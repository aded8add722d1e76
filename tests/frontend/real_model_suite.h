// One gtest fixture for the real-model suites: loads a GGUF model, its tokenizer and a
// llama.cpp reference fixture once per suite, and fails (or, with KVQ_ALLOW_NO_MODEL=1, skips)
// every test when the model is missing. `Model` names the file: static Path(), FetchHint()
// (how to get it) and Reference() (the fixture's file name in tests/fixtures/frontend).
#ifndef KVQ_TESTS_FRONTEND_REAL_MODEL_SUITE_H_
#define KVQ_TESTS_FRONTEND_REAL_MODEL_SUITE_H_

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kvq/frontend/gguf.h"
#include "kvq/frontend/llama.h"
#include "kvq/frontend/tokenizer.h"
#include "nlohmann/json.hpp"

namespace kvq::frontend {

inline std::string Fixture(const std::string& name) {
  return std::string(KVQ_FE_FIXTURES) + "/" + name;
}

template <typename Model>
class RealModelSuite : public ::testing::Test {
 protected:
  using json = nlohmann::json;

  static void SetUpTestSuite() {
    const std::string path = Model::Path();
    if (!std::filesystem::exists(path)) {
      missing_ = "model not found at " + path + " (" + Model::FetchHint() + ")";
      return;
    }
    // Errors are kept for SetUp to report: a fatal failure here would make gtest skip the
    // tests, which ctest counts as passed.
    auto f = GgufFile::Open(path);
    if (!f.ok()) return void(error_ = f.status().ToString());
    file_ = std::move(*f).release();
    auto t = Tokenizer::FromGguf(*file_);
    if (!t.ok()) return void(error_ = t.status().ToString());
    tok_ = std::move(*t).release();
    auto m = LlamaModel::Load(*file_);
    if (!m.ok()) return void(error_ = m.status().ToString());
    model_ = std::move(*m).release();
    SetBlasThreads(1);  // ctest runs tests in parallel; 2 BLAS threads would oversubscribe
    const std::string ref = Fixture(Model::Reference());
    std::ifstream in(ref);
    json parsed = json::parse(in, nullptr, /*allow_exceptions=*/false);
    if (parsed.is_discarded()) return void(error_ = "cannot read " + ref);
    ref_ = new json(std::move(parsed));
  }
  void SetUp() override {
    ASSERT_TRUE(error_.empty()) << error_;
    if (!missing_.empty()) {
      const char* allow = std::getenv("KVQ_ALLOW_NO_MODEL");
      if (allow && std::string(allow) == "1") GTEST_SKIP() << missing_ << "; KVQ_ALLOW_NO_MODEL=1";
      FAIL() << missing_ << "; set KVQ_ALLOW_NO_MODEL=1 to skip the real-model tests";
    }
    ASSERT_NE(model_, nullptr);
  }
  static std::vector<int32_t> Ids(const json& j) { return j.get<std::vector<int32_t>>(); }

  static inline std::string missing_;
  static inline std::string error_;  // loading failed: every test fails with it
  static inline GgufFile* file_ = nullptr;
  static inline Tokenizer* tok_ = nullptr;
  static inline LlamaModel* model_ = nullptr;
  static inline json* ref_ = nullptr;
};

}  // namespace kvq::frontend

#endif  // KVQ_TESTS_FRONTEND_REAL_MODEL_SUITE_H_
