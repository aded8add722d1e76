// DecodeAhead: a GetBlocks stream in codes decoded on a thread beside the receiving one.
#include "kvq/client/decode_ahead.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "kvq/core/status.h"

namespace kvq::client {

DecodeAhead::DecodeAhead(const ModelCodes& codes, core::DType dtype, OnRows on_rows, int depth)
    : codes_(codes),
      dtype_(dtype),
      on_rows_(std::move(on_rows)),
      depth_(static_cast<size_t>(depth < 1 ? 1 : depth)),
      thread_([this] { Run(); }) {}

DecodeAhead::~DecodeAhead() { (void)Finish(); }

bool DecodeAhead::InCodes(const v1::GetBlocksResponse& msg) const {
  return msg.has_codec() || codecs_.count(msg.layer()) > 0;
}

bool DecodeAhead::Push(v1::GetBlocksResponse msg) {
  // The codec is read here, in stream order, so that the decoding thread needs no map.
  absl::Status st;
  if (msg.has_codec()) {
    absl::StatusOr<core::CodecOptions> c = codes_.CodecOf(msg.codec());
    if (c.ok()) {
      codecs_[msg.layer()] = *c;
    } else {
      st = c.status();
    }
  }
  auto known = codecs_.find(msg.layer());
  if (st.ok() && known == codecs_.end()) {
    st = absl::DataLossError(
        absl::StrCat("GetBlocks: layer ", msg.layer(), " in codes without its codec"));
  }
  std::unique_lock<std::mutex> l(mu_);
  if (!st.ok() && error_.ok()) error_ = st;
  changed_.wait(l, [&] { return queue_.size() < depth_ || !error_.ok() || closed_; });
  if (!error_.ok() || closed_) return false;
  queue_.emplace_back(std::move(msg), known->second);
  changed_.notify_all();
  return true;
}

absl::Status DecodeAhead::Finish() {
  {
    std::lock_guard<std::mutex> l(mu_);
    closed_ = true;
    changed_.notify_all();
  }
  if (thread_.joinable()) thread_.join();
  std::lock_guard<std::mutex> l(mu_);
  return error_;
}

void DecodeAhead::Run() {
  std::vector<uint8_t> keys, values;
  for (;;) {
    std::pair<v1::GetBlocksResponse, core::CodecOptions> item;
    {
      std::unique_lock<std::mutex> l(mu_);
      changed_.wait(l, [&] { return !queue_.empty() || closed_; });
      if (queue_.empty()) return;  // closed and drained
      item = std::move(queue_.front());
      queue_.pop_front();
      changed_.notify_all();
      if (!error_.ok()) continue;  // drop what follows an error
    }
    absl::Status st = codes_.Decode(item.first, item.second, dtype_, &keys, &values);
    if (st.ok()) st = on_rows_(item.first, keys, values);
    if (!st.ok()) {
      std::lock_guard<std::mutex> l(mu_);
      if (error_.ok()) error_ = st;
      changed_.notify_all();
    }
  }
}

}  // namespace kvq::client
