// kvq-eval: perplexity of a real GGUF model with its KV cache held by each configuration.
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <map>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "flags.h"
#include "kvq/core/basis.h"
#include "kvq/frontend/eval_config.h"
#include "kvq/frontend/gguf.h"
#include "kvq/frontend/llama.h"
#include "kvq/frontend/model_files.h"
#include "kvq/frontend/perplexity.h"
#include "kvq/frontend/progress.h"
#include "kvq/frontend/tokenizer.h"
#include "nlohmann/json.hpp"

namespace kvq::frontend {
namespace {

constexpr char kHelp[] = R"(kvq-eval: perplexity of a GGUF Llama model whose KV cache is held by kvq configurations.

Usage: kvq-eval [--model GGUF] [--basis DIR] [--text FILE] [--windows N] [--window-len L]
                [--configs LIST] [--json FILE] [--threads T] [--dump-tokens FILE]

  --model GGUF      model file (default $KVQ_MODEL or ~/.cache/kvq/models/SmolLM2-135M-Instruct.Q4_1.gguf)
  --basis DIR       registry entry written by kvq-calibrate (needed by headq configs)
  --text FILE       evaluation text (default <shared>/data/wikitext-2/wiki.test.raw)
  --windows N       number of windows (default 8)
  --window-len L    tokens per window (default 512)
  --configs LIST    comma-separated configuration names (default dense,kivi-k2,headq-k2-r4)
  --json FILE       also write the results as JSON
  --threads T       BLAS threads (default 2)
  --dump-tokens F   write the token ids of --text to F (one per line) and exit

Protocol (llama.cpp perplexity): the tokenized text is cut into consecutive windows of L
tokens from token 0; each window is a fresh sequence; logits at positions L/2 .. L-2 score the
next token (L/2 - 1 tokens per window). Decode-faithful: every query sees exactly the
encoded / fp16 split it would see when decoding one token at a time (a group of G keys and
values is encoded once more than R + G - 1 tokens wait in the fp16 window).

Configuration grammar:
  dense                          fp16 keys and values, exact attention
  <family>-<target><bits>[-<option>...]
    family  kivi (KIVI-like base only) | headq (base + HeadQ side code, rank 4 by default)
    target  k (keys quantized, values fp16) | kv (keys and values quantized)
    bits    2, 3, 4, 8
    options r<N> rank, g<N> key group G (32/64/128), vg<N> value channel group,
            w<N> fp16 window R, s<N> side-code bits (4/8), a2 (A^2 value policy),
            random | wrongsign | centred | resw (basis controls and ablations)
  Defaults: G=32, vg=32, R=0, s=8; headq-kv*-a2 defaults to G=128, vg=64.
  Examples: kivi-k2 headq-k2-r4 headq-k2-r4-random headq-k2-r4-wrongsign kivi-kv2 headq-kv2-a2

Every flag can also be set as KVQ_EVAL_<FLAG> (e.g. KVQ_EVAL_WINDOWS=32).
)";

int Fail(const absl::Status& s) {
  std::fprintf(stderr, "kvq-eval: %s\n", std::string(s.ToString()).c_str());
  return 1;
}

// The config whose excess this one's is measured against: kivi with the same target and bits.
std::string BaselineOf(const EvalConfig& c) {
  if (c.dense || c.family == "kivi") return "";
  return absl::StrCat("kivi-", c.keys_only ? "k" : "kv", c.codec.key_bits);
}

int Main(int argc, char** argv) {
  Flags flags("eval",
              {{"model", DefaultModelPath()},
               {"basis", ""},
               {"text", SharedDir() + "/data/wikitext-2/wiki.test.raw"},
               {"windows", "8"},
               {"window-len", "512"},
               {"configs", "dense,kivi-k2,headq-k2-r4"},
               {"json", ""},
               {"threads", "2"},
               {"dump-tokens", ""}},
              kHelp);
  int rc = 0;
  if (!flags.Parse(argc, argv, &rc)) return rc;
  SetBlasThreads(static_cast<int>(flags.GetInt("threads")));
  auto configs = ParseEvalConfigList(flags.Get("configs"));
  if (!configs.ok()) return Fail(configs.status());
  auto file = GgufFile::Open(flags.Get("model"));
  if (!file.ok()) return Fail(file.status());
  auto tok = Tokenizer::FromGguf(**file);
  if (!tok.ok()) return Fail(tok.status());
  auto text = ReadFile(flags.Get("text"));
  if (!text.ok()) return Fail(text.status());
  const auto t_tok = std::chrono::steady_clock::now();
  std::vector<int32_t> ids = (*tok)->Encode(*text);
  std::fprintf(stderr, "kvq-eval: %zu tokens from %s (%.1fs)\n", ids.size(), flags.Get("text").c_str(),
               std::chrono::duration<double>(std::chrono::steady_clock::now() - t_tok).count());
  if (!flags.Get("dump-tokens").empty()) {
    std::ofstream out(flags.Get("dump-tokens"));
    for (int32_t id : ids) out << id << "\n";
    return out ? 0 : Fail(absl::InternalError("cannot write --dump-tokens file"));
  }
  auto model = LlamaModel::Load(**file);
  if (!model.ok()) return Fail(model.status());

  BasisSet bases;
  core::ModelBasis query, centred, resw;
  if (!flags.Get("basis").empty()) {
    auto b = core::ReadBasis(flags.Get("basis"));
    if (!b.ok()) return Fail(b.status());
    query = std::move(*b);
    bases.query = &query;
    if (auto c = core::ReadBasis(flags.Get("basis") + "/centred"); c.ok()) {
      centred = std::move(*c);
      bases.centred = &centred;
    }
    if (auto c = core::ReadBasis(flags.Get("basis") + "/resw"); c.ok()) {
      resw = std::move(*c);
      bases.residual_weighted = &resw;
    }
  }
  const int windows = static_cast<int>(flags.GetInt("windows"));
  const int wlen = static_cast<int>(flags.GetInt("window-len"));
  std::map<std::string, PerplexityResult> results;
  ProgressBar bar("kvq-eval", static_cast<int64_t>(windows) * configs->size());
  int64_t done = 0;
  for (const auto& c : *configs) {
    auto r = EvaluatePerplexity(**model, ids, windows, wlen, c, &bases, [&](int) {
      bar.Update(++done, c.name);
    });
    if (!r.ok()) return Fail(r.status());
    results[c.name] = *r;
  }
  bar.Finish();

  nlohmann::json js;
  js["model"] = flags.Get("model");
  js["text"] = flags.Get("text");
  js["windows"] = windows;
  js["window_len"] = wlen;
  js["protocol"] = "llama.cpp perplexity (second half of each window), decode-faithful";
  js["rows"] = nlohmann::json::array();
  std::printf("%-28s %10s %9s %7s %7s %9s %9s %8s\n", "config", "PPL", "excess%", "k_bits",
              "v_bits", "k_bits@L", "v_bits@L", "seconds");
  const PerplexityResult* dense = results.count("dense") ? &results["dense"] : nullptr;
  for (const auto& c : *configs) {
    const PerplexityResult& r = results[c.name];
    std::string ex = "-";
    nlohmann::json exj = nullptr;
    const std::string base = BaselineOf(c);
    if (dense && !base.empty() && results.count(base)) {
      const double denom = results[base].ppl - dense->ppl;
      if (std::abs(denom) > 1e-12) {
        const double e = (results[base].ppl - r.ppl) / denom;
        ex = absl::StrFormat("%.1f", 100 * e);
        exj = e;
      }
    }
    std::printf("%-28s %10.4f %9s %7.3f %7.3f %9.3f %9.3f %8.1f\n", c.name.c_str(), r.ppl,
                ex.c_str(), r.k_bits, r.v_bits, r.k_bits_ctx, r.v_bits_ctx, r.seconds);
    js["rows"].push_back({{"config", c.name},
                          {"ppl", r.ppl},
                          {"excess_removed", exj},
                          {"baseline", base.empty() ? nlohmann::json(nullptr) : nlohmann::json(base)},
                          {"k_bits", r.k_bits},
                          {"v_bits", r.v_bits},
                          {"k_bits_ctx", r.k_bits_ctx},
                          {"v_bits_ctx", r.v_bits_ctx},
                          {"tokens", r.scored_tokens},
                          {"seconds", r.seconds},
                          {"codec", c.dense ? "dense" : c.codec.ToString()}});
  }
  if (!flags.Get("json").empty()) {
    std::ofstream out(flags.Get("json"));
    out << js.dump(2) << "\n";
    if (!out) return Fail(absl::InternalError("cannot write --json file"));
  }
  return 0;
}

}  // namespace
}  // namespace kvq::frontend

int main(int argc, char** argv) { return kvq::frontend::Main(argc, argv); }
