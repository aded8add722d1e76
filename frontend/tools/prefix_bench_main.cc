// kvq-prefix-bench: time to first token and bytes stored per request, with and without
// attaching a shared prompt from a kvq server's prefix index (RemoteCache share).
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "flags.h"
#include "kvq/core/basis.h"
#include "kvq/core/status.h"
#include "kvq/frontend/blas_kernels.h"
#include "kvq/frontend/eval_config.h"
#include "kvq/frontend/gguf.h"
#include "kvq/frontend/llama.h"
#include "kvq/frontend/model_and_text.h"
#include "kvq/frontend/model_files.h"
#include "kvq/frontend/progress.h"
#include "kvq/frontend/remote_eval.h"
#include "kvq/frontend/tokenizer.h"
#include "nlohmann/json.hpp"

namespace kvq::frontend {
namespace {

constexpr char kHelp[] =
    R"(kvq-prefix-bench: time to first token and bytes stored per request, with and
without prefix sharing, the real model's KV cache held by a kvq server.

Usage: kvq-prefix-bench --server ADDR [--basis DIR] [--shared 128,512,1024] [--new 32]
                        [--reps 3] [--config headq-kv2] [--json FILE]

  --server ADDR     the kvq server (one)
  --tenant NAME     tenant to run as (auth off: x-kvq-tenant); default kvq-prefix-bench-<pid>,
                    a fresh one per run, so that nothing indexed by an earlier run is shared
                    (sharing never crosses tenants) and Stats counts this run only
  --model GGUF      model file (default $KVQ_MODEL or ~/.cache/kvq/models/SmolLM2-135M-Instruct.Q4_1.gguf)
  --basis DIR       registry entry written by kvq-calibrate (headq configs), e.g.
                    tests/fixtures/frontend/basis-r4
  --text FILE       text the prompts are cut from (default
                    $KVQ_DATA_DIR/wikitext-2/wiki.test.raw, KVQ_DATA_DIR default ../shared/data)
  --config NAME     codec configuration, kvq-eval's grammar (default headq-kv2); not keys-only
  --shared LIST     shared prompt lengths in tokens (default 128,512,1024)
  --new N           each request's own tokens after the shared prompt (default 32)
  --reps N          requests per length and mode; medians are reported (default 3)
  --threads T       BLAS threads (default 2)
  --json FILE       also write the rows as JSON

Per length S: a first request (prompt P of S tokens from the text, plus N tokens) is prefilled
with token ids, which indexes P's whole groups of G tokens on the server, and stays alive.
Then --reps requests of P plus N other tokens each (a different place in the text per
request), each prefilled twice on a fresh sequence:
  plain   no ids: the forward pass over all S + N tokens, every chunk's K/V sent (PutBlocks)
          and its attention read (Attend) through the server, per layer
  attach  ids: the longest indexed run of whole groups of the first S + N - 1 tokens is
          attached from the index without data (one PutBlocks of every layer), then the
          forward pass over the rest only, attending over the attached groups on the server
Both cut the forward pass into the same decode-faithful chunks (at the codec's encode
boundaries, as kvq-eval does). Time to first token: from the start of the request to the
logits of its last token (its next token's distribution). Bytes: the growth of the tenant's
stored_bytes (Stats) while the request's sequence is alive. The first token (argmax) of the
two is compared, and the largest logit difference of the last row printed (0 when the
first request ran the same chunks with the same BLAS thread count; the BLAS row results
depend on both). Columns: attach_s is the attach call alone (inside ttft_attach_s); bytes
per request include the 8-byte arrival hash every sequence keeps per token and layer.
Exit 1 when the first tokens differ.

Every flag can also be set as KVQ_PREFIX_BENCH_<FLAG>.
)";

int Fail(const absl::Status& s) {
  std::fprintf(stderr, "kvq-prefix-bench: %s\n", std::string(s.ToString()).c_str());
  return 1;
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty()      ? 0
         : v.size() % 2 ? v[v.size() / 2]
                        : 0.5 * (v[v.size() / 2 - 1] + v[v.size() / 2]);
}

struct Run {
  double ttft = 0, attach = 0;  // attach: the attach call alone
  int64_t bytes = 0, attached = 0;
  std::vector<float> last;  // logits of the last token
};

int Main(int argc, char** argv) {
  Flags flags("prefix-bench",
              {{"server", ""},
               {"tenant", ""},
               {"model", DefaultModelPath()},
               {"basis", ""},
               {"text", DataFile("wikitext-2/wiki.test.raw")},
               {"config", "headq-kv2"},
               {"shared", "128,512,1024"},
               {"new", "32"},
               {"reps", "3"},
               {"threads", "2"},
               {"json", ""}},
              kHelp);
  int rc = 0;
  if (!flags.Parse(argc, argv, &rc)) return rc;
  if (flags.Get("server").empty()) return Fail(absl::InvalidArgumentError("--server is required"));
  std::vector<int> lengths;
  for (absl::string_view s : absl::StrSplit(flags.Get("shared"), ',')) {
    int v = 0;
    if (!absl::SimpleAtoi(s, &v) || v < 1) {
      return Fail(absl::InvalidArgumentError(absl::StrCat("--shared: bad length '", s, "'")));
    }
    lengths.push_back(v);
  }
  const int fresh = static_cast<int>(flags.GetInt("new"));
  const int reps = static_cast<int>(flags.GetInt("reps"));
  if (fresh < 1 || reps < 1)
    return Fail(absl::InvalidArgumentError("--new and --reps must be >= 1"));
  auto cfg = ParseEvalConfig(flags.Get("config"));
  if (!cfg.ok()) return Fail(cfg.status());
  if (cfg->dense || cfg->keys_only) {
    return Fail(
        absl::InvalidArgumentError("--config: a kv configuration (the server encodes "
                                   "keys and values; keys-only cannot attach)"));
  }
  SetBlasThreads(static_cast<int>(flags.GetInt("threads")));
  auto loaded = LoadModelAndText(flags.Get("model"), flags.Get("text"));
  if (!loaded.ok()) return Fail(loaded.status());
  const LlamaModel& model = *loaded->model;
  const std::vector<int32_t> ids = std::move(loaded->ids);
  core::ModelBasis basis;
  if (!flags.Get("basis").empty()) {
    auto b = ReadBasisFor(model.config(), flags.Get("basis"));
    if (!b.ok()) return Fail(b.status());
    basis = std::move(*b);
  }
  if (cfg->codec.rank > 0 && basis.u.empty()) {
    return Fail(absl::FailedPreconditionError(cfg->name + ": needs --basis"));
  }
  // Prompts from disjoint places in the text (no two lengths share a prefix), continuations
  // from after all of them.
  int64_t need = 0;
  for (int s : lengths) need += s;
  const int64_t cont0 = need;
  need += static_cast<int64_t>(reps + 1) * fresh;
  if (static_cast<int64_t>(ids.size()) < need) {
    return Fail(
        absl::InvalidArgumentError(absl::StrCat("text has ", ids.size(), " tokens, need ", need)));
  }

  client::ClientOptions co;
  co.servers = client::SplitServers(flags.Get("server"));
  co.tenant = flags.Get("tenant").empty() ? absl::StrCat("kvq-prefix-bench-", getpid())
                                          : flags.Get("tenant");
  auto cl = client::Client::Create(co);
  if (!cl.ok()) return Fail(cl.status());
  client::Client& client = **cl;
  const LlamaConfig& mc = model.config();
  auto rm = RegisterRemoteModel(client, mc.cache_shape(), basis.u.empty() ? nullptr : &basis);
  if (!rm.ok()) return Fail(rm.status());
  RemoteCache::Options base;
  base.model = *rm;
  base.codec = cfg->codec;
  base.codec.head_dim = mc.head_dim;
  const std::string tag = absl::StrCat("kvq-prefix-bench-", getpid(), "-");
  auto stored = [&]() -> absl::StatusOr<int64_t> {
    auto s = client.Stats();
    if (!s.ok()) return s.status();
    return s->stored_bytes();
  };
  // One request: a fresh sequence, prefilled (attach or not), measured, deleted.
  auto request = [&](const std::string& id, const std::vector<int32_t>& t, bool share,
                     bool keep) -> absl::StatusOr<std::pair<Run, std::unique_ptr<RemoteCache>>> {
    RemoteCache::Options o = base;
    o.sequence_id = tag + id;
    o.share = share;
    ASSIGN_OR_RETURN(std::unique_ptr<RemoteCache> cache,
                     RemoteCache::Create(&client, nullptr, mc.cache_shape(), o));
    ASSIGN_OR_RETURN(int64_t before, stored());
    Run run;
    const int n = static_cast<int>(t.size());
    const auto t0 = std::chrono::steady_clock::now();
    ASSIGN_OR_RETURN(RemotePrefill p,
                     PrefillRemote(model, cache.get(), t.data(), n, n - 1, &run.last, share));
    run.ttft = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    run.attached = p.attached;
    run.attach = p.attach_seconds;
    ASSIGN_OR_RETURN(int64_t after, stored());
    run.bytes = after - before;
    if (!keep) {
      RETURN_IF_ERROR(cache->Finish(true));
      cache.reset();
    }
    return std::make_pair(std::move(run), std::move(cache));
  };

  ProgressBar bar("kvq-prefix-bench", static_cast<int64_t>(lengths.size()) * (2 * reps + 1));
  int64_t done = 0;
  nlohmann::json rows = nlohmann::json::array();
  struct Row {
    int shared;
    double ttft_plain, ttft_attach, attach_call;
    int64_t bytes_plain, bytes_attach, attached;
    bool same_first_token;
    double max_logit_diff;
  };
  std::vector<Row> table;
  int64_t prompt_at = 0;
  for (int S : lengths) {
    std::vector<int32_t> prompt(ids.begin() + prompt_at, ids.begin() + prompt_at + S);
    prompt_at += S;
    auto with = [&](int k) {  // P + the k-th continuation
      std::vector<int32_t> t = prompt;
      const auto* c = ids.data() + cont0 + static_cast<int64_t>(k) * fresh;
      t.insert(t.end(), c, c + fresh);
      return t;
    };
    const std::string note = absl::StrCat("shared ", S);
    auto first = request(absl::StrCat(S, "-first"), with(reps), /*share=*/true, /*keep=*/true);
    if (!first.ok()) return Fail(first.status());
    bar.Update(++done, note);
    std::vector<double> tp, ta, tc;
    std::vector<int64_t> bp, ba;
    int64_t attached = 0;
    bool same = true;
    double diff = 0;
    for (int r = 0; r < reps; ++r) {
      const std::vector<int32_t> t = with(r);
      auto plain = request(absl::StrCat(S, "-plain-", r), t, false, false);
      if (!plain.ok()) return Fail(plain.status());
      bar.Update(++done, note);
      auto shared = request(absl::StrCat(S, "-attach-", r), t, true, false);
      if (!shared.ok()) return Fail(shared.status());
      bar.Update(++done, note);
      const Run &a = plain->first, &b = shared->first;
      tp.push_back(a.ttft);
      ta.push_back(b.ttft);
      tc.push_back(b.attach);
      bp.push_back(a.bytes);
      ba.push_back(b.bytes);
      attached = b.attached;
      same &= std::max_element(a.last.begin(), a.last.end()) - a.last.begin() ==
              std::max_element(b.last.begin(), b.last.end()) - b.last.begin();
      for (size_t i = 0; i < a.last.size() && i < b.last.size(); ++i)
        diff = std::max(diff, static_cast<double>(std::abs(a.last[i] - b.last[i])));
    }
    if (auto st = first->second->Finish(true); !st.ok()) return Fail(st);
    table.push_back(
        {S, Median(tp), Median(ta), Median(tc), bp.back(), ba.back(), attached, same, diff});
  }
  bar.Finish();
  std::printf(
      "kvq-prefix-bench: %s, %d new tokens per request, %d requests per row (medians), "
      "server %s\n",
      cfg->name.c_str(), fresh, reps, flags.Get("server").c_str());
  std::printf("%7s %9s %12s %13s %9s %8s %13s %13s %7s %11s %10s\n", "shared", "attached",
              "ttft_plain_s", "ttft_attach_s", "attach_s", "speedup", "bytes_plain", "bytes_attach",
              "ratio", "same_token", "max_dlogit");
  for (const Row& r : table) {
    std::printf("%7d %9lld %12.3f %13.3f %9.4f %7.2fx %13lld %13lld %7.3f %11s %10.3g\n", r.shared,
                static_cast<long long>(r.attached), r.ttft_plain, r.ttft_attach, r.attach_call,
                r.ttft_attach > 0 ? r.ttft_plain / r.ttft_attach : 0.0,
                static_cast<long long>(r.bytes_plain), static_cast<long long>(r.bytes_attach),
                r.bytes_plain ? static_cast<double>(r.bytes_attach) / r.bytes_plain : 0.0,
                r.same_first_token ? "yes" : "NO", r.max_logit_diff);
    rows.push_back({{"shared", r.shared},
                    {"new", fresh},
                    {"attached", r.attached},
                    {"ttft_plain_s", r.ttft_plain},
                    {"ttft_attach_s", r.ttft_attach},
                    {"attach_call_s", r.attach_call},
                    {"bytes_plain", r.bytes_plain},
                    {"bytes_attach", r.bytes_attach},
                    {"same_first_token", r.same_first_token},
                    {"max_logit_diff", r.max_logit_diff}});
  }
  if (!flags.Get("json").empty()) {
    std::ofstream out(flags.Get("json"));
    out << nlohmann::json{{"config", cfg->name}, {"reps", reps}, {"rows", rows}}.dump(2) << "\n";
    if (!out) return Fail(absl::InternalError("cannot write --json"));
  }
  bool all_same = true;
  for (const Row& r : table) all_same &= r.same_first_token;
  return all_same ? 0 : 1;
}

}  // namespace
}  // namespace kvq::frontend

int main(int argc, char** argv) {
  kvq::frontend::PreferNativeBlasKernels(argv);
  return kvq::frontend::Main(argc, argv);
}
