// The one wrapper every kvq.v1.Kvq call goes through, unary handler or stream reactor alike.
// For every call, in this order:
//   1. it is counted in flight (Shutdown drains on this count) and its clock starts;
//   2. while the server drains it is refused: UNAVAILABLE "the server is shutting down";
//   3. it is authenticated (the tenant: bearer token, or x-kvq-tenant with auth off) before
//      anything else about the server is said, readiness included;
//   4. but for Echo (CallKind::kProbe), it is refused until the registry is loaded:
//      UNAVAILABLE "the registry is still loading; retry shortly";
//   5. a call whose work runs on the worker pool (CallKind::kPooled; a stream for its whole
//      life) is admitted against --max-inflight: one beyond it is refused at once with
//      RESOURCE_EXHAUSTED "server overloaded: N calls in flight, limit M" and counted in
//      kvq_rejected_total{reason="overload"}; and against --max-inflight-per-client, so that
//      no one client (its tenant with auth on; its tenant and address with auth off) holds
//      every slot, idle streams included: one beyond it gets RESOURCE_EXHAUSTED "client ...
//      holds N calls in flight, limit M per client", counted in
//      kvq_rejected_total{reason="client_limit"};
//   6. StillWanted says whether the client still waits for it (DEADLINE_EXCEEDED /
//      CANCELLED otherwise): checked when a worker takes a pooled unary call or GetBlocks up,
//      and before each item of a batch, so that abandoned work stops early (a PutBlocks
//      stream learns of it from its next read);
//   7. it ends exactly once (Call::End): its --max-inflight slot is freed, the call is
//      recorded (kvq_requests_total{method,code}, kvq_request_duration_seconds, bytes in and
//      out), logged (server-side failures, INTERNAL / DATA_LOSS / UNKNOWN, always; every call
//      with --log-calls), its status mapped to gRPC's (ToGrpc, the one mapping) and it is
//      counted out of flight.
// Unary() runs a unary handler's body under that wrapper; stream reactors hold a Call.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "grpcpp/grpcpp.h"
#include "kvq/core/worker_pool.h"
#include "server/auth.h"
#include "server/convert.h"
#include "server/metrics.h"

namespace kvq::server {

enum class CallKind {
  kProbe,   // Echo: answered on the gRPC thread, even before the registry is loaded
  kInline,  // ListModels, GetModel, Stats: answered on the gRPC thread once ready
  kPooled,  // everything else: runs on the worker pool, counted against --max-inflight
};

// What every call shares: the in-flight counts, the drain flag and where calls are recorded.
class CallGate {
 public:
  struct Options {
    const Authenticator* auth = nullptr;  // required
    Metrics* metrics = nullptr;           // null: calls are not recorded
    // Turns true once the registry is loaded; until then only probes are answered. Required.
    const std::atomic<bool>* ready = nullptr;
    // Pooled calls queued or running at once; 0 = no limit (ServerOptions::max_inflight).
    int64_t max_inflight = 0;
    // Of those, what one client may hold; 0 = no limit (ServerOptions::max_inflight_per_client).
    int64_t max_inflight_per_client = 0;
    // Log every call (method, tenant, code, duration, bytes) to stderr, not only failures of the
    // server's own (ServerOptions::log_calls).
    bool log_calls = false;
  };
  explicit CallGate(Options o) : o_(o) {}
  CallGate(const CallGate&) = delete;
  CallGate& operator=(const CallGate&) = delete;

  // Refuses new calls (UNAVAILABLE) and waits for those in flight to end, at most `grace`; returns
  // whether they did.
  bool Drain(absl::Duration grace);

  // Pooled calls `client` (Call::ClientKey()) holds now, and the limits it is admitted against
  // (0: none).
  int64_t HeldBy(const std::string& client);
  int64_t max_inflight() const { return o_.max_inflight; }
  int64_t max_inflight_per_client() const { return o_.max_inflight_per_client; }

 private:
  friend class Call;
  const Options o_;
  std::atomic<int64_t> inflight_{0};    // every call, from its start to its End
  std::atomic<int64_t> pool_calls_{0};  // admitted pooled calls
  std::atomic<bool> draining_{false};
  // Pooled calls held per client key (entries removed at zero). A mutex, not atomics: taken
  // once at a pooled call's admission and once at its end, next to far costlier work.
  absl::Mutex clients_mu_;
  absl::flat_hash_map<std::string, int64_t> client_calls_ ABSL_GUARDED_BY(clients_mu_);
};

// One call, from its start (steps 1-5 above, in the constructor) to End (step 7).
class Call {
 public:
  // `method` must outlive the call (a string literal); `ctx` too (gRPC keeps it until the call is
  // finished).
  Call(CallGate* gate, const char* method, const grpc::CallbackServerContext& ctx, CallKind kind);
  Call(const Call&) = delete;
  Call& operator=(const Call&) = delete;

  // OK when the call may go ahead; otherwise the status to End it with at once.
  const absl::Status& admission() const { return admission_; }
  // The caller's tenant (valid once admitted).
  const std::string& tenant() const { return tenant_; }
  // The caller as --max-inflight-per-client counts it (valid once admitted).
  std::string ClientKey() const;
  // OK while someone still waits for the answer: CANCELLED once the client cancelled (or went
  // away), DEADLINE_EXCEEDED once its deadline passed. `item` < 0: before any work; else before
  // item `item` of `items` (the message says the rest were skipped).
  absl::Status StillWanted(int item = -1, int items = 0) const;
  // Step 7; call exactly once, then finish the reactor with the status returned.
  grpc::Status End(const absl::Status& st, size_t bytes_in, size_t bytes_out);

 private:
  CallGate* gate_;
  const char* method_;
  const grpc::CallbackServerContext& ctx_;
  const absl::Time start_;
  // Step 5: takes a --max-inflight slot and one of the client's; false and admission_ set when
  // either is full.
  bool AdmitPooled();

  bool pooled_ = false;  // holds a --max-inflight slot and one of client_'s
  absl::Status admission_;
  std::string tenant_;
  std::string client_;  // ClientKey() (set when pooled_)
};

// A unary call under the wrapper: `body(call)` fills *resp and returns the call's status; it runs
// on the gRPC thread (kProbe, kInline) or on `pool` (kPooled) once admitted and still wanted. Bytes
// in and out are the request's and (on success) the response's sizes.
template <typename Req, typename Resp, typename Body>
grpc::ServerUnaryReactor* Unary(CallGate* gate, core::WorkerPool* pool, const char* method,
                                CallKind kind, grpc::CallbackServerContext* ctx, const Req* req,
                                Resp* resp, Body body) {
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  auto finish = [reactor, req, resp](Call& call, const absl::Status& st) {
    reactor->Finish(call.End(st, req->ByteSizeLong(), st.ok() ? resp->ByteSizeLong() : 0));
  };
  if (kind != CallKind::kPooled) {
    Call call(gate, method, *ctx, kind);
    finish(call, call.admission().ok() ? body(call) : call.admission());
    return reactor;
  }
  auto call = std::make_shared<Call>(gate, method, *ctx, kind);
  if (!call->admission().ok()) {
    finish(*call, call->admission());
    return reactor;
  }
  pool->Submit([call, finish, body = std::move(body)]() mutable {
    absl::Status st = call->StillWanted();
    if (st.ok()) st = body(*call);
    finish(*call, st);
  });
  return reactor;
}

}  // namespace kvq::server
