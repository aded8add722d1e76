// Flash-decoding's partial softmax: attention over one range of tokens, kept unnormalized so
// that ranges computed apart (on other threads, later on other devices) merge exactly.
//
// For one query row and a part with logits s_t over its tokens t:
//   m = max_t s_t,  l = sum_t exp(s_t - m),  o[c] = sum_t exp(s_t - m) v_t[c].
// A part that saw none of the row's tokens (causal masking) has m = -inf, l = 0, o = 0.
// The merge of parts k: M = max_k m_k, w_k = exp(m_k - M),
//   out[c] = sum_k w_k o_k[c] / sum_k w_k l_k,
// which is softmax(s) . v over the union of the parts, up to rounding.
#pragma once

#include <cstdint>

namespace kvq::core {

// m, l: [parts][rows]; o: [parts][rows][d]; out: [rows][d]. Parts are summed in index order,
// so the result depends on the partition only. A row no part saw is written as zeros.
void MergePartials(const float* m, const float* l, const float* o, int parts, int64_t rows, int d,
                   float* out);

}  // namespace kvq::core
