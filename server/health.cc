#include "server/health.h"

#include <utility>

namespace kvq::server {

using grpc::health::v1::HealthCheckRequest;
using grpc::health::v1::HealthCheckResponse;

// One Watch call. At most one write is outstanding; a change that arrives meanwhile is kept
// (only the latest) and written when the write completes. StartWrite and Finish are called
// outside mu_.
class HealthService::Watcher final : public grpc::ServerWriteReactor<HealthCheckResponse> {
 public:
  Watcher(HealthService* svc, std::string service) : svc_(svc), service_(std::move(service)) {}
  const std::string& service() const { return service_; }

  // Called with the service's mutex held.
  void Notify(ServingStatus s) {
    {
      absl::MutexLock l(&mu_);
      if (finishing_) return;
      if (writing_) {
        pending_ = s;
        has_pending_ = true;
        return;
      }
      if (sent_ && s == last_) return;
      Prepare(s);
    }
    StartWrite(&msg_);
  }

  void OnWriteDone(bool ok) override {
    bool write = false, finish = false;
    {
      absl::MutexLock l(&mu_);
      writing_ = false;
      if (!ok || cancelled_) {
        finish = !finishing_;
        finishing_ = true;
      } else if (has_pending_) {
        has_pending_ = false;
        if (pending_ != last_) {
          Prepare(pending_);
          write = true;
        }
      }
    }
    if (write) StartWrite(&msg_);
    if (finish) Finish(grpc::Status(grpc::StatusCode::CANCELLED, "health watch ended"));
  }

  void OnCancel() override {
    bool finish = false;
    {
      absl::MutexLock l(&mu_);
      cancelled_ = true;
      if (!writing_ && !finishing_) finish = finishing_ = true;
    }
    if (finish) Finish(grpc::Status(grpc::StatusCode::CANCELLED, "health watch ended"));
  }

  void OnDone() override {
    svc_->Remove(this);
    delete this;
  }

 private:
  void Prepare(ServingStatus s) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    writing_ = sent_ = true;
    last_ = s;
    msg_.set_status(s);
  }

  HealthService* svc_;
  const std::string service_;
  absl::Mutex mu_;
  HealthCheckResponse msg_;  // the outstanding write's message
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  bool sent_ ABSL_GUARDED_BY(mu_) = false;
  ServingStatus last_ ABSL_GUARDED_BY(mu_) = HealthCheckResponse::UNKNOWN;
  bool has_pending_ ABSL_GUARDED_BY(mu_) = false;
  ServingStatus pending_ ABSL_GUARDED_BY(mu_) = HealthCheckResponse::UNKNOWN;
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;
  bool finishing_ ABSL_GUARDED_BY(mu_) = false;
};

HealthService::HealthService(const std::vector<std::string>& services) {
  absl::MutexLock l(&mu_);
  status_[""] = HealthCheckResponse::NOT_SERVING;
  for (const auto& s : services) status_[s] = HealthCheckResponse::NOT_SERVING;
}

void HealthService::SetAll(ServingStatus s) {
  for (auto& [name, st] : status_) st = s;
  for (Watcher* w : watchers_) {
    if (status_.contains(w->service())) w->Notify(s);  // an unknown one stays SERVICE_UNKNOWN
  }
}

void HealthService::SetServing(bool serving) {
  absl::MutexLock l(&mu_);
  if (shut_down_) return;
  SetAll(serving ? HealthCheckResponse::SERVING : HealthCheckResponse::NOT_SERVING);
}

void HealthService::Shutdown() {
  absl::MutexLock l(&mu_);
  shut_down_ = true;
  SetAll(HealthCheckResponse::NOT_SERVING);
}

HealthService::ServingStatus HealthService::StatusOf(const std::string& service) {
  absl::MutexLock l(&mu_);
  auto it = status_.find(service);
  return it == status_.end() ? HealthCheckResponse::SERVICE_UNKNOWN : it->second;
}

grpc::ServerUnaryReactor* HealthService::Check(grpc::CallbackServerContext* ctx,
                                               const HealthCheckRequest* req,
                                               HealthCheckResponse* resp) {
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  const ServingStatus s = StatusOf(req->service());
  if (s == HealthCheckResponse::SERVICE_UNKNOWN) {
    reactor->Finish(
        grpc::Status(grpc::StatusCode::NOT_FOUND, "unknown service '" + req->service() + "'"));
  } else {
    resp->set_status(s);
    reactor->Finish(grpc::Status::OK);
  }
  return reactor;
}

grpc::ServerWriteReactor<HealthCheckResponse>* HealthService::Watch(grpc::CallbackServerContext*,
                                                                    const HealthCheckRequest* req) {
  auto* w = new Watcher(this, req->service());
  absl::MutexLock l(&mu_);
  watchers_.insert(w);
  auto it = status_.find(req->service());
  w->Notify(it == status_.end() ? HealthCheckResponse::SERVICE_UNKNOWN : it->second);
  return w;
}

void HealthService::Remove(Watcher* w) {
  absl::MutexLock l(&mu_);
  watchers_.erase(w);
}

}  // namespace kvq::server
