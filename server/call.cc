#include "server/call.h"

#include <chrono>
#include <cstdio>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace kvq::server {

int64_t CallGate::HeldBy(const std::string& client) {
  absl::MutexLock l(&clients_mu_);
  auto it = client_calls_.find(client);
  return it == client_calls_.end() ? 0 : it->second;
}

bool CallGate::Drain(absl::Duration grace) {
  draining_.store(true, std::memory_order_release);
  const absl::Time deadline = absl::Now() + grace;
  while (inflight_.load(std::memory_order_acquire) > 0) {
    if (absl::Now() >= deadline) return false;
    absl::SleepFor(absl::Milliseconds(5));
  }
  return true;
}

namespace {

// The peer's address without its port ("ipv4:10.0.0.7:51234" -> "ipv4:10.0.0.7"): one client
// host, whatever connections it opens.
std::string PeerHost(const grpc::CallbackServerContext& ctx) {
  std::string peer = ctx.peer();
  const size_t colon = peer.rfind(':');
  const size_t first = peer.find(':');
  if (colon != std::string::npos && colon != first) peer.resize(colon);
  return peer;
}

}  // namespace

Call::Call(CallGate* gate, const char* method, const grpc::CallbackServerContext& ctx,
           CallKind kind)
    : gate_(gate), method_(method), ctx_(ctx), start_(absl::Now()) {
  gate_->inflight_.fetch_add(1, std::memory_order_relaxed);
  const CallGate::Options& o = gate_->o_;
  if (gate_->draining_.load(std::memory_order_acquire)) {
    admission_ = absl::UnavailableError("the server is shutting down");
    return;
  }
  // Authenticate first: an unauthenticated caller learns nothing, not even readiness.
  absl::StatusOr<std::string> tenant = o.auth->TenantOf(ctx);
  if (!tenant.ok()) {
    admission_ = tenant.status();
    return;
  }
  tenant_ = *std::move(tenant);
  if (kind != CallKind::kProbe && !o.ready->load(std::memory_order_acquire)) {
    admission_ = absl::UnavailableError("the registry is still loading; retry shortly");
    return;
  }
  if (kind == CallKind::kPooled) pooled_ = AdmitPooled();
}

std::string Call::ClientKey() const {
  // With auth on the tenant is proven, so it is the client; with auth off anyone may claim any
  // tenant, so its address counts too.
  return gate_->o_.auth->enabled() ? absl::StrCat("tenant '", tenant_, "'")
                                   : absl::StrCat("tenant '", tenant_, "' at ", PeerHost(ctx_));
}

bool Call::AdmitPooled() {
  const CallGate::Options& o = gate_->o_;
  const int64_t before = gate_->pool_calls_.fetch_add(1, std::memory_order_acq_rel);
  if (o.max_inflight > 0 && before >= o.max_inflight) {
    gate_->pool_calls_.fetch_sub(1, std::memory_order_acq_rel);
    if (o.metrics != nullptr) o.metrics->RecordOverload();
    admission_ = absl::ResourceExhaustedError(
        absl::StrCat("server overloaded: ", before, " calls in flight, limit ", o.max_inflight));
    return false;
  }
  client_ = ClientKey();
  int64_t held = 0;
  {
    absl::MutexLock l(&gate_->clients_mu_);
    int64_t& n = gate_->client_calls_[client_];
    held = n;
    if (o.max_inflight_per_client <= 0 || n < o.max_inflight_per_client) {
      ++n;
      return true;
    }
  }
  gate_->pool_calls_.fetch_sub(1, std::memory_order_acq_rel);
  if (o.metrics != nullptr) o.metrics->RecordClientLimit();
  admission_ = absl::ResourceExhaustedError(
      absl::StrCat("client ", client_, " holds ", held, " calls in flight, limit ",
                   o.max_inflight_per_client, " per client (--max-inflight-per-client)"));
  return false;
}

absl::Status Call::StillWanted(int item, int items) const {
  const std::string where =
      item < 0 ? std::string("before a worker took it up")
               : absl::StrCat("after ", item, " of its ", items, " items; the rest were skipped");
  // A call past its deadline is cancelled too: the deadline, checked first, says more.
  if (std::chrono::system_clock::now() >= ctx_.deadline()) {
    return absl::DeadlineExceededError(absl::StrCat("the call's deadline passed ", where));
  }
  if (ctx_.IsCancelled()) return absl::CancelledError(absl::StrCat("call cancelled ", where));
  return absl::OkStatus();
}

grpc::Status Call::End(const absl::Status& st, size_t bytes_in, size_t bytes_out) {
  const CallGate::Options& o = gate_->o_;
  if (pooled_) {
    // The client's slot first, then the server's: a call admitted by the server's count once
    // this one has left must not find this one still counted against its client (with both
    // limits at 1 it would be refused as the client's, not the server's, overload).
    {
      absl::MutexLock l(&gate_->clients_mu_);
      auto it = gate_->client_calls_.find(client_);
      if (--it->second == 0) gate_->client_calls_.erase(it);
    }
    gate_->pool_calls_.fetch_sub(1, std::memory_order_acq_rel);
  }
  const absl::Duration took = absl::Now() - start_;
  if (o.metrics != nullptr) {
    o.metrics->RecordCall(method_, static_cast<int>(st.code()), absl::ToDoubleSeconds(took),
                          bytes_in, bytes_out);
  }
  const bool server_fault = st.code() == absl::StatusCode::kInternal ||
                            st.code() == absl::StatusCode::kDataLoss ||
                            st.code() == absl::StatusCode::kUnknown;
  if (o.log_calls || server_fault) {
    std::fprintf(stderr, "%s",
                 absl::StrFormat("kvq-server: %s tenant '%s': %s in %s, %d bytes in, %d out%s%s\n",
                                 method_, tenant_, absl::StatusCodeToString(st.code()),
                                 absl::FormatDuration(absl::Trunc(took, absl::Microseconds(1))),
                                 bytes_in, bytes_out, st.ok() ? "" : ": ", st.message())
                     .c_str());
  }
  grpc::Status out = ToGrpc(st);
  gate_->inflight_.fetch_sub(1, std::memory_order_acq_rel);
  return out;
}

}  // namespace kvq::server
