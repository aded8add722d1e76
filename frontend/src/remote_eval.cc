#include "kvq/frontend/remote_eval.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <thread>

#include "absl/strings/str_cat.h"
#include "kvq/core/status.h"

namespace kvq::frontend {
namespace {

double Since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// Where ForwardDecodeFaithful from token 0 starts the chunk holding position `a` (its cuts
// depend on positions only, except the last chunk's end).
int64_t ChunkStartAtOrBefore(const AttentionCache& cache, int64_t a, int max_chunk = 512) {
  int64_t pos = 0, start = 0;
  while (pos <= a) {
    start = pos;
    int64_t len = max_chunk;
    int64_t b = cache.NextEncodeBoundary(pos);
    if (b >= 0) {
      if (b <= pos + 1) b += cache.EncodeGroup();
      len = std::min(len, b - 1 - pos);
    }
    pos += len;
  }
  return start;
}

}  // namespace

absl::StatusOr<RemotePrefill> PrefillRemote(const LlamaModel& model, RemoteCache* cache,
                                            const int32_t* tokens, int n, int logits_from,
                                            std::vector<float>* logits, bool attach) {
  if (n < 1 || logits_from < 0 || logits_from > n) {
    return absl::InvalidArgumentError(
        absl::StrCat("prefill: ", n, " tokens, logits from ", logits_from));
  }
  RemotePrefill r;
  cache->SetTokenIds(tokens, n);
  if (attach) {
    const auto t0 = std::chrono::steady_clock::now();
    ASSIGN_OR_RETURN(r.attached, cache->AttachPrefix(std::min(logits_from, n - 1)));
    r.attach_seconds = Since(t0);
  }
  // Resume at the start of the chunk holding the attach point: the rows before it are held
  // (not sent again), and every new row is computed in the chunk a prefill from token 0
  // computes it in, so the logits are the same bits.
  const int s = static_cast<int>(ChunkStartAtOrBefore(*cache, r.attached));
  const auto t1 = std::chrono::steady_clock::now();
  RETURN_IF_ERROR(
      model.ForwardDecodeFaithful(tokens + s, n - s, s, cache, logits_from - s, logits));
  r.forward_seconds = Since(t1);
  return r;
}

absl::StatusOr<PerplexityResult> EvaluatePerplexityRemote(
    const LlamaModel& model, const std::vector<int32_t>& tokens, int windows, int window_len,
    const EvalConfig& config, BasisSet* bases, const RemoteEvalOptions& options,
    RemoteEvalStats* stats, const std::function<void(int)>& on_window) {
  const auto t0 = std::chrono::steady_clock::now();
  const LlamaConfig& mc = model.config();
  if (!options.client) return absl::InvalidArgumentError("remote eval: no client");
  if (config.dense) {
    return absl::InvalidArgumentError(
        "dense has no remote form: the server always encodes (run it in-process)");
  }
  if (window_len < 4) return absl::InvalidArgumentError("window length must be >= 4");
  if (static_cast<int64_t>(windows) * window_len > static_cast<int64_t>(tokens.size())) {
    return absl::InvalidArgumentError(absl::StrCat("text has ", tokens.size(), " tokens, need ",
                                                   static_cast<int64_t>(windows) * window_len));
  }
  if (config.wrong_sign || config.value_metric_rounding) {
    return absl::UnimplementedError(absl::StrCat(
        config.name, ": ", config.wrong_sign ? "wrongsign" : "vmr",
        " is an in-process control, not a codec a server can hold; run it with --kv local"));
  }
  // The basis of this configuration, registered as its own entry (controls get a suffix so
  // that they never collide with the query basis under the same name and version).
  const core::ModelBasis* basis = nullptr;
  std::string suffix;
  switch (config.basis) {
    case BasisKind::kQuery:
      basis = bases ? bases->query : nullptr;
      break;
    case BasisKind::kCentred:
      basis = bases ? bases->centred : nullptr;
      suffix = "-centred";
      break;
    case BasisKind::kResidualWeighted:
      basis = bases ? bases->residual_weighted : nullptr;
      suffix = "-resw";
      break;
    case BasisKind::kRandom:
      if (bases && bases->query) {
        if (bases->random.u.empty())
          bases->random = core::RandomBasis(bases->query->manifest, 1234);
        basis = &bases->random;
      }
      suffix = "-random";
      break;
    case BasisKind::kOracle:
      return absl::InvalidArgumentError(config.name +
                                        ": the oracle basis exists only in --diagnostics");
    case BasisKind::kOblique:
      basis = bases ? bases->oblique : nullptr;
      suffix = "-obl";
      break;
  }
  if (config.codec.rank > 0 && !basis) {
    return absl::FailedPreconditionError(
        absl::StrCat(config.name, ": no basis of that kind loaded (--basis)"));
  }
  std::string name = options.model_name;
  if (basis && (!name.empty() || !suffix.empty())) {
    name = (name.empty() ? basis->manifest.model : name) + suffix;
  }
  ASSIGN_OR_RETURN(RemoteModel rm, RegisterRemoteModel(*options.client, mc.cache_shape(), basis,
                                                       name, options.codes));

  core::CodecOptions o = config.codec;
  o.head_dim = mc.head_dim;
  const std::string prefix =
      options.sequence_prefix.empty()
          ? absl::StrCat("kvq-eval-", getpid(), "-",
                         std::chrono::steady_clock::now().time_since_epoch().count())
          : options.sequence_prefix;
  const int first = window_len / 2;
  const int batch = std::max(1, options.batch);
  RemoteEvalStats st;
  st.model = rm;
  PerplexityResult r;
  std::vector<double> nll(windows, 0.0);
  double kb = 0, vb = 0;
  int batches_with_stats = 0, done_windows = 0;
  for (int w0 = 0; w0 < windows; w0 += batch) {
    const int nb = std::min(batch, windows - w0);
    RemoteBatcher batcher(options.client);
    std::vector<std::unique_ptr<RemoteCache>> caches(nb);
    for (int b = 0; b < nb; ++b) {
      RemoteCache::Options co;
      co.sequence_id = absl::StrCat(prefix, "-", config.name, "-w", w0 + b);
      co.model = rm;
      co.codec = o;
      co.keys_only = config.keys_only;
      co.share = options.share;
      co.codes = options.codes;
      ASSIGN_OR_RETURN(caches[b],
                       RemoteCache::Create(options.client, &batcher, mc.cache_shape(), co));
    }
    std::vector<absl::Status> status(nb);
    std::vector<int64_t> attached(nb, 0);
    const auto td = std::chrono::steady_clock::now();
    auto decode = [&](int b) {
      RemoteCache& cache = *caches[b];
      const int32_t* tok = tokens.data() + static_cast<size_t>(w0 + b) * window_len;
      std::vector<float> logits;
      int a = 0;  // share: tokens attached from the prefix index (no logits needed there)
      if (options.share) {
        cache.SetTokenIds(tok, window_len);
        if (!config.keys_only) {
          absl::StatusOr<int64_t> got = cache.AttachPrefix(first);
          if (!got.ok()) {
            status[b] = got.status();
            cache.Finish(/*delete_sequence=*/false).IgnoreError();
            return;
          }
          a = static_cast<int>(*got);
          attached[b] = a;
        }
      }
      if (options.chunks) {
        const int c = static_cast<int>(ChunkStartAtOrBefore(cache, a));  // as PrefillRemote
        absl::Status s =
            model.ForwardDecodeFaithful(tok + c, window_len - c, c, &cache, first - c, &logits);
        if (!s.ok()) status[b] = s;
        for (int j = first; s.ok() && j < window_len - 1; ++j)
          nll[w0 + b] += TokenNll(logits.data() + static_cast<size_t>(j - first) * mc.vocab,
                                  mc.vocab, tok[j + 1]);
        cache.Finish(/*delete_sequence=*/false).IgnoreError();
        return;
      }
      if (options.prefill && a < first) {  // the unscored first half in one forward call
        absl::Status s = model.Forward(tok + a, first - a, a, &cache, first - a, nullptr);
        if (!s.ok()) {
          status[b] = s;
          cache.Finish(/*delete_sequence=*/false).IgnoreError();
          return;
        }
        a = first;
      }
      for (int p = a; p < window_len - 1; ++p) {
        const bool scored = p >= first;
        absl::Status s = model.Forward(tok + p, 1, p, &cache, scored ? 0 : 1, &logits);
        if (!s.ok()) {
          status[b] = s;
          break;
        }
        if (scored) nll[w0 + b] += TokenNll(logits.data(), mc.vocab, tok[p + 1]);
      }
      // Leave the lockstep now (the others stop waiting for this window); keep the
      // sequence until the batch's Stats call.
      cache.Finish(/*delete_sequence=*/false).IgnoreError();
    };
    std::vector<std::thread> threads;
    for (int b = 1; b < nb; ++b) threads.emplace_back(decode, b);
    decode(0);
    for (auto& t : threads) t.join();
    st.decode_seconds += Since(td);
    const int steps = options.chunks ? window_len : window_len - 1;
    int64_t most = 0;
    for (int b = 0; b < nb; ++b) {
      st.decode_steps += steps - attached[b];
      st.tokens_attached += attached[b];
      most = std::max<int64_t>(most, steps - attached[b]);
    }
    st.lockstep_steps += most;
    const RemoteStats bs = batcher.stats();
    st.rpc.batches += bs.batches;
    st.rpc.items += bs.items;
    st.rpc.attach_rpcs += bs.attach_rpcs;
    st.rpc.tokens_attached += bs.tokens_attached;
    st.rpc.put_rpcs += bs.put_rpcs;
    st.rpc.appends_in_attend += bs.appends_in_attend;
    st.rpc.appends_in_codes += bs.appends_in_codes;
    st.rpc.attend_rpcs += bs.attend_rpcs;
    st.rpc.score_rpcs += bs.score_rpcs;
    st.rpc.put_seconds += bs.put_seconds;
    st.rpc.read_seconds += bs.read_seconds;
    st.rpc.bytes_sent += bs.bytes_sent;
    for (int b = 0; b < nb; ++b) {
      if (status[b].ok()) continue;
      // Drop this batch's sequences before failing (best effort), so nothing is left behind.
      if (options.delete_sequences)
        for (auto& c : caches) c->Finish(true).IgnoreError();
      return status[b];
    }
    // The server's own size accounting, while this batch's sequences are alive (the tenant's
    // totals: exact when nothing else of this tenant lives on the server).
    if (options.client->num_shards() == 1) {
      if (auto ss = options.client->Stats(0); ss.ok()) {
        kb += ss->k_bits_per_element();
        vb += ss->v_bits_per_element();
        ++batches_with_stats;
      }
    }
    for (int b = 0; b < nb; ++b) {
      if (options.delete_sequences) RETURN_IF_ERROR(caches[b]->Finish(true));
      r.nll_sum += nll[w0 + b];
      r.scored_tokens += window_len - 1 - first;
      if (on_window) on_window(++done_windows);
    }
  }
  // One token fewer than the in-process run is decoded per window: the last token is never
  // an input (its logits score nothing), so the cache ends at L - 1 tokens.
  r.k_bits = 8.0 * core::KeyBlockBytes(o) / (static_cast<double>(o.key_group) * o.head_dim);
  r.v_bits = config.keys_only ? 16.0
             : o.per_token_value_bits()
                 ? 0.0
                 : 8.0 * core::ValueBlockBytes(o) / (static_cast<double>(o.key_group) * o.head_dim);
  if (batches_with_stats > 0) {
    r.k_bits_ctx = kb / batches_with_stats;
    r.v_bits_ctx = config.keys_only ? 16.0 : vb / batches_with_stats;
    st.k_bits_server = r.k_bits_ctx;
    st.v_bits_server = vb / batches_with_stats;
  }
  r.ppl = std::exp(r.nll_sum / r.scored_tokens);
  r.seconds = Since(t0);
  if (stats) *stats = st;
  return r;
}

}  // namespace kvq::frontend
