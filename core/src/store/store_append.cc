// The store's write path: StoreImpl::Append and its steps (store_append.h).
#include "core/src/store/store_append.h"

#include <algorithm>
#include <cstring>
#include <new>
#include <optional>
#include <set>

#include "absl/strings/str_cat.h"
#include "kvq/core/encoded_groups.h"
#include "kvq/core/field_error.h"
#include "kvq/core/status.h"
#include "xxhash.h"

namespace kvq::core {

namespace {

constexpr int64_t kMaxAppendTokens = 65536;

// Hash of token t (all heads, keys then values) as it arrived, including the dtype.
uint64_t TokenHash(const TensorView& k, const TensorView& v, int64_t t) {
  const size_t es = DTypeSize(k.dtype);
  uint64_t h = 0x6b7671ull ^ static_cast<uint64_t>(k.dtype);
  uint8_t buf[512 * 4];
  const TensorView* views[2] = {&k, &v};
  for (const TensorView* tv : views) {
    for (int64_t head = 0; head < tv->shape[0]; ++head) {
      const uint8_t* base =
          static_cast<const uint8_t*>(tv->data) + (head * tv->stride[0] + t * tv->stride[1]) * es;
      const size_t row = static_cast<size_t>(tv->shape[2]) * es;
      if (tv->stride[2] == 1) {
        h = XXH3_64bits_withSeed(base, row, h);
      } else {
        for (int64_t c = 0; c < tv->shape[2]; ++c) {
          std::memcpy(buf + c * es, base + c * tv->stride[2] * es, es);
        }
        h = XXH3_64bits_withSeed(buf, row, h);
      }
    }
  }
  return h;
}

TensorView SliceTokens(const TensorView& t, int64_t from, int64_t n) {
  TensorView s = t;
  s.data = static_cast<const uint8_t*>(t.data) + from * t.stride[1] * DTypeSize(t.dtype);
  s.shape[1] = n;
  return s;
}

// Bytes a layer grows by from `before` to `after` tokens: blocks for the groups that get
// encoded (the value block at its largest), the window at arrival precision, the hashes.
// Remeasure() replaces the estimate with the real size right after the append.
int64_t GrowthEstimate(const CodecOptions& o, int kv_heads, DType dtype, int64_t before,
                       int64_t after) {
  auto encoded = [&](int64_t n) {
    return std::max<int64_t>(0, (n - o.window) / o.key_group) * o.key_group;
  };
  const int64_t e0 = encoded(before), e1 = encoded(after);
  const int64_t blocks = (e1 - e0) / o.key_group * kv_heads;
  const int64_t block_bytes =
      blocks * static_cast<int64_t>(KeyBlockBytes(o) + MaxValueBlockBytes(o));
  const int64_t window_bytes = ((after - e1) - (before - e0)) * kv_heads * o.head_dim * 2 *
                               static_cast<int64_t>(DTypeSize(dtype));
  return std::max<int64_t>(0, block_bytes + window_bytes) +
         (after - before) * static_cast<int64_t>(sizeof(uint64_t));
}

// An error about item i of an append batch: the field `appends[i]` (field_error.h), which the
// server renames to its wire path; `parts` continue the field's path, then the message.
template <typename... Parts>
absl::Status AppendError(absl::StatusCode code, size_t i, const Parts&... parts) {
  return FieldError(code, absl::StrCat("appends[", i, "]"), absl::StrCat(parts...));
}

std::string Shape(const TensorView& t) {
  std::string s = "[";
  for (int i = 0; i < t.rank; ++i) absl::StrAppend(&s, i ? "," : "", t.shape[i]);
  return s + "]";
}

// An attach: token ids without keys and values.
bool IsAttach(const AppendSpec& a) {
  return a.keys.rank == 0 && a.values.rank == 0 && a.encoded == nullptr;
}

// Rows an append carries (after its encoded groups, if any).
int64_t RowCount(const AppendSpec& a) { return a.keys.rank == 3 ? a.keys.shape[1] : 0; }

// Hash of an encoded group as it arrived: its blocks (every head, keys then values).
uint64_t GroupHash(const EncodedGroupsView& run, const std::vector<size_t>& at, int kv_heads,
                   int64_t g) {
  const size_t first = static_cast<size_t>(g) * 2 * kv_heads;
  const size_t begin = at[first], end = at[first + 2 * kv_heads];
  return XXH3_64bits_withSeed(run.bytes.data() + begin, end - begin, 0x656e63ull);
}

// Hash of token t of an encoded group as it arrived: its group's hash and t's place in it (the
// group's bytes are hashed once, not once per token). Never equal to a row's TokenHash in
// practice, so a re-send in the other form is ALREADY_EXISTS.
uint64_t GroupTokenHash(uint64_t group_hash, int64_t t) {
  return XXH3_64bits_withSeed(&group_hash, sizeof(group_hash), static_cast<uint64_t>(t));
}

// The sub-run of groups [g0, g1) (0-based within `run`).
EncodedGroupsView SubRun(const EncodedGroupsView& run, const std::vector<size_t>& at, int kv_heads,
                         int64_t g0, int64_t g1) {
  EncodedGroupsView v = run;
  const size_t b0 = static_cast<size_t>(g0) * 2 * kv_heads,
               b1 = static_cast<size_t>(g1) * 2 * kv_heads;
  v.first_group = run.first_group + g0;
  v.groups = g1 - g0;
  v.bytes = run.bytes.subspan(at[b0], at[b1] - at[b0]);
  v.sizes = run.sizes.subspan(b0, b1 - b0);
  if (g0 > 0) v.sink_keys = v.sink_values = {};
  return v;
}

// The sequences one append holds: locked in address order (two appends never wait on each
// other in a cycle) and unlocked in reverse when it goes out of scope, on every path.
class SequenceLocks {
 public:
  explicit SequenceLocks(std::vector<StoreImpl::Sequence*> seqs) ABSL_NO_THREAD_SAFETY_ANALYSIS
      : seqs_(std::move(seqs)) {
    std::sort(seqs_.begin(), seqs_.end());
    for (StoreImpl::Sequence* s : seqs_) s->mu.Lock();
  }
  ~SequenceLocks() ABSL_NO_THREAD_SAFETY_ANALYSIS {
    for (auto it = seqs_.rbegin(); it != seqs_.rend(); ++it) (*it)->mu.Unlock();
  }
  SequenceLocks(const SequenceLocks&) = delete;
  SequenceLocks& operator=(const SequenceLocks&) = delete;
  const std::vector<StoreImpl::Sequence*>& held() const { return seqs_; }

 private:
  std::vector<StoreImpl::Sequence*> seqs_;
};

// The codec of a sequence of model `m` created with these fields (AppendSpec's has_codec and
// codec), checked against the model. Messages start with the field ("codec.rank ...").
absl::StatusOr<CodecOptions> CreationCodec(const ModelEntry& m, bool has_codec,
                                           const CodecOptions& overrides) {
  CodecOptions c = has_codec ? overrides : m.codec;
  c.head_dim = m.manifest.head_dim;
  if (c.rank > m.manifest.rank) {
    return absl::InvalidArgumentError(absl::StrCat("codec.rank ", c.rank,
                                                   " exceeds the basis rank ", m.manifest.rank,
                                                   " of model '", m.manifest.model, "'"));
  }
  if (absl::Status st = c.Validate(); !st.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("codec: ", st.message()));
  }
  if (c.metric_rounding && m.basis.query_moment.empty()) {
    return absl::FailedPreconditionError(
        absl::StrCat("codec.metric_rounding needs query moments, which model '", m.manifest.model,
                     "' version ", m.manifest.version, " was registered without"));
  }
  return c;
}

// A sequence that item i of a batch creates, checked against its model; not yet in the store.
absl::StatusOr<std::shared_ptr<StoreImpl::Sequence>> NewSequence(
    Registry& registry, const std::string& tenant, const AppendSpec& a,
    size_t i) ABSL_NO_THREAD_SAFETY_ANALYSIS {
  const std::string& id = a.sequence_id;
  if (a.model.empty()) {
    return AppendError(absl::StatusCode::kNotFound, i, ": sequence '", id,
                       "' does not exist; the append that creates it must name a model");
  }
  absl::StatusOr<std::shared_ptr<const ModelEntry>> m = registry.Get(a.model, a.basis_version);
  if (!m.ok()) return AppendError(m.status().code(), i, ".model: ", m.status().message());
  absl::StatusOr<CodecOptions> codec = CreationCodec(**m, a.has_codec, a.codec);
  if (!codec.ok()) return AppendError(codec.status().code(), i, ".", codec.status().message());
  auto s = std::make_shared<StoreImpl::Sequence>();
  s->tenant = tenant;
  s->id = id;
  s->model = *m;
  s->codec = *codec;
  const int layers = (*m)->manifest.layers;
  s->layers.resize(layers);
  s->hashes.resize(layers);
  s->hash_base.assign(layers, 0);
  s->prefix.resize(layers);
  for (int l = 0; l < layers; ++l) s->prefix[l].seed = PrefixSeed(**m, s->codec, l);
  return s;
}

}  // namespace

absl::StatusOr<int64_t> StoreImpl::IndexedPrefixTokens(const std::string& tenant,
                                                       const PrefixProbe& probe) {
  if (probe.token_ids.empty()) return 0;
  if (probe.token_ids.size() > static_cast<size_t>(kMaxAppendTokens)) {
    return absl::InvalidArgumentError(
        absl::StrCat("token_ids has ", probe.token_ids.size(), " ids; at most ", kMaxAppendTokens));
  }
  if (probe.model.empty()) {
    return absl::InvalidArgumentError("model must be set with token_ids");
  }
  absl::StatusOr<std::shared_ptr<const ModelEntry>> m =
      registry_->Get(probe.model, probe.basis_version);
  if (!m.ok())
    return FieldError(m.status().code(), "model", absl::StrCat(": ", m.status().message()));
  ASSIGN_OR_RETURN(const CodecOptions codec, CreationCodec(**m, probe.has_codec, probe.codec));
  const int64_t n = static_cast<int64_t>(probe.token_ids.size());
  const int G = codec.key_group;
  int64_t groups = std::max<int64_t>(0, (n - codec.window) / G);  // as PinIndexedGroups
  MutexLock g(&mu_);
  auto t = tenants_.find(tenant);
  if (t == tenants_.end()) return 0;
  for (int l = 0; l < (*m)->manifest.layers && groups > 0; ++l) {
    groups = t->second->prefixes.RunLength(PrefixSeed(**m, codec, l), probe.token_ids, G, groups);
  }
  return groups * G;
}

absl::Status StoreImpl::Append(const std::string& tenant, const std::vector<AppendSpec>& batch,
                               AppendOutcome* outcome) {
  *outcome = AppendOutcome{};
  if (batch.empty()) return absl::OkStatus();
  for (int attempt = 0;; ++attempt) {
    AppendBatch append(*this, tenant, batch);
    RETURN_IF_ERROR(append.FindOrCreateSequences());
    // Until this attempt ends, whatever leaves it.
    const SequenceLocks locks(append.sequences());
    RETURN_IF_ERROR(append.Plan());
    absl::Status published = append.Publish(locks.held());
    if (published.code() == absl::StatusCode::kAborted && attempt < 3) continue;
    RETURN_IF_ERROR(published);
    return append.Apply(locks.held(), outcome);
  }
}

StoreImpl::AppendBatch::~AppendBatch() {
  // Only an exception leaves pins here. Running out of memory again while releasing them
  // leaves those groups held (counted, never dropped): better than terminating.
  try {
    ReleasePins();
  } catch (const std::bad_alloc&) {
  }
}

absl::Status StoreImpl::AppendBatch::FindOrCreateSequences() {
  for (size_t i = 0; i < batch_.size(); ++i) {
    const std::string& id = batch_[i].sequence_id;
    if (id.empty() || id.size() > 256) {
      return AppendError(absl::StatusCode::kInvalidArgument, i,
                         ".sequence_id must be 1..256 bytes (got ", id.size(), ")");
    }
    if (seqs_.count(id)) continue;
    {
      MutexLock l(&store_.mu_);
      auto t = store_.tenants_.find(tenant_);
      if (t != store_.tenants_.end()) {
        auto s = t->second->seqs.find(id);
        if (s != t->second->seqs.end()) seqs_[id] = s->second;
      }
    }
    if (seqs_.count(id)) continue;
    ASSIGN_OR_RETURN(seqs_[id], NewSequence(*store_.registry_, tenant_, batch_[i], i));
    fresh_.insert(id);
  }
  return absl::OkStatus();
}

std::vector<StoreImpl::Sequence*> StoreImpl::AppendBatch::sequences() const {
  std::vector<Sequence*> all;
  for (const auto& [id, s] : seqs_) all.push_back(s.get());
  return all;
}

absl::Status StoreImpl::AppendBatch::Plan() {
  plans_.resize(batch_.size());
  runs_.resize(batch_.size());
  for (size_t i = 0; i < batch_.size(); ++i) {
    if (absl::Status st = PlanItem(i); !st.ok()) {
      ReleasePins();
      return st;
    }
  }
  // What the growth estimates leave out: the bookkeeping of the sequences and layer caches
  // this batch creates (Remeasure counts it), so that a write of a new sequence cannot take
  // the store past its capacity by that much.
  for (const std::string& id : fresh_) estimate_ += SequenceOverheadBytes(*seqs_.at(id));
  std::set<std::pair<const Sequence*, int>> new_layers;
  for (const AppendSpec& a : batch_) {
    const Sequence* s = seqs_.at(a.sequence_id).get();
    if (!s->layers[a.layer] && new_layers.insert({s, a.layer}).second)
      estimate_ += LayerCache::NewOverheadBytes(s->model->manifest.kv_heads);
  }
  return absl::OkStatus();
}

absl::Status StoreImpl::AppendBatch::PlanItem(size_t i) ABSL_NO_THREAD_SAFETY_ANALYSIS {
  const AppendSpec& a = batch_[i];
  Sequence* s = seqs_.at(a.sequence_id).get();
  RETURN_IF_ERROR(CheckTarget(i, *s));
  RETURN_IF_ERROR(CheckTensors(i, *s));
  if (a.encoded != nullptr) return PlanEncoded(i, s);
  const bool attach_only = IsAttach(a);
  const int G = s->codec.key_group;
  const int64_t n = attach_only ? static_cast<int64_t>(a.token_ids.size()) : a.keys.shape[1];
  std::vector<uint64_t>& pend = pending_[{s, a.layer}];
  const int64_t len = s->Length(a.layer) + static_cast<int64_t>(pend.size());
  if (a.start < 0 || a.start > len) {
    return AppendError(
        a.start < 0 ? absl::StatusCode::kInvalidArgument : absl::StatusCode::kFailedPrecondition, i,
        ".start ", a.start, " must be in 0..", len, " (layer ", a.layer, " of sequence '",
        a.sequence_id, "' holds ", len, " tokens; appends leave no gaps)");
  }
  const int64_t overlap = std::min(n, len - a.start);
  RETURN_IF_ERROR(attach_only ? CheckResentAttach(i, *s, overlap)
                              : CheckResentTokens(i, *s, a.start, overlap, pend));
  ItemPlan& p = plans_[i];
  p.from = overlap;
  p.n = n - overlap;
  PinIndexedGroups(i, *s, len, pend.empty());
  if (attach_only) p.n = static_cast<int64_t>(p.attach.size()) * G;
  if (len + p.n > store_.opts_.max_tokens_per_layer) {
    return AppendError(absl::StatusCode::kResourceExhausted, i, ": layer ", a.layer, " would hold ",
                       len + p.n, " tokens; the limit is ", store_.opts_.max_tokens_per_layer);
  }
  if (!attach_only) {
    for (int64_t t = p.from; t < n; ++t) p.new_hashes.push_back(TokenHash(a.keys, a.values, t));
  }
  pend.insert(pend.end(), p.new_hashes.begin(), p.new_hashes.end());
  duplicates_ += overlap;
  const int64_t shared = static_cast<int64_t>(p.attach.size()) * G;
  if (!attach_only) {
    estimate_ += GrowthEstimate(s->codec, s->model->manifest.kv_heads, a.keys.dtype, len + shared,
                                len + p.n);
  }
  // An attached group costs its key in the sequence's list (its blocks are the index's).
  estimate_ += static_cast<int64_t>(p.attach.size() * sizeof(PrefixKey));
  return CheckProbeWeights(i, s->model->manifest.kv_heads * n);
}

// The model, version and layer item i names.
absl::Status StoreImpl::AppendBatch::CheckTarget(size_t i, const Sequence& s) const {
  const AppendSpec& a = batch_[i];
  const BasisManifest& m = s.model->manifest;
  if (!a.model.empty() && a.model != m.model) {
    return AppendError(absl::StatusCode::kFailedPrecondition, i, ".model '", a.model,
                       "': sequence '", a.sequence_id, "' belongs to model '", m.model, "'");
  }
  if (a.basis_version != 0 && a.basis_version != m.version) {
    return AppendError(absl::StatusCode::kFailedPrecondition, i, ".basis_version ", a.basis_version,
                       ": sequence '", a.sequence_id, "' is pinned to version ", m.version, " of '",
                       m.model, "'");
  }
  if (a.layer < 0 || a.layer >= m.layers) {
    return AppendError(absl::StatusCode::kInvalidArgument, i, ".layer ", a.layer, " must be in 0..",
                       m.layers - 1, " (model '", m.model, "' has ", m.layers, " layers)");
  }
  return absl::OkStatus();
}

// Item i's shapes, dtypes, token ids and (in a batch of more than one) every element, against
// the model and the sequence.
absl::Status StoreImpl::AppendBatch::CheckTensors(size_t i, const Sequence& s) const
    ABSL_NO_THREAD_SAFETY_ANALYSIS {
  const AppendSpec& a = batch_[i];
  const BasisManifest& m = s.model->manifest;
  const TensorView &k = a.keys, &v = a.values;
  if (IsAttach(a)) {
    if (a.token_ids.empty() || a.token_ids.size() > static_cast<size_t>(kMaxAppendTokens)) {
      return AppendError(absl::StatusCode::kInvalidArgument, i,
                         ": keys and values are absent, so token_ids (1..", kMaxAppendTokens,
                         " ids) must name the tokens to attach from the prefix index (got ",
                         a.token_ids.size(), ")");
    }
    const int G = s.codec.key_group;
    if (a.start % G != 0) {
      return AppendError(absl::StatusCode::kInvalidArgument, i, ".start ", a.start,
                         ": an attach (token_ids without keys and values) starts at a multiple "
                         "of the group size G = ",
                         G);
    }
    if (a.probe_weights != nullptr) {
      return AppendError(absl::StatusCode::kInvalidArgument, i,
                         ".probe_weights: an attach carries no tokens to weigh");
    }
    return absl::OkStatus();
  }
  if (a.encoded != nullptr && k.rank == 0 && v.rank == 0) return absl::OkStatus();  // no rows
  if (k.rank != 3 || k.shape[0] != m.kv_heads || k.shape[2] != m.head_dim || k.shape[1] < 1 ||
      k.shape[1] > kMaxAppendTokens) {
    return AppendError(absl::StatusCode::kInvalidArgument, i, ".keys.shape ", Shape(k),
                       " must be [kv_heads=", m.kv_heads, ", n in 1..", kMaxAppendTokens,
                       ", head_dim=", m.head_dim, "]");
  }
  if (v.rank != 3 || v.shape[0] != k.shape[0] || v.shape[1] != k.shape[1] ||
      v.shape[2] != k.shape[2]) {
    return AppendError(absl::StatusCode::kInvalidArgument, i, ".values.shape ", Shape(v),
                       " must equal keys.shape ", Shape(k));
  }
  if (v.dtype != k.dtype) {
    return AppendError(absl::StatusCode::kInvalidArgument, i, ".values.dtype ", DTypeName(v.dtype),
                       " must equal keys.dtype ", DTypeName(k.dtype));
  }
  if (batch_.size() > 1) {
    // Each cache rejects bad rows without change, but only for its own append: with more
    // than one, every element is checked here so that a bad one leaves none applied.
    absl::Status rows = CheckStorable(k, "keys");
    if (rows.ok()) rows = CheckStorable(v, "values");
    if (!rows.ok()) {
      return AppendError(absl::StatusCode::kInvalidArgument, i, " (layer ", a.layer,
                         "): ", rows.message());
    }
  }
  if (a.encoded == nullptr && !a.token_ids.empty() &&
      a.token_ids.size() != static_cast<size_t>(k.shape[1])) {
    return AppendError(absl::StatusCode::kInvalidArgument, i, ".token_ids has ", a.token_ids.size(),
                       " ids; it must be empty or hold one id per appended token (", k.shape[1],
                       ")");
  }
  if (s.dtype_set && k.dtype != s.dtype) {
    return AppendError(absl::StatusCode::kInvalidArgument, i, ".keys.dtype ", DTypeName(k.dtype),
                       " differs from the dtype sequence '", a.sequence_id, "' arrived in (",
                       DTypeName(s.dtype), ")");
  }
  return absl::OkStatus();
}

absl::Status StoreImpl::AppendBatch::CheckResentAttach(
    size_t i, const Sequence& s, int64_t overlap) const ABSL_NO_THREAD_SAFETY_ANALYSIS {
  const AppendSpec& a = batch_[i];
  const Sequence::LayerPrefix& lp = s.prefix[a.layer];
  const int G = s.codec.key_group;
  // The overlapped groups must be sealed with the same keys.
  PrefixKey prev = lp.seed;
  const int64_t g0 = a.start / G;
  if (g0 > 0 && g0 <= static_cast<int64_t>(lp.block_keys.size())) prev = lp.block_keys[g0 - 1];
  int64_t g = 0;
  for (; (g + 1) * G <= overlap; ++g) {
    prev = ChainKey(prev, a.token_ids.data() + g * G, G);
    const size_t at_g = static_cast<size_t>(g0 + g);
    if (at_g >= lp.block_keys.size() || lp.block_keys[at_g] != prev) break;
  }
  if (g * G < overlap) {
    return AppendError(absl::StatusCode::kAlreadyExists, i, ".token_ids[", g * G,
                       "..]: tokens from ", a.start + g * G, " of layer ", a.layer,
                       " of sequence '", a.sequence_id,
                       "' are stored, but not as sealed groups of these ids");
  }
  return absl::OkStatus();
}

absl::Status StoreImpl::AppendBatch::CheckResentTokens(
    size_t i, const Sequence& s, int64_t pos0, int64_t overlap,
    const std::vector<uint64_t>& pending) const ABSL_NO_THREAD_SAFETY_ANALYSIS {
  const AppendSpec& a = batch_[i];
  const std::vector<uint64_t>& stored = s.hashes[a.layer];
  const int64_t base = s.hash_base[a.layer];
  const int G = s.codec.key_group;
  // Tokens of indexed groups compare with the index's hashes (under the store lock).
  std::optional<MutexLock> index_lock;
  const Tenant* T = nullptr;
  if (overlap > 0 && pos0 < base) {
    index_lock.emplace(&store_.mu_);
    auto t = store_.tenants_.find(tenant_);
    if (t != store_.tenants_.end()) T = t->second.get();
  }
  for (int64_t t = 0; t < overlap; ++t) {
    const int64_t pos = pos0 + t;
    const uint64_t want = TokenHash(a.keys, a.values, t);
    uint64_t have = 0;
    if (pos < base) {
      const PrefixIndex::Entry* e =
          T != nullptr ? T->prefixes.Find(s.prefix[a.layer].block_keys[pos / G]) : nullptr;
      have = e != nullptr ? e->hashes[pos % G] : ~want;
    } else {
      const int64_t j = pos - base;
      have = j < static_cast<int64_t>(stored.size()) ? stored[j] : pending[j - stored.size()];
    }
    if (have != want) {
      return AppendError(absl::StatusCode::kAlreadyExists, i, ": token ", pos, " of layer ",
                         a.layer, " of sequence '", a.sequence_id,
                         "' is already stored with different contents (re-sends must be "
                         "identical)");
    }
  }
  return absl::OkStatus();
}

void StoreImpl::AppendBatch::PinIndexedGroups(size_t i, const Sequence& s, int64_t len,
                                              bool pending_empty,
                                              int64_t max_groups) ABSL_NO_THREAD_SAFETY_ANALYSIS {
  const AppendSpec& a = batch_[i];
  ItemPlan& p = plans_[i];
  const Sequence::LayerPrefix& lp = s.prefix[a.layer];
  const LayerCache* cache = s.layers[a.layer].get();
  // Only at the end of a layer whose every token is sealed (and nothing earlier in this
  // message touched it).
  if (p.n == 0 || a.token_ids.empty() || !lp.open || !pending_empty || a.start + p.from != len ||
      (cache != nullptr && !cache->AllSealed())) {
    return;
  }
  // Attach or data alike: only groups that a sequence holding these n tokens would have
  // encoded itself; the last R (the window) and the incomplete group stay for the frontend
  // to send with data, at arrival precision.
  const int G = s.codec.key_group;
  int64_t most = std::max<int64_t>(0, (p.n - s.codec.window) / G);
  if (max_groups >= 0) most = std::min(most, max_groups);
  const PrefixKey prev = lp.block_keys.empty() ? lp.seed : lp.block_keys.back();
  MutexLock g(&store_.mu_);
  auto t = store_.tenants_.find(tenant_);
  if (t == store_.tenants_.end()) return;
  // Pinned: no reservation may drop them before they are attached.
  PrefixIndex::Run run = t->second->prefixes.HoldRun(prev, a.token_ids.subspan(p.from), G, most);
  p.attach = std::move(run.blocks);
  p.attach_keys = std::move(run.keys);
  if (IsAttach(a)) p.new_hashes = std::move(run.hashes);
}

absl::Status StoreImpl::AppendBatch::PlanEncoded(size_t i,
                                                 Sequence* s) ABSL_NO_THREAD_SAFETY_ANALYSIS {
  const AppendSpec& a = batch_[i];
  const int G = s->codec.key_group;
  const int kv_heads = s->model->manifest.kv_heads;
  runs_[i] = *a.encoded;
  runs_[i].first_group = a.start / G;
  if (runs_[i].groups < 0) {  // as many as the sizes hold
    const size_t per_group = 2 * static_cast<size_t>(kv_heads);
    if (runs_[i].sizes.size() % per_group != 0) {
      return AppendError(absl::StatusCode::kInvalidArgument, i, ".encoded.block_bytes has ",
                         runs_[i].sizes.size(), " sizes; a group of ", kv_heads, " KV heads has ",
                         per_group, " blocks (a key and a value block a head)");
    }
    runs_[i].groups = static_cast<int64_t>(runs_[i].sizes.size() / per_group);
  }
  const EncodedGroupsView& run = runs_[i];
  std::vector<uint64_t>& pend = pending_[{s, a.layer}];
  if (!pend.empty()) {
    return AppendError(absl::StatusCode::kInvalidArgument, i, ".encoded: an append with encoded ",
                       "groups must be the first append of its layer (", a.layer, ") in a message");
  }
  if (a.start < 0 || a.start % G != 0) {
    return AppendError(absl::StatusCode::kInvalidArgument, i, ".start ", a.start,
                       ": encoded groups start at a multiple of the group size G = ", G);
  }
  if (a.probe_weights != nullptr) {
    return AppendError(absl::StatusCode::kInvalidArgument, i,
                       ".probe_weights: not with encoded groups (the sender chose their widths)");
  }
  if (absl::Status st = CheckEncodedGroups(s->codec, kv_heads, run, ""); !st.ok()) {
    return AppendError(st.code(), i, ".encoded", st.message());
  }
  const std::string& fingerprint = s->model->manifest.fingerprint;
  if (s->codec.rank > 0 && run.groups > 0 && run.basis_fingerprint != fingerprint) {
    return AppendError(absl::StatusCode::kFailedPrecondition, i, ".encoded.basis_fingerprint '",
                       run.basis_fingerprint, "': the side codes of sequence '", a.sequence_id,
                       "' are made with basis ", fingerprint, " (model '", s->model->manifest.model,
                       "' version ", s->model->manifest.version, ")");
  }
  const int64_t len = s->Length(a.layer);
  const LayerCache* cache = s->layers[a.layer].get();
  const int64_t E = cache != nullptr ? cache->encoded_tokens() : 0;
  if (a.start > E) {
    return AppendError(absl::StatusCode::kFailedPrecondition, i, ".start ", a.start,
                       ": encoded groups of layer ", a.layer, " of sequence '", a.sequence_id,
                       "' must start at or before token ", E,
                       ", where its encoded groups end (the tokens after are rows)");
  }
  const int64_t rows = RowCount(a), n = run.groups * G + rows;
  const int64_t blocks_end = a.start + run.groups * G;
  if (n == 0) {
    return AppendError(absl::StatusCode::kInvalidArgument, i,
                       ".encoded: no groups and no rows (an append holds at least one token)");
  }
  if (!a.token_ids.empty() && a.token_ids.size() != static_cast<size_t>(n)) {
    return AppendError(absl::StatusCode::kInvalidArgument, i, ".token_ids has ", a.token_ids.size(),
                       " ids; it must be empty or hold one id per appended token (", n, ")");
  }
  RETURN_IF_ERROR(CheckResentGroups(i, *s, a.start / G, std::min(E, blocks_end) / G));
  // Rows over the layer's tokens must be what they re-send (window rows the groups cover are
  // replaced instead: the sender's encoding of them).
  const int64_t overlap = std::min(n, len - a.start);
  if (rows > 0 && len > blocks_end) {
    RETURN_IF_ERROR(CheckResentTokens(i, *s, blocks_end, std::min(rows, len - blocks_end), pend));
  }
  ItemPlan& p = plans_[i];
  p.from = overlap;
  p.n = n - overlap;
  PinIndexedGroups(i, *s, len, true, std::max<int64_t>(0, blocks_end - len) / G);
  if (len + p.n > store_.opts_.max_tokens_per_layer) {
    return AppendError(absl::StatusCode::kResourceExhausted, i, ": layer ", a.layer, " would hold ",
                       len + p.n, " tokens; the limit is ", store_.opts_.max_tokens_per_layer);
  }
  const std::vector<size_t> at = RunOffsets(run);
  int64_t hashed_group = -1;
  uint64_t group_hash = 0;
  for (int64_t pos = a.start + overlap; pos < a.start + n; ++pos) {
    if (pos >= blocks_end) {
      p.new_hashes.push_back(TokenHash(a.keys, a.values, pos - blocks_end));
      continue;
    }
    const int64_t g = (pos - a.start) / G;
    if (g != hashed_group) group_hash = GroupHash(run, at, kv_heads, hashed_group = g);
    p.new_hashes.push_back(GroupTokenHash(group_hash, pos % G));
  }
  pend.insert(pend.end(), p.new_hashes.begin(), p.new_hashes.end());
  duplicates_ += overlap;
  // The new groups' bytes (sinks included), the new rows at arrival precision, the hashes.
  const int64_t first_new = std::max<int64_t>(E, a.start) - a.start;
  const size_t b0 = static_cast<size_t>(first_new / G) * 2 * kv_heads;
  estimate_ +=
      static_cast<int64_t>(at.back() - std::min(at.back(), at[std::min(b0, at.size() - 1)])) +
      static_cast<int64_t>(run.sink_keys.size() + run.sink_values.size()) +
      p.n * static_cast<int64_t>(sizeof(uint64_t));
  if (rows > 0) {
    estimate_ += std::min(rows, p.n) * kv_heads * s->codec.head_dim * 2 *
                 static_cast<int64_t>(DTypeSize(a.keys.dtype));
  }
  return absl::OkStatus();
}

absl::Status StoreImpl::AppendBatch::CheckResentGroups(
    size_t i, const Sequence& s, int64_t g0, int64_t g1) const ABSL_NO_THREAD_SAFETY_ANALYSIS {
  const AppendSpec& a = batch_[i];
  const EncodedGroupsView& run = runs_[i];
  const LayerCache* cache = s.layers[a.layer].get();
  if (g0 >= g1 || cache == nullptr) return absl::OkStatus();
  const int kv_heads = s.model->manifest.kv_heads;
  const std::vector<size_t> at = RunOffsets(run);
  for (int64_t g = g0; g < g1; ++g) {
    EncodedGroups stored;
    RETURN_IF_ERROR(cache->ExportGroups(g, g + 1, &stored));
    const EncodedGroupsView sent =
        SubRun(run, at, kv_heads, g - run.first_group, g - run.first_group + 1);
    const std::span<const uint8_t> kept = ViewOf(stored).bytes;
    const bool same = kept.size() == sent.bytes.size() &&
                      std::equal(kept.begin(), kept.end(), sent.bytes.begin()) &&
                      (g > 0 || ViewOf(stored).sink_keys.size() == sent.sink_keys.size()) &&
                      (g > 0 || std::equal(sent.sink_keys.begin(), sent.sink_keys.end(),
                                           ViewOf(stored).sink_keys.begin())) &&
                      (g > 0 || std::equal(sent.sink_values.begin(), sent.sink_values.end(),
                                           ViewOf(stored).sink_values.begin()));
    if (!same) {
      return AppendError(absl::StatusCode::kAlreadyExists, i, ".encoded: group ", g, " of layer ",
                         a.layer, " of sequence '", a.sequence_id,
                         "' is already stored with different blocks (re-sends must be identical)");
    }
  }
  return absl::OkStatus();
}

absl::Status StoreImpl::AppendBatch::CheckProbeWeights(size_t i, int64_t n) const {
  const float* w = batch_[i].probe_weights;
  if (w == nullptr) return absl::OkStatus();
  for (int64_t j = 0; j < n; ++j) {
    if (!(w[j] >= 0.0f)) {
      return AppendError(absl::StatusCode::kInvalidArgument, i, ".probe_weights[", j,
                         "] must be finite and >= 0");
    }
  }
  return absl::OkStatus();
}

absl::Status StoreImpl::AppendBatch::Publish(const std::vector<Sequence*>& locked) {
  // Sequences evicted for the room are destroyed (their memory freed) after the store's
  // lock is released: declared before it.
  std::vector<std::shared_ptr<Sequence>> evicted;
  MutexLock l(&store_.mu_);
  auto& tp = store_.tenants_[tenant_];
  if (!tp) tp = std::make_unique<Tenant>();
  for (auto& [id, s] : seqs_) {
    auto it = tp->seqs.find(id);
    if (fresh_.count(id) ? it != tp->seqs.end() : (it == tp->seqs.end() || it->second != s)) {
      // Created, deleted or evicted concurrently.
      ReleasePinsLocked();
      return absl::AbortedError("sequences changed concurrently; retry the append");
    }
  }
  if (absl::Status st = store_.ReserveLocked(tenant_, estimate_, locked, &evicted); !st.ok()) {
    ReleasePinsLocked();
    return st;
  }
  for (auto& [id, s] : seqs_) {
    if (!fresh_.count(id)) continue;
    tp->seqs[id] = s;
    store_.lru_.push_front(s.get());
    s->lru = store_.lru_.begin();
    s->linked = true;
  }
  for (auto& [id, s] : seqs_) store_.TouchLocked(s.get());
  return absl::OkStatus();
}

absl::Status StoreImpl::AppendBatch::Apply(const std::vector<Sequence*>& locked,
                                           AppendOutcome* outcome) {
  outcome->tokens_duplicate = duplicates_;
  absl::Status applied;
  size_t item = 0;
  try {
    for (; item < batch_.size(); ++item) {
      applied = ApplyItem(item, outcome);
      if (!applied.ok()) break;
    }
  } catch (const std::bad_alloc&) {
    // Host memory itself ran out mid-append (no pool reservation covers the window and the
    // bookkeeping): the sequence of that item may hold half of it, so it is marked corrupt
    // (its reads fail with DATA_LOSS until it is deleted) rather than served.
    const std::string& id = batch_[item].sequence_id;
    seqs_.at(id)->corrupt.store(true);
    applied = AppendError(absl::StatusCode::kResourceExhausted, item,
                          ": out of memory while storing it; sequence '", id,
                          "' is marked corrupt (delete and re-send it)");
  }
  if (!applied.ok()) ReleasePins();
  Finish(locked, !applied.ok(), outcome);
  return applied;
}

absl::Status StoreImpl::AppendBatch::ApplyItem(size_t i, AppendOutcome* outcome)
    ABSL_NO_THREAD_SAFETY_ANALYSIS {
  const AppendSpec& a = batch_[i];
  const ItemPlan& p = plans_[i];
  if (p.n == 0) return absl::OkStatus();
  if (a.encoded != nullptr) return ApplyEncoded(i, outcome);
  Sequence* s = seqs_.at(a.sequence_id).get();
  LayerCache* cache = &CacheFor(s, a.layer);
  Sequence::LayerPrefix& lp = s->prefix[a.layer];
  if (a.token_ids.empty()) {
    lp.open = false;
    lp.pending_ids.clear();
  }
  cache->set_sealing(lp.open);
  const int64_t shared = static_cast<int64_t>(p.attach.size()) * s->codec.key_group;
  if (shared > 0) {
    ASSIGN_OR_RETURN(const bool linked, AttachPinned(i, s, *cache));
    if (!linked) return absl::OkStatus();
  }
  const int64_t data_n = p.n - shared;
  if (data_n > 0) RETURN_IF_ERROR(AppendData(i, s, *cache, p.from + shared, data_n));
  // Attached tokens' hashes are the index's; the rest are the sequence's own.
  std::vector<uint64_t>& h = s->hashes[a.layer];
  h.insert(h.end(), p.new_hashes.begin() + shared, p.new_hashes.end());
  if (lp.open) RETURN_IF_ERROR(IndexSealedGroups(s, a.layer));
  outcome->tokens_written += data_n;
  outcome->tokens_shared += shared;
  return absl::OkStatus();
}

LayerCache& StoreImpl::AppendBatch::CacheFor(Sequence* s,
                                             int layer) ABSL_NO_THREAD_SAFETY_ANALYSIS {
  std::unique_ptr<LayerCache>& cache = s->layers[layer];
  if (!cache) {
    const ModelEntry& model = *s->model;
    cache = std::make_unique<LayerCache>(s->codec, model.manifest.kv_heads,
                                         store_.LayerTables(model, layer, s->codec),
                                         store_.opts_.byte_pool);
    // Blocks in device memory are encoded and read where they lie.
    cache->set_block_ops(store_.opts_.attend_backend);
  }
  return *cache;
}

absl::Status StoreImpl::AppendBatch::ApplyEncoded(size_t i, AppendOutcome* outcome)
    ABSL_NO_THREAD_SAFETY_ANALYSIS {
  const AppendSpec& a = batch_[i];
  const ItemPlan& p = plans_[i];
  const EncodedGroupsView& run = runs_[i];
  Sequence* s = seqs_.at(a.sequence_id).get();
  const int G = s->codec.key_group;
  const int kv_heads = s->model->manifest.kv_heads;
  LayerCache& cache = CacheFor(s, a.layer);
  Sequence::LayerPrefix& lp = s->prefix[a.layer];
  if (a.token_ids.empty()) {
    lp.open = false;
    lp.pending_ids.clear();
  }
  cache.set_sealing(lp.open);
  const int64_t shared = static_cast<int64_t>(p.attach.size()) * G;
  if (shared > 0) {
    ASSIGN_OR_RETURN(const bool linked, AttachPinned(i, s, cache));
    if (!linked) return absl::OkStatus();
  }
  if (lp.open) {
    lp.pending_ids.insert(lp.pending_ids.end(), a.token_ids.begin() + p.from + shared,
                          a.token_ids.end());
  }
  // The groups the layer does not hold yet (the window rows they cover included).
  const int64_t blocks_end = a.start + run.groups * G;
  const int64_t E = cache.encoded_tokens();
  if (E < blocks_end) {
    const std::vector<size_t> at = RunOffsets(run);
    absl::Status st = cache.AppendGroups(SubRun(run, at, kv_heads, (E - a.start) / G, run.groups));
    if (!st.ok()) return AppendError(st.code(), i, " (layer ", a.layer, "): ", st.message());
  }
  // Then the rows after what the layer holds.
  const int64_t rows = RowCount(a), r0 = cache.tokens() - blocks_end;
  if (rows > r0) {
    absl::Status st = cache.Append(SliceTokens(a.keys, r0, rows - r0),
                                   SliceTokens(a.values, r0, rows - r0), cache.tokens());
    if (!st.ok()) return AppendError(st.code(), i, " (layer ", a.layer, "): ", st.message());
    s->dtype = a.keys.dtype;
    s->dtype_set = true;
  }
  std::vector<uint64_t>& h = s->hashes[a.layer];
  h.insert(h.end(), p.new_hashes.begin() + shared, p.new_hashes.end());
  if (lp.open) RETURN_IF_ERROR(IndexSealedGroups(s, a.layer));
  outcome->tokens_written += p.n - shared;
  outcome->tokens_shared += shared;
  return absl::OkStatus();
}

absl::StatusOr<bool> StoreImpl::AppendBatch::AttachPinned(size_t i, Sequence* s, LayerCache& cache)
    ABSL_NO_THREAD_SAFETY_ANALYSIS {
  const AppendSpec& a = batch_[i];
  ItemPlan& p = plans_[i];
  if (absl::Status st = cache.AttachSealed(p.attach); !st.ok()) {
    return AppendError(absl::StatusCode::kInternal, i, ": prefix block rejected: ", st.message());
  }
  Sequence::LayerPrefix& lp = s->prefix[a.layer];
  lp.block_keys.insert(lp.block_keys.end(), p.attach_keys.begin(), p.attach_keys.end());
  const int64_t shared = static_cast<int64_t>(p.attach.size()) * s->codec.key_group;
  s->hash_base[a.layer] += shared;  // their arrival hashes are the index's
  MutexLock g(&store_.mu_);
  if (!s->linked) {
    ReleasePinsLocked(i, i + 1);  // evicted meanwhile by another writer: hold nothing
    return false;
  }
  s->node_keys.insert(s->node_keys.end(), p.attach_keys.begin(), p.attach_keys.end());
  Tenant& T = *store_.tenants_[tenant_];
  const absl::Time now = store_.opts_.now();
  for (const PrefixKey& k : p.attach_keys) T.prefixes.Touch(k, now);
  p.attach_keys.clear();  // the sequence holds them now
  T.shared_tokens += shared;
  return true;
}

absl::Status StoreImpl::AppendBatch::AppendData(size_t i, Sequence* s, LayerCache& cache,
                                                int64_t from,
                                                int64_t n) ABSL_NO_THREAD_SAFETY_ANALYSIS {
  const AppendSpec& a = batch_[i];
  std::vector<float> probe;
  if (a.probe_weights) {
    const int64_t all = a.keys.shape[1];
    for (int64_t h = 0; h < a.keys.shape[0]; ++h) {
      probe.insert(probe.end(), a.probe_weights + h * all + from, a.probe_weights + h * all + all);
    }
  }
  Sequence::LayerPrefix& lp = s->prefix[a.layer];
  if (lp.open) {
    lp.pending_ids.insert(lp.pending_ids.end(), a.token_ids.begin() + from, a.token_ids.end());
  }
  absl::Status st = cache.Append(SliceTokens(a.keys, from, n), SliceTokens(a.values, from, n),
                                 a.start + from, probe.empty() ? nullptr : probe.data());
  if (!st.ok()) {
    return AppendError(st.code(), i, " (layer ", a.layer, "): ", st.message());
  }
  s->dtype = a.keys.dtype;
  s->dtype_set = true;
  return absl::OkStatus();
}

absl::Status StoreImpl::AppendBatch::IndexSealedGroups(Sequence* s,
                                                       int layer) ABSL_NO_THREAD_SAFETY_ANALYSIS {
  Sequence::LayerPrefix& lp = s->prefix[layer];
  LayerCache& cache = *s->layers[layer];
  const int G = s->codec.key_group;
  MutexLock g(&store_.mu_);
  // Evicted by another writer while this append ran: it is going away, index nothing.
  if (!s->linked) return absl::OkStatus();
  Tenant& T = *store_.tenants_[tenant_];
  const absl::Time now = store_.opts_.now();
  while (lp.block_keys.size() < cache.sealed().size()) {
    const size_t b = lp.block_keys.size();
    if (lp.pending_ids.size() < static_cast<size_t>(G)) {
      return absl::InternalError(
          absl::StrCat("layer ", layer, ": group ", b, " sealed without its token ids"));
    }
    const PrefixKey prev = b > 0 ? lp.block_keys[b - 1] : lp.seed;
    const PrefixKey key = ChainKey(prev, lp.pending_ids.data(), G);
    lp.pending_ids.erase(lp.pending_ids.begin(), lp.pending_ids.begin() + G);
    std::vector<uint64_t>& h = s->hashes[layer];  // starts at group b (hash_base = b * G)
    if (const PrefixIndex::Entry* e = T.prefixes.Find(key)) {
      // The same tokens, model, basis and codec settings: hold the indexed copy instead.
      RETURN_IF_ERROR(cache.ReplaceSealed(static_cast<int64_t>(b), e->block));
      T.prefixes.Hold(key);
      T.prefixes.Touch(key, now);
      T.shared_tokens += G;
    } else {
      const int64_t bytes =
          T.prefixes.Insert(key, b > 0 ? std::optional<PrefixKey>(prev) : std::nullopt,
                            cache.sealed()[b], std::span<const uint64_t>(h.data(), G), now);
      T.bytes += bytes;
      store_.used_bytes_ += bytes;
    }
    s->node_keys.push_back(key);
    lp.block_keys.push_back(key);
    // The group's arrival hashes now live in the index (and their room is given back once
    // most of it is unused: it is counted against the tenant).
    h.erase(h.begin(), h.begin() + G);
    if (h.capacity() > 2 * h.size() + 64) h.shrink_to_fit();
    s->hash_base[layer] += G;
  }
  return absl::OkStatus();
}

void StoreImpl::AppendBatch::Finish(const std::vector<Sequence*>& locked, bool failed,
                                    AppendOutcome* outcome) ABSL_NO_THREAD_SAFETY_ANALYSIS {
  // The whole reservation is given back once, with the first sequence's real size.
  int64_t reserved = estimate_;
  bool over = false;
  for (Sequence* s : locked) {
    over |= store_.Remeasure(s, reserved);
    reserved = 0;
  }
  // The estimate is close, not exact (vectors' spare capacity): where the real size took the
  // store or the tenant past its limit, make the room now as the reservation would have
  // (retained prefix groups first), so that the limits hold between appends. Sequences
  // evicted for it are destroyed after the lock is released. Within the limits (the common
  // case) this takes no lock.
  std::vector<std::shared_ptr<Sequence>> evicted;
  if (over) {
    MutexLock l(&store_.mu_);
    store_.ReserveLocked(tenant_, 0, locked, &evicted).IgnoreError();
  }
  if (failed) {
    // No partial sequence: one this batch created and left empty goes again.
    MutexLock l(&store_.mu_);
    for (auto& [id, s] : seqs_) {
      if (!fresh_.count(id)) continue;
      bool empty = true;
      for (size_t layer = 0; layer < s->layers.size(); ++layer)
        empty &= s->Length(static_cast<int>(layer)) == 0;
      if (empty) store_.UnlinkLocked(s.get(), /*drop=*/true);
    }
  }
  std::set<std::pair<std::string, int>> seen;
  for (const AppendSpec& a : batch_) {
    if (!seen.insert({a.sequence_id, a.layer}).second) continue;
    outcome->lengths.emplace_back(a.sequence_id, a.layer, seqs_.at(a.sequence_id)->Length(a.layer));
  }
}

void StoreImpl::AppendBatch::ReleasePins() {
  MutexLock g(&store_.mu_);
  ReleasePinsLocked();
}

void StoreImpl::AppendBatch::ReleasePinsLocked(size_t from, size_t to) {
  auto t = store_.tenants_.find(tenant_);
  if (t == store_.tenants_.end()) return;
  for (size_t i = from; i < std::min(to, plans_.size()); ++i) {
    ItemPlan& p = plans_[i];
    for (const PrefixKey& k : p.attach_keys) {
      store_.ReleasePrefixLocked(*t->second, k, /*drop=*/false);
    }
    p.attach_keys.clear();
  }
}

}  // namespace kvq::core
