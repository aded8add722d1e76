#include "kvq/wire/model.h"

#include "absl/strings/str_cat.h"
#include "kvq/core/status.h"
#include "kvq/format/block_format.h"
#include "kvq/wire/codec_settings.h"
#include "kvq/wire/tensor.h"

namespace kvq::wire {

void ModelShapeToWire(const core::BasisManifest& m, v1::ModelInfo* info) {
  info->set_model(m.model);
  info->set_version(m.version);
  info->set_layers(m.layers);
  info->set_kv_heads(m.kv_heads);
  info->set_q_heads(m.q_heads);
  info->set_head_dim(m.head_dim);
  info->set_rope_layout(m.rope_layout);
  info->set_channel_order(m.channel_order);
}

void BasisToWire(const core::ModelBasis& basis, v1::RegisterBasisRequest* req) {
  const core::BasisManifest& m = basis.manifest;
  v1::ModelInfo* info = req->mutable_info();
  ModelShapeToWire(m, info);
  info->set_basis_rank(m.rank);
  info->set_kind(m.kind);
  info->set_calibration_tokens(m.calibration_tokens);
  // One F32 tensor [kv_heads, head_dim, cols] per layer, from a [layers][kv][d][cols] array.
  auto fill = [&](const std::vector<float>& from, int64_t cols,
                  google::protobuf::RepeatedPtrField<v1::Tensor>* to) {
    to->Clear();
    if (from.empty()) return;
    const size_t per = static_cast<size_t>(m.kv_heads) * m.head_dim * cols;
    for (int l = 0; l < m.layers; ++l) {
      v1::Tensor* t = to->Add();
      t->set_dtype(v1::DTYPE_F32);
      for (int64_t d : {int64_t{m.kv_heads}, int64_t{m.head_dim}, cols}) t->add_shape(d);
      t->set_data(reinterpret_cast<const char*>(from.data() + l * per), per * sizeof(float));
    }
  };
  fill(basis.u, m.rank, req->mutable_basis());
  // An oblique pair's encode basis and the query moment travel with it when present: a
  // server given only U would score with the wrong side coefficients.
  fill(basis.encode, m.rank, req->mutable_encode_basis());
  fill(basis.query_moment, m.head_dim, req->mutable_query_moment());
}

void ModelToWire(const core::ModelEntry& e, int64_t live_sequences, v1::ModelInfo* out) {
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
  // Registered entries are valid codecs, so this cannot fail.
  if (auto c = CodecToWire(e.codec); c.ok()) *out->mutable_codec() = *std::move(c);
  out->set_live_sequences(live_sequences);
  out->set_block_version_min(format::kMinVersion);
  out->set_block_version_max(format::kMaxVersion);
}

absl::StatusOr<core::ModelEntry> ModelFromWire(const v1::RegisterBasisRequest& req) {
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
  ASSIGN_OR_RETURN(e.codec, MergeCodec(e.codec, info.codec(), "info.codec"));
  return e;
}

}  // namespace kvq::wire
