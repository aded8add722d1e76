// Element types on the wire and in the full-precision window, and a strided tensor view.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace kvq::core {

enum class DType : uint8_t { kF32 = 0, kF16 = 1, kBF16 = 2 };

inline size_t DTypeSize(DType t) { return t == DType::kF32 ? 4 : 2; }
absl::string_view DTypeName(DType t);
absl::StatusOr<DType> ParseDType(absl::string_view name);  // "f32"/"fp32"/"float32", "f16", "bf16"

// Converts n elements of type `t` at `src` (little-endian) to fp32.
void ToFloat(DType t, const void* src, float* dst, size_t n);
// ToFloat, true when every element is finite and within +-format::kHalfMax (the fp16 range the
// block format's scales and zero points are stored in; kvq/core/half.h's bounds).
bool ToFloatStorable(DType t, const void* src, float* dst, size_t n);
// Converts n fp32 values to type `t` at `dst`.
void FromFloat(DType t, const float* src, void* dst, size_t n);

// A non-owning view of up to 4 dimensions; strides are in elements, so views can
// be non-contiguous (a head sliced out of [tokens, heads, dim], for instance).
struct TensorView {
  const void* data = nullptr;
  DType dtype = DType::kF32;
  int rank = 0;
  std::array<int64_t, 4> shape{};
  std::array<int64_t, 4> stride{};

  static TensorView Contiguous(const void* data, DType dtype, std::initializer_list<int64_t> shape);
  int64_t numel() const;
  bool contiguous() const;
  // Element at a multi-index, converted to fp32.
  float at(std::initializer_list<int64_t> idx) const;
  // Copies a contiguous row (last dimension) at the leading indices into dst as fp32.
  void RowToFloat(std::initializer_list<int64_t> lead, float* dst) const;
};

}  // namespace kvq::core
