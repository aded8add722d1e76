// The configuration grammar of kvq-eval (one name per cache configuration):
//
//   dense                                   fp32 keys and values, exact attention
//   <family>-<target><bits>[-<option>...]
//     family   kivi   KIVI-like base quantizer only (rank 0)
//              headq  KIVI-like base + HeadQ side code (rank 4 unless -r is given)
//     target   k      keys quantized, values kept dense (fp16, 16 bits/element)
//              kv     keys and values quantized
//     bits     2, 3, 4 or 8: key base bits (and value bits for kv)
//     options  r<N>   HeadQ rank N (headq only)
//              g<N>   key group G (tokens per key block): 32, 64, 128
//              vg<N>  channels per value scale group
//              w<N>   R: most recent tokens kept at fp16 besides the incomplete group
//              s<N>   side-code bits (4 or 8)
//              a2     A^2 value policy: per-token value bits {1..4} at a mean of <bits>
//              random     control: random orthonormal basis of the same rank (fixed seed)
//              wrongsign  control: the HeadQ correction subtracted instead of added
//              centred    basis from centred query PCA (kvq-calibrate writes DIR/centred)
//              resw       residual-weighted basis (kvq-calibrate writes DIR/resw)
//              obl        oblique pair from reduced-rank regression (kvq-calibrate writes
//                         DIR/oblique): encode basis A, decode basis B (calibration.h)
//              oracle     --diagnostics only, a labelled upper bound: the PCA of the very
//                         queries being scored (not a deployable basis)
//              probe      with a2: each append carries the appended positions' own queries as
//                         probe queries (LayerCache::Append with ProbeQueries), so tokens are
//                         weighed before their group is encoded; an encode-triggering token
//                         is appended alone with only its own query (no later query leaks)
//              adapt      per-layer HeadQ ranks with mean <rank> (1..basis rank), allocated
//                         greedily by the query energy each added column captures, measured
//                         on validation text (BasisSet::layer_ranks), never the test text
//              hadapt     per-head HeadQ ranks with mean <rank> over all (layer, KV head),
//                         given greedily to the head whose next rank lowers its score error
//                         most (the codec's own base residual and basis, queries of
//                         --calib-text: MeasureHeadScoreError); each head counted at its own
//                         rank
//              mr         metric rounding of the key base codes (needs a basis written with
//                         kvq-calibrate --query-moment)
//              vmr        value metric rounding: each value token's codes chosen by error
//                         feedback in the output projection's metric (kv targets; the
//                         basis's value metric, which kvq-eval fills from the model's
//                         weights when the basis has none)
//              rotk, rotv, rot  keys, values or both rotated by the normalized Hadamard
//                         matrix before quantization (CodecOptions::rotate_keys/values)
//              fused      read through the codec's fused LayerCache::Attend instead of
//                         local attention over LayerCache::Decode (same numbers, slower)
//              nuq, nuqk, nuqv  evaluation only: per-layer non-uniform code books (KVQuant's
//                         nuq) for keys and values, keys only or values only, fitted by Lloyd
//                         on the validation text (--calib-text) within kvq's own groups
//                         (nuq.h); keys on books: kivi only, not with mr or rotk; values on
//                         books: not with vmr or rotv
//              sk<N>, sv<N>  dense-and-sparse in the codec: N per mille of each key / value
//                         block's elements kept exact beside the codes (CodecOptions::
//                         sparse_keys / sparse_values; the block's list counted in the bits);
//                         spk<N> / spv<N> are the evaluation-only version measured before it
//                         (a budget per group of all KV heads, not per block)
//              sink<N>    attention sinks: a sequence's first N positions (1..16) kept at
//                         fp16, keys and values, beside the codec's first group
//                         (CodecOptions::fp16_sinks; counted in the at-context bits)
//
// Defaults: G = 32, value group 32, R = 0, side bits 8, except headq-kv*-a2, which defaults
// to G = 128 (the side code repairs the coarser key groups; that pays for the side code and
// the A^2 width tags) so that it stays within kivi-kv<bits>'s combined budget.
//   calibrated                              the codec that the basis folder's codec.json names
//                                           (kvq-calibrate --bits writes it): see
//                                           ParseEvalConfigList's `calibrated` argument
// Examples: kivi-k2, headq-k2-r4, headq-k2-r4-random, headq-k2-r4-wrongsign, kivi-kv2,
// headq-kv2-a2, kivi-k2-g128, headq-k3-r4-g64-w128.
#pragma once

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "kvq/core/codec.h"
#include "kvq/frontend/eval_levers.h"

namespace kvq::frontend {

enum class BasisKind { kQuery, kRandom, kCentred, kResidualWeighted, kOracle, kOblique };

struct EvalConfig {
  std::string name;
  bool dense = false;
  bool keys_only = false;  // values stay fp16 (dense readout)
  core::CodecOptions codec;
  BasisKind basis = BasisKind::kQuery;
  std::string family;               // "dense", "kivi", "headq"
  bool fused = false;               // CodecRead::kAttend
  bool adaptive_rank = false;       // per-layer ranks from BasisSet::column_energy
  bool head_adaptive_rank = false;  // per-head ranks from MeasureHeadScoreError
  bool probe = false;               // A^2 probe queries with each append
  EvalLevers levers;                // evaluation-only: spk<N>, spv<N>, pre (eval_levers.h)
  // Controls and experiments that are not codec settings (no codec.json or wire form):
  // wrongsign: the HeadQ correction subtracted instead of added, by decoding with -U what was
  // encoded with U (an oblique pair whose decode basis is the encode basis negated: the
  // paper's wrong-sign test); vmr: value codes rounded in the output projection's metric
  // (core::LayerCache's value_metric; it did not pay, docs/CODEC.md). Both run in-process only.
  bool wrong_sign = false;
  bool value_metric_rounding = false;
};

// The name of the config that evaluates the basis folder's codec.json.
inline constexpr char kCalibratedConfig[] = "calibrated";

absl::StatusOr<EvalConfig> ParseEvalConfig(const std::string& name);

// A config that evaluates `codec` exactly, as the server would serve it (full KV, the query
// basis; family headq when it has a side code, kivi otherwise), named `name`. Refused when
// `codec` fails Validate.
absl::StatusOr<EvalConfig> EvalConfigFromCodec(const std::string& name,
                                               const core::CodecOptions& codec);

// `calibrated`: the codec that "calibrated" stands for (null: the name is an error saying
// where it comes from).
absl::StatusOr<std::vector<EvalConfig>> ParseEvalConfigList(
    const std::string& comma_list, const core::CodecOptions* calibrated = nullptr);

// Whether the comma-separated list names "calibrated".
bool NamesCalibratedConfig(const std::string& comma_list);

}  // namespace kvq::frontend
