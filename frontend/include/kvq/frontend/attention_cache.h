// The KV cache as the Llama forward pass sees it: one object per sequence, holding every
// layer. The forward pass appends the post-RoPE keys and values of a chunk of tokens to a
// layer and immediately attends the chunk's queries over everything cached so far (causal).
//
// Implementations: DenseCache (fp16-rounded keys and values, exact attention), CodecCache
// (in-process kvq codec: kvq::core::LayerCache per layer) and, later, a remote cache over the kvq
// gRPC client.
//
// Layouts (fp32, contiguous): k, v [n][kv_heads][head_dim] (the projection output rows);
// q and out [q_heads][n][head_dim]. Query i of the chunk sits at position start + i and sees
// cached positions [0, start + i].
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "kvq/core/basis.h"
#include "kvq/core/cache.h"
#include "kvq/core/codec.h"
#include "kvq/frontend/eval_levers.h"

namespace kvq::frontend {

struct CacheShape {
  int layers = 0;
  int q_heads = 0;
  int kv_heads = 0;
  int head_dim = 0;
};

class AttentionCache {
 public:
  virtual ~AttentionCache() = default;
  // Appends n tokens at positions [start, start + n) to `layer` (start == tokens(layer)),
  // then writes the attention of the n queries to out.
  virtual absl::Status AppendAndAttend(int layer, const float* k, const float* v, int64_t start,
                                       int n, const float* q, float* out) = 0;
  virtual int64_t tokens(int layer) const = 0;
  // Size accounting summed over layers (zero for the dense cache).
  virtual core::SizeReport Size() const { return {}; }
  // The token count at which the next group gets encoded (given `tokens` cached now), or -1
  // when nothing is ever encoded (dense). Later encodes follow every EncodeGroup() tokens. The
  // decode-faithful driver (llama.h) cuts chunks at these counts, so that each query sees
  // exactly what it would see when decoding one token at a time.
  virtual int64_t NextEncodeBoundary(int64_t tokens) const { return -1; }
  virtual int64_t EncodeGroup() const { return 0; }
};

class DenseCache : public AttentionCache {
 public:
  explicit DenseCache(const CacheShape& s);
  absl::Status AppendAndAttend(int layer, const float* k, const float* v, int64_t start, int n,
                               const float* q, float* out) override;
  int64_t tokens(int layer) const override { return static_cast<int64_t>(k_[layer].size()) / row_; }

 private:
  CacheShape s_;
  int64_t row_;
  std::vector<std::vector<float>> k_, v_;  // per layer [tokens][kv_heads][d]
};

// One kvq::core::LayerCache per layer. head_ranks (optional): a HeadQ rank per layer and KV
// head ([layer][kv head], each <= the basis rank) instead of o.rank everywhere. basis: the model's
// basis (rank >= o.rank; the first o.rank columns are used) or null for rank 0. Keys and values are
// sent as fp16, as a serving frontend would, so the full-precision window holds fp16 and is counted
// at 16 bits. The A^2 value policy sees only what LayerCache records itself: attention of queries
// at positions up to the newest token (earlier readouts), never later queries. How CodecCache reads
// attention: kDecode takes keys and values as attention sees them (LayerCache::Decode, what
// GetBlocks serves: keys as base + U z_hat, giving exactly the HeadQ scores up to float rounding)
// and attends locally with BLAS; kAttend calls the codec's fused LayerCache::Attend. The A^2 value
// policy always uses kAttend, because its weights come from the readouts the cache observes.
// Reads do not verify block checksums (core::ReadPolicy): an evaluation's blocks never leave
// its own memory, and checksums guard storage, not arithmetic.
enum class CodecRead { kDecode, kAttend };

// How a CodecCache is built beyond its codec and basis.
struct CodecCacheOptions {
  bool keys_only = false;  // values kept dense (fp32), keys through the codec
  CodecRead read = CodecRead::kDecode;
  const std::vector<std::vector<int>>* head_ranks = nullptr;  // see above; null: o.rank
  bool probe = false;                                         // A^2 probe queries with each append
  // Round value codes in the basis's value metric (ModelBasis::value_metric, which must be
  // there): kvq-eval's vmr experiment, not a codec setting (core::LayerCache's value_metric).
  bool value_metric_rounding = false;
};

class CodecCache : public AttentionCache {
 public:
  static absl::StatusOr<std::unique_ptr<CodecCache>> Create(const CacheShape& s,
                                                            const core::CodecOptions& o,
                                                            const core::ModelBasis* basis,
                                                            const CodecCacheOptions& options = {});
  absl::Status AppendAndAttend(int layer, const float* k, const float* v, int64_t start, int n,
                               const float* q, float* out) override;
  int64_t tokens(int layer) const override {
    return feeds_.empty() ? layers_[layer]->tokens() : feeds_[layer].tokens();
  }
  core::SizeReport Size() const override;
  // Evaluation-only levers (eval_levers.h), before the first append; read by decoding.
  absl::Status SetLevers(const EvalLevers& levers);
  // The levers' per-layer feeds (empty without levers).
  const std::vector<LeverFeed>& feeds() const { return feeds_; }
  int64_t NextEncodeBoundary(int64_t tokens) const override;
  int64_t EncodeGroup() const override { return o_.key_group; }

 private:
  CodecCache(const CacheShape& s, const core::CodecOptions& o) : s_(s), o_(o) {}
  void LocalAttendSplit(const float* q, int n, int64_t start, int64_t T, const float* K,
                        const float* V, float* out) const;
  absl::Status AppendWithProbes(core::LayerCache& lc, const uint16_t* kh, const uint16_t* vh,
                                int64_t start, int n, const float* q);
  CodecRead read_ = CodecRead::kDecode;
  bool probe_ = false;
  CacheShape s_;
  core::CodecOptions o_;
  // keys_only: scores from the codec (Score), values read dense from fp16-rounded copies.
  bool keys_only_ = false;
  std::vector<std::vector<float>> dense_v_;  // per layer [tokens][kv_heads][d]
  std::vector<std::unique_ptr<core::LayerCache>> layers_;
  std::vector<LeverFeed> feeds_;              // per layer, when levers are set
  std::vector<std::vector<int>> head_ranks_;  // [layer][kv head], when given
};

}  // namespace kvq::frontend
