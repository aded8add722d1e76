// Models on the wire: core's model entries and bases <-> ModelInfo and RegisterBasisRequest,
// for the server (registration in, GetModel/GetBasis out) and clients (a calibrated basis
// registered; a served basis fetched to encode and decode codes themselves).
#pragma once

#include <cstdint>

#include "absl/status/statusor.h"
#include "kvq/core/basis.h"
#include "kvq/core/registry.h"
#include "kvq/v1/kvq.pb.h"

namespace kvq::wire {

// The identity and shape fields a manifest.json and a model.json share (core::ReadModelShape).
void ModelShapeToWire(const core::BasisManifest& m, v1::ModelInfo* info);
// A calibrated basis as a RegisterBasis request: the manifest's fields in ModelInfo and one F32
// tensor [kv_heads, head_dim, rank] per layer (plus, when the basis has them, the encode basis
// of an oblique pair and the query moments [kv_heads, head_dim, head_dim]).
void BasisToWire(const core::ModelBasis& basis, v1::RegisterBasisRequest* req);
// A registry entry as ModelInfo (every field, the server's block-format versions included).
void ModelToWire(const core::ModelEntry& e, int64_t live_sequences, v1::ModelInfo* out);
// A RegisterBasisRequest (or a GetBasis answer) as an entry, every field and tensor shape
// checked (INVALID_ARGUMENT naming the field); the values themselves are the registry's to
// check (core::CheckBasisTensors). The fingerprint is not computed here.
absl::StatusOr<core::ModelEntry> ModelFromWire(const v1::RegisterBasisRequest& req);

}  // namespace kvq::wire
