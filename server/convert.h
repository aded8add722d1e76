// Protobuf <-> core translation and wire-level validation. Every error names the field
// (e.g. "items[3].queries.data") and the limit it broke.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "grpcpp/support/status.h"
#include "kvq/core/codec.h"
#include "kvq/core/store.h"
#include "kvq/core/tensor.h"
#include "kvq/v1/kvq.pb.h"

namespace kvq::server {

inline constexpr int kMaxBatchItems = 4096;
inline constexpr int kMaxQueriesPerItem = 1024;

// The one mapping from core statuses to gRPC statuses (same code, same message).
grpc::Status ToGrpc(const absl::Status& s);
void SetItemStatus(const absl::Status& s, v1::ItemStatus* out);

absl::StatusOr<core::DType> FromProto(v1::DType t, absl::string_view field);
v1::DType ToProto(core::DType t);

// Checks dtype, rank (min..max), dims >= 1 and data size; returns a view of the bytes.
absl::StatusOr<core::TensorView> ViewOf(const v1::Tensor& t, absl::string_view field, int min_rank,
                                        int max_rank);

// Queries [q_heads, n_q, d] or [q_heads, d] -> fp32 contiguous; sets the three sizes.
absl::Status QueriesToFloat(const v1::Tensor& t, absl::string_view field, std::vector<float>* q,
                            int* q_heads, int* n_q, int* d);

// Writes fp32 values into a tensor of `dtype` (UNSPECIFIED: F32).
void FillTensor(const float* data, std::initializer_list<int64_t> shape, v1::DType dtype,
                v1::Tensor* out);

// Codec settings cross the wire through kvq/wire/codec_settings.h (MergeCodec, CodecToWire).
void ModelToProto(const core::ModelEntry& e, int64_t live_sequences, v1::ModelInfo* out);
// The entry's tensors as RegisterBasisRequest carries them (ModelFromProto's inverse): basis,
// encode_basis and query_moment, one F32 tensor per layer each (those the entry has).
void BasisToProto(const core::ModelEntry& e, v1::RegisterBasisRequest* out);
absl::StatusOr<core::ModelEntry> ModelFromProto(const v1::RegisterBasisRequest& req);

}  // namespace kvq::server
