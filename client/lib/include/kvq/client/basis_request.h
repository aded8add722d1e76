// A calibrated basis as a RegisterBasis request: the manifest's fields in ModelInfo and one F32
// tensor [kv_heads, head_dim, rank] per layer (plus, when the basis has them, the encode
// basis of an oblique pair and the query moments [kv_heads, head_dim, head_dim]).
// Header-only: callers link kvq_core already.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "kvq/core/basis.h"
#include "kvq/v1/kvq.pb.h"

namespace kvq::client {

// The identity and shape fields a manifest.json and a model.json share (core::ReadModelShape).
inline void FillModelShape(const core::BasisManifest& m, v1::ModelInfo* info) {
  info->set_model(m.model);
  info->set_version(m.version);
  info->set_layers(m.layers);
  info->set_kv_heads(m.kv_heads);
  info->set_q_heads(m.q_heads);
  info->set_head_dim(m.head_dim);
  info->set_rope_layout(m.rope_layout);
  info->set_channel_order(m.channel_order);
}

inline void FillBasisRequest(const core::ModelBasis& basis, v1::RegisterBasisRequest* req) {
  const core::BasisManifest& m = basis.manifest;
  v1::ModelInfo* info = req->mutable_info();
  FillModelShape(m, info);
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

}  // namespace kvq::client
