#include "kvq/wire/encoded_groups.h"

#include <tuple>
#include <utility>

#include "absl/strings/str_cat.h"

namespace kvq::wire {

void EncodedToWire(core::EncodedGroups run, int kv_heads, int head_dim, v1::EncodedGroups* out) {
  out->Clear();
  out->set_blocks(std::move(run.bytes));
  out->mutable_block_bytes()->Add(run.sizes.begin(), run.sizes.end());
  out->set_basis_fingerprint(run.basis_fingerprint);
  for (const auto& [rows, tensor] : {std::pair{&run.sink_keys, out->mutable_sink_keys()},
                                     std::pair{&run.sink_values, out->mutable_sink_values()}}) {
    if (rows->empty()) continue;
    tensor->set_dtype(v1::DTYPE_F16);
    const int64_t sinks = static_cast<int64_t>(rows->size()) / (int64_t{kv_heads} * head_dim);
    for (int64_t dim : {int64_t{kv_heads}, sinks, int64_t{head_dim}}) tensor->add_shape(dim);
    tensor->set_data(reinterpret_cast<const char*>(rows->data()), 2 * rows->size());
  }
  if (run.sink_keys.empty()) out->clear_sink_keys();
  if (run.sink_values.empty()) out->clear_sink_values();
}

absl::Status EncodedFromWire(const v1::EncodedGroups& e, absl::string_view field,
                             core::EncodedGroupsView* out) {
  *out = core::EncodedGroupsView{};
  out->groups = -1;
  out->bytes = {reinterpret_cast<const uint8_t*>(e.blocks().data()), e.blocks().size()};
  out->sizes = {e.block_bytes().data(), static_cast<size_t>(e.block_bytes_size())};
  out->basis_fingerprint = e.basis_fingerprint();
  for (const auto& [sinks, view, name] :
       {std::tuple{&e.sink_keys(), &out->sink_keys, "sink_keys"},
        std::tuple{&e.sink_values(), &out->sink_values, "sink_values"}}) {
    if (sinks->data().empty()) continue;
    if (sinks->dtype() != v1::DTYPE_F16) {
      return absl::InvalidArgumentError(absl::StrCat(field, ".", name, ".dtype must be DTYPE_F16"));
    }
    *view = {reinterpret_cast<const uint8_t*>(sinks->data().data()), sinks->data().size()};
  }
  return absl::OkStatus();
}

}  // namespace kvq::wire
