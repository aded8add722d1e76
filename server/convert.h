// The server's own wire translation: statuses, query tensors, limits (the mappings of core's
// types that clients share are kvq/wire/: tensors, codecs, models, encoded groups). Every error
// names the field (e.g. "items[3].queries.data") and the limit it broke.
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

// A sequence id of 1..256 bytes (INVALID_ARGUMENT naming `field` otherwise).
absl::Status CheckId(const std::string& id, absl::string_view field);

// Queries [q_heads, n_q, d] or [q_heads, d] -> fp32 contiguous; sets the three sizes.
absl::Status QueriesToFloat(const v1::Tensor& t, absl::string_view field, std::vector<float>* q,
                            int* q_heads, int* n_q, int* d);

}  // namespace kvq::server
