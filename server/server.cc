#include "server/server.h"

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <fstream>
#include <limits>
#include <optional>
#include <sstream>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/grpcpp.h"
#include "kvq/core/memory_pool.h"
#include "kvq/core/status.h"
#include "kvq/core/store.h"
#include "kvq/core/worker_pool.h"
#include "kvq/kernels/device.h"
#include "kvq/kernels/kernels.h"
#include "server/auth.h"
#include "server/health.h"
#include "server/metrics.h"
#include "server/probe_gap.h"
#include "server/service.h"

namespace kvq::server {
namespace {

void Log(const std::string& line) { std::fprintf(stderr, "kvq-server: %s\n", line.c_str()); }

absl::StatusOr<std::string> ReadFile(const std::string& path, const char* what) {
  std::ifstream f(path, std::ios::binary);
  if (!f) return absl::NotFoundError(absl::StrCat("cannot read ", what, " ", path));
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

absl::Status CheckRange(const char* flag, int64_t v, int64_t lo, int64_t hi) {
  if (v >= lo && v <= hi) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(flag, " ", v, " must be in ", lo, "..", hi));
}

absl::Status CheckDuration(const char* flag, absl::Duration d) {
  if (d >= absl::ZeroDuration() && d != absl::InfiniteDuration()) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat(flag, " ", absl::FormatDuration(d), " must be finite and >= 0"));
}

}  // namespace

absl::Status ValidateOptions(const ServerOptions& o) {
  constexpr int64_t kMax = std::numeric_limits<int64_t>::max();
  RETURN_IF_ERROR(CheckRange("--grpc-port", o.grpc_port, 0, 65535));
  RETURN_IF_ERROR(CheckRange("--metrics-port", o.metrics_port, -1, 65535));
  RETURN_IF_ERROR(CheckRange("--workers", o.workers, 0, 1024));
  RETURN_IF_ERROR(CheckRange("--split-attend-min-tokens", o.split_attend_min_tokens, 0, kMax));
  RETURN_IF_ERROR(CheckRange("--worker-poll-us", o.worker_poll_us, 0, 10000));
  RETURN_IF_ERROR(CheckRange("--max-inflight", o.max_inflight, 0, 1000000));
  RETURN_IF_ERROR(CheckRange("--max-inflight-per-client", o.max_inflight_per_client, -1, 1000000));
  // Below 64 KiB hardly a registration or a prefill fits; gRPC's limit is an int.
  RETURN_IF_ERROR(CheckRange("--max-message-bytes", o.max_message_bytes, 64 << 10, INT32_MAX));
  RETURN_IF_ERROR(CheckRange("--capacity", o.capacity_bytes, 0, kMax));
  RETURN_IF_ERROR(CheckRange("--tenant-quota", o.tenant_quota_bytes, 0, kMax));
  RETURN_IF_ERROR(CheckDuration("--sequence-ttl", o.ttl));
  RETURN_IF_ERROR(CheckDuration("--shutdown-grace", o.shutdown_grace));
  RETURN_IF_ERROR(CheckDuration("--scrub-period", o.scrub_period));
  if (o.stream_idle_timeout != absl::ZeroDuration() &&
      (o.stream_idle_timeout < absl::Milliseconds(1) || o.stream_idle_timeout > absl::Hours(24))) {
    return absl::InvalidArgumentError(absl::StrCat("--stream-idle-timeout ",
                                                   absl::FormatDuration(o.stream_idle_timeout),
                                                   " must be 0 (never) or in 1ms..24h"));
  }
  if (o.drop_after_probe_gap != absl::ZeroDuration() &&
      (o.drop_after_probe_gap < absl::Milliseconds(10) ||
       o.drop_after_probe_gap > absl::Hours(1))) {
    return absl::InvalidArgumentError(absl::StrCat("--drop-after-probe-gap ",
                                                   absl::FormatDuration(o.drop_after_probe_gap),
                                                   " must be 0 (off) or in 10ms..1h"));
  }
  if (o.housekeeping_period <= absl::ZeroDuration() ||
      o.housekeeping_period == absl::InfiniteDuration()) {
    return absl::InvalidArgumentError("the housekeeping period must be finite and > 0");
  }
  return absl::OkStatus();
}

struct KvqServer::Impl {
  ServerOptions opts;
  std::string pool_name = "host";
  std::unique_ptr<core::Registry> registry;
  std::unique_ptr<core::Store> store;
  Authenticator auth;
  std::unique_ptr<Metrics> metrics;
  std::unique_ptr<ProbeGapWatch> probe_gap;  // with --drop-after-probe-gap
  std::unique_ptr<core::WorkerPool> pool;
  std::unique_ptr<Service> service;
  std::unique_ptr<HealthService> health;
  std::unique_ptr<grpc::Server> server;
  std::atomic<bool> ready{false};
  int grpc_port = 0, metrics_port = -1;
  std::thread housekeeping;
  absl::Mutex mu;
  bool stopping ABSL_GUARDED_BY(mu) = false;
  bool shut_down = false;

  absl::Status Start();
  void Housekeeping();
  // A router's probe (metrics.h); true: the store was dropped, answer 503.
  bool RouterProbe(const std::string& prober);
};

absl::Status KvqServer::Impl::Start() {
  RETURN_IF_ERROR(ValidateOptions(opts));
  core::StoreOptions so = opts;  // the embedded store options, with the serving defaults:
  if (so.byte_pool == nullptr) {
    ASSIGN_OR_RETURN(core::MemoryPoolChoice memory,
                     core::ChooseMemoryPool(opts.memory, "--memory"));
    RETURN_IF_ERROR(core::ChooseAttend(opts.attend, "--attend", &memory));
    so.byte_pool = memory.pool;
    if (so.attend_backend == nullptr) so.attend_backend = memory.backend;
    Log(absl::StrCat("memory: ", memory.explanation));
  }
  // A pool the CPU does not read is device memory, or the stand-in of it a test gives.
  pool_name = so.byte_pool->cpu_readable() ? kernels::PoolName(so.byte_pool->pool()) : "gpu";
  if (opts.byte_pool != nullptr) {
    Log(absl::StrCat(
        "memory: ", pool_name, " (given)",
        so.attend_backend ? absl::StrCat("; attend: ", so.attend_backend->name()) : ""));
  }
  so.capacity_bytes = core::CapacityOrDefault(so.capacity_bytes);

  absl::StatusOr<Authenticator> a = Authenticator::Load(opts.auth_tokens_file, opts.admin_tenants);
  if (!a.ok()) return a.status();
  auth = *std::move(a);

  registry = std::make_unique<core::Registry>(opts.registry_dir);
  store = std::make_unique<core::Store>(so, registry.get());
  const int workers =
      opts.workers > 0 ? opts.workers : std::max(1u, std::thread::hardware_concurrency());
  pool = std::make_unique<core::WorkerPool>(workers, opts.worker_poll_us);
  metrics = std::make_unique<Metrics>();
  if (opts.drop_after_probe_gap > absl::ZeroDuration()) {
    probe_gap = std::make_unique<ProbeGapWatch>(opts.drop_after_probe_gap, opts.now);
    metrics->SetProbeHook([this](const std::string& prober) { return RouterProbe(prober); });
  }
  if (opts.metrics_port >= 0) {
    try {
      metrics_port = metrics->Expose(opts.metrics_address, opts.metrics_port);
    } catch (const std::exception& e) {
      return absl::UnavailableError(absl::StrCat("cannot serve metrics on ", opts.metrics_address,
                                                 ":", opts.metrics_port, ": ", e.what()));
    }
  }
  // The CPU kernels, after the attend backend that serves Attend's encoded blocks, if any
  // ("cuda+avx512").
  const std::string backend = absl::StrCat(
      so.attend_backend ? absl::StrCat(so.attend_backend->name(), "+") : "", kernels::Best().name);
  CallGate::Options calls;
  calls.auth = &auth;
  calls.metrics = metrics.get();
  calls.ready = &ready;
  calls.max_inflight = opts.max_inflight;
  calls.max_inflight_per_client =
      opts.max_inflight_per_client >= 0
          ? opts.max_inflight_per_client
          : (opts.max_inflight > 0 ? std::max(1, opts.max_inflight / 4) : 0);
  calls.log_calls = opts.log_calls;
  ServiceOptions service_opts;
  service_opts.store = store.get();
  service_opts.registry = registry.get();
  service_opts.pool = pool.get();
  service_opts.calls = calls;
  service_opts.pool_name = pool_name;
  service_opts.backend_name = backend;
  service_opts.stream_idle_timeout = opts.stream_idle_timeout;
  service_opts.split_attend_min_tokens = opts.split_attend_min_tokens;
  service_opts.split_metrics = metrics.get();
  service = std::make_unique<Service>(std::move(service_opts));

  std::shared_ptr<grpc::ServerCredentials> creds;
  if (!opts.tls_cert.empty() || !opts.tls_key.empty()) {
    if (opts.tls_cert.empty() || opts.tls_key.empty()) {
      return absl::InvalidArgumentError("--tls-cert and --tls-key go together");
    }
    absl::StatusOr<std::string> cert = ReadFile(opts.tls_cert, "--tls-cert");
    if (!cert.ok()) return cert.status();
    absl::StatusOr<std::string> key = ReadFile(opts.tls_key, "--tls-key");
    if (!key.ok()) return key.status();
    grpc::SslServerCredentialsOptions ssl(
        opts.tls_client_ca.empty() ? GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE
                                   : GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
    if (!opts.tls_client_ca.empty()) {
      absl::StatusOr<std::string> ca = ReadFile(opts.tls_client_ca, "--tls-client-ca");
      if (!ca.ok()) return ca.status();
      ssl.pem_root_certs = *ca;
    }
    ssl.pem_key_cert_pairs.push_back({*key, *cert});
    creds = grpc::SslServerCredentials(ssl);
  } else if (!opts.tls_client_ca.empty()) {
    return absl::InvalidArgumentError("--tls-client-ca needs --tls-cert and --tls-key");
  } else {
    creds = grpc::InsecureServerCredentials();
  }

  // Health: the whole server ("") and kvq.v1.Kvq by name, NOT_SERVING from the first call
  // on (gRPC's default health service would say SERVING as soon as the server starts).
  health = std::make_unique<HealthService>(std::vector<std::string>{v1::Kvq::service_full_name()});
  grpc::EnableDefaultHealthCheckService(false);
  if (opts.reflection) grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  builder.AddListeningPort(absl::StrCat(opts.grpc_address, ":", opts.grpc_port), creds, &grpc_port);
  builder.RegisterService(service.get());
  builder.RegisterService(health.get());
  const int limit = static_cast<int>(opts.max_message_bytes);
  builder.SetMaxReceiveMessageSize(limit);
  builder.SetMaxSendMessageSize(limit);
  // gRPC sets SO_REUSEPORT on Linux by default: a second server on a port in use would then
  // start and take part of the connections. The port must be ours alone.
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  server = builder.BuildAndStart();
  if (!server || grpc_port == 0) {
    return absl::UnavailableError(absl::StrCat("cannot listen on ", opts.grpc_address, ":",
                                               opts.grpc_port,
                                               " (the port is in use, or the address is not "
                                               "this machine's)"));
  }
  if (opts.on_listening) opts.on_listening(grpc_port);

  std::vector<std::string> loaded, skipped;
  absl::Status st = registry->LoadAll(&loaded, &skipped);
  if (!st.ok()) return st;
  for (const auto& s : skipped) Log(absl::StrCat("registry: skipped ", s));
  Log(absl::StrCat("registry: ", opts.registry_dir.empty() ? "(memory only)" : opts.registry_dir,
                   ", ", loaded.size(), " entries",
                   loaded.empty() ? "" : absl::StrCat(": ", absl::StrJoin(loaded, ", "))));
  Log(absl::StrCat(
      "compute backend: ", backend, "; workers: ", workers,
      opts.worker_poll_us > 0 ? absl::StrCat(" (polling ", opts.worker_poll_us, " us)") : "",
      "; split attend: ",
      opts.split_attend_min_tokens > 0
          ? absl::StrCat("layers >= ", opts.split_attend_min_tokens, " tokens on idle workers")
          : "off",
      "; max in flight: ", opts.max_inflight ? absl::StrCat(opts.max_inflight) : "unlimited",
      " (per client: ",
      calls.max_inflight_per_client ? absl::StrCat(calls.max_inflight_per_client) : "unlimited",
      ")", "; capacity: ", so.capacity_bytes, " bytes",
      opts.capacity_bytes > 0 ? "" : " (auto: half the physical memory)",
      so.tenant_quota_bytes ? absl::StrCat("; tenant quota: ", so.tenant_quota_bytes) : "",
      "; prefixes retained: ", so.retain_prefixes ? "yes" : "no"));
  Log(absl::StrCat(
      "auth: ",
      auth.enabled() ? absl::StrCat("bearer tokens (", auth.tokens(), ")")
                     : "off (tenant from x-kvq-tenant; development only)",
      "; tls: ", opts.tls_cert.empty() ? "off" : (opts.tls_client_ca.empty() ? "on" : "mutual")));
  ready.store(true, std::memory_order_release);
  health->SetServing(true);  // "" and kvq.v1.Kvq
  metrics->SetReady(true);
  metrics->Refresh(*store, *registry, pool_name.c_str());
  Log(absl::StrCat("serving gRPC on ", opts.grpc_address, ":", grpc_port, "; metrics ",
                   metrics_port >= 0
                       ? absl::StrCat("on ", opts.metrics_address, ":", metrics_port, "/metrics")
                       : std::string("off")));
  housekeeping = std::thread([this] { Housekeeping(); });
  return absl::OkStatus();
}

bool KvqServer::Impl::RouterProbe(const std::string& prober) {
  const std::optional<absl::Duration> gap = probe_gap->Probe(prober);
  if (!gap) return false;
  const core::Store::Dropped d = store->DropAll();
  metrics->RecordProbeGapDrop(d.sequences);
  Log(absl::StrCat("router probe from ", prober, " after ", absl::FormatDuration(*gap),
                   " without one (--drop-after-probe-gap ",
                   absl::FormatDuration(opts.drop_after_probe_gap),
                   "): the router may have moved this shard's keys meanwhile; dropped every "
                   "sequence (",
                   d.sequences, ", ", d.bytes,
                   " bytes with the prefix groups, all tenants) and answered the probe 503"));
  return true;
}

void KvqServer::Impl::Housekeeping() {
  absl::Time next_scrub = absl::Now() + opts.scrub_period;
  for (;;) {
    {
      absl::MutexLock l(&mu);
      auto stop = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) { return stopping; };
      if (mu.AwaitWithTimeout(absl::Condition(&stop), opts.housekeeping_period)) return;
    }
    store->Sweep();
    if (opts.scrub_period > absl::ZeroDuration() && absl::Now() >= next_scrub) {
      const int64_t bad = store->Scrub();
      if (bad) Log(absl::StrCat("scrub: ", bad, " sequences failed their checksums"));
      metrics->RecordScrubFailures(bad);
      next_scrub = absl::Now() + opts.scrub_period;
    }
    metrics->Refresh(*store, *registry, pool_name.c_str());
  }
}

KvqServer::KvqServer(ServerOptions opts) : impl_(std::make_unique<Impl>()) {
  impl_->opts = std::move(opts);
}

KvqServer::~KvqServer() { Shutdown(); }

absl::Status KvqServer::Start() { return impl_->Start(); }

void KvqServer::Shutdown() {
  Impl& s = *impl_;
  if (s.shut_down) return;
  s.shut_down = true;
  s.ready.store(false);
  if (s.metrics) s.metrics->SetReady(false);  // /healthz answers 503 while draining
  if (s.server) {
    s.health->Shutdown();
    // Drain: new calls are refused with UNAVAILABLE while in-flight ones (their work is on
    // the pool, still running) finish, for at most the grace period. Then gRPC shuts down at
    // once: it would otherwise also wait for idle client connections to go away.
    const bool drained = s.service->Drain(s.opts.shutdown_grace);
    if (!drained) Log("shutdown: grace period over; cancelling the calls still in flight");
    s.server->Shutdown(std::chrono::system_clock::now() + std::chrono::milliseconds(100));
  }
  {
    absl::MutexLock l(&s.mu);
    s.stopping = true;
  }
  if (s.housekeeping.joinable()) s.housekeeping.join();
  if (s.server) s.server->Wait();
  s.pool.reset();  // drains
}

int KvqServer::grpc_port() const { return impl_->grpc_port; }
int KvqServer::metrics_port() const { return impl_->metrics_port; }
core::Store& KvqServer::store() { return *impl_->store; }
core::Registry& KvqServer::registry() { return *impl_->registry; }

}  // namespace kvq::server
