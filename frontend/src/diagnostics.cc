#include "kvq/frontend/diagnostics.h"

#include <cmath>

#include "absl/strings/str_cat.h"
#include "kvq/core/cache.h"
#include "kvq/core/metrics.h"
#include "kvq/core/status.h"
#include "kvq/core/tensor.h"

namespace kvq::frontend {

absl::StatusOr<ValueDistortion> MeasureValueDistortion(const core::CodecOptions& codec,
                                                       const float* v, int n, int d,
                                                       const float* value_metric,
                                                       bool round_in_metric) {
  core::CodecOptions o = codec;
  o.head_dim = d;
  o.window = 0;
  o.rank = 0;  // keys are not measured here
  RETURN_IF_ERROR(o.Validate());
  if (!value_metric) return absl::InvalidArgumentError("no value metric");
  core::LayerCache cache(o, 1, nullptr, nullptr, nullptr, nullptr,
                         round_in_metric ? value_metric : nullptr);
  const core::TensorView vv = core::TensorView::Contiguous(v, core::DType::kF32, {1, n, d});
  RETURN_IF_ERROR(cache.Append(vv, vv, 0));
  std::vector<float> keys, values;
  RETURN_IF_ERROR(cache.Decode(&keys, &values));
  ValueDistortion r;
  r.value_mse = core::MeanSquaredError(v, values.data(), static_cast<int64_t>(n) * d);
  std::vector<double> e(d);
  for (int t = 0; t < n; ++t) {
    for (int c = 0; c < d; ++c)
      e[c] = double(values[static_cast<size_t>(t) * d + c]) - v[t * d + c];
    for (int a = 0; a < d; ++a) {
      double row = 0;
      for (int c = 0; c < d; ++c) row += double(value_metric[a * d + c]) * e[c];
      r.metric_error += e[a] * row;
    }
  }
  r.metric_error /= n;
  return r;
}

absl::StatusOr<KeyDistortion> MeasureKeyDistortion(const KeyQuantizer& qz, const float* q, int gq,
                                                   const float* k, int n, int d, int min_pos) {
  core::CodecOptions o = qz.codec;
  o.head_dim = d;
  o.window = 0;
  RETURN_IF_ERROR(o.Validate());
  if (o.rank > 0 && !qz.basis)
    return absl::InvalidArgumentError(qz.name + ": rank > 0 needs a basis");
  if (min_pos >= n) return absl::InvalidArgumentError("min_pos >= n");
  core::LayerCache cache(o, 1, o.rank > 0 ? qz.basis : nullptr, nullptr,
                         o.rank > 0 ? qz.encode_basis : nullptr, qz.query_moment);
  const core::TensorView kv = core::TensorView::Contiguous(k, core::DType::kF32, {1, n, d});
  RETURN_IF_ERROR(cache.Append(kv, kv, 0));  // values are not measured here
  std::vector<float> approx(static_cast<size_t>(gq) * n * n);
  RETURN_IF_ERROR(cache.Score(q, gq, n, approx.data()));
  std::vector<float> keys, values;
  RETURN_IF_ERROR(cache.Decode(&keys, &values));
  KeyDistortion r;
  r.quantizer = qz.name;
  r.key_mse = core::MeanSquaredError(k, keys.data(), static_cast<int64_t>(n) * d);
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  std::vector<float> exact(n);
  int64_t cnt = 0;
  for (int h = 0; h < gq; ++h) {
    for (int i = min_pos; i < n; ++i) {
      const float* qi = q + (static_cast<size_t>(h) * n + i) * d;
      for (int t = 0; t <= i; ++t) {
        float s = 0;
        for (int c = 0; c < d; ++c) s += qi[c] * k[static_cast<size_t>(t) * d + c];
        exact[t] = s * scale;
      }
      const float* ai = approx.data() + (static_cast<size_t>(h) * n + i) * n;
      r.fisher += core::FisherScoreError(exact.data(), ai, i + 1);
      r.kl += core::AttentionKL(exact.data(), ai, i + 1);
      ++cnt;
    }
  }
  r.fisher /= cnt;
  r.kl /= cnt;
  r.k_bits = cache.Size().k_bits_steady();
  return r;
}

}  // namespace kvq::frontend
