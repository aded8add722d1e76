// Codec levers that kvq-eval measures around the serving codec without it knowing: a fraction
// of key or value elements kept exactly beside the codes (dense-and-sparse, KVQuant), keys
// quantized before RoPE (KVQuant), and non-uniform per-layer code books (KVQuant's nuq, nuq.h).
// They are evaluation-only rows of docs/RESULTS.md, not codec settings: a lever that pays would
// move into core (the block format, the readers) first.
//
// LeverFeed stands between the forward pass and one layer's LayerCache: it holds the layer's
// rows as sent until a whole key group has arrived, then trims the group's outliers (each
// kept exact, at fp16 plus a 16-bit position: 32 bits counted per element) and/or rotates its
// keys back to before RoPE, compands its quantization groups through the layer's code books,
// and appends the group, which the LayerCache encodes at once (window 0). Reads decode the
// layer, expand the groups back, put the exact elements back, redo RoPE, and add the rows not
// yet fed as sent: what attention would see from such a codec.
#pragma once

#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "kvq/core/cache.h"
#include "kvq/core/codec.h"
#include "kvq/core/outliers.h"
#include "kvq/frontend/nuq.h"
#include "kvq/frontend/rope.h"

namespace kvq::frontend {

struct EvalLevers {
  int key_outliers_permille = 0;    // spk<N>: N / 1000 of key elements kept exact
  int value_outliers_permille = 0;  // spv<N>: the same for values
  bool keys_before_rope = false;    // pre: keys quantized before RoPE
  bool nuq_keys = false;            // nuq, nuqk: keys on per-layer non-uniform code books
  bool nuq_values = false;          // nuq (kv targets): values on them too
  Rope rope;                        // the model's, for keys_before_rope (kvq-eval fills it)
  // The fitted books (kvq-eval fits them on calibration text, FitCodeBooks); null while
  // fitting: the feeds then code uniformly and count where the elements fall.
  std::shared_ptr<const CodeBooks> books;
  bool any() const {
    return key_outliers_permille > 0 || value_outliers_permille > 0 || keys_before_rope ||
           nuq_keys || nuq_values;
  }
};

// Bits each exactly kept element costs: its fp16 value and a 16-bit position in its block.
inline constexpr int kOutlierBits = 32;

// Why `levers` cannot run with codec `o` (empty when they can). Outliers are trimmed in the
// coordinates the codec quantizes, so they exclude a rotation of the same tensor; keys before
// RoPE exclude what is fitted to post-RoPE queries (a side code, metric rounding); code books
// exclude what works on the uniform codes' residual or their choice (a side code, metric
// rounding, a rotation of the same tensor); all need window 0 and a codec that is read by
// decoding (no A^2 per-token widths).
absl::Status CheckLevers(const EvalLevers& levers, const core::CodecOptions& o);

// Dense-and-sparse trimming: core::TrimOutliers (kvq/core/outliers.h).
using core::TrimOutliers;

class LeverFeed {
 public:
  // `layer`: which of the levers' code books this feed uses.
  LeverFeed(const EvalLevers& levers, const core::CodecOptions& o, int kv_heads, bool keys_only,
            int layer);

  // Appends rows k, v [n][kv_heads][head_dim] (post-RoPE, fp32) at [start, start + n),
  // feeding each completed key group to `lc`.
  absl::Status Append(core::LayerCache& lc, const float* k, const float* v, int64_t start, int n);

  // Keys and values as attention sees them, [kv_heads][tokens][head_dim] each (values left
  // empty for keys_only).
  absl::Status Read(const core::LayerCache& lc, std::vector<float>* keys,
                    std::vector<float>* values) const;

  int64_t tokens() const { return tokens_; }
  // What the exactly kept elements cost, in bytes.
  int64_t key_outlier_bytes() const { return key_exact_.size() * kOutlierBits / 8; }
  int64_t value_outlier_bytes() const { return value_exact_.size() * kOutlierBits / 8; }
  // Where the fed elements fell in their groups (counted while the levers have no books).
  const UnitHistogram& key_histogram() const { return key_hist_; }
  const UnitHistogram& value_histogram() const { return value_hist_; }

 private:
  struct Exact {
    int64_t t;  // position
    int head, channel;
    float value;  // as fed (fp16-rounded; before RoPE for keys_before_rope)
  };
  absl::Status FeedGroup(core::LayerCache& lc);
  // The quantization groups of the key group at t0, as element indices into its rows
  // [G][kv][d]: keys per channel over the tokens, values per token over value_group channels
  // (the first group's fp16 sinks excluded).
  std::vector<std::vector<int64_t>> Units(bool keys, int64_t t0) const;
  void Trim(std::vector<float>* rows, int permille, bool keys, int64_t t0,
            std::vector<Exact>* exact) const;
  // Through the layer's book: compands each group of `rows` and records its range, or (no
  // books yet) counts where its elements fall.
  void Compand(std::vector<float>* rows, bool keys, int64_t t0);
  // Expands the decoded groups of `rows` [kv][T][d] (the fed tokens) back onto their levels.
  void Expand(std::vector<float>* rows, bool keys, int64_t T) const;

  EvalLevers levers_;
  core::CodecOptions o_;
  int kv_heads_;
  bool keys_only_;
  int64_t tokens_ = 0, fed_ = 0;
  // Rows as sent, fp16-rounded, [tokens][kv][d]: keys post-RoPE (fed as they are, and
  // attention's view of the rows not yet fed), the same keys rotated back before RoPE (only
  // for keys_before_rope: those are fed then), values.
  std::vector<float> keys_sent_, keys_before_rope_, values_;
  std::vector<Exact> key_exact_, value_exact_;
  const std::vector<float>* key_book_ = nullptr;  // the layer's levels (null: uniform)
  const std::vector<float>* value_book_ = nullptr;
  // Each companded group's (min, max), in Units() order, group after group.
  std::vector<std::pair<float, float>> key_ranges_, value_ranges_;
  UnitHistogram key_hist_, value_hist_;
};

}  // namespace kvq::frontend
