// The forward pass on a tiny synthetic Llama written as GGUF by the test (random F32
// weights): chunked prefill equals one-shot prefill on the dense cache, and with the codec
// cache ForwardDecodeFaithful equals true token-by-token decoding, while a one-shot prefill
// does not (it lets queries see keys of their own group already quantized).
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <fstream>
#include <random>

#include "gtest/gtest.h"
#include "kvq/frontend/attention_cache.h"
#include "kvq/frontend/gguf.h"
#include "kvq/frontend/llama.h"

namespace kvq::frontend {
namespace {

constexpr int kH = 128, kHeads = 2, kKv = 1, kF = 96, kVocab = 40, kLayers = 2;

std::unique_ptr<GgufFile> TinyModel() {
  std::mt19937_64 rng(42);
  std::normal_distribution<float> nd;
  GgufWriter w;
  w.AddString("general.architecture", "llama");
  w.AddUint32("llama.block_count", kLayers);
  w.AddUint32("llama.embedding_length", kH);
  w.AddUint32("llama.attention.head_count", kHeads);
  w.AddUint32("llama.attention.head_count_kv", kKv);
  w.AddUint32("llama.feed_forward_length", kF);
  w.AddFloat32("llama.attention.layer_norm_rms_epsilon", 1e-5f);
  w.AddFloat32("llama.rope.freq_base", 10000.0f);
  auto tensor = [&](const std::string& name, std::vector<int64_t> dims, float scale, float mean = 0) {
    int64_t n = 1;
    for (auto d : dims) n *= d;
    std::vector<float> v(n);
    for (auto& x : v) x = mean + scale * nd(rng);
    std::vector<uint8_t> b(n * 4);
    std::memcpy(b.data(), v.data(), b.size());
    w.AddTensor(name, dims, static_cast<uint32_t>(GgmlType::kF32), b);
  };
  tensor("token_embd.weight", {kH, kVocab}, 1.0f);
  tensor("output_norm.weight", {kH}, 0.1f, 1.0f);
  for (int l = 0; l < kLayers; ++l) {
    const std::string p = "blk." + std::to_string(l) + ".";
    tensor(p + "attn_norm.weight", {kH}, 0.1f, 1.0f);
    tensor(p + "attn_q.weight", {kH, kH}, 0.25f);
    tensor(p + "attn_k.weight", {kH, kKv * 64}, 0.25f);
    tensor(p + "attn_v.weight", {kH, kKv * 64}, 0.1f);
    tensor(p + "attn_output.weight", {kH, kH}, 0.1f);
    tensor(p + "ffn_norm.weight", {kH}, 0.1f, 1.0f);
    tensor(p + "ffn_gate.weight", {kH, kF}, 0.1f);
    tensor(p + "ffn_up.weight", {kH, kF}, 0.1f);
    tensor(p + "ffn_down.weight", {kF, kH}, 0.1f);
  }
  const auto bytes = w.Finish();
  const std::string path = ::testing::TempDir() + "/tiny_llama_" + std::to_string(::getpid()) + ".gguf";
  std::ofstream(path, std::ios::binary).write(reinterpret_cast<const char*>(bytes.data()), bytes.size());
  auto f = GgufFile::Open(path);
  EXPECT_TRUE(f.ok()) << f.status();
  return std::move(*f);
}

std::vector<int32_t> Tokens(int n) {
  std::vector<int32_t> t(n);
  for (int i = 0; i < n; ++i) t[i] = (i * 7 + 3) % kVocab;
  return t;
}

double MaxDiff(const std::vector<float>& a, const std::vector<float>& b) {
  EXPECT_EQ(a.size(), b.size());
  double m = 0;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) m = std::max(m, static_cast<double>(std::abs(a[i] - b[i])));
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

TEST(Llama, DenseChunkedPrefillEqualsOneShotAndDecode) {
  auto f = TinyModel();
  auto m = *LlamaModel::Load(*f);
  const auto t = Tokens(70);
  DenseCache a(m->config().cache_shape()), b(m->config().cache_shape()), c(m->config().cache_shape());
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

}  // namespace
}  // namespace kvq::frontend
