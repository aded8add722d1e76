#include "kvq/frontend/perplexity.h"

#include <chrono>
#include <cmath>
#include <cstdio>

#include "absl/strings/str_cat.h"
#include "kvq/core/status.h"

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

absl::StatusOr<CodeBooks> FitCodeBooks(const LlamaModel& model, const std::vector<int32_t>& tokens,
                                       int window_len, const EvalConfig& config) {
  const LlamaConfig& mc = model.config();
  if (!config.levers.nuq_keys) {
    return absl::InvalidArgumentError(config.name + ": no code books to fit (not a nuq config)");
  }
  core::CodecOptions o = config.codec;
  o.head_dim = mc.head_dim;
  o.verify_on_read = false;
  EvalLevers levers = config.levers;
  levers.rope = model.rope();
  levers.books = nullptr;  // uniform while counting
  std::vector<UnitHistogram> keys(mc.layers), values(mc.layers);
  int64_t windows = 0;
  for (size_t s = 0; s + window_len <= tokens.size(); s += window_len) {
    ASSIGN_OR_RETURN(auto cc, CodecCache::Create(mc.cache_shape(), o, nullptr, config.keys_only));
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
    books.keys.push_back(FitCodeBook(keys[l], o.key_bits));
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
  if (!config.dense && (config.codec.rank > 0 || config.codec.metric_rounding ||
                        config.codec.value_metric_rounding)) {
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
    if (config.codec.value_metric_rounding && basis->value_metric.empty())
      return absl::FailedPreconditionError(
          absl::StrCat(config.name,
                       ": value metric rounding needs the basis's value metric (kvq-calibrate "
                       "writes it; kvq-eval fills it from the model's weights)"));
  }
  PerplexityResult r;
  const int first = window_len / 2;
  std::vector<int> ranks;
  if (!config.dense && config.adaptive_rank) {
    if (bases->column_energy.empty() || !basis)
      return absl::FailedPreconditionError(
          config.name + ": no per-layer query energy (kvq-eval measures it from --calib-text)");
    ranks = AllocateRanks(bases->column_energy, config.codec.rank, basis->manifest.rank);
    std::string s;
    for (int rk : ranks) absl::StrAppend(&s, rk, " ");
    std::fprintf(stderr, "%s: per-layer ranks %s\n", config.name.c_str(), s.c_str());
  }
  auto make_cache = [&]() -> absl::StatusOr<std::unique_ptr<AttentionCache>> {
    if (config.dense) return std::make_unique<DenseCache>(mc.cache_shape());
    core::CodecOptions o = config.codec;
    o.head_dim = mc.head_dim;
    // Checksums guard storage, not arithmetic; the store's scrub covers them in serving.
    o.verify_on_read = false;
    ASSIGN_OR_RETURN(auto cc,
                     CodecCache::Create(mc.cache_shape(), o, basis, config.keys_only,
                                        config.fused ? CodecRead::kAttend : CodecRead::kDecode,
                                        config.adaptive_rank ? &ranks : nullptr, config.probe));
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
