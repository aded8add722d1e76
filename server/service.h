// The kvq.v1.Kvq callback service: a thin translator from protobuf to core::Store calls.
// Each handler authenticates on the gRPC thread, then runs on the worker pool; one wrapper
// (Unary / the stream reactors) adds the status mapping, timing and counters to every call.
#pragma once

#include <atomic>
#include <memory>
#include <string>

#include "kvq/core/store.h"
#include "kvq/v1/kvq.grpc.pb.h"
#include "server/auth.h"
#include "server/idle_streams.h"
#include "server/metrics.h"
#include "server/worker_pool.h"

namespace kvq::server {

// PutBlocks is registered raw (grpc::ByteBuffer in and out) so that it parses its messages
// itself and can tell a message that does not parse from the end of the stream.
class Service final : public v1::Kvq::WithRawCallbackMethod_PutBlocks<v1::Kvq::CallbackService> {
 public:
  // metrics may be null. `ready` turns true once the registry is loaded; until then every
  // call but Echo is UNAVAILABLE.
  Service(core::Store* store, core::Registry* registry, const Authenticator* auth, Metrics* metrics,
          WorkerPool* pool, const std::atomic<bool>* ready, std::string pool_name,
          std::string backend_name);

  grpc::ServerUnaryReactor* RegisterBasis(grpc::CallbackServerContext* ctx,
                                          const v1::RegisterBasisRequest* req,
                                          v1::RegisterBasisResponse* resp) override;
  grpc::ServerUnaryReactor* ListModels(grpc::CallbackServerContext* ctx,
                                       const v1::ListModelsRequest* req,
                                       v1::ListModelsResponse* resp) override;
  grpc::ServerUnaryReactor* GetModel(grpc::CallbackServerContext* ctx,
                                     const v1::GetModelRequest* req, v1::ModelInfo* resp) override;
  // Reads PutBlocksRequest messages, answers a serialized PutBlocksResponse.
  grpc::ServerReadReactor<grpc::ByteBuffer>* PutBlocks(grpc::CallbackServerContext* ctx,
                                                      grpc::ByteBuffer* resp) override;
  grpc::ServerUnaryReactor* Score(grpc::CallbackServerContext* ctx, const v1::ScoreRequest* req,
                                  v1::ScoreResponse* resp) override;
  grpc::ServerUnaryReactor* Readout(grpc::CallbackServerContext* ctx, const v1::ReadoutRequest* req,
                                    v1::ReadoutResponse* resp) override;
  grpc::ServerUnaryReactor* Attend(grpc::CallbackServerContext* ctx, const v1::AttendRequest* req,
                                   v1::AttendResponse* resp) override;
  grpc::ServerWriteReactor<v1::GetBlocksResponse>* GetBlocks(
      grpc::CallbackServerContext* ctx, const v1::GetBlocksRequest* req) override;
  grpc::ServerUnaryReactor* DeleteSequence(grpc::CallbackServerContext* ctx,
                                           const v1::DeleteSequenceRequest* req,
                                           v1::DeleteSequenceResponse* resp) override;
  grpc::ServerUnaryReactor* Stats(grpc::CallbackServerContext* ctx, const v1::StatsRequest* req,
                                  v1::StatsResponse* resp) override;
  grpc::ServerUnaryReactor* Echo(grpc::CallbackServerContext* ctx, const v1::EchoRequest* req,
                                 v1::EchoResponse* resp) override;

  // Shared by the stream reactors.
  // Translates one wire append into a store append (views into `a`; probe weights converted
  // into *probe), validating what the store does not; errors start with `at`.
  absl::Status SpecOf(const v1::Append& a, const std::string& at, core::AppendSpec* spec,
                      std::vector<float>* probe);
  // Applies an Attend or Score item's `append` (its own sequence and layer only).
  template <class Item>
  absl::Status ItemAppend(const std::string& tenant, const Item& item, const std::string& at);
  core::Store* store() { return store_; }
  core::Registry* registry() { return registry_; }
  WorkerPool* pool() { return pool_; }
  // Authentication and readiness; OK and the tenant, or the status to finish with.
  absl::StatusOr<std::string> Admit(const grpc::CallbackServerContext& ctx, bool need_ready);
  void Record(const char* method, const absl::Status& st, absl::Time start, size_t in, size_t out);
  // Every handler counts itself in on entry (Enter) and out in Record, which each call
  // reaches exactly once. Drain() refuses new calls (UNAVAILABLE) and waits for the count
  // to reach zero, at most `grace`; returns whether it did.
  void Enter() { inflight_.fetch_add(1, std::memory_order_relaxed); }
  bool Drain(absl::Duration grace);
  // Overload shedding: calls whose work goes to the worker pool (all but Echo, ListModels,
  // GetModel, Stats; a stream counts for its whole life) enter with EnterPool, which refuses
  // one beyond `max_inflight` (0 = no limit) with RESOURCE_EXHAUSTED, and leave with
  // LeavePool once finished. Set before serving.
  void set_max_inflight(int64_t n) { max_inflight_ = n; }
  absl::Status EnterPool();
  void LeavePool() { pool_calls_.fetch_sub(1, std::memory_order_acq_rel); }
  // PutBlocks streams quiet this long between messages fail with DEADLINE_EXCEEDED (zero:
  // never). Set before serving.
  void set_stream_idle_timeout(absl::Duration d) { idle_ = std::make_unique<IdleStreams>(d); }
  IdleStreams* idle_streams() { return idle_.get(); }

 private:
  template <typename Req, typename Resp, typename Fn>
  grpc::ServerUnaryReactor* Unary(const char* method, grpc::CallbackServerContext* ctx,
                                  const Req* req, Resp* resp, bool on_pool, Fn fn);

  core::Store* store_;
  core::Registry* registry_;
  const Authenticator* auth_;
  Metrics* metrics_;
  WorkerPool* pool_;
  const std::atomic<bool>* ready_;
  std::string pool_name_, backend_name_;
  absl::Time started_;
  std::atomic<int64_t> inflight_{0};
  std::atomic<bool> draining_{false};
  int64_t max_inflight_ = 0;
  std::atomic<int64_t> pool_calls_{0};
  std::unique_ptr<IdleStreams> idle_ = std::make_unique<IdleStreams>(absl::ZeroDuration());
};

}  // namespace kvq::server
