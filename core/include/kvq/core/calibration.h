// Query-PCA calibration: streaming E[q q^T] per (layer, KV head) and its top-r eigenvectors.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "kvq/core/basis.h"

namespace kvq::core {

struct CalibrationOptions {
  // false (default): uncentred second moment E[q q^T], the matrix whose quadratic form is the
  // mean squared score error of a residual. true: covariance (centred PCA), an ablation.
  bool centred = false;
  // Optional per-channel weights (e.g. the base quantizer's residual variance per channel);
  // when set, the basis diagonalizes D^1/2 E[qq^T] D^1/2 (residual-weighted basis).
  bool residual_weighted = false;
  // Oblique pair by reduced-rank regression: the rank-r M = B A^T minimizing the mean squared
  // score error E[(q^T (e - M e))^2] = tr(Sq (I - M) Se (I - M)^T) over the query second
  // moment Sq and the base quantizer's residual covariance Se (AddResidual). With
  // R = Se^1/2 and W the top-r eigenvectors of R Sq R: B = R W (decode), A = R^-1 W (encode).
  // Reduces to the query PCA when Se is isotropic. Needs residual statistics.
  bool oblique = false;
  // Also keep E[q q^T] per head in the basis (ModelBasis::query_moment) for metric rounding.
  bool keep_query_moment = false;
};

class QueryStats {
 public:
  // q_heads must be a multiple of kv_heads; query head h reads KV head h / (q_heads/kv_heads).
  QueryStats(int layers, int q_heads, int kv_heads, int head_dim);
  // Adds n post-RoPE queries of one query head: q [n][head_dim].
  void Add(int layer, int q_head, const float* q, int64_t n);
  // Adds per-channel residual statistics of a KV head (sum of e^2 over tokens): e [n][d].
  void AddResidual(int layer, int kv_head, const float* e, int64_t n);
  int64_t count(int layer, int kv_head) const;
  // Top-r eigenvectors per (layer, KV head), in descending eigenvalue order, each column's
  // entry of largest magnitude positive (the sign convention kvq.hf.QueryStats follows too).
  absl::StatusOr<ModelBasis> Basis(int rank, const CalibrationOptions& opts,
                                   BasisManifest manifest) const;
  // Fraction of the (uncentred) query energy the top-r directions capture, per head.
  std::vector<double> CapturedEnergy(const ModelBasis& b) const;

 private:
  int layers_, q_heads_, kv_heads_, d_;
  std::vector<double> m2_;      // [layers][kv][d][d]
  std::vector<double> m1_;      // [layers][kv][d]
  std::vector<double> res2_;    // [layers][kv][d]
  std::vector<double> res_m2_;  // [layers][kv][d][d] (upper triangle)
  std::vector<int64_t> n_;      // [layers][kv]
  std::vector<int64_t> nres_;
};

}  // namespace kvq::core
