// An encoded group of G tokens for every KV head (SealedBlock), immutable once made, and the
// exact fp16 rows of a sequence's attention sinks that travel with its first group (SinkRows).
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "absl/status/status.h"
#include "kvq/core/byte_pool.h"

namespace kvq::core {

// The exact rows of a sequence's attention sinks (CodecOptions::fp16_sinks): fp16 keys and
// values [kv_heads][S][d] each, which the first group's blocks hold stand-ins for. Made once,
// when that group is encoded, and never changed; the checksum (XXH3-64 over both) is
// verified wherever the blocks' are, so that a corrupted sink is detected, never served.
struct SinkRows {
  int sinks = 0, head_dim = 0;
  std::vector<uint16_t> keys, values;
  uint64_t checksum = 0;
  uint64_t Hash() const;
  absl::Status Verify() const;  // DATA_LOSS on a checksum mismatch
  int64_t bytes() const { return 2 * static_cast<int64_t>(keys.size() + values.size()); }
  const uint16_t* key(int h, int t) const {
    return keys.data() + (static_cast<size_t>(h) * sinks + t) * head_dim;
  }
  const uint16_t* value(int h, int t) const {
    return values.data() + (static_cast<size_t>(h) * sinks + t) * head_dim;
  }
};

// One encoded group of G tokens for every KV head, immutable once made: the unit of prefix
// sharing (several caches may hold the same block). For head h, the key block is
// bytes[offsets[2h], offsets[2h+1]) and the value block bytes[offsets[2h+1], offsets[2h+2]).
struct SealedBlock {
  explicit SealedBlock(BytePool* pool = nullptr) : bytes(pool) {}
  Bytes bytes;
  std::vector<uint32_t> offsets{0};
  // The sinks' exact rows, for a sequence's first group under a codec with fp16_sinks (they
  // travel with the group when it is shared); null otherwise.
  std::shared_ptr<const SinkRows> sinks;
  // Every block's checksum and the sinks'.
  absl::Status Verify() const;
  // What the group holds: its bytes, offsets and sinks.
  int64_t stored_bytes() const;
  std::span<const uint8_t> key(int h) const {
    return {bytes.data() + offsets[2 * h], offsets[2 * h + 1] - offsets[2 * h]};
  }
  std::span<const uint8_t> value(int h) const {
    return {bytes.data() + offsets[2 * h + 1], offsets[2 * h + 2] - offsets[2 * h + 1]};
  }
  int64_t key_bytes() const;    // sum over heads
  int64_t value_bytes() const;  // sum over heads
};
using SealedBlockPtr = std::shared_ptr<const SealedBlock>;

}  // namespace kvq::core
