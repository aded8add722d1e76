// Encoded groups on the wire: core's runs (kvq/core/encoded_groups.h) <-> v1::EncodedGroups,
// for the server (PutBlocks in, GetBlocks out) and clients (the other way round).
#pragma once

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "kvq/core/encoded_groups.h"
#include "kvq/v1/kvq.pb.h"

namespace kvq::wire {

// A run as its message: blocks, sizes, the sinks' rows as F16 [kv_heads, S, head_dim] tensors
// (when it has them) and the basis fingerprint. The blocks are moved into the message, not
// copied (pass std::move(run), or a copy to keep one).
void EncodedToWire(core::EncodedGroups run, int kv_heads, int head_dim, v1::EncodedGroups* out);
// A view of a message's run, nothing copied (it points into `e`): groups -1 (as many as its
// sizes hold, which only the receiver of the sequence's shape can tell) and first_group 0 (the
// append's start places it). Sink tensors must be F16 (INVALID_ARGUMENT naming field.sink_keys
// or .sink_values); everything else is CheckEncodedGroups' to check.
absl::Status EncodedFromWire(const v1::EncodedGroups& e, absl::string_view field,
                             core::EncodedGroupsView* out);

}  // namespace kvq::wire
