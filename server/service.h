// The kvq.v1.Kvq callback service: a thin translator from protobuf to core::Store calls.
// Each handler authenticates on the gRPC thread, then runs on the worker pool; one wrapper
// (server/call.h: Unary for unary calls, a Call held by each stream reactor) adds admission,
// the deadline check, the status mapping, timing, counters and logging to every call.
#pragma once

#include <memory>
#include <string>

#include "kvq/core/store.h"
#include "kvq/core/worker_pool.h"
#include "kvq/v1/kvq.grpc.pb.h"
#include "server/auth.h"
#include "server/call.h"
#include "server/idle_streams.h"

namespace kvq::server {

class Metrics;

// Everything a Service is built with; the pointers must outlive it.
struct ServiceOptions {
  core::Store* store = nullptr;
  core::Registry* registry = nullptr;
  core::WorkerPool* pool = nullptr;
  // The wrapper every call goes through (authentication, readiness, --max-inflight, metrics,
  // logging: server/call.h).
  CallGate::Options calls;
  // What Stats reports as the block pool and the attend backend.
  std::string pool_name, backend_name;
  // PutBlocks streams quiet this long between messages fail with DEADLINE_EXCEEDED (zero:
  // never).
  absl::Duration stream_idle_timeout = absl::ZeroDuration();
  // Attend items over layers of at least this many tokens split across idle workers (0:
  // never; ServerOptions::split_attend_min_tokens), each split counted in split_metrics
  // (null: not counted).
  int64_t split_attend_min_tokens = 0;
  Metrics* split_metrics = nullptr;
};

// PutBlocks is registered raw (grpc::ByteBuffer in and out) so that it parses its messages
// itself and can tell a message that does not parse from the end of the stream.
class Service final : public v1::Kvq::WithRawCallbackMethod_PutBlocks<v1::Kvq::CallbackService> {
 public:
  explicit Service(ServiceOptions opts);

  grpc::ServerUnaryReactor* RegisterBasis(grpc::CallbackServerContext* ctx,
                                          const v1::RegisterBasisRequest* req,
                                          v1::RegisterBasisResponse* resp) override;
  grpc::ServerUnaryReactor* ListModels(grpc::CallbackServerContext* ctx,
                                       const v1::ListModelsRequest* req,
                                       v1::ListModelsResponse* resp) override;
  grpc::ServerUnaryReactor* GetModel(grpc::CallbackServerContext* ctx,
                                     const v1::GetModelRequest* req, v1::ModelInfo* resp) override;
  grpc::ServerUnaryReactor* GetBasis(grpc::CallbackServerContext* ctx,
                                     const v1::GetModelRequest* req,
                                     v1::RegisterBasisRequest* resp) override;
  // The generated typed PutBlocks is never registered (the raw one replaces it); named here so
  // that overriding the raw one does not hide it (clang's -Woverloaded-virtual).
  using v1::Kvq::WithRawCallbackMethod_PutBlocks<v1::Kvq::CallbackService>::PutBlocks;
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
  grpc::ServerUnaryReactor* MatchPrefix(grpc::CallbackServerContext* ctx,
                                        const v1::MatchPrefixRequest* req,
                                        v1::MatchPrefixResponse* resp) override;
  grpc::ServerUnaryReactor* Stats(grpc::CallbackServerContext* ctx, const v1::StatsRequest* req,
                                  v1::StatsResponse* resp) override;
  grpc::ServerUnaryReactor* Echo(grpc::CallbackServerContext* ctx, const v1::EchoRequest* req,
                                 v1::EchoResponse* resp) override;

  // Shared by the stream reactors.
  // What a store append points at besides the request: probe weights converted to fp32, the
  // encoded groups' view.
  struct SpecStorage {
    std::vector<float> probe;
    core::EncodedGroupsView run;
  };
  // Translates one wire append into a store append (views into `a` and *storage), validating
  // what the store does not; errors start with `at`.
  absl::Status SpecOf(const v1::Append& a, const std::string& at, core::AppendSpec* spec,
                      SpecStorage* storage);
  // Applies an Attend or Score item's `append` (its own sequence and layer only).
  template <class Item>
  absl::Status ItemAppend(const std::string& tenant, const Item& item, const std::string& at);
  core::Store* store() { return store_; }
  core::Registry* registry() { return registry_; }
  core::WorkerPool* pool() { return pool_; }
  // The call wrapper's shared state (server/call.h): stream reactors start their Call on it.
  CallGate* calls() { return &calls_; }
  // Refuses new calls (UNAVAILABLE) and waits for those in flight to end, at most `grace`;
  // returns whether they did.
  bool Drain(absl::Duration grace) { return calls_.Drain(grace); }
  // The PutBlocks streams' idle timer (ServiceOptions::stream_idle_timeout).
  IdleStreams* idle_streams() { return idle_.get(); }

 private:
  // A unary call under the wrapper (server/call.h): body(const Call&) -> absl::Status.
  template <typename Req, typename Resp, typename Body>
  grpc::ServerUnaryReactor* Unary(const char* method, CallKind kind,
                                  grpc::CallbackServerContext* ctx, const Req* req, Resp* resp,
                                  Body body);

  // A new sequence's codec: `settings` over model `model` version `version`'s registered
  // defaults (checked as the wire's CodecSettings); errors name `at`'s model and codec fields
  // ("<at>.model", "<at>.codec.<name>"; no prefix when `at` is empty).
  absl::StatusOr<core::CodecOptions> CreationCodecOf(const std::string& model, int version,
                                                     const v1::CodecSettings& settings,
                                                     const std::string& at) const;

  core::Store* store_;
  core::Registry* registry_;
  const Authenticator* auth_;
  core::WorkerPool* pool_;
  std::string pool_name_, backend_name_;
  absl::Time started_;
  CallGate calls_;
  int64_t split_min_tokens_ = 0;
  Metrics* split_metrics_ = nullptr;
  std::unique_ptr<IdleStreams> idle_;
};

}  // namespace kvq::server
