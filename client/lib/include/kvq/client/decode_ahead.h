// A GetBlocks stream in codes decoded one message ahead on a thread of its own: the stream's
// callback hands each message over (Push) and goes back to receiving the next one while this
// one decodes, so that the transfer and the decode overlap (what the Python client does too).
// Decoded rows reach `on_rows` in stream order, on the decoding thread.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <mutex>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "kvq/client/codes.h"
#include "kvq/core/codec.h"
#include "kvq/core/tensor.h"
#include "kvq/v1/kvq.pb.h"

namespace kvq::client {

class DecodeAhead {
 public:
  // msg: the message as received; keys, values: its tokens [msg.start(), + n) decoded,
  // [kv_heads][n][head_dim] elements of the dtype each (the callee may take them). An error
  // ends the decoding: later messages are dropped and Finish returns it.
  using OnRows = std::function<absl::Status(
      const v1::GetBlocksResponse& msg, std::vector<uint8_t>& keys, std::vector<uint8_t>& values)>;

  // `codes` must outlive this; at most `depth` messages wait while one decodes.
  DecodeAhead(const ModelCodes& codes, core::DType dtype, OnRows on_rows, int depth = 2);
  ~DecodeAhead();  // Finish()
  DecodeAhead(const DecodeAhead&) = delete;
  DecodeAhead& operator=(const DecodeAhead&) = delete;

  // Whether `msg` is in codes: it names its layer's codec (a layer's first message), or an
  // earlier one of its layer did. A stream of rows decodes nothing.
  bool InCodes(const v1::GetBlocksResponse& msg) const;

  // Queues a message in codes, waiting while `depth` are queued; false once decoding failed
  // (the message is dropped; Finish says why). Not thread-safe: one stream's callback.
  bool Push(v1::GetBlocksResponse msg);

  // Waits until every queued message is decoded (or dropped after an error); the first error.
  absl::Status Finish();

 private:
  void Run();

  const ModelCodes& codes_;
  const core::DType dtype_;
  const OnRows on_rows_;
  const size_t depth_;
  std::map<int, core::CodecOptions> codecs_;  // per layer, from its first message (caller's)
  std::mutex mu_;
  std::condition_variable changed_;
  std::deque<std::pair<v1::GetBlocksResponse, core::CodecOptions>> queue_;  // guarded by mu_
  bool closed_ = false;                                                     // guarded by mu_
  absl::Status error_;                                                      // guarded by mu_
  std::thread thread_;
};

}  // namespace kvq::client
