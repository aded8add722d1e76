#include "kvq/core/tensor.h"

#include <cstring>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "kvq/core/half.h"

namespace kvq::core {

absl::string_view DTypeName(DType t) {
  switch (t) {
    case DType::kF32:
      return "f32";
    case DType::kF16:
      return "f16";
    case DType::kBF16:
      return "bf16";
  }
  return "?";
}

absl::StatusOr<DType> ParseDType(absl::string_view name) {
  std::string n = absl::AsciiStrToLower(name);
  if (n == "f32" || n == "fp32" || n == "float32") return DType::kF32;
  if (n == "f16" || n == "fp16" || n == "float16") return DType::kF16;
  if (n == "bf16" || n == "bfloat16") return DType::kBF16;
  return absl::InvalidArgumentError(absl::StrCat("dtype '", name, "': must be f32, f16 or bf16"));
}

void ToFloat(DType t, const void* src, float* dst, size_t n) {
  if (n == 0) return;  // empty tensors may come with null pointers
  switch (t) {
    case DType::kF32:
      std::memcpy(dst, src, n * 4);
      return;
    case DType::kF16:
      HalfToFloatN(static_cast<const uint16_t*>(src), dst, n);
      return;
    case DType::kBF16: {
      const uint16_t* s = static_cast<const uint16_t*>(src);
      for (size_t i = 0; i < n; ++i) dst[i] = BF16ToFloat(s[i]);
      return;
    }
  }
}

bool ToFloatStorable(DType t, const void* src, float* dst, size_t n) {
  if (n == 0) return true;
  switch (t) {
    case DType::kF32: {
      std::memcpy(dst, src, n * 4);
      const auto* u = static_cast<const uint32_t*>(src);
      bool ok = true;
      for (size_t i = 0; i < n; ++i) ok &= (u[i] & 0x7fffffffu) <= kF32StorableBits;
      return ok;
    }
    case DType::kF16:
      return HalfToFloatStorableN(static_cast<const uint16_t*>(src), dst, n);
    case DType::kBF16:
      return BF16ToFloatStorableN(static_cast<const uint16_t*>(src), dst, n);
  }
  return false;
}

void FromFloat(DType t, const float* src, void* dst, size_t n) {
  if (n == 0) return;  // empty tensors may come with null pointers
  switch (t) {
    case DType::kF32:
      std::memcpy(dst, src, n * 4);
      return;
    case DType::kF16:
      FloatToHalfN(src, static_cast<uint16_t*>(dst), n);
      return;
    case DType::kBF16:
      FloatToBF16N(src, static_cast<uint16_t*>(dst), n);
      return;
  }
}

TensorView TensorView::Contiguous(const void* data, DType dtype,
                                  std::initializer_list<int64_t> shape) {
  TensorView v;
  v.data = data;
  v.dtype = dtype;
  v.rank = static_cast<int>(shape.size());
  int i = 0;
  for (int64_t s : shape) v.shape[i++] = s;
  int64_t st = 1;
  for (int j = v.rank - 1; j >= 0; --j) {
    v.stride[j] = st;
    st *= v.shape[j];
  }
  return v;
}

int64_t TensorView::numel() const {
  int64_t n = 1;
  for (int i = 0; i < rank; ++i) n *= shape[i];
  return n;
}

bool TensorView::contiguous() const {
  int64_t st = 1;
  for (int j = rank - 1; j >= 0; --j) {
    if (shape[j] != 1 && stride[j] != st) return false;
    st *= shape[j];
  }
  return true;
}

float TensorView::at(std::initializer_list<int64_t> idx) const {
  int64_t off = 0;
  int i = 0;
  for (int64_t x : idx) off += x * stride[i++];
  float f;
  ToFloat(dtype, static_cast<const uint8_t*>(data) + off * DTypeSize(dtype), &f, 1);
  return f;
}

void TensorView::RowToFloat(std::initializer_list<int64_t> lead, float* dst) const {
  int64_t off = 0;
  int i = 0;
  for (int64_t x : lead) off += x * stride[i++];
  const int64_t n = shape[rank - 1], st = stride[rank - 1];
  const uint8_t* base = static_cast<const uint8_t*>(data);
  const size_t es = DTypeSize(dtype);
  if (st == 1) return ToFloat(dtype, base + off * es, dst, n);
  for (int64_t j = 0; j < n; ++j) ToFloat(dtype, base + (off + j * st) * es, dst + j, 1);
}

}  // namespace kvq::core
