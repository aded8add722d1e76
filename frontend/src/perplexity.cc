#include "kvq/frontend/perplexity.h"

#include <chrono>
#include <cmath>
#include <cstdio>

#include "absl/strings/str_cat.h"
#include "kvq/core/status.h"

namespace kvq::frontend {

absl::StatusOr<CodeBooks> FitCodeBooks(const LlamaModel& model, const std::vector<int32_t>& tokens,
                                       int window_len, const EvalConfig& config) {
  const LlamaConfig& mc = model.config();
  if (!config.levers.nuq_keys && !config.levers.nuq_values) {
    return absl::InvalidArgumentError(config.name + ": no code books to fit (not a nuq config)");
  }
  core::CodecOptions o = config.codec;
  o.head_dim = mc.head_dim;
  if (!config.levers.nuq_keys) {
    // Value books only: the keys take the plain base code while counting (no basis needed);
    // the values' groups, and so their books, do not depend on how keys are coded.
    o.rank = 0;
    o.metric_rounding = false;
    o.rotate_keys = false;
  }
  EvalLevers levers = config.levers;
  levers.rope = model.rope();
  levers.books = nullptr;  // uniform while counting
  std::vector<UnitHistogram> keys(mc.layers), values(mc.layers);
  int64_t windows = 0;
  for (size_t s = 0; s + window_len <= tokens.size(); s += window_len) {
    ASSIGN_OR_RETURN(
        auto cc, CodecCache::Create(mc.cache_shape(), o, nullptr, {.keys_only = config.keys_only}));
    RETURN_IF_ERROR(cc->SetLevers(levers));
    std::vector<std::vector<float>> logits;
    RETURN_IF_ERROR(model.ForwardDecodeFaithfulBatch({tokens.data() + s}, window_len, 0, {cc.get()},
                                                     window_len, &logits));
    for (int l = 0; l < mc.layers; ++l) {
      keys[l].Merge(cc->feeds()[l].key_histogram());
      values[l].Merge(cc->feeds()[l].value_histogram());
    }
    ++windows;
  }
  if (windows == 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        config.name, ": the calibration text holds no window of ", window_len, " tokens"));
  }
  CodeBooks books;
  for (int l = 0; l < mc.layers; ++l) {
    if (config.levers.nuq_keys) books.keys.push_back(FitCodeBook(keys[l], o.key_bits));
    if (config.levers.nuq_values) books.values.push_back(FitCodeBook(values[l], o.value_bits));
  }
  return books;
}

double TokenNll(const float* logits, int vocab, int32_t target) {
  float mx = logits[0];
  for (int i = 1; i < vocab; ++i) mx = std::max(mx, logits[i]);
  double sum = 0;
  for (int i = 0; i < vocab; ++i) sum += std::exp(static_cast<double>(logits[i]) - mx);
  return std::log(sum) + mx - logits[target];
}

const core::ModelBasis* BasisSet::WrongSign(const core::ModelBasis& of) {
  if (wrong_sign_of != &of) {
    wrong_sign = of;
    if (!of.oblique()) wrong_sign.encode = of.u;
    for (float& x : wrong_sign.u) x = -x;
    wrong_sign_of = &of;
  }
  return &wrong_sign;
}

absl::StatusOr<PerplexityResult> EvaluatePerplexity(const LlamaModel& model,
                                                    const std::vector<int32_t>& tokens, int windows,
                                                    int window_len, const EvalConfig& config,
                                                    BasisSet* bases,
                                                    const std::function<void(int)>& on_window) {
  const auto t0 = std::chrono::steady_clock::now();
  const LlamaConfig& mc = model.config();
  if (window_len < 4) return absl::InvalidArgumentError("window length must be >= 4");
  if (static_cast<int64_t>(windows) * window_len > static_cast<int64_t>(tokens.size())) {
    return absl::InvalidArgumentError(absl::StrCat("text has ", tokens.size(), " tokens, need ",
                                                   static_cast<int64_t>(windows) * window_len));
  }
  const core::ModelBasis* basis = nullptr;
  if (!config.dense &&
      (config.codec.rank > 0 || config.codec.metric_rounding || config.value_metric_rounding)) {
    switch (config.basis) {
      case BasisKind::kQuery:
        basis = bases->query;
        break;
      case BasisKind::kCentred:
        basis = bases->centred;
        break;
      case BasisKind::kResidualWeighted:
        basis = bases->residual_weighted;
        break;
      case BasisKind::kOblique:
        basis = bases->oblique;
        break;
      case BasisKind::kOracle:
        return absl::InvalidArgumentError(config.name +
                                          ": the oracle basis exists only in --diagnostics");
      case BasisKind::kRandom:
        if (!bases->query) break;
        if (bases->random.u.empty())
          bases->random = core::RandomBasis(bases->query->manifest, 1234);
        basis = &bases->random;
        break;
    }
    if (!basis)
      return absl::FailedPreconditionError(
          absl::StrCat(config.name, ": no basis of that kind loaded (--basis)"));
    if (config.wrong_sign) basis = bases->WrongSign(*basis);
    if (config.value_metric_rounding && basis->value_metric.empty())
      return absl::FailedPreconditionError(
          absl::StrCat(config.name,
                       ": value metric rounding needs the basis's value metric (kvq-calibrate "
                       "writes it; kvq-eval fills it from the model's weights)"));
  }
  PerplexityResult r;
  const int first = window_len / 2;
  std::vector<std::vector<int>> ranks;  // [layer][kv head]
  if (!config.dense && config.adaptive_rank) {
    if (bases->column_energy.empty() || !basis)
      return absl::FailedPreconditionError(
          config.name + ": no per-layer query energy (kvq-eval measures it from --calib-text)");
    std::string s;
    for (int rk : AllocateRanks(bases->column_energy, config.codec.rank, basis->manifest.rank)) {
      ranks.emplace_back(mc.kv_heads, rk);
      absl::StrAppend(&s, rk, " ");
    }
    std::fprintf(stderr, "%s: per-layer ranks %s\n", config.name.c_str(), s.c_str());
  }
  if (!config.dense && config.head_adaptive_rank) {
    if (!bases->calibration_tokens || !basis)
      return absl::FailedPreconditionError(
          config.name + ": no validation tokens for the per-head allocation (--calib-text)");
    core::CodecOptions o = config.codec;
    o.head_dim = mc.head_dim;
    ASSIGN_OR_RETURN(
        auto err, MeasureHeadScoreError(model, *bases->calibration_tokens, window_len, *basis, o));
    ranks = AllocateHeadRanks(err, config.codec.rank, basis->manifest.rank);
    std::string s;
    for (const auto& row : ranks) {
      for (int rk : row) absl::StrAppend(&s, rk);
      s += " ";
    }
    std::fprintf(stderr, "%s: per-head ranks (a layer's heads together) %s\n", config.name.c_str(),
                 s.c_str());
  }
  auto make_cache = [&]() -> absl::StatusOr<std::unique_ptr<AttentionCache>> {
    if (config.dense) return std::make_unique<DenseCache>(mc.cache_shape());
    core::CodecOptions o = config.codec;
    o.head_dim = mc.head_dim;
    ASSIGN_OR_RETURN(
        auto cc, CodecCache::Create(mc.cache_shape(), o, basis,
                                    {.keys_only = config.keys_only,
                                     .read = config.fused ? CodecRead::kAttend : CodecRead::kDecode,
                                     .head_ranks = ranks.empty() ? nullptr : &ranks,
                                     .probe = config.probe,
                                     .value_metric_rounding = config.value_metric_rounding}));
    EvalLevers levers = config.levers;
    levers.rope = model.rope();
    RETURN_IF_ERROR(cc->SetLevers(levers));
    return std::unique_ptr<AttentionCache>(std::move(cc));
  };
  // Windows run kWindowBatch at a time through one batched forward (same results as one by
  // one, LlamaModel::ForwardBatch; the weights are read once per chunk for all of them).
  constexpr int kWindowBatch = 8;
  std::vector<std::vector<float>> logits;
  for (int w0 = 0; w0 < windows; w0 += kWindowBatch) {
    const int nb = std::min(kWindowBatch, windows - w0);
    std::vector<std::unique_ptr<AttentionCache>> owned(nb);
    std::vector<AttentionCache*> caches(nb);
    std::vector<const int32_t*> toks(nb);
    for (int b = 0; b < nb; ++b) {
      ASSIGN_OR_RETURN(owned[b], make_cache());
      caches[b] = owned[b].get();
      toks[b] = tokens.data() + static_cast<size_t>(w0 + b) * window_len;
    }
    RETURN_IF_ERROR(model.ForwardDecodeFaithfulBatch(toks, window_len, 0, caches, first, &logits));
    for (int b = 0; b < nb; ++b) {
      for (int j = first; j < window_len - 1; ++j) {
        r.nll_sum += TokenNll(logits[b].data() + static_cast<size_t>(j - first) * mc.vocab,
                              mc.vocab, toks[b][j + 1]);
        ++r.scored_tokens;
      }
      if (!config.dense) {
        core::SizeReport sz = caches[b]->Size();
        r.k_bits += sz.k_bits_steady();
        r.k_bits_ctx += sz.k_bits_effective();
        if (config.keys_only) {
          r.v_bits += 16;
          r.v_bits_ctx += 16;
        } else {
          r.v_bits += sz.v_bits_steady();
          r.v_bits_ctx += sz.v_bits_effective();
        }
      }
    }
    if (on_window) on_window(w0 + nb);
  }
  if (config.dense) {
    r.k_bits = r.v_bits = r.k_bits_ctx = r.v_bits_ctx = 16;  // fp16 cache
  } else {
    r.k_bits /= windows;
    r.v_bits /= windows;
    r.k_bits_ctx /= windows;
    r.v_bits_ctx /= windows;
  }
  r.ppl = std::exp(r.nll_sum / r.scored_tokens);
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return r;
}

}  // namespace kvq::frontend
