#include "kvq/frontend/codec_search.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "kvq/core/codec_json.h"
#include "kvq/core/status.h"
#include "kvq/frontend/eval_config.h"
#include "kvq/frontend/perplexity.h"

namespace kvq::frontend {

CodecBits SteadyStateBits(const core::CodecOptions& o, int context_tokens) {
  const double elements = static_cast<double>(o.key_group) * o.head_dim;
  CodecBits b{8.0 * core::KeyBlockBytes(o) / elements,
              8.0 * core::MaxValueBlockBytes(o) / elements};
  // S rows of 16-bit keys and values per head over context_tokens rows: 16 S / T per element.
  if (context_tokens > 0) b.sinks = 16.0 * o.fp16_sinks / context_tokens;
  return b;
}

const std::vector<std::string>& CodecSearchCandidates() {
  // Bits per element at head_dim 64 in the comments (K, V: mean). Fewer side-code bits,
  // coarser key groups and wider value groups reach below kivi-kv2; mixed key / value bits
  // fill the steps between the uniform rows; the 8-bit rows are the high end. Left out, since
  // every candidate costs a search run: settings another candidate beats at no more bits in
  // RESULTS.md's SmolLM2 tables (kivi-kv2 by headq-kv2-g128, the old G = 32 default
  // headq-kv2 and rank 2 with 8-bit side codes by headq-kv3-g128-s4-v2).
  static const std::vector<std::string> kCandidates = {
      "kivi-kv2-g128-vg64",         // 2.27, 2.52: 2.39
      "headq-kv2-g128-s4-vg64",     // 2.53, 2.52: 2.52
      "kivi-kv2-g128",              // 2.27, 3.02: 2.64
      "headq-kv2-g128-vg64",        // 2.78, 2.52: 2.65
      "headq-kv2-g128-s4",          // 2.53, 3.02: 2.77
      "headq-kv2-g128",             // 2.78, 3.02: 2.90
      "headq-kv3-g128-s4-v2-vg64",  // 3.53, 2.52: 3.02
      "kivi-kv3-g128-v2",           // 3.27, 3.02: 3.14
      "headq-kv3-g128-s4-v2",       // 3.53, 3.02: 3.27
      "headq-kv3-g128-v2",          // 3.78, 3.02: 3.40
      "headq-kv2-g128-v3",          // 2.78, 4.02: 3.40
      "kivi-kv4-g128-v2",           // 4.27, 3.02: 3.64
      "kivi-kv3-g128",              // 3.27, 4.02: 3.64
      "headq-kv3-g128-vg64",        // 3.78, 3.52: 3.65
      "headq-kv3-g128",             // 3.78, 4.02: 3.90
      "kivi-kv3",                   // 4.06, 4.06: 4.06
      "headq-kv4-g128-v3",          // 4.78, 4.02: 4.40
      "kivi-kv4-g128-vg64",         // 4.27, 4.52: 4.39
      "kivi-kv4-g128",              // 4.27, 5.02: 4.64
      "headq-kv4-g128",             // 4.78, 5.02: 4.90
      "kivi-kv4",                   // 5.06, 5.06: 5.06
      "kivi-kv4-g128-v8-vg64",      // 4.27, 8.52: 6.39
      "headq-kv4-g128-v8-vg64",     // 4.78, 8.52: 6.65
      "kivi-kv8-g128-vg64",         // 8.27, 8.52: 8.39
      "kivi-kv8-g128",              // 8.27, 9.02: 8.64
      "kivi-kv8-vg64",              // 9.06, 8.56: 8.81
      "kivi-kv8",                   // 9.06, 9.06: 9.06
  };
  return kCandidates;
}

const std::vector<std::string>& KeyLevers() {
  static const std::vector<std::string> kLevers = {"", "mr", "obl-mr", "rotk-mr"};
  return kLevers;
}

std::string WithKeyLever(const std::string& name, const std::string& lever) {
  std::string l = lever;
  // A KIVI-like codec has no side code: an oblique pair means nothing to it.
  if (name.rfind("kivi", 0) == 0 && l.rfind("obl", 0) == 0)
    l = l.find('-') == std::string::npos ? "" : l.substr(l.find('-') + 1);
  return l.empty() ? name : absl::StrCat(name, "-", l);
}

std::string WithSparseLever(const std::string& name) {
  const std::vector<std::string> parts = absl::StrSplit(name, '-');
  auto has = [&](const char* p) { return std::find(parts.begin(), parts.end(), p) != parts.end(); };
  std::string out = name;
  if (!has("rotk") && !has("rot")) absl::StrAppend(&out, "-sk", kSparseLeverPermille);
  if (!has("rotv") && !has("rot")) absl::StrAppend(&out, "-sv", kSparseLeverPermille);
  return out;
}

absl::StatusOr<std::vector<CodecSearchRow>> PlanCodecSearch(const std::vector<std::string>& names,
                                                            int head_dim, int basis_rank,
                                                            double max_bits, int context_tokens) {
  std::vector<CodecSearchRow> rows;
  const CodecSearchRow* smallest = nullptr;
  bool any = false;
  for (const std::string& name : names) {
    ASSIGN_OR_RETURN(EvalConfig c, ParseEvalConfig(name));
    // Only what a registry entry's codec.json can say: the server serves keys and values
    // through the codec with the entry's query basis.
    if (c.keys_only || (c.basis != BasisKind::kQuery && c.basis != BasisKind::kOblique) ||
        c.adaptive_rank || c.probe || c.fused || c.wrong_sign || c.value_metric_rounding) {
      return absl::InvalidArgumentError(absl::StrCat(
          "codec search candidate '", name,
          "': must be a full-KV (kv) codec with the query basis or the oblique pair (no basis "
          "controls, adapt, probe or fused): codec.json holds only codec settings"));
    }
    CodecSearchRow r;
    r.name = name;
    r.oblique = c.basis == BasisKind::kOblique;
    r.codec = c.codec;
    r.codec.head_dim = head_dim;
    absl::Status valid = r.codec.Validate();
    if (!valid.ok()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "codec search candidate '", name, "' at head_dim ", head_dim, ": ", valid.message()));
    }
    r.bits = SteadyStateBits(r.codec, context_tokens);
    if (r.codec.rank > basis_rank) {
      r.skipped = absl::StrCat("rank ", r.codec.rank, " > basis rank ", basis_rank);
    } else if (r.bits.per_element() > max_bits) {
      r.skipped = absl::StrFormat("%.3f bits > %.3f", r.bits.per_element(), max_bits);
    }
    any |= r.skipped.empty();
    rows.push_back(std::move(r));
  }
  for (const auto& r : rows) {
    if (r.codec.rank <= basis_rank &&
        (!smallest || r.bits.per_element() < smallest->bits.per_element())) {
      smallest = &r;
    }
  }
  if (!any) {
    if (!smallest)
      return absl::FailedPreconditionError("no codec search candidate fits the basis rank");
    return absl::FailedPreconditionError(absl::StrFormat(
        "--bits %.3f: no codec candidate fits; the smallest, %s, costs %.3f bits per element "
        "(K %.3f, V %.3f)",
        max_bits, smallest->name, smallest->bits.per_element(), smallest->bits.k,
        smallest->bits.v));
  }
  return rows;
}

absl::StatusOr<int> RunCodecSearch(
    const LlamaModel& model, const std::vector<int32_t>& tokens, int windows, int window_len,
    BasisSet* bases, std::vector<CodecSearchRow>* rows,
    const std::function<void(int64_t, const std::string&)>& on_window) {
  int64_t done = 0;
  for (size_t i = 0; i < rows->size(); ++i) {
    CodecSearchRow& r = (*rows)[i];
    if (!r.skipped.empty()) continue;
    // Evaluated as kvq-eval --configs calibrated evaluates codec.json: the same conversion.
    ASSIGN_OR_RETURN(EvalConfig c, EvalConfigFromCodec(r.name, r.codec));
    if (r.oblique) c.basis = BasisKind::kOblique;
    const int64_t before = done;
    auto progress = [&](int w) {
      if (on_window) on_window(before + w, r.name);
    };
    ASSIGN_OR_RETURN(PerplexityResult p,
                     EvaluatePerplexity(model, tokens, windows, window_len, c, bases, progress));
    done = before + windows;
    r.ppl = p.ppl;
  }
  const int chosen = ChooseWithin(*rows, std::numeric_limits<double>::infinity());
  if (chosen < 0) return absl::InternalError("no codec candidate gave a finite perplexity");
  (*rows)[chosen].chosen = true;
  return chosen;
}

int ChooseWithin(const std::vector<CodecSearchRow>& rows, double budget) {
  auto fits = [&](const CodecSearchRow& r) {
    return r.skipped.empty() && std::isfinite(r.ppl) && r.bits.per_element() <= budget;
  };
  double lowest = std::numeric_limits<double>::infinity();
  for (const CodecSearchRow& r : rows)
    if (fits(r)) lowest = std::min(lowest, r.ppl);
  // The near-ties: within kChoiceNoiseMargin of the lowest; of them the fewest bits, then the
  // earlier row.
  int best = -1;
  for (size_t i = 0; i < rows.size(); ++i) {
    const CodecSearchRow& r = rows[i];
    if (!fits(r) || r.ppl > lowest * (1 + kChoiceNoiseMargin)) continue;
    if (best < 0 || r.bits.per_element() < rows[best].bits.per_element())
      best = static_cast<int>(i);
  }
  return best;
}

nlohmann::json CodecSearchJson(const std::vector<CodecSearchRow>& rows, double max_bits,
                               const std::string& text, int windows, int window_len) {
  nlohmann::json js;
  js["max_bits_per_element"] = max_bits;
  js["criterion"] =
      "validation perplexity, llama.cpp's protocol (second half of each window), "
      "decode-faithful, with the entry's basis; ties: fewer bits per element";
  js["bits"] =
      "steady state, every byte counted: 8 * block bytes / (G * head_dim), "
      "A^2 value blocks at their largest; per element = (K + V) / 2, plus the fp16 "
      "sinks' rows counted at window_len tokens (16 * sinks / window_len)";
  js["text"] = text;
  js["windows"] = windows;
  js["window_len"] = window_len;
  js["candidates"] = nlohmann::json::array();
  for (const auto& r : rows) {
    nlohmann::json row = {
        {"name", r.name},
        {"codec", r.codec.ToString()},
        {"settings", core::CodecToJson(r.codec)},
        {"bits_per_element", r.bits.per_element()},
        {"k_bits", r.bits.k},
        {"v_bits", r.bits.v},
        {"sink_bits", r.bits.sinks},
        {"oblique_basis", r.oblique},
        {"ppl", r.skipped.empty() ? nlohmann::json(r.ppl) : nlohmann::json(nullptr)},
        {"chosen", r.chosen}};
    if (!r.skipped.empty()) row["skipped"] = r.skipped;
    js["candidates"].push_back(std::move(row));
  }
  for (const auto& r : rows)
    if (r.chosen) js["chosen"] = r.name;
  return js;
}

std::string CodecSearchTable(const std::vector<CodecSearchRow>& rows) {
  std::string out = absl::StrFormat("%-28s %7s %7s %7s %10s  %s\n", "candidate", "bits", "k_bits",
                                    "v_bits", "PPL", "codec");
  for (const auto& r : rows) {
    const std::string ppl = r.skipped.empty() ? absl::StrFormat("%.4f", r.ppl) : "-";
    absl::StrAppendFormat(&out, "%-28s %7.3f %7.3f %7.3f %10s  %s%s\n", r.name,
                          r.bits.per_element(), r.bits.k, r.bits.v, ppl, r.codec.ToString(),
                          r.chosen            ? "  <- chosen"
                          : r.skipped.empty() ? ""
                                              : absl::StrCat("  (skipped: ", r.skipped, ")"));
  }
  return out;
}

}  // namespace kvq::frontend
