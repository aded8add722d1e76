// kvq._codes: the Python package's native module (nanobind). HeadQ codes on the wire (docs/API.md,
// "Codes on the wire") encoded and decoded by core's own codec, as the C++ client does
// (client/lib/src/codes.cc): a core::LayerCache over MakeLayerCodecTables(model, layer, codec) to
// encode, core::DecodeMessage (the untrusted check, then the decode) to decode, so that the blocks
// made here are the server's byte for byte and the rows decoded here are GetBlocks' decoded rows
// bit for bit. No protobuf here: kvq/codes.py takes the messages apart and passes tensors as numpy
// arrays and settings as plain values.
//
// Errors are kvq._codes.Error(code, message): code is the absl (= gRPC) status code number.
// The GIL is released while a codec runs; a Model is immutable (thread-safe), a LayerEncoder
// serialises its own appends.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "kvq/core/basis.h"
#include "kvq/core/cache.h"
#include "kvq/core/codec.h"
#include "kvq/core/codec_schema.h"
#include "kvq/core/encoded_groups.h"
#include "kvq/core/paged_rows.h"
#include "kvq/core/registry.h"
#include "kvq/core/tensor.h"
#include "kvq/format/block_format.h"

namespace nb = nanobind;

namespace kvq::python {
namespace {

// ------------------------------------------------------------------------------ errors

// A failed status on its way to Python (the translator below raises kvq._codes.Error).
struct StatusError {
  absl::Status status;
};
PyObject* g_error = nullptr;  // kvq._codes.Error, made at import

void Check(const absl::Status& st) {
  if (!st.ok()) throw StatusError{st};
}
[[noreturn]] void Invalid(const std::string& message) {
  throw StatusError{absl::InvalidArgumentError(message)};
}

// ------------------------------------------------------------------------------ arrays

// An input array on the CPU, C-contiguous (nanobind copies a strided numpy array into one),
// of any dtype: DTypeOf says which it is.
using InArray = nb::ndarray<nb::ro, nb::c_contig, nb::device::cpu>;
using F32Array = nb::ndarray<const float, nb::ndim<3>, nb::c_contig, nb::device::cpu>;
using U32Array = nb::ndarray<const uint32_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
// An output array, numpy's, owning its bytes.
using OutArray = nb::ndarray<nb::numpy>;
// A paged cache written in place (a torch tensor through DLPack, or a numpy array).
using CacheArray = nb::ndarray<nb::c_contig, nb::device::cpu>;
using I32Array = nb::ndarray<const int32_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using I64Array = nb::ndarray<const int64_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;

// f32, f16, or bf16: a DLPack bfloat16 (torch) or a uint16 array of bfloat16 bits (numpy has
// no bfloat16; the client's convention, kvq/tensors.py).
core::DType DTypeOf(const nb::dlpack::dtype t, const std::string& field) {
  using Code = nb::dlpack::dtype_code;
  if (t.lanes == 1 && t.code == static_cast<uint8_t>(Code::Float) && t.bits == 32) {
    return core::DType::kF32;
  }
  if (t.lanes == 1 && t.code == static_cast<uint8_t>(Code::Float) && t.bits == 16) {
    return core::DType::kF16;
  }
  if (t.lanes == 1 && t.bits == 16 &&
      (t.code == static_cast<uint8_t>(Code::Bfloat) ||
       t.code == static_cast<uint8_t>(Code::UInt))) {
    return core::DType::kBF16;
  }
  Invalid(field + ": dtype is not float32, float16 or bfloat16 (a uint16 array of bfloat16 bits)");
}

// The numpy dtype an output of `t` has: float32, float16, or uint16 holding bfloat16 bits.
nb::dlpack::dtype NumpyDType(core::DType t) {
  switch (t) {
    case core::DType::kF32:
      return nb::dtype<float>();
    case core::DType::kF16:
      return {static_cast<uint8_t>(nb::dlpack::dtype_code::Float), 16, 1};
    case core::DType::kBF16:
      break;
  }
  return nb::dtype<uint16_t>();
}

// A numpy array over `bytes` (moved into the array's owner: no copy), C order.
OutArray ToNumpy(std::vector<uint8_t>&& bytes, nb::dlpack::dtype dtype,
                 std::initializer_list<size_t> shape) {
  auto* owned = new std::vector<uint8_t>(std::move(bytes));
  if (owned->empty()) owned->reserve(1);  // a non-null pointer for an empty array
  nb::capsule owner(owned, [](void* p) noexcept { delete static_cast<std::vector<uint8_t>*>(p); });
  return OutArray(owned->data(), shape.size(), shape.begin(), owner, nullptr, dtype);
}

core::DType ParseDType(const std::string& name) {
  absl::StatusOr<core::DType> t = core::ParseDType(name);
  Check(t.status());
  return *t;
}

// A message's window rows (keys, values [kv_heads, n, head_dim] of one dtype, or both None) as
// views for core; n = 0 without rows.
class WindowRows {
 public:
  WindowRows(const nb::object& keys, const nb::object& values, int kv_heads, int head_dim) {
    if (keys.is_none() && values.is_none()) return;
    if (keys.is_none() || values.is_none()) Invalid("keys/values: give both or none");
    k_ = nb::cast<InArray>(keys);
    v_ = nb::cast<InArray>(values);
    const core::DType t = DTypeOf(k_.dtype(), "keys");
    if (DTypeOf(v_.dtype(), "values") != t) Invalid("keys and values must have one dtype");
    if (k_.ndim() != 3 || v_.ndim() != 3 || k_.shape(0) != static_cast<size_t>(kv_heads) ||
        k_.shape(2) != static_cast<size_t>(head_dim) || v_.shape(0) != k_.shape(0) ||
        v_.shape(1) != k_.shape(1) || v_.shape(2) != k_.shape(2)) {
      Invalid("keys/values: not [kv_heads, n, head_dim] of the model");
    }
    n = static_cast<int64_t>(k_.shape(1));
    tk_ = core::TensorView::Contiguous(k_.data(), t, {kv_heads, n, head_dim});
    tv_ = core::TensorView::Contiguous(v_.data(), t, {kv_heads, n, head_dim});
  }
  const core::TensorView* keys() const { return n ? &tk_ : nullptr; }
  const core::TensorView* values() const { return n ? &tv_ : nullptr; }

  int64_t n = 0;

 private:
  InArray k_, v_;
  core::TensorView tk_, tv_;
};

// ------------------------------------------------------------------------------ codec

// The codec settings of `settings` ({name: value}, names and ranges those of core's codec table,
// core/codec_schema.h, which the wire's CodecSettings shares) over `base`, each checked as the
// server checks a CodecSettings field (CheckCodecField), then the whole (Validate):
// INVALID_ARGUMENT naming "<field>.<name>". value_policy is "uniform" or "a2"; booleans must be
// bool, integer fields int.
core::CodecOptions MergeSettings(const core::CodecOptions& base, const nb::dict& settings,
                                 const std::string& field) {
  core::CodecOptions c = base;
  for (auto [key, value] : settings) {
    if (!nb::isinstance<nb::str>(key)) Invalid(field + ": setting names must be str");
    const std::string name = nb::cast<std::string>(key);
    const core::CodecField* f = core::FindCodecField(name);
    if (f == nullptr) Invalid(absl::StrCat(field, ".", name, ": no such codec setting"));
    const std::string at = absl::StrCat(field, ".", name);
    double v = 0;
    switch (f->type) {
      case core::CodecFieldType::kValuePolicy: {
        core::ValuePolicy p;
        if (!nb::isinstance<nb::str>(value) ||
            !core::ParseValuePolicy(nb::cast<std::string>(value), &p)) {
          Invalid(at + " must be \"uniform\" or \"a2\"");
        }
        v = p == core::ValuePolicy::kA2 ? 1 : 0;
        break;
      }
      case core::CodecFieldType::kBool:
        if (!nb::isinstance<nb::bool_>(value)) Invalid(at + " must be True or False");
        v = nb::cast<bool>(value) ? 1 : 0;
        break;
      case core::CodecFieldType::kInt:
        if (!nb::isinstance<nb::int_>(value) || nb::isinstance<nb::bool_>(value)) {
          Invalid(at + " must be an int");
        }
        v = static_cast<double>(nb::cast<int64_t>(value));
        break;
      case core::CodecFieldType::kFloat:
        if (!nb::isinstance<nb::int_>(value) && !nb::isinstance<nb::float_>(value)) {
          Invalid(at + " must be a number");
        }
        v = nb::cast<double>(value);
        break;
    }
    Check(core::CheckCodecField(*f, v, c.head_dim, field + "."));
    core::SetCodecField(*f, v, &c);
  }
  if (absl::Status st = c.Validate(); !st.ok()) Invalid(absl::StrCat(field, ": ", st.message()));
  return c;
}

// A validated codec of one model (Model::MakeCodec): what a sequence is made with.
class Codec {
 public:
  explicit Codec(const core::CodecOptions& o) : o_(o) {}
  const core::CodecOptions& options() const { return o_; }
  // Every setting of the table, {name: value} (value_policy "uniform" / "a2"): what a
  // CodecSettings with every field set carries.
  nb::dict Settings() const {
    nb::dict d;
    for (const core::CodecField& f : core::CodecFields()) {
      const std::string name(f.name);
      const double v = core::GetCodecField(f, o_);
      switch (f.type) {
        case core::CodecFieldType::kValuePolicy:
          d[name.c_str()] = std::string(core::ValuePolicyName(o_.value_policy));
          break;
        case core::CodecFieldType::kBool:
          d[name.c_str()] = v != 0;
          break;
        case core::CodecFieldType::kInt:
          d[name.c_str()] = static_cast<int64_t>(v);
          break;
        case core::CodecFieldType::kFloat:
          d[name.c_str()] = v;
          break;
      }
    }
    return d;
  }

 private:
  core::CodecOptions o_;
};

// ------------------------------------------------------------------------------ encode

// What one LayerEncoder::Append gives: the groups encoded since the previous one (a run from
// first_group on) and the rows that stay rows (tokens [encoded_tokens, tokens), the incomplete
// group and the window, in the arrival dtype): what an Append with `encoded` carries.
struct EncodedRun {
  int64_t first_group = 0, groups = 0;
  nb::bytes blocks;
  // numpy arrays (held as objects: each owns its bytes).
  nb::object block_bytes;             // uint32 [2 * kv_heads * groups]
  nb::object sink_keys, sink_values;  // float16 [kv_heads, S, head_dim], or None
  std::string basis_fingerprint;
  nb::object keys, values;  // [kv_heads, tokens - encoded_tokens, head_dim]
  std::string rows_dtype;
  int64_t tokens = 0, encoded_tokens = 0;
};

class LayerEncoder {
 public:
  LayerEncoder(std::shared_ptr<const core::ModelEntry> model, int layer,
               const core::CodecOptions& codec)
      : model_(std::move(model)),
        layer_(layer),
        cache_(codec, model_->manifest.kv_heads,
               core::MakeLayerCodecTables(*model_, layer, codec)) {}

  // Appends tokens [tokens(), tokens() + n) (keys, values [kv_heads, n, head_dim] of one
  // dtype), then exports the groups encoded since the last call and the rows after them.
  EncodedRun Append(const InArray& keys, const InArray& values) {
    const core::BasisManifest& m = model_->manifest;
    const core::DType kt = DTypeOf(keys.dtype(), "keys"), vt = DTypeOf(values.dtype(), "values");
    if (kt != vt) Invalid("keys and values must have one dtype");
    for (const auto& [a, name] : {std::pair{&keys, "keys"}, std::pair{&values, "values"}}) {
      if (a->ndim() != 3 || a->shape(0) != static_cast<size_t>(m.kv_heads) ||
          a->shape(2) != static_cast<size_t>(m.head_dim) || a->shape(1) != keys.shape(1)) {
        Invalid(absl::StrCat(name, ": must be [kv_heads=", m.kv_heads, ", n, head_dim=", m.head_dim,
                             "] with n the same for keys and values"));
      }
    }
    const int64_t n = static_cast<int64_t>(keys.shape(1));
    const core::TensorView k =
        core::TensorView::Contiguous(keys.data(), kt, {m.kv_heads, n, m.head_dim});
    const core::TensorView v =
        core::TensorView::Contiguous(values.data(), kt, {m.kv_heads, n, m.head_dim});
    core::EncodedGroups run;
    std::vector<uint8_t> wk, wv;
    int64_t E = 0, T = 0, g0 = 0;
    {
      nb::gil_scoped_release unlocked;
      std::lock_guard<std::mutex> lock(mu_);
      Check(cache_.Append(k, v, cache_.tokens()));
      const int64_t G = cache_.options().key_group;
      E = cache_.encoded_tokens();
      T = cache_.tokens();
      g0 = exported_;
      Check(cache_.ExportGroups(g0, E / G, &run));
      exported_ = E / G;
      if (cache_.options().rank > 0 && model_->has_basis && run.groups > 0) {
        run.basis_fingerprint = m.fingerprint;
      }
      Check(cache_.DecodeAs(E, T, kt, &wk, &wv));
    }
    EncodedRun out;
    out.first_group = run.first_group;
    out.groups = run.groups;
    out.blocks = nb::bytes(run.bytes.data(), run.bytes.size());
    std::vector<uint8_t> sizes(run.sizes.size() * sizeof(uint32_t));
    if (!sizes.empty()) std::memcpy(sizes.data(), run.sizes.data(), sizes.size());
    out.block_bytes =
        nb::cast(ToNumpy(std::move(sizes), nb::dtype<uint32_t>(), {run.sizes.size()}));
    out.sink_keys = out.sink_values = nb::none();
    const size_t per_sink = static_cast<size_t>(m.kv_heads) * m.head_dim;
    for (auto [rows, to] : {std::pair{&run.sink_keys, &out.sink_keys},
                            std::pair{&run.sink_values, &out.sink_values}}) {
      if (rows->empty()) continue;
      std::vector<uint8_t> bytes(rows->size() * 2);
      std::memcpy(bytes.data(), rows->data(), bytes.size());
      *to = nb::cast(ToNumpy(std::move(bytes), NumpyDType(core::DType::kF16),
                             {static_cast<size_t>(m.kv_heads), rows->size() / per_sink,
                              static_cast<size_t>(m.head_dim)}));
    }
    out.basis_fingerprint = run.basis_fingerprint;
    const size_t rows = static_cast<size_t>(T - E);
    const std::initializer_list<size_t> shape = {static_cast<size_t>(m.kv_heads), rows,
                                                 static_cast<size_t>(m.head_dim)};
    out.keys = nb::cast(ToNumpy(std::move(wk), NumpyDType(kt), shape));
    out.values = nb::cast(ToNumpy(std::move(wv), NumpyDType(kt), shape));
    out.rows_dtype = std::string(core::DTypeName(kt));
    out.tokens = T;
    out.encoded_tokens = E;
    return out;
  }

  int layer() const { return layer_; }
  int64_t tokens() {
    std::lock_guard<std::mutex> lock(mu_);
    return cache_.tokens();
  }
  int64_t encoded_tokens() {
    std::lock_guard<std::mutex> lock(mu_);
    return cache_.encoded_tokens();
  }

 private:
  std::shared_ptr<const core::ModelEntry> model_;
  int layer_;
  std::mutex mu_;
  core::LayerCache cache_;  // guarded by mu_
  int64_t exported_ = 0;    // groups handed out so far; guarded by mu_
};

// ------------------------------------------------------------------------------ model

// A model entry as GetBasis describes it (the fields of its ModelInfo and its tensors): the
// codec tables of every layer come from it, as the server's do (MakeLayerCodecTables).
class Model {
 public:
  Model(const std::string& model, int version, int layers, int kv_heads, int q_heads, int head_dim,
        int basis_rank, const std::string& fingerprint, const nb::dict& codec,
        const std::vector<F32Array>& basis, const std::vector<F32Array>& encode_basis,
        const std::vector<F32Array>& query_moment) {
    // The shape limits of RegisterBasisRequest (what a server registered).
    if (version < 1) Invalid(absl::StrCat("info.version ", version, " must be >= 1"));
    if (layers < 1 || layers > 1024) {
      Invalid(absl::StrCat("info.layers ", layers, " must be in 1..1024"));
    }
    if (kv_heads < 1 || kv_heads > 256) {
      Invalid(absl::StrCat("info.kv_heads ", kv_heads, " must be in 1..256"));
    }
    if (q_heads < kv_heads || q_heads % kv_heads != 0) {
      Invalid(absl::StrCat("info.q_heads ", q_heads, " must be a multiple of kv_heads (", kv_heads,
                           ")"));
    }
    if (head_dim < 1 || head_dim > 512) {
      Invalid(absl::StrCat("info.head_dim ", head_dim, " must be in 1..512"));
    }
    if (basis_rank < 0 || basis_rank > head_dim) {
      Invalid(
          absl::StrCat("info.basis_rank ", basis_rank, " must be in 0..head_dim (", head_dim, ")"));
    }
    auto e = std::make_shared<core::ModelEntry>();
    core::BasisManifest& m = e->manifest;
    m.model = model;
    m.version = version;
    m.layers = layers;
    m.kv_heads = kv_heads;
    m.q_heads = q_heads;
    m.head_dim = head_dim;
    m.rank = basis_rank;
    m.fingerprint = fingerprint;
    e->has_basis = basis_rank > 0;
    // One f32 [kv_heads, head_dim, cols] per layer, appended to *to in layer order.
    auto read = [&](const std::vector<F32Array>& list, const char* name, int cols,
                    std::vector<float>* to) {
      if (static_cast<int>(list.size()) != layers) {
        Invalid(absl::StrCat(name, " holds ", list.size(), " tensors; expected one per layer (",
                             layers, ")"));
      }
      const size_t per = static_cast<size_t>(kv_heads) * head_dim * cols;
      to->resize(per * layers);
      for (int l = 0; l < layers; ++l) {
        const F32Array& t = list[l];
        if (t.shape(0) != static_cast<size_t>(kv_heads) ||
            t.shape(1) != static_cast<size_t>(head_dim) ||
            t.shape(2) != static_cast<size_t>(cols)) {
          Invalid(absl::StrCat(name, "[", l, "] must be f32 [kv_heads=", kv_heads,
                               ", head_dim=", head_dim, ", ", cols, "]"));
        }
        if (per > 0) std::memcpy(to->data() + l * per, t.data(), per * sizeof(float));
      }
    };
    if (e->has_basis) {
      e->basis.manifest = m;
      read(basis, "basis", basis_rank, &e->basis.u);
      if (!encode_basis.empty()) read(encode_basis, "encode_basis", basis_rank, &e->basis.encode);
      if (!query_moment.empty()) {
        read(query_moment, "query_moment", head_dim, &e->basis.query_moment);
      }
      // The checks every basis passes on a server (finite, orthonormal or A^T B = I,
      // symmetric moments): what the codec tables are then built from is never garbage.
      Check(core::CheckBasisTensors(m, e->basis));
    } else if (!basis.empty() || !encode_basis.empty() || !query_moment.empty()) {
      Invalid("basis, encode_basis and query_moment must be empty when info.basis_rank is 0");
    }
    e->codec = MergeSettings(core::Registry::DefaultCodec(m, e->has_basis), codec, "info.codec");
    entry_ = std::move(e);
  }

  const core::ModelEntry& entry() const { return *entry_; }
  Codec DefaultCodec() const { return MakeCodec(nb::dict()); }

  // A sequence's codec: `settings` over the model's defaults (a GetBlocksResponse's codec has
  // every field set), with the model's head_dim, rank 0 without a basis; refused as the server
  // refuses it for a new sequence (rank beyond the basis rank; metric rounding without query
  // moments: FAILED_PRECONDITION).
  Codec MakeCodec(const nb::dict& settings) const {
    const core::BasisManifest& m = entry_->manifest;
    core::CodecOptions c = MergeSettings(entry_->codec, settings, "codec");
    c.head_dim = m.head_dim;
    if (!entry_->has_basis) c.rank = 0;
    if (c.rank > m.rank) {
      Invalid(absl::StrCat("codec.rank ", c.rank, " exceeds the basis rank ", m.rank, " of model '",
                           m.model, "'"));
    }
    if (c.metric_rounding && entry_->basis.query_moment.empty()) {
      throw StatusError{absl::FailedPreconditionError(
          absl::StrCat("codec.metric_rounding needs query moments, which model '", m.model,
                       "' version ", m.version, " was registered without"))};
    }
    return Codec(c);
  }

  LayerEncoder* Encoder(int layer, const Codec& codec) const {
    CheckLayer(layer);
    return new LayerEncoder(entry_, layer, codec.options());
  }

  // One GetBlocks message in codes of layer `layer` of a sequence of `codec`: the run of
  // groups from token `start` (blocks, block_bytes, the fp16 sinks' bytes or b"", the
  // fingerprint it names) checked as untrusted and decoded (core::DecodeMessage),
  // then the window rows (keys, values [kv_heads, n, head_dim], or None): [kv_heads, groups * G
  // + n, head_dim] each in `dtype`, bit for bit what GetBlocks decodes ([groups * G + n,
  // kv_heads, head_dim] with token_major: a paged cache's writer's order, no transpose after).
  std::pair<OutArray, OutArray> Decode(int layer, const Codec& codec, int64_t start,
                                       const nb::bytes& blocks, const U32Array& block_bytes,
                                       const nb::bytes& sink_keys, const nb::bytes& sink_values,
                                       const std::string& basis_fingerprint,
                                       const nb::object& rows_keys, const nb::object& rows_values,
                                       const std::string& dtype_name, bool token_major) const {
    const core::DType dtype = ParseDType(dtype_name);
    const int kv = entry_->manifest.kv_heads, d = entry_->manifest.head_dim;
    const core::EncodedGroupsView run = RunOf(layer, codec, start, blocks, block_bytes, sink_keys,
                                              sink_values, basis_fingerprint, /*rows_only=*/false);
    const WindowRows rows(rows_keys, rows_values, kv, d);
    std::vector<uint8_t> keys, values;
    {
      nb::gil_scoped_release unlocked;
      const auto tables = ReadTables(layer, codec);
      // What the server sends is checked as what a client sends is: never trusted.
      Check(core::DecodeMessage(
          codec.options(), kv, tables->basis.empty() ? nullptr : tables->basis.data(), run,
          rows.keys(), rows.values(), dtype, "encoded", &keys, &values,
          token_major ? core::RowOrder::kTokenMajor : core::RowOrder::kHeadMajor));
    }
    const int64_t n = run.groups * codec.options().key_group + rows.n;
    const size_t tokens = static_cast<size_t>(n), heads = static_cast<size_t>(kv);
    const std::initializer_list<size_t> shape = {
        token_major ? tokens : heads, token_major ? heads : tokens, static_cast<size_t>(d)};
    return {ToNumpy(std::move(keys), NumpyDType(dtype), shape),
            ToNumpy(std::move(values), NumpyDType(dtype), shape)};
  }

  // Decode's message written straight into a paged KV cache (core::DecodeMessageInto): `cache`
  // (any shape, C-contiguous, f32/f16/bf16, written in place) holds channel c of token t, KV
  // head h of K at element block_offsets[t / block_size] + h * head_stride + key_index[(t %
  // block_size) * head_dim + c] (V: value_index); only tokens [from_token, to_token) are
  // written. A message of window rows only may start at any token. Returns the tokens written.
  int64_t DecodeInto(int layer, const Codec& codec, int64_t start, const nb::bytes& blocks,
                     const U32Array& block_bytes, const nb::bytes& sink_keys,
                     const nb::bytes& sink_values, const std::string& basis_fingerprint,
                     const nb::object& rows_keys, const nb::object& rows_values, CacheArray cache,
                     const I32Array& key_index, const I32Array& value_index,
                     const I64Array& block_offsets, int64_t head_stride, int64_t block_size,
                     int64_t from_token, int64_t to_token) const {
    const int kv = entry_->manifest.kv_heads, d = entry_->manifest.head_dim;
    const core::EncodedGroupsView run =
        RunOf(layer, codec, start, blocks, block_bytes, sink_keys, sink_values, basis_fingerprint,
              /*rows_only=*/block_bytes.shape(0) == 0);
    const WindowRows rows(rows_keys, rows_values, kv, d);
    core::PagedRows p;
    p.base = static_cast<uint8_t*>(cache.data());
    p.dtype = DTypeOf(cache.dtype(), "cache");
    p.elements = static_cast<int64_t>(cache.size());
    p.block_tokens = block_size;
    p.head_stride = head_stride;
    p.block_offsets = {block_offsets.data(), block_offsets.shape(0)};
    p.key_index = {key_index.data(), key_index.shape(0)};
    p.value_index = {value_index.data(), value_index.shape(0)};
    p.from_token = from_token;
    p.to_token = to_token;
    absl::StatusOr<int64_t> written;
    {
      nb::gil_scoped_release unlocked;
      const auto tables = ReadTables(layer, codec);
      written = core::DecodeMessageInto(codec.options(), kv,
                                        tables->basis.empty() ? nullptr : tables->basis.data(), run,
                                        start, rows.keys(), rows.values(), "encoded", p);
    }
    Check(written.status());
    return *written;
  }

 private:
  // A message's run of groups (from token `start`, a multiple of G unless rows_only: a message
  // of window rows only), viewed in the arguments' bytes; a run of another basis than the
  // model's is FAILED_PRECONDITION.
  core::EncodedGroupsView RunOf(int layer, const Codec& codec, int64_t start,
                                const nb::bytes& blocks, const U32Array& block_bytes,
                                const nb::bytes& sink_keys, const nb::bytes& sink_values,
                                const std::string& basis_fingerprint, bool rows_only) const {
    CheckLayer(layer);
    const core::BasisManifest& m = entry_->manifest;
    const int G = codec.options().key_group;
    core::EncodedGroupsView run;
    run.bytes = {reinterpret_cast<const uint8_t*>(blocks.c_str()), blocks.size()};
    run.sizes = {block_bytes.data(), block_bytes.shape(0)};
    run.sink_keys = {reinterpret_cast<const uint8_t*>(sink_keys.c_str()), sink_keys.size()};
    run.sink_values = {reinterpret_cast<const uint8_t*>(sink_values.c_str()), sink_values.size()};
    run.basis_fingerprint = basis_fingerprint;
    run.groups = static_cast<int64_t>(run.sizes.size()) / (2 * m.kv_heads);
    if (start < 0 || (!rows_only && start % G != 0)) {
      Invalid(absl::StrCat("start ", start, " must be a non-negative multiple of G (", G, ")"));
    }
    run.first_group = start / G;
    if (codec.options().rank > 0 && run.groups > 0 && run.basis_fingerprint != m.fingerprint) {
      throw StatusError{absl::FailedPreconditionError(
          absl::StrCat("encoded.basis_fingerprint '", run.basis_fingerprint,
                       "': the side codes were made with another basis than model '", m.model,
                       "' version ", m.version, "'s (", m.fingerprint, ")"))};
    }
    return run;
  }

  // The decode tables of a layer: decoding needs only the decode basis (no rounding factors, a
  // Cholesky per head).
  std::shared_ptr<const core::LayerCodecTables> ReadTables(int layer, const Codec& codec) const {
    core::CodecOptions reads = codec.options();
    reads.metric_rounding = false;
    return core::MakeLayerCodecTables(*entry_, layer, reads);
  }

  void CheckLayer(int layer) const {
    if (layer < 0 || layer >= entry_->manifest.layers) {
      Invalid(absl::StrCat("layer ", layer, " must be in 0..", entry_->manifest.layers - 1));
    }
  }

  std::shared_ptr<const core::ModelEntry> entry_;
};

}  // namespace
}  // namespace kvq::python

NB_MODULE(_codes, m) {
  using namespace kvq::python;
  m.doc() =
      "HeadQ codes encoded and decoded by kvq's own codec (core), bit for bit the server's. "
      "Use kvq.codes, which wraps this module.";
  // Clients keep their models' codes (kvq._wire_codes) for their lifetime, and a client may
  // live until the interpreter exits: those objects are then alive at teardown by design, not
  // leaked by reference counting, so nanobind's teardown report would only be noise.
  nb::set_leak_warnings(false);

  g_error = PyErr_NewException("kvq._codes.Error", PyExc_Exception, nullptr);
  m.attr("Error") = nb::handle(g_error);
  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const StatusError& e) {
      nb::tuple args =
          nb::make_tuple(static_cast<int>(e.status.code()), std::string(e.status.message()));
      PyErr_SetObject(g_error, args.ptr());
    }
  });

  m.attr("BLOCK_VERSION_MIN") = static_cast<int>(kvq::format::kMinVersion);
  m.attr("BLOCK_VERSION_MAX") = static_cast<int>(kvq::format::kMaxVersion);
  m.def(
      "codec_fields",
      [] {
        std::vector<std::string> names;
        for (const kvq::core::CodecField& f : kvq::core::CodecFields()) names.emplace_back(f.name);
        return names;
      },
      "The names of the codec settings, in wire-number order (core's codec table).");

  nb::class_<Codec>(m, "Codec", "A validated codec of one model (Model.codec).")
      .def("settings", &Codec::Settings,
           "Every setting, {name: value} (value_policy 'uniform' or 'a2').")
      .def_prop_ro("head_dim", [](const Codec& c) { return c.options().head_dim; })
      .def_prop_ro("key_group", [](const Codec& c) { return c.options().key_group; })
      .def_prop_ro("rank", [](const Codec& c) { return c.options().rank; })
      .def_prop_ro("fp16_sinks", [](const Codec& c) { return c.options().fp16_sinks; })
      .def_prop_ro("window", [](const Codec& c) { return c.options().window; })
      .def("__str__", [](const Codec& c) { return c.options().ToString(); });

  nb::class_<EncodedRun>(m, "EncodedRun", "What one LayerEncoder.append gives.")
      .def_ro("first_group", &EncodedRun::first_group)
      .def_ro("groups", &EncodedRun::groups)
      .def_ro("blocks", &EncodedRun::blocks)
      .def_ro("block_bytes", &EncodedRun::block_bytes)
      .def_ro("sink_keys", &EncodedRun::sink_keys)
      .def_ro("sink_values", &EncodedRun::sink_values)
      .def_ro("basis_fingerprint", &EncodedRun::basis_fingerprint)
      .def_ro("keys", &EncodedRun::keys)
      .def_ro("values", &EncodedRun::values)
      .def_ro("rows_dtype", &EncodedRun::rows_dtype)
      .def_ro("tokens", &EncodedRun::tokens)
      .def_ro("encoded_tokens", &EncodedRun::encoded_tokens);

  nb::class_<LayerEncoder>(m, "LayerEncoder", "One layer's encoder (Model.encoder).")
      .def("append", &LayerEncoder::Append, nb::arg("keys"), nb::arg("values"),
           "Appends [kv_heads, n, head_dim] keys and values; returns the groups encoded since "
           "the last append and the rows after them.")
      .def_prop_ro("layer", &LayerEncoder::layer)
      .def_prop_ro("tokens", &LayerEncoder::tokens)
      .def_prop_ro("encoded_tokens", &LayerEncoder::encoded_tokens);

  nb::class_<Model>(m, "Model", "A model entry as GetBasis describes it.")
      .def(nb::init<const std::string&, int, int, int, int, int, int, const std::string&,
                    const nb::dict&, const std::vector<F32Array>&, const std::vector<F32Array>&,
                    const std::vector<F32Array>&>(),
           nb::arg("model"), nb::arg("version"), nb::arg("layers"), nb::arg("kv_heads"),
           nb::arg("q_heads"), nb::arg("head_dim"), nb::arg("basis_rank"), nb::arg("fingerprint"),
           nb::arg("codec"), nb::arg("basis"), nb::arg("encode_basis"), nb::arg("query_moment"))
      .def("default_codec", &Model::DefaultCodec)
      .def("codec", &Model::MakeCodec, nb::arg("settings"))
      .def("encoder", &Model::Encoder, nb::arg("layer"), nb::arg("codec"),
           nb::rv_policy::take_ownership)
      .def("decode", &Model::Decode, nb::arg("layer"), nb::arg("codec"), nb::arg("start"),
           nb::arg("blocks"), nb::arg("block_bytes"), nb::arg("sink_keys"), nb::arg("sink_values"),
           nb::arg("basis_fingerprint"), nb::arg("keys").none(), nb::arg("values").none(),
           nb::arg("dtype"), nb::arg("token_major") = false)
      .def("decode_into", &Model::DecodeInto, nb::arg("layer"), nb::arg("codec"), nb::arg("start"),
           nb::arg("blocks"), nb::arg("block_bytes"), nb::arg("sink_keys"), nb::arg("sink_values"),
           nb::arg("basis_fingerprint"), nb::arg("keys").none(), nb::arg("values").none(),
           nb::arg("cache"), nb::arg("key_index"), nb::arg("value_index"), nb::arg("block_offsets"),
           nb::arg("head_stride"), nb::arg("block_size"), nb::arg("from_token"),
           nb::arg("to_token"));
}
