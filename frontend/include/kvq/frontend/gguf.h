// A reader for GGUF model files (versions 2 and 3): header, typed metadata, tensor infos and
// the aligned data section, plus dequantization to fp32 of the tensor types kvq meets
// (F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q6_K).
//
// The file is memory-mapped read-only (or held in memory: FromBytes); tensor data pointers
// stay valid while the GgufFile lives. Every length and offset read from the file is
// bounds-checked, and every count that sizes an allocation (tensors, array elements, a
// tensor's elements) is bounded by the bytes the file has left: a truncated or malformed
// file is an INVALID_ARGUMENT / DATA_LOSS error naming what is wrong, an unsupported tensor
// type is UNIMPLEMENTED, never a crash or an allocation out of proportion to the file.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <variant>
#include <vector>

#include "absl/status/statusor.h"

namespace kvq::frontend {

// GGML tensor type ids as stored in GGUF tensor infos.
enum class GgmlType : uint32_t {
  kF32 = 0,
  kF16 = 1,
  kQ4_0 = 2,
  kQ4_1 = 3,
  kQ5_0 = 6,
  kQ5_1 = 7,
  kQ8_0 = 8,
  kQ8_1 = 9,
  kQ2_K = 10,
  kQ3_K = 11,
  kQ4_K = 12,
  kQ5_K = 13,
  kQ6_K = 14,
  kQ8_K = 15,
  kBF16 = 30,
};
const char* GgmlTypeName(uint32_t type);

// A metadata value. Arrays hold scalars or strings of one element type.
struct GgufValue {
  using Array = std::vector<GgufValue>;
  std::variant<uint64_t, int64_t, double, bool, std::string, std::shared_ptr<Array>> v;
  uint32_t type = 0;  // GGUF value type id (0..12)
};

struct GgufTensorInfo {
  std::string name;
  std::vector<int64_t> dims;  // ne[0] is the innermost (contiguous) dimension
  uint32_t type = 0;
  uint64_t offset = 0;  // relative to the data section
  int64_t numel() const;
  // Bytes of the tensor's data, for the supported types; 0 when the type is unknown.
  uint64_t bytes() const;
  const uint8_t* data = nullptr;  // into the mapped file
};

class GgufFile {
 public:
  static absl::StatusOr<std::unique_ptr<GgufFile>> Open(const std::string& path);
  // The same over bytes in memory (kept by the GgufFile; `name` stands for the path in
  // errors). The fuzz target reads through it.
  static absl::StatusOr<std::unique_ptr<GgufFile>> FromBytes(std::string bytes,
                                                             const std::string& name = "<memory>");
  ~GgufFile();

  uint32_t version() const { return version_; }
  uint64_t alignment() const { return alignment_; }
  const std::map<std::string, GgufValue>& metadata() const { return meta_; }
  const std::vector<GgufTensorInfo>& tensors() const { return tensors_; }
  const GgufTensorInfo* FindTensor(const std::string& name) const;

  // Typed metadata accessors: NOT_FOUND when absent, INVALID_ARGUMENT on a type mismatch.
  absl::StatusOr<int64_t> GetInt(const std::string& key) const;
  absl::StatusOr<double> GetFloat(const std::string& key) const;
  absl::StatusOr<bool> GetBool(const std::string& key) const;
  absl::StatusOr<std::string> GetString(const std::string& key) const;
  absl::StatusOr<std::vector<std::string>> GetStringArray(const std::string& key) const;
  absl::StatusOr<std::vector<int64_t>> GetIntArray(const std::string& key) const;

  // Dequantizes the whole tensor to fp32 (numel values, ne[0] fastest).
  absl::StatusOr<std::vector<float>> Dequantize(const std::string& name) const;

 private:
  GgufFile() = default;
  absl::Status Parse();
  std::string path_;
  std::string owned_;    // FromBytes: the bytes (base_ points into them; nothing mapped)
  bool mapped_ = false;  // Open: base_ is an mmap of size_ bytes
  const uint8_t* base_ = nullptr;
  size_t size_ = 0;
  uint32_t version_ = 0;
  uint64_t alignment_ = 32;
  std::map<std::string, GgufValue> meta_;
  std::vector<GgufTensorInfo> tensors_;
};

// Dequantizes n elements (a multiple of the type's block size) of `type` from src.
// UNIMPLEMENTED for types this reader does not decode.
absl::Status DequantizeRow(uint32_t type, const uint8_t* src, int64_t n, float* dst);
// Block size (elements) and block bytes of a type; {0, 0} when unknown.
std::pair<int64_t, int64_t> GgmlBlockLayout(uint32_t type);

// Serializes a GGUF file in memory (for tests and tools): metadata and tensors with raw bytes.
class GgufWriter {
 public:
  void AddString(const std::string& key, const std::string& value);
  void AddUint32(const std::string& key, uint32_t value);
  void AddFloat32(const std::string& key, float value);
  void AddStringArray(const std::string& key, const std::vector<std::string>& values);
  void AddTensor(const std::string& name, std::vector<int64_t> dims, uint32_t type,
                 std::vector<uint8_t> bytes);
  std::vector<uint8_t> Finish(uint64_t alignment = 32) const;

 private:
  std::vector<uint8_t> kv_;
  uint64_t n_kv_ = 0;
  struct T {
    std::string name;
    std::vector<int64_t> dims;
    uint32_t type;
    std::vector<uint8_t> bytes;
  };
  std::vector<T> tensors_;
};

}  // namespace kvq::frontend
