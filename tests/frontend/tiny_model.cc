#include "tiny_model.h"

#include <unistd.h>

#include <cstring>
#include <fstream>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "kvq/frontend/tokenizer.h"

namespace kvq::frontend {
namespace {

std::string WriteModel(const GgufWriter& w, const std::string& tag) {
  const auto bytes = w.Finish();
  static int seq = 0;
  const std::string path = ::testing::TempDir() + "/tiny_" + tag + "_" +
                           std::to_string(::getpid()) + "_" + std::to_string(seq++) + ".gguf";
  std::ofstream(path, std::ios::binary)
      .write(reinterpret_cast<const char*>(bytes.data()), bytes.size());
  return path;
}

}  // namespace

std::string WriteTinyModel(const TinyOptions& o) {
  std::mt19937_64 rng(42);
  std::normal_distribution<float> nd;
  GgufWriter w;
  const std::string a = o.arch;
  w.AddString("general.architecture", a);
  w.AddUint32(a + ".block_count", kLayers);
  w.AddUint32(a + ".embedding_length", kH);
  w.AddUint32(a + ".attention.head_count", kHeads);
  w.AddUint32(a + ".attention.head_count_kv", kKv);
  w.AddUint32(a + ".feed_forward_length", kF);
  w.AddFloat32(a + ".attention.layer_norm_rms_epsilon", 1e-5f);
  w.AddFloat32(a + ".rope.freq_base", 10000.0f);
  if (!o.extra_key.empty()) w.AddString(a + "." + o.extra_key, "linear");
  const int vocab = o.byte_tokenizer ? kByteVocab : kVocab;
  if (o.byte_tokenizer) {
    w.AddString("tokenizer.ggml.model", "gpt2");
    w.AddString("tokenizer.ggml.pre", "gpt2");
    w.AddStringArray("tokenizer.ggml.tokens", Tokenizer::ByteSymbols());
    w.AddStringArray("tokenizer.ggml.merges", {});
  }
  auto put = [&](const std::string& name, std::vector<int64_t> dims, const std::vector<float>& v) {
    std::vector<uint8_t> b(v.size() * 4);
    std::memcpy(b.data(), v.data(), b.size());
    w.AddTensor(name, dims, static_cast<uint32_t>(GgmlType::kF32), b);
  };
  // Biases come from their own generator, so that files with and without them share every
  // other weight.
  std::mt19937_64 bias_rng(7);
  auto random = [&](std::vector<int64_t> dims, float scale, float mean = 0, bool bias = false) {
    int64_t n = 1;
    for (auto d : dims) n *= d;
    std::vector<float> v(n);
    for (auto& x : v) x = mean + scale * nd(bias ? bias_rng : rng);
    return v;
  };
  auto tensor = [&](const std::string& name, std::vector<int64_t> dims, float scale,
                    float mean = 0) { put(name, dims, random(dims, scale, mean)); };
  // Rows of a Q/K projection (or bias), head by head: row i of a head in halves order goes to
  // 2i (i < 32) or 2(i - 32) + 1 in adjacent-pairs order, so that both layouts rotate the same
  // channel pairs.
  auto permute = [&](std::vector<float> v, int64_t row_len) {
    if (!o.halves_to_pairs) return v;
    std::vector<float> out(v.size());
    const int64_t rows = static_cast<int64_t>(v.size()) / row_len;
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t head = r / 64, i = r % 64;
      const int64_t to = head * 64 + (i < 32 ? 2 * i : 2 * (i - 32) + 1);
      std::copy_n(v.begin() + r * row_len, row_len, out.begin() + to * row_len);
    }
    return out;
  };
  const std::vector<float> emb = random({kH, vocab}, 1.0f);
  put("token_embd.weight", {kH, vocab}, emb);
  if (o.output_scale > 0) {
    std::vector<float> out = emb;
    for (auto& x : out) x *= o.output_scale;
    put("output.weight", {kH, vocab}, out);
  }
  tensor("output_norm.weight", {kH}, 0.1f, 1.0f);
  for (int l = 0; l < kLayers; ++l) {
    const std::string p = "blk." + std::to_string(l) + ".";
    tensor(p + "attn_norm.weight", {kH}, 0.1f, 1.0f);
    put(p + "attn_q.weight", {kH, kH}, permute(random({kH, kH}, 0.25f), kH));
    put(p + "attn_k.weight", {kH, kKv * 64}, permute(random({kH, kKv * 64}, 0.25f), kH));
    tensor(p + "attn_v.weight", {kH, kKv * 64}, 0.1f);
    tensor(p + "attn_output.weight", {kH, kH}, 0.1f);
    tensor(p + "ffn_norm.weight", {kH}, 0.1f, 1.0f);
    tensor(p + "ffn_gate.weight", {kH, kF}, 0.1f);
    tensor(p + "ffn_up.weight", {kH, kF}, 0.1f);
    tensor(p + "ffn_down.weight", {kF, kH}, 0.1f);
    if (o.biases) {
      put(p + "attn_q.bias", {kH}, permute(random({kH}, 0.5f, 0, true), 1));
      put(p + "attn_k.bias", {kKv * 64}, permute(random({kKv * 64}, 0.5f, 0, true), 1));
      put(p + "attn_v.bias", {kKv * 64}, random({kKv * 64}, 0.5f, 0, true));
    }
  }
  if (!o.extra_tensor.empty()) tensor(o.extra_tensor, {kH}, 1.0f);
  return WriteModel(w, o.byte_tokenizer ? a + "_bytes" : a);
}

std::unique_ptr<GgufFile> TinyModel(const TinyOptions& o) {
  auto f = GgufFile::Open(WriteTinyModel(o));
  EXPECT_TRUE(f.ok()) << f.status();
  return f.ok() ? std::move(*f) : nullptr;
}

}  // namespace kvq::frontend
