#include "kvq/client/client.h"

#include <algorithm>
#include <atomic>
#include <cinttypes>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <deque>
#include <fstream>
#include <mutex>
#include <random>
#include <sstream>
#include <thread>
#include <unordered_map>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "grpcpp/grpcpp.h"
#include "kvq/v1/kvq.grpc.pb.h"

namespace kvq::client {
namespace {

absl::StatusOr<std::string> ReadFile(const std::string& path, const char* what) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::InvalidArgumentError(absl::StrCat(what, ": cannot read '", path, "'"));
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

absl::Status ToAbsl(const grpc::Status& st, const std::string& server) {
  if (st.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(st.error_code()),
                      absl::StrCat(st.error_message(), " [server ", server, "]"));
}

// Runs job(0..n-1) on at most kMaxParallelCalls threads (this one included).
void ForEachParallel(int n, const std::function<void(int)>& job) {
  if (n <= 0) return;
  std::atomic<int> next{0};
  auto worker = [&] {
    for (int i; (i = next.fetch_add(1)) < n;) job(i);
  };
  std::vector<std::thread> threads;
  for (int t = 1; t < std::min(n, kMaxParallelCalls); ++t) threads.emplace_back(worker);
  worker();
  for (auto& t : threads) t.join();
}

}  // namespace

std::vector<std::string> SplitServers(std::string_view list) {
  std::vector<std::string> out;
  for (absl::string_view s : absl::StrSplit(absl::string_view(list.data(), list.size()), ',')) {
    s = absl::StripAsciiWhitespace(s);
    if (!s.empty()) out.emplace_back(s);
  }
  return out;
}

std::string StatusCodeName(int code) {
  // gRPC's codes are Abseil's: the canonical names come from absl.
  std::string name = absl::StatusCodeToString(static_cast<absl::StatusCode>(code));
  return name.empty() ? absl::StrCat("CODE_", code) : name;
}

struct Client::Impl {
  ClientOptions opts;
  std::vector<std::shared_ptr<grpc::Channel>> channels;
  std::vector<std::unique_ptr<v1::Kvq::Stub>> stubs;
  std::vector<std::unique_ptr<grpc::health::v1::Health::Stub>> health;
  std::mutex rng_mu;
  std::mt19937_64 rng{std::random_device{}()};
  std::string default_route;  // router mode: RouteKey(""), for calls of no sequence

  void Prepare(grpc::ClientContext* ctx, std::string_view route) const {
    ctx->set_deadline(absl::ToChronoTime(absl::Now() + opts.timeout));
    if (!opts.token.empty()) {
      ctx->AddMetadata("authorization", absl::StrCat("Bearer ", opts.token));
    } else if (!opts.tenant.empty()) {
      ctx->AddMetadata("x-kvq-tenant", opts.tenant);
    }
    if (opts.router)
      ctx->AddMetadata(kRouteHeader, std::string(route.empty() ? default_route : route));
  }

  // The server named in errors: the address, plus the routing key in router mode.
  std::string Label(int shard, std::string_view route) const {
    if (!opts.router) return opts.servers[shard];
    return absl::StrCat(opts.servers[shard], " (", kRouteHeader, " ",
                        route.empty() ? default_route : std::string(route), ")");
  }

  absl::Duration Backoff(int retry) {
    const double cap = std::min(
        absl::ToDoubleSeconds(opts.max_backoff),
        absl::ToDoubleSeconds(opts.initial_backoff) * std::pow(opts.backoff_multiplier, retry - 1));
    std::lock_guard<std::mutex> lock(rng_mu);
    return absl::Seconds(std::uniform_real_distribution<double>(0.0, std::max(0.0, cap))(rng));
  }

  // Runs fn(ctx) until it succeeds, fails with a code other than UNAVAILABLE, runs out of
  // attempts, or (for streams) *no_more_retries turns true.
  // route: router mode's x-kvq-route ("": the default route).
  template <class Fn>
  grpc::Status Run(std::string_view method, int shard, bool idempotent, Fn&& fn,
                   const bool* no_more_retries = nullptr, std::string_view route = {}) {
    const int attempts = idempotent ? std::max(1, opts.max_attempts) : 1;
    grpc::Status st;
    for (int a = 1; a <= attempts; ++a) {
      grpc::ClientContext ctx;
      Prepare(&ctx, route);
      st = fn(&ctx);
      if (opts.on_attempt) opts.on_attempt(method, a, shard, st.error_code());
      if (st.ok() || st.error_code() != grpc::StatusCode::UNAVAILABLE || a == attempts ||
          (no_more_retries != nullptr && *no_more_retries)) {
        break;
      }
      absl::SleepFor(Backoff(a));
    }
    return st;
  }

  // Splits a batched request by placement group (shard, or routing key in router mode),
  // runs the parts concurrently, merges the results in request order.
  template <class Req, class Resp>
  absl::StatusOr<Resp> Batched(std::string_view method, const Req& req, bool idempotent,
                               const Client::Placement& place,
                               grpc::Status (v1::Kvq::Stub::*call)(grpc::ClientContext*, const Req&,
                                                                   Resp*)) {
    const int n = req.items_size();
    const int groups = static_cast<int>(place.members.size());
    if (groups <= 1) {  // one group, or an empty batch (the server judges it)
      const int s = groups ? place.shard[0] : 0;
      const std::string route = groups ? place.route[0] : std::string();
      Resp resp;
      grpc::Status st = Run(
          method, s, idempotent,
          [&](grpc::ClientContext* ctx) {
            resp.Clear();
            return (stubs[s].get()->*call)(ctx, req, &resp);
          },
          nullptr, route);
      if (!st.ok()) return ToAbsl(st, Label(s, route));
      if (resp.results_size() != n) {
        return absl::InternalError(absl::StrCat(std::string(method), ": server ", Label(s, route),
                                                " returned ", resp.results_size(), " results for ",
                                                n, " items"));
      }
      return resp;
    }
    std::vector<Req> parts(groups);
    std::vector<Resp> answers(groups);
    std::vector<grpc::Status> statuses(groups);
    for (int g = 0; g < groups; ++g) {
      for (int i : place.members[g]) *parts[g].add_items() = req.items(i);
    }
    ForEachParallel(groups, [&](int g) {
      const int s = place.shard[g];
      statuses[g] = Run(
          method, s, idempotent,
          [&](grpc::ClientContext* ctx) {
            answers[g].Clear();
            return (stubs[s].get()->*call)(ctx, parts[g], &answers[g]);
          },
          nullptr, place.route[g]);
      if (statuses[g].ok() && answers[g].results_size() != parts[g].items_size()) {
        statuses[g] = grpc::Status(grpc::StatusCode::INTERNAL,
                                   absl::StrCat("returned ", answers[g].results_size(),
                                                " results for ", parts[g].items_size(), " items"));
      }
    });

    int failed = 0;
    for (int g = 0; g < groups; ++g) failed += statuses[g].ok() ? 0 : 1;
    if (failed == groups) return ToAbsl(statuses[0], Label(place.shard[0], place.route[0]));
    Resp out;
    std::vector<int> next(groups, 0);
    for (int i = 0; i < n; ++i) {
      const int g = place.group_of[i];
      auto* r = out.add_results();
      if (statuses[g].ok()) {
        r->Swap(answers[g].mutable_results(next[g]++));
      } else {
        r->mutable_status()->set_code(statuses[g].error_code());
        r->mutable_status()->set_message(absl::StrCat(
            "server ", Label(place.shard[g], place.route[g]), ": ", statuses[g].error_message()));
      }
    }
    return out;
  }
};

absl::StatusOr<std::unique_ptr<Client>> Client::Create(ClientOptions o) {
  if (o.servers.empty()) return absl::InvalidArgumentError("no server address given");
  for (size_t i = 0; i < o.servers.size(); ++i) {
    if (o.servers[i].empty()) return absl::InvalidArgumentError("empty server address");
    for (size_t j = 0; j < i; ++j) {
      if (o.servers[i] == o.servers[j]) {
        return absl::InvalidArgumentError(absl::StrCat("server '", o.servers[i], "' listed twice"));
      }
    }
  }
  if (o.timeout <= absl::ZeroDuration()) return absl::InvalidArgumentError("timeout must be > 0");
  if (o.max_attempts < 1) return absl::InvalidArgumentError("max_attempts must be >= 1");
  if (o.backoff_multiplier < 1.0) {
    return absl::InvalidArgumentError("backoff_multiplier must be >= 1");
  }
  if (o.virtual_nodes < 1) return absl::InvalidArgumentError("virtual_nodes must be >= 1");
  if (o.router && o.servers.size() != 1) {
    return absl::InvalidArgumentError(
        "router mode takes exactly one address (the routing proxy), not a shard list");
  }
  if (!o.tls && !o.token.empty() && !o.allow_insecure_token) {
    return absl::InvalidArgumentError(
        "refusing to send a bearer token over plaintext: turn TLS on (or allow insecure tokens "
        "for loopback testing)");
  }
  if (!o.tls && (!o.tls_ca.empty() || !o.tls_cert.empty() || !o.tls_key.empty())) {
    return absl::InvalidArgumentError("TLS files given but TLS is off");
  }
  if (o.tls_cert.empty() != o.tls_key.empty()) {
    return absl::InvalidArgumentError("a client certificate needs both tls_cert and tls_key");
  }

  std::shared_ptr<grpc::ChannelCredentials> creds = grpc::InsecureChannelCredentials();
  if (o.tls) {
    grpc::SslCredentialsOptions ssl;
    if (!o.tls_ca.empty()) {
      auto ca = ReadFile(o.tls_ca, "tls_ca");
      if (!ca.ok()) return ca.status();
      ssl.pem_root_certs = *ca;
    }
    if (!o.tls_cert.empty()) {
      auto cert = ReadFile(o.tls_cert, "tls_cert");
      if (!cert.ok()) return cert.status();
      auto key = ReadFile(o.tls_key, "tls_key");
      if (!key.ok()) return key.status();
      ssl.pem_cert_chain = *cert;
      ssl.pem_private_key = *key;
    }
    creds = grpc::SslCredentials(ssl);
  }
  auto impl = std::make_unique<Impl>();
  impl->opts = o;
  for (const std::string& addr : o.servers) {
    grpc::ChannelArguments args;
    const int limit = static_cast<int>(std::min<int64_t>(o.max_message_bytes, INT32_MAX));
    args.SetMaxReceiveMessageSize(limit);
    args.SetMaxSendMessageSize(limit);
    const int reconnect_ms = static_cast<int>(
        std::max<int64_t>(100, absl::ToInt64Milliseconds(o.max_reconnect_backoff)));
    args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, std::min(reconnect_ms, 100));
    args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, reconnect_ms);
    if (o.tls && !o.tls_server_name.empty()) args.SetSslTargetNameOverride(o.tls_server_name);
    auto ch = grpc::CreateCustomChannel(addr, creds, args);
    impl->stubs.push_back(v1::Kvq::NewStub(ch));
    impl->health.push_back(grpc::health::v1::Health::NewStub(ch));
    impl->channels.push_back(std::move(ch));
  }
  return std::unique_ptr<Client>(new Client(std::move(o), std::move(impl)));
}

Client::Client(ClientOptions options, std::unique_ptr<Impl> impl)
    : options_(std::move(options)),
      ring_(options_.servers, options_.virtual_nodes),
      shard_tenant_(!options_.tenant.empty()  ? options_.tenant
                    : !options_.token.empty() ? options_.token
                                              : std::string("default")),
      impl_(std::move(impl)) {
  impl_->default_route = RouteKey("");
}

Client::~Client() = default;

int Client::ShardOf(std::string_view sequence_id) const {
  return options_.router ? 0 : ring_.ShardOf(shard_tenant_, sequence_id);
}

std::string Client::RouteKey(std::string_view sequence_id) const {
  char hex[17];
  std::snprintf(hex, sizeof hex, "%016" PRIx64, HashRing::KeyOf(shard_tenant_, sequence_id));
  return hex;
}

Client::Placement Client::Place(const std::function<std::string_view(int)>& id_of, int n) const {
  Placement p;
  p.group_of.resize(n);
  if (options_.router) {  // by routing key, groups in order of first appearance
    std::unordered_map<std::string, int> group;
    for (int i = 0; i < n; ++i) {
      std::string key = RouteKey(id_of(i));
      auto [it, added] = group.try_emplace(key, static_cast<int>(p.members.size()));
      if (added) {
        p.members.emplace_back();
        p.shard.push_back(0);
        p.route.push_back(std::move(key));
      }
      p.group_of[i] = it->second;
      p.members[it->second].push_back(i);
    }
    return p;
  }
  std::vector<int> group(num_shards(), -1);  // by shard, groups in shard order
  std::vector<int> shard_of(n);
  for (int i = 0; i < n; ++i) {
    shard_of[i] = num_shards() == 1 ? 0 : ShardOf(id_of(i));
    group[shard_of[i]] = 0;
  }
  for (int s = 0; s < num_shards(); ++s) {
    if (group[s] < 0) continue;
    group[s] = static_cast<int>(p.members.size());
    p.members.emplace_back();
    p.shard.push_back(s);
    p.route.emplace_back();
  }
  for (int i = 0; i < n; ++i) {
    p.group_of[i] = group[shard_of[i]];
    p.members[p.group_of[i]].push_back(i);
  }
  return p;
}

std::vector<ShardHealth> Client::Health() {
  std::vector<ShardHealth> out(ring_.size());
  for (int s = 0; s < num_shards(); ++s) {
    grpc::health::v1::HealthCheckResponse resp;
    grpc::Status st = impl_->Run("Health", s, true, [&](grpc::ClientContext* ctx) {
      grpc::health::v1::HealthCheckRequest req;
      return impl_->health[s]->Check(ctx, req, &resp);
    });
    out[s].server = server(s);
    out[s].status = ToAbsl(st, server(s));
    out[s].serving = st.ok() && resp.status() == grpc::health::v1::HealthCheckResponse::SERVING;
  }
  return out;
}

absl::StatusOr<v1::StatsResponse> Client::Stats(int shard) {
  if (shard < 0 || shard >= num_shards()) return absl::InvalidArgumentError("no such shard");
  v1::StatsResponse resp;
  grpc::Status st = impl_->Run("Stats", shard, true, [&](grpc::ClientContext* ctx) {
    return impl_->stubs[shard]->Stats(ctx, v1::StatsRequest(), &resp);
  });
  if (!st.ok()) return ToAbsl(st, server(shard));
  return resp;
}

absl::StatusOr<v1::ListModelsResponse> Client::ListModels(int shard) {
  if (shard < 0 || shard >= num_shards()) return absl::InvalidArgumentError("no such shard");
  v1::ListModelsResponse resp;
  grpc::Status st = impl_->Run("ListModels", shard, true, [&](grpc::ClientContext* ctx) {
    return impl_->stubs[shard]->ListModels(ctx, v1::ListModelsRequest(), &resp);
  });
  if (!st.ok()) return ToAbsl(st, server(shard));
  return resp;
}

absl::StatusOr<v1::ModelInfo> Client::GetModel(const std::string& model, int version, int shard) {
  if (shard < 0 || shard >= num_shards()) return absl::InvalidArgumentError("no such shard");
  v1::GetModelRequest req;
  req.set_model(model);
  req.set_version(version);
  v1::ModelInfo resp;
  grpc::Status st = impl_->Run("GetModel", shard, true, [&](grpc::ClientContext* ctx) {
    return impl_->stubs[shard]->GetModel(ctx, req, &resp);
  });
  if (!st.ok()) return ToAbsl(st, server(shard));
  return resp;
}

absl::StatusOr<v1::RegisterBasisRequest> Client::GetBasis(const std::string& model, int version,
                                                          int shard) {
  if (shard < 0 || shard >= num_shards()) return absl::InvalidArgumentError("no such shard");
  v1::GetModelRequest req;
  req.set_model(model);
  req.set_version(version);
  v1::RegisterBasisRequest resp;
  grpc::Status st = impl_->Run("GetBasis", shard, true, [&](grpc::ClientContext* ctx) {
    return impl_->stubs[shard]->GetBasis(ctx, req, &resp);
  });
  if (!st.ok()) return ToAbsl(st, server(shard));
  return resp;
}

absl::StatusOr<v1::RegisterBasisResponse> Client::RegisterBasis(
    const v1::RegisterBasisRequest& req) {
  if (options_.router) {
    return absl::FailedPreconditionError(
        "RegisterBasis in router mode: the proxy would register the model on one shard only; "
        "register it on every shard directly (kvq --server shard1,shard2,... models register)");
  }
  std::vector<v1::RegisterBasisResponse> resps(num_shards());
  std::vector<grpc::Status> sts(num_shards());
  std::vector<std::thread> threads;
  for (int s = 0; s < num_shards(); ++s) {
    threads.emplace_back([&, s] {
      sts[s] = impl_->Run("RegisterBasis", s, true, [&](grpc::ClientContext* ctx) {
        return impl_->stubs[s]->RegisterBasis(ctx, req, &resps[s]);
      });
    });
  }
  for (auto& t : threads) t.join();
  for (int s = 0; s < num_shards(); ++s) {
    if (!sts[s].ok()) return ToAbsl(sts[s], server(s));
  }
  return resps[0];
}

absl::StatusOr<v1::PutBlocksResponse> Client::PutBlocks(
    const std::vector<v1::PutBlocksRequest>& msgs) {
  // Where every append goes (by shard, or by routing key in router mode).
  std::vector<const v1::Append*> appends;
  for (const v1::PutBlocksRequest& m : msgs) {
    for (const v1::Append& a : m.appends()) appends.push_back(&a);
  }
  const Placement place =
      Place([&](int i) -> std::string_view { return appends[i]->sequence_id(); },
            static_cast<int>(appends.size()));
  const int groups = std::max<int>(1, static_cast<int>(place.members.size()));
  // When every append goes to one place the messages are sent as they are (no copy: a
  // prefill can be hundreds of MiB); otherwise each message is split, order kept per group.
  std::vector<std::vector<v1::PutBlocksRequest>> parts;
  if (place.members.size() > 1) {
    parts.resize(groups);
    int i = 0;
    for (const v1::PutBlocksRequest& m : msgs) {
      std::vector<v1::PutBlocksRequest*> cur(groups, nullptr);
      for (const v1::Append& a : m.appends()) {
        const int g = place.group_of[i++];
        if (cur[g] == nullptr) cur[g] = &parts[g].emplace_back();
        *cur[g]->add_appends() = a;
      }
    }
  }
  std::vector<v1::PutBlocksResponse> resps(groups);
  std::vector<grpc::Status> sts(groups);
  ForEachParallel(groups, [&](int g) {
    const int s = place.members.empty() ? 0 : place.shard[g];
    const std::string route = place.members.empty() ? std::string() : place.route[g];
    const std::vector<v1::PutBlocksRequest>& src = parts.empty() ? msgs : parts[g];
    sts[g] = impl_->Run(
        "PutBlocks", s, true,
        [&](grpc::ClientContext* ctx) {
          resps[g].Clear();
          auto writer = impl_->stubs[s]->PutBlocks(ctx, &resps[g]);
          for (const v1::PutBlocksRequest& m : src) {
            if (!writer->Write(m)) break;  // the stream ended; Finish() says why
          }
          writer->WritesDone();
          return writer->Finish();
        },
        nullptr, route);
  });
  v1::PutBlocksResponse out;
  for (int g = 0; g < groups; ++g) {
    if (!sts[g].ok()) {
      return ToAbsl(sts[g], place.members.empty() ? impl_->Label(0, "")
                                                  : impl_->Label(place.shard[g], place.route[g]));
    }
    out.set_messages(out.messages() + resps[g].messages());
    out.set_appends(out.appends() + resps[g].appends());
    out.set_tokens_written(out.tokens_written() + resps[g].tokens_written());
    out.set_tokens_duplicate(out.tokens_duplicate() + resps[g].tokens_duplicate());
    out.set_tokens_shared(out.tokens_shared() + resps[g].tokens_shared());
    for (auto& l : *resps[g].mutable_lengths()) out.add_lengths()->Swap(&l);
  }
  return out;
}

template <class Req>
Client::Placement Client::PlaceItems(const Req& req) const {
  return Place([&](int i) -> std::string_view { return req.items(i).sequence_id(); },
               req.items_size());
}

absl::StatusOr<v1::ScoreResponse> Client::Score(const v1::ScoreRequest& req) {
  return impl_->Batched("Score", req, true, PlaceItems(req), &v1::Kvq::Stub::Score);
}

absl::StatusOr<v1::ReadoutResponse> Client::Readout(const v1::ReadoutRequest& req) {
  return impl_->Batched("Readout", req, true, PlaceItems(req), &v1::Kvq::Stub::Readout);
}

absl::StatusOr<v1::AttendResponse> Client::Attend(const v1::AttendRequest& req) {
  // Observing calls record A^2 statistics: a retry would count them twice.
  bool read_only = true;
  for (const v1::AttendItem& it : req.items()) {
    read_only = read_only && it.has_observe() && !it.observe();
  }
  return impl_->Batched("Attend", req, read_only, PlaceItems(req), &v1::Kvq::Stub::Attend);
}

namespace {

// PutBlocksStream's producer: a thread of its own calls `next` up to kAhead messages ahead of
// the writer, so that making a message (an encode) overlaps the transfer of the ones before
// even while the writer is blocked in flow control.
class MessagesAhead {
 public:
  static constexpr size_t kAhead = 8;
  explicit MessagesAhead(const std::function<absl::StatusOr<bool>(v1::PutBlocksRequest*)>& next)
      : thread_([this, &next] { Produce(next); }) {}
  ~MessagesAhead() {
    {
      std::lock_guard<std::mutex> l(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }
  // The next message (true), the end (false), or `next`'s error.
  absl::StatusOr<bool> Pop(v1::PutBlocksRequest* m) {
    std::unique_lock<std::mutex> l(mu_);
    cv_.wait(l, [this] { return !queue_.empty() || ended_; });
    if (queue_.empty()) {
      if (!status_.ok()) return status_;
      return false;
    }
    *m = std::move(queue_.front());
    queue_.pop_front();
    cv_.notify_all();
    return true;
  }

 private:
  void Produce(const std::function<absl::StatusOr<bool>(v1::PutBlocksRequest*)>& next) {
    for (;;) {
      v1::PutBlocksRequest m;
      absl::StatusOr<bool> more = next(&m);
      std::unique_lock<std::mutex> l(mu_);
      if (!more.ok() || !*more) {
        ended_ = true;
        status_ = more.status();
        cv_.notify_all();
        return;
      }
      cv_.wait(l, [this] { return queue_.size() < kAhead || stop_; });
      if (stop_) return;
      queue_.push_back(std::move(m));
      cv_.notify_all();
    }
  }

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<v1::PutBlocksRequest> queue_;
  bool ended_ = false, stop_ = false;
  absl::Status status_;
  std::thread thread_;  // last: starts once the members above exist
};

}  // namespace

absl::StatusOr<v1::PutBlocksResponse> Client::PutBlocksStream(
    const std::string& sequence_id,
    const std::function<absl::StatusOr<bool>(v1::PutBlocksRequest*)>& next) {
  const int s = ShardOf(sequence_id);
  const std::string route = options_.router ? RouteKey(sequence_id) : std::string();
  MessagesAhead ahead(next);
  std::vector<v1::PutBlocksRequest> made;  // for a retry
  bool ended = false;
  absl::Status failed;  // from `next` or a message of another sequence: not retried
  v1::PutBlocksResponse resp;
  grpc::Status st = impl_->Run(
      "PutBlocks", s, true,
      [&](grpc::ClientContext* ctx) {
        resp.Clear();
        auto writer = impl_->stubs[s]->PutBlocks(ctx, &resp);
        bool open = true;
        for (size_t i = 0; open && i < made.size(); ++i) open = writer->Write(made[i]);
        while (open && !ended) {
          v1::PutBlocksRequest m;
          absl::StatusOr<bool> more = ahead.Pop(&m);
          if (!more.ok() || !*more) {
            ended = true;
            failed = more.status();
            break;
          }
          for (const v1::Append& a : m.appends()) {
            if (a.sequence_id() != sequence_id) {
              ended = true;
              failed = absl::InvalidArgumentError(
                  absl::StrCat("PutBlocksStream: an append of sequence '", a.sequence_id(),
                               "' in a stream of '", sequence_id, "'"));
            }
          }
          if (!failed.ok()) break;
          open = writer->Write(m);  // the stream ended early when false: Finish() says why
          made.push_back(std::move(m));
        }
        if (!failed.ok()) {
          ctx->TryCancel();
          writer->Finish();
          return grpc::Status::OK;
        }
        writer->WritesDone();
        return writer->Finish();
      },
      nullptr, route);
  if (!failed.ok()) return failed;
  if (!st.ok()) return ToAbsl(st, impl_->Label(s, route));
  return resp;
}

absl::Status Client::GetBlocks(const v1::GetBlocksRequest& req,
                               const std::function<bool(const v1::GetBlocksResponse&)>& on_chunk) {
  const int s = ShardOf(req.sequence_id());
  const std::string route = options_.router ? RouteKey(req.sequence_id()) : std::string();
  bool received = false;
  grpc::Status st = impl_->Run(
      "GetBlocks", s, true,
      [&](grpc::ClientContext* ctx) {
        auto reader = impl_->stubs[s]->GetBlocks(ctx, req);
        v1::GetBlocksResponse chunk;
        while (reader->Read(&chunk)) {
          received = true;
          if (!on_chunk(chunk)) {
            ctx->TryCancel();
            reader->Finish();
            return grpc::Status::OK;
          }
        }
        return reader->Finish();
      },
      &received, route);
  return ToAbsl(st, impl_->Label(s, route));
}

absl::StatusOr<v1::DeleteSequenceResponse> Client::DeleteSequence(const std::string& sequence_id) {
  const int s = ShardOf(sequence_id);
  const std::string route = options_.router ? RouteKey(sequence_id) : std::string();
  v1::DeleteSequenceRequest req;
  req.set_sequence_id(sequence_id);
  v1::DeleteSequenceResponse resp;
  grpc::Status st = impl_->Run(
      "DeleteSequence", s, false,
      [&](grpc::ClientContext* ctx) { return impl_->stubs[s]->DeleteSequence(ctx, req, &resp); },
      nullptr, route);
  if (!st.ok()) return ToAbsl(st, impl_->Label(s, route));
  return resp;
}

absl::StatusOr<v1::MatchPrefixResponse> Client::MatchPrefix(const v1::MatchPrefixRequest& req) {
  const std::string first = req.sequence_ids().empty() ? std::string() : req.sequence_ids(0);
  const int s = ShardOf(first);
  const std::string route = options_.router ? RouteKey(first) : std::string();
  for (int i = 1; i < req.sequence_ids_size(); ++i) {
    const std::string& id = req.sequence_ids(i);
    if (ShardOf(id) != s || (options_.router && RouteKey(id) != route)) {
      return absl::InvalidArgumentError(
          absl::StrCat("sequence_ids[", i, "] '", id, "' is placed apart from sequence_ids[0] '",
                       first, "'; a MatchPrefix reaches one shard: give the sequences one {tag}"));
    }
  }
  v1::MatchPrefixResponse resp;
  grpc::Status st = impl_->Run(
      "MatchPrefix", s, true,
      [&](grpc::ClientContext* ctx) { return impl_->stubs[s]->MatchPrefix(ctx, req, &resp); },
      nullptr, route);
  if (!st.ok()) return ToAbsl(st, impl_->Label(s, route));
  return resp;
}

absl::StatusOr<std::string> Client::Echo(const std::string& payload, int shard) {
  if (shard < 0 || shard >= num_shards()) return absl::InvalidArgumentError("no such shard");
  v1::EchoRequest req;
  req.set_payload(payload);
  v1::EchoResponse resp;
  grpc::Status st = impl_->Run("Echo", shard, true, [&](grpc::ClientContext* ctx) {
    return impl_->stubs[shard]->Echo(ctx, req, &resp);
  });
  if (!st.ok()) return ToAbsl(st, server(shard));
  return std::move(*resp.mutable_payload());
}

}  // namespace kvq::client
