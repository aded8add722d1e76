// PutBlocks: the stream reactor that receives appends and applies them, message by message, to
// the store (Service::SpecOf translates each append).
#include <deque>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kvq/core/status.h"
#include "server/convert.h"
#include "server/service.h"

namespace kvq::server {

namespace {

// Reading overlaps applying: while a worker parses and encodes message i, message i+1 is
// already being received (at most one received message waits). Messages are applied strictly
// in order, by one worker at a time. The stream is read as raw bytes and parsed here: gRPC's
// typed reader reports a message that does not parse exactly as the client's end of stream,
// which would answer OK and silently drop that message and every later one.
// A stream that waits longer than --stream-idle-timeout for its next message is failed with
// DEADLINE_EXCEEDED (IdleStreams), which frees its --max-inflight slot.
class PutBlocksReactor final : public grpc::ServerReadReactor<grpc::ByteBuffer>, public IdleStream {
 public:
  PutBlocksReactor(Service* svc, grpc::CallbackServerContext* ctx, grpc::ByteBuffer* resp)
      : svc_(svc), resp_(resp), call_(svc->calls(), "PutBlocks", *ctx, CallKind::kPooled) {
    if (!call_.admission().ok()) {
      Done(call_.admission());
      return;
    }
    {
      absl::MutexLock l(&mu_);
      buf_ = std::make_unique<grpc::ByteBuffer>();
      reading_ = true;
    }
    svc_->idle_streams()->Add(this);
    StartRead(buf_.get());
  }

  bool ClaimIdle() override {
    absl::MutexLock l(&mu_);
    if (done_ || applying_ || !queue_.empty()) return false;
    done_ = true;
    return true;
  }

  void ExpireIdle(absl::Duration idle) override {
    const absl::Duration timeout = svc_->idle_streams()->timeout();
    const absl::Duration ms = absl::Trunc(idle, absl::Milliseconds(1));
    Done(absl::DeadlineExceededError(absl::StrCat(
        "PutBlocks stream idle for ", absl::FormatDuration(ms), " (--stream-idle-timeout ",
        absl::FormatDuration(timeout), "); the ", messages_seen_,
        " messages before were applied")));  // may delete this
  }

  void OnReadDone(bool ok) override {
    bool finish = false, submit = false;
    grpc::ByteBuffer* next = nullptr;
    {
      absl::MutexLock l(&mu_);
      reading_ = false;
      if (done_) {  // failed or timed out meanwhile: what arrives now is dropped
        buf_.reset();
        return;
      }
      if (!ok) {  // the client closed its side (or the call was cancelled)
        eof_ = true;
        finish = !applying_ && !done_;
        if (finish) done_ = true;
      } else {
        bytes_in_ += buf_->Length();
        queue_.push_back(std::move(buf_));
        if (!applying_) applying_ = submit = true;
        next = NextReadLocked();
      }
    }
    // The read is started before the drain is scheduled: a drain that fails a message calls
    // Finish, after which no read may be started.
    if (ok) svc_->idle_streams()->Touch(this);
    if (next) StartRead(next);
    if (submit) svc_->pool()->Submit([this] { Drain(); });
    if (finish) Succeed();  // may delete this
  }

  void OnDone() override { delete this; }

 private:
  static constexpr size_t kMaxQueued = 1;  // at most two messages in memory per stream

  // A buffer to read the next message into, when one should be read now.
  grpc::ByteBuffer* NextReadLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (reading_ || eof_ || done_ || queue_.size() >= kMaxQueued) return nullptr;
    reading_ = true;
    buf_ = std::make_unique<grpc::ByteBuffer>();
    return buf_.get();
  }

  // Runs on the pool: applies queued messages in order until the queue is empty.
  void Drain() {
    for (;;) {
      std::unique_ptr<grpc::ByteBuffer> msg;
      grpc::ByteBuffer* next = nullptr;
      bool finish = false;
      {
        absl::MutexLock l(&mu_);
        if (queue_.empty()) {
          applying_ = false;
          finish = eof_ && !done_;
          if (finish) done_ = true;
        } else {
          msg = std::move(queue_.front());
          queue_.pop_front();
          next = NextReadLocked();
        }
      }
      if (!msg) {
        if (finish) Succeed();  // may delete this
        return;
      }
      if (next) StartRead(next);
      absl::Status st = ParseAndApply(msg.get());
      svc_->idle_streams()->Touch(this);  // quiet time counts from the end of the work
      if (!st.ok()) {
        {
          absl::MutexLock l(&mu_);
          done_ = true;
          queue_.clear();
        }
        Done(st);  // may delete this
        return;
      }
    }
  }

  void Succeed() {
    for (const auto& [key, tokens] : lengths_) {
      auto* l = out_.add_lengths();
      l->set_sequence_id(key.first);
      l->set_layer(key.second);
      l->set_tokens(tokens);
    }
    Done(absl::OkStatus());
  }

  // Message `messages_seen_` of the stream (0-based). One that does not parse fails the
  // stream; the messages before it were whole and stay applied, as after any failed message.
  absl::Status ParseAndApply(grpc::ByteBuffer* bytes) {
    v1::PutBlocksRequest req;
    const int64_t index = messages_seen_++;
    if (!grpc::SerializationTraits<v1::PutBlocksRequest>::Deserialize(bytes, &req).ok()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "message ", index, " of the stream (0-based) is not a valid PutBlocksRequest; the ",
          index, " before it were applied"));
    }
    return Apply(req);
  }

  absl::Status Apply(const v1::PutBlocksRequest& req) {
    std::vector<core::AppendSpec> specs(req.appends_size());
    std::vector<Service::SpecStorage> storage(req.appends_size());
    for (int i = 0; i < req.appends_size(); ++i) {
      RETURN_IF_ERROR(
          svc_->SpecOf(req.appends(i), absl::StrCat("appends[", i, "]"), &specs[i], &storage[i]));
    }
    core::AppendOutcome out;
    RETURN_IF_ERROR(svc_->store()->Append(call_.tenant(), specs, &out));
    out_.set_messages(out_.messages() + 1);
    out_.set_appends(out_.appends() + req.appends_size());
    out_.set_tokens_written(out_.tokens_written() + out.tokens_written);
    out_.set_tokens_duplicate(out_.tokens_duplicate() + out.tokens_duplicate);
    out_.set_tokens_shared(out_.tokens_shared() + out.tokens_shared);
    for (const auto& [id, layer, tokens] : out.lengths) lengths_[{id, layer}] = tokens;
    return absl::OkStatus();
  }

  void Done(const absl::Status& st) {
    size_t in;
    {
      absl::MutexLock l(&mu_);
      in = bytes_in_;
    }
    svc_->idle_streams()->Remove(this);
    bool own_buffer = false;
    if (st.ok()) {
      grpc::SerializationTraits<v1::PutBlocksResponse>::Serialize(out_, resp_, &own_buffer);
    }
    Finish(call_.End(st, in, st.ok() ? out_.ByteSizeLong() : 0));
  }

  Service* svc_;
  grpc::ByteBuffer* resp_;
  v1::PutBlocksResponse out_;  // serialized into resp_ on success
  Call call_;
  absl::Mutex mu_;
  std::unique_ptr<grpc::ByteBuffer> buf_;  // the outstanding read's target
  std::deque<std::unique_ptr<grpc::ByteBuffer>> queue_ ABSL_GUARDED_BY(mu_);
  bool reading_ ABSL_GUARDED_BY(mu_) = false;   // a read is outstanding
  bool applying_ ABSL_GUARDED_BY(mu_) = false;  // a worker is draining the queue
  bool eof_ ABSL_GUARDED_BY(mu_) = false;       // no more messages will come
  bool done_ ABSL_GUARDED_BY(mu_) = false;      // Finish was (or is being) called
  size_t bytes_in_ ABSL_GUARDED_BY(mu_) = 0;
  // Touched only by the worker draining the queue (one at a time) and by Succeed, which
  // runs after the last drain.
  std::map<std::pair<std::string, int>, int64_t> lengths_;
  int64_t messages_seen_ = 0;
};

}  // namespace

grpc::ServerReadReactor<grpc::ByteBuffer>* Service::PutBlocks(grpc::CallbackServerContext* ctx,
                                                              grpc::ByteBuffer* resp) {
  return new PutBlocksReactor(this, ctx, resp);
}

}  // namespace kvq::server
