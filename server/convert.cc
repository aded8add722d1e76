#include "server/convert.h"

#include "absl/strings/str_cat.h"
#include "kvq/core/status.h"
#include "kvq/wire/tensor.h"

namespace kvq::server {

grpc::Status ToGrpc(const absl::Status& s) {
  if (s.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(s.code()), std::string(s.message()));
}

void SetItemStatus(const absl::Status& s, v1::ItemStatus* out) {
  out->set_code(static_cast<int>(s.code()));
  out->set_message(std::string(s.message()));
}

absl::Status QueriesToFloat(const v1::Tensor& t, absl::string_view field, std::vector<float>* q,
                            int* q_heads, int* n_q, int* d) {
  ASSIGN_OR_RETURN(core::TensorView v, wire::ViewOf(t, field, 2, 3));
  *q_heads = static_cast<int>(v.shape[0]);
  *n_q = v.rank == 3 ? static_cast<int>(v.shape[1]) : 1;
  *d = static_cast<int>(v.shape[v.rank - 1]);
  if (*n_q > kMaxQueriesPerItem) {
    return absl::InvalidArgumentError(absl::StrCat(field, ".shape[1] (queries) ", *n_q,
                                                   " exceeds the limit ", kMaxQueriesPerItem));
  }
  if (*q_heads > 4096 || *d > 512) {
    return absl::InvalidArgumentError(absl::StrCat(field, ".shape ", *q_heads, " heads x ", *d,
                                                   " dims exceeds 4096 heads or 512 dims"));
  }
  q->resize(v.numel());
  core::ToFloat(v.dtype, v.data, q->data(), q->size());
  return absl::OkStatus();
}

absl::Status CheckId(const std::string& id, absl::string_view field) {
  if (id.empty() || id.size() > 256) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, " must be 1..256 bytes (got ", id.size(), ")"));
  }
  return absl::OkStatus();
}

}  // namespace kvq::server
