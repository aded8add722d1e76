// One gtest fixture for the real-model suites: loads a GGUF model, its tokenizer and a
// llama.cpp reference fixture once per suite, and fails (or, with KVQ_ALLOW_NO_MODEL=1, skips)
// every test when the model is missing. `Model` names the file: static Path(), FetchHint()
// (how to get it) and Reference() (the fixture's file name in tests/fixtures/frontend). The
// checks both models make against their fixtures live here too; each test states its limits.
#ifndef KVQ_TESTS_FRONTEND_REAL_MODEL_SUITE_H_
#define KVQ_TESTS_FRONTEND_REAL_MODEL_SUITE_H_

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kvq/core/basis.h"
#include "kvq/frontend/attention_cache.h"
#include "kvq/frontend/eval_config.h"
#include "kvq/frontend/gguf.h"
#include "kvq/frontend/llama.h"
#include "kvq/frontend/model_files.h"
#include "kvq/frontend/perplexity.h"
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

  static std::string SharedText(const std::string& name) {
    auto text = ReadFile(DataFile("wikitext-2/" + name));
    EXPECT_TRUE(text.ok()) << text.status();
    return text.ok() ? *std::move(text) : std::string();
  }

  // The tokenizer against the fixture: the sample (and its round trip), a slice of the
  // validation text, and the count and FNV-1a hash of every id of the whole test text.
  static void ExpectTokenizerMatchesReference() {
    auto sample = ReadFile(Fixture("tokenizer_sample.txt"));
    ASSERT_TRUE(sample.ok());
    EXPECT_EQ(tok_->Encode(*sample), Ids((*ref_)["sample_ids"]));
    EXPECT_EQ(tok_->Decode(tok_->Encode(*sample)), *sample);
    const std::string valid = SharedText("wiki.valid.tokens");
    EXPECT_EQ(tok_->Encode(valid.substr(0, (*ref_)["valid_slice_bytes"].get<size_t>())),
              Ids((*ref_)["valid_slice_ids"]));
    const std::vector<int32_t> ids = tok_->Encode(SharedText("wiki.test.raw"));
    uint64_t h = 0xcbf29ce484222325ull;
    for (int32_t t : ids)
      for (int b = 0; b < 4; ++b) {
        h ^= static_cast<uint8_t>(static_cast<uint32_t>(t) >> (8 * b));
        h *= 0x100000001b3ull;
      }
    char hex[17];
    std::snprintf(hex, sizeof(hex), "%016llx", static_cast<unsigned long long>(h));
    EXPECT_EQ(static_cast<int64_t>(ids.size()), (*ref_)["test_token_count"].get<int64_t>());
    EXPECT_EQ(std::string(hex), (*ref_)["test_ids_fnv1a64"].get<std::string>());
    if (ref_->contains("test_first_ids")) {
      const auto first = Ids((*ref_)["test_first_ids"]);
      ASSERT_GE(ids.size(), first.size());
      EXPECT_EQ(std::vector<int32_t>(ids.begin(), ids.begin() + static_cast<long>(first.size())),
                first);
    }
  }

  // Our logits of the fixture's prompts (dense cache) against llama.cpp's at its top ids and
  // fixed ids. A row's argmax agrees when it is llama.cpp's top id, or another of its top ids
  // whose logit there is within `tie` of the top one (a near tie may flip).
  struct LogitAgreement {
    double mean = 0, worst = 0;
    int rows = 0, top1_agree = 0;
  };
  static LogitAgreement CompareLogitsToReference(float tie) {
    const auto fixed = Ids((*ref_)["fixed_ids"]);
    const int V = model_->config().vocab;
    LogitAgreement a;
    double sum = 0;
    int n = 0;
    for (const auto& p : (*ref_)["logits"]) {
      auto ids = Ids(p["ids"]);
      EXPECT_EQ(tok_->Encode(p["prompt"].get<std::string>()), ids);
      DenseCache cache(model_->config().cache_shape());
      std::vector<float> logits;
      EXPECT_TRUE(
          model_->Forward(ids.data(), static_cast<int>(ids.size()), 0, &cache, 0, &logits).ok());
      if (logits.size() != ids.size() * V) return a;
      for (size_t i = 0; i < ids.size(); ++i) {
        const auto& row = p["rows"][i];
        const float* l = logits.data() + i * V;
        auto top = Ids(row["top_ids"]);
        auto tl = row["top_logits"].get<std::vector<float>>();
        auto fl = row["fixed_logits"].get<std::vector<float>>();
        auto diff = [&](float x, float y) {
          const double d = std::abs(static_cast<double>(x) - y);
          a.worst = std::max(a.worst, d);
          sum += d;
          ++n;
        };
        for (size_t k = 0; k < top.size(); ++k) diff(l[top[k]], tl[k]);
        for (size_t k = 0; k < fixed.size(); ++k) diff(l[fixed[k]], fl[k]);
        const int arg = static_cast<int>(std::max_element(l, l + V) - l);
        bool agree = arg == top[0];
        for (size_t k = 1; k < top.size() && !agree; ++k)
          agree = arg == top[k] && tl[0] - tl[k] < tie;
        if (!agree) {
          std::printf(
              "row %zu of \"%s\": argmax %d (%.4f), llama.cpp top %d (%.4f, ours %.4f), "
              "second %d (%.4f)\n",
              i, p["prompt"].get<std::string>().c_str(), arg, l[arg], top[0], tl[0], l[top[0]],
              top[1], tl[1]);
        }
        a.top1_agree += agree;
        ++a.rows;
      }
    }
    a.mean = n ? sum / n : 0;
    return a;
  }

  // CI-sized perplexity: 2 windows of 256 tokens of wiki.test.raw (llama.cpp's protocol) for
  // each named kvq-eval configuration, with the basis folder `basis` (a fixture); "reference"
  // holds llama.cpp's dense figure for the same windows.
  static std::map<std::string, double> ShortPerplexities(const std::string& basis_fixture,
                                                         const std::vector<std::string>& names) {
    std::map<std::string, double> ppl;
    const std::vector<int32_t> ids = tok_->Encode(SharedText("wiki.test.raw").substr(0, 20000));
    for (const auto& p : (*ref_)["perplexity"])
      if (p["windows"] == 2 && p["window_len"] == 256) ppl["reference"] = p["ppl"].get<double>();
    EXPECT_GT(ppl["reference"], 0);
    auto basis = core::ReadBasis(Fixture(basis_fixture));
    EXPECT_TRUE(basis.ok()) << basis.status();
    if (!basis.ok()) return ppl;
    BasisSet bases;
    bases.query = &*basis;
    for (const std::string& name : names) {
      auto c = ParseEvalConfig(name);
      EXPECT_TRUE(c.ok()) << name;
      if (!c.ok()) continue;
      auto r = EvaluatePerplexity(*model_, ids, 2, 256, *c, &bases);
      EXPECT_TRUE(r.ok()) << r.status();
      if (!r.ok()) continue;
      ppl[name] = r->ppl;
      std::printf("%-24s ppl %.4f (%.1fs)\n", name.c_str(), r->ppl, r->seconds);
    }
    return ppl;
  }

  static inline std::string missing_;
  static inline std::string error_;  // loading failed: every test fails with it
  static inline GgufFile* file_ = nullptr;
  static inline Tokenizer* tok_ = nullptr;
  static inline LlamaModel* model_ = nullptr;
  static inline json* ref_ = nullptr;
};

}  // namespace kvq::frontend

#endif  // KVQ_TESTS_FRONTEND_REAL_MODEL_SUITE_H_
