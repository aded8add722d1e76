#include "kvq/client/client.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <mutex>
#include <random>
#include <sstream>
#include <thread>

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

  void Prepare(grpc::ClientContext* ctx) const {
    ctx->set_deadline(absl::ToChronoTime(absl::Now() + opts.timeout));
    if (!opts.token.empty()) {
      ctx->AddMetadata("authorization", absl::StrCat("Bearer ", opts.token));
    } else if (!opts.tenant.empty()) {
      ctx->AddMetadata("x-kvq-tenant", opts.tenant);
    }
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
  template <class Fn>
  grpc::Status Run(std::string_view method, int shard, bool idempotent, Fn&& fn,
                   const bool* no_more_retries = nullptr) {
    const int attempts = idempotent ? std::max(1, opts.max_attempts) : 1;
    grpc::Status st;
    for (int a = 1; a <= attempts; ++a) {
      grpc::ClientContext ctx;
      Prepare(&ctx);
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

  // Splits a batched request by shard, runs the parts concurrently, merges the results.
  template <class Req, class Resp>
  absl::StatusOr<Resp> Batched(std::string_view method, const Req& req, bool idempotent,
                               const HashRing& ring, const std::string& tenant,
                               grpc::Status (v1::Kvq::Stub::*call)(grpc::ClientContext*, const Req&,
                                                                   Resp*)) {
    const int n = req.items_size();
    std::vector<int> shard_of(n);
    std::vector<std::vector<int>> by_shard(ring.size());
    for (int i = 0; i < n; ++i) {
      shard_of[i] = ring.ShardOf(tenant, req.items(i).sequence_id());
      by_shard[shard_of[i]].push_back(i);
    }
    std::vector<int> used;
    for (int s = 0; s < static_cast<int>(ring.size()); ++s) {
      if (!by_shard[s].empty()) used.push_back(s);
    }
    if (used.empty()) used.push_back(0);  // an empty batch: let the server judge it
    if (used.size() == 1) {
      const int s = used[0];
      Resp resp;
      grpc::Status st = Run(method, s, idempotent, [&](grpc::ClientContext* ctx) {
        resp.Clear();
        return (stubs[s].get()->*call)(ctx, req, &resp);
      });
      if (!st.ok()) return ToAbsl(st, ring.servers()[s]);
      if (resp.results_size() != n) {
        return absl::InternalError(absl::StrCat(std::string(method), ": server ", ring.servers()[s],
                                                " returned ", resp.results_size(), " results for ",
                                                n, " items"));
      }
      return resp;
    }
    std::vector<Req> parts(ring.size());
    std::vector<Resp> answers(ring.size());
    std::vector<grpc::Status> statuses(ring.size());
    for (int s : used) {
      for (int i : by_shard[s]) *parts[s].add_items() = req.items(i);
    }
    auto run_shard = [&](int s) {
      statuses[s] = Run(method, s, idempotent, [&](grpc::ClientContext* ctx) {
        answers[s].Clear();
        return (stubs[s].get()->*call)(ctx, parts[s], &answers[s]);
      });
      if (statuses[s].ok() && answers[s].results_size() != parts[s].items_size()) {
        statuses[s] = grpc::Status(grpc::StatusCode::INTERNAL,
                                   absl::StrCat("returned ", answers[s].results_size(),
                                                " results for ", parts[s].items_size(), " items"));
      }
    };
    std::vector<std::thread> threads;
    for (size_t k = 1; k < used.size(); ++k) threads.emplace_back(run_shard, used[k]);
    run_shard(used[0]);
    for (auto& t : threads) t.join();

    int failed = 0;
    for (int s : used) failed += statuses[s].ok() ? 0 : 1;
    if (failed == static_cast<int>(used.size()))
      return ToAbsl(statuses[used[0]], ring.servers()[used[0]]);
    Resp out;
    std::vector<int> next(ring.size(), 0);
    for (int i = 0; i < n; ++i) {
      const int s = shard_of[i];
      auto* r = out.add_results();
      if (statuses[s].ok()) {
        r->Swap(answers[s].mutable_results(next[s]++));
      } else {
        r->mutable_status()->set_code(statuses[s].error_code());
        r->mutable_status()->set_message(
            absl::StrCat("server ", ring.servers()[s], ": ", statuses[s].error_message()));
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
      impl_(std::move(impl)) {}

Client::~Client() = default;

int Client::ShardOf(std::string_view sequence_id) const {
  return ring_.ShardOf(shard_tenant_, sequence_id);
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

absl::StatusOr<v1::RegisterBasisResponse> Client::RegisterBasis(
    const v1::RegisterBasisRequest& req) {
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
  const int n = num_shards();
  // Where every append goes; when they all go to one shard the messages are sent as they
  // are (no copy: a prefill can be hundreds of MiB).
  int only = -1;
  bool single = true;
  for (const v1::PutBlocksRequest& m : msgs) {
    for (const v1::Append& a : m.appends()) {
      const int s = n == 1 ? 0 : ShardOf(a.sequence_id());
      if (only == -1) only = s;
      single = single && s == only;
    }
  }
  std::vector<std::vector<v1::PutBlocksRequest>> parts(n);
  std::vector<const std::vector<v1::PutBlocksRequest>*> src(n, nullptr);
  if (single) {
    src[only < 0 ? 0 : only] = &msgs;
  } else {
    for (const v1::PutBlocksRequest& m : msgs) {
      std::vector<v1::PutBlocksRequest*> cur(n, nullptr);
      for (const v1::Append& a : m.appends()) {
        const int s = ShardOf(a.sequence_id());
        if (cur[s] == nullptr) cur[s] = &parts[s].emplace_back();
        *cur[s]->add_appends() = a;
      }
    }
    for (int s = 0; s < n; ++s) {
      if (!parts[s].empty()) src[s] = &parts[s];
    }
  }
  std::vector<v1::PutBlocksResponse> resps(n);
  std::vector<grpc::Status> sts(n);
  auto run_shard = [&](int s) {
    sts[s] = impl_->Run("PutBlocks", s, true, [&](grpc::ClientContext* ctx) {
      resps[s].Clear();
      auto writer = impl_->stubs[s]->PutBlocks(ctx, &resps[s]);
      for (const v1::PutBlocksRequest& m : *src[s]) {
        if (!writer->Write(m)) break;  // the stream ended; Finish() says why
      }
      writer->WritesDone();
      return writer->Finish();
    });
  };
  std::vector<int> used;
  for (int s = 0; s < n; ++s) {
    if (src[s] != nullptr) used.push_back(s);
  }
  std::vector<std::thread> threads;
  for (size_t k = 1; k < used.size(); ++k) threads.emplace_back(run_shard, used[k]);
  run_shard(used[0]);
  for (auto& t : threads) t.join();
  v1::PutBlocksResponse out;
  for (int s : used) {
    if (!sts[s].ok()) return ToAbsl(sts[s], server(s));
    out.set_messages(out.messages() + resps[s].messages());
    out.set_appends(out.appends() + resps[s].appends());
    out.set_tokens_written(out.tokens_written() + resps[s].tokens_written());
    out.set_tokens_duplicate(out.tokens_duplicate() + resps[s].tokens_duplicate());
    out.set_tokens_shared(out.tokens_shared() + resps[s].tokens_shared());
    for (auto& l : *resps[s].mutable_lengths()) out.add_lengths()->Swap(&l);
  }
  return out;
}

absl::StatusOr<v1::ScoreResponse> Client::Score(const v1::ScoreRequest& req) {
  return impl_->Batched("Score", req, true, ring_, shard_tenant_, &v1::Kvq::Stub::Score);
}

absl::StatusOr<v1::ReadoutResponse> Client::Readout(const v1::ReadoutRequest& req) {
  return impl_->Batched("Readout", req, true, ring_, shard_tenant_, &v1::Kvq::Stub::Readout);
}

absl::StatusOr<v1::AttendResponse> Client::Attend(const v1::AttendRequest& req) {
  // Observing calls record A^2 statistics: a retry would count them twice.
  bool read_only = true;
  for (const v1::AttendItem& it : req.items()) {
    read_only = read_only && it.has_observe() && !it.observe();
  }
  return impl_->Batched("Attend", req, read_only, ring_, shard_tenant_, &v1::Kvq::Stub::Attend);
}

absl::Status Client::GetBlocks(const v1::GetBlocksRequest& req,
                               const std::function<bool(const v1::GetBlocksResponse&)>& on_chunk) {
  const int s = ShardOf(req.sequence_id());
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
      &received);
  return ToAbsl(st, server(s));
}

absl::StatusOr<v1::DeleteSequenceResponse> Client::DeleteSequence(const std::string& sequence_id) {
  const int s = ShardOf(sequence_id);
  v1::DeleteSequenceRequest req;
  req.set_sequence_id(sequence_id);
  v1::DeleteSequenceResponse resp;
  grpc::Status st = impl_->Run("DeleteSequence", s, false, [&](grpc::ClientContext* ctx) {
    return impl_->stubs[s]->DeleteSequence(ctx, req, &resp);
  });
  if (!st.ok()) return ToAbsl(st, server(s));
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
