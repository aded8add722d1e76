// The fixture of the real-model end-to-end tests: a real model (`Model`, one of
// tests/frontend/real_models.h), its tokenizer, the token ids of the start of wiki.test.raw and
// the model's committed basis, loaded once per test binary; a real kvq-server in-process on
// port 0 (2 workers) and a client per test.
//
// Needs the model (scripts/fetch-model.sh [name]): without it every test FAILS, unless
// KVQ_ALLOW_NO_MODEL=1 is set by hand, which turns them into skips.
#pragma once

#include <cstdlib>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "gtest/gtest.h"
#include "kvq/client/client.h"
#include "kvq/core/basis.h"
#include "kvq/core/status.h"
#include "kvq/frontend/gguf.h"
#include "kvq/frontend/llama.h"
#include "kvq/frontend/tokenizer.h"
#include "tests/frontend/real_models.h"
#include "tests/server/test_util.h"

namespace kvq::frontend {

template <typename Model>
class RealModelServerTest : public ::testing::Test {
 protected:
  static constexpr size_t kTextChars = 12000;  // about 2900 tokens

  // Errors are kept for SetUp to report: a fatal failure inside SetUpTestSuite would make
  // googletest report the tests as skipped, which ctest counts as passing.
  static void SetUpTestSuite() {
    const std::string path = Model::Path();
    if (!std::filesystem::exists(path)) {
      missing_ = "model not found at " + path + " (" + Model::FetchHint() + ")";
      return;
    }
    absl::Status st = Load(path);
    if (!st.ok()) error_ = st.ToString();
  }

  static absl::Status Load(const std::string& path) {
    ASSIGN_OR_RETURN(std::unique_ptr<GgufFile> f, GgufFile::Open(path));
    file_ = f.release();
    ASSIGN_OR_RETURN(std::unique_ptr<Tokenizer> t, Tokenizer::FromGguf(*file_));
    ASSIGN_OR_RETURN(std::unique_ptr<LlamaModel> m, LlamaModel::Load(*file_));
    model_ = m.release();
    SetBlasThreads(1);
    ASSIGN_OR_RETURN(std::string text, ReadFile(DataFile("wikitext-2/wiki.test.raw")));
    ids_ = new std::vector<int32_t>(t->Encode(text.substr(0, kTextChars)));
    ASSIGN_OR_RETURN(core::ModelBasis b,
                     core::ReadBasis(std::string(KVQ_FE_FIXTURES) + "/" + Model::Basis()));
    basis_ = new core::ModelBasis(std::move(b));
    return absl::OkStatus();
  }

  void SetUp() override {
    if (!missing_.empty()) {
      const char* allow = std::getenv("KVQ_ALLOW_NO_MODEL");
      if (allow && std::string(allow) == "1") GTEST_SKIP() << missing_ << "; KVQ_ALLOW_NO_MODEL=1";
      FAIL() << missing_ << "; set KVQ_ALLOW_NO_MODEL=1 to skip the real-model tests";
    }
    ASSERT_TRUE(error_.empty()) << "loading the model, text or basis: " << error_;
    ASSERT_NE(model_, nullptr);
    ASSERT_EQ(model_->config().layers, Model::kLayers);  // the tests' counts assume it
    server::ServerOptions so;
    so.memory = "host";
    so.workers = 2;
    server_ = std::make_unique<testing::TestServer>(so);
    client::ClientOptions co;
    co.servers = {server_->address()};
    auto c = client::Client::Create(co);
    ASSERT_TRUE(c.ok()) << c.status();
    client_ = std::move(*c);
  }

  static inline std::string missing_, error_;
  static inline GgufFile* file_ = nullptr;
  static inline LlamaModel* model_ = nullptr;
  static inline std::vector<int32_t>* ids_ = nullptr;
  static inline core::ModelBasis* basis_ = nullptr;
  std::unique_ptr<testing::TestServer> server_;
  std::unique_ptr<client::Client> client_;
};

}  // namespace kvq::frontend
