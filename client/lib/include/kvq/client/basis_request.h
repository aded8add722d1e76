// A calibrated basis as a RegisterBasis request: the manifest's fields in ModelInfo and one F32
// tensor [kv_heads, head_dim, rank] per layer. Header-only: callers link kvq_core already.
#pragma once

#include <cstddef>

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
  const size_t per = static_cast<size_t>(m.kv_heads) * m.head_dim * m.rank;
  req->clear_basis();
  for (int l = 0; l < m.layers; ++l) {
    v1::Tensor* t = req->add_basis();
    t->set_dtype(v1::DTYPE_F32);
    for (int64_t d : {m.kv_heads, m.head_dim, m.rank}) t->add_shape(d);
    t->set_data(reinterpret_cast<const char*>(basis.u.data() + l * per), per * sizeof(float));
  }
}

}  // namespace kvq::client
