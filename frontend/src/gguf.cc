#include "kvq/frontend/gguf.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>

#include "absl/strings/str_cat.h"
#include "kvq/core/half.h"
#include "kvq/core/status.h"

namespace kvq::frontend {
namespace {

constexpr uint32_t kGgufMagic = 0x46554747;  // "GGUF"
enum : uint32_t {
  kU8 = 0,
  kI8,
  kU16,
  kI16,
  kU32,
  kI32,
  kF32v,
  kBool,
  kString,
  kArray,
  kU64,
  kI64,
  kF64v
};

// A bounds-checked cursor over the mapped file.
class Cursor {
 public:
  Cursor(const uint8_t* p, size_t n) : p_(p), n_(n) {}
  size_t pos() const { return pos_; }
  size_t left() const { return n_ - pos_; }
  absl::Status Need(size_t k, const char* what) const {
    if (k > n_ - pos_) {
      return absl::InvalidArgumentError(absl::StrCat("GGUF truncated: need ", k, " bytes for ",
                                                     what, " at offset ", pos_, ", file has ", n_));
    }
    return absl::OkStatus();
  }
  template <typename T>
  absl::StatusOr<T> Read(const char* what) {
    RETURN_IF_ERROR(Need(sizeof(T), what));
    T v;
    std::memcpy(&v, p_ + pos_, sizeof(T));
    pos_ += sizeof(T);
    return v;
  }
  absl::StatusOr<std::string> ReadString(const char* what) {
    ASSIGN_OR_RETURN(uint64_t len, Read<uint64_t>(what));
    RETURN_IF_ERROR(Need(len, what));
    std::string s(reinterpret_cast<const char*>(p_ + pos_), len);
    pos_ += len;
    return s;
  }

 private:
  const uint8_t* p_;
  size_t n_;
  size_t pos_ = 0;
};

// The fewest bytes one value of a metadata type takes (a string: its 8-byte length); 0 for
// arrays (not allowed as elements) and unknown types.
size_t MinValueBytes(uint32_t type) {
  switch (type) {
    case kU8:
    case kI8:
    case kBool:
      return 1;
    case kU16:
    case kI16:
      return 2;
    case kU32:
    case kI32:
    case kF32v:
      return 4;
    case kU64:
    case kI64:
    case kF64v:
    case kString:
      return 8;
    default:
      return 0;
  }
}

// The fewest bytes one tensor info takes: name length, n_dims, one dim, type, offset.
constexpr size_t kMinTensorInfoBytes = 8 + 4 + 8 + 4 + 8;
// The most elements a tensor may have (dims are at most 2^40 each): keeps numel() and bytes()
// far from overflow.
constexpr int64_t kMaxTensorElements = int64_t{1} << 56;

absl::StatusOr<GgufValue> ReadValue(Cursor& c, uint32_t type, int depth) {
  GgufValue out;
  out.type = type;
  switch (type) {
    case kU8: {
      ASSIGN_OR_RETURN(auto v, c.Read<uint8_t>("u8"));
      out.v = uint64_t{v};
      break;
    }
    case kI8: {
      ASSIGN_OR_RETURN(auto v, c.Read<int8_t>("i8"));
      out.v = int64_t{v};
      break;
    }
    case kU16: {
      ASSIGN_OR_RETURN(auto v, c.Read<uint16_t>("u16"));
      out.v = uint64_t{v};
      break;
    }
    case kI16: {
      ASSIGN_OR_RETURN(auto v, c.Read<int16_t>("i16"));
      out.v = int64_t{v};
      break;
    }
    case kU32: {
      ASSIGN_OR_RETURN(auto v, c.Read<uint32_t>("u32"));
      out.v = uint64_t{v};
      break;
    }
    case kI32: {
      ASSIGN_OR_RETURN(auto v, c.Read<int32_t>("i32"));
      out.v = int64_t{v};
      break;
    }
    case kU64: {
      ASSIGN_OR_RETURN(auto v, c.Read<uint64_t>("u64"));
      out.v = v;
      break;
    }
    case kI64: {
      ASSIGN_OR_RETURN(auto v, c.Read<int64_t>("i64"));
      out.v = v;
      break;
    }
    case kF32v: {
      ASSIGN_OR_RETURN(auto v, c.Read<float>("f32"));
      out.v = double{v};
      break;
    }
    case kF64v: {
      ASSIGN_OR_RETURN(auto v, c.Read<double>("f64"));
      out.v = v;
      break;
    }
    case kBool: {
      ASSIGN_OR_RETURN(auto v, c.Read<uint8_t>("bool"));
      out.v = v != 0;
      break;
    }
    case kString: {
      ASSIGN_OR_RETURN(auto s, c.ReadString("string"));
      out.v = std::move(s);
      break;
    }
    case kArray: {
      if (depth > 0) return absl::InvalidArgumentError("GGUF: nested arrays are not supported");
      ASSIGN_OR_RETURN(uint32_t et, c.Read<uint32_t>("array type"));
      ASSIGN_OR_RETURN(uint64_t n, c.Read<uint64_t>("array length"));
      // Reject lengths the file cannot hold (each element takes at least its type's smallest
      // encoding) before reserving room for them.
      if (n > 0) {
        const size_t min_bytes = MinValueBytes(et);
        if (et == kArray)
          return absl::InvalidArgumentError("GGUF: nested arrays are not supported");
        if (min_bytes == 0) {
          return absl::InvalidArgumentError(absl::StrCat("GGUF: unknown metadata value type ", et));
        }
        if (n > c.left() / min_bytes) {
          return absl::InvalidArgumentError(absl::StrCat(
              "GGUF truncated: array of ", n, " elements of type ", et, " needs at least ",
              min_bytes, " bytes each at offset ", c.pos(), ", ", c.left(), " bytes left"));
        }
      }
      auto arr = std::make_shared<GgufValue::Array>();
      arr->reserve(n);
      for (uint64_t i = 0; i < n; ++i) {
        ASSIGN_OR_RETURN(GgufValue e, ReadValue(c, et, depth + 1));
        arr->push_back(std::move(e));
      }
      out.v = std::move(arr);
      break;
    }
    default:
      return absl::InvalidArgumentError(absl::StrCat("GGUF: unknown metadata value type ", type));
  }
  return out;
}

}  // namespace

const char* GgmlTypeName(uint32_t type) {
  switch (static_cast<GgmlType>(type)) {
    case GgmlType::kF32:
      return "F32";
    case GgmlType::kF16:
      return "F16";
    case GgmlType::kQ4_0:
      return "Q4_0";
    case GgmlType::kQ4_1:
      return "Q4_1";
    case GgmlType::kQ5_0:
      return "Q5_0";
    case GgmlType::kQ5_1:
      return "Q5_1";
    case GgmlType::kQ8_0:
      return "Q8_0";
    case GgmlType::kQ8_1:
      return "Q8_1";
    case GgmlType::kQ2_K:
      return "Q2_K";
    case GgmlType::kQ3_K:
      return "Q3_K";
    case GgmlType::kQ4_K:
      return "Q4_K";
    case GgmlType::kQ5_K:
      return "Q5_K";
    case GgmlType::kQ6_K:
      return "Q6_K";
    case GgmlType::kQ8_K:
      return "Q8_K";
    case GgmlType::kBF16:
      return "BF16";
  }
  return "unknown";
}

std::pair<int64_t, int64_t> GgmlBlockLayout(uint32_t type) {
  switch (static_cast<GgmlType>(type)) {
    case GgmlType::kF32:
      return {1, 4};
    case GgmlType::kF16:
      return {1, 2};
    case GgmlType::kBF16:
      return {1, 2};
    case GgmlType::kQ4_0:
      return {32, 18};
    case GgmlType::kQ4_1:
      return {32, 20};
    case GgmlType::kQ5_0:
      return {32, 22};
    case GgmlType::kQ8_0:
      return {32, 34};
    case GgmlType::kQ4_K:
      return {256, 144};
    case GgmlType::kQ6_K:
      return {256, 210};
    default:
      return {0, 0};
  }
}

absl::Status DequantizeRow(uint32_t type, const uint8_t* src, int64_t n, float* dst) {
  auto [bs, bb] = GgmlBlockLayout(type);
  if (bs == 0) {
    return absl::UnimplementedError(
        absl::StrCat("GGUF: tensor type ", GgmlTypeName(type), " (", type, ") is not supported"));
  }
  if (n % bs != 0) {
    return absl::InvalidArgumentError(absl::StrCat("GGUF: ", n, " elements is not a multiple of ",
                                                   GgmlTypeName(type), "'s block of ", bs));
  }
  auto half = [](const uint8_t* p) {
    uint16_t h;
    std::memcpy(&h, p, 2);
    return core::HalfToFloat(h);
  };
  const int64_t nb = n / bs;
  switch (static_cast<GgmlType>(type)) {
    case GgmlType::kF32:
      std::memcpy(dst, src, n * 4);
      return absl::OkStatus();
    case GgmlType::kF16:
      for (int64_t i = 0; i < n; ++i) dst[i] = half(src + 2 * i);
      return absl::OkStatus();
    case GgmlType::kBF16:
      for (int64_t i = 0; i < n; ++i) {
        uint16_t b;
        std::memcpy(&b, src + 2 * i, 2);
        dst[i] = core::BF16ToFloat(b);
      }
      return absl::OkStatus();
    case GgmlType::kQ4_0:
      for (int64_t b = 0; b < nb; ++b, src += bb, dst += 32) {
        const float d = half(src);
        for (int j = 0; j < 16; ++j) {
          dst[j] = d * static_cast<float>((src[2 + j] & 0xF) - 8);
          dst[j + 16] = d * static_cast<float>((src[2 + j] >> 4) - 8);
        }
      }
      return absl::OkStatus();
    case GgmlType::kQ4_1:
      for (int64_t b = 0; b < nb; ++b, src += bb, dst += 32) {
        const float d = half(src), m = half(src + 2);
        for (int j = 0; j < 16; ++j) {
          dst[j] = d * static_cast<float>(src[4 + j] & 0xF) + m;
          dst[j + 16] = d * static_cast<float>(src[4 + j] >> 4) + m;
        }
      }
      return absl::OkStatus();
    case GgmlType::kQ5_0:
      // fp16 d, 32 high bits (bit j = fifth bit of weight j), 16 bytes of low nibbles laid out
      // like Q4_0 (byte j: weight j low, weight j + 16 high); weight = d * (code - 16).
      for (int64_t b = 0; b < nb; ++b, src += bb, dst += 32) {
        const float d = half(src);
        uint32_t qh;
        std::memcpy(&qh, src + 2, 4);
        const uint8_t* qs = src + 6;
        for (int j = 0; j < 16; ++j) {
          const int hi0 = static_cast<int>((qh >> j) & 1u) << 4;
          const int hi1 = static_cast<int>((qh >> (j + 16)) & 1u) << 4;
          dst[j] = d * static_cast<float>(((qs[j] & 0xF) | hi0) - 16);
          dst[j + 16] = d * static_cast<float>(((qs[j] >> 4) | hi1) - 16);
        }
      }
      return absl::OkStatus();
    case GgmlType::kQ4_K:
      // Super block of 256 = 8 sub-blocks of 32: fp16 d, fp16 dmin, 12 bytes packing eight
      // 6-bit scales and eight 6-bit mins, 128 bytes of nibbles. Each 32-byte run of nibbles
      // holds two sub-blocks (low nibbles the first, high nibbles the second);
      // weight = d * scale * code - dmin * min.
      for (int64_t b = 0; b < nb; ++b, src += bb) {
        const float d = half(src), dmin = half(src + 2);
        const uint8_t* sc = src + 4;
        const uint8_t* q = src + 16;
        auto scale_min = [sc](int j, int* s, int* m) {
          if (j < 4) {
            *s = sc[j] & 63;
            *m = sc[j + 4] & 63;
          } else {
            *s = (sc[j + 4] & 0xF) | ((sc[j - 4] >> 6) << 4);
            *m = (sc[j + 4] >> 4) | ((sc[j] >> 6) << 4);
          }
        };
        for (int sub = 0; sub < 8; sub += 2, q += 32) {
          int s0, m0, s1, m1;
          scale_min(sub, &s0, &m0);
          scale_min(sub + 1, &s1, &m1);
          const float d0 = d * s0, mm0 = dmin * m0, d1 = d * s1, mm1 = dmin * m1;
          for (int l = 0; l < 32; ++l) dst[l] = d0 * static_cast<float>(q[l] & 0xF) - mm0;
          for (int l = 0; l < 32; ++l) dst[l + 32] = d1 * static_cast<float>(q[l] >> 4) - mm1;
          dst += 64;
        }
      }
      return absl::OkStatus();
    case GgmlType::kQ8_0:
      for (int64_t b = 0; b < nb; ++b, src += bb, dst += 32) {
        const float d = half(src);
        for (int j = 0; j < 32; ++j)
          dst[j] = d * static_cast<float>(static_cast<int8_t>(src[2 + j]));
      }
      return absl::OkStatus();
    case GgmlType::kQ6_K:
      // Super block of 256: ql[128] (low 4 bits), qh[64] (high 2 bits), int8 scales[16], fp16 d.
      for (int64_t b = 0; b < nb; ++b, src += bb) {
        const uint8_t* ql = src;
        const uint8_t* qh = src + 128;
        const int8_t* sc = reinterpret_cast<const int8_t*>(src + 192);
        const float d = half(src + 208);
        for (int half_blk = 0; half_blk < 2; ++half_blk) {
          for (int l = 0; l < 32; ++l) {
            const int is = l / 16;
            const int q1 = static_cast<int>((ql[l] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32;
            const int q2 = static_cast<int>((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32;
            const int q3 = static_cast<int>((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
            const int q4 = static_cast<int>((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
            dst[l] = d * sc[is] * q1;
            dst[l + 32] = d * sc[is + 2] * q2;
            dst[l + 64] = d * sc[is + 4] * q3;
            dst[l + 96] = d * sc[is + 6] * q4;
          }
          dst += 128;
          ql += 64;
          qh += 32;
          sc += 8;
        }
      }
      return absl::OkStatus();
    default:
      break;
  }
  return absl::UnimplementedError(absl::StrCat("GGUF: tensor type ", GgmlTypeName(type)));
}

int64_t GgufTensorInfo::numel() const {
  int64_t n = 1;
  for (int64_t d : dims) n *= d;
  return n;
}

uint64_t GgufTensorInfo::bytes() const {
  auto [bs, bb] = GgmlBlockLayout(type);
  if (bs == 0) return 0;
  return static_cast<uint64_t>(numel() / bs * bb);
}

absl::StatusOr<std::unique_ptr<GgufFile>> GgufFile::Open(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY);
  if (fd < 0)
    return absl::NotFoundError(
        absl::StrCat("GGUF: cannot open ", path, ": ", std::strerror(errno)));
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    ::close(fd);
    return absl::InternalError(absl::StrCat("GGUF: cannot stat ", path));
  }
  std::unique_ptr<GgufFile> f(new GgufFile());
  f->path_ = path;
  f->size_ = static_cast<size_t>(st.st_size);
  if (f->size_ > 0) {
    void* p = ::mmap(nullptr, f->size_, PROT_READ, MAP_PRIVATE, fd, 0);
    if (p == MAP_FAILED) {
      ::close(fd);
      return absl::InternalError(absl::StrCat("GGUF: cannot map ", path));
    }
    f->base_ = static_cast<const uint8_t*>(p);
    f->mapped_ = true;
  }
  ::close(fd);
  absl::Status s = f->Parse();
  if (!s.ok()) return absl::Status(s.code(), absl::StrCat(path, ": ", s.message()));
  return f;
}

absl::StatusOr<std::unique_ptr<GgufFile>> GgufFile::FromBytes(std::string bytes,
                                                              const std::string& name) {
  std::unique_ptr<GgufFile> f(new GgufFile());
  f->path_ = name;
  f->owned_ = std::move(bytes);
  f->size_ = f->owned_.size();
  f->base_ = reinterpret_cast<const uint8_t*>(f->owned_.data());
  absl::Status s = f->Parse();
  if (!s.ok()) return absl::Status(s.code(), absl::StrCat(name, ": ", s.message()));
  return f;
}

GgufFile::~GgufFile() {
  if (mapped_ && base_) ::munmap(const_cast<uint8_t*>(base_), size_);
}

absl::Status GgufFile::Parse() {
  Cursor c(base_, size_);
  ASSIGN_OR_RETURN(uint32_t magic, c.Read<uint32_t>("magic"));
  if (magic != kGgufMagic) return absl::InvalidArgumentError("not a GGUF file (bad magic)");
  ASSIGN_OR_RETURN(version_, c.Read<uint32_t>("version"));
  if (version_ < 2 || version_ > 3) {
    return absl::UnimplementedError(
        absl::StrCat("GGUF version ", version_, " is not supported (2, 3)"));
  }
  ASSIGN_OR_RETURN(uint64_t n_tensors, c.Read<uint64_t>("tensor count"));
  ASSIGN_OR_RETURN(uint64_t n_kv, c.Read<uint64_t>("metadata count"));
  if (n_tensors > size_ || n_kv > size_)
    return absl::InvalidArgumentError("GGUF: implausible counts");
  for (uint64_t i = 0; i < n_kv; ++i) {
    ASSIGN_OR_RETURN(std::string key, c.ReadString("metadata key"));
    ASSIGN_OR_RETURN(uint32_t type, c.Read<uint32_t>("metadata type"));
    ASSIGN_OR_RETURN(GgufValue v, ReadValue(c, type, 0));
    meta_[key] = std::move(v);
  }
  if (auto a = GetInt("general.alignment"); a.ok()) {
    if (*a <= 0 || (*a & (*a - 1)) != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("GGUF: alignment ", *a, " is not a power of two"));
    }
    alignment_ = static_cast<uint64_t>(*a);
  }
  // A tensor info takes at least kMinTensorInfoBytes: a count the rest of the file cannot
  // hold is an error before anything is reserved for it.
  if (n_tensors > c.left() / kMinTensorInfoBytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "GGUF truncated: ", n_tensors, " tensor infos need at least ", kMinTensorInfoBytes,
        " bytes each at offset ", c.pos(), ", ", c.left(), " bytes left"));
  }
  tensors_.reserve(n_tensors);
  for (uint64_t i = 0; i < n_tensors; ++i) {
    GgufTensorInfo t;
    ASSIGN_OR_RETURN(t.name, c.ReadString("tensor name"));
    ASSIGN_OR_RETURN(uint32_t nd, c.Read<uint32_t>("tensor n_dims"));
    if (nd == 0 || nd > 4) {
      return absl::InvalidArgumentError(
          absl::StrCat("GGUF: tensor ", t.name, " has ", nd, " dims"));
    }
    int64_t numel = 1;
    for (uint32_t d = 0; d < nd; ++d) {
      ASSIGN_OR_RETURN(uint64_t ne, c.Read<uint64_t>("tensor dim"));
      if (ne == 0 || ne > (1ull << 40)) {
        return absl::InvalidArgumentError(absl::StrCat("GGUF: tensor ", t.name, " bad dim ", ne));
      }
      t.dims.push_back(static_cast<int64_t>(ne));
      if (static_cast<int64_t>(ne) > kMaxTensorElements / numel) {
        return absl::InvalidArgumentError(
            absl::StrCat("GGUF: tensor ", t.name, " has over 2^56 elements"));
      }
      numel *= static_cast<int64_t>(ne);
    }
    ASSIGN_OR_RETURN(t.type, c.Read<uint32_t>("tensor type"));
    ASSIGN_OR_RETURN(t.offset, c.Read<uint64_t>("tensor offset"));
    tensors_.push_back(std::move(t));
  }
  const uint64_t data_start = (c.pos() + alignment_ - 1) / alignment_ * alignment_;
  for (auto& t : tensors_) {
    if (t.offset % alignment_ != 0) {
      return absl::InvalidArgumentError(absl::StrCat("GGUF: tensor ", t.name, " offset ", t.offset,
                                                     " is not aligned to ", alignment_));
    }
    const uint64_t nbytes = t.bytes();
    if (nbytes == 0) continue;  // unknown type: reported by Dequantize when used
    auto [bs, bb] = GgmlBlockLayout(t.type);
    if (t.dims[0] % bs != 0) {
      return absl::InvalidArgumentError(absl::StrCat("GGUF: tensor ", t.name, " row of ", t.dims[0],
                                                     " is not a multiple of block ", bs));
    }
    // (Each term is checked against the file size alone first: no sum can wrap around.)
    if (data_start > size_ || t.offset > size_ - data_start ||
        nbytes > size_ - data_start - t.offset) {
      return absl::InvalidArgumentError(
          absl::StrCat("GGUF truncated: tensor ", t.name, " needs bytes [", data_start + t.offset,
                       ", ", data_start + t.offset + nbytes, "), file has ", size_));
    }
    t.data = base_ + data_start + t.offset;
  }
  return absl::OkStatus();
}

const GgufTensorInfo* GgufFile::FindTensor(const std::string& name) const {
  for (const auto& t : tensors_) {
    if (t.name == name) return &t;
  }
  return nullptr;
}

absl::StatusOr<int64_t> GgufFile::GetInt(const std::string& key) const {
  auto it = meta_.find(key);
  if (it == meta_.end()) return absl::NotFoundError(absl::StrCat("GGUF: no metadata ", key));
  if (auto* u = std::get_if<uint64_t>(&it->second.v)) return static_cast<int64_t>(*u);
  if (auto* i = std::get_if<int64_t>(&it->second.v)) return *i;
  return absl::InvalidArgumentError(absl::StrCat("GGUF: metadata ", key, " is not an integer"));
}

absl::StatusOr<double> GgufFile::GetFloat(const std::string& key) const {
  auto it = meta_.find(key);
  if (it == meta_.end()) return absl::NotFoundError(absl::StrCat("GGUF: no metadata ", key));
  if (auto* d = std::get_if<double>(&it->second.v)) return *d;
  if (auto* u = std::get_if<uint64_t>(&it->second.v)) return static_cast<double>(*u);
  if (auto* i = std::get_if<int64_t>(&it->second.v)) return static_cast<double>(*i);
  return absl::InvalidArgumentError(absl::StrCat("GGUF: metadata ", key, " is not a number"));
}

absl::StatusOr<bool> GgufFile::GetBool(const std::string& key) const {
  auto it = meta_.find(key);
  if (it == meta_.end()) return absl::NotFoundError(absl::StrCat("GGUF: no metadata ", key));
  if (auto* b = std::get_if<bool>(&it->second.v)) return *b;
  return absl::InvalidArgumentError(absl::StrCat("GGUF: metadata ", key, " is not a bool"));
}

absl::StatusOr<std::string> GgufFile::GetString(const std::string& key) const {
  auto it = meta_.find(key);
  if (it == meta_.end()) return absl::NotFoundError(absl::StrCat("GGUF: no metadata ", key));
  if (auto* s = std::get_if<std::string>(&it->second.v)) return *s;
  return absl::InvalidArgumentError(absl::StrCat("GGUF: metadata ", key, " is not a string"));
}

absl::StatusOr<std::vector<std::string>> GgufFile::GetStringArray(const std::string& key) const {
  auto it = meta_.find(key);
  if (it == meta_.end()) return absl::NotFoundError(absl::StrCat("GGUF: no metadata ", key));
  auto* a = std::get_if<std::shared_ptr<GgufValue::Array>>(&it->second.v);
  if (!a)
    return absl::InvalidArgumentError(absl::StrCat("GGUF: metadata ", key, " is not an array"));
  std::vector<std::string> out;
  out.reserve((*a)->size());
  for (const auto& e : **a) {
    auto* s = std::get_if<std::string>(&e.v);
    if (!s)
      return absl::InvalidArgumentError(absl::StrCat("GGUF: ", key, " is not a string array"));
    out.push_back(*s);
  }
  return out;
}

absl::StatusOr<std::vector<int64_t>> GgufFile::GetIntArray(const std::string& key) const {
  auto it = meta_.find(key);
  if (it == meta_.end()) return absl::NotFoundError(absl::StrCat("GGUF: no metadata ", key));
  auto* a = std::get_if<std::shared_ptr<GgufValue::Array>>(&it->second.v);
  if (!a)
    return absl::InvalidArgumentError(absl::StrCat("GGUF: metadata ", key, " is not an array"));
  std::vector<int64_t> out;
  out.reserve((*a)->size());
  for (const auto& e : **a) {
    if (auto* u = std::get_if<uint64_t>(&e.v))
      out.push_back(static_cast<int64_t>(*u));
    else if (auto* i = std::get_if<int64_t>(&e.v))
      out.push_back(*i);
    else
      return absl::InvalidArgumentError(absl::StrCat("GGUF: ", key, " is not an integer array"));
  }
  return out;
}

absl::StatusOr<std::vector<float>> GgufFile::Dequantize(const std::string& name) const {
  const GgufTensorInfo* t = FindTensor(name);
  if (!t) return absl::NotFoundError(absl::StrCat("GGUF: no tensor ", name, " in ", path_));
  if (!t->data) {
    return absl::UnimplementedError(absl::StrCat("GGUF: tensor ", name, " has unsupported type ",
                                                 GgmlTypeName(t->type), " (", t->type, ")"));
  }
  std::vector<float> out(t->numel());
  RETURN_IF_ERROR(DequantizeRow(t->type, t->data, t->numel(), out.data()));
  return out;
}

// ---- writer ----

namespace {
void PutU32(std::vector<uint8_t>& b, uint32_t v) {
  b.insert(b.end(), reinterpret_cast<uint8_t*>(&v), reinterpret_cast<uint8_t*>(&v) + 4);
}
void PutU64(std::vector<uint8_t>& b, uint64_t v) {
  b.insert(b.end(), reinterpret_cast<uint8_t*>(&v), reinterpret_cast<uint8_t*>(&v) + 8);
}
void PutStr(std::vector<uint8_t>& b, const std::string& s) {
  PutU64(b, s.size());
  b.insert(b.end(), s.begin(), s.end());
}
}  // namespace

void GgufWriter::AddString(const std::string& key, const std::string& value) {
  PutStr(kv_, key);
  PutU32(kv_, kString);
  PutStr(kv_, value);
  ++n_kv_;
}
void GgufWriter::AddUint32(const std::string& key, uint32_t value) {
  PutStr(kv_, key);
  PutU32(kv_, kU32);
  PutU32(kv_, value);
  ++n_kv_;
}
void GgufWriter::AddFloat32(const std::string& key, float value) {
  uint32_t u;
  std::memcpy(&u, &value, 4);
  PutStr(kv_, key);
  PutU32(kv_, kF32v);
  PutU32(kv_, u);
  ++n_kv_;
}
void GgufWriter::AddStringArray(const std::string& key, const std::vector<std::string>& values) {
  PutStr(kv_, key);
  PutU32(kv_, kArray);
  PutU32(kv_, kString);
  PutU64(kv_, values.size());
  for (const auto& s : values) PutStr(kv_, s);
  ++n_kv_;
}
void GgufWriter::AddTensor(const std::string& name, std::vector<int64_t> dims, uint32_t type,
                           std::vector<uint8_t> bytes) {
  tensors_.push_back({name, std::move(dims), type, std::move(bytes)});
}

std::vector<uint8_t> GgufWriter::Finish(uint64_t alignment) const {
  std::vector<uint8_t> b;
  PutU32(b, kGgufMagic);
  PutU32(b, 3);
  PutU64(b, tensors_.size());
  PutU64(b, n_kv_);
  b.insert(b.end(), kv_.begin(), kv_.end());
  uint64_t off = 0;
  std::vector<uint64_t> offs;
  for (const auto& t : tensors_) {
    PutStr(b, t.name);
    PutU32(b, static_cast<uint32_t>(t.dims.size()));
    for (int64_t d : t.dims) PutU64(b, static_cast<uint64_t>(d));
    PutU32(b, t.type);
    PutU64(b, off);
    offs.push_back(off);
    off += (t.bytes.size() + alignment - 1) / alignment * alignment;
  }
  b.resize((b.size() + alignment - 1) / alignment * alignment, 0);
  const size_t data_start = b.size();
  for (size_t i = 0; i < tensors_.size(); ++i) {
    b.resize(data_start + offs[i], 0);
    b.insert(b.end(), tensors_[i].bytes.begin(), tensors_[i].bytes.end());
  }
  return b;
}

}  // namespace kvq::frontend
