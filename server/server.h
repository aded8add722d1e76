// kvq-server: the gRPC service over core::Store, as a class that tests start in-process.
//
// Threads: gRPC's callback threads only parse, authenticate and hand work over; encoding,
// scoring, attention and decoding run on a fixed worker pool (ServerOptions::workers), and
// the reactor is finished from there. Echo alone is answered on the gRPC thread (it is the
// transport baseline).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "kvq/core/store.h"

namespace kvq::server {

// The store's options are embedded, one schema from flag to core::Store: capacity_bytes,
// tenant_quota_bytes, ttl, retain_prefixes and the rest are documented in kvq/core/store.h,
// and taken as they are but for two serving defaults:
//   capacity_bytes 0 = half the machine's physical memory (core::CapacityOrDefault), not
//     unlimited as for a bare core::Store;
//   byte_pool null = the pool `memory` names (core::ChooseMemoryPool), and attend_backend
//     null = that choice's backend (the CUDA attend for gpu); set them (tests) to use a pool
//     and backend of one's own.
struct ServerOptions : core::StoreOptions {
  // gRPC listen address and port. Port 0 picks a free port (tests); see grpc_port().
  std::string grpc_address = "0.0.0.0";
  int grpc_port = 50051;
  // Prometheus exporter (/metrics). -1 turns it off; 0 picks a free port.
  std::string metrics_address = "0.0.0.0";
  int metrics_port = 9464;
  // Registry folder (created when absent). "" keeps models in memory only.
  std::string registry_dir;
  // Memory pool of the encoded blocks, by name (core::ChooseMemoryPool, which says what it
  // chose and why at start-up): "auto" (the best that works: gpu where the CUDA attend
  // answers its probe, then pinned, then host; no CUDA driver means host), "gpu" (device
  // memory, attends on the GPU; refused with the reason where it cannot work), "pinned",
  // "host". Ignored when byte_pool is set.
  std::string memory = "auto";
  // Which attend reads the blocks (core::ChooseAttend): "auto" (the CUDA attend for gpu
  // memory, the CPU kernels otherwise), "gpu" (the CUDA attend on the chosen pool: pinned
  // memory read by the device over the bus; refused where it cannot work), "cpu". Ignored
  // when byte_pool is set.
  std::string attend = "auto";
  // Worker threads for encode/score/attend; 0 = the number of CPU cores.
  int workers = 0;
  // Split Attend (flash-decoding, core::AttendOptions::parts): an Attend item over a layer of
  // at least this many tokens, started while some workers are idle, runs its tokens in
  // core::AttendSplitParts(idle, workers) parts = min(idle + 1, 4, workers) on the calling
  // worker and the idle ones; with none idle it runs unsplit, submitting nothing. Each item
  // of a batch decides when it starts: a batch's items are handed to idle workers first
  // (one item per worker), so a batch splits only with workers left over. Results differ
  // from the unsplit order by rounding, within 2e-6 * max|v| per element (1e-5 * max|v| on
  // the int16 readout; core::AttendOptions::parts). Counted in
  // kvq_attend_split_total. 0 = never split. 8192: at 32k tokens two workers answer one
  // request 1.6-2x faster (docs/BENCHMARKS.md); short layers gain too little to pay the
  // helper's wake-up.
  int64_t split_attend_min_tokens = 8192;
  // A worker that runs out of work polls the queue this many microseconds before it sleeps
  // (core::WorkerPool's spin_us), so that a split Attend's helper or the next call starts
  // without the tens of microseconds a sleeping vCPU takes to wake; it burns that much CPU per
  // idle spell, so leave it 0 where cores are shared. 0 = sleep at once.
  int worker_poll_us = 0;
  // Overload shedding: calls queued or running on the worker pool at once (every call but
  // Echo, ListModels, GetModel and Stats; an open stream counts until it ends). One more is
  // refused at once with RESOURCE_EXHAUSTED ("server overloaded: N calls in flight, limit M")
  // and counted in kvq_rejected_total{reason="overload"}, rather than queued behind work it
  // would wait long for. 0 = no limit. The default leaves room for thousands of concurrent
  // streams while bounding the queue (and the requests it holds in memory).
  int max_inflight = 4096;
  // Fairness: of those, what one client may hold at once, streams included, so that one client
  // (its tenant with auth on; its tenant and address with auth off, where tenants are only
  // claimed) cannot take every slot, e.g. with idle PutBlocks streams, and starve the others.
  // One more is refused with RESOURCE_EXHAUSTED ("client ... holds N calls in flight, limit M
  // per client") and counted in kvq_rejected_total{reason="client_limit"}. -1 (default) = a
  // quarter of max_inflight (at least 1; none when max_inflight is 0); 0 = no limit. Behind a
  // router with auth off every caller of one tenant shares the router's address, so one limit:
  // turn auth on there, or raise it.
  int max_inflight_per_client = -1;
  // Log every call to stderr (method, tenant, status, duration, bytes), not only those that
  // fail on the server's side (INTERNAL, DATA_LOSS, UNKNOWN), which are always logged. Off by
  // default: a line per call costs more than Echo itself.
  bool log_calls = false;
  // A PutBlocks stream that receives no message for this long fails with DEADLINE_EXCEEDED,
  // freeing its --max-inflight slot (a client that opens a stream and goes quiet would hold
  // it forever). Time spent applying a message does not count. Zero = never.
  absl::Duration stream_idle_timeout = absl::Seconds(60);
  // Largest gRPC message either way. 256 MiB holds a 16k-token fp16 prefill of one layer
  // at 8 KV heads x 128 dims (2 x 32 MiB) several times over; clients should split larger
  // writes into several PutBlocks messages (each is applied atomically).
  int64_t max_message_bytes = int64_t{256} << 20;
  // TLS: server certificate chain and key (PEM files). Both empty = plaintext.
  std::string tls_cert;
  std::string tls_key;
  // Client CA (PEM): when set, clients must present a certificate it signed (mTLS).
  std::string tls_client_ca;
  // Bearer tokens file: lines "<token> <tenant>" ('#' starts a comment). Empty = auth off:
  // the tenant comes from the `x-kvq-tenant` metadata, trusted as sent (development only).
  std::string auth_tokens_file;
  // With auth on: comma-separated tenants allowed to RegisterBasis (the registry is shared by
  // all tenants). Empty = every authenticated tenant may register.
  std::string admin_tenants;
  // Router tier (docs/ROUTER.md): when a router's probe (GET /healthz on the metrics port with
  // an x-kvq-probe header, as deploy/haproxy sends it) arrives more than this long after the
  // same router's previous one, the router may have marked this shard down meanwhile and sent
  // its keys to other shards, where they were re-put and appended to: every sequence of every
  // tenant is dropped (prefix groups too; core::Store::DropAll), counted
  // (kvq_probe_gap_drops_total), logged, and that probe is answered 503, so that the router
  // counts its `rise` checks from after the drop. Set it above the router's check interval and
  // below the shortest time in which it can mark a shard down (haproxy.cfg). Zero = off (the
  // default: without a router no probe gap means anything). Uses StoreOptions::now.
  absl::Duration drop_after_probe_gap = absl::ZeroDuration();
  // In-flight calls get this long to finish at shutdown before they are cancelled.
  absl::Duration shutdown_grace = absl::Seconds(10);
  // Seconds between metric refreshes, TTL sweeps and the checksum scrub (0: no scrub).
  absl::Duration housekeeping_period = absl::Seconds(1);
  absl::Duration scrub_period = absl::Minutes(10);
  // gRPC server reflection (grpcurl-friendly).
  bool reflection = true;
  // Tests: called with the bound gRPC port as soon as the server listens, before the
  // registry is loaded (health is NOT_SERVING then).
  std::function<void(int grpc_port)> on_listening;
};

// Range checks of every numeric option, each error naming its flag and the allowed range
// (kvq-server exits 2 on one, as on any usage error; Start checks them too):
//   --grpc-port 0..65535; --metrics-port -1..65535; --workers 0..1024;
//   --split-attend-min-tokens >= 0; --worker-poll-us 0..10000;
//   --max-inflight 0..1000000; --max-inflight-per-client -1..1000000; --max-message-bytes
//   64K..2147483647 (gRPC's limit);
//   --capacity, --tenant-quota >= 0; --sequence-ttl, --shutdown-grace, --scrub-period
//   finite and >= 0; --stream-idle-timeout 0 or 1ms..24h; --drop-after-probe-gap 0 or
//   10ms..1h; the housekeeping period > 0.
absl::Status ValidateOptions(const ServerOptions& opts);

class KvqServer {
 public:
  explicit KvqServer(ServerOptions opts);
  ~KvqServer();
  KvqServer(const KvqServer&) = delete;
  KvqServer& operator=(const KvqServer&) = delete;

  // Binds the ports, starts serving (health NOT_SERVING: our own grpc.health.v1 service,
  // whose statuses start NOT_SERVING), loads the registry, then reports SERVING. Logs the memory
  // pool, compute backend, registry entries and ports.
  absl::Status Start();
  // Stops accepting, lets in-flight calls finish within the grace period, stops the
  // workers. Idempotent.
  void Shutdown();

  int grpc_port() const;
  int metrics_port() const;  // -1 when off
  core::Store& store();
  core::Registry& registry();

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace kvq::server
