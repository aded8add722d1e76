#include "kvq/frontend/attention_cache.h"

#include <cblas.h>

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "kvq/core/status.h"
#include "kvq/core/tensor.h"

namespace kvq::frontend {
namespace {

// Exact causal attention of q [QH][n][d] (positions start..start+n-1) over T cached tokens.
// Head h of K/V starts at K + kh * head_off with rows `row` floats apart.
void LocalAttend(const CacheShape& s_, const float* q, int n, int64_t start, int64_t T,
                 const float* K, const float* V, int64_t head_off, int64_t row, float* out) {
  const int D = s_.head_dim, group = s_.q_heads / s_.kv_heads;
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  std::vector<float> s(static_cast<size_t>(n) * T);
  for (int h = 0; h < s_.q_heads; ++h) {
    const int kh = h / group;
    const float* qh = q + static_cast<size_t>(h) * n * D;
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, n, static_cast<int>(T), D, scale, qh, D,
                K + kh * head_off, static_cast<int>(row), 0.0f, s.data(), static_cast<int>(T));
    for (int i = 0; i < n; ++i) {
      float* si = s.data() + static_cast<size_t>(i) * T;
      const int64_t vis = std::min<int64_t>(T, start + i + 1);  // causal
      float mx = -INFINITY;
      for (int64_t t = 0; t < vis; ++t) mx = std::max(mx, si[t]);
      double sum = 0;
      for (int64_t t = 0; t < vis; ++t) {
        si[t] = std::exp(si[t] - mx);
        sum += si[t];
      }
      const float inv = static_cast<float>(1.0 / sum);
      for (int64_t t = 0; t < vis; ++t) si[t] *= inv;
      for (int64_t t = vis; t < T; ++t) si[t] = 0.0f;
    }
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, n, D, static_cast<int>(T), 1.0f,
                s.data(), static_cast<int>(T), V + kh * head_off, static_cast<int>(row), 0.0f,
                out + static_cast<size_t>(h) * n * D, D);
  }
}

}  // namespace

DenseCache::DenseCache(const CacheShape& s)
    : s_(s), row_(static_cast<int64_t>(s.kv_heads) * s.head_dim), k_(s.layers), v_(s.layers) {}

absl::Status DenseCache::AppendAndAttend(int layer, const float* k, const float* v, int64_t start,
                                         int n, const float* q, float* out) {
  auto& K = k_[layer];
  auto& V = v_[layer];
  if (start != tokens(layer)) {
    return absl::InvalidArgumentError(absl::StrCat("dense cache: append at ", start, " but layer ",
                                                   layer, " holds ", tokens(layer)));
  }
  // Rounded to fp16, the precision of a serving cache (and of llama.cpp's default KV cache).
  const size_t old = K.size(), cnt = static_cast<size_t>(n) * row_;
  K.resize(old + cnt);
  V.resize(old + cnt);
  std::vector<uint16_t> tmp(cnt);
  core::FromFloat(core::DType::kF16, k, tmp.data(), cnt);
  core::ToFloat(core::DType::kF16, tmp.data(), K.data() + old, cnt);
  core::FromFloat(core::DType::kF16, v, tmp.data(), cnt);
  core::ToFloat(core::DType::kF16, tmp.data(), V.data() + old, cnt);
  LocalAttend(s_, q, n, start, tokens(layer), K.data(), V.data(), s_.head_dim, row_, out);
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<CodecCache>> CodecCache::Create(const CacheShape& s,
                                                               const core::CodecOptions& o,
                                                               const core::ModelBasis* basis,
                                                               const CodecCacheOptions& options) {
  const bool keys_only = options.keys_only, probe = options.probe;
  const std::vector<std::vector<int>>* head_ranks = options.head_ranks;
  RETURN_IF_ERROR(o.Validate());
  if (options.value_metric_rounding && (!basis || basis->value_metric.empty()))
    return absl::InvalidArgumentError("value metric rounding needs a basis with value metrics");
  if (o.head_dim != s.head_dim)
    return absl::InvalidArgumentError("codec head_dim != model head_dim");
  std::unique_ptr<CodecCache> c(new CodecCache(s, o));
  c->keys_only_ = keys_only;
  c->read_ = options.read;
  c->probe_ = probe;
  if (probe && !o.per_token_value_bits())
    return absl::InvalidArgumentError("probe needs the A^2 policy");
  if (keys_only) c->dense_v_.resize(s.layers);
  std::vector<float> u, a;  // U (or the decode basis B) and an oblique pair's A, per layer
  if (head_ranks) {
    if (static_cast<int>(head_ranks->size()) != s.layers)
      return absl::InvalidArgumentError("head_ranks needs one row per layer");
    for (const auto& row : *head_ranks)
      if (static_cast<int>(row.size()) != s.kv_heads)
        return absl::InvalidArgumentError("head_ranks needs one rank per KV head");
    c->head_ranks_ = *head_ranks;
  }
  int max_rank = o.rank;
  if (head_ranks)
    for (const auto& row : *head_ranks)
      for (int r : row) max_rank = std::max(max_rank, r);
  if (max_rank > 0) {
    if (!basis) return absl::InvalidArgumentError("codec rank > 0 needs a basis");
    const auto& m = basis->manifest;
    if (m.layers != s.layers || m.kv_heads != s.kv_heads || m.head_dim != s.head_dim ||
        m.rank < max_rank) {
      return absl::InvalidArgumentError(absl::StrCat(
          "basis shape (layers ", m.layers, ", kv_heads ", m.kv_heads, ", head_dim ", m.head_dim,
          ", rank ", m.rank, ") does not fit the model / rank ", max_rank));
    }
  }
  for (int l = 0; l < s.layers; ++l) {
    const float* bp = nullptr;
    const float* ap = nullptr;
    core::CodecOptions ol = o;
    // A layer's blocks hold its largest head rank; a head of lower rank keeps zero columns
    // beyond its own (the side code then codes exactly what a block of that rank would), and
    // Size() counts the bytes of each head's own rank.
    if (head_ranks) ol.rank = *std::max_element((*head_ranks)[l].begin(), (*head_ranks)[l].end());
    RETURN_IF_ERROR(ol.Validate());
    if (ol.rank > 0) {
      // Keep the first ol.rank columns of each head's U: [kv][d][rank].
      const int R = basis->manifest.rank;
      auto first_columns = [&](bool encode, std::vector<float>* to) {
        to->assign(static_cast<size_t>(s.kv_heads) * s.head_dim * ol.rank, 0.0f);
        for (int h = 0; h < s.kv_heads; ++h) {
          const float* src = encode ? basis->encode_head(l, h) : basis->head(l, h);
          for (int i = 0; i < s.head_dim; ++i)
            for (int r = 0; r < (head_ranks ? (*head_ranks)[l][h] : ol.rank); ++r)
              (*to)[(static_cast<size_t>(h) * s.head_dim + i) * ol.rank + r] = src[i * R + r];
        }
      };
      first_columns(false, &u);
      bp = u.data();
      if (basis->oblique()) {
        first_columns(true, &a);
        ap = a.data();
      }
    }
    const float* moment = basis ? basis->query_moment_head(l, 0) : nullptr;
    const float* value_metric =
        options.value_metric_rounding ? basis->value_metric_head(l, 0) : nullptr;
    c->layers_.push_back(
        std::make_unique<core::LayerCache>(ol, s.kv_heads, bp, nullptr, ap, moment, value_metric));
    c->layers_.back()->set_read_policy({.verify_checksums = false});
  }
  return c;
}

absl::Status CodecCache::AppendAndAttend(int layer, const float* k, const float* v, int64_t start,
                                         int n, const float* q, float* out) {
  core::LayerCache& lc = *layers_[layer];
  const int64_t KVH = s_.kv_heads, D = s_.head_dim;
  // Sent as fp16, the wire dtype a serving frontend would use.
  std::vector<uint16_t> kh(static_cast<size_t>(n) * KVH * D), vh(kh.size());
  core::FromFloat(core::DType::kF16, k, kh.data(), kh.size());
  core::FromFloat(core::DType::kF16, v, vh.data(), vh.size());
  core::TensorView kv, vv;
  for (auto* t : {&kv, &vv}) {
    t->dtype = core::DType::kF16;
    t->rank = 3;
    t->shape = {KVH, n, D, 0};
    t->stride = {D, KVH * D, 1, 0};
  }
  kv.data = kh.data();
  vv.data = vh.data();
  if (probe_) {
    RETURN_IF_ERROR(AppendWithProbes(lc, kh.data(), vh.data(), start, n, q));
    core::AttendOptions ao;
    ao.causal_offset = start;
    ao.observe = false;  // the probes already recorded these queries' attention
    return lc.Attend(q, s_.q_heads, n, ao, out);
  }
  if (keys_only_) {
    auto& dv = dense_v_[layer];
    const size_t old = dv.size();
    dv.resize(old + vh.size());
    core::ToFloat(core::DType::kF16, vh.data(), dv.data() + old, vh.size());
  }
  if (!feeds_.empty()) {
    LeverFeed& f = feeds_[layer];
    RETURN_IF_ERROR(f.Append(lc, k, v, start, n));
    std::vector<float> K, V;
    RETURN_IF_ERROR(f.Read(lc, &K, &V));
    if (keys_only_) {
      LocalAttendSplit(q, n, start, f.tokens(), K.data(), dense_v_[layer].data(), out);
    } else {
      LocalAttend(s_, q, n, start, f.tokens(), K.data(), V.data(), f.tokens() * D, D, out);
    }
    return absl::OkStatus();
  }
  RETURN_IF_ERROR(lc.Append(kv, vv, start));
  if (o_.per_token_value_bits() || read_ == CodecRead::kAttend) {
    // Server-side attend: the A^2 policy observes these readouts (earlier queries only).
    if (keys_only_) return absl::FailedPreconditionError("keys-only caches read via Decode");
    core::AttendOptions ao;
    ao.causal_offset = start;
    ao.observe = true;
    return lc.Attend(q, s_.q_heads, n, ao, out);
  }
  // Keys as attention sees them (base + U z_hat: exactly the HeadQ scores up to rounding) and
  // decoded values, attended locally with BLAS.
  std::vector<float> K, V;
  RETURN_IF_ERROR(lc.Decode(&K, &V));
  const int64_t T = lc.tokens();
  if (keys_only_) {
    LocalAttendSplit(q, n, start, T, K.data(), dense_v_[layer].data(), out);
    return absl::OkStatus();
  }
  LocalAttend(s_, q, n, start, T, K.data(), V.data(), T * D, D, out);
  return absl::OkStatus();
}

void CodecCache::LocalAttendSplit(const float* q, int n, int64_t start, int64_t T, const float* K,
                                  const float* V, float* out) const {
  // Keys [kv][T][d] from the codec, values [T][kv][d] dense: score with one layout, read out
  // with the other, by transposing the values once.
  const int D = s_.head_dim;
  std::vector<float> Vt(static_cast<size_t>(s_.kv_heads) * T * D);
  for (int h = 0; h < s_.kv_heads; ++h)
    for (int64_t t = 0; t < T; ++t)
      std::copy_n(V + (static_cast<size_t>(t) * s_.kv_heads + h) * D, D,
                  Vt.data() + (static_cast<size_t>(h) * T + t) * D);
  LocalAttend(s_, q, n, start, T, K, Vt.data(), T * D, D, out);
}

absl::Status CodecCache::AppendWithProbes(core::LayerCache& lc, const uint16_t* kh,
                                          const uint16_t* vh, int64_t start, int n,
                                          const float* q) {
  // The probes of tokens [a, a + m) are their own queries, [q_heads][m][d], causal.
  const int64_t KVH = s_.kv_heads, D = s_.head_dim;
  auto append = [&](int a, int m) -> absl::Status {
    core::TensorView kv, vv;
    for (auto* t : {&kv, &vv}) {
      t->dtype = core::DType::kF16;
      t->rank = 3;
      t->shape = {KVH, m, D, 0};
      t->stride = {D, KVH * D, 1, 0};
    }
    kv.data = kh + static_cast<size_t>(a) * KVH * D;
    vv.data = vh + static_cast<size_t>(a) * KVH * D;
    std::vector<float> pq(static_cast<size_t>(s_.q_heads) * m * D);
    for (int h = 0; h < s_.q_heads; ++h)
      std::copy_n(q + (static_cast<size_t>(h) * n + a) * D, static_cast<size_t>(m) * D,
                  pq.data() + static_cast<size_t>(h) * m * D);
    core::ProbeQueries pr;
    pr.q = pq.data();
    pr.q_heads = s_.q_heads;
    pr.n = m;
    pr.causal_offset = start + a;
    return lc.Append(kv, vv, start + a, pr);
  };
  // If this append encodes a group, the token that triggers it goes alone with its own query:
  // when decoding, no later query exists yet at that moment.
  const int64_t boundary = lc.Size().encoded_tokens + o_.window + o_.key_group;
  int first = 0;
  if (start + 1 == boundary) {
    RETURN_IF_ERROR(append(0, 1));
    first = 1;
  }
  if (first < n) RETURN_IF_ERROR(append(first, n - first));
  return absl::OkStatus();
}

absl::Status CodecCache::SetLevers(const EvalLevers& levers) {
  if (!levers.any()) return absl::OkStatus();
  RETURN_IF_ERROR(CheckLevers(levers, o_));
  if (read_ != CodecRead::kDecode || probe_) {
    return absl::InvalidArgumentError(
        "the evaluation levers read by decoding (not fused, not probe)");
  }
  if (levers.keys_before_rope && levers.rope.inv_freq.empty()) {
    return absl::InvalidArgumentError("pre: the model's RoPE frequencies are missing");
  }
  if (!feeds_.empty() || (!layers_.empty() && layers_[0]->tokens() > 0)) {
    return absl::FailedPreconditionError("levers are set before the first append");
  }
  for (size_t l = 0; l < layers_.size(); ++l)
    feeds_.emplace_back(levers, o_, s_.kv_heads, keys_only_, static_cast<int>(l));
  return absl::OkStatus();
}

core::SizeReport CodecCache::Size() const {
  core::SizeReport r;
  for (size_t i = 0; i < layers_.size(); ++i) {
    core::SizeReport l = layers_[i]->Size();
    if (!feeds_.empty()) {
      // Rows not fed yet wait at fp16, as the codec's own window would hold them.
      const LeverFeed& f = feeds_[i];
      const int64_t tail = f.tokens() - l.tokens,
                    row = static_cast<int64_t>(s_.kv_heads) * s_.head_dim;
      l.tokens += tail;
      l.window_tokens += tail;
      l.elements += tail * row;
      l.key_window_bytes += tail * row * 2;
      l.value_window_bytes += tail * row * 2;
      l.key_block_bytes += f.key_outlier_bytes();
      l.value_block_bytes += f.value_outlier_bytes();
    }
    if (!head_ranks_.empty()) {
      // Each head's blocks at its own rank (the side code's bytes are linear in the rank).
      core::CodecOptions ol = layers_[i]->options(), oh = ol;
      const int64_t blocks = l.encoded_tokens / o_.key_group;
      for (int r : head_ranks_[i]) {
        oh.rank = r;
        l.key_block_bytes -=
            blocks * static_cast<int64_t>(core::KeyBlockBytes(ol) - core::KeyBlockBytes(oh));
      }
    }
    r += l;
  }
  return r;
}

int64_t CodecCache::NextEncodeBoundary(int64_t tokens) const {
  const int64_t encoded = layers_.empty() ? 0 : layers_[0]->Size().encoded_tokens;
  return encoded + o_.window + o_.key_group;
}

}  // namespace kvq::frontend
