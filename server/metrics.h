// Prometheus metrics of the service (prometheus-cpp), all named kvq_*.
//
//   kvq_requests_total{method,code}            counter   calls by gRPC method and status code
//   kvq_request_duration_seconds{method}       histogram latency from arrival to finish
//   kvq_received_bytes_total{method}           counter   request message bytes
//   kvq_sent_bytes_total{method}               counter   response message bytes
//   kvq_stored_bytes{pool}                     gauge     bytes held (codes + window + hashes)
//   kvq_stored_blocks{pool}                    gauge     encoded blocks held
//   kvq_capacity_bytes{pool}                   gauge     the capacity limit
//   kvq_memory_pool_bytes{pool,state}          gauge     the block memory pool: state=requested
//                                                        (live block vectors), held (their size
//                                                        classes), reserved (slabs taken from
//                                                        the driver), fallback (in host memory
//                                                        because the pool refused)
//   kvq_key_bits_per_element / kvq_value_bits_per_element   gauge (effective: blocks, window
//                                                        and fp16 sink rows)
//   kvq_cached_tokens                          gauge     tokens per head over layers/sequences
//   kvq_sequences                              gauge     live sequences
//   kvq_evictions_total, kvq_expirations_total counter   sequences evicted (LRU) / expired (TTL)
//   kvq_scrub_failures_total                   counter   sequences that failed a checksum scrub
//   kvq_tenant_stored_bytes{tenant}, kvq_tenant_sequences{tenant}, kvq_tenant_cached_tokens{tenant}
//   kvq_prefix_blocks, kvq_prefix_bytes        gauge     prefix-index groups and their bytes
//                                                        (in kvq_stored_bytes, counted once)
//   kvq_prefix_retained_bytes                  gauge     of which held by no live sequence
//   kvq_prefix_shared_tokens_total             counter   tokens taken from the index, not encoded
//   kvq_models                                 gauge     registry entries (model versions)
//   kvq_ready                                  gauge     1 once the registry is loaded
//   kvq_rejected_total{reason}                 counter   calls refused before any work;
//                                                        reason="overload": over --max-inflight,
//                                                        reason="client_limit": over
//                                                        --max-inflight-per-client
//   kvq_probe_gap_drops_total                  counter   times every sequence was dropped
//                                                        after a gap in a router's probes
//                                                        (--drop-after-probe-gap)
//   kvq_probe_gap_dropped_sequences_total      counter   the sequences those drops took
//   kvq_attend_split_total                     counter   Attend items whose tokens were split
//                                                        across idle workers (server.h,
//                                                        split_attend_min_tokens)
//   kvq_attend_backend_calls_total{backend}    counter   attends whose encoded blocks the
//                                                        store's attend backend served (cuda
//                                                        with --memory gpu; absent without one)
//   kvq_backend_block_ops_total{backend}       counter   encodes, scores, readouts and decodes
//                                                        of device blocks the attend backend
//                                                        ran where they lie (set_block_ops)
//   kvq_block_copy_back_bytes_total            counter   block bytes copied out of memory the
//                                                        CPU does not read (device memory) for
//                                                        the CPU's reads (core::CpuView)
//
// The same port also answers GET (or HEAD) /healthz: 200 "SERVING" while SetReady(true) holds
// (the registry is loaded and the server is not shutting down), 503 "NOT_SERVING" otherwise.
// A plain HTTP check for proxies and load balancers that cannot speak grpc.health.v1
// (HAProxy's `option httpchk`, deploy/haproxy/haproxy.cfg). A check carrying the header
// `x-kvq-probe: NAME` is a router's probe: it also goes to the probe hook (SetProbeHook), which
// may have it answered 503.
#pragma once

#include <atomic>
#include <functional>
#include <memory>
#include <string>

#include "absl/synchronization/mutex.h"
#include "prometheus/counter.h"
#include "prometheus/exposer.h"
#include "prometheus/gauge.h"
#include "prometheus/histogram.h"
#include "prometheus/registry.h"

namespace kvq::core {
class Store;
class Registry;
}  // namespace kvq::core

namespace kvq::server {

class Metrics {
 public:
  Metrics();
  // Serves /metrics and /healthz on address:port (port 0: a free one). Returns the bound port.
  int Expose(const std::string& address, int port);
  ~Metrics();

  void RecordCall(const std::string& method, int code, double seconds, size_t bytes_in,
                  size_t bytes_out);
  void RecordScrubFailures(int64_t n);
  void RecordOverload();     // a call refused over --max-inflight
  void RecordClientLimit();  // a call refused over --max-inflight-per-client
  void RecordAttendSplit();  // an Attend item run in parts on idle workers
  void RecordProbeGapDrop(int64_t sequences);

  // Called for every GET or HEAD /healthz that carries x-kvq-probe, with the prober's identity
  // ("<remote address> <header value>"); true has the probe answered 503 NOT_SERVING. Set it
  // before Expose (civetweb's threads read it unguarded); it runs on one of them.
  using ProbeHook = std::function<bool(const std::string& prober)>;
  void SetProbeHook(ProbeHook hook) { probe_hook_ = std::move(hook); }
  // For the /healthz handler (metrics.cc).
  bool OnProbe(const std::string& prober) const { return probe_hook_ && probe_hook_(prober); }
  void SetReady(bool ready);  // also what /healthz answers
  bool ready() const { return serving_.load(std::memory_order_acquire); }
  // Refreshes the store gauges (called periodically).
  void Refresh(const core::Store& store, const core::Registry& registry, const char* pool);

  prometheus::Registry& registry() { return *registry_; }

 private:
  std::shared_ptr<prometheus::Registry> registry_;
  std::unique_ptr<prometheus::Exposer> exposer_;
  int exposed_port_ = -1;  // the port /healthz is registered under (see metrics.cc)
  std::atomic<bool> serving_{false};
  ProbeHook probe_hook_;
  prometheus::Family<prometheus::Counter>& requests_;
  prometheus::Family<prometheus::Histogram>& latency_;
  prometheus::Family<prometheus::Counter>& bytes_in_;
  prometheus::Family<prometheus::Counter>& bytes_out_;
  prometheus::Family<prometheus::Gauge>& stored_bytes_;
  prometheus::Family<prometheus::Gauge>& stored_blocks_;
  prometheus::Family<prometheus::Gauge>& capacity_;
  prometheus::Family<prometheus::Gauge>& pool_bytes_;
  prometheus::Gauge& k_bits_;
  prometheus::Gauge& v_bits_;
  prometheus::Gauge& tokens_;
  prometheus::Gauge& sequences_;
  prometheus::Counter& evictions_;
  prometheus::Counter& expirations_;
  prometheus::Counter& scrub_failures_;
  prometheus::Family<prometheus::Gauge>& tenant_bytes_;
  prometheus::Family<prometheus::Gauge>& tenant_sequences_;
  prometheus::Family<prometheus::Gauge>& tenant_tokens_;
  prometheus::Gauge& prefix_blocks_;
  prometheus::Gauge& prefix_bytes_;
  prometheus::Gauge& prefix_retained_bytes_;
  prometheus::Counter& prefix_shared_tokens_;
  int64_t seen_shared_tokens_ ABSL_GUARDED_BY(mu_) = 0;
  prometheus::Gauge& models_;
  prometheus::Gauge& ready_;
  prometheus::Counter& rejected_overload_;
  prometheus::Counter& rejected_client_limit_;
  prometheus::Counter& probe_gap_drops_;
  prometheus::Counter& probe_gap_dropped_sequences_;
  prometheus::Counter& attend_split_;
  prometheus::Family<prometheus::Counter>& attend_backend_calls_;
  prometheus::Family<prometheus::Counter>& backend_block_ops_;
  prometheus::Counter& copy_back_bytes_;
  absl::Mutex mu_;
  int64_t seen_evictions_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t seen_expirations_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t seen_attend_backend_calls_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t seen_backend_block_ops_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t seen_copy_back_bytes_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace kvq::server
