#include "kvq/wire/tensor.h"

#include <limits>

#include "absl/strings/str_cat.h"
#include "kvq/core/status.h"

namespace kvq::wire {

absl::StatusOr<core::DType> FromProto(v1::DType t, absl::string_view field) {
  switch (t) {
    case v1::DTYPE_F32:
      return core::DType::kF32;
    case v1::DTYPE_F16:
      return core::DType::kF16;
    case v1::DTYPE_BF16:
      return core::DType::kBF16;
    default:
      return absl::InvalidArgumentError(absl::StrCat(
          field, " must be DTYPE_F32, DTYPE_F16 or DTYPE_BF16 (got ", static_cast<int>(t), ")"));
  }
}

v1::DType ToProto(core::DType t) {
  switch (t) {
    case core::DType::kF16:
      return v1::DTYPE_F16;
    case core::DType::kBF16:
      return v1::DTYPE_BF16;
    default:
      return v1::DTYPE_F32;
  }
}

absl::StatusOr<core::TensorView> ViewOf(const v1::Tensor& t, absl::string_view field, int min_rank,
                                        int max_rank) {
  ASSIGN_OR_RETURN(core::DType dt, FromProto(t.dtype(), absl::StrCat(field, ".dtype")));
  if (t.shape_size() < min_rank || t.shape_size() > max_rank) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ".shape has ", t.shape_size(), " dimensions; expected ", min_rank,
                     min_rank == max_rank ? "" : absl::StrCat("..", max_rank)));
  }
  int64_t n = 1;
  for (int i = 0; i < t.shape_size(); ++i) {
    const int64_t s = t.shape(i);
    if (s < 1 || s > (int64_t{1} << 31)) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, ".shape[", i, "] = ", s, " must be in 1..2^31"));
    }
    if (n > std::numeric_limits<int64_t>::max() / s) {
      return absl::InvalidArgumentError(absl::StrCat(field, ".shape overflows"));
    }
    n *= s;
  }
  const int64_t want = n * static_cast<int64_t>(core::DTypeSize(dt));
  if (static_cast<int64_t>(t.data().size()) != want) {
    return absl::InvalidArgumentError(absl::StrCat(field, ".data holds ", t.data().size(),
                                                   " bytes; shape and dtype need ", want));
  }
  core::TensorView v;
  v.data = t.data().data();
  v.dtype = dt;
  v.rank = t.shape_size();
  int64_t stride = 1;
  for (int i = v.rank - 1; i >= 0; --i) {
    v.shape[i] = t.shape(i);
    v.stride[i] = stride;
    stride *= t.shape(i);
  }
  return v;
}

void FillTensor(const float* data, std::initializer_list<int64_t> shape, v1::DType dtype,
                v1::Tensor* out) {
  if (dtype == v1::DTYPE_UNSPECIFIED) dtype = v1::DTYPE_F32;
  out->set_dtype(dtype);
  out->clear_shape();
  size_t n = 1;
  for (int64_t s : shape) {
    out->add_shape(s);
    n *= static_cast<size_t>(s);
  }
  const core::DType dt = *FromProto(dtype, "");
  std::string* bytes = out->mutable_data();
  bytes->resize(n * core::DTypeSize(dt));
  core::FromFloat(dt, data, bytes->data(), n);
}

}  // namespace kvq::wire
