#include "kvq/frontend/perplexity.h"

#include <chrono>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "kvq/core/status.h"

namespace kvq::frontend {

double TokenNll(const float* logits, int vocab, int32_t target) {
  float mx = logits[0];
  for (int i = 1; i < vocab; ++i) mx = std::max(mx, logits[i]);
  double sum = 0;
  for (int i = 0; i < vocab; ++i) sum += std::exp(static_cast<double>(logits[i]) - mx);
  return std::log(sum) + mx - logits[target];
}

absl::StatusOr<PerplexityResult> EvaluatePerplexity(const LlamaModel& model,
                                                    const std::vector<int32_t>& tokens,
                                                    int windows, int window_len,
                                                    const EvalConfig& config, BasisSet* bases,
                                                    const std::function<void(int)>& on_window) {
  const auto t0 = std::chrono::steady_clock::now();
  const LlamaConfig& mc = model.config();
  if (window_len < 4) return absl::InvalidArgumentError("window length must be >= 4");
  if (static_cast<int64_t>(windows) * window_len > static_cast<int64_t>(tokens.size())) {
    return absl::InvalidArgumentError(absl::StrCat("text has ", tokens.size(), " tokens, need ",
                                                   static_cast<int64_t>(windows) * window_len));
  }
  const core::ModelBasis* basis = nullptr;
  if (!config.dense && config.codec.rank > 0) {
    switch (config.basis) {
      case BasisKind::kQuery: basis = bases->query; break;
      case BasisKind::kCentred: basis = bases->centred; break;
      case BasisKind::kResidualWeighted: basis = bases->residual_weighted; break;
      case BasisKind::kOracle:
        return absl::InvalidArgumentError(config.name + ": the oracle basis exists only in --diagnostics");
      case BasisKind::kRandom:
        if (!bases->query) break;
        if (bases->random.u.empty()) bases->random = core::RandomBasis(bases->query->manifest, 1234);
        basis = &bases->random;
        break;
    }
    if (!basis) return absl::FailedPreconditionError(absl::StrCat(config.name, ": no basis of that kind loaded (--basis)"));
  }
  PerplexityResult r;
  const int first = window_len / 2;
  std::vector<float> logits;
  for (int w = 0; w < windows; ++w) {
    const int32_t* tok = tokens.data() + static_cast<size_t>(w) * window_len;
    std::unique_ptr<AttentionCache> cache;
    if (config.dense) {
      cache = std::make_unique<DenseCache>(mc.cache_shape());
    } else {
      core::CodecOptions o = config.codec;
      o.head_dim = mc.head_dim;
      // Checksums guard storage, not arithmetic; the store's scrub covers them in serving.
      o.verify_on_read = false;
      ASSIGN_OR_RETURN(auto cc, CodecCache::Create(mc.cache_shape(), o, basis, config.keys_only,
                                                    config.fused ? CodecRead::kAttend : CodecRead::kDecode));
      cache = std::move(cc);
    }
    RETURN_IF_ERROR(model.ForwardDecodeFaithful(tok, window_len, 0, cache.get(), first, &logits));
    for (int j = first; j < window_len - 1; ++j) {
      r.nll_sum += TokenNll(logits.data() + static_cast<size_t>(j - first) * mc.vocab, mc.vocab, tok[j + 1]);
      ++r.scored_tokens;
    }
    if (!config.dense) {
      core::SizeReport s = cache->Size();
      r.k_bits += s.k_bits_steady();
      r.k_bits_ctx += s.k_bits_effective();
      if (config.keys_only) {
        r.v_bits += 16;
        r.v_bits_ctx += 16;
      } else {
        r.v_bits += s.v_bits_steady();
        r.v_bits_ctx += s.v_bits_effective();
      }
    }
    if (on_window) on_window(w + 1);
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
