// GetBlocks: the stream reactor that reads a sequence's layers chunk by chunk, decoded (rows)
// or as stored (codes on the wire), with the flow control of a server write reactor.
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kvq/core/status.h"
#include "kvq/format/block_format.h"
#include "kvq/wire/codec_settings.h"
#include "kvq/wire/encoded_groups.h"
#include "kvq/wire/tensor.h"
#include "server/convert.h"
#include "server/service.h"

namespace kvq::server {

namespace {

class GetBlocksReactor final : public grpc::ServerWriteReactor<v1::GetBlocksResponse> {
 public:
  GetBlocksReactor(Service* svc, grpc::CallbackServerContext* ctx, const v1::GetBlocksRequest* req)
      : svc_(svc),
        req_(*req),
        call_(svc->calls(), "GetBlocks", *ctx, CallKind::kPooled),
        bytes_in_(req->ByteSizeLong()) {
    if (!call_.admission().ok()) {
      Done(call_.admission());
      return;
    }
    svc_->pool()->Submit([this] { Next(); });
  }

  void OnWriteDone(bool ok) override {
    if (!ok) {
      Done(absl::CancelledError("the client went away"));
      return;
    }
    bytes_out_ += msg_.ByteSizeLong();
    svc_->pool()->Submit([this] { Next(); });
  }

  void OnDone() override { delete this; }

 private:
  // Runs on the pool: writes the next chunk, or finishes.
  void Next() {
    absl::Status st;
    {
      // Successive Next()s run on any pool worker, one at a time: each is submitted from
      // OnWriteDone after the previous one's write. That order passes through gRPC, which
      // ThreadSanitizer cannot see into; this uncontended lock states it where it can. (Finish,
      // in Done, stays outside: OnDone may delete the reactor, and the lock with it.)
      std::lock_guard<std::mutex> l(producing_);
      st = Produce();
      if (st.ok() && !finished_) {
        StartWrite(&msg_);
        return;
      }
    }
    Done(st);
  }

  absl::Status Produce() {
    if (!started_) {
      started_ = true;
      RETURN_IF_ERROR(call_.StillWanted());
      RETURN_IF_ERROR(CheckId(req_.sequence_id(), "sequence_id"));
      if (req_.max_tokens_per_message() < 0) {
        return absl::InvalidArgumentError("max_tokens_per_message must be >= 0 (0: 4096)");
      }
      chunk_ = req_.max_tokens_per_message() ? req_.max_tokens_per_message() : 4096;
      if (req_.from_token() < 0 || req_.to_token() < 0 ||
          (req_.to_token() > 0 && req_.to_token() < req_.from_token())) {
        return absl::InvalidArgumentError(
            absl::StrCat("from_token ", req_.from_token(), " and to_token ", req_.to_token(),
                         " must be >= 0 with from_token <= to_token (to_token 0: to the end)"));
      }
      // Decoded straight into the wire dtype (unspecified: fp32).
      wire_dtype_ = req_.dtype() == v1::DTYPE_UNSPECIFIED ? v1::DTYPE_F32 : req_.dtype();
      ASSIGN_OR_RETURN(dtype_, wire::FromProto(wire_dtype_, "dtype"));
      ASSIGN_OR_RETURN(core::SequenceInfo info,
                       svc_->store()->Describe(call_.tenant(), req_.sequence_id()));
      if (req_.basis_version() != 0 && req_.basis_version() != info.model->manifest.version) {
        return absl::FailedPreconditionError(
            absl::StrCat("basis_version ", req_.basis_version(), ": sequence '", req_.sequence_id(),
                         "' is pinned to version ", info.model->manifest.version));
      }
      kv_heads_ = info.model->manifest.kv_heads;
      d_ = info.model->manifest.head_dim;
      version_ = info.model->manifest.version;
      group_ = info.codec.key_group;
      if (req_.codes()) {
        model_ = info.model->manifest.model;
        ASSIGN_OR_RETURN(codec_, wire::CodecToWire(info.codec));
      }
      if (info.codec.rank > 0) fingerprint_ = info.model->manifest.fingerprint;
      if (req_.codes() && req_.max_block_version() < format::kMinVersion) {
        return absl::FailedPreconditionError(absl::StrCat(
            "max_block_version ", req_.max_block_version(),
            ": codes need a client that reads block-format versions this server writes (",
            format::kMinVersion, " to ", format::kMaxVersion, ")"));
      }
      // Every layer is read up to its length now (taken under the sequence's lock in one
      // step): appends that land while the stream is under way are not seen.
      snapshot_ = info.layer_tokens;
      const int n_layers = info.model->manifest.layers;
      if (req_.layers_size() == 0) {
        for (int l = 0; l < n_layers; ++l) layers_.push_back(l);
      }
      for (int i = 0; i < req_.layers_size(); ++i) {
        if (req_.layers(i) < 0 || req_.layers(i) >= n_layers) {
          return absl::InvalidArgumentError(
              absl::StrCat("layers[", i, "] = ", req_.layers(i), " must be in 0..", n_layers - 1));
        }
        layers_.push_back(req_.layers(i));
      }
    }
    if (req_.codes()) return ProduceCodes();
    // The layer's range is decoded a window at a time (at most kDecodeWindow tokens, or one
    // message's), so that a stream holds a bounded fp32 copy however long the layer and
    // however slowly its client reads. Next layer once this one's range is sent (an empty
    // range of a non-empty layer sends one message with n = 0; an empty layer sends none).
    while (offset_ >= decoded_) {
      if (layer_open_ && first_ + decoded_ < end_) {  // the next window of this layer
        RETURN_IF_ERROR(DecodeWindow(first_ + decoded_));
        break;
      }
      if (layer_open_ && !layer_sent_ && tokens_ > 0) break;  // its one empty message
      if (next_layer_ >= layers_.size()) {
        finished_ = true;
        return absl::OkStatus();
      }
      layer_ = layers_[next_layer_++];
      layer_open_ = true;
      layer_sent_ = false;
      const int64_t length = layer_ < static_cast<int>(snapshot_.size()) ? snapshot_[layer_] : 0;
      length_ = length;
      end_ = req_.to_token() > 0 ? std::min<int64_t>(req_.to_token(), length) : length;
      if (req_.from_token() == 0 && end_ == length) {
        // The whole layer: every block checked before its first message goes out.
        RETURN_IF_ERROR(svc_->store()->VerifyLayer(At()));
      }
      offset_ = decoded_ = 0;
      RETURN_IF_ERROR(DecodeWindow(req_.from_token()));
      end_ = std::min(end_, tokens_);
      if (tokens_ == 0) layer_open_ = false;  // an empty layer sends nothing
    }
    layer_sent_ = true;
    const int64_t n = std::min<int64_t>(chunk_, decoded_ - offset_);
    msg_.Clear();
    msg_.set_layer(layer_);
    msg_.set_start(first_ + offset_);
    msg_.set_layer_tokens(tokens_);
    msg_.set_basis_version(version_);
    CopyRows(keys_, n, msg_.mutable_keys());
    CopyRows(values_, n, msg_.mutable_values());
    offset_ += n;
    return absl::OkStatus();
  }

  // Codes: the next message of whole groups (at most chunk_ tokens of them, at least one group),
  // then the window's rows, layer after layer.
  absl::Status ProduceCodes() {
    for (;;) {
      if (layer_open_ && (pos_ < end_ || !layer_sent_)) break;
      if (next_layer_ >= layers_.size()) {
        finished_ = true;
        return absl::OkStatus();
      }
      layer_ = layers_[next_layer_++];
      length_ = layer_ < static_cast<int>(snapshot_.size()) ? snapshot_[layer_] : 0;
      end_ = req_.to_token() > 0 ? std::min<int64_t>(req_.to_token(), length_) : length_;
      pos_ = std::min(req_.from_token(), end_);
      layer_open_ = length_ > 0;  // an empty layer sends nothing
      layer_sent_ = false;
      if (layer_open_ && req_.from_token() == 0 && end_ == length_) {
        RETURN_IF_ERROR(svc_->store()->VerifyLayer(At()));
      }
    }
    const int64_t chunk = std::max<int64_t>(group_, chunk_ / group_ * group_);
    const int64_t to = end_ - pos_ <= chunk ? end_ : pos_ + chunk;
    core::EncodedGroups groups;
    ASSIGN_OR_RETURN(
        const core::RangeRead found,
        svc_->store()->ReadEncoded(At(), {pos_, to}, dtype_, &groups, &keys_, &values_));
    tokens_ = found.tokens;
    const int64_t first = found.first;
    const std::vector<size_t> at = core::RunOffsets(core::ViewOf(groups));
    for (size_t b = 0; b < groups.sizes.size(); ++b) {
      const int version = static_cast<uint8_t>(groups.bytes[at[b] + format::kVersionAt]);
      if (version > req_.max_block_version()) {
        return absl::FailedPreconditionError(
            absl::StrCat("layer ", layer_, " holds blocks of block-format version ", version,
                         "; the client reads versions up to ", req_.max_block_version(),
                         " (max_block_version)"));
      }
    }
    const bool first_of_layer = !layer_sent_;
    layer_sent_ = true;
    pos_ = std::max(to, first + groups.groups * group_);
    msg_.Clear();
    if (first_of_layer) {
      msg_.set_model(model_);
      *msg_.mutable_codec() = codec_;
    }
    msg_.set_layer(layer_);
    msg_.set_start(first);
    msg_.set_layer_tokens(std::min(tokens_, length_));
    msg_.set_basis_version(version_);
    if (groups.groups > 0) groups.basis_fingerprint = fingerprint_;
    wire::EncodedToWire(std::move(groups), kv_heads_, d_, msg_.mutable_encoded());
    // The window rows: all of them, whatever chunk_ (at most R + G - 1 tokens).
    decoded_ =
        static_cast<int64_t>(keys_.size() / core::DTypeSize(dtype_)) / (int64_t{kv_heads_} * d_);
    offset_ = 0;
    CopyRows(keys_, decoded_, msg_.mutable_keys());
    CopyRows(values_, decoded_, msg_.mutable_values());
    return absl::OkStatus();
  }

  // Tokens [offset_, offset_ + n) of every head of the decoded window `rows` ([kv][decoded_][d]
  // elements of dtype_) as a [kv][n][d] tensor: the bytes as decoded, one copy per head.
  void CopyRows(const std::vector<uint8_t>& rows, int64_t n, v1::Tensor* out) const {
    const size_t row = static_cast<size_t>(d_) * core::DTypeSize(dtype_);
    out->set_dtype(wire_dtype_);
    for (int64_t dim : {int64_t{kv_heads_}, n, int64_t{d_}}) out->add_shape(dim);
    std::string* bytes = out->mutable_data();
    bytes->resize(static_cast<size_t>(kv_heads_) * n * row);
    if (n == 0) return;  // an empty range's one message: rows may be empty (null data())
    for (int h = 0; h < kv_heads_; ++h) {
      std::memcpy(bytes->data() + h * n * row,
                  rows.data() + (static_cast<size_t>(h) * decoded_ + offset_) * row, n * row);
    }
  }

  // Decodes tokens [from, min(end_, from + window)) of the current layer into keys_/values_
  // (first_: where they start; tokens_: the layer's length).
  absl::Status DecodeWindow(int64_t from) {
    // Whole messages per window: only the range's last message is short.
    const int64_t window = std::max<int64_t>(chunk_, kDecodeWindow / chunk_ * chunk_);
    // (end_ - from, not from + window: a request's start may lie near INT64_MAX)
    const core::TokenRange range{from, end_ - from <= window ? end_ : from + window};
    ASSIGN_OR_RETURN(const core::RangeRead found,
                     svc_->store()->DecodeAs(At(), range, dtype_, &keys_, &values_));
    first_ = found.first;
    tokens_ = std::min(found.tokens, length_);  // appends after the call started are not seen
    decoded_ =
        static_cast<int64_t>(keys_.size() / core::DTypeSize(dtype_)) / (int64_t{kv_heads_} * d_);
    offset_ = 0;
    return absl::OkStatus();
  }

  // The layer being read, as the store names it.
  core::LayerRef At() const {
    return {call_.tenant(), req_.sequence_id(), layer_, req_.basis_version()};
  }

  void Done(const absl::Status& st) { Finish(call_.End(st, bytes_in_, bytes_out_)); }

  Service* svc_;
  const v1::GetBlocksRequest req_;
  Call call_;
  size_t bytes_in_ = 0, bytes_out_ = 0;
  std::mutex producing_;  // held by Produce (see Next)
  bool started_ = false, finished_ = false;
  int64_t chunk_ = 4096;
  int kv_heads_ = 0, d_ = 0, version_ = 0;
  std::vector<int> layers_;
  std::vector<int64_t> snapshot_;  // every layer's length when the call started
  size_t next_layer_ = 0;
  int layer_ = 0;
  // The current layer: its length (tokens_, at most length_, its length when the call
  // started), the end of the requested range (end_), the window decoded ([first_, first_ +
  // decoded_)), the next message's offset in it, and whether a message of it went out.
  // Tokens decoded per window: about this many, a whole number of messages (at least one).
  static constexpr int64_t kDecodeWindow = 1024;
  int64_t offset_ = 0, tokens_ = 0, first_ = 0, decoded_ = 0, end_ = 0, length_ = 0;
  // Codes: the codec's group size and the next token of the current layer to send.
  int64_t group_ = 1, pos_ = 0;
  std::string fingerprint_;  // of the basis the side codes use ("" at rank 0)
  std::string model_;        // the sequence's model and codec, for a client's decoder
  v1::CodecSettings codec_;
  bool layer_open_ = false, layer_sent_ = true;
  v1::DType wire_dtype_ = v1::DTYPE_F32;
  core::DType dtype_ = core::DType::kF32;
  std::vector<uint8_t> keys_, values_;  // the window, [kv][decoded_][d] of dtype_
  v1::GetBlocksResponse msg_;
};

}  // namespace

grpc::ServerWriteReactor<v1::GetBlocksResponse>* Service::GetBlocks(
    grpc::CallbackServerContext* ctx, const v1::GetBlocksRequest* req) {
  return new GetBlocksReactor(this, ctx, req);
}

}  // namespace kvq::server
