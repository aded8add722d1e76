#include "server/metrics.h"

#include <cstring>

#include "CivetServer.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "civetweb.h"
#include "kvq/core/attend_backend.h"
#include "kvq/core/store.h"

namespace kvq::server {
namespace {
using prometheus::BuildCounter;
using prometheus::BuildGauge;
using prometheus::BuildHistogram;

// /metrics: connections served at once, and how long one may take to send its request (or
// read a chunk of the answer) before it is dropped.
constexpr int kMetricsThreads = 16;
constexpr int kMetricsReadTimeoutMs = 2000;

// /healthz. prometheus-cpp's Exposer keeps its CivetServer to itself and serves only
// collectables, so the check is answered from civetweb's begin_request callback, which sees
// every request before the Exposer's handlers. A callback is a plain function: it finds the
// Metrics of its server by the listening port the request came in on (several servers may
// run in one process, as in the tests). Until a port is registered (between the Exposer's
// start and Expose's return) it answers 503.
absl::Mutex health_mu(absl::kConstInit);
absl::flat_hash_map<int, const Metrics*>& HealthByPort() ABSL_EXCLUSIVE_LOCKS_REQUIRED(health_mu) {
  static auto* m = new absl::flat_hash_map<int, const Metrics*>();
  return *m;
}

int HealthzRequest(mg_connection* conn) {
  const mg_request_info* info = mg_get_request_info(conn);
  if (info == nullptr || info->local_uri == nullptr ||
      std::strcmp(info->local_uri, "/healthz") != 0) {
    return 0;  // not ours: the Exposer's handlers (/metrics) or civetweb's 404
  }
  const bool head =
      info->request_method != nullptr && std::strcmp(info->request_method, "HEAD") == 0;
  const bool get = info->request_method != nullptr && std::strcmp(info->request_method, "GET") == 0;
  const Metrics* metrics = nullptr;
  {
    absl::MutexLock l(&health_mu);
    auto it = HealthByPort().find(info->server_port);
    if (it != HealthByPort().end()) metrics = it->second;
  }
  // Outside health_mu: the hook may drop the whole store. The Metrics outlives this call (its
  // destructor stops civetweb, which waits for this thread, before its members go).
  bool serving = metrics != nullptr && metrics->ready();
  const char* probe = mg_get_header(conn, "X-Kvq-Probe");
  if (metrics != nullptr && probe != nullptr && (get || head) &&
      metrics->OnProbe(absl::StrCat(info->remote_addr, " ", probe))) {
    serving = false;
  }
  const char* body = !get && !head ? "method not allowed\n"
                     : serving     ? "SERVING\n"
                                   : "NOT_SERVING\n";
  const int code = !get && !head ? 405 : serving ? 200 : 503;
  const char* reason = code == 200   ? "OK"
                       : code == 503 ? "Service Unavailable"
                                     : "Method Not Allowed";
  mg_printf(conn,
            "HTTP/1.1 %d %s\r\nContent-Type: text/plain\r\nContent-Length: %zu\r\n"
            "Cache-Control: no-store\r\nConnection: close\r\n\r\n",
            code, reason, std::strlen(body));
  if (!head) mg_write(conn, body, std::strlen(body));
  return code;
}

// gRPC's codes are Abseil's: the canonical names come from absl.
std::string CodeName(int code) {
  std::string name = absl::StatusCodeToString(static_cast<absl::StatusCode>(code));
  return name.empty() ? "UNKNOWN" : name;
}
}  // namespace

Metrics::Metrics()
    : registry_(std::make_shared<prometheus::Registry>()),
      requests_(BuildCounter()
                    .Name("kvq_requests_total")
                    .Help("gRPC calls by method and status code")
                    .Register(*registry_)),
      latency_(BuildHistogram()
                   .Name("kvq_request_duration_seconds")
                   .Help("Call latency from arrival to finish, by method")
                   .Register(*registry_)),
      bytes_in_(BuildCounter()
                    .Name("kvq_received_bytes_total")
                    .Help("Request message bytes by method")
                    .Register(*registry_)),
      bytes_out_(BuildCounter()
                     .Name("kvq_sent_bytes_total")
                     .Help("Response message bytes by method")
                     .Register(*registry_)),
      stored_bytes_(BuildGauge()
                        .Name("kvq_stored_bytes")
                        .Help("Bytes stored (codes, full-precision window, token hashes)")
                        .Register(*registry_)),
      stored_blocks_(BuildGauge()
                         .Name("kvq_stored_blocks")
                         .Help("Encoded blocks stored (per KV head, K and V)")
                         .Register(*registry_)),
      capacity_(BuildGauge()
                    .Name("kvq_capacity_bytes")
                    .Help("Capacity limit of the store (0: unlimited)")
                    .Register(*registry_)),
      pool_bytes_(BuildGauge()
                      .Name("kvq_memory_pool_bytes")
                      .Help("Block memory pool: requested, held (size classes), reserved "
                            "(slabs), fallback (host memory because the pool refused)")
                      .Register(*registry_)),
      k_bits_(BuildGauge()
                  .Name("kvq_key_bits_per_element")
                  .Help("Effective key bits per element, window and fp16 sink rows included")
                  .Register(*registry_)
                  .Add({})),
      v_bits_(BuildGauge()
                  .Name("kvq_value_bits_per_element")
                  .Help("Effective value bits per element, window and fp16 sink rows included")
                  .Register(*registry_)
                  .Add({})),
      tokens_(BuildGauge()
                  .Name("kvq_cached_tokens")
                  .Help("Cached tokens (per head) over all layers and sequences")
                  .Register(*registry_)
                  .Add({})),
      sequences_(
          BuildGauge().Name("kvq_sequences").Help("Live sequences").Register(*registry_).Add({})),
      evictions_(BuildCounter()
                     .Name("kvq_evictions_total")
                     .Help("Sequences evicted to make room (LRU)")
                     .Register(*registry_)
                     .Add({})),
      expirations_(BuildCounter()
                       .Name("kvq_expirations_total")
                       .Help("Sequences dropped after the TTL")
                       .Register(*registry_)
                       .Add({})),
      scrub_failures_(BuildCounter()
                          .Name("kvq_scrub_failures_total")
                          .Help("Sequences that failed a background checksum scrub")
                          .Register(*registry_)
                          .Add({})),
      tenant_bytes_(BuildGauge()
                        .Name("kvq_tenant_stored_bytes")
                        .Help("Bytes stored per tenant")
                        .Register(*registry_)),
      tenant_sequences_(BuildGauge()
                            .Name("kvq_tenant_sequences")
                            .Help("Live sequences per tenant")
                            .Register(*registry_)),
      tenant_tokens_(BuildGauge()
                         .Name("kvq_tenant_cached_tokens")
                         .Help("Cached tokens per tenant")
                         .Register(*registry_)),
      prefix_blocks_(BuildGauge()
                         .Name("kvq_prefix_blocks")
                         .Help("Groups in the prefix index (stored once per tenant)")
                         .Register(*registry_)
                         .Add({})),
      prefix_bytes_(BuildGauge()
                        .Name("kvq_prefix_bytes")
                        .Help("Bytes of the prefix index, included in kvq_stored_bytes")
                        .Register(*registry_)
                        .Add({})),
      prefix_retained_bytes_(BuildGauge()
                                 .Name("kvq_prefix_retained_bytes")
                                 .Help("Prefix-index bytes held by no live sequence")
                                 .Register(*registry_)
                                 .Add({})),
      prefix_shared_tokens_(BuildCounter()
                                .Name("kvq_prefix_shared_tokens_total")
                                .Help("Tokens taken from the prefix index instead of encoded")
                                .Register(*registry_)
                                .Add({})),
      models_(BuildGauge()
                  .Name("kvq_models")
                  .Help("Registry entries (model versions) loaded")
                  .Register(*registry_)
                  .Add({})),
      ready_(BuildGauge()
                 .Name("kvq_ready")
                 .Help("1 once the registry is loaded and the service is SERVING")
                 .Register(*registry_)
                 .Add({})),
      rejected_overload_(BuildCounter()
                             .Name("kvq_rejected_total")
                             .Help("Calls refused before any work, by reason")
                             .Register(*registry_)
                             .Add({{"reason", "overload"}})),
      rejected_client_limit_(BuildCounter()
                                 .Name("kvq_rejected_total")
                                 .Help("Calls refused before any work, by reason")
                                 .Register(*registry_)
                                 .Add({{"reason", "client_limit"}})),
      probe_gap_drops_(BuildCounter()
                           .Name("kvq_probe_gap_drops_total")
                           .Help("Times every sequence was dropped because a router's health "
                                 "probe came after a gap over --drop-after-probe-gap")
                           .Register(*registry_)
                           .Add({})),
      probe_gap_dropped_sequences_(BuildCounter()
                                       .Name("kvq_probe_gap_dropped_sequences_total")
                                       .Help("Sequences dropped after gaps in a router's probes")
                                       .Register(*registry_)
                                       .Add({})),
      attend_split_(BuildCounter()
                        .Name("kvq_attend_split_total")
                        .Help("Attend items split across idle workers (--split-attend-min-tokens)")
                        .Register(*registry_)
                        .Add({})),
      attend_backend_calls_(BuildCounter()
                                .Name("kvq_attend_backend_calls_total")
                                .Help("Attends whose encoded blocks the attend backend served")
                                .Register(*registry_)),
      backend_block_ops_(BuildCounter()
                             .Name("kvq_backend_block_ops_total")
                             .Help("Encodes, scores, readouts and decodes of device blocks the "
                                   "attend backend ran where they lie")
                             .Register(*registry_)),
      copy_back_bytes_(BuildCounter()
                           .Name("kvq_block_copy_back_bytes_total")
                           .Help("Block bytes copied out of device memory for CPU reads")
                           .Register(*registry_)
                           .Add({})) {}

int Metrics::Expose(const std::string& address, int port) {
  // civetweb gives each connection a worker thread until its request arrives, for as long as
  // request_timeout_ms (30 s by default) per read: with the default 2 threads, two idle
  // connections blocked every scrape. More threads and a short timeout keep /metrics served
  // while a few peers are slow or silent (a scrape's request arrives at once).
  // civetweb copies the callbacks at start.
  CivetCallbacks callbacks;
  callbacks.begin_request = &HealthzRequest;
  exposer_ = std::make_unique<prometheus::Exposer>(
      std::vector<std::string>{"listening_ports", absl::StrCat(address, ":", port), "num_threads",
                               absl::StrCat(kMetricsThreads), "request_timeout_ms",
                               absl::StrCat(kMetricsReadTimeoutMs)},
      &callbacks);
  exposer_->RegisterCollectable(registry_);
  auto ports = exposer_->GetListeningPorts();
  const int bound = ports.empty() ? port : ports[0];
  absl::MutexLock l(&health_mu);
  HealthByPort()[bound] = this;
  exposed_port_ = bound;
  return bound;
}

Metrics::~Metrics() {
  {
    absl::MutexLock l(&health_mu);
    auto it = HealthByPort().find(exposed_port_);
    if (it != HealthByPort().end() && it->second == this) HealthByPort().erase(it);
  }
  exposer_.reset();  // stops civetweb (its threads) before the members go
}

void Metrics::RecordCall(const std::string& method, int code, double seconds, size_t bytes_in,
                         size_t bytes_out) {
  requests_.Add({{"method", method}, {"code", CodeName(code)}}).Increment();
  static const prometheus::Histogram::BucketBoundaries kBuckets = {
      0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025,
      0.05,   0.1,     0.25,   0.5,   1,      2.5,   5,    10};
  latency_.Add({{"method", method}}, kBuckets).Observe(seconds);
  bytes_in_.Add({{"method", method}}).Increment(static_cast<double>(bytes_in));
  bytes_out_.Add({{"method", method}}).Increment(static_cast<double>(bytes_out));
}

void Metrics::RecordScrubFailures(int64_t n) { scrub_failures_.Increment(static_cast<double>(n)); }

void Metrics::RecordOverload() { rejected_overload_.Increment(); }
void Metrics::RecordClientLimit() { rejected_client_limit_.Increment(); }

void Metrics::RecordProbeGapDrop(int64_t sequences) {
  probe_gap_drops_.Increment();
  probe_gap_dropped_sequences_.Increment(static_cast<double>(sequences));
}
void Metrics::RecordAttendSplit() { attend_split_.Increment(); }

void Metrics::SetReady(bool ready) {
  serving_.store(ready, std::memory_order_release);
  ready_.Set(ready ? 1 : 0);
}

void Metrics::Refresh(const core::Store& store, const core::Registry& registry, const char* pool) {
  const core::UsageStats u = store.TotalUsage();
  stored_bytes_.Add({{"pool", pool}}).Set(static_cast<double>(u.bytes));
  stored_blocks_.Add({{"pool", pool}}).Set(static_cast<double>(u.blocks));
  capacity_.Add({{"pool", pool}}).Set(static_cast<double>(store.options().capacity_bytes));
  const core::BytePool* bp =
      store.options().byte_pool ? store.options().byte_pool : core::HostBytePool();
  const core::BytePool::Usage pu = bp->usage();
  for (const auto& [state, v] : {std::pair{"requested", pu.requested_bytes},
                                 {"held", pu.held_bytes},
                                 {"reserved", pu.reserved_bytes},
                                 {"fallback", pu.fallback_bytes}}) {
    pool_bytes_.Add({{"pool", pool}, {"state", state}}).Set(static_cast<double>(v));
  }
  k_bits_.Set(u.k_bits());
  v_bits_.Set(u.v_bits());
  tokens_.Set(static_cast<double>(u.tokens));
  sequences_.Set(static_cast<double>(u.sequences));
  models_.Set(static_cast<double>(registry.List().size()));
  prefix_blocks_.Set(static_cast<double>(u.prefix_blocks));
  prefix_bytes_.Set(static_cast<double>(u.prefix_bytes));
  prefix_retained_bytes_.Set(static_cast<double>(u.retained_bytes));
  {
    absl::MutexLock l(&mu_);
    if (u.evictions > seen_evictions_) evictions_.Increment(double(u.evictions - seen_evictions_));
    if (u.expirations > seen_expirations_) {
      expirations_.Increment(double(u.expirations - seen_expirations_));
    }
    seen_evictions_ = u.evictions;
    if (u.shared_tokens > seen_shared_tokens_) {
      prefix_shared_tokens_.Increment(double(u.shared_tokens - seen_shared_tokens_));
    }
    seen_shared_tokens_ = u.shared_tokens;
    seen_expirations_ = u.expirations;
    if (const core::AttendBackend* b = store.options().attend_backend) {
      const int64_t calls = b->calls();
      if (calls > seen_attend_backend_calls_) {
        attend_backend_calls_.Add({{"backend", b->name()}})
            .Increment(double(calls - seen_attend_backend_calls_));
      }
      seen_attend_backend_calls_ = calls;
      const int64_t reads = b->block_op_calls();
      if (reads > seen_backend_block_ops_) {
        backend_block_ops_.Add({{"backend", b->name()}})
            .Increment(double(reads - seen_backend_block_ops_));
      }
      seen_backend_block_ops_ = reads;
    }
    const int64_t copied = core::CopiedBackBytes();
    if (copied > seen_copy_back_bytes_) {
      copy_back_bytes_.Increment(double(copied - seen_copy_back_bytes_));
    }
    seen_copy_back_bytes_ = copied;
  }
  for (const auto& [tenant, tu] : store.AllTenants()) {
    tenant_bytes_.Add({{"tenant", tenant}}).Set(static_cast<double>(tu.bytes));
    tenant_sequences_.Add({{"tenant", tenant}}).Set(static_cast<double>(tu.sequences));
    tenant_tokens_.Add({{"tenant", tenant}}).Set(static_cast<double>(tu.tokens));
  }
}

}  // namespace kvq::server
