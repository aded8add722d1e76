// The forward pass on a tiny synthetic Llama written as GGUF by the test (random F32
// weights): chunked prefill equals one-shot prefill on the dense cache, and with the codec
// cache ForwardDecodeFaithful equals true token-by-token decoding, while a one-shot prefill
// does not (it lets queries see keys of their own group already quantized).
#include "kvq/frontend/llama.h"

#include <unistd.h>

#include <cmath>
#include <cstring>
#include <fstream>
#include <random>
#include <string>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "kvq/frontend/attention_cache.h"
#include "kvq/frontend/gguf.h"
#include "tiny_model.h"

namespace kvq::frontend {
namespace {

std::vector<int32_t> Tokens(int n) {
  std::vector<int32_t> t(n);
  for (int i = 0; i < n; ++i) t[i] = (i * 7 + 3) % kVocab;
  return t;
}

double MaxDiff(const std::vector<float>& a, const std::vector<float>& b) {
  EXPECT_EQ(a.size(), b.size());
  double m = 0;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i)
    m = std::max(m, static_cast<double>(std::abs(a[i] - b[i])));
  return m;
}

// The largest |logit|: the scale of a tolerance for sums that OpenBLAS may order differently.
double MaxAbs(const std::vector<float>& a) {
  double m = 0;
  for (float x : a) m = std::max(m, static_cast<double>(std::abs(x)));
  return m;
}

// Token-by-token decoding: one Forward call per token.
std::vector<float> Decode(const LlamaModel& m, AttentionCache* c, const std::vector<int32_t>& t) {
  std::vector<float> all, one;
  for (size_t i = 0; i < t.size(); ++i) {
    EXPECT_TRUE(m.Forward(t.data() + i, 1, static_cast<int64_t>(i), c, 0, &one).ok());
    all.insert(all.end(), one.begin(), one.end());
  }
  return all;
}

TEST(Llama, LoadsTinyModelAndRejectsMissingTensors) {
  auto f = TinyModel();
  auto m = LlamaModel::Load(*f);
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ((*m)->config().head_dim, 64);
  EXPECT_EQ((*m)->config().vocab, kVocab);
  GgufWriter w;
  w.AddString("general.architecture", "llama");
  const auto b = w.Finish();
  const std::string path = ::testing::TempDir() + "/empty_llama.gguf";
  std::ofstream(path, std::ios::binary).write(reinterpret_cast<const char*>(b.data()), b.size());
  auto e = GgufFile::Open(path);
  ASSERT_TRUE(e.ok());
  EXPECT_FALSE(LlamaModel::Load(**e).ok());
}

// The value metric of each KV head is the Gram matrix of the output projection's columns
// that read its query heads (the file's attn_output.weight, ne[0] = q_heads * head_dim the
// fastest), summed over the group (or, heads together, of the group's summed columns):
// checked against the sums written out from the file.
TEST(Llama, OutputProjectionMetricIsTheGroupsGramMatrix) {
  auto f = TinyModel();
  auto m = LlamaModel::Load(*f);
  ASSERT_TRUE(m.ok()) << m.status();
  const LlamaConfig& c = (*m)->config();
  const int D = c.head_dim, group = c.q_heads / c.kv_heads, in = c.q_heads * D;
  ASSERT_GT(group, 1);  // the sum over a group is exercised
  const std::vector<float> metric = (*m)->OutputProjectionMetric();
  const std::vector<float> together = (*m)->OutputProjectionMetric(/*heads_together=*/true);
  ASSERT_EQ(metric.size(), static_cast<size_t>(c.layers) * c.kv_heads * D * D);
  ASSERT_EQ(together.size(), metric.size());
  for (int l = 0; l < c.layers; ++l) {
    auto wo = f->Dequantize(absl::StrCat("blk.", l, ".attn_output.weight"));
    ASSERT_TRUE(wo.ok()) << wo.status();
    for (int h = 0; h < c.kv_heads; ++h)
      for (int a = 0; a < D; ++a)
        for (int b = 0; b < D; ++b) {
          double want = 0, want_together = 0;
          for (int i = 0; i < c.hidden; ++i) {
            double sa = 0, sb = 0;
            for (int q = h * group; q < (h + 1) * group; ++q) {
              want += double((*wo)[i * in + q * D + a]) * (*wo)[i * in + q * D + b];
              sa += (*wo)[i * in + q * D + a];
              sb += (*wo)[i * in + q * D + b];
            }
            want_together += sa * sb;
          }
          const size_t at = ((static_cast<size_t>(l) * c.kv_heads + h) * D + a) * D + b;
          const float got = metric[at];
          ASSERT_NEAR(got, want, 1e-4 * (1 + std::fabs(want)))
              << l << " " << h << " " << a << " " << b;
          ASSERT_NEAR(together[at], want_together, 1e-4 * (1 + std::fabs(want_together)));
          ASSERT_EQ(got, metric[((static_cast<size_t>(l) * c.kv_heads + h) * D + b) * D + a]);
        }
  }
}

TEST(Llama, DenseChunkedPrefillEqualsOneShotAndDecode) {
  auto f = TinyModel();
  auto m = *LlamaModel::Load(*f);
  const auto t = Tokens(70);
  DenseCache a(m->config().cache_shape()), b(m->config().cache_shape()),
      c(m->config().cache_shape());
  std::vector<float> one, chunked;
  ASSERT_TRUE(m->Forward(t.data(), 70, 0, &a, 0, &one).ok());
  ASSERT_TRUE(m->ForwardDecodeFaithful(t.data(), 70, 0, &b, 0, &chunked, 13).ok());
  // Logits are O(10-40) here; fp32 sums over different chunk shapes differ by ~1e-4 relative.
  EXPECT_LT(MaxDiff(one, chunked), 1e-2);
  EXPECT_LT(MaxDiff(one, Decode(*m, &c, t)), 1e-2);
}

TEST(Llama, DecodeFaithfulCodecMatchesTokenByTokenDecoding) {
  auto f = TinyModel();
  auto m = *LlamaModel::Load(*f);
  const auto t = Tokens(100);
  core::CodecOptions o;
  o.key_bits = 2;
  o.value_bits = 2;
  o.key_group = 32;
  for (int window : {0, 16}) {
    o.window = window;
    auto faithful = *CodecCache::Create(m->config().cache_shape(), o, nullptr);
    auto decode = *CodecCache::Create(m->config().cache_shape(), o, nullptr);
    auto prefill = *CodecCache::Create(m->config().cache_shape(), o, nullptr);
    std::vector<float> lf, lp;
    ASSERT_TRUE(m->ForwardDecodeFaithful(t.data(), 100, 0, faithful.get(), 0, &lf).ok());
    const std::vector<float> ld = Decode(*m, decode.get(), t);
    ASSERT_TRUE(m->Forward(t.data(), 100, 0, prefill.get(), 0, &lp).ok());
    const double faithful_err = MaxDiff(lf, ld), prefill_err = MaxDiff(lp, ld);
    std::printf("R=%d: decode-faithful vs decode %.3g, one-shot prefill vs decode %.3g\n", window,
                faithful_err, prefill_err);
    // The two runs compute the same rows in sgemm calls of different shapes, whose fp32 sums
    // round differently per CPU (OpenBLAS picks its kernel at run time: 0.006-0.013 seen on
    // AVX-512 machines); 2-bit codes can amplify such a difference. 5e-2 is still ~1e-3 of the
    // logits and three orders below the one-shot prefill's gap checked next.
    EXPECT_LT(faithful_err, 5e-2) << "R " << window;
    EXPECT_GT(prefill_err, 1.0) << "R " << window;  // the check above is not vacuous
    EXPECT_EQ(faithful->Size().encoded_tokens, decode->Size().encoded_tokens);
  }
}

// A batch of windows through one forward equals each window alone: kvq-eval's perplexity runs
// windows batched, and its figures (and the remote = in-process checks) rely on this.
TEST(Llama, BatchedWindowsEqualEachWindowAlone) {
  auto f = TinyModel();
  auto m = *LlamaModel::Load(*f);
  const auto t = Tokens(3 * 100);
  core::CodecOptions o;
  o.key_bits = 2;
  o.value_bits = 2;
  o.key_group = 32;
  std::vector<std::unique_ptr<CodecCache>> batched;
  std::vector<AttentionCache*> caches;
  std::vector<const int32_t*> toks;
  for (int s = 0; s < 3; ++s) {
    batched.push_back(*CodecCache::Create(m->config().cache_shape(), o, nullptr));
    caches.push_back(batched.back().get());
    toks.push_back(t.data() + s * 100);
  }
  std::vector<std::vector<float>> lb;
  ASSERT_TRUE(m->ForwardDecodeFaithfulBatch(toks, 100, 0, caches, 50, &lb).ok());
  ASSERT_EQ(lb.size(), 3u);
  for (int s = 0; s < 3; ++s) {
    auto alone = *CodecCache::Create(m->config().cache_shape(), o, nullptr);
    std::vector<float> la;
    ASSERT_TRUE(m->ForwardDecodeFaithful(toks[s], 100, 0, alone.get(), 50, &la).ok());
    ASSERT_EQ(la.size(), static_cast<size_t>(50) * kVocab);
    ASSERT_EQ(lb[s].size(), la.size());
    // This model's products are small enough for OpenBLAS's small-matrix kernels, whose sums
    // depend on the row count, and 2-bit codes amplify a flipped rounding: 4e-5 of logits up
    // to 83 with OpenBLAS's SkylakeX kernels, 7e-3 with its Haswell/Zen ones (an AMD EPYC);
    // 1e-3 of the logits' scale, where different windows differ by more than the scale. At
    // real models' sizes rows are equal bit for bit (real_model_test checks that).
    EXPECT_LT(MaxDiff(la, lb[s]), 1e-3 * MaxAbs(la)) << "window " << s;
    EXPECT_EQ(alone->Size().encoded_tokens, batched[s]->Size().encoded_tokens);
  }
  // Different windows give different logits (the batch does not repeat one window).
  EXPECT_GT(MaxDiff(lb[0], lb[1]), 0.1 * MaxAbs(lb[0]));
  // Caches that encode at different positions cannot share a chunking.
  auto first = *CodecCache::Create(m->config().cache_shape(), o, nullptr);
  o.key_group = 64;
  auto other = *CodecCache::Create(m->config().cache_shape(), o, nullptr);
  EXPECT_EQ(
      m->ForwardDecodeFaithfulBatch({toks[0], toks[1]}, 100, 0, {first.get(), other.get()}, 50, &lb)
          .code(),
      absl::StatusCode::kInvalidArgument);
}

// qwen2 rotates the two halves of each head; llama adjacent pairs. A qwen2 model and the llama
// model whose Q/K rows (and biases) are permuted from halves to pairs compute the same
// attention scores, so the same logits; without the permutation they differ.
TEST(Llama, Qwen2HalvesRopeEqualsLlamaPairsOnPermutedRows) {
  TinyOptions q;
  q.arch = "qwen2";
  q.biases = true;
  TinyOptions l = q;
  l.arch = "llama";
  l.halves_to_pairs = true;
  TinyOptions l_unpermuted = q;
  l_unpermuted.arch = "llama";
  auto fq = TinyModel(q), fl = TinyModel(l), fu = TinyModel(l_unpermuted);
  auto mq = LlamaModel::Load(*fq);
  auto ml = LlamaModel::Load(*fl);
  auto mu = LlamaModel::Load(*fu);
  ASSERT_TRUE(mq.ok()) << mq.status();
  ASSERT_TRUE(ml.ok()) << ml.status();
  ASSERT_TRUE(mu.ok()) << mu.status();
  EXPECT_EQ((*mq)->config().rope_layout, RopeLayout::kHalves);
  EXPECT_EQ((*ml)->config().rope_layout, RopeLayout::kAdjacentPairs);
  EXPECT_STREQ(RopeLayoutName((*mq)->config().rope_layout), "halves");
  EXPECT_STREQ(RopeLayoutName((*ml)->config().rope_layout), "adjacent_pairs");
  const auto t = Tokens(40);
  auto run = [&](const LlamaModel& m) {
    DenseCache c(m.config().cache_shape());
    std::vector<float> out;
    EXPECT_TRUE(m.Forward(t.data(), 40, 0, &c, 0, &out).ok());
    return out;
  };
  const auto lq = run(**mq), ll = run(**ml), lu = run(**mu);
  // The permuted rows sum in another order: 6e-3 of logits up to 77 with OpenBLAS's Haswell/Zen
  // kernels (1e-3 of the scale allowed); the unpermuted layout is off by half the scale.
  EXPECT_LT(MaxDiff(lq, ll), 1e-3 * MaxAbs(lq));
  EXPECT_GT(MaxDiff(lq, lu), 0.1 * MaxAbs(lq));  // the layouts differ: not vacuous
}

TEST(Llama, BiasesAndOutputWeightAreUsed) {
  const auto t = Tokens(20);
  auto run = [&](const TinyOptions& o) {
    auto f = TinyModel(o);
    auto m = LlamaModel::Load(*f);
    EXPECT_TRUE(m.ok()) << m.status();
    DenseCache c((*m)->config().cache_shape());
    std::vector<float> out;
    EXPECT_TRUE((*m)->Forward(t.data(), 20, 0, &c, 0, &out).ok());
    return out;
  };
  TinyOptions plain, bias, out1, out2;
  bias.biases = true;  // a llama file with biases uses them
  out1.output_scale = 1.0f;
  out2.output_scale = 2.0f;
  const auto lp = run(plain), lb = run(bias), l1 = run(out1), l2 = run(out2);
  EXPECT_GT(MaxDiff(lb, lp), 0.1);
  // output.weight = token_embd: the tied logits; = 2 x token_embd: twice those (the tied
  // embedding is not what the head reads).
  EXPECT_LT(MaxDiff(l1, lp), 1e-4);
  ASSERT_EQ(l1.size(), l2.size());
  double worst = 0;
  for (size_t i = 0; i < l1.size(); ++i)
    worst = std::max(worst, static_cast<double>(std::abs(l2[i] - 2 * l1[i])));
  EXPECT_LT(worst, 1e-3);
}

TEST(Llama, UnsupportedArchitectureTensorsAndMetadataAreNamedErrors) {
  TinyOptions arch;
  arch.arch = "gemma";
  auto fa = TinyModel(arch);
  auto ma = LlamaModel::Load(*fa);
  EXPECT_EQ(ma.status().code(), absl::StatusCode::kUnimplemented);
  EXPECT_NE(ma.status().message().find("architecture gemma"), std::string::npos) << ma.status();
  TinyOptions tensor;
  tensor.extra_tensor = "blk.0.attn_q_norm.weight";
  auto ft = TinyModel(tensor);
  auto mt = LlamaModel::Load(*ft);
  EXPECT_EQ(mt.status().code(), absl::StatusCode::kUnimplemented);
  EXPECT_NE(mt.status().message().find("blk.0.attn_q_norm.weight"), std::string::npos)
      << mt.status();
  TinyOptions key;
  key.extra_key = "rope.scaling.type";
  auto fk = TinyModel(key);
  auto mk = LlamaModel::Load(*fk);
  EXPECT_EQ(mk.status().code(), absl::StatusCode::kUnimplemented);
  EXPECT_NE(mk.status().message().find("llama.rope.scaling.type"), std::string::npos)
      << mk.status();
  TinyOptions qwen_no_bias;
  qwen_no_bias.arch = "qwen2";
  auto fq = TinyModel(qwen_no_bias);
  auto mq = LlamaModel::Load(*fq);
  EXPECT_FALSE(mq.ok());
  EXPECT_NE(mq.status().message().find("bias"), std::string::npos) << mq.status();
}

// Counts out of range are named errors before anything is sized by them. A block_count of
// 2^32 - 1 (an int of -1) in a file without layer tensors resized the layers to 2^64 - 1
// (std::length_error, an abort); a billion spent minutes naming a billion layers' tensors.
TEST(Llama, CountsOutOfRangeAreNamedErrors) {
  auto file = [](uint32_t layers, uint32_t heads) {
    GgufWriter w;
    w.AddString("general.architecture", "llama");
    w.AddUint32("llama.block_count", layers);
    w.AddUint32("llama.embedding_length", kH);
    w.AddUint32("llama.attention.head_count", heads);
    w.AddUint32("llama.attention.head_count_kv", 1);
    w.AddUint32("llama.feed_forward_length", kF);
    w.AddFloat32("llama.attention.layer_norm_rms_epsilon", 1e-5f);
    w.AddTensor("token_embd.weight", {kH, 4}, static_cast<uint32_t>(GgmlType::kF32),
                std::vector<uint8_t>(kH * 4 * 4, 0));
    w.AddTensor("output_norm.weight", {kH}, static_cast<uint32_t>(GgmlType::kF32),
                std::vector<uint8_t>(kH * 4, 0));
    const auto b = w.Finish();
    auto f = GgufFile::FromBytes(std::string(b.begin(), b.end()));
    EXPECT_TRUE(f.ok()) << f.status();
    return std::move(*f);
  };
  for (uint32_t layers : {0xFFFFFFFFu, 0u, 1000000000u}) {
    auto m = LlamaModel::Load(*file(layers, kHeads));
    EXPECT_EQ(m.status().code(), absl::StatusCode::kInvalidArgument) << layers;
    EXPECT_NE(m.status().message().find(
                  absl::StrCat("llama.block_count = ", layers, " is outside 1..4096")),
              std::string::npos)
        << m.status();
  }
  auto h = LlamaModel::Load(*file(1, 1u << 31));
  EXPECT_NE(h.status().message().find("llama.attention.head_count = 2147483648 is outside 1..4096"),
            std::string::npos)
      << h.status();
}

}  // namespace
}  // namespace kvq::frontend
