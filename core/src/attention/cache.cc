#include "kvq/core/cache.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <new>

#include "absl/strings/str_cat.h"
#include "core/src/codec/value_policy.h"
#include "kvq/core/attend_backend.h"
#include "kvq/core/half.h"
#include "kvq/core/partial_attention.h"
#include "kvq/core/status.h"
#include "kvq/kernels/kernels.h"

namespace kvq::core {

double SizeReport::k_bits_steady() const {
  return encoded_elements ? 8.0 * key_block_bytes / encoded_elements : 0.0;
}
double SizeReport::v_bits_steady() const {
  return encoded_elements ? 8.0 * value_block_bytes / encoded_elements : 0.0;
}
double SizeReport::k_bits_effective() const {
  return elements ? 8.0 * (key_block_bytes + key_window_bytes + key_sink_bytes) / elements : 0.0;
}
double SizeReport::v_bits_effective() const {
  return elements ? 8.0 * (value_block_bytes + value_window_bytes + value_sink_bytes) / elements
                  : 0.0;
}
SizeReport& SizeReport::operator+=(const SizeReport& o) {
  // Summing layers (or sequences) of the same shape: token rows and bytes add up.
  tokens += o.tokens;
  encoded_tokens += o.encoded_tokens;
  window_tokens += o.window_tokens;
  if (elements_per_token == 0) elements_per_token = o.elements_per_token;
  elements += o.elements;
  encoded_elements += o.encoded_elements;
  key_block_bytes += o.key_block_bytes;
  value_block_bytes += o.value_block_bytes;
  key_window_bytes += o.key_window_bytes;
  value_window_bytes += o.value_window_bytes;
  key_sink_bytes += o.key_sink_bytes;
  value_sink_bytes += o.value_sink_bytes;
  sealed_block_bytes += o.sealed_block_bytes;
  return *this;
}

std::shared_ptr<const LayerCodecTables> MakeLayerCodecTables(const CodecOptions& o, int kv_heads,
                                                             const float* basis,
                                                             const float* encode_basis,
                                                             const float* query_moment,
                                                             const float* value_metric) {
  auto t = std::make_shared<LayerCodecTables>();
  const int d = o.head_dim, r = basis ? o.rank : 0;
  if (r > 0) t->basis.assign(basis, basis + static_cast<size_t>(kv_heads) * d * r);
  // The encoder projects with A^T (U^T unless an oblique pair is given), kept transposed.
  const float* enc = r > 0 && encode_basis ? encode_basis : t->basis.data();
  t->basis_t.resize(t->basis.size());
  for (int h = 0; h < kv_heads; ++h)
    for (int c = 0; c < d; ++c)
      for (int j = 0; j < r; ++j)
        t->basis_t[(static_cast<size_t>(h) * r + j) * d + c] =
            enc[(static_cast<size_t>(h) * d + c) * r + j];
  if (o.metric_rounding && query_moment) {
    for (int h = 0; h < kv_heads; ++h) {
      const size_t hb = static_cast<size_t>(h) * d * r;
      std::vector<float> f = KeyRoundingFactor(query_moment + static_cast<size_t>(h) * d * d, d,
                                               r > 0 ? t->basis.data() + hb : nullptr,
                                               r > 0 ? enc + hb : nullptr, r, o.rotate_keys);
      t->rounding.insert(t->rounding.end(), f.begin(), f.end());
    }
  }
  if (value_metric) {
    for (int h = 0; h < kv_heads; ++h) {
      std::vector<float> f =
          ValueRoundingFactor(value_metric + static_cast<size_t>(h) * d * d, d, o.rotate_values);
      t->value_rounding.insert(t->value_rounding.end(), f.begin(), f.end());
    }
  }
  return t;
}

LayerCache::LayerCache(const CodecOptions& o, int kv_heads, const float* basis, BytePool* pool,
                       const float* encode_basis, const float* query_moment,
                       const float* value_metric)
    : LayerCache(o, kv_heads,
                 MakeLayerCodecTables(o, kv_heads, basis, encode_basis, query_moment, value_metric),
                 pool) {}

LayerCache::LayerCache(const CodecOptions& o, int kv_heads,
                       std::shared_ptr<const LayerCodecTables> tables, BytePool* pool)
    : opts_(o),
      kv_heads_(kv_heads),
      pool_(pool ? pool : HostBytePool()),
      tables_(std::move(tables)),
      heads_(kv_heads, Head(pool_)),
      kblock_bytes_(KeyBlockBytes(o)) {
  if (o.rank > 0 && tables_->basis.empty()) {  // no basis: KIVI-like base only
    opts_.rank = 0;
    kblock_bytes_ = KeyBlockBytes(opts_);  // the blocks are those of rank 0
  }
}

namespace {

// Room for `more` bytes: growth by at least a quarter of the capacity, so that appending one
// group at a time (decode) copies each block a bounded number of times (at most 4 on average)
// instead of once per later group, for at most a quarter of the capacity left unused.
void Reserve(Bytes* v, size_t more) {
  const size_t need = v->size() + more;
  if (need > v->capacity()) v->reserve(std::max(need, v->capacity() + v->capacity() / 4));
}

absl::Status CheckKV(const TensorView& t, absl::string_view name, int kv_heads, int d, int64_t n) {
  if (t.rank != 3)
    return absl::InvalidArgumentError(
        absl::StrCat(name, ": rank ", t.rank, ", must be 3 ([kv_heads, tokens, head_dim])"));
  if (t.shape[0] != kv_heads)
    return absl::InvalidArgumentError(
        absl::StrCat(name, ".shape[0] = ", t.shape[0], ": must equal kv_heads = ", kv_heads));
  if (t.shape[1] != n)
    return absl::InvalidArgumentError(
        absl::StrCat(name, ".shape[1] = ", t.shape[1], ": must equal the token count ", n));
  if (t.shape[2] != d)
    return absl::InvalidArgumentError(
        absl::StrCat(name, ".shape[2] = ", t.shape[2], ": must equal head_dim = ", d));
  if (t.data == nullptr && t.numel() > 0)
    return absl::InvalidArgumentError(absl::StrCat(name, ": no data"));
  return absl::OkStatus();
}

// True when every element is finite and within +-kMaxStorableMagnitude (the fp16 range the
// block's scales and zero points are stored in), read from the raw bits: a larger element
// would give its group an infinite zero point, so that every token of it decodes to Inf/NaN.
// Non-finite bit patterns are above every bound, so one comparison tests both.
bool AllStorable(DType t, const uint8_t* p, int n, int* bad) {
  // The magnitude bits compared as signed integers of the element's width (non-negative once
  // the sign is masked off): one vector compare per lane width, where an unsigned compare
  // would need widening (this scan reads every input byte first, so it sets the encode's pace).
  auto scan = [&](const auto* u, auto mask, auto bound) {
    using S = decltype(mask);
    S any = 0;
    for (int c = 0; c < n; ++c) any |= static_cast<S>(static_cast<S>(u[c] & mask) > bound);
    if (!any) return true;
    for (int c = 0; c < n; ++c)
      if (static_cast<S>(u[c] & mask) > bound) return *bad = c, false;
    return false;
  };
  if (t == DType::kF32)
    return scan(reinterpret_cast<const int32_t*>(p), int32_t{0x7fffffff},
                static_cast<int32_t>(kF32StorableBits));
  return scan(reinterpret_cast<const int16_t*>(p), int16_t{0x7fff},
              static_cast<int16_t>(t == DType::kF16 ? kHalfStorableBits : kBF16StorableBits));
}

// The message for element `c` of a row that AllStorable rejected.
absl::Status NotStorable(DType t, const uint8_t* row, int c, absl::string_view name, int h,
                         int64_t j) {
  float x;
  ToFloat(t, row + c * DTypeSize(t), &x, 1);
  const std::string at = absl::StrCat(name, "[", h, ", ", j, ", ", c, "]");
  if (!std::isfinite(x))
    return absl::InvalidArgumentError(absl::StrCat(at, " is not finite (in ", DTypeName(t), ")"));
  return absl::InvalidArgumentError(
      absl::StrCat(at, " = ", x, ": outside [-", kMaxStorableMagnitude, ", ", kMaxStorableMagnitude,
                   "], the fp16 range of the block format's scales and zero points"));
}

absl::Status CheckQueries(int q_heads, int kv_heads, int n_q);

bool FastRows(const TensorView& t, DType to) { return to == t.dtype && t.stride[2] == 1; }

const uint8_t* RowPtr(const TensorView& t, int h, int64_t j) {
  return static_cast<const uint8_t*>(t.data) +
         (h * t.stride[0] + j * t.stride[1]) * DTypeSize(t.dtype);
}

// Checks that one head's rows [n][d] are storable (AllStorable) once stored as dtype `to`
// (a conversion that overflows, f32 -> f16, counts too). Reads only: the cache is not touched.
absl::Status ValidateRows(const TensorView& t, int h, int64_t n, int d, DType to,
                          absl::string_view name) {
  int bad = 0;
  // A contiguous run of rows stored as is: one pass over all of it (the common case).
  if (FastRows(t, to) && t.stride[1] == d && n * d <= INT32_MAX &&
      AllStorable(to, RowPtr(t, h, 0), static_cast<int>(n * d), &bad))
    return absl::OkStatus();
  std::vector<float> row;
  std::vector<uint8_t> conv;
  for (int64_t j = 0; j < n; ++j) {
    const uint8_t* p = RowPtr(t, h, j);
    if (!FastRows(t, to)) {
      row.resize(d);
      conv.resize(d * DTypeSize(to));
      t.RowToFloat({h, j}, row.data());
      FromFloat(to, row.data(), conv.data(), d);
      p = conv.data();
    }
    if (!AllStorable(to, p, d, &bad)) return NotStorable(to, p, bad, name, h, j);
  }
  return absl::OkStatus();
}

// Appends one head's rows [j0, n) ([n][d]) to dst as dtype `to` (already validated).
void AppendRows(const TensorView& t, int h, int64_t j0, int64_t n, int d, DType to,
                std::vector<uint8_t>* dst) {
  if (j0 >= n) return;
  const size_t es = DTypeSize(to);
  const size_t at = dst->size();
  dst->resize(at + (n - j0) * d * es);
  uint8_t* out = dst->data() + at;
  if (FastRows(t, to) && t.stride[1] == d) {  // the head's rows are one contiguous run
    std::memcpy(out, RowPtr(t, h, j0), (n - j0) * d * es);
    return;
  }
  std::vector<float> row(d);
  for (int64_t j = j0; j < n; ++j, out += d * es) {
    if (FastRows(t, to)) {
      std::memcpy(out, RowPtr(t, h, j), d * es);
    } else {
      t.RowToFloat({h, j}, row.data());
      FromFloat(to, row.data(), out, d);
    }
  }
}

// Converts G rows of d elements, `stride` bytes apart, to fp32 [G][d]; true when every
// element is storable (ToFloatStorable).
bool RowsToFloat(DType dt, const uint8_t* rows, int64_t stride, int G, int d, float* out) {
  const size_t row_bytes = static_cast<size_t>(d) * DTypeSize(dt);
  if (stride == static_cast<int64_t>(row_bytes))
    return ToFloatStorable(dt, rows, out, static_cast<size_t>(G) * d);
  bool ok = true;
  for (int t = 0; t < G; ++t)
    ok &= ToFloatStorable(dt, rows + t * stride, out + static_cast<size_t>(t) * d, d);
  return ok;
}

void Widen(std::vector<uint8_t>* win, DType from) {
  const size_t n = win->size() / DTypeSize(from);
  std::vector<uint8_t> out(n * 4);
  ToFloat(from, win->data(), reinterpret_cast<float*>(out.data()), n);
  win->swap(out);
}

}  // namespace

absl::Status CheckStorable(const TensorView& t, absl::string_view name) {
  if (t.rank != 3)
    return absl::InvalidArgumentError(absl::StrCat(name, ": rank ", t.rank, ", must be 3"));
  for (int h = 0; h < t.shape[0]; ++h)
    RETURN_IF_ERROR(ValidateRows(t, h, t.shape[1], static_cast<int>(t.shape[2]), t.dtype, name));
  return absl::OkStatus();
}

absl::Status LayerCache::Append(const TensorView& k, const TensorView& v, int64_t start,
                                const float* probe_weights) {
  return AppendImpl(k, v, start, probe_weights, nullptr);
}

absl::Status LayerCache::Append(const TensorView& k, const TensorView& v, int64_t start,
                                const ProbeQueries& probes) {
  return AppendImpl(k, v, start, nullptr, &probes);
}

absl::Status LayerCache::AppendImpl(const TensorView& k, const TensorView& v, int64_t start,
                                    const float* probe_weights, const ProbeQueries* probes) {
  RETURN_IF_ERROR(opts_.Validate());
  if (start != tokens_)
    return absl::InvalidArgumentError(
        absl::StrCat("start = ", start, ": must equal the cached token count ", tokens_));
  const int d = opts_.head_dim;
  const int64_t n = k.rank == 3 ? k.shape[1] : -1;
  if (n < 0) return CheckKV(k, "keys", kv_heads_, d, 0);
  RETURN_IF_ERROR(CheckKV(k, "keys", kv_heads_, d, n));
  RETURN_IF_ERROR(CheckKV(v, "values", kv_heads_, d, n));
  if (n == 0) return absl::OkStatus();
  // The window keeps the arrival dtype; mixed dtypes widen it to f32 (lossless).
  const bool has_window = tokens_ > encoded_;
  DType to = k.dtype == v.dtype ? k.dtype : DType::kF32;
  if (has_window && heads_[0].win_dtype != to) to = DType::kF32;
  // Validate everything before touching the cache, so that bad input harms nothing stored.
  auto validate = [&]() -> absl::Status {
    for (int h = 0; h < kv_heads_; ++h) {
      RETURN_IF_ERROR(ValidateRows(k, h, n, d, to, "keys"));
      RETURN_IF_ERROR(ValidateRows(v, h, n, d, to, "values"));
    }
    return absl::OkStatus();
  };
  const int64_t ready =
      std::max<int64_t>(0, (tokens_ + n - encoded_ - opts_.window) / opts_.key_group);
  // Nothing waits in the window and the rows are stored as they arrive: the whole groups are
  // encoded straight from the input (the same bytes the window would hold), each group checked
  // as it is converted, so that the rows are read from memory once; a bad value undoes every
  // append and the check above reports it as before.
  const bool direct =
      probes == nullptr && !has_window && ready > 0 && FastRows(k, to) && FastRows(v, to);
  if (!direct) RETURN_IF_ERROR(validate());
  if (probes != nullptr) {
    RETURN_IF_ERROR(CheckQueries(probes->q_heads, kv_heads_, probes->n));
    if (probes->q == nullptr) return absl::InvalidArgumentError("probe queries: no data");
    if (probes->causal_offset < -1)
      return absl::InvalidArgumentError(
          absl::StrCat("probe causal_offset = ", probes->causal_offset, ": must be >= -1"));
  }
  // Sealed groups only lead the cache: once an unsealed block exists, no more sealing.
  building_.clear();
  building_sinks_.reset();
  // Every byte the new groups take from the block pool, taken before anything changes: a pool
  // that cannot give it (std::bad_alloc) fails the append with RESOURCE_EXHAUSTED and leaves
  // the cache as it was (the encoders below then never grow a block vector).
  try {
    if (sealing_ && heads_[0].voffsets.empty()) {
      for (int64_t g = 0; g < ready; ++g) {
        // Sized once: its exact bytes (the largest A^2 value blocks), never regrown.
        auto b = std::make_shared<SealedBlock>(pool_);
        b->bytes.reserve(static_cast<size_t>(kv_heads_) *
                         (kblock_bytes_ + MaxValueBlockBytes(opts_)));
        b->offsets.reserve(2 * kv_heads_ + 1);
        building_.push_back(std::move(b));
      }
    } else if (ready > 0) {
      for (Head& hd : heads_) {
        Reserve(&hd.kblocks, ready * kblock_bytes_);
        Reserve(&hd.vblocks, ready * MaxValueBlockBytes(opts_));
      }
    }
  } catch (const std::bad_alloc&) {
    building_.clear();
    return absl::ResourceExhaustedError(absl::StrCat("append of ", n,
                                                     " tokens: the block pool cannot hold ", ready,
                                                     " more groups of ", kv_heads_, " heads"));
  }
  tokens_ += n;
  auto join_window = [&](int h, int64_t j0) {
    Head& hd = heads_[h];
    if (has_window && hd.win_dtype != to) {
      Widen(&hd.kwin, hd.win_dtype);
      Widen(&hd.vwin, hd.win_dtype);
    }
    hd.win_dtype = to;
    AppendRows(k, h, j0, n, d, to, &hd.kwin);
    AppendRows(v, h, j0, n, d, to, &hd.vwin);
    for (int64_t j = j0; j < n; ++j) {
      hd.a2_sum.push_back(0.0f);
      hd.a2_reads.push_back(0);
      hd.probe.push_back(probe_weights ? probe_weights[h * n + j] : -1.0f);
    }
  };
  if (probes != nullptr) {
    // Everything joins the window, the probes read it, then the ready groups are encoded.
    for (int h = 0; h < kv_heads_; ++h) join_window(h, 0);
    std::vector<float> scratch(static_cast<size_t>(probes->q_heads) * probes->n * d);
    AttendOptions ao;
    ao.causal_offset = probes->causal_offset;
    RETURN_IF_ERROR(Attend(probes->q, probes->q_heads, probes->n, ao, scratch.data()));
    for (int h = 0; h < kv_heads_; ++h) RETURN_IF_ERROR(EncodeGroups(h, ready));
  } else if (direct) {
    RETURN_IF_ERROR(EncodeInput(
        k, v, n, to, ready, probe_weights, [&](int h) { join_window(h, ready * opts_.key_group); },
        validate));
  } else {
    // Head by head: append to the window and encode what is ready while it is warm in cache.
    for (int h = 0; h < kv_heads_; ++h) {
      join_window(h, 0);
      RETURN_IF_ERROR(EncodeGroups(h, ready));
    }
  }
  if (building_sinks_) {  // the first group was encoded: its sinks are complete
    building_sinks_->checksum = building_sinks_->Hash();
    sinks_ = std::move(building_sinks_);
    if (!building_.empty() && sealed_.empty()) building_[0]->sinks = sinks_;
  }
  for (auto& b : building_) sealed_.push_back(std::move(b));
  building_.clear();
  encoded_ += ready * opts_.key_group;
  return absl::OkStatus();
}

void LayerCache::WindowToFloat(const Head& hd, bool keys, float* out) const {
  const auto& w = keys ? hd.kwin : hd.vwin;
  ToFloat(hd.win_dtype, w.data(), out, w.size() / DTypeSize(hd.win_dtype));
}

absl::Status LayerCache::EncodeInput(const TensorView& k, const TensorView& v, int64_t n, DType to,
                                     int64_t ready, const float* probe_weights,
                                     const std::function<void(int)>& keep_rest,
                                     const std::function<absl::Status()>& validate) {
  const int G = opts_.key_group, d = opts_.head_dim;
  std::vector<size_t> sizes(3 * kv_heads_);
  std::vector<DType> dtypes(kv_heads_);
  for (int h = 0; h < kv_heads_; ++h) {
    sizes[3 * h] = heads_[h].kblocks.size();
    sizes[3 * h + 1] = heads_[h].vblocks.size();
    sizes[3 * h + 2] = heads_[h].voffsets.size();
    dtypes[h] = heads_[h].win_dtype;
  }
  auto finite = [&](const TensorView& t, int h, int64_t j0, int64_t j1) {
    int bad = 0;
    if (t.stride[1] == d)
      return AllStorable(to, RowPtr(t, h, j0), static_cast<int>((j1 - j0) * d), &bad);
    for (int64_t j = j0; j < j1; ++j)
      if (!AllStorable(to, RowPtr(t, h, j), d, &bad)) return false;
    return true;
  };
  // The whole groups are checked by EncodeGroups as it converts them (input rows are read
  // once); the rows after them, which join the window, here.
  bool ok = true;
  absl::Status st;
  for (int h = 0; h < kv_heads_ && ok && st.ok(); ++h) {
    InputRows in{RowPtr(k, h, 0),
                 RowPtr(v, h, 0),
                 k.stride[1] * static_cast<int64_t>(DTypeSize(to)),
                 v.stride[1] * static_cast<int64_t>(DTypeSize(to)),
                 to,
                 probe_weights ? probe_weights + h * n : nullptr};
    st = EncodeGroups(h, ready, &in);
    ok = ok && finite(k, h, ready * G, n) && finite(v, h, ready * G, n);
    if (ok && st.ok()) keep_rest(h);
  }
  if (ok && st.ok()) return absl::OkStatus();
  for (int h = 0; h < kv_heads_; ++h) {  // only appends happened: undo them
    Head& hd = heads_[h];
    hd.win_dtype = dtypes[h];
    hd.kblocks.resize(sizes[3 * h]);
    hd.vblocks.resize(sizes[3 * h + 1]);
    hd.voffsets.resize(sizes[3 * h + 2]);
    hd.kwin.clear();
    hd.vwin.clear();
    hd.a2_sum.clear();
    hd.a2_reads.clear();
    hd.probe.clear();
  }
  building_.clear();
  building_sinks_.reset();
  tokens_ -= n;
  RETURN_IF_ERROR(validate());
  return st.ok() ? absl::InternalError("append: input changed while it was encoded") : st;
}

absl::Status LayerCache::EncodeGroups(int h, int64_t ready, const InputRows* input) {
  if (ready == 0) return absl::OkStatus();
  const int G = opts_.key_group, d = opts_.head_dim, r = opts_.rank;
  const AttendBackend* ops = EncodesOn();
  // On the block ops every group's rows and widths are prepared first (one call encodes them
  // all); on the CPU one group at a time (kf, vf hold that group).
  const size_t rows = static_cast<size_t>(ops ? ready : 1) * G * d;
  thread_local std::vector<float> kf, vf, wts;
  thread_local std::vector<uint8_t> widths;
  kf.resize(rows);
  vf.resize(rows);
  wts.resize(G);
  widths.resize(static_cast<size_t>(ops ? ready : 1) * G);
  Head& hd = heads_[h];
  const DType dt = input ? input->dtype : hd.win_dtype;
  const int64_t row_bytes = static_cast<int64_t>(d) * DTypeSize(dt);
  const int64_t kstride = input ? input->kstride : row_bytes;
  const int64_t vstride = input ? input->vstride : row_bytes;
  const uint8_t* krows = input ? input->k : hd.kwin.data();
  const uint8_t* vrows = input ? input->v : hd.vwin.data();
  // Group g's rows as fp32 into k, v (the sinks' stand-ins in place) and, for per-token value
  // widths, its widths into w (else w is left alone).
  auto prepare = [&](int64_t g, float* k, float* v, uint8_t* w) -> absl::Status {
    const int64_t first = g * G;  // window (or input) index of the group's first token
    // Input rows are checked as they are converted (window rows were checked on arrival):
    // EncodeInput undoes the append and names the element.
    const bool keys_ok = RowsToFloat(dt, krows + first * kstride, kstride, G, d, k);
    const bool values_ok = RowsToFloat(dt, vrows + first * vstride, vstride, G, d, v);
    if (input && !(keys_ok && values_ok))
      return absl::InvalidArgumentError("append: input rows not storable");
    if (opts_.fp16_sinks > 0 && encoded_ + first == 0) HoldSinks(h, k, v);
    if (!opts_.per_token_value_bits()) return absl::OkStatus();
    bool any = false;
    for (int t = 0; t < G; ++t) {
      const int64_t j = first + t;
      const float probe = input ? (input->probe ? input->probe[j] : -1.0f) : hd.probe[j];
      if (probe >= 0) {
        wts[t] = probe;
        any = true;
      } else if (!input && hd.a2_reads[j] > 0) {
        wts[t] = hd.a2_sum[j] / hd.a2_reads[j];
        any = true;
      } else {
        wts[t] = 1.0f;
      }
    }
    ChooseValueBits(opts_, v, d, any ? wts.data() : nullptr, G, encoded_ + first, w);
    return absl::OkStatus();
  };
  const bool seal = !building_.empty();
  if (!seal) {
    Reserve(&hd.kblocks, ready * kblock_bytes_);
    Reserve(&hd.vblocks, ready * MaxValueBlockBytes(opts_));
  }
  const uint8_t* wp = opts_.per_token_value_bits() ? widths.data() : nullptr;
  if (ops != nullptr) {
    const size_t n = static_cast<size_t>(G) * d;
    for (int64_t g = 0; g < ready; ++g)
      RETURN_IF_ERROR(prepare(g, kf.data() + g * n, vf.data() + g * n, widths.data() + g * G));
    RETURN_IF_ERROR(EncodeOnBackend(*ops, h, ready, kf.data(), vf.data(), wp));
  } else {
    const float* Ut = r > 0 ? tables_->basis_t.data() + static_cast<size_t>(h) * d * r : nullptr;
    // The blocks are encoded into host memory and copied into the pool's (which may be device
    // memory): unsealed ones once per call, key blocks and value blocks, a sealed group's once
    // per group and head.
    thread_local std::vector<uint8_t> kst, vst;
    kst.clear();
    vst.clear();
    for (int64_t g = 0; g < ready; ++g) {
      const int64_t first = g * G;
      RETURN_IF_ERROR(prepare(g, kf.data(), vf.data(), widths.data()));
      // Reading the input from memory is what a memcpy of it costs: the next group's key rows
      // are fetched while this group's keys are quantized, its value rows while the values
      // are, a few lines at a time (kernels::PrefetchWhileEncoding), so the next conversion
      // finds them in cache.
      const bool fetch_next = input && g + 1 < ready;
      SealedBlock* sb = seal ? building_[g].get() : nullptr;
      // Dense-and-sparse: reads decode keys with the decode basis; the sinks' stand-in rows of
      // a sequence's first group are never kept exact.
      SparseEncode sparse;
      sparse.decode_basis = r > 0 && !tables_->basis.empty()
                                ? tables_->basis.data() + static_cast<size_t>(h) * d * r
                                : nullptr;
      sparse.skip_rows = encoded_ + first == 0 ? opts_.fp16_sinks : 0;
      if (fetch_next) kernels::PrefetchWhileEncoding(krows + (first + G) * kstride, G * kstride);
      RETURN_IF_ERROR(EncodeKeyBlockT(
          opts_, kf.data(), d, Ut, &kst,
          tables_->rounding.empty() ? nullptr
                                    : tables_->rounding.data() + static_cast<size_t>(h) * d * d,
          &sparse));
      if (seal) sb->offsets.push_back(static_cast<uint32_t>(sb->bytes.size() + kst.size()));
      const float* vround = tables_->value_rounding.empty()
                                ? nullptr
                                : tables_->value_rounding.data() + static_cast<size_t>(h) * d * d;
      if (fetch_next) kernels::PrefetchWhileEncoding(vrows + (first + G) * vstride, G * vstride);
      if (seal) {
        RETURN_IF_ERROR(EncodeValueBlock(opts_, vf.data(), d, wp, &kst, vround, &sparse));
        sb->offsets.push_back(static_cast<uint32_t>(sb->bytes.size() + kst.size()));
        RETURN_IF_ERROR(sb->bytes.Append(kst.data(), kst.size()));
        kst.clear();
        continue;
      }
      hd.voffsets.push_back(hd.vblocks.size() + vst.size());
      RETURN_IF_ERROR(EncodeValueBlock(opts_, vf.data(), d, wp, &vst, vround, &sparse));
    }
    RETURN_IF_ERROR(hd.kblocks.Append(kst.data(), kst.size()));
    RETURN_IF_ERROR(hd.vblocks.Append(vst.data(), vst.size()));
  }
  if (input) return absl::OkStatus();  // the window never held these rows
  // Drop the encoded tokens from the window once (not per group: prefill stays linear).
  const size_t group_bytes = static_cast<size_t>(G) * row_bytes;
  hd.kwin.erase(hd.kwin.begin(), hd.kwin.begin() + ready * group_bytes);
  hd.vwin.erase(hd.vwin.begin(), hd.vwin.begin() + ready * group_bytes);
  hd.a2_sum.erase(hd.a2_sum.begin(), hd.a2_sum.begin() + ready * G);
  hd.a2_reads.erase(hd.a2_reads.begin(), hd.a2_reads.begin() + ready * G);
  hd.probe.erase(hd.probe.begin(), hd.probe.begin() + ready * G);
  return absl::OkStatus();
}

void LayerCache::HoldSinks(int h, float* keys, float* values) {
  const int S = opts_.fp16_sinks, d = opts_.head_dim;
  if (!building_sinks_) {
    building_sinks_ = std::make_shared<SinkRows>();
    building_sinks_->sinks = S;
    building_sinks_->head_dim = d;
    building_sinks_->keys.resize(static_cast<size_t>(kv_heads_) * S * d);
    building_sinks_->values.resize(building_sinks_->keys.size());
  }
  const size_t at = static_cast<size_t>(h) * S * d;
  FromFloat(DType::kF16, keys, building_sinks_->keys.data() + at, static_cast<size_t>(S) * d);
  FromFloat(DType::kF16, values, building_sinks_->values.data() + at, static_cast<size_t>(S) * d);
  // The stand-in: the first row after the sinks (S < G), an ordinary row of the group.
  for (int t = 0; t < S; ++t) {
    std::copy_n(keys + static_cast<size_t>(S) * d, d, keys + static_cast<size_t>(t) * d);
    std::copy_n(values + static_cast<size_t>(S) * d, d, values + static_cast<size_t>(t) * d);
  }
}

absl::StatusOr<const SinkRows*> LayerCache::ReadSinks(bool verify) const {
  if (!sinks_ || encoded_ == 0) return nullptr;
  if (verify) RETURN_IF_ERROR(sinks_->Verify());
  return sinks_.get();
}

namespace {
absl::Status CheckQueries(int q_heads, int kv_heads, int n_q) {
  if (q_heads <= 0 || q_heads % kv_heads != 0)
    return absl::InvalidArgumentError(absl::StrCat(
        "q_heads = ", q_heads, ": must be a positive multiple of kv_heads = ", kv_heads));
  if (n_q <= 0 || n_q > 65536)
    return absl::InvalidArgumentError(absl::StrCat("n_queries = ", n_q, ": must be in [1, 65536]"));
  return absl::OkStatus();
}
}  // namespace

// Scores the rows [rows][d] of one KV head's query group into out [rows][T].
absl::Status LayerCache::ScoreHead(int h, const float* q, int rows, float scale, bool corr_only,
                                   float* out) const {
  return ScoreRange(h, q, rows, scale, corr_only, 0, encoded_ / opts_.key_group, true, out,
                    tokens_);
}

absl::Status LayerCache::ScoreRange(int h, const float* q, int rows, float scale, bool corr_only,
                                    int64_t b0, int64_t b1, bool window, float* out,
                                    int64_t T) const {
  const Head& hd = heads_[h];
  const int d = opts_.head_dim, r = opts_.rank, G = opts_.key_group;
  thread_local std::vector<float> uq, win, rq;
  const float* U = r > 0 ? tables_->basis.data() + static_cast<size_t>(h) * d * r : nullptr;
  if (r > 0) {
    uq.resize(static_cast<size_t>(rows) * r);
    kernels::Active().project_queries(q, rows, d, U, r, uq.data());
  }
  // Rotated keys are scored with H q: rotated here once for every block, not per block.
  const bool rotate = opts_.rotate_keys && !corr_only && b1 > b0;
  if (rotate) {
    rq.assign(q, q + static_cast<size_t>(rows) * d);
    HadamardRotateRows(rq.data(), d, rows, d);
  }
  const AttendBackend* dev = corr_only ? nullptr : BlocksOn();
  if (dev != nullptr && b1 > b0) {
    RETURN_IF_ERROR(ScoreOnBackend(*dev, h, rotate ? rq.data() : q, r > 0 ? uq.data() : nullptr,
                                   rows, scale, b0, b1, out, T));
  } else {
    const BlockReader reader(opts_, read_.verify_checksums);
    KeyBlockView kv;
    thread_local std::vector<uint8_t> copy;
    for (int64_t b = b0; b < b1; ++b) {
      ASSIGN_OR_RETURN(std::span<const uint8_t> kb, CpuKeyBlock(h, b, &copy));
      RETURN_IF_ERROR(reader.Key(kb, &kv));
      ScoreKeyBlock(kv, rotate ? rq.data() : q, r > 0 ? uq.data() : nullptr, rows, scale,
                    out + (b - b0) * G, T, !corr_only, /*q_rotated=*/rotate);
    }
  }
  // Verified once per call by Score / Readout / Attend, not once per head.
  ASSIGN_OR_RETURN(const SinkRows* sinks, ReadSinks(false));
  if (sinks && b0 == 0 && b1 > 0) {  // the sinks are the first group's first tokens
    if (corr_only)
      return absl::FailedPreconditionError(
          "corrections_only scores: the codec keeps fp16 sinks, whose blocks hold stand-ins "
          "(score whole logits instead)");
    // Exact logits over the blocks' stand-ins (SinkPartial computes the same), with the
    // reference's bits (kernels.h, on project_queries: they feed the next layer's codes).
    kernels::Ref().dense_scores_f16(sinks->key(h, 0), sinks->sinks, d, q, rows, out, T);
    for (int i = 0; i < rows; ++i)
      for (int t = 0; t < sinks->sinks; ++t) out[static_cast<size_t>(i) * T + t] *= scale;
  }
  const int64_t W = window ? tokens_ - encoded_ : 0;
  const int64_t at = (b1 - b0) * G;  // where the window's tokens start in out's rows
  if (W > 0) {
    if (corr_only) {
      for (int i = 0; i < rows; ++i) std::fill_n(out + i * T + at, W, 0.0f);
    } else {
      win.resize(static_cast<size_t>(W) * d);
      WindowToFloat(hd, true, win.data());
      kernels::Active().dense_scores_f32(win.data(), static_cast<int>(W), d, q, rows, out + at, T);
      for (int i = 0; i < rows; ++i)
        for (int64_t t = 0; t < W; ++t) out[i * T + at + t] *= scale;
    }
  }
  return absl::OkStatus();
}

absl::Status LayerCache::ReadoutHead(int h, const float* p, int rows, float* out) const {
  return ReadoutRange(h, p, tokens_, rows, 0, encoded_ / opts_.key_group, true, out);
}

absl::Status LayerCache::ReadoutRange(int h, const float* p, int64_t T, int rows, int64_t b0,
                                      int64_t b1, bool window, float* out) const {
  const Head& hd = heads_[h];
  const int d = opts_.head_dim, G = opts_.key_group;
  thread_local std::vector<float> win;
  std::fill(out, out + static_cast<size_t>(rows) * d, 0.0f);
  // Rotated values: the blocks' readouts summed in the rotated coordinates (out starts at
  // zero), then the sum rotated back once instead of each block's partial output.
  const bool rotated = opts_.rotate_values && b1 > b0;
  const BlockReader reader(opts_, read_.verify_checksums);
  // Verified once per call by Score / Readout / Attend, not once per head.
  ASSIGN_OR_RETURN(const SinkRows* sinks, ReadSinks(false));
  if (b0 > 0 || b1 == 0) sinks = nullptr;  // the sinks are the first group's first tokens
  ValueBlockView vv;
  thread_local std::vector<uint8_t> copy;
  const AttendBackend* dev = BlocksOn();
  if (dev != nullptr && b1 > b0)
    RETURN_IF_ERROR(ReadoutOnBackend(*dev, h, p, T, rows, b0, b1, sinks ? sinks->sinks : 0, out));
  for (int64_t b = b0; dev == nullptr && b < b1; ++b) {
    ASSIGN_OR_RETURN(std::span<const uint8_t> vb, CpuValueBlock(h, b, &copy));
    RETURN_IF_ERROR(reader.Value(vb, &vv));
    if (b == 0 && sinks) {  // the stand-ins get no weight: the sinks' rows are added below
      thread_local std::vector<float> p0;
      p0.resize(static_cast<size_t>(rows) * G);
      for (int i = 0; i < rows; ++i) {
        std::copy_n(p + static_cast<size_t>(i) * T, G, p0.data() + static_cast<size_t>(i) * G);
        std::fill_n(p0.data() + static_cast<size_t>(i) * G, sinks->sinks, 0.0f);
      }
      ReadoutValueBlock(vv, p0.data(), G, rows, out, d, /*out_rotated=*/rotated);
      continue;
    }
    ReadoutValueBlock(vv, p + (b - b0) * G, T, rows, out, d, /*out_rotated=*/rotated);
  }
  if (rotated) HadamardRotateRows(out, d, rows, d);
  if (sinks)
    kernels::Ref().dense_readout_f16(sinks->value(h, 0), sinks->sinks, d, p, T, rows, out, d);
  const int64_t W = window ? tokens_ - encoded_ : 0;
  const int64_t at = (b1 - b0) * G;  // where the window's weights start in p's rows
  if (W > 0) {
    win.resize(static_cast<size_t>(W) * d);
    WindowToFloat(hd, false, win.data());
    kernels::Active().dense_readout_f32(win.data(), static_cast<int>(W), d, p + at, T, rows, out,
                                        d);
  }
  return absl::OkStatus();
}

absl::Status LayerCache::Score(const float* q, int q_heads, int n_q, float* out, float scale,
                               bool corrections_only) const {
  RETURN_IF_ERROR(CheckQueries(q_heads, kv_heads_, n_q));
  RETURN_IF_ERROR(ReadSinks(read_.verify_checksums).status());
  const int d = opts_.head_dim, gq = q_heads / kv_heads_, rows = gq * n_q;
  if (scale == 0.0f) scale = 1.0f / std::sqrt(static_cast<float>(d));
  for (int h = 0; h < kv_heads_; ++h)
    RETURN_IF_ERROR(ScoreHead(h, q + static_cast<size_t>(h) * rows * d, rows, scale,
                              corrections_only, out + static_cast<size_t>(h) * rows * tokens_));
  return absl::OkStatus();
}

absl::Status LayerCache::Readout(const float* p, int q_heads, int n_q, float* out) const {
  RETURN_IF_ERROR(CheckQueries(q_heads, kv_heads_, n_q));
  RETURN_IF_ERROR(ReadSinks(read_.verify_checksums).status());
  const int d = opts_.head_dim, gq = q_heads / kv_heads_, rows = gq * n_q;
  for (int h = 0; h < kv_heads_; ++h)
    RETURN_IF_ERROR(ReadoutHead(h, p + static_cast<size_t>(h) * rows * tokens_, rows,
                                out + static_cast<size_t>(h) * rows * d));
  return absl::OkStatus();
}

absl::Status LayerCache::Attend(const float* q, int q_heads, int n_q, const AttendOptions& ao,
                                float* out) {
  RETURN_IF_ERROR(CheckQueries(q_heads, kv_heads_, n_q));
  RETURN_IF_ERROR(ReadSinks(read_.verify_checksums).status());
  if (tokens_ == 0) return absl::FailedPreconditionError("attend over an empty cache");
  if (ao.causal_offset < -1)
    return absl::InvalidArgumentError(
        absl::StrCat("causal_offset = ", ao.causal_offset, ": must be >= -1"));
  const int d = opts_.head_dim, gq = q_heads / kv_heads_, rows = gq * n_q;
  const int64_t T = tokens_;
  const float scale = ao.scale != 0.0f ? ao.scale : 1.0f / std::sqrt(static_cast<float>(d));
  if (ao.backend) {
    bool used = false;
    RETURN_IF_ERROR(AttendOnBackend(q, q_heads, n_q, ao, scale, out, &used));
    if (used) return absl::OkStatus();
  }
  if (ao.parts > 1 && T >= ao.split_min_tokens && encoded_ / opts_.key_group > 1)
    return AttendSplit(q, q_heads, n_q, ao, scale, out);
  // The weights are read out unnormalized, exp(s - m), and each output row is divided by its
  // sum afterwards, as a split Attend's one part and MergePartials do: the int16 readout rounds
  // a block's weights on the scale of its largest, so a split whose visible tokens all lie in
  // one part reads the same weights and gives the same bits (docs/CODEC.md, "Split attention").
  thread_local std::vector<float> s, inv;
  s.resize(static_cast<size_t>(rows) * T);
  inv.resize(rows);
  const auto& kt = kernels::Active();
  for (int h = 0; h < kv_heads_; ++h) {
    RETURN_IF_ERROR(
        ScoreHead(h, q + static_cast<size_t>(h) * rows * d, rows, scale, false, s.data()));
    Head& hd = heads_[h];
    for (int i = 0; i < rows; ++i) {
      float* si = s.data() + static_cast<size_t>(i) * T;
      const int qi = i % n_q;
      const int64_t vis =
          ao.causal_offset < 0 ? T : std::min<int64_t>(T, ao.causal_offset + qi + 1);
      inv[i] = 1.0f / kt.exp_sum(si, vis, kt.max_value(si, vis));
      std::fill(si + vis, si + T, 0.0f);
      if (ao.observe)
        for (int64_t t = encoded_; t < vis; ++t) {
          const float w = si[t] * inv[i];  // the softmax weight
          hd.a2_sum[t - encoded_] += w * w;
          hd.a2_reads[t - encoded_] += 1;
        }
    }
    float* o = out + static_cast<size_t>(h) * rows * d;
    RETURN_IF_ERROR(ReadoutHead(h, s.data(), rows, o));
    for (int i = 0; i < rows; ++i)
      for (int c = 0; c < d; ++c) o[static_cast<size_t>(i) * d + c] *= inv[i];
  }
  return absl::OkStatus();
}

std::vector<int64_t> LayerCache::AttendPartBounds(int parts) const {
  const int64_t G = opts_.key_group, nb = encoded_ / G;
  const int64_t p = std::max<int64_t>(1, std::min<int64_t>(parts, nb));
  std::vector<int64_t> bounds(p + 1);
  for (int64_t k = 0; k < p; ++k) bounds[k] = nb * k / p * G;
  bounds[p] = tokens_;
  return bounds;
}

// Part k of a split Attend, for every KV head: logits of tokens [bounds[k], bounds[k + 1]),
// masked causally, exponentiated against the part's maximum and read out unnormalized
// (partial_attention.h). m, l: [q_heads * n_q]; o: [q_heads * n_q][d]; window_p (the last
// part, when observing): the window tokens' exp(s - m), [q_heads * n_q][W].
absl::Status LayerCache::AttendPart(const float* q, int q_heads, int n_q, const AttendOptions& ao,
                                    float scale, const std::vector<int64_t>& bounds, int k,
                                    float* m, float* l, float* o, float* window_p) const {
  const int d = opts_.head_dim, G = opts_.key_group, rows = q_heads / kv_heads_ * n_q;
  const int64_t t0 = bounds[k], t1 = bounds[k + 1], len = t1 - t0;
  const bool last = k + 2 == static_cast<int>(bounds.size());
  const int64_t b0 = t0 / G, b1 = last ? encoded_ / G : t1 / G;
  const int64_t W = last ? tokens_ - encoded_ : 0;
  thread_local std::vector<float> s;
  s.resize(static_cast<size_t>(rows) * len);
  const auto& kt = kernels::Active();
  for (int h = 0; h < kv_heads_; ++h) {
    const size_t r0 = static_cast<size_t>(h) * rows;  // this head's first query row
    RETURN_IF_ERROR(ScoreRange(h, q + r0 * d, rows, scale, false, b0, b1, last, s.data(), len));
    for (int i = 0; i < rows; ++i) {
      float* si = s.data() + static_cast<size_t>(i) * len;
      const int64_t vis = ao.causal_offset < 0
                              ? tokens_
                              : std::min<int64_t>(tokens_, ao.causal_offset + i % n_q + 1);
      const int64_t n = std::clamp<int64_t>(vis - t0, 0, len);
      if (n == 0) {
        m[r0 + i] = -std::numeric_limits<float>::infinity();
        l[r0 + i] = 0.0f;
      } else {
        m[r0 + i] = kt.max_value(si, n);
        l[r0 + i] = kt.exp_sum(si, n, m[r0 + i]);
      }
      std::fill(si + n, si + len, 0.0f);
      if (window_p && W > 0) std::copy_n(si + (len - W), W, window_p + (r0 + i) * W);
    }
    RETURN_IF_ERROR(ReadoutRange(h, s.data(), len, rows, b0, b1, last, o + r0 * d));
  }
  return absl::OkStatus();
}

absl::Status LayerCache::AttendSplit(const float* q, int q_heads, int n_q, const AttendOptions& ao,
                                     float scale, float* out) {
  const int d = opts_.head_dim;
  const int64_t R = static_cast<int64_t>(q_heads) * n_q, W = tokens_ - encoded_;
  const std::vector<int64_t> bounds = AttendPartBounds(ao.parts);
  const int P = static_cast<int>(bounds.size()) - 1;
  std::vector<float> m(P * R), l(P * R), o(P * R * d), wp(ao.observe ? R * W : 0);
  std::vector<absl::Status> st(P);
  const std::function<void(int)> part = [&](int k) {
    st[k] = AttendPart(q, q_heads, n_q, ao, scale, bounds, k, m.data() + k * R, l.data() + k * R,
                       o.data() + k * R * d, k == P - 1 && !wp.empty() ? wp.data() : nullptr);
  };
  if (ao.run_parts) {
    (*ao.run_parts)(P, part);
  } else {
    for (int k = 0; k < P; ++k) part(k);
  }
  for (const absl::Status& s : st) RETURN_IF_ERROR(s);
  MergePartials(m.data(), l.data(), o.data(), P, R, d, out);
  if (!wp.empty() && W > 0) RecordWindowWeights(m.data(), l.data(), P, R, n_q, ao, wp.data());
  return absl::OkStatus();
}

void LayerCache::RecordWindowWeights(const float* m, const float* l, int P, int64_t R, int n_q,
                                     const AttendOptions& ao, const float* wp) {
  const int64_t W = tokens_ - encoded_;
  const int rows = static_cast<int>(R / kv_heads_);
  // The window tokens' normalized weights, exp(s - m_last) exp(m_last - M) / L.
  for (int64_t r = 0; r < R; ++r) {
    const int64_t vis = ao.causal_offset < 0
                            ? tokens_
                            : std::min<int64_t>(tokens_, ao.causal_offset + (r % rows) % n_q + 1);
    if (vis <= encoded_) continue;
    float mx = -std::numeric_limits<float>::infinity(), denom = 0.0f;
    for (int k = 0; k < P; ++k) mx = std::max(mx, m[k * R + r]);
    for (int k = 0; k < P; ++k)
      if (l[k * R + r] > 0.0f) denom += std::exp(m[k * R + r] - mx) * l[k * R + r];
    const float f = std::exp(m[(P - 1) * R + r] - mx) / denom;
    Head& hd = heads_[r / rows];
    for (int64_t t = encoded_; t < vis; ++t) {
      const float pt = wp[r * W + (t - encoded_)] * f;
      hd.a2_sum[t - encoded_] += pt * pt;
      hd.a2_reads[t - encoded_] += 1;
    }
  }
}

absl::Status LayerCache::Observe(const float* p, int q_heads, int n_q) {
  RETURN_IF_ERROR(CheckQueries(q_heads, kv_heads_, n_q));
  const int rows = q_heads / kv_heads_ * n_q;
  const int64_t T = tokens_;
  for (int h = 0; h < kv_heads_; ++h) {
    for (int i = 0; i < rows; ++i) {
      const float* pi = p + (static_cast<size_t>(h) * rows + i) * T;
      for (int64_t t = encoded_; t < T; ++t) {
        if (!(pi[t] >= 0.0f && pi[t] <= 1.0f))
          return absl::InvalidArgumentError(
              absl::StrCat("p[", h, ", ", i, ", ", t, "] = ", pi[t], ": must be in [0, 1]"));
      }
    }
  }
  // Validated: record (a row reads the window tokens up to its last non-zero weight, as a
  // causal Attend would have seen them).
  for (int h = 0; h < kv_heads_; ++h) {
    Head& hd = heads_[h];
    for (int i = 0; i < rows; ++i) {
      const float* pi = p + (static_cast<size_t>(h) * rows + i) * T;
      int64_t last = T - 1;
      while (last >= encoded_ && pi[last] == 0.0f) --last;
      for (int64_t t = encoded_; t <= last; ++t) {
        hd.a2_sum[t - encoded_] += pi[t] * pi[t];
        hd.a2_reads[t - encoded_] += 1;
      }
    }
  }
  return absl::OkStatus();
}

absl::Status LayerCache::Decode(std::vector<float>* keys, std::vector<float>* values) const {
  return Decode(0, tokens_, keys, values);
}

absl::Status LayerCache::Decode(int64_t from, int64_t to, std::vector<float>* keys,
                                std::vector<float>* values) const {
  if (from < 0 || to < from || to > tokens_)
    return DecodeInto(from, to, DType::kF32, nullptr, nullptr);
  // Every element is written (blocks, sinks, window): no zero-fill pass.
  const size_t n = static_cast<size_t>(to - from) * opts_.head_dim * kv_heads_;
  keys->resize(n);
  values->resize(n);
  return DecodeInto(from, to, DType::kF32, reinterpret_cast<uint8_t*>(keys->data()),
                    reinterpret_cast<uint8_t*>(values->data()));
}

absl::Status LayerCache::DecodeAs(int64_t from, int64_t to, DType dtype, std::vector<uint8_t>* keys,
                                  std::vector<uint8_t>* values) const {
  if (dtype != DType::kF32 && dtype != DType::kF16 && dtype != DType::kBF16)
    return absl::InvalidArgumentError(
        absl::StrCat("decode to ", DTypeName(dtype), ": must be f32, f16 or bf16"));
  if (from < 0 || to < from || to > tokens_) return DecodeInto(from, to, dtype, nullptr, nullptr);
  const size_t n = static_cast<size_t>(to - from) * opts_.head_dim * kv_heads_ * DTypeSize(dtype);
  keys->resize(n);
  values->resize(n);
  return DecodeInto(from, to, dtype, keys->data(), values->data());
}

absl::Status LayerCache::DecodeInto(int64_t from, int64_t to, DType dtype, uint8_t* kout_all,
                                    uint8_t* vout_all) const {
  if (from < 0 || to < from || to > tokens_) {
    return absl::OutOfRangeError(
        absl::StrCat("decode range [", from, ", ", to, ") must lie in [0, ", tokens_, "]"));
  }
  const int d = opts_.head_dim, G = opts_.key_group, r = opts_.rank;
  const int64_t n = to - from;
  if (n == 0) return absl::OkStatus();  // nothing to write (and the outputs may be null)
  const size_t es = DTypeSize(dtype), row_bytes = static_cast<size_t>(d) * es;
  const bool f32 = dtype == DType::kF32;
  // fp32 rows [count][d] written as `dtype` at dst.
  auto emit = [&](const float* src, int64_t count, uint8_t* dst) {
    if (f32) {
      std::memcpy(dst, src, count * row_bytes);
    } else {
      FromFloat(dtype, src, dst, static_cast<size_t>(count) * d);
    }
  };
  // Blocks overlapping [from, to): fp32 and whole ones are decoded in place, the others
  // through a scratch group (L1-sized) and converted. Every block read is verified.
  const int64_t b0 = from / G, b1 = (std::min(to, encoded_) + G - 1) / G;
  ASSIGN_OR_RETURN(const SinkRows* sinks, ReadSinks(true));
  thread_local std::vector<float> kg, vg;
  thread_local std::vector<uint8_t> kcopy, vcopy;
  kg.resize(static_cast<size_t>(G) * d);
  vg.resize(static_cast<size_t>(G) * d);
  const AttendBackend* dev = BlocksOn();
  // On the backend: the blocks decoded where they lie, kBackendBlocks at a time, into fp32
  // rows here (kg, vg then hold that many groups).
  constexpr int64_t kBackendBlocks = 32;
  if (dev != nullptr) {
    kg.resize(static_cast<size_t>(kBackendBlocks) * G * d);
    vg.resize(kg.size());
  }
  for (int h = 0; h < kv_heads_; ++h) {
    const Head& hd = heads_[h];
    uint8_t* kd = kout_all + h * n * row_bytes;
    uint8_t* vd = vout_all + h * n * row_bytes;
    const float* U = r > 0 ? tables_->basis.data() + static_cast<size_t>(h) * d * r : nullptr;
    for (int64_t c0 = b0; dev != nullptr && c0 < b1; c0 += kBackendBlocks) {
      const int64_t c1 = std::min(b1, c0 + kBackendBlocks);
      RETURN_IF_ERROR(DecodeOnBackend(*dev, h, c0, c1, kg.data(), vg.data()));
      const int64_t lo = std::max(from, c0 * G), hi = std::min(to, c1 * G);
      const size_t off = static_cast<size_t>(lo - c0 * G) * d;
      emit(kg.data() + off, hi - lo, kd + (lo - from) * row_bytes);
      emit(vg.data() + off, hi - lo, vd + (lo - from) * row_bytes);
    }
    for (int64_t b = b0; dev == nullptr && b < b1; ++b) {
      const int64_t lo = std::max(from, b * G), hi = std::min(to, (b + 1) * G);
      const bool direct = f32 && lo == b * G && hi == (b + 1) * G;
      uint8_t* kout = kd + (lo - from) * row_bytes;
      uint8_t* vout = vd + (lo - from) * row_bytes;
      // The output lines are asked for before the block is decoded, so that their misses
      // overlap the decode instead of stalling the stores after it (a large output does not
      // stay in cache from call to call).
      for (size_t off = 0; off < static_cast<size_t>(hi - lo) * row_bytes; off += 64) {
        __builtin_prefetch(kout + off, 1);
        __builtin_prefetch(vout + off, 1);
      }
      ASSIGN_OR_RETURN(std::span<const uint8_t> kb, CpuKeyBlock(h, b, &kcopy));
      ASSIGN_OR_RETURN(KeyBlockView kv, ParseKeyBlock(kb, opts_, true));
      DecodeKeyBlock(kv, U, direct ? reinterpret_cast<float*>(kout) : kg.data());
      ASSIGN_OR_RETURN(std::span<const uint8_t> vb, CpuValueBlock(h, b, &vcopy));
      ASSIGN_OR_RETURN(ValueBlockView vv, ParseValueBlock(vb, opts_, true));
      DecodeValueBlock(vv, direct ? reinterpret_cast<float*>(vout) : vg.data());
      if (!direct) {
        const size_t off = static_cast<size_t>(lo - b * G) * d;
        emit(kg.data() + off, hi - lo, kout);
        emit(vg.data() + off, hi - lo, vout);
      }
    }
    for (int64_t t = from; sinks && t < std::min<int64_t>(to, sinks->sinks); ++t) {
      ToFloat(DType::kF16, sinks->key(h, static_cast<int>(t)), kg.data(), d);
      ToFloat(DType::kF16, sinks->value(h, static_cast<int>(t)), vg.data(), d);
      emit(kg.data(), 1, kd + (t - from) * row_bytes);
      emit(vg.data(), 1, vd + (t - from) * row_bytes);
    }
    if (to > encoded_) {  // window tokens [max(from, encoded_), to)
      const int64_t W = tokens_ - encoded_, lo = std::max(from, encoded_);
      std::vector<float> kw(static_cast<size_t>(W) * d), vw(kw.size());
      WindowToFloat(hd, true, kw.data());
      WindowToFloat(hd, false, vw.data());
      const size_t off = static_cast<size_t>(lo - encoded_) * d;
      emit(kw.data() + off, to - lo, kd + (lo - from) * row_bytes);
      emit(vw.data() + off, to - lo, vd + (lo - from) * row_bytes);
    }
  }
  return absl::OkStatus();
}

absl::Status LayerCache::VerifyAll() const {
  RETURN_IF_ERROR(ReadSinks(true).status());
  const int64_t nb = encoded_ / opts_.key_group;
  if (const AttendBackend* dev = BlocksOn()) return VerifyOnBackend(*dev, 0, kv_heads_, 0, nb);
  std::vector<uint8_t> copy;
  for (int h = 0; h < kv_heads_; ++h)
    for (int64_t b = 0; b < nb; ++b) {
      ASSIGN_OR_RETURN(std::span<const uint8_t> kb, CpuKeyBlock(h, b, &copy));
      RETURN_IF_ERROR(VerifyBlock(kb));
      ASSIGN_OR_RETURN(std::span<const uint8_t> vb, CpuValueBlock(h, b, &copy));
      RETURN_IF_ERROR(VerifyBlock(vb));
    }
  return absl::OkStatus();
}

int64_t LayerCache::OverheadBytes() const {
  // A heap block costs its capacity and malloc's header (16 bytes on glibc x86-64).
  auto held = [](const auto& v) -> int64_t {
    return v.capacity() ? static_cast<int64_t>(v.capacity() * sizeof(v[0])) + 16 : 0;
  };
  int64_t b = static_cast<int64_t>(sizeof(LayerCache)) + 16 + held(heads_) + held(sealed_) +
              held(building_);
  for (const Head& h : heads_) {
    // The window's bytes are counted in Size(); here its unused capacity and header.
    b += held(h.kwin) - static_cast<int64_t>(h.kwin.size()) + held(h.vwin) -
         static_cast<int64_t>(h.vwin.size()) + held(h.voffsets) + held(h.a2_sum) +
         held(h.a2_reads) + held(h.probe);
  }
  // The sinks' bytes are counted in Size(); here the object and its vectors' headers.
  if (sinks_ && (sealed_.empty() || sealed_[0]->sinks != sinks_))
    b += static_cast<int64_t>(sizeof(SinkRows)) + 3 * 16;
  return b;
}

int64_t LayerCache::NewOverheadBytes(int kv_heads) {
  return static_cast<int64_t>(sizeof(LayerCache)) + 16 +
         static_cast<int64_t>(kv_heads) * static_cast<int64_t>(sizeof(Head)) + 16;
}

SizeReport LayerCache::Size() const {
  SizeReport s;
  s.tokens = tokens_;
  s.encoded_tokens = encoded_;
  s.window_tokens = tokens_ - encoded_;
  s.elements_per_token = static_cast<int64_t>(kv_heads_) * opts_.head_dim;
  s.elements = s.tokens * s.elements_per_token;
  s.encoded_elements = s.encoded_tokens * s.elements_per_token;
  for (const SealedBlockPtr& b : sealed_) {
    s.key_block_bytes += b->key_bytes();
    s.value_block_bytes += b->value_bytes();
    s.sealed_block_bytes += static_cast<int64_t>(b->bytes.size());
  }
  if (sinks_ && encoded_ > 0) {
    s.key_sink_bytes = 2 * static_cast<int64_t>(sinks_->keys.size());
    s.value_sink_bytes = 2 * static_cast<int64_t>(sinks_->values.size());
    // Held by the first sealed group when it is shared: counted once, with it.
    if (!sealed_.empty() && sealed_[0]->sinks == sinks_) s.sealed_block_bytes += sinks_->bytes();
  }
  for (const Head& hd : heads_) {
    s.key_block_bytes += hd.kblocks.size();
    s.value_block_bytes += hd.vblocks.size();
    s.key_window_bytes += hd.kwin.size();
    s.value_window_bytes += hd.vwin.size();
  }
  return s;
}

std::span<const uint8_t> LayerCache::KeyBlock(int h, int64_t b) const {
  const int64_t ns = static_cast<int64_t>(sealed_.size());
  if (b < ns) return sealed_[b]->key(h);
  return {heads_[h].kblocks.data() + (b - ns) * kblock_bytes_, kblock_bytes_};
}

std::span<const uint8_t> LayerCache::ValueBlock(int h, int64_t b) const {
  const int64_t ns = static_cast<int64_t>(sealed_.size());
  if (b < ns) return sealed_[b]->value(h);
  const Head& hd = heads_[h];
  const size_t i = b - ns;
  const size_t start = hd.voffsets[i];
  const size_t end = i + 1 < hd.voffsets.size() ? hd.voffsets[i + 1] : hd.vblocks.size();
  return {hd.vblocks.data() + start, end - start};
}

absl::StatusOr<std::span<const uint8_t>> LayerCache::CpuKeyBlock(
    int h, int64_t b, std::vector<uint8_t>* scratch) const {
  const BytePool& pool =
      b < static_cast<int64_t>(sealed_.size()) ? *sealed_[b]->bytes.pool() : *pool_;
  return CpuView(pool, KeyBlock(h, b), scratch);
}

absl::StatusOr<std::span<const uint8_t>> LayerCache::CpuValueBlock(
    int h, int64_t b, std::vector<uint8_t>* scratch) const {
  const BytePool& pool =
      b < static_cast<int64_t>(sealed_.size()) ? *sealed_[b]->bytes.pool() : *pool_;
  return CpuView(pool, ValueBlock(h, b), scratch);
}

bool LayerCache::AllSealed() const {
  return tokens_ == encoded_ && encoded_ == static_cast<int64_t>(sealed_.size()) * opts_.key_group;
}

absl::Status LayerCache::CheckSinksOf(const SealedBlock& blk, bool first) const {
  const int S = first ? opts_.fp16_sinks : 0;
  if (S == 0) {
    if (blk.sinks)
      return absl::InvalidArgumentError(
          "sealed block: holds fp16 sinks where the codec keeps none (or not a first group)");
    return absl::OkStatus();
  }
  const size_t rows = static_cast<size_t>(kv_heads_) * S * opts_.head_dim;
  if (!blk.sinks || blk.sinks->sinks != S || blk.sinks->head_dim != opts_.head_dim ||
      blk.sinks->keys.size() != rows || blk.sinks->values.size() != rows)
    return absl::InvalidArgumentError(
        absl::StrCat("sealed block: a first group of a codec with fp16_sinks = ", S, " needs its ",
                     S, " sink rows per head"));
  return absl::OkStatus();
}

absl::Status LayerCache::CheckSealed(const SealedBlock& blk) const {
  if (blk.offsets.size() != static_cast<size_t>(2 * kv_heads_ + 1) ||
      blk.offsets.back() != blk.bytes.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("sealed block: ", blk.offsets.size(), " offsets over ", blk.bytes.size(),
                     " bytes; a layer of ", kv_heads_, " KV heads needs ", 2 * kv_heads_ + 1));
  }
  for (int h = 0; h < kv_heads_; ++h) {
    if (blk.offsets[2 * h] > blk.offsets[2 * h + 1] ||
        blk.offsets[2 * h + 1] > blk.offsets[2 * h + 2]) {
      return absl::InvalidArgumentError("sealed block: offsets out of order");
    }
    std::vector<uint8_t> copy;
    ASSIGN_OR_RETURN(std::span<const uint8_t> kb, CpuView(*blk.bytes.pool(), blk.key(h), &copy));
    RETURN_IF_ERROR(ParseKeyBlock(kb, opts_, false).status());
    ASSIGN_OR_RETURN(std::span<const uint8_t> vb, CpuView(*blk.bytes.pool(), blk.value(h), &copy));
    RETURN_IF_ERROR(ParseValueBlock(vb, opts_, false).status());
  }
  return absl::OkStatus();
}

absl::Status LayerCache::AttachSealed(std::span<const SealedBlockPtr> blocks) {
  if (!AllSealed()) {
    return absl::FailedPreconditionError(
        absl::StrCat("sealed blocks attach only to a cache whose every token is sealed (", tokens_,
                     " tokens, ", encoded_, " encoded, ", sealed_.size(), " sealed groups)"));
  }
  for (size_t i = 0; i < blocks.size(); ++i) {
    if (!blocks[i]) return absl::InvalidArgumentError("sealed block: null");
    RETURN_IF_ERROR(CheckSealed(*blocks[i]));
    RETURN_IF_ERROR(CheckSinksOf(*blocks[i], tokens_ == 0 && i == 0));
  }
  if (tokens_ == 0 && !blocks.empty()) sinks_ = blocks[0]->sinks;
  sealed_.insert(sealed_.end(), blocks.begin(), blocks.end());
  const int64_t n = static_cast<int64_t>(blocks.size()) * opts_.key_group;
  tokens_ += n;
  encoded_ += n;
  return absl::OkStatus();
}

absl::Status LayerCache::ReplaceSealed(int64_t b, SealedBlockPtr block) {
  if (b < 0 || b >= static_cast<int64_t>(sealed_.size())) {
    return absl::OutOfRangeError(
        absl::StrCat("sealed block ", b, ": the cache holds ", sealed_.size()));
  }
  if (!block) return absl::InvalidArgumentError("sealed block: null");
  RETURN_IF_ERROR(CheckSealed(*block));
  RETURN_IF_ERROR(CheckSinksOf(*block, b == 0));
  if (b == 0) sinks_ = block->sinks;
  sealed_[b] = std::move(block);
  return absl::OkStatus();
}

}  // namespace kvq::core

namespace kvq::core {

absl::Status LayerCache::ExportGroups(int64_t g0, int64_t g1, EncodedGroups* out) const {
  const int64_t groups = encoded_ / opts_.key_group;
  if (g0 < 0 || g0 > g1 || g1 > groups) {
    return absl::OutOfRangeError(
        absl::StrCat("groups [", g0, ", ", g1, "): the layer holds ", groups, " encoded groups"));
  }
  *out = EncodedGroups{};
  out->first_group = g0;
  out->groups = g1 - g0;
  out->sizes.reserve(static_cast<size_t>(g1 - g0) * 2 * kv_heads_);
  // Sized once (the blocks' sizes are known wherever they lie): a run grown block by block
  // was copied and faulted in anew at every doubling.
  size_t total = 0;
  for (int64_t g = g0; g < g1; ++g)
    for (int h = 0; h < kv_heads_; ++h) total += KeyBlock(h, g).size() + ValueBlock(h, g).size();
  out->bytes.reserve(total);
  std::vector<uint8_t> scratch;
  for (int64_t g = g0; g < g1; ++g) {
    for (int h = 0; h < kv_heads_; ++h) {
      for (int value = 0; value < 2; ++value) {
        ASSIGN_OR_RETURN(std::span<const uint8_t> b,
                         value ? CpuValueBlock(h, g, &scratch) : CpuKeyBlock(h, g, &scratch));
        RETURN_IF_ERROR(VerifyBlock(b));
        out->bytes.append(reinterpret_cast<const char*>(b.data()), b.size());
        out->sizes.push_back(static_cast<uint32_t>(b.size()));
      }
    }
  }
  if (g0 == 0 && g1 > 0 && sinks_) {
    RETURN_IF_ERROR(sinks_->Verify());
    out->sink_keys = sinks_->keys;
    out->sink_values = sinks_->values;
  }
  return absl::OkStatus();
}

absl::Status LayerCache::AppendGroups(const EncodedGroupsView& run) {
  const int G = opts_.key_group, d = opts_.head_dim;
  if (run.first_group * G != encoded_) {
    return absl::FailedPreconditionError(absl::StrCat("encoded groups from group ", run.first_group,
                                                      ": the layer's next group is ",
                                                      encoded_ / G));
  }
  if (run.sizes.size() != static_cast<size_t>(run.groups) * 2 * kv_heads_) {
    return absl::InvalidArgumentError("encoded groups: unchecked run (sizes do not fit)");
  }
  if (run.groups == 0) return absl::OkStatus();
  const std::vector<size_t> at = RunOffsets(run);
  auto block = [&](int64_t g, int h, int value) {
    const size_t i = static_cast<size_t>((g * kv_heads_ + h) * 2 + value);
    return run.bytes.subspan(at[i], run.sizes[i]);
  };
  std::shared_ptr<SinkRows> sinks;
  if (run.first_group == 0 && opts_.fp16_sinks > 0) {
    sinks = std::make_shared<SinkRows>();
    sinks->sinks = opts_.fp16_sinks;
    sinks->head_dim = d;
    const size_t n = static_cast<size_t>(kv_heads_) * opts_.fp16_sinks * d;
    if (run.sink_keys.size() != 2 * n || run.sink_values.size() != 2 * n) {
      return absl::InvalidArgumentError("encoded groups: group 0 without its sink rows");
    }
    sinks->keys.resize(n);
    sinks->values.resize(n);
    for (size_t e = 0; e < n; ++e) {
      sinks->keys[e] = static_cast<uint16_t>(format::LoadU16(run.sink_keys.data() + 2 * e));
      sinks->values[e] = static_cast<uint16_t>(format::LoadU16(run.sink_values.data() + 2 * e));
    }
    sinks->checksum = sinks->Hash();
  }
  const bool seal = sealing_ && heads_[0].voffsets.empty() &&
                    encoded_ == static_cast<int64_t>(sealed_.size()) * G;
  std::vector<std::shared_ptr<SealedBlock>> made;
  // Every byte is placed before anything changes: a pool that cannot give it leaves the cache
  // as it was.
  std::vector<size_t> sizes(3 * kv_heads_);
  for (int h = 0; h < kv_heads_; ++h) {
    sizes[3 * h] = heads_[h].kblocks.size();
    sizes[3 * h + 1] = heads_[h].vblocks.size();
    sizes[3 * h + 2] = heads_[h].voffsets.size();
  }
  absl::Status placed;
  try {
    for (int64_t g = 0; g < run.groups && placed.ok(); ++g) {
      if (seal) {
        auto b = std::make_shared<SealedBlock>(pool_);
        size_t bytes = 0;
        for (int h = 0; h < kv_heads_; ++h) bytes += block(g, h, 0).size() + block(g, h, 1).size();
        b->bytes.reserve(bytes);
        for (int h = 0; h < kv_heads_ && placed.ok(); ++h) {
          for (int value = 0; value < 2 && placed.ok(); ++value) {
            const std::span<const uint8_t> x = block(g, h, value);
            placed = b->bytes.Append(x.data(), x.size());
            b->offsets.push_back(static_cast<uint32_t>(b->bytes.size()));
          }
        }
        made.push_back(std::move(b));
        continue;
      }
      for (int h = 0; h < kv_heads_ && placed.ok(); ++h) {
        Head& hd = heads_[h];
        const std::span<const uint8_t> k = block(g, h, 0), v = block(g, h, 1);
        placed = hd.kblocks.Append(k.data(), k.size());
        hd.voffsets.push_back(hd.vblocks.size());
        if (placed.ok()) placed = hd.vblocks.Append(v.data(), v.size());
      }
    }
  } catch (const std::bad_alloc&) {
    placed = absl::ResourceExhaustedError(
        absl::StrCat("encoded groups: the block pool cannot hold ", run.groups, " more groups of ",
                     kv_heads_, " heads"));
  }
  if (!placed.ok()) {
    for (int h = 0; h < kv_heads_; ++h) {
      heads_[h].kblocks.resize(sizes[3 * h]);
      heads_[h].vblocks.resize(sizes[3 * h + 1]);
      heads_[h].voffsets.resize(sizes[3 * h + 2]);
    }
    return placed;
  }
  // The window rows the run covers go: the run holds them now.
  const int64_t n = run.groups * G;
  const int64_t covered = std::min(tokens_ - encoded_, n);
  for (Head& hd : heads_) {
    const size_t row = static_cast<size_t>(d) * DTypeSize(hd.win_dtype);
    hd.kwin.erase(hd.kwin.begin(), hd.kwin.begin() + covered * row);
    hd.vwin.erase(hd.vwin.begin(), hd.vwin.begin() + covered * row);
    hd.a2_sum.erase(hd.a2_sum.begin(), hd.a2_sum.begin() + covered);
    hd.a2_reads.erase(hd.a2_reads.begin(), hd.a2_reads.begin() + covered);
    hd.probe.erase(hd.probe.begin(), hd.probe.begin() + covered);
  }
  if (sinks) {
    sinks_ = sinks;
    if (seal) made[0]->sinks = sinks;
  }
  for (auto& b : made) sealed_.push_back(std::move(b));
  encoded_ += n;
  tokens_ = std::max(tokens_, encoded_);
  return absl::OkStatus();
}

}  // namespace kvq::core
