// Tensors on the wire: v1::DType and v1::Tensor <-> core's dtypes and views, with the one
// validation of a tensor a peer sent (dtype, rank, dims, data size), for the server and clients.
#pragma once

#include <cstdint>
#include <initializer_list>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "kvq/core/tensor.h"
#include "kvq/v1/kvq.pb.h"

namespace kvq::wire {

absl::StatusOr<core::DType> FromProto(v1::DType t, absl::string_view field);
v1::DType ToProto(core::DType t);

// Checks dtype, rank (min..max), dims >= 1 and data size; returns a view of the bytes. Errors
// name `field` and the limit.
absl::StatusOr<core::TensorView> ViewOf(const v1::Tensor& t, absl::string_view field, int min_rank,
                                        int max_rank);

// Writes fp32 values into a tensor of `dtype` (UNSPECIFIED: F32).
void FillTensor(const float* data, std::initializer_list<int64_t> shape, v1::DType dtype,
                v1::Tensor* out);

}  // namespace kvq::wire
