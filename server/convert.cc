#include "server/convert.h"

#include <limits>

#include "absl/strings/str_cat.h"
#include "kvq/core/status.h"
#include "kvq/format/block_format.h"
#include "kvq/wire/codec_settings.h"

namespace kvq::server {

grpc::Status ToGrpc(const absl::Status& s) {
  if (s.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(s.code()), std::string(s.message()));
}

void SetItemStatus(const absl::Status& s, v1::ItemStatus* out) {
  out->set_code(static_cast<int>(s.code()));
  out->set_message(std::string(s.message()));
}

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

absl::Status QueriesToFloat(const v1::Tensor& t, absl::string_view field, std::vector<float>* q,
                            int* q_heads, int* n_q, int* d) {
  ASSIGN_OR_RETURN(core::TensorView v, ViewOf(t, field, 2, 3));
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

void ModelToProto(const core::ModelEntry& e, int64_t live_sequences, v1::ModelInfo* out) {
  const core::BasisManifest& m = e.manifest;
  out->set_model(m.model);
  out->set_version(m.version);
  out->set_layers(m.layers);
  out->set_kv_heads(m.kv_heads);
  out->set_q_heads(m.q_heads);
  out->set_head_dim(m.head_dim);
  out->set_basis_rank(e.has_basis ? m.rank : 0);
  out->set_has_basis(e.has_basis);
  out->set_fingerprint(m.fingerprint);
  out->set_rope_layout(m.rope_layout);
  out->set_channel_order(m.channel_order);
  out->set_kind(e.has_basis ? m.kind : "none");
  out->set_oblique(e.has_basis && e.basis.oblique());
  out->set_has_query_moment(e.has_basis && !e.basis.query_moment.empty());
  out->set_calibration_tokens(m.calibration_tokens);
  // Registered entries are valid codecs with a wire form (side_sign is not a setting).
  if (auto c = wire::CodecToWire(e.codec); c.ok()) *out->mutable_codec() = *std::move(c);
  out->set_live_sequences(live_sequences);
  out->set_block_version_min(format::kMinVersion);
  out->set_block_version_max(format::kMaxVersion);
}

void BasisToProto(const core::ModelEntry& e, v1::RegisterBasisRequest* out) {
  if (!e.has_basis) return;
  const core::BasisManifest& m = e.manifest;
  auto layers = [&](const std::vector<float>& all, int cols,
                    google::protobuf::RepeatedPtrField<v1::Tensor>* to) {
    if (all.empty()) return;
    const size_t per_layer = static_cast<size_t>(m.kv_heads) * m.head_dim * cols;
    for (int l = 0; l < m.layers; ++l) {
      FillTensor(all.data() + l * per_layer, {m.kv_heads, m.head_dim, cols}, v1::DTYPE_F32,
                 to->Add());
    }
  };
  layers(e.basis.u, m.rank, out->mutable_basis());
  layers(e.basis.encode, m.rank, out->mutable_encode_basis());
  layers(e.basis.query_moment, m.head_dim, out->mutable_query_moment());
}

absl::StatusOr<core::ModelEntry> ModelFromProto(const v1::RegisterBasisRequest& req) {
  const v1::ModelInfo& info = req.info();
  core::ModelEntry e;
  core::BasisManifest& m = e.manifest;
  m.model = info.model();
  m.version = info.version();
  m.layers = info.layers();
  m.kv_heads = info.kv_heads();
  m.q_heads = info.q_heads();
  m.head_dim = info.head_dim();
  m.rank = info.basis_rank();
  if (!info.rope_layout().empty()) m.rope_layout = info.rope_layout();
  if (!info.channel_order().empty()) m.channel_order = info.channel_order();
  if (!info.kind().empty()) m.kind = info.kind();
  m.calibration_tokens = info.calibration_tokens();
  e.has_basis = info.basis_rank() > 0;
  if (info.head_dim() < 1 || info.head_dim() > 512) {
    return absl::InvalidArgumentError(
        absl::StrCat("info.head_dim ", info.head_dim(), " must be in 1..512"));
  }
  if (info.basis_rank() < 0 || info.basis_rank() > info.head_dim()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "info.basis_rank ", info.basis_rank(), " must be in 0..head_dim (", info.head_dim(), ")"));
  }
  if (info.layers() < 1 || info.layers() > 1024) {
    return absl::InvalidArgumentError(
        absl::StrCat("info.layers ", info.layers(), " must be in 1..1024"));
  }
  // One F32 tensor [kv_heads, head_dim, cols] per layer of `list`, appended to *to; the
  // values themselves are checked by the registry (core::CheckBasisTensors).
  auto read_layers = [&](const google::protobuf::RepeatedPtrField<v1::Tensor>& list,
                         absl::string_view name, int cols, absl::string_view cols_name,
                         std::vector<float>* to) -> absl::Status {
    if (list.size() != info.layers()) {
      return absl::InvalidArgumentError(absl::StrCat(
          name, " holds ", list.size(), " tensors; expected one per layer (", info.layers(), ")"));
    }
    for (int l = 0; l < list.size(); ++l) {
      const std::string field = absl::StrCat(name, "[", l, "]");
      ASSIGN_OR_RETURN(core::TensorView v, ViewOf(list[l], field, 3, 3));
      if (v.dtype != core::DType::kF32 || v.shape[0] != info.kv_heads() ||
          v.shape[1] != info.head_dim() || v.shape[2] != cols) {
        return absl::InvalidArgumentError(
            absl::StrCat(field, " must be DTYPE_F32 [kv_heads=", info.kv_heads(),
                         ", head_dim=", info.head_dim(), ", ", cols_name, "=", cols, "]"));
      }
      const size_t n = static_cast<size_t>(v.numel());
      const size_t off = to->size();
      to->resize(off + n);
      core::ToFloat(core::DType::kF32, v.data, to->data() + off, n);
    }
    return absl::OkStatus();
  };
  if (e.has_basis) {
    e.basis.manifest = m;
    RETURN_IF_ERROR(read_layers(req.basis(), "basis", info.basis_rank(), "basis_rank", &e.basis.u));
    if (req.encode_basis_size() > 0) {
      RETURN_IF_ERROR(read_layers(req.encode_basis(), "encode_basis", info.basis_rank(),
                                  "basis_rank", &e.basis.encode));
    }
    if (req.query_moment_size() > 0) {
      RETURN_IF_ERROR(read_layers(req.query_moment(), "query_moment", info.head_dim(), "head_dim",
                                  &e.basis.query_moment));
    }
  } else if (req.basis_size() != 0 || req.encode_basis_size() != 0 ||
             req.query_moment_size() != 0) {
    return absl::InvalidArgumentError(
        "basis, encode_basis and query_moment must be empty when info.basis_rank is 0");
  }
  e.codec = core::Registry::DefaultCodec(m, e.has_basis);
  ASSIGN_OR_RETURN(e.codec, wire::MergeCodec(e.codec, info.codec(), "info.codec"));
  return e;
}

}  // namespace kvq::server
