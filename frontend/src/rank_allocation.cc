#include "kvq/frontend/rank_allocation.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "kvq/core/cache.h"
#include "kvq/core/status.h"
#include "kvq/core/tensor.h"
#include "kvq/frontend/attention_cache.h"

namespace kvq::frontend {

absl::StatusOr<std::vector<std::vector<double>>> MeasureColumnEnergy(
    const LlamaModel& model, const std::vector<int32_t>& tokens, int window_len,
    const core::ModelBasis& basis) {
  const LlamaConfig& c = model.config();
  const int D = c.head_dim, R = basis.manifest.rank, gq = c.q_heads / c.kv_heads;
  std::vector<std::vector<double>> num(c.layers, std::vector<double>(R, 0.0));
  std::vector<double> den(c.layers, 0.0);
  auto hook = [&](int layer, int64_t, int n, const float* q, const float*, const float*) {
    for (int h = 0; h < c.q_heads; ++h) {
      const float* U = basis.head(layer, h / gq);
      for (int i = 0; i < n; ++i) {
        const float* qi = q + (static_cast<size_t>(h) * n + i) * D;
        for (int a = 0; a < D; ++a) den[layer] += static_cast<double>(qi[a]) * qi[a];
        for (int j = 0; j < R; ++j) {
          double p = 0;
          for (int a = 0; a < D; ++a) p += static_cast<double>(qi[a]) * U[a * R + j];
          num[layer][j] += p * p;
        }
      }
    }
  };
  for (size_t s = 0; s + window_len <= tokens.size(); s += window_len) {
    DenseCache cache(c.cache_shape());
    RETURN_IF_ERROR(
        model.Forward(tokens.data() + s, window_len, 0, &cache, window_len, nullptr, hook));
  }
  for (int l = 0; l < c.layers; ++l) {
    if (den[l] <= 0) return absl::InvalidArgumentError("no tokens for the rank allocation");
    for (double& x : num[l]) x /= den[l];
  }
  return num;
}

std::vector<int> AllocateRanks(const std::vector<std::vector<double>>& e, int mean_rank,
                               int max_rank) {
  const int L = static_cast<int>(e.size());
  std::vector<int> r(L, 1);
  for (int budget = L * (mean_rank - 1); budget > 0; --budget) {
    int best = -1;
    for (int l = 0; l < L; ++l)
      if (r[l] < max_rank && (best < 0 || e[l][r[l]] > e[best][r[best]])) best = l;
    if (best < 0) break;
    ++r[best];
  }
  return r;
}

namespace {

// The residual e = k - base(k) of `o`'s base code (rank 0) for keys [n][kv][d], as
// [kv][n][d]: the keys go through a LayerCache as a serving frontend sends them (fp16).
absl::StatusOr<std::vector<float>> BaseResidual(const core::CodecOptions& o, int kv_heads,
                                                const float* keys, int n,
                                                const float* query_moment) {
  const int D = o.head_dim;
  const size_t cnt = static_cast<size_t>(n) * kv_heads * D;
  std::vector<uint16_t> kh(cnt), vh(cnt, 0);
  core::FromFloat(core::DType::kF16, keys, kh.data(), cnt);
  core::TensorView kv, vv;
  for (auto* t : {&kv, &vv}) {
    t->dtype = core::DType::kF16;
    t->rank = 3;
    t->shape = {kv_heads, n, D, 0};
    t->stride = {D, static_cast<int64_t>(kv_heads) * D, 1, 0};
  }
  kv.data = kh.data();
  vv.data = vh.data();
  core::LayerCache lc(o, kv_heads, nullptr, nullptr, nullptr, query_moment);
  lc.set_read_policy({.verify_checksums = false});  // evaluation: blocks never leave memory
  RETURN_IF_ERROR(lc.Append(kv, vv, 0));
  std::vector<float> K, V;
  RETURN_IF_ERROR(lc.Decode(&K, &V));  // [kv][n][d]
  std::vector<float> sent(cnt);
  core::ToFloat(core::DType::kF16, kh.data(), sent.data(), cnt);
  for (int h = 0; h < kv_heads; ++h)
    for (int t = 0; t < n; ++t)
      for (int a = 0; a < D; ++a) {
        const size_t i = (static_cast<size_t>(h) * n + t) * D + a;
        K[i] = sent[(static_cast<size_t>(t) * kv_heads + h) * D + a] - K[i];
      }
  return K;
}

}  // namespace

absl::StatusOr<std::vector<std::vector<std::vector<double>>>> MeasureHeadScoreError(
    const LlamaModel& model, const std::vector<int32_t>& tokens, int window_len,
    const core::ModelBasis& basis, const core::CodecOptions& codec) {
  const LlamaConfig& c = model.config();
  const int D = c.head_dim, KVH = c.kv_heads, R = basis.manifest.rank, gq = c.q_heads / KVH;
  if (basis.manifest.layers != c.layers || basis.manifest.kv_heads != KVH ||
      basis.manifest.head_dim != D) {
    return absl::InvalidArgumentError("hadapt: the basis does not fit the model");
  }
  core::CodecOptions o = codec;
  o.rank = 0;
  o.window = 0;
  o.head_dim = D;
  if (o.metric_rounding && basis.query_moment.empty()) {
    return absl::FailedPreconditionError("hadapt with mr: the basis has no query moments");
  }
  std::vector<std::vector<std::vector<double>>> err(
      c.layers, std::vector<std::vector<double>>(KVH, std::vector<double>(R + 1, 0.0)));
  // One window's second moments per (layer, head): M of its queries, S of its base residuals
  // (queries meet only the keys of their own window).
  const size_t DD = static_cast<size_t>(D) * D;
  std::vector<std::vector<double>> M(static_cast<size_t>(c.layers) * KVH, std::vector<double>(DD));
  std::vector<std::vector<float>> window_keys(c.layers);
  auto hook = [&](int layer, int64_t, int n, const float* q, const float* k, const float*) {
    for (int h = 0; h < c.q_heads; ++h) {
      std::vector<double>& m = M[static_cast<size_t>(layer) * KVH + h / gq];
      for (int i = 0; i < n; ++i) {
        const float* qi = q + (static_cast<size_t>(h) * n + i) * D;
        for (int a = 0; a < D; ++a)
          for (int b = 0; b < D; ++b) m[a * D + b] += static_cast<double>(qi[a]) * qi[b];
      }
    }
    std::vector<float>& wk = window_keys[layer];
    wk.insert(wk.end(), k, k + static_cast<size_t>(n) * KVH * D);
  };
  std::vector<double> S(DD), W(DD), WS(DD);
  int windows = 0;
  for (size_t s = 0; s + window_len <= tokens.size(); s += window_len, ++windows) {
    for (auto& wk : window_keys) wk.clear();
    for (auto& m : M) std::fill(m.begin(), m.end(), 0.0);
    DenseCache cache(c.cache_shape());
    RETURN_IF_ERROR(
        model.Forward(tokens.data() + s, window_len, 0, &cache, window_len, nullptr, hook));
    for (int l = 0; l < c.layers; ++l) {
      ASSIGN_OR_RETURN(std::vector<float> e,
                       BaseResidual(o, KVH, window_keys[l].data(), window_len,
                                    o.metric_rounding ? basis.query_moment_head(l, 0) : nullptr));
      for (int h = 0; h < KVH; ++h) {
        std::fill(S.begin(), S.end(), 0.0);
        for (int t = 0; t < window_len; ++t) {
          const float* et = e.data() + (static_cast<size_t>(h) * window_len + t) * D;
          for (int a = 0; a < D; ++a)
            for (int b = 0; b < D; ++b) S[a * D + b] += static_cast<double>(et[a]) * et[b];
        }
        const float* B = basis.head(l, h);         // [d][R]
        const float* A = basis.encode_head(l, h);  // [d][R] (= B without an oblique pair)
        const std::vector<double>& m = M[static_cast<size_t>(l) * KVH + h];
        for (int r = 0; r <= R; ++r) {
          // W = I - B_r A_r^T; error = tr(M W S W^T).
          for (int a = 0; a < D; ++a)
            for (int b = 0; b < D; ++b) {
              double x = a == b ? 1.0 : 0.0;
              for (int j = 0; j < r; ++j) x -= static_cast<double>(B[a * R + j]) * A[b * R + j];
              W[a * D + b] = x;
            }
          for (int a = 0; a < D; ++a)  // WS = W S
            for (int b = 0; b < D; ++b) {
              double x = 0;
              for (int j = 0; j < D; ++j) x += W[a * D + j] * S[j * D + b];
              WS[a * D + b] = x;
            }
          double tr = 0;  // tr(M W S W^T) = sum_ab M_ab (W S W^T)_ba
          for (int a = 0; a < D; ++a)
            for (int b = 0; b < D; ++b) {
              double wsw = 0;  // (W S W^T)_ba = sum_j (W S)_bj W_aj
              for (int j = 0; j < D; ++j) wsw += WS[b * D + j] * W[a * D + j];
              tr += m[a * D + b] * wsw;
            }
          err[l][h][r] += tr;
        }
      }
    }
  }
  if (windows == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("hadapt: the calibration text holds no window of ", window_len, " tokens"));
  }
  return err;
}

std::vector<std::vector<int>> AllocateHeadRanks(
    const std::vector<std::vector<std::vector<double>>>& error, int mean_rank, int max_rank) {
  std::vector<std::vector<int>> r;
  int64_t heads = 0;
  for (const auto& layer : error) {
    r.emplace_back(layer.size(), 0);
    heads += static_cast<int64_t>(layer.size());
  }
  for (int64_t budget = heads * mean_rank; budget > 0; --budget) {
    int bl = -1, bh = -1;
    double best = -INFINITY;
    for (size_t l = 0; l < error.size(); ++l)
      for (size_t h = 0; h < error[l].size(); ++h) {
        const int k = r[l][h];
        if (k >= max_rank || k + 1 >= static_cast<int>(error[l][h].size())) continue;
        const double gain = error[l][h][k] - error[l][h][k + 1];
        if (gain > best) {
          best = gain;
          bl = static_cast<int>(l);
          bh = static_cast<int>(h);
        }
      }
    if (bl < 0) break;
    ++r[bl][bh];
  }
  return r;
}

}  // namespace kvq::frontend
