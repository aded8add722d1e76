// grpc.health.v1.Health, ours rather than gRPC's default: every status starts NOT_SERVING,
// so no health check can see SERVING before the registry is loaded (gRPC's default service
// says SERVING from the moment the server starts). Check and Watch follow the standard:
// Check of an unknown service is NOT_FOUND; Watch sends the current status (SERVICE_UNKNOWN
// for an unknown service) and then every change, until the client or the server ends it.
#pragma once

#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/synchronization/mutex.h"
#include "grpc/health/v1/health.grpc.pb.h"

namespace kvq::server {

class HealthService final : public grpc::health::v1::Health::CallbackService {
 public:
  using ServingStatus = grpc::health::v1::HealthCheckResponse::ServingStatus;

  // The whole server ("") and each named service, all NOT_SERVING until SetServing(true).
  explicit HealthService(const std::vector<std::string>& services);

  // Sets every service's status. Ignored after Shutdown.
  void SetServing(bool serving);
  // NOT_SERVING for good (watchers are told); the server's shutdown then ends the Watch calls.
  void Shutdown();
  // The current status of a service, or SERVICE_UNKNOWN.
  ServingStatus StatusOf(const std::string& service);

  grpc::ServerUnaryReactor* Check(grpc::CallbackServerContext* ctx,
                                  const grpc::health::v1::HealthCheckRequest* req,
                                  grpc::health::v1::HealthCheckResponse* resp) override;
  grpc::ServerWriteReactor<grpc::health::v1::HealthCheckResponse>* Watch(
      grpc::CallbackServerContext* ctx, const grpc::health::v1::HealthCheckRequest* req) override;

  class Watcher;

 private:
  friend class Watcher;
  void Remove(Watcher* w);
  void SetAll(ServingStatus s) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  absl::Mutex mu_;
  absl::flat_hash_map<std::string, ServingStatus> status_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_set<Watcher*> watchers_ ABSL_GUARDED_BY(mu_);
  bool shut_down_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace kvq::server
