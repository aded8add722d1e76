// Perplexity of a cache configuration, llama.cpp's protocol: the token stream is cut into
// consecutive windows of L tokens starting at token 0; each window is a fresh sequence
// (positions 0..L-1, no BOS since the model's add_bos_token is false), and only the second
// half is scored: the logits at positions j = L/2 .. L-2 predict tokens j+1, i.e. L/2 - 1
// scored tokens per window. PPL = exp(mean NLL).
//
// Decode-faithful: windows run through LlamaModel::ForwardDecodeFaithful, so every query sees
// the encoded / full-precision split it would see while decoding one token at a time.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "kvq/core/basis.h"
#include "kvq/frontend/eval_config.h"
#include "kvq/frontend/llama.h"
#include "kvq/frontend/rank_allocation.h"

namespace kvq::frontend {

struct PerplexityResult {
  double ppl = 0;
  double nll_sum = 0;
  int64_t scored_tokens = 0;
  // Bits per element (0 for dense): steady state (encoded blocks only) and at the window's
  // full context (blocks + full-precision window), averaged over windows.
  double k_bits = 0, v_bits = 0, k_bits_ctx = 0, v_bits_ctx = 0;
  double seconds = 0;
};

// basis: the query basis (or null when no config needs one). Random / centred /
// residual-weighted bases are passed through `bases` keyed by BasisKind.
struct BasisSet {
  const core::ModelBasis* query = nullptr;
  const core::ModelBasis* centred = nullptr;
  const core::ModelBasis* residual_weighted = nullptr;
  const core::ModelBasis* oblique = nullptr;
  core::ModelBasis random;  // filled lazily from query's shape
  // The wrong-sign control's pair for `of` (EvalConfig::wrong_sign): the encode basis `of`'s
  // (its A, else U), the decode basis `of`'s negated (-B, else -U), so that decoding subtracts
  // the correction the encoder coded. Kept for the last basis asked for.
  const core::ModelBasis* WrongSign(const core::ModelBasis& of);
  core::ModelBasis wrong_sign;
  const core::ModelBasis* wrong_sign_of = nullptr;
  // For "-adapt" configs: captured query energy per layer, [layer][j] = mean over KV heads of
  // E[(u_j . q)^2] / E[|q|^2] for column j of the query basis (see MeasureColumnEnergy).
  std::vector<std::vector<double>> column_energy;
  // For "-hadapt" configs: the validation tokens on which each config's per-head score errors
  // are measured (MeasureHeadScoreError with its own codec and basis).
  const std::vector<int32_t>* calibration_tokens = nullptr;
};

// The "-nuq" lever's code books for `config` (a kivi config with nuq or nuqk): runs `tokens`
// (validation text) in windows of window_len through the config's cache without books, counts
// where each layer's elements fall in their quantization groups, and fits each layer's keys'
// (and values') levels by Lloyd (nuq.h).
absl::StatusOr<CodeBooks> FitCodeBooks(const LlamaModel& model, const std::vector<int32_t>& tokens,
                                       int window_len, const EvalConfig& config);

absl::StatusOr<PerplexityResult> EvaluatePerplexity(
    const LlamaModel& model, const std::vector<int32_t>& tokens, int windows, int window_len,
    const EvalConfig& config, BasisSet* bases,
    const std::function<void(int window)>& on_window = nullptr);

// NLL of target under logits row (log-softmax), in double.
double TokenNll(const float* logits, int vocab, int32_t target);

}  // namespace kvq::frontend
