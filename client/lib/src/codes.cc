#include "kvq/client/codes.h"

#include <cstring>

#include "absl/strings/str_cat.h"
#include "kvq/core/cache.h"
#include "kvq/core/encoded_groups.h"
#include "kvq/core/status.h"
#include "kvq/wire/codec_settings.h"
#include "kvq/wire/encoded_groups.h"
#include "kvq/wire/model.h"
#include "kvq/wire/tensor.h"

namespace kvq::client {
namespace {

// The rows of `cache` that stay rows (the incomplete group and the window, tokens
// [encoded_tokens, tokens)) as `a`'s keys and values in `dtype` (none when there are none).
absl::Status SetRows(const core::LayerCache& cache, core::DType dtype, v1::Append* a) {
  const int64_t E = cache.encoded_tokens(), T = cache.tokens();
  if (T == E) return absl::OkStatus();
  std::vector<uint8_t> wk, wv;
  RETURN_IF_ERROR(cache.DecodeAs(E, T, dtype, &wk, &wv));
  const int64_t kv = cache.kv_heads(), d = cache.options().head_dim;
  for (auto [rows, t] : {std::pair{&wk, a->mutable_keys()}, std::pair{&wv, a->mutable_values()}}) {
    t->set_dtype(wire::ToProto(dtype));
    for (int64_t dim : {kv, T - E, d}) t->add_shape(dim);
    t->set_data(rows->data(), rows->size());
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<ModelCodes>> ModelCodes::Create(
    const v1::RegisterBasisRequest& basis) {
  ASSIGN_OR_RETURN(core::ModelEntry e, wire::ModelFromWire(basis));
  e.manifest.fingerprint = basis.info().fingerprint();
  e.basis.manifest.fingerprint = e.manifest.fingerprint;
  return std::unique_ptr<ModelCodes>(new ModelCodes(std::move(e)));
}

absl::StatusOr<core::CodecOptions> ModelCodes::CodecOf(const v1::CodecSettings& settings) const {
  ASSIGN_OR_RETURN(core::CodecOptions c, wire::MergeCodec(entry_.codec, settings, "codec"));
  c.head_dim = entry_.manifest.head_dim;
  if (!entry_.has_basis) c.rank = 0;
  return c;
}

absl::StatusOr<std::vector<v1::Append>> ModelCodes::EncodeLayer(
    const std::string& sequence_id, int layer, const core::CodecOptions& codec,
    const core::TensorView& k, const core::TensorView& v, int64_t max_tokens) const {
  const core::BasisManifest& m = entry_.manifest;
  if (layer < 0 || layer >= m.layers) {
    return absl::InvalidArgumentError(
        absl::StrCat("layer ", layer, " must be in 0..", m.layers - 1));
  }
  core::LayerCache cache(codec, m.kv_heads, core::MakeLayerCodecTables(entry_, layer, codec));
  RETURN_IF_ERROR(cache.Append(k, v, 0));
  const int64_t G = codec.key_group, E = cache.encoded_tokens();
  const int64_t per = std::max<int64_t>(1, max_tokens / G);
  ASSIGN_OR_RETURN(v1::CodecSettings settings, wire::CodecToWire(codec));
  std::vector<v1::Append> out;
  for (int64_t g = 0; g == 0 || g < E / G; g += per) {
    v1::Append& a = out.emplace_back();
    a.set_sequence_id(sequence_id);
    a.set_layer(layer);
    a.set_start(g * G);
    if (g == 0) {
      a.set_model(m.model);
      a.set_basis_version(m.version);
      *a.mutable_codec() = settings;
    }
    core::EncodedGroups run;
    RETURN_IF_ERROR(cache.ExportGroups(g, std::min(E / G, g + per), &run));
    if (codec.rank > 0 && entry_.has_basis) run.basis_fingerprint = m.fingerprint;
    wire::EncodedToWire(std::move(run), m.kv_heads, m.head_dim, a.mutable_encoded());
  }
  RETURN_IF_ERROR(SetRows(cache, k.dtype, &out.back()));  // the last append carries the rows
  return out;
}

absl::StatusOr<std::unique_ptr<LayerEncoder>> ModelCodes::Encoder(
    int layer, const core::CodecOptions& codec) const {
  if (layer < 0 || layer >= entry_.manifest.layers) {
    return absl::InvalidArgumentError(
        absl::StrCat("layer ", layer, " must be in 0..", entry_.manifest.layers - 1));
  }
  if (codec.per_token_value_bits()) {
    return absl::FailedPreconditionError(
        "value_policy a2: its value widths follow the attention the server observes; only the "
        "server encodes such a sequence (send rows)");
  }
  return std::make_unique<LayerEncoder>(entry_, layer, codec);
}

LayerEncoder::LayerEncoder(const core::ModelEntry& model, int layer,
                           const core::CodecOptions& codec)
    : manifest_(&model.manifest),
      side_codes_(codec.rank > 0 && model.has_basis),
      layer_(layer),
      cache_(codec, model.manifest.kv_heads, core::MakeLayerCodecTables(model, layer, codec)) {}

absl::StatusOr<bool> LayerEncoder::Append(const core::TensorView& k, const core::TensorView& v,
                                          v1::Append* out) {
  const int64_t first_new = cache_.tokens();
  RETURN_IF_ERROR(cache_.Append(k, v, first_new));
  const int64_t G = cache_.options().key_group, E = cache_.encoded_tokens();
  const int64_t g0 = exported_;
  exported_ = E / G;
  // Codes replace the new rows the groups cover; they also cover rows the server holds, which
  // it would encode itself when these rows arrive. Send them only when that is fewer bytes.
  if (E <= first_new) return false;
  core::EncodedGroups run;
  RETURN_IF_ERROR(cache_.ExportGroups(g0, E / G, &run));
  const size_t row_bytes = static_cast<size_t>(manifest_->kv_heads) * manifest_->head_dim * 2 *
                           core::DTypeSize(k.dtype);  // a token's key and value rows
  if (run.bytes.size() >= static_cast<size_t>(E - first_new) * row_bytes) return false;
  if (side_codes_) run.basis_fingerprint = manifest_->fingerprint;
  out->set_start(g0 * G);
  wire::EncodedToWire(std::move(run), manifest_->kv_heads, manifest_->head_dim,
                      out->mutable_encoded());
  out->clear_keys();
  out->clear_values();
  RETURN_IF_ERROR(SetRows(cache_, k.dtype, out));  // all of them new rows: E > first_new
  return true;
}

absl::Status ModelCodes::Decode(const v1::GetBlocksResponse& msg, const core::CodecOptions& codec,
                                core::DType dtype, std::vector<uint8_t>* keys,
                                std::vector<uint8_t>* values) const {
  const core::BasisManifest& m = entry_.manifest;
  const int kv = m.kv_heads, G = codec.key_group;
  core::EncodedGroupsView run;
  RETURN_IF_ERROR(wire::EncodedFromWire(msg.encoded(), "encoded", &run));
  run.groups = static_cast<int64_t>(run.sizes.size()) / (2 * kv);
  run.first_group = msg.start() / G;
  // The window rows after the groups, if any.
  core::TensorView rk, rv;
  const bool rows = msg.has_keys() && msg.keys().shape_size() > 0 && msg.keys().shape(1) > 0;
  if (rows) {
    ASSIGN_OR_RETURN(rk, wire::ViewOf(msg.keys(), "keys", 3, 3));
    ASSIGN_OR_RETURN(rv, wire::ViewOf(msg.values(), "values", 3, 3));
  }
  // Decoding needs only the decode basis: no rounding factors (a Cholesky per head) are made.
  core::CodecOptions reads = codec;
  reads.metric_rounding = false;
  const auto tables = core::MakeLayerCodecTables(entry_, msg.layer(), reads);
  // What the server sends is checked as what a client sends is: never trusted.
  return core::DecodeMessage(codec, kv, tables->basis.empty() ? nullptr : tables->basis.data(), run,
                             rows ? &rk : nullptr, rows ? &rv : nullptr, dtype, "encoded", keys,
                             values);
}

}  // namespace kvq::client
