// kvq-load: a load generator for kvq servers.
//
// Each of --concurrency streams (a thread) owns --batch sequences of --context cached tokens,
// created in a setup phase, then issues requests drawn from --mix until --duration or
// --requests is reached, closed loop (the next request when the last one answered) or open
// loop at --rate requests/s over all streams (latency then counts from the scheduled start,
// so a slow server cannot hide behind a late sender). With --baseline noop each request is
// followed by an Echo carrying the same number of bytes from the same stream, reported as
// method "noop": the transport's share of the latency, measured under the same load.
//
// Method "session" (with --shared-prefix P): a new conversation after a shared system prompt.
// Each stream first stores the P-token prompt once with token ids (so the server indexes its
// groups); each session then creates a new sequence, attaches the prompt by its token ids
// (no K/V sent), appends the prompt's unattached tail and --put-tokens new tokens with data,
// attends once on layer 0 and deletes the sequence; its latency is the whole session. The
// report adds how many prompt tokens were attached. Session and prompt ids share a hash tag
// ("{<run>-s<stream>}"), so that with several servers a stream's sessions land on the server
// holding its prompt (kvq/client/hash_ring.h).
//
// Exit codes: 0 every request succeeded; 1 some requests failed (the report says which);
// 2 usage; 3 setup failed (model or sequences could not be created; nothing measured);
// 130 interrupted by SIGINT/SIGTERM (the report of what ran is still printed).
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "client/load/load_report.h"
#include "kvq/client/client.h"
#include "kvq/client/flags.h"
#include "kvq/core/basis.h"
#include "kvq/core/tensor.h"

namespace {

using kvq::client::Client;
using kvq::load::MethodStats;
namespace v1 = kvq::v1;

constexpr int kExitOk = 0, kExitErrors = 1, kExitUsage = 2, kExitSetup = 3, kExitInterrupted = 130;
const char* const kMethods[] = {"put", "score", "readout", "attend", "get", "session"};

std::atomic<bool> g_interrupted{false};
void OnSignal(int) { g_interrupted = true; }

struct LoadOptions {
  int concurrency = 4;
  absl::Duration duration = absl::ZeroDuration();  // zero: 10s unless --requests
  int64_t requests = 0;
  double rate = 0;  // 0: closed loop
  std::string mix = "attend";
  int64_t context = 1024;
  std::string model;
  int layers = 2, q_heads = 32, kv_heads = 8, head_dim = 128, basis_rank = 16;
  int batch = 1;    // sequences (items) per batched call
  int queries = 1;  // queries per item (1: decode)
  std::string dtype = "f16";
  std::string baseline;
  std::string json;
  absl::Duration max_duration = absl::Minutes(10);
  absl::Duration progress = absl::Seconds(1);
  int put_tokens = 1;
  int64_t shared_prefix = 0;  // method "session": prompt tokens attached by id
  bool keep = false;
  uint64_t seed = 1;
  int stalled_readers = 0;  // GetBlocks streams opened and then not read (soak tests)
};

v1::DType DTypeOf(const std::string& s) {
  return s == "f32" ? v1::DTYPE_F32 : s == "bf16" ? v1::DTYPE_BF16 : v1::DTYPE_F16;
}

// n random values ~ N(0,1) in the wire dtype.
std::string RandomBytes(v1::DType dtype, size_t n, std::mt19937_64& rng) {
  std::normal_distribution<float> dist(0.f, 1.f);
  std::vector<float> x(n);
  for (float& f : x) f = dist(rng);
  const kvq::core::DType t = dtype == v1::DTYPE_F32    ? kvq::core::DType::kF32
                             : dtype == v1::DTYPE_BF16 ? kvq::core::DType::kBF16
                                                       : kvq::core::DType::kF16;
  std::string out(n * kvq::core::DTypeSize(t), '\0');
  kvq::core::FromFloat(t, x.data(), out.data(), n);
  return out;
}

void SetTensor(v1::Tensor* t, v1::DType dtype, std::initializer_list<int64_t> shape,
               std::string data) {
  t->set_dtype(dtype);
  for (int64_t d : shape) t->add_shape(d);
  t->set_data(std::move(data));
}

struct Shared {
  LoadOptions o;
  Client* client = nullptr;
  std::string model;
  int model_version = 0;
  std::string run_id;
  std::vector<std::pair<std::string, double>> mix;  // method, cumulative weight
  absl::Time start, end;
  std::atomic<int64_t> next{0};  // request tickets (--requests, --rate)
  std::atomic<bool> stop{false};
  std::atomic<int64_t> setup_done{0};
  // Live counters for the progress line.
  std::atomic<int64_t> done{0}, failed{0}, noop_done{0};
  // Method "session": prompt tokens asked for and attached (over layers).
  std::atomic<int64_t> session_prompt_tokens{0}, session_attached_tokens{0};
};

class Worker {
 public:
  Worker(Shared* s, int index) : s_(s), index_(index), rng_(s->o.seed * 1000003 + index) {}

  absl::Status Setup() {
    const LoadOptions& o = s_->o;
    const v1::DType dt = DTypeOf(o.dtype);
    for (int b = 0; b < o.batch; ++b) {
      seqs_.push_back(absl::StrCat("kvq-load-", s_->run_id, "-s", index_, "-b", b));
    }
    tokens_.assign(o.batch, std::vector<int64_t>(o.layers, 0));
    // One chunk of random K/V, re-sent at every position and layer: the data's content does
    // not change the codec's cost.
    const int64_t chunk = std::min<int64_t>(o.context, 1024);
    const size_t elems = static_cast<size_t>(o.kv_heads) * chunk * o.head_dim;
    const std::string k = RandomBytes(dt, elems, rng_), v = RandomBytes(dt, elems, rng_);
    for (int b = 0; b < o.batch && !s_->stop; ++b) {
      std::vector<v1::PutBlocksRequest> msgs;
      for (int l = 0; l < o.layers; ++l) {
        for (int64_t t0 = 0; t0 < o.context; t0 += chunk) {
          const int64_t n = std::min(chunk, o.context - t0);
          v1::Append* a = msgs.emplace_back().add_appends();
          a->set_sequence_id(seqs_[b]);
          a->set_layer(l);
          a->set_start(t0);
          if (l == 0 && t0 == 0) {
            a->set_model(s_->model);
            a->set_basis_version(s_->model_version);
          }
          const size_t bytes =
              static_cast<size_t>(o.kv_heads) * n * o.head_dim * (dt == v1::DTYPE_F32 ? 4 : 2);
          SetTensor(a->mutable_keys(), dt, {o.kv_heads, n, o.head_dim}, k.substr(0, bytes));
          SetTensor(a->mutable_values(), dt, {o.kv_heads, n, o.head_dim}, v.substr(0, bytes));
        }
      }
      auto r = s_->client->PutBlocks(msgs);
      if (!r.ok()) return r.status();
      for (int l = 0; l < o.layers; ++l) tokens_[b][l] = o.context;
      ++s_->setup_done;
    }
    if (o.shared_prefix > 0) {
      // The system prompt, stored once per stream with its token ids (the same ids and bytes
      // in every stream: a deterministic prefill); sessions attach it.
      const int64_t P = o.shared_prefix, n = P + o.put_tokens;
      for (int64_t t = 0; t < P; ++t) prompt_ids_.push_back(static_cast<uint32_t>(1000 + 7 * t));
      std::mt19937_64 same(o.seed * 7919 + 1);
      const size_t per_token = static_cast<size_t>(o.kv_heads) * o.head_dim;
      session_k_ = RandomBytes(dt, per_token * n, same);
      session_v_ = RandomBytes(dt, per_token * n, same);
      prompt_seq_ = absl::StrCat("kvq-load-{", s_->run_id, "-s", index_, "}-prompt");
      v1::PutBlocksRequest m = SessionAppend(prompt_seq_, std::vector<int64_t>(o.layers, 0), P, 0);
      auto r = s_->client->PutBlocks({m});
      if (!r.ok()) return r.status();
    }
    queries_ = RandomBytes(dt, static_cast<size_t>(o.q_heads) * o.queries * o.head_dim, rng_);
    put_k_ = RandomBytes(dt, static_cast<size_t>(o.kv_heads) * o.put_tokens * o.head_dim, rng_);
    put_v_ = RandomBytes(dt, static_cast<size_t>(o.kv_heads) * o.put_tokens * o.head_dim, rng_);
    return absl::OkStatus();
  }

  void Run() {
    const LoadOptions& o = s_->o;
    std::uniform_real_distribution<double> pick(0.0, s_->mix.back().second);
    while (!s_->stop && !g_interrupted) {
      absl::Time scheduled = absl::Now();
      if (o.requests > 0 || o.rate > 0) {
        const int64_t k = s_->next.fetch_add(1);
        if (o.requests > 0 && k >= o.requests) break;
        if (o.rate > 0) {
          scheduled = s_->start + absl::Seconds(static_cast<double>(k) / o.rate);
          if (scheduled >= s_->end) break;
          while (absl::Now() < scheduled && !s_->stop && !g_interrupted) {
            absl::SleepFor(std::min(scheduled - absl::Now(), absl::Milliseconds(50)));
          }
          if (s_->stop || g_interrupted) break;
        }
      }
      if (absl::Now() >= s_->end) break;
      const double w = pick(rng_);
      std::string method = s_->mix.back().first;
      for (const auto& [m, cum] : s_->mix) {
        if (w < cum) {
          method = m;
          break;
        }
      }
      const int64_t request_bytes = Issue(method, scheduled);
      if (o.baseline == "noop" && request_bytes >= 0) Noop(request_bytes);
    }
  }

  // Cleans up the worker's sequences (best effort).
  void Teardown() {
    for (const std::string& id : seqs_) (void)s_->client->DeleteSequence(id);
    if (!prompt_seq_.empty()) (void)s_->client->DeleteSequence(prompt_seq_);
  }

  std::map<std::string, MethodStats>& stats() { return stats_; }

 private:
  // Tokens [from[l], to) of every layer l of a session-shaped sequence, with data and ids: the
  // prompt's ids below shared_prefix, new ids (unique per session `salt`) above.
  v1::PutBlocksRequest SessionAppend(const std::string& id, const std::vector<int64_t>& from,
                                     int64_t to, uint64_t salt) {
    const LoadOptions& o = s_->o;
    const v1::DType dt = DTypeOf(o.dtype);
    const size_t es = dt == v1::DTYPE_F32 ? 4 : 2;
    const int64_t total = o.shared_prefix + o.put_tokens;
    v1::PutBlocksRequest m;
    for (int l = 0; l < o.layers; ++l) {
      const int64_t n = to - from[l];
      if (n <= 0) continue;
      v1::Append* a = m.add_appends();
      a->set_sequence_id(id);
      a->set_layer(l);
      a->set_start(from[l]);
      a->set_model(s_->model);
      a->set_basis_version(s_->model_version);
      // [kv_heads][n][head_dim] out of the [kv_heads][total][head_dim] session data.
      std::string k, v;
      const size_t row = static_cast<size_t>(o.head_dim) * es;
      for (int h = 0; h < o.kv_heads; ++h) {
        const size_t at = (static_cast<size_t>(h) * total + from[l]) * row;
        k.append(session_k_, at, n * row);
        v.append(session_v_, at, n * row);
      }
      SetTensor(a->mutable_keys(), dt, {o.kv_heads, n, o.head_dim}, std::move(k));
      SetTensor(a->mutable_values(), dt, {o.kv_heads, n, o.head_dim}, std::move(v));
      for (int64_t t = from[l]; t < to; ++t) {
        a->add_token_ids(t < o.shared_prefix
                             ? prompt_ids_[t]
                             : static_cast<uint32_t>(0x80000000u + salt * 4099u + t));
      }
    }
    return m;
  }

  // Runs one request; returns its request message bytes (-1 when it was not sent).
  int64_t Issue(const std::string& method, absl::Time scheduled) {
    const LoadOptions& o = s_->o;
    const v1::DType dt = DTypeOf(o.dtype);
    const int layer = static_cast<int>(step_++ % o.layers);
    MethodStats& st = stats_[method];
    int64_t req_bytes = 0, resp_bytes = 0;
    absl::Status call;
    std::vector<int> item_codes;
    if (method == "session") {
      const std::string id = absl::StrCat("kvq-load-{", s_->run_id, "-s", index_, "}-n", sessions_);
      const uint64_t salt = static_cast<uint64_t>(index_) * 1000003u + ++sessions_;
      // 1. Attach the prompt by its ids, every layer, no data.
      v1::PutBlocksRequest attach;
      for (int l = 0; l < o.layers; ++l) {
        v1::Append* a = attach.add_appends();
        a->set_sequence_id(id);
        a->set_layer(l);
        a->set_model(s_->model);
        a->set_basis_version(s_->model_version);
        for (uint32_t t : prompt_ids_) a->add_token_ids(t);
      }
      req_bytes = static_cast<int64_t>(attach.ByteSizeLong());
      auto r1 = s_->client->PutBlocks({attach});
      call = r1.status();
      std::vector<int64_t> from(o.layers, 0);
      if (r1.ok()) {
        resp_bytes += static_cast<int64_t>(r1->ByteSizeLong());
        for (const auto& len : r1->lengths()) {
          if (len.layer() >= 0 && len.layer() < o.layers) from[len.layer()] = len.tokens();
        }
        s_->session_prompt_tokens += static_cast<int64_t>(o.layers) * o.shared_prefix;
        s_->session_attached_tokens += r1->tokens_shared();
        // 2. The rest of the prompt and the new tokens, with data.
        v1::PutBlocksRequest rest = SessionAppend(id, from, o.shared_prefix + o.put_tokens, salt);
        req_bytes += static_cast<int64_t>(rest.ByteSizeLong());
        auto r2 = s_->client->PutBlocks({rest});
        call = r2.status();
        if (r2.ok()) resp_bytes += static_cast<int64_t>(r2->ByteSizeLong());
      }
      if (call.ok()) {  // 3. One decode step's attention on layer 0.
        v1::AttendRequest req;
        v1::AttendItem* it = req.add_items();
        it->set_sequence_id(id);
        it->set_observe(false);
        it->set_output_dtype(dt);
        SetTensor(it->mutable_queries(), dt, {o.q_heads, o.queries, o.head_dim}, queries_);
        req_bytes += static_cast<int64_t>(req.ByteSizeLong());
        auto r3 = s_->client->Attend(req);
        call = r3.status();
        if (r3.ok()) {
          resp_bytes += static_cast<int64_t>(r3->ByteSizeLong());
          for (const auto& res : r3->results()) item_codes.push_back(res.status().code());
        }
      }
      (void)s_->client->DeleteSequence(id);  // 4. The conversation ends.
    } else if (method == "attend") {
      v1::AttendRequest req;
      for (int b = 0; b < o.batch; ++b) {
        v1::AttendItem* it = req.add_items();
        it->set_sequence_id(seqs_[b]);
        it->set_layer(layer);
        it->set_observe(false);  // read-only: the load does not skew the value policy
        it->set_output_dtype(dt);
        SetTensor(it->mutable_queries(), dt, {o.q_heads, o.queries, o.head_dim}, queries_);
      }
      req_bytes = static_cast<int64_t>(req.ByteSizeLong());
      auto r = s_->client->Attend(req);
      call = r.status();
      if (r.ok()) {
        resp_bytes = static_cast<int64_t>(r->ByteSizeLong());
        for (const auto& res : r->results()) item_codes.push_back(res.status().code());
      }
    } else if (method == "score") {
      v1::ScoreRequest req;
      for (int b = 0; b < o.batch; ++b) {
        v1::ScoreItem* it = req.add_items();
        it->set_sequence_id(seqs_[b]);
        it->set_layer(layer);
        SetTensor(it->mutable_queries(), dt, {o.q_heads, o.queries, o.head_dim}, queries_);
      }
      req_bytes = static_cast<int64_t>(req.ByteSizeLong());
      auto r = s_->client->Score(req);
      call = r.status();
      if (r.ok()) {
        resp_bytes = static_cast<int64_t>(r->ByteSizeLong());
        for (const auto& res : r->results()) item_codes.push_back(res.status().code());
      }
    } else if (method == "get") {
      // GetBlocks: a frontend taking back one layer of the stream's first sequence, as it
      // would to attend locally.
      v1::GetBlocksRequest req;
      req.set_sequence_id(seqs_[0]);
      req.add_layers(layer);
      req.set_dtype(dt);
      req_bytes = static_cast<int64_t>(req.ByteSizeLong());
      call = s_->client->GetBlocks(req, [&](const v1::GetBlocksResponse& chunk) {
        resp_bytes += static_cast<int64_t>(chunk.ByteSizeLong());
        return true;
      });
    } else if (method == "readout") {
      v1::ReadoutRequest req;
      for (int b = 0; b < o.batch; ++b) {
        v1::ReadoutItem* it = req.add_items();
        it->set_sequence_id(seqs_[b]);
        it->set_layer(layer);
        it->set_weights_are_logits(true);
        it->set_output_dtype(dt);
        const int64_t t = tokens_[b][layer];
        std::string& logits = logits_[t];
        if (logits.empty()) {
          logits = RandomBytes(v1::DTYPE_F32, static_cast<size_t>(o.q_heads) * o.queries * t, rng_);
        }
        SetTensor(it->mutable_weights(), v1::DTYPE_F32, {o.q_heads, o.queries, t}, logits);
      }
      req_bytes = static_cast<int64_t>(req.ByteSizeLong());
      auto r = s_->client->Readout(req);
      call = r.status();
      if (r.ok()) {
        resp_bytes = static_cast<int64_t>(r->ByteSizeLong());
        for (const auto& res : r->results()) item_codes.push_back(res.status().code());
      }
    } else {  // put: the next --put-tokens tokens of every layer of every sequence (a decode step)
      v1::PutBlocksRequest msg;
      for (int b = 0; b < o.batch; ++b) {
        for (int l = 0; l < o.layers; ++l) {
          v1::Append* a = msg.add_appends();
          a->set_sequence_id(seqs_[b]);
          a->set_layer(l);
          a->set_start(tokens_[b][l]);
          if (tokens_[b][l] == 0) {  // re-creating a sequence the server evicted
            a->set_model(s_->model);
            a->set_basis_version(s_->model_version);
          }
          SetTensor(a->mutable_keys(), dt, {o.kv_heads, o.put_tokens, o.head_dim}, put_k_);
          SetTensor(a->mutable_values(), dt, {o.kv_heads, o.put_tokens, o.head_dim}, put_v_);
        }
      }
      req_bytes = static_cast<int64_t>(msg.ByteSizeLong());
      auto r = s_->client->PutBlocks({msg});
      call = r.status();
      if (r.ok()) {
        resp_bytes = static_cast<int64_t>(r->ByteSizeLong());
        for (auto& row : tokens_) {
          for (int64_t& t : row) t += o.put_tokens;
        }
        if (logits_.size() > 8) logits_.clear();  // readout weights follow the new length
      } else if (call.code() == absl::StatusCode::kNotFound) {
        // Evicted under memory pressure: the next put starts the sequences again, as a
        // frontend would prefill again (the NOT_FOUND is still counted).
        for (auto& row : tokens_) std::fill(row.begin(), row.end(), 0);
        logits_.clear();
      }
    }
    const double latency = absl::ToDoubleSeconds(absl::Now() - scheduled);
    Record(st, call, item_codes, latency, req_bytes + resp_bytes);
    return req_bytes;
  }

  void Noop(int64_t bytes) {
    if (payload_.size() != static_cast<size_t>(bytes)) payload_.assign(bytes, 'x');
    const absl::Time t0 = absl::Now();
    // To the server of the stream's sequences: the baseline shares their connection and load.
    auto r = s_->client->Echo(payload_, s_->client->ShardOf(seqs_[0]));
    const double latency = absl::ToDoubleSeconds(absl::Now() - t0);
    Record(stats_["noop"], r.status(), {}, latency,
           r.ok() ? 2 * static_cast<int64_t>(payload_.size()) : 0, /*noop=*/true);
  }

  void Record(MethodStats& st, const absl::Status& call, const std::vector<int>& item_codes,
              double latency, int64_t bytes, bool noop = false) {
    ++st.requests;
    st.latency_s.push_back(latency);
    bool failed = !call.ok();
    if (!call.ok()) {
      ++st.errors_by_code[kvq::client::StatusCodeName(static_cast<int>(call.code()))];
    }
    for (int c : item_codes) {
      if (c != 0) {
        failed = true;
        ++st.errors_by_code[kvq::client::StatusCodeName(c)];
      }
    }
    if (failed) {
      ++st.errors;
      ++s_->failed;
      if (first_error_.empty()) {
        first_error_ = call.ok() ? "an item failed" : std::string(call.message());
      }
    } else {
      st.bytes += bytes;
    }
    ++(noop ? s_->noop_done : s_->done);
  }

 public:
  std::string first_error_;
  const std::string& first_sequence() const { return seqs_[0]; }

 private:
  Shared* s_;
  int index_;
  std::mt19937_64 rng_;
  std::vector<std::string> seqs_;
  std::vector<std::vector<int64_t>> tokens_;  // [batch][layer] cached tokens
  std::string queries_, put_k_, put_v_, payload_;
  std::map<int64_t, std::string> logits_;  // readout weights by sequence length
  uint64_t step_ = 0;
  // Method "session".
  std::vector<uint32_t> prompt_ids_;
  std::string session_k_, session_v_, prompt_seq_;
  uint64_t sessions_ = 0;
  std::map<std::string, MethodStats> stats_;
};

absl::Status ParseMix(const std::string& mix, std::vector<std::pair<std::string, double>>* out) {
  double total = 0;
  for (absl::string_view part : absl::StrSplit(mix, ',', absl::SkipEmpty())) {
    std::pair<absl::string_view, absl::string_view> kv =
        absl::StrSplit(part, absl::MaxSplits(':', 1));
    std::string name(kv.first);
    double w = 1;
    if (!kv.second.empty() && (!absl::SimpleAtod(kv.second, &w) || !(w > 0))) {
      return absl::InvalidArgumentError(absl::StrCat("--mix: bad weight in '", part, "'"));
    }
    if (std::find(std::begin(kMethods), std::end(kMethods), name) == std::end(kMethods)) {
      return absl::InvalidArgumentError(absl::StrCat("--mix: unknown method '", name,
                                                     "' (put, score, readout, attend, session)"));
    }
    total += w;
    out->emplace_back(name, total);
  }
  if (out->empty()) return absl::InvalidArgumentError("--mix is empty");
  return absl::OkStatus();
}

}  // namespace

int main(int argc, char** argv) {
  LoadOptions o;
  kvq::client::ClientOptions copts;
  copts.timeout = absl::Seconds(10);
  kvq::client::ClientFlags cflags;
  bool help = false;
  kvq::client::FlagSet flags;
  using kvq::client::ParseDoubleFlag;
  using kvq::client::ParseDurationFlag;
  using kvq::client::ParseInt64Flag;
  using kvq::client::ParseIntFlag;
  flags.AddBool("help", "print help and exit", &help);
  kvq::client::AddClientFlags(&flags, &copts, &cflags);
  flags.Add(
      "concurrency", "N", "concurrent streams (threads), each with its own sequences (default 4)",
      [&](const std::string& v) { return ParseIntFlag(v, &o.concurrency) && o.concurrency >= 1; });
  flags.Add("duration", "DURATION",
            "how long to measure, e.g. 10s (default 10s without --requests)",
            [&](const std::string& v) {
              return ParseDurationFlag(v, &o.duration) && o.duration > absl::ZeroDuration();
            });
  flags.Add(
      "requests", "N", "stop after N requests over all streams (noop pairs not counted)",
      [&](const std::string& v) { return ParseInt64Flag(v, &o.requests) && o.requests >= 1; });
  flags.Add("rate", "REQ/S", "open loop at this total rate (default: closed loop)",
            [&](const std::string& v) { return ParseDoubleFlag(v, &o.rate) && o.rate > 0; });
  flags.Add("mix", "LIST", "methods with weights, e.g. attend:8,put:1,score:1 (default attend)",
            [&](const std::string& v) { return o.mix = v, true; });
  flags.Add("context", "TOKENS",
            "cached tokens per sequence and layer before measuring (default 1024)",
            [&](const std::string& v) { return ParseInt64Flag(v, &o.context) && o.context >= 1; });
  flags.Add("model", "NAME", "use a registered model's shape (default: register a synthetic one)",
            [&](const std::string& v) { return o.model = v, true; });
  flags.Add("layers", "N", "synthetic model: layers (default 2)",
            [&](const std::string& v) { return ParseIntFlag(v, &o.layers) && o.layers >= 1; });
  flags.Add("q-heads", "N", "synthetic model: query heads (default 32)",
            [&](const std::string& v) { return ParseIntFlag(v, &o.q_heads) && o.q_heads >= 1; });
  flags.Add("kv-heads", "N", "synthetic model: KV heads (default 8)",
            [&](const std::string& v) { return ParseIntFlag(v, &o.kv_heads) && o.kv_heads >= 1; });
  flags.Add("head-dim", "N", "synthetic model: head dimension (default 128)",
            [&](const std::string& v) { return ParseIntFlag(v, &o.head_dim) && o.head_dim >= 1; });
  flags.Add(
      "basis-rank", "N", "synthetic model: rank of its random HeadQ basis, 0 none (default 16)",
      [&](const std::string& v) { return ParseIntFlag(v, &o.basis_rank) && o.basis_rank >= 0; });
  flags.Add("batch", "N", "sequences per stream, one item each per batched call (default 1)",
            [&](const std::string& v) { return ParseIntFlag(v, &o.batch) && o.batch >= 1; });
  flags.Add("queries", "N", "queries per item (default 1: a decode step)",
            [&](const std::string& v) { return ParseIntFlag(v, &o.queries) && o.queries >= 1; });
  flags.Add(
      "put-tokens", "N", "tokens per layer appended by a put (default 1: a decode step)",
      [&](const std::string& v) { return ParseIntFlag(v, &o.put_tokens) && o.put_tokens >= 1; });
  flags.Add(
      "dtype", "f16|bf16|f32", "wire dtype of K/V, queries and outputs (default f16)",
      [&](const std::string& v) { return o.dtype = v, v == "f16" || v == "bf16" || v == "f32"; });
  flags.Add("baseline", "noop", "also run Echo with the same bytes after each request",
            [&](const std::string& v) { return o.baseline = v, v == "noop" || v.empty(); });
  flags.Add("json", "FILE", "also write the report as JSON",
            [&](const std::string& v) { return o.json = v, !v.empty(); });
  flags.Add("max-duration", "DURATION", "hard stop of the measured phase (default 10m)",
            [&](const std::string& v) {
              return ParseDurationFlag(v, &o.max_duration) && o.max_duration > absl::ZeroDuration();
            });
  flags.Add("progress", "DURATION", "progress line period on stderr, 0 off (default 1s)",
            [&](const std::string& v) { return ParseDurationFlag(v, &o.progress); });
  flags.Add("shared-prefix", "TOKENS",
            "method 'session': a new sequence per request attaching this many prompt tokens by "
            "token ids, then --put-tokens new tokens, one attend, delete (default 0: off)",
            [&](const std::string& v) {
              return ParseInt64Flag(v, &o.shared_prefix) && o.shared_prefix >= 0 &&
                     o.shared_prefix <= 65536;
            });
  flags.AddBool("keep", "keep the sequences at the end (default: delete them)", &o.keep);
  std::string run_id;
  flags.Add("run-id", "ID",
            "names the sequences kvq-load-ID-s<stream>-b<n> (default: time and pid, unique)",
            [&](const std::string& v) { return run_id = v, !v.empty() && v.size() <= 64; });
  flags.Add("seed", "N", "random seed of the data (default 1)",
            [&](const std::string& v) { return absl::SimpleAtoi(v, &o.seed); });
  flags.Add("stalled-readers", "N",
            "also open N GetBlocks streams (16 tokens a message) that stop reading after their "
            "first message until the end: slow peers the server must not buffer for (default 0)",
            [&](const std::string& v) {
              return absl::SimpleAtoi(v, &o.stalled_readers) && o.stalled_readers >= 0 &&
                     o.stalled_readers <= 1024;
            });
  std::vector<std::string> pos;
  absl::Status parsed = flags.Parse(argc, argv, 1, &pos);
  if (help) {
    std::printf(
        "Usage: kvq-load [FLAGS]\n"
        "Load generator for kvq servers: sets up --concurrency streams of --batch sequences\n"
        "with --context cached tokens each, then sends --mix requests (closed loop, or open\n"
        "loop at --rate) for --duration or --requests, with a progress line on stderr, and\n"
        "prints per method: requests, req/s, GB/s (request + response bytes), latency\n"
        "p50/p90/p99/max in ms, errors by status code. --baseline noop pairs every request\n"
        "with an Echo of the same bytes (method 'noop').\n"
        "Exit codes: 0 no request failed; 1 some failed; 2 usage; 3 setup failed;\n"
        "130 interrupted (SIGINT/SIGTERM; the report of what ran is printed).\n\n"
        "Flags:\n%s",
        flags.Help().c_str());
    return kExitOk;
  }
  auto usage = [](const std::string& m) {
    std::fprintf(stderr, "kvq-load: USAGE: %s (see --help)\n", m.c_str());
    return kExitUsage;
  };
  if (!parsed.ok()) return usage(std::string(parsed.message()));
  if (!pos.empty()) return usage(absl::StrCat("unexpected argument '", pos[0], "'"));
  Shared s;
  if (absl::Status st = ParseMix(o.mix, &s.mix); !st.ok()) return usage(std::string(st.message()));
  if (o.q_heads % o.kv_heads != 0) return usage("--q-heads must be a multiple of --kv-heads");
  const bool sessions =
      std::any_of(s.mix.begin(), s.mix.end(), [](const auto& m) { return m.first == "session"; });
  if (sessions != (o.shared_prefix > 0)) {
    return usage("method 'session' in --mix and --shared-prefix TOKENS go together");
  }
  if (o.basis_rank > o.head_dim) return usage("--basis-rank must be <= --head-dim");
  if (o.duration == absl::ZeroDuration() && o.requests == 0) o.duration = absl::Seconds(10);
  if (absl::Status st = kvq::client::ResolveClientFlags(cflags, &copts); !st.ok()) {
    return usage(std::string(st.message()));
  }
  auto client = Client::Create(copts);
  if (!client.ok()) return usage(std::string(client.status().message()));
  s.client = client->get();

  auto setup_fail = [](const std::string& what, const absl::Status& st) {
    std::fprintf(stderr, "\nkvq-load: SETUP: %s: %s: %s\n", what.c_str(),
                 kvq::client::StatusCodeName(static_cast<int>(st.code())).c_str(),
                 std::string(st.message()).c_str());
    return kExitSetup;
  };
  // The model: a registered one, or a synthetic one with a deterministic random basis
  // (registering it again in a later run is a no-op).
  if (!o.model.empty()) {
    auto m = s.client->GetModel(o.model);
    if (!m.ok()) return setup_fail(absl::StrCat("model ", o.model), m.status());
    o.layers = m->layers();
    o.q_heads = m->q_heads();
    o.kv_heads = m->kv_heads();
    o.head_dim = m->head_dim();
    s.model = o.model;
    s.model_version = m->version();
  } else {
    kvq::core::BasisManifest shape;
    shape.model = absl::StrFormat("kvq-load-l%d-q%d-kv%d-d%d-r%d", o.layers, o.q_heads, o.kv_heads,
                                  o.head_dim, o.basis_rank);
    shape.version = 1;
    shape.layers = o.layers;
    shape.kv_heads = o.kv_heads;
    shape.q_heads = o.q_heads;
    shape.head_dim = o.head_dim;
    shape.rank = o.basis_rank;
    shape.kind = "random";
    v1::RegisterBasisRequest req;
    v1::ModelInfo* info = req.mutable_info();
    info->set_model(shape.model);
    info->set_version(1);
    info->set_layers(o.layers);
    info->set_kv_heads(o.kv_heads);
    info->set_q_heads(o.q_heads);
    info->set_head_dim(o.head_dim);
    info->set_basis_rank(o.basis_rank);
    info->set_kind("random");
    if (o.basis_rank > 0) {
      const kvq::core::ModelBasis b = kvq::core::RandomBasis(shape, 42);
      const size_t per = static_cast<size_t>(o.kv_heads) * o.head_dim * o.basis_rank;
      for (int l = 0; l < o.layers; ++l) {
        SetTensor(
            req.add_basis(), v1::DTYPE_F32, {o.kv_heads, o.head_dim, o.basis_rank},
            std::string(reinterpret_cast<const char*>(b.u.data() + l * per), per * sizeof(float)));
      }
    }
    auto r = s.client->RegisterBasis(req);
    if (!r.ok()) return setup_fail(absl::StrCat("register ", shape.model), r.status());
    s.model = shape.model;
    s.model_version = 1;
  }
  s.o = o;
  s.run_id = !run_id.empty()
                 ? run_id
                 : absl::StrFormat("%x-%d", absl::ToUnixMicros(absl::Now()) & 0xffffffff, getpid());

  signal(SIGINT, OnSignal);
  signal(SIGTERM, OnSignal);
  const bool tty = isatty(STDERR_FILENO);
  auto progress_line = [&](const std::string& line, bool final) {
    if (o.progress == absl::ZeroDuration()) return;
    if (tty) {
      std::fprintf(stderr, "\r\033[K%s%s", line.c_str(), final ? "\n" : "");
    } else {
      std::fprintf(stderr, "%s\n", line.c_str());
    }
  };

  // Setup: every stream creates its sequences.
  std::vector<std::unique_ptr<Worker>> workers;
  for (int i = 0; i < o.concurrency; ++i) workers.push_back(std::make_unique<Worker>(&s, i));
  std::vector<absl::Status> setup(o.concurrency);
  {
    s.end = absl::InfiniteFuture();
    std::vector<std::thread> threads;
    std::atomic<int> ended{0}, failures{0};
    for (int i = 0; i < o.concurrency; ++i) {
      threads.emplace_back([&, i] {
        setup[i] = workers[i]->Setup();
        if (!setup[i].ok()) {
          ++failures;
          s.stop = true;  // the other streams stop after their current put
        }
        ++ended;
      });
    }
    const int64_t total = static_cast<int64_t>(o.concurrency) * o.batch;
    const absl::Time t0 = absl::Now();
    absl::Time shown = t0;
    while (ended < o.concurrency) {
      absl::SleepFor(absl::Milliseconds(50));
      if (g_interrupted) s.stop = true;
      if (o.progress > absl::ZeroDuration() && absl::Now() - shown >= o.progress) {
        shown = absl::Now();
        progress_line(absl::StrFormat("kvq-load: setup %d/%d sequences of %d tokens x %d layers",
                                      s.setup_done.load(), total, o.context, o.layers),
                      false);
      }
    }
    for (auto& t : threads) t.join();
    for (int i = 0; i < o.concurrency; ++i) {
      if (!setup[i].ok()) {
        for (auto& w : workers) w->Teardown();
        return setup_fail("creating sequences", setup[i]);
      }
    }
    if (g_interrupted) {
      for (auto& w : workers) w->Teardown();
      std::fprintf(stderr, "\nkvq-load: interrupted during setup\n");
      return kExitInterrupted;
    }
  }

  // The measured phase.
  s.start = absl::Now();
  const absl::Duration limit =
      o.duration > absl::ZeroDuration() ? std::min(o.duration, o.max_duration) : o.max_duration;
  s.end = s.start + limit;
  // Stalled readers: each takes one message of a stream's first sequence, then holds the
  // stream open without reading until the measured phase ends.
  std::vector<std::thread> stalled;
  std::atomic<int> stalled_open{0};
  for (int i = 0; i < o.stalled_readers; ++i) {
    stalled.emplace_back([&, i] {
      v1::GetBlocksRequest req;
      req.set_sequence_id(workers[i % o.concurrency]->first_sequence());
      req.set_max_tokens_per_message(16);
      (void)s.client->GetBlocks(req, [&](const v1::GetBlocksResponse&) {
        ++stalled_open;
        while (!s.stop && !g_interrupted && absl::Now() < s.end)
          absl::SleepFor(absl::Milliseconds(20));
        return false;  // then cancel
      });
    });
  }
  std::vector<std::thread> threads;
  std::atomic<int> running{o.concurrency};
  for (int i = 0; i < o.concurrency; ++i) {
    threads.emplace_back([&, i] {
      workers[i]->Run();
      --running;
    });
  }
  absl::Time last = s.start;
  int64_t last_done = 0;
  while (running > 0) {
    absl::SleepFor(absl::Milliseconds(50));
    if (absl::Now() > s.end + absl::Seconds(1)) s.stop = true;  // belt and braces
    if (o.progress > absl::ZeroDuration() && absl::Now() - last >= o.progress) {
      const absl::Time now = absl::Now();
      const int64_t done = s.done;
      progress_line(
          absl::StrFormat("kvq-load: %.1fs/%s  %d requests (%.0f/s now)  %d noop  %d errors",
                          absl::ToDoubleSeconds(now - s.start),
                          o.requests > 0 ? absl::StrCat(o.requests, " req")
                                         : absl::StrFormat("%.0fs", absl::ToDoubleSeconds(limit)),
                          done,
                          static_cast<double>(done - last_done) / absl::ToDoubleSeconds(now - last),
                          s.noop_done.load(), s.failed.load()),
          false);
      last = now;
      last_done = done;
    }
  }
  for (auto& t : threads) t.join();
  for (auto& t : stalled) t.join();
  if (o.stalled_readers > 0) {
    std::fprintf(stderr, "kvq-load: %d of %d stalled readers got their first message\n",
                 stalled_open.load(), o.stalled_readers);
  }
  const double wall = absl::ToDoubleSeconds(absl::Now() - s.start);
  progress_line(absl::StrFormat("kvq-load: done: %d requests, %d noop, %d errors in %.1f s%s",
                                s.done.load(), s.noop_done.load(), s.failed.load(), wall,
                                g_interrupted ? " (interrupted)" : ""),
                true);
  if (!o.keep) {
    for (auto& w : workers) w->Teardown();
  }

  std::map<std::string, MethodStats> merged;
  std::string first_error;
  for (auto& w : workers) {
    for (auto& [m, st] : w->stats()) merged[m].Merge(st);
    if (first_error.empty()) first_error = w->first_error_;
  }
  nlohmann::json config = {{"servers", copts.servers},
                           {"concurrency", o.concurrency},
                           {"duration_s", wall},
                           {"requests", o.requests},
                           {"rate", o.rate},
                           {"mix", o.mix},
                           {"context", o.context},
                           {"model", s.model},
                           {"layers", o.layers},
                           {"q_heads", o.q_heads},
                           {"kv_heads", o.kv_heads},
                           {"head_dim", o.head_dim},
                           {"batch", o.batch},
                           {"queries", o.queries},
                           {"dtype", o.dtype},
                           {"baseline", o.baseline},
                           {"closed_loop", o.rate == 0},
                           {"shared_prefix", o.shared_prefix},
                           {"session_prompt_tokens", s.session_prompt_tokens.load()},
                           {"session_attached_tokens", s.session_attached_tokens.load()},
                           {"interrupted", g_interrupted.load()}};
  std::printf(
      "kvq-load: %d streams x %d sequences, %s, %.1f s, mix %s, context %lld, model %s "
      "(%d layers, %d/%d heads, head_dim %d)\n%s",
      o.concurrency, o.batch,
      o.rate > 0 ? absl::StrFormat("open loop %.0f req/s", o.rate).c_str() : "closed loop", wall,
      o.mix.c_str(), static_cast<long long>(o.context), s.model.c_str(), o.layers, o.q_heads,
      o.kv_heads, o.head_dim, kvq::load::ReportText(merged, wall).c_str());
  if (s.session_prompt_tokens > 0) {
    std::printf("sessions: %lld of %lld prompt tokens attached from the prefix index (%.1f%%)\n",
                static_cast<long long>(s.session_attached_tokens.load()),
                static_cast<long long>(s.session_prompt_tokens.load()),
                100.0 * s.session_attached_tokens.load() / s.session_prompt_tokens.load());
  }
  if (!first_error.empty()) std::printf("first error: %s\n", first_error.c_str());
  if (!o.json.empty()) {
    std::ofstream out(o.json);
    out << kvq::load::ReportJson(merged, wall, config).dump(2) << "\n";
    if (!out) {
      std::fprintf(stderr, "kvq-load: cannot write --json '%s'\n", o.json.c_str());
      return kExitErrors;
    }
  }
  if (g_interrupted) return kExitInterrupted;
  return s.failed > 0 ? kExitErrors : kExitOk;
}
