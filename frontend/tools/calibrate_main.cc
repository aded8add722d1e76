// kvq-calibrate: runs a GGUF model over calibration text, accumulates the post-RoPE queries
// per layer and KV head, and writes a HeadQ basis registry entry (basis.safetensors +
// manifest.json) into --out; with --bits B it then chooses the codec for that budget by
// validation perplexity (codec_search.h) and writes codec.json and codec-search.json.
#include <algorithm>
#include <cstdio>
#include <fstream>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "flags.h"
#include "kvq/core/basis.h"
#include "kvq/core/calibration.h"
#include "kvq/core/codec.h"
#include "kvq/core/codec_json.h"
#include "kvq/core/status.h"
#include "kvq/frontend/attention_cache.h"
#include "kvq/frontend/blas_kernels.h"
#include "kvq/frontend/codec_search.h"
#include "kvq/frontend/gguf.h"
#include "kvq/frontend/llama.h"
#include "kvq/frontend/model_and_text.h"
#include "kvq/frontend/model_files.h"
#include "kvq/frontend/progress.h"
#include "kvq/frontend/tokenizer.h"

namespace kvq::frontend {
namespace {

constexpr char kHelp[] =
    R"(kvq-calibrate: HeadQ query-PCA calibration of a GGUF model (llama or qwen2).

Usage: kvq-calibrate --out DIR [--model GGUF] [--text FILE] [--tokens N] [--rank R]
                     [--window-len L] [--variants] [--model-name NAME] [--threads T]
                     [--bits B [--search-windows N] [--search-window-len L] [--search-only]]

  --out DIR         registry entry to write (created; basis.safetensors + manifest.json)
  --model GGUF      model (default $KVQ_MODEL or ~/.cache/kvq/models/SmolLM2-135M-Instruct.Q4_1.gguf)
  --text FILE       calibration text (default $KVQ_DATA_DIR/wikitext-2/wiki.valid.tokens,
                    KVQ_DATA_DIR default ../shared/data; used verbatim: its <unk> markers are
                    kept as text)
  --tokens N        calibration tokens (default 32768), taken from the start of the text
  --rank R          basis rank (default 8; evaluation may use the first r <= R columns)
  --window-len L    tokens per independent calibration sequence (default 512)
  --variants        also write DIR/centred (centred PCA), DIR/resw (query second moment
                    weighted by the 2-bit G=32 KIVI key residual per channel) and DIR/oblique
                    (the reduced-rank-regression encode/decode pair over that residual's
                    covariance)
  --query-moment B  store each head's E[q q^T] in the basis (default true): the metric of the
                    codec's metric rounding (keys rounded so that the score error is small);
                    false writes U alone (a smaller file, nearest rounding only)
  --value-metric B  also store each KV head's value metric (sum of W_o,q^T W_o,q over its
                    query heads, from the weights; default false): the metric of the codec's
                    value metric rounding (kvq-eval computes it itself when a basis has none)
  --value-metric-heads independent|together
                    how the group's query heads combine in it: independent (the default, the
                    sum of each head's Gram matrix) or together (the Gram matrix of their
                    summed columns: every head attending alike; an evaluation variant)
  --model-name NAME manifest model name (default: the model's file name, lower case, without
                    .gguf and its quantization tag: SmolLM2-135M-Instruct.Q4_1.gguf ->
                    smollm2-135m-instruct)
  --threads T       BLAS threads (default 2)

Choosing the codec (a registry entry without codec.json is served with the server's
built-in default; `kvq models register DIR` sends DIR/codec.json with the basis):
  --bits B[,B2..]   also choose the codec for a budget of B bits per element, K and V
                    together ((K bits + V bits) / 2, steady state, every byte counted: block
                    headers, scales and zero points, side code; A^2 value blocks at their
                    largest; fp16 sinks at L tokens). Candidates: a fixed list of kvq-eval config names (full-KV
                    kivi-kv*/headq-kv* settings from about 2.4 to 9 bits per element at
                    head_dim 64; frontend/src/codec_search.cc); those over B (or over
                    the basis rank) are skipped and listed as such; it is an error when none
                    fits (naming the smallest candidate's bits). First the key-side lever
                    (none, metric rounding, + the oblique pair, + keys rotated by H:
                    codec_search.h KeyLevers) is chosen on one probe codec, then whether
                    fp16 attention sinks (sink4: the first 4 positions kept at fp16,
                    counted at L tokens: +16 * 4 / L bits) lower the probe's perplexity,
                    then whether dense-and-sparse (sk5-sv5, or sv5 with rotated keys: 5 per
                    mille of each block exact, +0.16 bits per tensor) lowers it by >= 1%;
                    then every candidate with that lever (and once more with sink4, and
                    with the sparse lever, when they paid) is evaluated with the basis just calibrated
                    (and DIR/oblique, which --bits also writes) by perplexity on N windows of
                    L tokens of --text that follow the basis's calibration tokens (the
                    validation text; llama.cpp's protocol, decode-faithful, as kvq-eval;
                    no token chooses the codec that also fitted the basis), and the lowest
                    perplexity wins, but near-ties (within 0.5% of the lowest,
                    codec_search.h kChoiceNoiseMargin) go to the fewest bits.
                    Writes DIR/codec.json (the chosen codec, the registry's format) and
                    DIR/codec-search.json (every candidate: name, bits per element, K and V
                    bits, validation PPL, skipped reason, chosen flag; the budget, text,
                    windows and window length) and prints the table. Without --bits no codec
                    is chosen and no codec.json is written.
                    Check the choice on the test text: kvq-eval --basis DIR --configs calibrated
                    More budgets (e.g. --bits 3,2.5,4) are chosen from the same evaluation
                    (candidates up to the largest); codec.json gets the first one's choice and
                    codec-search.json lists every budget's ("budgets").
  --search-windows N   windows of the search (default 8)
  --search-window-len L  tokens per search window (default 512)
  --search-only     do not calibrate: choose the codec for the basis already in DIR (its
                    manifest must match --model), e.g. for another --bits

Queries are post-RoPE in GGUF channel order, with the RoPE layout of the architecture
(llama: adjacent pairs, qwen2: halves; written to the manifest as rope_layout), all query
heads of a group pooled into their KV head, uncentred second moment E[q q^T] unless stated.
Every flag can also be set as KVQ_CALIBRATE_<FLAG>.
)";

int Fail(const absl::Status& s) {
  std::fprintf(stderr, "kvq-calibrate: %s\n", std::string(s.ToString()).c_str());
  return 1;
}

absl::Status WriteFile(const std::string& path, const std::string& text) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f << text;
  f.flush();
  if (!f) return absl::InternalError(absl::StrCat("cannot write ", path));
  return absl::OkStatus();
}

// --bits: chooses the codec for the basis in --out and writes codec.json and
// codec-search.json next to it.
int SearchCodec(const LlamaModel& model, const std::vector<int32_t>& ids,
                const std::vector<double>& budgets, int windows, int window_len,
                const Flags& flags) {
  const std::string dir = flags.Get("out");
  auto main_basis = ReadBasisFor(model.config(), dir);
  if (!main_basis.ok()) return Fail(main_basis.status());
  // DIR's basis is the query PCA, or the oblique pair an earlier search chose (the query PCA
  // then waits in DIR/query-pca); the other one is looked for beside it.
  const bool was_oblique = main_basis->oblique();
  core::ModelBasis query, oblique;
  (was_oblique ? oblique : query) = std::move(*main_basis);
  auto other = ReadBasisFor(model.config(), dir + (was_oblique ? "/query-pca" : "/oblique"));
  if (other.ok()) (was_oblique ? query : oblique) = std::move(*other);
  if (query.u.empty()) return Fail(other.status());
  // The search's windows follow the basis's calibration tokens (the first calibration_tokens
  // of the same text), so that no token the basis was fitted to also chooses the codec.
  const int64_t skip = query.manifest.calibration_tokens;
  if (static_cast<int64_t>(ids.size()) < skip + static_cast<int64_t>(windows) * window_len) {
    return Fail(absl::InvalidArgumentError(
        absl::StrCat("--text has ", ids.size(), " tokens; the search needs the basis's ", skip,
                     " calibration tokens + --search-windows ", windows, " x --search-window-len ",
                     window_len)));
  }
  const std::vector<int32_t> held_out(ids.begin() + skip, ids.end());
  BasisSet bases;
  bases.query = &query;
  if (!oblique.u.empty()) bases.oblique = &oblique;
  const int d = model.config().head_dim, rank = query.manifest.rank;
  auto search =
      [&](const std::vector<std::string>& names, double budget,
          const char* what) -> absl::StatusOr<std::pair<std::vector<CodecSearchRow>, int>> {
    ASSIGN_OR_RETURN(std::vector<CodecSearchRow> rows,
                     PlanCodecSearch(names, d, rank, budget, window_len));
    int64_t evaluated = 0;
    for (const auto& r : rows) evaluated += r.skipped.empty();
    std::fprintf(stderr,
                 "kvq-calibrate: %s: %lld of %zu candidates, each on %d x %d tokens of %s "
                 "after its first %lld\n",
                 what, static_cast<long long>(evaluated), rows.size(), windows, window_len,
                 flags.Get("text").c_str(), static_cast<long long>(skip));
    ProgressBar bar(absl::StrCat("kvq-calibrate ", what), evaluated * windows);
    ASSIGN_OR_RETURN(int chosen, RunCodecSearch(model, held_out, windows, window_len, &bases, &rows,
                                                [&](int64_t done, const std::string& name) {
                                                  bar.Update(done, name);
                                                }));
    bar.Finish();
    std::fputs(CodecSearchTable(rows).c_str(), stdout);
    return std::make_pair(std::move(rows), chosen);
  };
  // Stage 1: which key-side lever pays on this model, on one probe codec.
  std::vector<std::string> probes;
  std::vector<std::string> levers;
  for (const std::string& l : KeyLevers()) {
    if (l.rfind("obl", 0) == 0 && !bases.oblique) continue;  // no oblique pair calibrated
    probes.push_back(WithKeyLever(kLeverProbe, l));
    levers.push_back(l);
  }
  auto stage1 = search(probes, 1e9, "key lever");
  if (!stage1.ok()) return Fail(stage1.status());
  const std::string lever = levers[stage1->second];
  // Stage 1b: whether fp16 sinks pay on this model: the probe with the lever, with sinks.
  const CodecSearchRow& no_sinks = stage1->first[stage1->second];
  auto sink_probe = search({absl::StrCat(no_sinks.name, "-", kSinkLever)}, 1e9, "sink lever");
  if (!sink_probe.ok()) return Fail(sink_probe.status());
  const bool sinks = sink_probe->first[0].ppl < no_sinks.ppl;
  // Stage 1c: whether dense-and-sparse pays: the probe so far (the lever, the sinks when they
  // paid) with the sparse lever.
  const CodecSearchRow& probe_so_far = sinks ? sink_probe->first[0] : no_sinks;
  auto sparse_probe = search({WithSparseLever(probe_so_far.name)}, 1e9, "dense-and-sparse lever");
  if (!sparse_probe.ok()) return Fail(sparse_probe.status());
  const bool sparse = sparse_probe->first[0].name != probe_so_far.name &&
                      sparse_probe->first[0].ppl < probe_so_far.ppl * (1 - kSparseLeverMinGain);
  // Stage 2: the codec within the budget, every candidate with that lever (and each once
  // more with the sinks, when they paid, and once more with dense-and-sparse, when it paid).
  std::vector<std::string> names;
  for (const std::string& n : CodecSearchCandidates()) {
    names.push_back(WithKeyLever(n, lever));
    if (sinks) names.push_back(absl::StrCat(names.back(), "-", kSinkLever));
    if (sparse && WithSparseLever(names.back()) != names.back())
      names.push_back(WithSparseLever(names.back()));
  }
  // One evaluation serves every budget: the rows up to the largest, a choice per budget.
  const double max_bits = budgets[0], largest = *std::max_element(budgets.begin(), budgets.end());
  auto stage2 = search(names, largest, absl::StrCat("codec search (lever '", lever, "')").c_str());
  if (!stage2.ok()) return Fail(stage2.status());
  std::vector<CodecSearchRow>& rows = stage2->first;
  nlohmann::json per_budget = nlohmann::json::array();
  for (double b : budgets) {
    const int i = ChooseWithin(rows, b);
    per_budget.push_back(
        {{"max_bits_per_element", b},
         {"chosen", i < 0 ? nlohmann::json(nullptr) : nlohmann::json(rows[i].name)},
         {"bits_per_element", i < 0 ? 0.0 : rows[i].bits.per_element()},
         {"ppl", i < 0 ? nlohmann::json(nullptr) : nlohmann::json(rows[i].ppl)}});
    if (i >= 0)
      std::fprintf(
          stderr,
          "kvq-calibrate: within %.3f bits per element: %s (%.3f bits, validation PPL %.4f)\n", b,
          rows[i].name.c_str(), rows[i].bits.per_element(), rows[i].ppl);
  }
  const int first = ChooseWithin(rows, max_bits);
  if (first < 0) {
    return Fail(absl::FailedPreconditionError(
        absl::StrFormat("--bits %.3f: no evaluated candidate fits", max_bits)));
  }
  for (size_t i = 0; i < rows.size(); ++i) rows[i].chosen = static_cast<int>(i) == first;
  const CodecSearchRow& best = rows[first];
  // The entry serves with one basis: the oblique pair becomes DIR's when it was chosen.
  absl::Status st;
  if (best.oblique != was_oblique) {
    st = core::WriteBasis(dir + (best.oblique ? "/query-pca" : "/oblique"),
                          best.oblique ? query : oblique);
    if (st.ok()) st = core::WriteBasis(dir, best.oblique ? oblique : query);
  }
  if (st.ok()) st = WriteFile(dir + "/codec.json", core::CodecToJson(best.codec).dump(2) + "\n");
  if (st.ok()) {
    nlohmann::json js = CodecSearchJson(rows, max_bits, flags.Get("text"), windows, window_len);
    js["key_lever"] = lever;
    js["first_token"] = skip;  // the windows start after the calibration tokens
    js["budgets"] = per_budget;
    js["key_lever_search"] =
        CodecSearchJson(stage1->first, 1e9, flags.Get("text"), windows, window_len);
    js["sink_lever"] = sinks ? kSinkLever : "";
    js["sink_lever_search"] =
        CodecSearchJson(sink_probe->first, 1e9, flags.Get("text"), windows, window_len);
    js["sparse_lever"] = sparse;
    js["sparse_lever_search"] =
        CodecSearchJson(sparse_probe->first, 1e9, flags.Get("text"), windows, window_len);
    js["basis"] =
        best.oblique ? "oblique_rrr (DIR; the query PCA in DIR/query-pca)" : "query PCA (DIR)";
    st = WriteFile(dir + "/codec-search.json", js.dump(2) + "\n");
  }
  if (!st.ok()) return Fail(st);
  std::fprintf(stderr,
               "kvq-calibrate: chose %s (%s, %.3f bits per element, validation PPL %.4f): "
               "wrote %s/codec.json and %s/codec-search.json\n",
               best.name.c_str(), best.codec.ToString().c_str(), best.bits.per_element(), best.ppl,
               dir.c_str(), dir.c_str());
  return 0;
}

int Main(int argc, char** argv) {
  Flags flags("calibrate",
              {{"out", ""},
               {"model", DefaultModelPath()},
               {"text", DataFile("wikitext-2/wiki.valid.tokens")},
               {"tokens", "32768"},
               {"rank", "8"},
               {"window-len", "512"},
               {"variants", "false"},
               {"query-moment", "true"},
               {"value-metric", "false"},
               {"value-metric-heads", "independent"},
               {"model-name", ""},
               {"threads", "2"},
               {"bits", ""},
               {"search-windows", "8"},
               {"search-window-len", "512"},
               {"search-only", "false"}},
              kHelp);
  int rc = 0;
  if (!flags.Parse(argc, argv, &rc)) return rc;
  if (flags.Get("out").empty()) return Fail(absl::InvalidArgumentError("--out is required"));
  const bool search = !flags.Get("bits").empty(), search_only = flags.GetBool("search-only");
  std::vector<double> budgets;
  for (absl::string_view part : absl::StrSplit(flags.Get("bits"), ',', absl::SkipEmpty())) {
    double b = 0;
    if (!absl::SimpleAtod(part, &b) || !(b > 0)) {
      return Fail(absl::InvalidArgumentError(absl::StrCat(
          "--bits must be positive numbers of bits per element, comma-separated (got '",
          flags.Get("bits"), "')")));
    }
    budgets.push_back(b);
  }
  if (search && budgets.empty()) return Fail(absl::InvalidArgumentError("--bits: no budget given"));
  const double max_bits = search ? budgets[0] : 0;
  if (search_only && !search) {
    return Fail(absl::InvalidArgumentError("--search-only needs --bits B"));
  }
  const int search_windows = static_cast<int>(flags.GetInt("search-windows"));
  const int search_len = static_cast<int>(flags.GetInt("search-window-len"));
  if (search && (search_windows < 1 || search_len < 4)) {
    return Fail(
        absl::InvalidArgumentError("--search-windows must be >= 1 and --search-window-len >= 4"));
  }
  SetBlasThreads(static_cast<int>(flags.GetInt("threads")));
  auto loaded = LoadModelAndText(flags.Get("model"), flags.Get("text"));
  if (!loaded.ok()) return Fail(loaded.status());
  const LlamaModel& model = *loaded->model;
  std::vector<int32_t> ids = std::move(loaded->ids);
  if (search &&
      static_cast<int64_t>(ids.size()) < static_cast<int64_t>(search_windows) * search_len) {
    return Fail(absl::InvalidArgumentError(
        absl::StrCat("--text has ", ids.size(), " tokens; the search needs --search-windows ",
                     search_windows, " x --search-window-len ", search_len)));
  }
  if (search_only) return SearchCodec(model, ids, budgets, search_windows, search_len, flags);
  // The plan before the calibration: an impossible --bits is an error now, not after it.
  if (search) {
    auto plan = PlanCodecSearch(CodecSearchCandidates(), model.config().head_dim,
                                static_cast<int>(flags.GetInt("rank")), max_bits);
    if (!plan.ok()) return Fail(plan.status());
  }
  const int64_t want = flags.GetInt("tokens");
  const int L = static_cast<int>(flags.GetInt("window-len"));
  if (static_cast<int64_t>(ids.size()) < want) {
    return Fail(absl::InvalidArgumentError(
        absl::StrCat("text has ", ids.size(), " tokens, --tokens ", want)));
  }
  const LlamaConfig& c = model.config();
  const bool variants = flags.GetBool("variants");
  // The residual statistics feed the variants and the oblique pair the codec search tries.
  const bool residuals = variants || search;
  core::QueryStats stats(c.layers, c.q_heads, c.kv_heads, c.head_dim);
  // The residual statistics for the residual-weighted basis: 2-bit KIVI keys, G = 32.
  core::CodecOptions kivi;
  kivi.head_dim = c.head_dim;
  kivi.key_bits = 2;
  kivi.key_group = 32;
  kivi.rank = 0;
  std::vector<uint8_t> block;
  std::vector<float> kh, kb;
  auto hook = [&](int layer, int64_t start, int n, const float* q, const float* k, const float*) {
    for (int h = 0; h < c.q_heads; ++h)
      stats.Add(layer, h, q + static_cast<size_t>(h) * n * c.head_dim, n);
    if (!residuals) return;
    const int G = kivi.key_group, D = c.head_dim;
    for (int h = 0; h < c.kv_heads; ++h) {
      for (int t0 = 0; t0 + G <= n; t0 += G) {
        kh.resize(static_cast<size_t>(G) * D);
        for (int t = 0; t < G; ++t)
          for (int j = 0; j < D; ++j)
            kh[t * D + j] = k[(static_cast<size_t>(t0 + t) * c.kv_heads + h) * D + j];
        block.clear();
        if (!core::EncodeKeyBlock(kivi, kh.data(), D, nullptr, &block).ok()) continue;
        auto view = core::ParseKeyBlock(block, kivi, false);
        if (!view.ok()) continue;
        kb.resize(kh.size());
        core::DecodeKeyBase(*view, kb.data());
        for (size_t i = 0; i < kh.size(); ++i) kb[i] = kh[i] - kb[i];
        stats.AddResidual(layer, h, kb.data(), G);
      }
    }
  };
  ProgressBar bar("kvq-calibrate", want);
  std::vector<float> none;
  for (int64_t s = 0; s < want; s += L) {
    const int n = static_cast<int>(std::min<int64_t>(L, want - s));
    DenseCache cache(c.cache_shape());
    absl::Status st = model.Forward(ids.data() + s, n, 0, &cache, n, nullptr, hook);
    if (!st.ok()) return Fail(st);
    bar.Update(s + n);
  }
  bar.Finish();
  core::BasisManifest m;
  m.model = flags.Get("model-name").empty() ? ModelNameFromPath(flags.Get("model"))
                                            : flags.Get("model-name");
  m.calibration_tokens = want;
  m.calibration_text = flags.Get("text");
  // The keys and queries the basis was fitted to: post-RoPE in the file's channel order, with
  // the pairing the architecture rotates; serving must present them the same way.
  m.rope_layout = RopeLayoutName(c.rope_layout);
  m.channel_order = "gguf";
  const int rank = static_cast<int>(flags.GetInt("rank"));
  struct Out {
    std::string dir;
    core::CalibrationOptions opts;
  };
  std::vector<Out> outs = {{flags.Get("out"), {}}};
  if (search && !variants) {
    core::CalibrationOptions obl;
    obl.oblique = true;
    outs.push_back({flags.Get("out") + "/oblique", obl});
  }
  if (variants) {
    core::CalibrationOptions cen, rw, obl;
    cen.centred = true;
    rw.residual_weighted = true;
    obl.oblique = true;
    outs.push_back({flags.Get("out") + "/centred", cen});
    outs.push_back({flags.Get("out") + "/resw", rw});
    outs.push_back({flags.Get("out") + "/oblique", obl});
  }
  const std::string heads = flags.Get("value-metric-heads");
  if (heads != "independent" && heads != "together") {
    return Fail(absl::InvalidArgumentError(
        absl::StrCat("--value-metric-heads ", heads, ": must be independent or together")));
  }
  std::vector<float> value_metric;
  if (flags.GetBool("value-metric"))
    value_metric = model.OutputProjectionMetric(heads == "together");
  for (auto& o : outs) {
    o.opts.keep_query_moment = flags.GetBool("query-moment");
    auto b = stats.Basis(rank, o.opts, m);
    if (!b.ok()) return Fail(b.status());
    b->value_metric = value_metric;
    absl::Status ws = core::WriteBasis(o.dir, *b);
    if (!ws.ok()) return Fail(ws);
    std::vector<double> e = stats.CapturedEnergy(*b);
    double mean = 0;
    for (double x : e) mean += x;
    std::fprintf(stderr, "kvq-calibrate: wrote %s (%s, rank %d, mean captured query energy %.3f)\n",
                 o.dir.c_str(), b->manifest.kind.c_str(), rank, e.empty() ? 0.0 : mean / e.size());
  }
  if (search) return SearchCodec(model, ids, budgets, search_windows, search_len, flags);
  return 0;
}

}  // namespace
}  // namespace kvq::frontend

int main(int argc, char** argv) {
  kvq::frontend::PreferNativeBlasKernels(argv);
  return kvq::frontend::Main(argc, argv);
}
