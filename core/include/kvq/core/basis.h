// Per-model calibration basis (HeadQ's U per layer and KV head) and its files.
//
// On disk a registry entry is a folder: basis.safetensors (one F32 tensor per layer,
// "layer.{l}.u" of shape [kv_heads, head_dim, rank], U row-major per head with orthonormal
// columns) and manifest.json (the fields of BasisManifest). An oblique basis adds
// "layer.{l}.encode" of the same shape (the encode basis A, stored after every layer's U):
// then U is the decode basis B, need not be orthonormal, and A^T B = I per head. The reader
// validates every field, the tensor table, sizes and orthonormality, and that the fingerprint
// matches the tensors.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "kvq/core/env.h"

namespace kvq::core {

struct BasisManifest {
  std::string model;  // e.g. "smollm2-135m-instruct"
  int version = 1;    // basis version (>= 1); a sequence is pinned to one
  int layers = 0;
  int kv_heads = 0;
  int q_heads = 0;  // multiple of kv_heads (grouped-query attention)
  int head_dim = 0;
  int rank = 0;                                // 1..head_dim
  std::string rope_layout = "adjacent_pairs";  // or "halves"; keys and queries must agree
  std::string channel_order = "gguf";          // channel order of keys/queries the basis expects
  std::string kind = "query_pca_uncentred";    // query_pca_uncentred|query_pca_centred|random|...
  int64_t calibration_tokens = 0;
  std::string calibration_text;
  std::string fingerprint;  // hex XXH3-64 of the tensor bytes (filled by WriteBasis)
};

struct ModelBasis {
  BasisManifest manifest;
  // [layers][kv_heads][head_dim][rank], row-major: the basis scores and decodes use
  // (U^T q and U z_hat).
  std::vector<float> u;
  // Empty, or the encode basis A of an oblique pair, same shape: side coefficients are
  // A^T e instead of U^T e. A reduced-rank regression pair (calibration.h) weighs the base
  // quantizer's residual covariance against the queries, which no single orthonormal U can.
  std::vector<float> encode;
  bool oblique() const { return !encode.empty(); }
  // Empty, or the calibration queries' second moment E[q q^T] per head,
  // [layers][kv_heads][head_dim][head_dim] ("layer.{l}.query_moment", stored last): the metric
  // in which the encoder rounds keys when the codec asks for metric rounding.
  std::vector<float> query_moment;
  const float* query_moment_head(int layer, int kv_head) const {
    return query_moment.empty()
               ? nullptr
               : query_moment.data() + (static_cast<size_t>(layer) * manifest.kv_heads + kv_head) *
                                           manifest.head_dim * manifest.head_dim;
  }
  // Empty, or each KV head's value metric M = sum over its query heads q of W_o,q^T W_o,q
  // (W_o,q: the output projection's columns that read query head q's attention output),
  // [layers][kv_heads][head_dim][head_dim] ("layer.{l}.value_metric", stored after the query
  // moments): the metric in which a value error reaches the layer output, in which the encoder
  // rounds values when the codec asks for value metric rounding. A function of the weights.
  std::vector<float> value_metric;
  const float* value_metric_head(int layer, int kv_head) const {
    return value_metric.empty()
               ? nullptr
               : value_metric.data() + (static_cast<size_t>(layer) * manifest.kv_heads + kv_head) *
                                           manifest.head_dim * manifest.head_dim;
  }
  const float* head(int layer, int kv_head) const { return u.data() + HeadOffset(layer, kv_head); }
  // The basis the encoder projects with: A for an oblique pair, else U.
  const float* encode_head(int layer, int kv_head) const {
    return (oblique() ? encode.data() : u.data()) + HeadOffset(layer, kv_head);
  }
  size_t HeadOffset(int layer, int kv_head) const {
    return (static_cast<size_t>(layer) * manifest.kv_heads + kv_head) * manifest.head_dim *
           manifest.rank;
  }
  // A copy keeping only the first r columns of each head's U (r <= rank).
  ModelBasis Truncated(int r) const;
};

// Writes dir/basis.safetensors and dir/manifest.json atomically (temp files + rename).
// Fills manifest.fingerprint.
// env: where the files are written / read (null: Env::Default()).
absl::Status WriteBasis(const std::string& dir, ModelBasis& basis, Env* env = nullptr);
absl::StatusOr<ModelBasis> ReadBasis(const std::string& dir, Env* env = nullptr);
// The checks every basis passes wherever it comes from (ReadBasis, a registration), against
// the shape in `m` (layers, kv_heads, head_dim, rank; b.manifest is not consulted): the
// tensor sizes (U; A the same when oblique; query_moment and value_metric [layers][kv][d][d]
// when present), every value finite, per head U's columns orthonormal or, for an oblique
// pair, A^T B = I (each to 1e-3: either way B A^T is a projection, so the side code cannot
// amplify a residual), and each query moment and value metric symmetric with a non-negative
// diagonal (both are Gram matrices).
// INVALID_ARGUMENT naming the layer, head and columns.
absl::Status CheckBasisTensors(const BasisManifest& m, const ModelBasis& b);
std::string BasisFingerprint(const ModelBasis& basis);

// A random orthonormal basis of the same shape (control), deterministic in `seed`.
ModelBasis RandomBasis(const BasisManifest& shape, uint64_t seed);

}  // namespace kvq::core
