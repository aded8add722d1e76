#include "kvq/core/sealed_block.h"

#include <xxhash.h>

#include "absl/strings/str_cat.h"
#include "kvq/core/codec.h"
#include "kvq/core/status.h"

namespace kvq::core {

uint64_t SinkRows::Hash() const {
  const uint64_t k = XXH3_64bits(keys.data(), keys.size() * 2);
  return XXH3_64bits_withSeed(values.data(), values.size() * 2, k);
}

absl::Status SinkRows::Verify() const {
  if (Hash() == checksum) return absl::OkStatus();
  return absl::DataLossError(
      absl::StrCat("fp16 sink rows (", sinks, " tokens): checksum mismatch"));
}

absl::Status SealedBlock::Verify() const {
  std::vector<uint8_t> scratch;
  for (size_t i = 0; i + 1 < offsets.size(); ++i) {
    ASSIGN_OR_RETURN(
        std::span<const uint8_t> b,
        CpuView(*bytes.pool(), {bytes.data() + offsets[i], offsets[i + 1] - offsets[i]}, &scratch));
    RETURN_IF_ERROR(VerifyBlock(b));
  }
  return sinks ? sinks->Verify() : absl::OkStatus();
}

int64_t SealedBlock::stored_bytes() const {
  return static_cast<int64_t>(bytes.size() + offsets.size() * sizeof(uint32_t)) +
         (sinks ? sinks->bytes() : 0);
}

int64_t SealedBlock::key_bytes() const {
  int64_t n = 0;
  for (size_t i = 0; i + 1 < offsets.size(); i += 2) n += offsets[i + 1] - offsets[i];
  return n;
}

int64_t SealedBlock::value_bytes() const {
  return static_cast<int64_t>(bytes.size()) - key_bytes();
}

}  // namespace kvq::core
