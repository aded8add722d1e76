// Fails client streams that wait too long for their next message, so that a client which
// opens a stream and goes quiet cannot hold a --max-inflight slot (and its buffers) forever.
#pragma once

#include <thread>

#include "absl/container/flat_hash_map.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace kvq::server {

// What a stream gives the watch.
class IdleStream {
 public:
  virtual ~IdleStream() = default;
  // Called with the watch's lock held once the stream has been quiet for the timeout: true
  // when it is waiting for a message (not applying one, not finishing) and takes the expiry,
  // so that nothing else will finish it; false leaves it as it is.
  virtual bool ClaimIdle() = 0;
  // Fails the stream; called once, outside the watch's lock, after ClaimIdle returned true.
  virtual void ExpireIdle(absl::Duration idle) = 0;
};

class IdleStreams {
 public:
  // timeout zero: streams never expire (and no thread runs).
  explicit IdleStreams(absl::Duration timeout);
  ~IdleStreams();
  IdleStreams(const IdleStreams&) = delete;
  IdleStreams& operator=(const IdleStreams&) = delete;

  absl::Duration timeout() const { return timeout_; }
  // A stream starts being watched, as of now.
  void Add(IdleStream* s);
  // The stream received or applied a message: its quiet time starts again.
  void Touch(IdleStream* s);
  // The stream is finishing: it is never claimed after this returns (call it before the
  // stream can be deleted; a stream not watched is fine).
  void Remove(IdleStream* s);

 private:
  void Run();

  const absl::Duration timeout_;
  absl::Mutex mu_;
  absl::flat_hash_map<IdleStream*, absl::Time> active_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

}  // namespace kvq::server
