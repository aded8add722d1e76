// Fuzzes codec.json's reader: arbitrary bytes as a registry entry's codec.json. Parsing never
// throws; a file that reads and validates writes back to the same codec.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "kvq/core/codec_json.h"
#include "nlohmann/json.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  const nlohmann::json j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) return 0;
  kvq::core::CodecOptions c;
  if (!kvq::core::CodecFromJson(j, "codec.json", &c).ok() || !c.Validate().ok()) return 0;
  kvq::core::CodecOptions back;
  if (!kvq::core::CodecFromJson(kvq::core::CodecToJson(c), "again", &back).ok()) std::abort();
  if (kvq::core::CodecToJson(back) != kvq::core::CodecToJson(c)) std::abort();
  return 0;
}
