// A Llama-family decoder on the CPU, loaded from GGUF: RMSNorm, RoPE, grouped-query attention
// through an AttentionCache, SwiGLU FFN, tied or separate output embedding. Two architectures
// (general.architecture), which differ only where the file says so:
//   llama  RoPE on adjacent pairs (x[2i], x[2i+1]) (the converter permuted Q/K rows for it);
//   qwen2  RoPE on the two halves (x[i], x[i + n/2]) (llama.cpp's NEOX mode), Q/K/V biases.
// Optional tensors (Q/K/V biases, output.weight) are used whenever the file has them; any
// tensor or metadata the forward pass does not implement is an UNIMPLEMENTED error naming
// it. Weights are dequantized to fp32 at load; matrix products go through OpenBLAS sgemm
// (thread count set by the caller, default 2).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "kvq/frontend/attention_cache.h"
#include "kvq/frontend/gguf.h"
#include "kvq/frontend/rope.h"

namespace kvq::frontend {

// How RoPE pairs the channels of a head. The names are the basis registry's rope_layout.
enum class RopeLayout { kAdjacentPairs, kHalves };
const char* RopeLayoutName(RopeLayout layout);  // "adjacent_pairs" / "halves"

struct LlamaConfig {
  std::string arch;  // general.architecture
  RopeLayout rope_layout = RopeLayout::kAdjacentPairs;
  int layers = 0, hidden = 0, q_heads = 0, kv_heads = 0, head_dim = 0, ffn = 0, vocab = 0;
  float rms_eps = 1e-5f;
  float rope_base = 10000.0f;
  int rope_dims = 0;  // rotated dimensions per head (== head_dim for both architectures here)
  int64_t context_length = 0;
  CacheShape cache_shape() const { return {layers, q_heads, kv_heads, head_dim}; }
};

// Called once per layer and chunk with the post-RoPE queries [q_heads][n][d] and the
// post-RoPE keys and values [n][kv_heads][d] of tokens at positions [start, start + n).
using ActivationHook = std::function<void(int layer, int64_t start, int n, const float* q,
                                          const float* k, const float* v)>;

class LlamaModel {
 public:
  static absl::StatusOr<std::unique_ptr<LlamaModel>> Load(const GgufFile& f);
  const LlamaConfig& config() const { return cfg_; }
  // The rotation this model applies to queries and keys.
  Rope rope() const { return {cfg_.rope_layout == RopeLayout::kHalves, inv_freq_}; }

  // Runs tokens [start, start + n) of one sequence through the model, reading and extending
  // `cache` (which must hold exactly `start` tokens in every layer). Writes logits [n][vocab]
  // for the rows i with logits_from <= i (rows before are skipped to save the output matmul;
  // the output then holds n - logits_from rows). logits may be null.
  absl::Status Forward(const int32_t* tokens, int n, int64_t start, AttentionCache* cache,
                       int logits_from, std::vector<float>* logits,
                       const ActivationHook& hook = nullptr) const;

  // Each KV head's value metric, [layers][kv_heads][head_dim][head_dim]: M = sum over the
  // head's query heads q of W_o,q^T W_o,q, W_o,q [hidden][head_dim] the output projection's
  // columns that read query head q's attention output. A value error dv of one token reaches
  // the layer output as sum_q p_q W_o,q dv; M is its mean square for uncorrelated, equally
  // weighted attention of the group's heads (ModelBasis::value_metric). No text needed.
  // heads_together: the other extreme, every head of the group attending alike:
  // M = (sum_q W_o,q)^T (sum_q W_o,q) (an evaluation variant).
  std::vector<float> OutputProjectionMetric(bool heads_together = false) const;

  // Forward in chunks cut at the cache's encode boundaries (decode-faithful: each query sees
  // exactly the encoded/full-precision split it would see when decoding token by token),
  // at most max_chunk tokens per chunk. Same outputs as Forward.
  absl::Status ForwardDecodeFaithful(const int32_t* tokens, int n, int64_t start,
                                     AttentionCache* cache, int logits_from,
                                     std::vector<float>* logits, int max_chunk = 512,
                                     const ActivationHook& hook = nullptr) const;

  // Several sequences at once, each at the same positions [start, start + n) with its own
  // cache (perplexity windows): the matrix products run on all rows together, so the weights
  // stream from memory once per chunk instead of once per sequence (Qwen2.5-0.5B's fp32
  // weights are 2 GB; a 32-token chunk reads them for 32 rows of work). Attention runs per
  // sequence; the hook is called per sequence, in order. (*logits)[s] is sequence s's rows.
  // OpenBLAS computes a row of a product the same whatever the number of rows around it (checked
  // bit for bit on this machine's SkylakeX kernel, 2..256 rows, at real models' sizes), so each
  // sequence's outputs equal its single-sequence run (real_model_test), except where the single
  // run's product has one row (OpenBLAS's matrix-vector kernel sums in another order) or the
  // shapes are tiny (its small-matrix kernels): llama_test bounds those.
  absl::Status ForwardBatch(const std::vector<const int32_t*>& tokens, int n, int64_t start,
                            const std::vector<AttentionCache*>& caches, int logits_from,
                            std::vector<std::vector<float>>* logits,
                            const ActivationHook& hook = nullptr) const;
  // ForwardDecodeFaithful over a batch: the caches must encode at the same positions (one
  // codec configuration), which is checked.
  absl::Status ForwardDecodeFaithfulBatch(const std::vector<const int32_t*>& tokens, int n,
                                          int64_t start, const std::vector<AttentionCache*>& caches,
                                          int logits_from, std::vector<std::vector<float>>* logits,
                                          int max_chunk = 512,
                                          const ActivationHook& hook = nullptr) const;

 private:
  struct Layer {
    std::vector<float> attn_norm, wq, wk, wv, wo, ffn_norm, wgate, wup, wdown;
    std::vector<float> bq, bk, bv;  // empty when the file has no bias
  };
  LlamaConfig cfg_;
  std::vector<float> tok_embd_, out_norm_, output_;  // output_ empty when tied
  std::vector<Layer> layers_;
  std::vector<float> inv_freq_;
};

// Sets the BLAS thread count (OpenBLAS), for the tools' --threads flag.
void SetBlasThreads(int n);

}  // namespace kvq::frontend
