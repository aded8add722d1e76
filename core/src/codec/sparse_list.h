// Dense-and-sparse lists of encoded blocks (CodecOptions::sparse_keys / sparse_values,
// format::kFlagSparse): which elements a block keeps exactly, the list's bytes, and what reads add.
#pragma once

#include <cstdint>
#include <vector>

#include "kvq/core/codec.h"

namespace kvq::core::sparse {

// Chooses a block's exactly kept elements among rows x [G][d] (contiguous, a copy the caller
// then quantizes): up to `n` of them by TrimOutliers over the block's quantization ranges (keys:
// a channel over the tokens; values: a token's channel group), rows [0, skip) excluded. Clamps
// the chosen elements in x; returns their indices t * d + c, ascending, and their values before.
struct Chosen {
  std::vector<int64_t> index;
  std::vector<float> exact;
};
Chosen Choose(const CodecOptions& o, bool keys, int n, int skip, float* x);

// Writes the n-entry list at `list`: the chosen elements' deltas, exact minus decoded (decoded
// [G][d], what reads give without the list), then unused entries (position 0, delta 0).
void WriteList(const Chosen& chosen, const float* decoded, int n, uint8_t* list);

// Whether every entry's position is inside a block of G x d elements.
bool ListValid(const uint8_t* list, int n, int G, int d);

// What reads add, entry by entry (entries whose position falls outside the block are
// skipped: a list the reader did not verify never writes outside its rows):
// rows [G][d] (row stride ld) += delta at (t, c);
void AddToRows(const uint8_t* list, int n, int G, int d, float* rows, int64_t ld);
// scores out[i * out_stride + t] += scale * q[i * d + c] * delta;
void AddToScores(const uint8_t* list, int n, int G, int d, const float* q, int n_q, float scale,
                 float* out, int64_t out_stride);
// readout out[i * out_stride + c] += p[i * p_stride + t] * delta.
void AddToReadout(const uint8_t* list, int n, int G, int d, const float* p, int64_t p_stride,
                  int n_q, float* out, int64_t out_stride);

}  // namespace kvq::core::sparse
