// kvq-eval: perplexity of a real GGUF model with its KV cache held by each configuration.
#include <array>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "flags.h"
#include "kvq/core/basis.h"
#include "kvq/core/calibration.h"
#include "kvq/core/codec_json.h"
#include "kvq/core/metrics.h"
#include "kvq/core/status.h"
#include "kvq/core/store.h"
#include "kvq/frontend/blas_kernels.h"
#include "kvq/frontend/diagnostics.h"
#include "kvq/frontend/eval_config.h"
#include "kvq/frontend/gguf.h"
#include "kvq/frontend/llama.h"
#include "kvq/frontend/model_and_text.h"
#include "kvq/frontend/model_files.h"
#include "kvq/frontend/perplexity.h"
#include "kvq/frontend/progress.h"
#ifdef KVQ_FRONTEND_REMOTE
#include "kvq/frontend/remote_eval.h"
#endif
#include "kvq/frontend/tokenizer.h"
#include "nlohmann/json.hpp"

namespace kvq::frontend {
namespace {

constexpr char kHelp[] =
    R"(kvq-eval: perplexity of a GGUF model (llama or qwen2) whose KV cache is held by kvq configurations.

Usage: kvq-eval [--model GGUF] [--basis DIR] [--text FILE] [--windows N] [--window-len L]
                [--configs LIST] [--json FILE] [--threads T] [--dump-tokens FILE]

  --model GGUF      model file (default $KVQ_MODEL or ~/.cache/kvq/models/SmolLM2-135M-Instruct.Q4_1.gguf)
  --basis DIR       registry entry written by kvq-calibrate (needed by headq configs)
  --text FILE       evaluation text (default $KVQ_DATA_DIR/wikitext-2/wiki.test.raw,
                    KVQ_DATA_DIR default ../shared/data)
  --windows N       number of windows (default 8)
  --window-len L    tokens per window (default 512)
  --first-token N   the windows start at token N of --text (default 0); kvq-calibrate's
                    search windows start after the basis's calibration tokens
                    (codec-search.json "first_token"): pass that number to reproduce them
  --configs LIST    comma-separated configuration names (default dense,kivi-k2,headq-k2-r4);
                    "calibrated" is the codec that --basis DIR/codec.json names (what the
                    server serves that entry with; kvq-calibrate --bits B chooses and writes
                    it): the row keeps the name, its codec is printed and in --json
  --json FILE       also write the results as JSON
  --threads T       BLAS threads (default 2)
  --kv MODE         where the KV cache lives: local (default, in-process caches) or
                    remote=ADDR[,ADDR...]: a kvq server (or shards); every non-dense config
                    is decoded token by token through it (PutBlocks + Attend per step and
                    layer, Score for keys-only configs), --kv-batch windows batched per call;
                    prints decode steps/s and the RPC share of the time (dense stays local);
                    remote=ADDR,share: prefix sharing, every append carries its token ids
                    (the server stores each whole group of G tokens once per tenant) and each
                    window first attaches what the server's prefix index holds of its first
                    half (no logits needed there) and computes only the rest; a second run
                    over the same text attaches what the first left. Keys-only configs send
                    ids but never attach (their values live in the frontend)
  --kv-batch N      windows decoded at once in remote mode (default 8)
  --kv-decode M     remote mode: token (default; one token per forward call, as a serving
                    frontend decodes) or chunks (the in-process run's decode-faithful chunks:
                    the same K/V bits reach the codec, so PPL matches the in-process run of
                    the same read path; steps/s then counts tokens) or prefill (each
                    window's unscored first half in one forward call, as a serving frontend
                    prefills a prompt, then token by token)
  --kv-wire W       remote mode: codes (default; appends whose rows complete groups go as
                    HeadQ codes encoded here, where the server takes them and the codec's
                    value policy is uniform) or fp16 (every append as fp16 rows, the server
                    encodes). The server holds the same blocks either way: same perplexity
  --dump-tokens F   write the token ids of --text to F (one per line) and exit
  --calib-text F    validation text for the "-adapt" / "-hadapt" rank allocations and the
                    "-nuq" code books (default $KVQ_DATA_DIR/wikitext-2/wiki.valid.tokens;
                    its first --adapt-tokens tokens)
  --adapt-tokens N  tokens for those measurements (default 4096)
  --diagnostics     instead of perplexity: run one dense window of --diag-tokens tokens from
                    the start of --text, and for every (layer, KV head) and each key
                    quantizer in --diag-configs measure raw key MSE, Fisher score error and
                    exact attention KL (mean over causal queries from position 32); print
                    per-quantizer means, Spearman rho(Fisher, KL) and rho(MSE, KL) over all
                    cases, same-budget counterexamples (lower MSE, higher KL at key bits
                    within 0.15), and per-layer Fisher removal of headq-k2-r4 vs kivi-k2
  --diag-tokens N   tokens for --diagnostics (default 512)
  --diag-configs L  key quantizers for --diagnostics (default: a set of kivi/headq k2-k4);
                    kv configs also get a value table (MSE and the error in the output
                    projection's metric, which -vmr rounds in)

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
            v<N> value bits other than the key bits (kv targets; the A^2 mean with a2),
            random | wrongsign | centred | resw (basis controls and ablations),
            obl (the oblique reduced-rank-regression pair kvq-calibrate --variants writes),
            rotk | rotv | rot (keys / values / both rotated by a Hadamard matrix),
            mr (key codes chosen in the query metric), sink<N> (first N positions at fp16),
            adapt | hadapt (per-layer / per-head ranks of mean r<N>, fitted on --calib-text),
            vmr (value codes chosen in the output projection's metric; kv targets),
            evaluation-only levers (not codec settings; window 0, read by decoding):
            spk<N> | spv<N> (N / 1000 of key / value elements kept exact, 32 bits each),
            pre (keys quantized before RoPE; kivi only, not with mr),
            nuq | nuqk | nuqv (per-layer non-uniform code books for keys and values /
            keys / values, fitted on --calib-text; keys: kivi only, not with mr or rotk;
            values: not with vmr or rotv),
            oracle (--diagnostics only: PCA of the scored queries themselves, an upper bound)
  calibrated                     the codec of --basis DIR/codec.json (fields it omits take
                                 the registry's defaults for the entry)
  Defaults: G=32, vg=32, R=0, s=8; headq-kv*-a2 defaults to G=128.
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

// U [d][r] of (layer, kv head) from a basis with rank >= r.
std::vector<float> HeadBasis(const core::ModelBasis& b, int layer, int h, int r,
                             bool encode = false) {
  const int d = b.manifest.head_dim, R = b.manifest.rank;
  const float* src = encode ? b.encode_head(layer, h) : b.head(layer, h);
  std::vector<float> u(static_cast<size_t>(d) * r);
  for (int i = 0; i < d; ++i)
    for (int j = 0; j < r; ++j) u[static_cast<size_t>(i) * r + j] = src[i * R + j];
  return u;
}

int Diagnostics(const LlamaModel& model, const std::vector<int32_t>& ids, BasisSet& bases,
                const Flags& flags) {
  auto configs = ParseEvalConfigList(flags.Get("diag-configs"));
  if (!configs.ok()) return Fail(configs.status());
  const LlamaConfig& c = model.config();
  const int n = static_cast<int>(flags.GetInt("diag-tokens"));
  if (static_cast<int>(ids.size()) < n) return Fail(absl::InvalidArgumentError("text too short"));
  const int D = c.head_dim, gq = c.q_heads / c.kv_heads;
  std::vector<std::vector<float>> Q(c.layers), K(c.layers), V(c.layers);
  auto hook = [&](int layer, int64_t, int m, const float* q, const float* k, const float* v) {
    Q[layer].assign(q, q + static_cast<size_t>(c.q_heads) * m * D);
    K[layer].resize(static_cast<size_t>(c.kv_heads) * m * D);
    V[layer].resize(K[layer].size());
    for (int h = 0; h < c.kv_heads; ++h)
      for (int t = 0; t < m; ++t) {
        const size_t from = (static_cast<size_t>(t) * c.kv_heads + h) * D,
                     to = (static_cast<size_t>(h) * m + t) * D;
        std::copy_n(k + from, D, K[layer].data() + to);
        std::copy_n(v + from, D, V[layer].data() + to);
      }
  };
  DenseCache dense(c.cache_shape());
  absl::Status st = model.Forward(ids.data(), n, 0, &dense, n, nullptr, hook);
  if (!st.ok()) return Fail(st);
  if (bases.query && bases.random.u.empty())
    bases.random = core::RandomBasis(bases.query->manifest, 1234);
  struct Case {
    std::string q;
    int layer, head;
    KeyDistortion r;
  };
  std::vector<Case> cases;
  ProgressBar bar("kvq-eval diagnostics", static_cast<int64_t>(c.layers) * c.kv_heads);
  for (int l = 0; l < c.layers; ++l) {
    for (int h = 0; h < c.kv_heads; ++h) {
      const float* qh = Q[l].data() + static_cast<size_t>(h) * gq * n * D;
      const float* kh = K[l].data() + static_cast<size_t>(h) * n * D;
      for (const auto& cfg : *configs) {
        if (cfg.dense) continue;
        KeyQuantizer qz{cfg.name, cfg.codec, nullptr};
        std::vector<float> u, a;
        if (cfg.codec.rank > 0 && cfg.basis == BasisKind::kOracle) {
          core::QueryStats qs(1, gq, 1, D);
          for (int j = 0; j < gq; ++j) qs.Add(0, j, qh + static_cast<size_t>(j) * n * D, n);
          auto ob = qs.Basis(cfg.codec.rank, {}, core::BasisManifest{});
          if (!ob.ok()) return Fail(ob.status());
          u = ob->u;
          qz.basis = u.data();
        } else if (cfg.codec.rank > 0) {
          const core::ModelBasis* b = cfg.basis == BasisKind::kQuery     ? bases.query
                                      : cfg.basis == BasisKind::kRandom  ? &bases.random
                                      : cfg.basis == BasisKind::kCentred ? bases.centred
                                      : cfg.basis == BasisKind::kOblique ? bases.oblique
                                                                         : bases.residual_weighted;
          if (!b || b->u.empty())
            return Fail(absl::FailedPreconditionError(cfg.name + ": no such basis (--basis)"));
          u = HeadBasis(*b, l, h, cfg.codec.rank);
          qz.basis = u.data();
          if (b->oblique() || cfg.wrong_sign) {
            a = b->oblique() ? HeadBasis(*b, l, h, cfg.codec.rank, true) : u;
            qz.encode_basis = a.data();
          }
          if (cfg.wrong_sign)  // decode with -B what was encoded with A (BasisSet::WrongSign)
            for (float& x : u) x = -x;
        }
        if (cfg.codec.metric_rounding) {
          const core::ModelBasis* mb =
              cfg.basis == BasisKind::kOblique ? bases.oblique : bases.query;
          if (!mb || mb->query_moment.empty())
            return Fail(absl::FailedPreconditionError(cfg.name +
                                                      ": metric rounding needs a basis with query "
                                                      "moments (kvq-calibrate --query-moment)"));
          qz.query_moment = mb->query_moment_head(l, h);
        }
        auto r = MeasureKeyDistortion(qz, qh, gq, kh, n, D, 32);
        if (!r.ok()) return Fail(r.status());
        cases.push_back({cfg.name, l, h, *r});
      }
      bar.Update(static_cast<int64_t>(l) * c.kv_heads + h + 1);
    }
  }
  bar.Finish();
  std::vector<double> mse, fisher, kl;
  std::map<std::string, std::array<double, 5>> mean;  // mse, fisher, kl, bits, count
  for (const auto& cs : cases) {
    mse.push_back(cs.r.key_mse);
    fisher.push_back(cs.r.fisher);
    kl.push_back(cs.r.kl);
    auto& m = mean[cs.q];
    m[0] += cs.r.key_mse;
    m[1] += cs.r.fisher;
    m[2] += cs.r.kl;
    m[3] += cs.r.k_bits;
    m[4] += 1;
  }
  nlohmann::json js;
  js["text"] = flags.Get("text");
  js["tokens"] = n;
  js["cases"] = cases.size();
  std::printf("key distortion over %d layers x %d KV heads, %d tokens (means over heads)\n",
              c.layers, c.kv_heads, n);
  std::printf("%-24s %7s %12s %12s %12s\n", "quantizer", "k_bits", "key_mse", "fisher", "kl");
  for (const auto& cfg : *configs) {
    auto& m = mean[cfg.name];
    if (m[4] == 0) continue;
    std::printf("%-24s %7.3f %12.5g %12.5g %12.5g\n", cfg.name.c_str(), m[3] / m[4], m[0] / m[4],
                m[1] / m[4], m[2] / m[4]);
    js["quantizers"].push_back({{"name", cfg.name},
                                {"k_bits", m[3] / m[4]},
                                {"key_mse", m[0] / m[4]},
                                {"fisher", m[1] / m[4]},
                                {"kl", m[2] / m[4]}});
  }
  const double rf = core::SpearmanRho(fisher, kl), rm = core::SpearmanRho(mse, kl);
  std::printf("Spearman over %zu cases: rho(Fisher, KL) = %.3f, rho(MSE, KL) = %.3f\n",
              cases.size(), rf, rm);
  js["rho_fisher_kl"] = rf;
  js["rho_mse_kl"] = rm;
  // Same-budget counterexamples: same (layer, head), key bits within 0.15, lower MSE, higher KL.
  int shown = 0, total = 0;
  for (size_t i = 0; i < cases.size(); ++i)
    for (size_t j = 0; j < cases.size(); ++j) {
      const auto &a = cases[i], &b = cases[j];
      if (a.layer != b.layer || a.head != b.head || a.q == b.q) continue;
      if (std::abs(a.r.k_bits - b.r.k_bits) > 0.15) continue;
      if (a.r.key_mse < b.r.key_mse && a.r.kl > b.r.kl * 1.1) {
        ++total;
        if (shown++ < 5)
          std::printf(
              "counterexample: layer %d head %d: %s (%.3f bits, MSE %.4g, KL %.4g) vs %s (%.3f "
              "bits, MSE %.4g, KL %.4g)\n",
              a.layer, a.head, a.q.c_str(), a.r.k_bits, a.r.key_mse, a.r.kl, b.q.c_str(),
              b.r.k_bits, b.r.key_mse, b.r.kl);
      }
    }
  std::printf("same-budget counterexamples (lower MSE, >10%% higher KL): %d\n", total);
  js["counterexamples"] = total;
  // Value distortion of the kv configs, in the output projection's metric (the basis's value
  // metric, which main fills from the model's weights when the basis has none).
  const core::ModelBasis* vb = bases.query;
  bool header = false;
  for (const auto& cfg : *configs) {
    if (cfg.dense || cfg.keys_only || !vb || vb->value_metric.empty()) continue;
    if (!header) {
      std::printf("value distortion over %d layers x %d KV heads, %d tokens (means over heads)\n",
                  c.layers, c.kv_heads, n);
      std::printf("%-36s %12s %14s\n", "quantizer", "value_mse", "metric_error");
      header = true;
    }
    double mse = 0, merr = 0;
    for (int l = 0; l < c.layers; ++l)
      for (int h = 0; h < c.kv_heads; ++h) {
        auto r = MeasureValueDistortion(cfg.codec, V[l].data() + static_cast<size_t>(h) * n * D, n,
                                        D, vb->value_metric_head(l, h), cfg.value_metric_rounding);
        if (!r.ok()) return Fail(r.status());
        mse += r->value_mse;
        merr += r->metric_error;
      }
    const double heads = static_cast<double>(c.layers) * c.kv_heads;
    std::printf("%-36s %12.5g %14.5g\n", cfg.name.c_str(), mse / heads, merr / heads);
    js["value_quantizers"].push_back(
        {{"name", cfg.name}, {"value_mse", mse / heads}, {"metric_error", merr / heads}});
  }
  // Per-layer Fisher removal of rank-4 HeadQ (calibrated and oracle basis) against kivi-k2.
  for (const char* hq : {"headq-k2-r4", "headq-k2-r4-oracle"}) {
    std::map<int, std::array<double, 2>> per_layer;
    for (const auto& cs : cases) {
      if (cs.q == "kivi-k2") per_layer[cs.layer][0] += cs.r.fisher;
      if (cs.q == hq) per_layer[cs.layer][1] += cs.r.fisher;
    }
    std::string line;
    double tot0 = 0, tot1 = 0;
    for (auto& [l, v] : per_layer) {
      if (v[0] <= 0 || v[1] <= 0) continue;
      const double removed = 1.0 - v[1] / v[0];
      tot0 += v[0];
      tot1 += v[1];
      absl::StrAppend(&line, absl::StrFormat(" L%d:%.0f%%", l, 100 * removed));
      js[std::string("layer_fisher_removed_") + hq].push_back(removed);
    }
    if (!line.empty())
      std::printf("Fisher removed by %s vs kivi-k2: total %.1f%%, per layer:%s\n", hq,
                  100 * (1 - tot1 / tot0), line.c_str());
  }
  if (!flags.Get("json").empty()) {
    std::ofstream out(flags.Get("json"));
    out << js.dump(2) << "\n";
  }
  return 0;
}

// What "calibrated" stands for: the entry's codec as the registry loads it (its defaults for
// the basis, then codec.json over them), checked as the registry checks it.
absl::StatusOr<core::CodecOptions> ReadCalibratedCodec(const core::ModelBasis& basis,
                                                       const std::string& file) {
  if (!std::filesystem::exists(file)) {
    return absl::NotFoundError(absl::StrCat("--configs calibrated: ", file,
                                            " does not exist; kvq-calibrate --bits B --search-only "
                                            "--out DIR writes it for an existing basis"));
  }
  core::CodecOptions c = core::Registry::DefaultCodec(basis.manifest, /*has_basis=*/true);
  RETURN_IF_ERROR(core::ReadCodecJson(file, &c));
  if (c.rank > basis.manifest.rank) {
    return absl::InvalidArgumentError(
        absl::StrCat(file, ": rank ", c.rank, " exceeds the basis rank ", basis.manifest.rank));
  }
  absl::Status st = c.Validate();
  if (!st.ok()) return absl::InvalidArgumentError(absl::StrCat(file, ": ", st.message()));
  return c;
}

int Main(int argc, char** argv) {
  Flags flags("eval",
              {{"model", DefaultModelPath()},
               {"basis", ""},
               {"text", DataFile("wikitext-2/wiki.test.raw")},
               {"windows", "8"},
               {"window-len", "512"},
               {"first-token", "0"},
               {"configs", "dense,kivi-k2,headq-k2-r4"},
               {"json", ""},
               {"threads", "2"},
               {"kv", "local"},
               {"kv-batch", "8"},
               {"kv-decode", "token"},
               {"kv-wire", "codes"},
               {"dump-tokens", ""},
               {"calib-text", DataFile("wikitext-2/wiki.valid.tokens")},
               {"adapt-tokens", "4096"},
               {"diagnostics", "false"},
               {"diag-tokens", "512"},
               {"diag-configs",
                "kivi-k2,kivi-k2-g128,kivi-k3,kivi-k3-g128,kivi-k4,headq-k2-r1,headq-k2-r2,"
                "headq-k2-r4,headq-k2-r8,headq-k2-r4-random,headq-k2-r4-wrongsign,headq-k2-r4-resw,"
                "headq-k2-r4-g128,headq-k2-r8-g128,headq-k2-r4-oracle,headq-k2-r8-oracle"}},
              kHelp);
  int rc = 0;
  if (!flags.Parse(argc, argv, &rc)) return rc;
  SetBlasThreads(static_cast<int>(flags.GetInt("threads")));
  const bool calibrated = NamesCalibratedConfig(flags.Get("configs"));
  if (calibrated && flags.Get("basis").empty()) {
    return Fail(absl::InvalidArgumentError(
        "--configs calibrated evaluates the codec that the basis folder's codec.json names: "
        "give --basis DIR"));
  }
  // The names are checked before the model loads ("calibrated" stands in as any valid codec
  // until its codec.json is read, below).
  const core::CodecOptions stand_in;
  if (auto check = ParseEvalConfigList(flags.Get("configs"), calibrated ? &stand_in : nullptr);
      !check.ok()) {
    return Fail(check.status());
  }
  auto file = GgufFile::Open(flags.Get("model"));
  if (!file.ok()) return Fail(file.status());
  auto tok = Tokenizer::FromGguf(**file);
  if (!tok.ok()) return Fail(tok.status());
  auto text = ReadFile(flags.Get("text"));
  if (!text.ok()) return Fail(text.status());
  const auto t_tok = std::chrono::steady_clock::now();
  std::vector<int32_t> ids = (*tok)->Encode(*text);
  std::fprintf(stderr, "kvq-eval: %zu tokens from %s (%.1fs); BLAS kernel %s, %d threads\n",
               ids.size(), flags.Get("text").c_str(),
               std::chrono::duration<double>(std::chrono::steady_clock::now() - t_tok).count(),
               BlasKernelName(), static_cast<int>(flags.GetInt("threads")));
  if (!flags.Get("dump-tokens").empty()) {
    std::ofstream out(flags.Get("dump-tokens"));
    for (int32_t id : ids) out << id << "\n";
    return out ? 0 : Fail(absl::InternalError("cannot write --dump-tokens file"));
  }
  // --first-token: the windows start there (kvq-calibrate's search starts after the basis's
  // calibration tokens; this reproduces its windows).
  const int64_t first = flags.GetInt("first-token");
  if (first < 0 || first >= static_cast<int64_t>(ids.size())) {
    return Fail(absl::InvalidArgumentError(absl::StrCat("--first-token ", first, " must be in 0..",
                                                        ids.size() - 1, " (the text's tokens)")));
  }
  ids.erase(ids.begin(), ids.begin() + first);
  auto model = LlamaModel::Load(**file);
  if (!model.ok()) return Fail(model.status());

  BasisSet bases;
  core::ModelBasis query, centred, resw, oblique;
  if (!flags.Get("basis").empty()) {
    auto b = ReadBasisFor((*model)->config(), flags.Get("basis"));
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
    if (auto c = core::ReadBasis(flags.Get("basis") + "/oblique"); c.ok()) {
      oblique = std::move(*c);
      bases.oblique = &oblique;
    }
  }
  // Value metric rounding's metric is a function of the output projection alone: a basis
  // written before kvq-calibrate stored it gets it from the model here.
  std::vector<float> value_metric;
  for (core::ModelBasis* b : {&query, &centred, &resw, &oblique}) {
    if (b->u.empty() || !b->value_metric.empty()) continue;
    if (value_metric.empty()) value_metric = (*model)->OutputProjectionMetric();
    b->value_metric = value_metric;
  }
  if (flags.GetBool("diagnostics")) {
    return Diagnostics(**model, ids, bases, flags);
  }
  core::CodecOptions calibrated_codec;
  std::string codec_file;
  if (calibrated) {
    codec_file = flags.Get("basis") + "/codec.json";
    auto c = ReadCalibratedCodec(query, codec_file);
    if (!c.ok()) return Fail(c.status());
    calibrated_codec = *c;
    std::fprintf(stderr, "kvq-eval: calibrated = %s (%s)\n", calibrated_codec.ToString().c_str(),
                 codec_file.c_str());
  }
  auto configs =
      ParseEvalConfigList(flags.Get("configs"), calibrated ? &calibrated_codec : nullptr);
  if (!configs.ok()) return Fail(configs.status());
  bool any_adapt = false, any_nuq = false, any_hadapt = false;
  for (const auto& c : *configs) {
    any_adapt |= c.adaptive_rank;
    any_nuq |= c.levers.nuq_keys || c.levers.nuq_values;
    any_hadapt |= c.head_adaptive_rank;
  }
  // The validation text's first --adapt-tokens tokens: what -adapt, -hadapt and -nuq are
  // fitted on.
  std::vector<int32_t> cids;
  if ((any_adapt && bases.query) || any_nuq || any_hadapt) {
    auto calib = ReadFile(flags.Get("calib-text"));
    if (!calib.ok()) return Fail(calib.status());
    cids = (*tok)->Encode(*calib);
    const size_t want = static_cast<size_t>(flags.GetInt("adapt-tokens"));
    if (cids.size() > want) cids.resize(want);
  }
  for (auto& c : *configs) {
    if (!c.levers.nuq_keys && !c.levers.nuq_values) continue;
    std::fprintf(stderr, "kvq-eval: %s: fitting code books on %zu calibration tokens\n",
                 c.name.c_str(), cids.size());
    auto books = FitCodeBooks(**model, cids, 512, c);
    if (!books.ok()) return Fail(books.status());
    const size_t layers = std::max(books->keys.size(), books->values.size());
    for (size_t l = 0; l < layers; l += std::max<size_t>(1, layers / 2)) {
      std::string line;
      for (size_t i = 0; i < books->keys.size() && i < books->keys[l].size(); ++i)
        absl::StrAppend(&line, absl::SixDigits(books->keys[l][i]), " ");
      std::string vline;
      for (size_t i = 0; i < books->values.size() && i < books->values[l].size(); ++i)
        absl::StrAppend(&vline, absl::SixDigits(books->values[l][i]), " ");
      std::fprintf(stderr, "kvq-eval: %s: layer %zu books: keys [%s] values [%s]\n", c.name.c_str(),
                   l, line.c_str(), vline.c_str());
    }
    c.levers.books = std::make_shared<const CodeBooks>(std::move(*books));
  }
  if (any_hadapt) bases.calibration_tokens = &cids;
  if (any_adapt && bases.query) {
    auto e = MeasureColumnEnergy(**model, cids, 512, query);
    if (!e.ok()) return Fail(e.status());
    bases.column_energy = std::move(*e);
  }
  const int windows = static_cast<int>(flags.GetInt("windows"));
  const int wlen = static_cast<int>(flags.GetInt("window-len"));
  std::map<std::string, PerplexityResult> results;
  ProgressBar bar("kvq-eval", static_cast<int64_t>(windows) * configs->size());
  int64_t done = 0;
  const std::string kv = flags.Get("kv");
  if (flags.Get("kv-decode") != "token" && flags.Get("kv-decode") != "chunks" &&
      flags.Get("kv-decode") != "prefill") {
    return Fail(absl::InvalidArgumentError("--kv-decode must be token, chunks or prefill"));
  }
  if (flags.Get("kv-wire") != "codes" && flags.Get("kv-wire") != "fp16") {
    return Fail(absl::InvalidArgumentError("--kv-wire must be codes or fp16"));
  }
  if (kv != "local" && kv.rfind("remote=", 0) != 0) {
    return Fail(absl::InvalidArgumentError("--kv must be local or remote=ADDR[,ADDR...][,share]"));
  }
  // remote=ADDR[,ADDR...][,share]: the servers, then options.
  std::string kv_servers = kv == "local" ? "" : kv.substr(7);
  bool kv_share = false;
  if (kv_servers == "share" || absl::EndsWith(kv_servers, ",share")) {
    kv_share = true;
    kv_servers = kv_servers.substr(0, kv_servers.size() - std::min<size_t>(kv_servers.size(), 6));
  }
  if (kv != "local" && kv_servers.empty()) {
    return Fail(absl::InvalidArgumentError("--kv remote=ADDR[,ADDR...][,share]: no server"));
  }
  std::map<std::string, nlohmann::json> remote_rows;
#ifdef KVQ_FRONTEND_REMOTE
  std::unique_ptr<client::Client> remote;
  if (kv != "local") {
    client::ClientOptions co;
    co.servers = client::SplitServers(kv_servers);
    auto cl = client::Client::Create(co);
    if (!cl.ok()) return Fail(cl.status());
    remote = std::move(*cl);
  }
#else
  if (kv != "local") return Fail(absl::UnimplementedError("--kv remote: built without gRPC"));
#endif
  for (const auto& c : *configs) {
    auto on_window = [&](int) { bar.Update(++done, c.name); };
    absl::StatusOr<PerplexityResult> r;
#ifdef KVQ_FRONTEND_REMOTE
    if (remote && !c.dense) {
      RemoteEvalOptions ro;
      ro.client = remote.get();
      ro.batch = static_cast<int>(flags.GetInt("kv-batch"));
      ro.chunks = flags.Get("kv-decode") == "chunks";
      ro.prefill = flags.Get("kv-decode") == "prefill";
      ro.codes = flags.Get("kv-wire") == "codes";
      ro.share = kv_share;
      RemoteEvalStats rs;
      r = EvaluatePerplexityRemote(**model, ids, windows, wlen, c, &bases, ro, &rs, on_window);
      if (r.ok()) {
        remote_rows[c.name] = {{"server", kv_servers},
                               {"share", kv_share},
                               {"tokens_attached", rs.tokens_attached},
                               {"model", rs.model.model},
                               {"decode_steps", rs.decode_steps},
                               {"decode_seconds", rs.decode_seconds},
                               {"steps_per_second", rs.steps_per_second()},
                               {"rpc_share", rs.rpc_share()},
                               {"put_seconds", rs.rpc.put_seconds},
                               {"read_seconds", rs.rpc.read_seconds},
                               {"batches", rs.rpc.batches},
                               {"items", rs.rpc.items},
                               {"put_rpcs", rs.rpc.put_rpcs},
                               {"appends_in_attend", rs.rpc.appends_in_attend},
                               {"appends_in_codes", rs.rpc.appends_in_codes},
                               {"bytes_sent", rs.rpc.bytes_sent}};
        std::fprintf(stderr, "kvq-eval: %s: %lld bytes sent, %lld of %lld appends in codes%s%s\n",
                     c.name.c_str(), static_cast<long long>(rs.rpc.bytes_sent),
                     static_cast<long long>(rs.rpc.appends_in_codes),
                     static_cast<long long>(rs.rpc.appends_in_attend),
                     rs.model.codes ? "" : "; rows only: ", rs.model.rows_reason.c_str());
        std::fprintf(
            stderr,
            "kvq-eval: %s through %s: %lld decode steps in %.2fs = %.1f steps/s "
            "(%d windows batched), RPC %.1f%% of the time (PutBlocks %.1f%%, %s %.1f%%), "
            "%lld batched calls (%lld PutBlocks, %lld appends carried by Attend)\n",
            c.name.c_str(), kv_servers.c_str(), static_cast<long long>(rs.decode_steps),
            rs.decode_seconds, rs.steps_per_second(), std::min(windows, std::max(1, ro.batch)),
            100 * rs.rpc_share(), 100 * rs.rpc.put_seconds / std::max(1e-12, rs.decode_seconds),
            c.keys_only ? "Score" : "Attend",
            100 * rs.rpc.read_seconds / std::max(1e-12, rs.decode_seconds),
            static_cast<long long>(rs.rpc.batches), static_cast<long long>(rs.rpc.put_rpcs),
            static_cast<long long>(rs.rpc.appends_in_attend));
        if (kv_share) {
          std::fprintf(stderr,
                       "kvq-eval: %s: share: %lld tokens per layer attached from the "
                       "prefix index (%lld attach calls)\n",
                       c.name.c_str(), static_cast<long long>(rs.tokens_attached),
                       static_cast<long long>(rs.rpc.attach_rpcs));
        }
      }
    } else
#endif
    {
      r = EvaluatePerplexity(**model, ids, windows, wlen, c, &bases, on_window);
    }
    if (!r.ok()) return Fail(r.status());
    results[c.name] = *r;
  }
  bar.Finish();

  nlohmann::json js;
  js["model"] = flags.Get("model");
  js["text"] = flags.Get("text");
  js["windows"] = windows;
  js["window_len"] = wlen;
  js["first_token"] = first;
  js["protocol"] = "llama.cpp perplexity (second half of each window), decode-faithful";
  js["blas_kernel"] = BlasKernelName();
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
    std::printf("%-28s %10.4f %9s %7.3f %7.3f %9.3f %9.3f %8.1f%s\n", c.name.c_str(), r.ppl,
                ex.c_str(), r.k_bits, r.v_bits, r.k_bits_ctx, r.v_bits_ctx, r.seconds,
                c.name == kCalibratedConfig ? absl::StrCat("  ", c.codec.ToString()).c_str() : "");
    js["rows"].push_back(
        {{"config", c.name},
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
    if (c.name == kCalibratedConfig) {
      js["rows"].back()["codec_file"] = codec_file;
      js["rows"].back()["codec_settings"] = core::CodecToJson(c.codec);
    }
    if (remote_rows.count(c.name)) js["rows"].back()["remote"] = remote_rows[c.name];
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

int main(int argc, char** argv) {
  kvq::frontend::PreferNativeBlasKernels(argv);
  return kvq::frontend::Main(argc, argv);
}
