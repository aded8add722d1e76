#include "kvq/frontend/eval_levers.h"

#include <algorithm>
#include <cmath>
#include <queue>
#include <utility>

#include "absl/strings/str_cat.h"
#include "kvq/core/status.h"
#include "kvq/core/tensor.h"

namespace kvq::frontend {

absl::Status CheckLevers(const EvalLevers& l, const core::CodecOptions& o) {
  auto no = [](const std::string& why) { return absl::InvalidArgumentError(why); };
  for (int p : {l.key_outliers_permille, l.value_outliers_permille}) {
    if (p < 0 || p > 100) return no(absl::StrCat("outliers: ", p, " per mille outside 0..100"));
  }
  if (!l.any()) return absl::OkStatus();
  if (o.window != 0) return no("the evaluation levers (spk, spv, pre) need window 0");
  if (o.per_token_value_bits())
    return no("the evaluation levers do not run with a2 (read by decoding)");
  if (l.key_outliers_permille > 0 && o.rotate_keys)
    return no("spk trims keys before a rotation spreads them: not with rotk");
  if (l.value_outliers_permille > 0 && o.rotate_values) return no("spv: not with rotv");
  // Keys and values apart: values on books beside a side code and metric-rounded keys.
  if (l.nuq_keys) {
    if (o.rank > 0) return no("nuq keys: the side code corrects uniform codes (kivi or nuqv)");
    if (o.metric_rounding) return no("nuq keys: mr chooses among uniform codes (not with mr)");
    if (o.rotate_keys) return no("nuq keys: books are fitted unrotated (not with rotk)");
  }
  if (l.nuq_values) {
    if (o.rotate_values) return no("nuq values: books are fitted unrotated (not with rotv)");
  }
  if (l.keys_before_rope) {
    if (o.rank > 0)
      return no("pre: the side code's basis is fitted to post-RoPE queries (kivi only)");
    if (o.metric_rounding)
      return no("pre: metric rounding's query moment is post-RoPE (not with mr)");
  }
  return absl::OkStatus();
}

namespace {

// fp16 rounding, the precision a serving frontend sends.
void RoundToHalf(float* x, size_t n) {
  std::vector<uint16_t> h(n);
  core::FromFloat(core::DType::kF16, x, h.data(), n);
  core::ToFloat(core::DType::kF16, h.data(), x, n);
}

}  // namespace

LeverFeed::LeverFeed(const EvalLevers& levers, const core::CodecOptions& o, int kv_heads,
                     bool keys_only, int layer)
    : levers_(levers), o_(o), kv_heads_(kv_heads), keys_only_(keys_only) {
  if (levers_.books) {
    const CodeBooks& b = *levers_.books;
    if (levers_.nuq_keys && layer < static_cast<int>(b.keys.size()) && !b.keys[layer].empty())
      key_book_ = &b.keys[layer];
    if (levers_.nuq_values && layer < static_cast<int>(b.values.size()) && !b.values[layer].empty())
      value_book_ = &b.values[layer];
  }
}

absl::Status LeverFeed::Append(core::LayerCache& lc, const float* k, const float* v, int64_t start,
                               int n) {
  if (start != tokens_) {
    return absl::InvalidArgumentError(
        absl::StrCat("lever feed: append at ", start, ", holds ", tokens_));
  }
  const size_t row = static_cast<size_t>(kv_heads_) * o_.head_dim, cnt = row * n;
  const size_t old = keys_sent_.size();
  keys_sent_.insert(keys_sent_.end(), k, k + cnt);
  values_.insert(values_.end(), v, v + cnt);
  RoundToHalf(keys_sent_.data() + old, cnt);
  RoundToHalf(values_.data() + old, cnt);
  if (levers_.keys_before_rope) {
    keys_before_rope_.insert(keys_before_rope_.end(), keys_sent_.begin() + old, keys_sent_.end());
    float* rows = keys_before_rope_.data() + old;
    RotateRows(levers_.rope, start, n, kv_heads_, o_.head_dim, rows, /*inverse=*/true);
    RoundToHalf(rows, cnt);
  }
  tokens_ += n;
  while (tokens_ - fed_ >= o_.key_group) RETURN_IF_ERROR(FeedGroup(lc));
  return absl::OkStatus();
}

std::vector<std::vector<int64_t>> LeverFeed::Units(bool keys, int64_t t0) const {
  const int G = o_.key_group, D = o_.head_dim, KVH = kv_heads_;
  // The sinks' rows are kept exact by the codec already, and stand in for nothing here.
  const int first = t0 == 0 ? std::min(o_.fp16_sinks, G) : 0;
  auto at = [&](int t, int h, int c) { return (static_cast<int64_t>(t) * KVH + h) * D + c; };
  std::vector<std::vector<int64_t>> units;
  if (keys) {  // per channel over the group's tokens
    for (int h = 0; h < KVH; ++h)
      for (int c = 0; c < D; ++c) {
        std::vector<int64_t>& u = units.emplace_back();
        for (int t = first; t < G; ++t) u.push_back(at(t, h, c));
      }
  } else {  // per token over value_group channels
    for (int t = first; t < G; ++t)
      for (int h = 0; h < KVH; ++h)
        for (int c0 = 0; c0 < D; c0 += o_.value_group) {
          std::vector<int64_t>& u = units.emplace_back();
          for (int c = c0; c < std::min(D, c0 + o_.value_group); ++c) u.push_back(at(t, h, c));
        }
  }
  return units;
}

void LeverFeed::Trim(std::vector<float>* rows, int permille, bool keys, int64_t t0,
                     std::vector<Exact>* exact) const {
  const int G = o_.key_group, D = o_.head_dim, KVH = kv_heads_;
  const std::vector<std::vector<int64_t>> units = Units(keys, t0);
  const std::vector<float> before = *rows;
  const int64_t budget = std::llround(static_cast<double>(permille) / 1000.0 * G * KVH * D);
  for (int64_t i : TrimOutliers(rows->data(), units, budget)) {
    const int c = static_cast<int>(i % D), h = static_cast<int>(i / D % KVH);
    exact->push_back({t0 + i / (static_cast<int64_t>(KVH) * D), h, c, before[i]});
  }
}

void LeverFeed::Compand(std::vector<float>* rows, bool keys, int64_t t0) {
  const std::vector<float>* book = keys ? key_book_ : value_book_;
  UnitHistogram& hist = keys ? key_hist_ : value_hist_;
  std::vector<std::pair<float, float>>& ranges = keys ? key_ranges_ : value_ranges_;
  float* x = rows->data();
  for (const std::vector<int64_t>& unit : Units(keys, t0)) {
    float lo = INFINITY, hi = -INFINITY;
    for (int64_t i : unit) {
      lo = std::min(lo, x[i]);
      hi = std::max(hi, x[i]);
    }
    const float span = hi - lo;
    if (!book) {
      if (span > 0)
        for (int64_t i : unit) hist.Add((static_cast<double>(x[i]) - lo) / span);
      continue;
    }
    ranges.emplace_back(lo, hi);
    if (!(span > 0)) continue;
    // The ends map onto themselves, so the codec sees the same min and max (its zero and scale).
    for (int64_t i : unit) {
      if (x[i] == lo || x[i] == hi) continue;
      x[i] = lo + frontend::Compand((x[i] - lo) / span, *book) * span;
    }
  }
}

void LeverFeed::Expand(std::vector<float>* rows, bool keys, int64_t T) const {
  const std::vector<float>* book = keys ? key_book_ : value_book_;
  if (!book) return;
  const std::vector<std::pair<float, float>>& ranges = keys ? key_ranges_ : value_ranges_;
  const int G = o_.key_group, D = o_.head_dim, KVH = kv_heads_;
  size_t next = 0;
  for (int64_t t0 = 0; t0 + G <= fed_; t0 += G) {
    for (const std::vector<int64_t>& unit : Units(keys, t0)) {
      const auto [lo, hi] = ranges[next++];
      const float span = hi - lo;
      if (!(span > 0)) continue;
      for (int64_t i : unit) {
        // Group-relative [t][kv][d] -> [kv][T][d].
        const int64_t t = t0 + i / (static_cast<int64_t>(KVH) * D);
        const int h = static_cast<int>(i / D % KVH), c = static_cast<int>(i % D);
        float& y = (*rows)[(static_cast<size_t>(h) * T + t) * D + c];
        const float u = std::clamp((y - lo) / span, 0.0f, 1.0f);
        y = lo + frontend::Expand(u, *book) * span;
      }
    }
  }
}

absl::Status LeverFeed::FeedGroup(core::LayerCache& lc) {
  const int G = o_.key_group, D = o_.head_dim, KVH = kv_heads_;
  const size_t row = static_cast<size_t>(KVH) * D;
  const int64_t t0 = fed_;
  const std::vector<float>& fed = levers_.keys_before_rope ? keys_before_rope_ : keys_sent_;
  std::vector<float> kg(fed.begin() + t0 * row, fed.begin() + (t0 + G) * row);
  std::vector<float> vg(values_.begin() + t0 * row, values_.begin() + (t0 + G) * row);
  if (levers_.key_outliers_permille > 0)
    Trim(&kg, levers_.key_outliers_permille, true, t0, &key_exact_);
  if (levers_.value_outliers_permille > 0 && !keys_only_)
    Trim(&vg, levers_.value_outliers_permille, false, t0, &value_exact_);
  if (levers_.nuq_keys) Compand(&kg, true, t0);
  if (levers_.nuq_values && !keys_only_) Compand(&vg, false, t0);
  std::vector<uint16_t> kh(kg.size()), vh(vg.size());
  core::FromFloat(core::DType::kF16, kg.data(), kh.data(), kh.size());
  core::FromFloat(core::DType::kF16, vg.data(), vh.data(), vh.size());
  core::TensorView kv, vv;
  for (auto* t : {&kv, &vv}) {
    t->dtype = core::DType::kF16;
    t->rank = 3;
    t->shape = {KVH, G, D, 0};
    t->stride = {D, static_cast<int64_t>(row), 1, 0};
  }
  kv.data = kh.data();
  vv.data = vh.data();
  RETURN_IF_ERROR(lc.Append(kv, vv, t0));
  if (lc.Size().encoded_tokens != t0 + G) {
    return absl::InternalError("lever feed: the codec did not encode a whole group (window 0?)");
  }
  fed_ += G;
  return absl::OkStatus();
}

absl::Status LeverFeed::Read(const core::LayerCache& lc, std::vector<float>* keys,
                             std::vector<float>* values) const {
  const int D = o_.head_dim, KVH = kv_heads_;
  const int64_t T = tokens_, F = fed_;
  std::vector<float> K, V;
  RETURN_IF_ERROR(lc.Decode(&K, &V));  // [kv][F][d]
  auto at = [&](int h, int64_t t) { return (static_cast<size_t>(h) * T + t) * D; };
  auto sent = [&](const std::vector<float>& rows, int64_t t, int h) {
    return rows.data() + (static_cast<size_t>(t) * KVH + h) * D;
  };
  keys->assign(static_cast<size_t>(KVH) * T * D, 0.0f);
  for (int h = 0; h < KVH; ++h) {
    std::copy_n(K.data() + static_cast<size_t>(h) * F * D, F * D, keys->data() + at(h, 0));
  }
  Expand(keys, true, T);
  for (const Exact& e : key_exact_) (*keys)[at(e.head, e.t) + e.channel] = e.value;
  if (levers_.keys_before_rope) {
    for (int h = 0; h < KVH; ++h)
      RotateRows(levers_.rope, 0, static_cast<int>(F), 1, D, keys->data() + at(h, 0), false);
  }
  for (int h = 0; h < KVH; ++h)
    for (int64_t t = F; t < T; ++t) std::copy_n(sent(keys_sent_, t, h), D, keys->data() + at(h, t));
  values->clear();
  if (keys_only_) return absl::OkStatus();
  values->assign(keys->size(), 0.0f);
  for (int h = 0; h < KVH; ++h) {
    std::copy_n(V.data() + static_cast<size_t>(h) * F * D, F * D, values->data() + at(h, 0));
  }
  Expand(values, false, T);
  for (int h = 0; h < KVH; ++h) {
    for (int64_t t = F; t < T; ++t) std::copy_n(sent(values_, t, h), D, values->data() + at(h, t));
  }
  for (const Exact& e : value_exact_) (*values)[at(e.head, e.t) + e.channel] = e.value;
  return absl::OkStatus();
}

}  // namespace kvq::frontend
