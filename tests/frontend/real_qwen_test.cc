// The second real model, Qwen2.5-Coder-0.5B-Instruct (GGUF Q4_K_M, architecture qwen2: Q/K/V
// biases, RoPE on the two halves, output.weight, the qwen2 pre-tokenizer), against llama.cpp's
// reference fixtures (tests/fixtures/frontend/reference_qwen.json, made by make_reference.py),
// and a short HeadQ perplexity check with the rank-8 basis calibrated on validation text
// (tests/fixtures/frontend/qwen-basis-r8). Needs the model: scripts/test-extra.sh fetches it
// (scripts/fetch-model.sh qwen2.5-coder-0.5b) into the cache ($KVQ_MODEL_CACHE, default
// ~/.cache/kvq/models), or $KVQ_QWEN_MODEL names it. Without it these tests FAIL, unless
// KVQ_ALLOW_NO_MODEL=1 is set by hand, which turns them into skips.
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>

#include "gtest/gtest.h"
#include "kvq/core/basis.h"
#include "kvq/frontend/eval_config.h"
#include "kvq/frontend/gguf.h"
#include "kvq/frontend/llama.h"
#include "kvq/frontend/model_files.h"
#include "kvq/frontend/perplexity.h"
#include "kvq/frontend/tokenizer.h"
#include "nlohmann/json.hpp"
#include "real_model_suite.h"
#include "real_models.h"

namespace kvq::frontend {
namespace {

using nlohmann::json;

class RealQwen : public RealModelSuite<QwenFile> {};

TEST_F(RealQwen, MetadataMatchesTheDocumentedArchitecture) {
  const LlamaConfig& c = model_->config();
  EXPECT_EQ(c.arch, "qwen2");
  EXPECT_EQ(c.rope_layout, RopeLayout::kHalves);
  EXPECT_EQ(c.layers, 24);
  EXPECT_EQ(c.hidden, 896);
  EXPECT_EQ(c.q_heads, 14);
  EXPECT_EQ(c.kv_heads, 2);
  EXPECT_EQ(c.head_dim, 64);
  EXPECT_EQ(c.ffn, 4864);
  EXPECT_EQ(c.vocab, 151936);
  EXPECT_FLOAT_EQ(c.rope_base, 1e6f);
  EXPECT_FALSE(tok_->add_bos());
  EXPECT_EQ((*ref_)["model_sha256"].get<std::string>(),
            "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32");
}

TEST_F(RealQwen, TokenizerMatchesLlamaCpp) {
  auto sample = ReadFile(Fixture("tokenizer_sample.txt"));
  ASSERT_TRUE(sample.ok());
  EXPECT_EQ(tok_->Encode(*sample), Ids((*ref_)["sample_ids"]));
  EXPECT_EQ(tok_->Decode(tok_->Encode(*sample)), *sample);
  auto valid = ReadFile(SharedDir() + "/data/wikitext-2/wiki.valid.tokens");
  ASSERT_TRUE(valid.ok()) << valid.status();
  EXPECT_EQ(tok_->Encode(valid->substr(0, (*ref_)["valid_slice_bytes"].get<size_t>())),
            Ids((*ref_)["valid_slice_ids"]));
  auto test = ReadFile(SharedDir() + "/data/wikitext-2/wiki.test.raw");
  ASSERT_TRUE(test.ok()) << test.status();
  std::vector<int32_t> ids = tok_->Encode(*test);
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
  const auto first = Ids((*ref_)["test_first_ids"]);
  ASSERT_GE(ids.size(), first.size());
  EXPECT_EQ(std::vector<int32_t>(ids.begin(), ids.begin() + static_cast<long>(first.size())),
            first);
}

TEST_F(RealQwen, LogitsMatchLlamaCpp) {
  const auto fixed = Ids((*ref_)["fixed_ids"]);
  const int V = model_->config().vocab;
  double worst = 0, sum = 0;
  int rows = 0, top1_agree = 0, n = 0;
  for (const auto& p : (*ref_)["logits"]) {
    auto ids = Ids(p["ids"]);
    EXPECT_EQ(tok_->Encode(p["prompt"].get<std::string>()), ids);
    DenseCache cache(model_->config().cache_shape());
    std::vector<float> logits;
    ASSERT_TRUE(
        model_->Forward(ids.data(), static_cast<int>(ids.size()), 0, &cache, 0, &logits).ok());
    for (size_t i = 0; i < ids.size(); ++i) {
      const auto& row = p["rows"][i];
      const float* l = logits.data() + i * V;
      auto top = Ids(row["top_ids"]);
      auto tl = row["top_logits"].get<std::vector<float>>();
      auto fl = row["fixed_logits"].get<std::vector<float>>();
      auto diff = [&](float a, float b) {
        const double d = std::abs(static_cast<double>(a) - b);
        worst = std::max(worst, d);
        sum += d;
        ++n;
      };
      for (size_t k = 0; k < top.size(); ++k) diff(l[top[k]], tl[k]);
      for (size_t k = 0; k < fixed.size(); ++k) diff(l[fixed[k]], fl[k]);
      int arg = static_cast<int>(std::max_element(l, l + V) - l);
      // A near tie may flip: llama.cpp's own logit of our argmax within 0.1 of its top one
      // (measured: one row of 51, a gap of 0.06 there, -0.02 here).
      bool agree = arg == top[0];
      for (size_t k = 1; k < top.size() && !agree; ++k)
        agree = arg == top[k] && tl[0] - tl[k] < 0.1f;
      if (!agree) {
        std::printf(
            "row %zu of \"%s\": argmax %d (%.4f), llama.cpp top %d (%.4f, ours %.4f), "
            "second %d (%.4f)\n",
            i, p["prompt"].get<std::string>().c_str(), arg, l[arg], top[0], tl[0], l[top[0]],
            top[1], tl[1]);
      }
      top1_agree += agree;
      ++rows;
    }
  }
  std::printf("logits: mean |diff| %.4f, max %.4f over %d rows, top-1 agreement %d/%d\n", sum / n,
              worst, rows, top1_agree, rows);
  // llama.cpp quantizes activations to 8 bits for its quantized dot products; kvq computes in
  // fp32 on dequantized weights (measured: mean 0.062, max 0.33 on logits of ~10-25). A wrong
  // RoPE layout, a missing bias or a wrong tokenization moves logits by whole units.
  EXPECT_LT(sum / n, 0.15) << "mean |logit difference| over " << rows << " rows";
  EXPECT_LT(worst, 0.75) << "max |logit difference| over " << rows << " rows";
  EXPECT_EQ(top1_agree, rows);
}

// CI-sized: 2 windows of 256 tokens of wiki.test.raw, llama.cpp's protocol; HeadQ rank 4 at 2
// bits (keys only) between dense and the KIVI-like baseline.
TEST_F(RealQwen, DensePerplexityMatchesLlamaCppAndHeadQBeatsKivi) {
  auto test = ReadFile(SharedDir() + "/data/wikitext-2/wiki.test.raw");
  ASSERT_TRUE(test.ok()) << test.status();
  std::vector<int32_t> ids = tok_->Encode(test->substr(0, 20000));
  double ref = 0;
  for (const auto& p : (*ref_)["perplexity"])
    if (p["windows"] == 2 && p["window_len"] == 256) ref = p["ppl"].get<double>();
  ASSERT_GT(ref, 0);
  auto basis = core::ReadBasis(Fixture("qwen-basis-r8"));
  ASSERT_TRUE(basis.ok()) << basis.status();
  EXPECT_EQ(basis->manifest.rope_layout, "halves");
  BasisSet bases;
  bases.query = &*basis;
  std::map<std::string, double> ppl;
  for (const char* name : {"dense", "kivi-k2", "headq-k2-r4"}) {
    auto c = ParseEvalConfig(name);
    ASSERT_TRUE(c.ok());
    auto r = EvaluatePerplexity(*model_, ids, 2, 256, *c, &bases);
    ASSERT_TRUE(r.ok()) << r.status();
    ppl[name] = r->ppl;
    std::printf("%-24s ppl %.4f (%.1fs)\n", name, r->ppl, r->seconds);
  }
  EXPECT_NEAR(ppl["dense"] / ref, 1.0, 0.01) << "dense " << ppl["dense"] << " vs llama.cpp " << ref;
  EXPECT_LT(ppl["dense"], ppl["headq-k2-r4"]);
  EXPECT_LT(ppl["headq-k2-r4"], ppl["kivi-k2"]);
}

}  // namespace
}  // namespace kvq::frontend
