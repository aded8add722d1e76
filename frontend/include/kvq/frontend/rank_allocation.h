// HeadQ ranks that differ across layers or heads, allocated on validation text: by the query
// energy each basis column captures per layer ("-adapt"), or by the score error each rank
// leaves per (layer, KV head), measured with the codec's own base code ("-hadapt").
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "kvq/core/basis.h"
#include "kvq/core/codec.h"
#include "kvq/frontend/llama.h"

namespace kvq::frontend {

// Runs `tokens` (validation text) through the dense model in windows of window_len and
// measures, per layer, the share of query energy each column of `basis` captures:
// [layer][j] = mean over KV heads of E[(u_j . q)^2] / E[|q|^2].
absl::StatusOr<std::vector<std::vector<double>>> MeasureColumnEnergy(
    const LlamaModel& model, const std::vector<int32_t>& tokens, int window_len,
    const core::ModelBasis& basis);

// Per-layer ranks with sum = mean_rank * layers, each in [1, max_rank], chosen greedily by
// the largest next-column energy (optimal for decreasing marginals).
std::vector<int> AllocateRanks(const std::vector<std::vector<double>>& column_energy, int mean_rank,
                               int max_rank);

// The score error that a rank-r side code leaves, [layer][kv_head][r] for r = 0..basis rank:
// sum over the windows' keys k and the head's queries q of (q . (e - B_r A_r^T e))^2 with
// e = k - base(k) the residual of `codec`'s base code (its bits, groups, sinks and metric
// rounding; rank 0) and B_r, A_r the first r columns of the basis's decode and encode bases.
// Every query meets every key of its window (no causal mask), through the window's second
// moments: tr(M W S W^T), M = sum q q^T, S = sum e e^T, W = I - B_r A_r^T. Side-code
// quantization is not modelled. With rotated keys the codec quantizes H k and codes the side
// code on H B, H A: the decoded key is H^T base(H k) + B A^T e with e = k - H^T base(H k), the
// same formula in the keys' own coordinates, with e from the decoded (rotated back) base.
absl::StatusOr<std::vector<std::vector<std::vector<double>>>> MeasureHeadScoreError(
    const LlamaModel& model, const std::vector<int32_t>& tokens, int window_len,
    const core::ModelBasis& basis, const core::CodecOptions& codec);

// Ranks [layer][kv_head] in [0, max_rank] summing to mean_rank * layers * kv_heads, given
// greedily to the head whose next rank lowers its error most.
std::vector<std::vector<int>> AllocateHeadRanks(
    const std::vector<std::vector<std::vector<double>>>& error, int mean_rank, int max_rank);

}  // namespace kvq::frontend
