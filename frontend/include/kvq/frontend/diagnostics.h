// Key-side distortion diagnostics (docs/CODEC.md, "Distortion metrics") on real activations:
// for one KV head's post-RoPE keys and the queries that read them, encode the keys with a
// quantizer, then measure raw key MSE, the Fisher score error and the exact attention KL,
// averaged over causal queries. Used by kvq-eval --diagnostics and by the activation-fixture
// tests.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "kvq/core/codec.h"

namespace kvq::frontend {

struct KeyQuantizer {
  std::string name;
  core::CodecOptions codec;             // rank > 0 needs `basis`
  const float* basis = nullptr;         // U [d][codec.rank] row-major, or null
  const float* encode_basis = nullptr;  // an oblique pair's A (same layout), or null: A = U
  const float* query_moment = nullptr;  // [d][d] for codec.metric_rounding, or null
};

struct KeyDistortion {
  std::string quantizer;
  double key_mse = 0;  // mean squared key error per element
  double fisher = 0;   // mean over queries of 1/2 Var_p(ds)
  double kl = 0;       // mean over queries of KL(p || p_hat)
  double k_bits = 0;   // steady-state key bits per element
};

// q: [gq][n][d] queries of the gq query heads reading this KV head, position i = row i.
// k: [n][d] keys. Query i sees keys [0, i]; queries i < min_pos are skipped (too little
// context for a meaningful distribution). Keys are encoded with window 0 (all full groups).
absl::StatusOr<KeyDistortion> MeasureKeyDistortion(const KeyQuantizer& qz, const float* q, int gq,
                                                   const float* k, int n, int d, int min_pos);

// Value-side distortion of one KV head's values through a codec (window 0, the codec's sinks
// and value policy; A^2 widths from no observed attention): the mean squared error per
// element and the mean per token of dv^T M dv in the head's value metric M [d][d]
// (ModelBasis::value_metric: the error as the output projection sees it), which value
// metric rounding lowers when M couples channels.
struct ValueDistortion {
  double value_mse = 0;
  double metric_error = 0;
};
// v: [n][d] values. value_metric: [d][d]. round_in_metric: the codes are rounded in that
// metric (kvq-eval's vmr experiment) instead of to nearest.
absl::StatusOr<ValueDistortion> MeasureValueDistortion(const core::CodecOptions& codec,
                                                       const float* v, int n, int d,
                                                       const float* value_metric,
                                                       bool round_in_metric);

}  // namespace kvq::frontend
