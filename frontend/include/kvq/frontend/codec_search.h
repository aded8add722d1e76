// kvq-calibrate --bits B: the codec settings it chooses among, what each costs in bits per
// element, and the search itself (validation perplexity with the basis just calibrated).
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "kvq/core/basis.h"
#include "kvq/core/codec.h"
#include "kvq/frontend/llama.h"
#include "kvq/frontend/perplexity.h"
#include "nlohmann/json.hpp"

namespace kvq::frontend {

// Steady-state bits per element of a codec at its head_dim, every byte counted (headers,
// scales and zero points, side code, A^2 width tags): 8 * block bytes / (G * head_dim), as
// kvq-eval's k_bits / v_bits columns measure them. An A^2 value block is counted at its
// largest size (MaxValueBlockBytes), so the figure bounds what any block costs. The fp16
// sinks (CodecOptions::fp16_sinks) cost a sequence the same bytes whatever its length: they
// are counted at `context_tokens` (the search's window length; 0: not counted).
struct CodecBits {
  double k = 0, v = 0;
  double sinks = 0;  // bits per element the fp16 sinks add (K and V together) at the context
  double per_element() const { return (k + v) / 2 + sinks; }  // K and V together
};
CodecBits SteadyStateBits(const core::CodecOptions& o, int context_tokens = 0);

// The candidates, as kvq-eval config names (full-KV "kv" targets with the query basis):
// the one list to edit to search more settings. From about 2.4 to 9 bits per element at
// head_dim 64.
const std::vector<std::string>& CodecSearchCandidates();

// The key-side levers, as suffixes of kvq-eval options: "" (nearest rounding, query basis),
// "mr" (metric rounding), "obl-mr" (and the oblique pair), "rotk-mr" (and keys rotated by
// H). Which pays is model-dependent (rotation: a large gain on SmolLM2, a large loss on
// Qwen2.5), so the search first evaluates each on one probe codec (kLeverProbe) and then
// searches the candidates with the winner (WithKeyLever).
const std::vector<std::string>& KeyLevers();
// The probe has 2-bit keys: at 3 bits the levers' perplexities lay within rounding noise of
// each other on Qwen2.5 (0.5%), at 2 bits they differ by several percent.
inline constexpr char kLeverProbe[] = "headq-kv2-g128";
// The attention-sink lever (CodecOptions::fp16_sinks = 4): tried on the probe with the key
// lever chosen, and when it lowers the probe's perplexity every candidate is searched with
// and without it (the budget decides, its 16-bit rows counted at the search's context).
inline constexpr char kSinkLever[] = "sink4";
// `name` with `lever` applied: headq names get it whole, kivi names its codec parts only
// (they have no basis to make oblique).
std::string WithKeyLever(const std::string& name, const std::string& lever);
// The dense-and-sparse lever (CodecOptions::sparse_keys / sparse_values, this per mille of
// each block): tried on the probe after the sink lever, and when it lowers the probe's
// perplexity by kSparseLeverMinGain every candidate is searched once more with it (the budget
// decides: its lists cost 32 bits an element, 0.16 bits per element at 5 per mille).
inline constexpr int kSparseLeverPermille = 5;
// ... taken only when the probe's perplexity falls by at least this fraction: its lists cost
// bits, and the search's run-to-run spread is up to about 1% (docs/RESULTS.md), within which a
// strict "lower" would take it by chance (SmolLM2's probe: 16.094 -> 16.091).
inline constexpr double kSparseLeverMinGain = 0.01;
// `name` with the sparse lever for the tensors it applies to: keys unless the name rotates
// them (rotk, rot), values unless it rotates them (rotv, rot); `name` itself when neither.
std::string WithSparseLever(const std::string& name);

struct CodecSearchRow {
  std::string name;
  core::CodecOptions codec;  // at the model's head_dim: what codec.json would hold
  CodecBits bits;
  std::string skipped;  // why it was not evaluated ("" when it was)
  double ppl = 0;       // validation perplexity (when evaluated)
  bool chosen = false;
  bool oblique = false;  // evaluated with the oblique pair (DIR/oblique) instead of DIR's basis
};

// The rows of `names` at `head_dim`: each parsed (a name that is not a full-KV codec with
// the query basis or the oblique pair is an error naming it), its bits counted, and skipped when
// its bits per element exceed max_bits or its rank the basis rank. FAILED_PRECONDITION when none is
// left, naming the smallest candidate's bits. context_tokens: where the fp16 sinks are counted
// (SteadyStateBits).
absl::StatusOr<std::vector<CodecSearchRow>> PlanCodecSearch(const std::vector<std::string>& names,
                                                            int head_dim, int basis_rank,
                                                            double max_bits,
                                                            int context_tokens = 0);

// The choice's noise margin: perplexities within this fraction of the lowest are near-ties,
// and of them the fewest bits per element win (then the earlier row), so that a change in the
// arithmetic (another build, another forward pass) cannot flip the choice between codecs that
// are equal within its noise. 0.5%: one codec's perplexity on the same 8 x 512 tokens moves by
// 0.01-0.70% (median 0.32%) between kvq's forward pass and transformers' (docs/RESULTS.md,
// "Calibration chooses the codec"; a rerun of either is bit for bit the same); a wider margin
// gives up test-text perplexity that the recorded rows show is real. kvq-calibrate-hf applies
// the same rule (kvq/hf/codec_choice.py NOISE_MARGIN; a test holds the two equal).
inline constexpr double kChoiceNoiseMargin = 0.005;

// Evaluates every row not skipped: perplexity over `windows` windows of `window_len` tokens
// of `tokens` (llama.cpp's protocol, decode-faithful: EvaluatePerplexity) with `basis`, and
// marks ChooseWithin's row (no budget) as chosen. Returns the chosen row's index.
// on_window(windows done over all rows, row name) reports progress.
absl::StatusOr<int> RunCodecSearch(
    const LlamaModel& model, const std::vector<int32_t>& tokens, int windows, int window_len,
    BasisSet* bases, std::vector<CodecSearchRow>* rows,
    const std::function<void(int64_t, const std::string&)>& on_window = nullptr);

// Among the evaluated rows with a finite perplexity at <= budget bits per element, the near-ties
// (perplexity at most (1 + kChoiceNoiseMargin) times the lowest), and of them the one with the
// fewest bits, then the earlier row; -1 when none. Choices for smaller budgets come from the
// same rows.
int ChooseWithin(const std::vector<CodecSearchRow>& rows, double budget);

// codec-search.json: how the choice was made (budget, text, windows) and every row.
nlohmann::json CodecSearchJson(const std::vector<CodecSearchRow>& rows, double max_bits,
                               const std::string& text, int windows, int window_len);

// The rows as a table (one line each, the chosen one marked), for the tool's stdout.
std::string CodecSearchTable(const std::vector<CodecSearchRow>& rows);

}  // namespace kvq::frontend
