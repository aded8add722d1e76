// A registry entry folder (what kvq-calibrate writes, the layout kvq-server loads at start)
// as a RegisterBasis request: manifest.json + basis.safetensors (with basis), or model.json
// (a model served without basis), plus an optional codec.json of codec defaults.
#pragma once

#include <string>

#include "absl/status/statusor.h"
#include "kvq/v1/kvq.pb.h"

namespace kvq::client {

absl::StatusOr<v1::RegisterBasisRequest> ReadRegistryEntry(const std::string& dir);

}  // namespace kvq::client
