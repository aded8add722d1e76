// The block store: sequences per tenant, their reads, capacity and LRU eviction (the write
// path, StoreImpl::Append, is store_append.cc).
#include <algorithm>
#include <deque>
#include <optional>

#include "absl/strings/str_cat.h"
#include "core/src/store/eviction_planner.h"
#include "core/src/store/store_impl.h"
#include "kvq/core/metrics.h"
#include "kvq/core/status.h"

namespace kvq::core {

namespace {}  // namespace

StoreImpl::StoreImpl(StoreOptions opts, Registry* registry)
    : opts_(std::move(opts)), registry_(registry) {}

StoreImpl::~StoreImpl() {
  MutexLock l(&mu_);
  lru_.clear();
  tenants_.clear();
}

void StoreImpl::TouchLocked(Sequence* s) {
  s->last_used = opts_.now();
  if (s->linked) lru_.splice(lru_.begin(), lru_, s->lru);
}

void StoreImpl::UnlinkLocked(Sequence* s, bool drop) {
  if (!s->linked) return;
  Tenant& t = *tenants_[s->tenant];
  t.bytes -= s->bytes;
  used_bytes_ -= s->bytes;
  lru_.erase(s->lru);
  s->linked = false;
  // Release its prefix blocks, last group first so that a dropped group's extensions (held
  // by nobody either) are already gone.
  for (auto it = s->node_keys.rbegin(); it != s->node_keys.rend(); ++it) {
    ReleasePrefixLocked(t, *it, drop);
  }
  s->node_keys.clear();
  t.seqs.erase(s->id);  // may destroy *s when nobody else holds it: do this last
}

void StoreImpl::ReleasePrefixLocked(Tenant& t, const PrefixKey& key, bool drop) {
  if (t.prefixes.Release(key) && (drop || !opts_.retain_prefixes)) DropPrefixLocked(t, key);
}

int64_t StoreImpl::DropPrefixLocked(Tenant& t, const PrefixKey& key) {
  const int64_t freed = t.prefixes.Drop(key);
  t.bytes -= freed;
  used_bytes_ -= freed;
  return freed;
}

int64_t StoreImpl::DropRetainedLocked(Tenant& t, int64_t need, absl::Time older_than) {
  const int64_t freed = t.prefixes.DropRetained(need, older_than);
  t.bytes -= freed;
  used_bytes_ -= freed;
  return freed;
}

absl::Status StoreImpl::ReserveLocked(const std::string& tenant, int64_t bytes,
                                      const std::vector<Sequence*>& keep,
                                      std::vector<std::shared_ptr<Sequence>>* evicted) {
  auto& tp = tenants_[tenant];
  if (!tp) tp = std::make_unique<Tenant>();
  Tenant& T = *tp;
  auto kept = [&](Sequence* s) { return std::find(keep.begin(), keep.end(), s) != keep.end(); };
  auto evict = [&](Sequence* s) {
    Tenant& owner = *tenants_[s->tenant];
    ++owner.evictions;
    ++evictions_;
    // Destroyed by the caller once the store's lock is released, not under it.
    if (evicted) evicted->push_back(owner.seqs[s->id]);
    UnlinkLocked(s, /*drop=*/true);
  };
  const int64_t quota = opts_.tenant_quota_bytes, cap = opts_.capacity_bytes;
  if (quota > 0 && bytes > quota) {
    return absl::ResourceExhaustedError(
        absl::StrCat("the write needs ", bytes, " bytes; the tenant quota is ", quota, " bytes"));
  }
  if (cap > 0 && bytes > cap) {
    return absl::ResourceExhaustedError(
        absl::StrCat("the write needs ", bytes, " bytes; the capacity is ", cap, " bytes"));
  }
  // Retained prefix blocks are a cache: they go first, as far as needed (over the quota the
  // writer's own; over the capacity those of tenants above an equal share, then the
  // writer's).
  if (quota > 0 && T.bytes + bytes > quota) DropRetainedLocked(T, T.bytes + bytes - quota);
  if (cap > 0 && used_bytes_ + bytes > cap) {
    int64_t active = 0;
    for (const auto& [name, t] : tenants_) active += (t->bytes > 0 || name == tenant) ? 1 : 0;
    const int64_t share = cap / std::max<int64_t>(1, active);
    for (auto& [name, t] : tenants_) {
      if (used_bytes_ + bytes <= cap) break;
      if (name != tenant && t->bytes > share) {
        DropRetainedLocked(*t, std::min(used_bytes_ + bytes - cap, t->bytes - share));
      }
    }
    if (used_bytes_ + bytes > cap) DropRetainedLocked(T, used_bytes_ + bytes - cap);
  }
  // Plans first (eviction_planner.h), then evicts: a write that cannot fit evicts nothing.
  if ((quota > 0 && T.bytes + bytes > quota) || (cap > 0 && used_bytes_ + bytes > cap)) {
    EvictionRequest req;
    req.writer = tenant;
    req.write_bytes = bytes;
    req.quota = quota;
    req.capacity = cap;
    req.used_bytes = used_bytes_;
    for (const auto& [name, t] : tenants_) req.tenant_bytes[name] = t->bytes;
    // The LRU list as candidates, least recently used first, built as far as the planner reads.
    std::deque<EvictionCandidate> seen;
    auto lru_at = lru_.rbegin();
    auto order = [&](size_t i) -> const EvictionCandidate* {
      while (seen.size() <= i && lru_at != lru_.rend()) {
        Sequence* s = *lru_at++;
        if (kept(s)) continue;
        EvictionCandidate& c = seen.emplace_back();
        c.handle = s;
        c.tenant = s->tenant;
        c.bytes = s->bytes;
        const Tenant& owner = *tenants_[s->tenant];
        for (const PrefixKey& k : s->node_keys) {
          if (const PrefixIndex::Entry* e = owner.prefixes.Find(k)) {
            c.blocks.push_back({e, e->bytes, e->refs});
          }
        }
      }
      return i < seen.size() ? &seen[i] : nullptr;
    };
    const EvictionPlan plan = PlanEviction(req, order);
    last_plan_steps_ = plan.steps;
    if (!plan.fits) {
      const bool over_quota = quota > 0 && T.bytes + bytes > quota;
      return absl::ResourceExhaustedError(
          absl::StrCat("the write needs ", bytes, " bytes and cannot fit even after eviction (",
                       over_quota ? absl::StrCat("tenant quota ", quota, ", tenant holds ", T.bytes)
                                  : absl::StrCat("capacity ", cap, ", in use ", used_bytes_),
                       " bytes)"));
    }
    for (const void* v : plan.victims) evict(static_cast<Sequence*>(const_cast<void*>(v)));
  }
  T.bytes += bytes;
  used_bytes_ += bytes;
  return absl::OkStatus();
}

std::shared_ptr<const LayerCodecTables> StoreImpl::LayerTables(const ModelEntry& model, int layer,
                                                               const CodecOptions& codec) {
  // What the tables depend on: the entry's tensors (name, version, fingerprint) and the
  // codec fields that shape them.
  const std::string key =
      absl::StrCat(model.manifest.model, "/", model.manifest.version, "/",
                   model.manifest.fingerprint, "/", layer, "/", codec.head_dim, ",", codec.rank,
                   ",", codec.rotate_keys, ",", codec.metric_rounding);
  MutexLock l(&tables_mu_);
  if (auto held = tables_[key].lock()) return held;
  std::shared_ptr<const LayerCodecTables> t = MakeLayerCodecTables(model, layer, codec);
  tables_[key] = t;
  // Forget the tables no cache holds any more (retired versions, finished codecs).
  absl::erase_if(tables_, [](const auto& kv) { return kv.second.expired(); });
  return t;
}

// What a sequence takes besides its codes, windows and arrival hashes, counted against
// capacity and quota so that many tiny sequences cannot take memory the count does not see:
// the object and its strings, the per-layer vectors and caches (with malloc's 16-byte header
// per heap block), and an estimate of the tenant map's slot and the LRU node (kIndexBytes).
int64_t SequenceOverheadBytes(const StoreImpl::Sequence& s) ABSL_NO_THREAD_SAFETY_ANALYSIS {
  constexpr int64_t kIndexBytes = 96;
  auto held = [](const auto& v) -> int64_t {
    return v.capacity() ? static_cast<int64_t>(v.capacity() * sizeof(v[0])) + 16 : 0;
  };
  int64_t b = kIndexBytes + static_cast<int64_t>(sizeof(StoreImpl::Sequence)) + 16 +
              held(s.tenant) + held(s.id) + held(s.layers) + held(s.hashes) + held(s.hash_base) +
              held(s.prefix) + held(s.node_keys);
  // The hashes' capacity is counted with the sequence's data (Remeasure); here their headers.
  for (const auto& h : s.hashes) b += h.capacity() ? 16 : 0;
  for (const auto& p : s.prefix) b += held(p.block_keys) + held(p.pending_ids);
  for (const auto& l : s.layers)
    if (l) b += l->OverheadBytes();
  return b;
}

bool StoreImpl::Remeasure(Sequence* s, int64_t reserved) {
  SizeReport size;
  int64_t tokens = 0, blocks = 0, elements = 0;
  for (const auto& l : s->layers) {
    if (!l) continue;
    const SizeReport r = l->Size();
    size += r;
    elements += r.tokens * r.elements_per_token;
    tokens += l->tokens();
    blocks += 2 * (r.encoded_tokens / s->codec.key_group) * s->model->manifest.kv_heads;
  }
  // Sealed blocks are counted once, in the prefix index.
  int64_t bytes = size.total_bytes() - size.sealed_block_bytes;
  for (const auto& h : s->hashes) bytes += static_cast<int64_t>(h.capacity() * sizeof(uint64_t));
  bytes += SequenceOverheadBytes(*s);
  MutexLock l(&mu_);
  auto t = tenants_.find(s->tenant);
  if (t == tenants_.end()) return false;
  t->second->bytes -= reserved;
  used_bytes_ -= reserved;
  if (s->linked) {
    t->second->bytes += bytes - s->bytes;
    used_bytes_ += bytes - s->bytes;
  }
  s->bytes = bytes;
  s->tokens = tokens;
  s->blocks = blocks;
  s->elements = elements;
  s->size = size;
  const int64_t quota = opts_.tenant_quota_bytes, cap = opts_.capacity_bytes;
  return (quota > 0 && t->second->bytes > quota) || (cap > 0 && used_bytes_ > cap);
}

absl::StatusOr<std::shared_ptr<StoreImpl::Sequence>> StoreImpl::Find(const std::string& tenant,
                                                                     const std::string& id,
                                                                     int basis_version) {
  MutexLock l(&mu_);
  auto t = tenants_.find(tenant);
  std::shared_ptr<Sequence> s;
  if (t != tenants_.end()) {
    auto it = t->second->seqs.find(id);
    if (it != t->second->seqs.end()) s = it->second;
  }
  if (!s) return absl::NotFoundError(absl::StrCat("sequence '", id, "' not found"));
  const BasisManifest& m = s->model->manifest;
  if (basis_version != 0 && basis_version != m.version) {
    return absl::FailedPreconditionError(absl::StrCat("basis_version ", basis_version,
                                                      ": sequence '", id, "' is pinned to version ",
                                                      m.version, " of model '", m.model, "'"));
  }
  if (s->corrupt.load()) {
    return absl::DataLossError(
        absl::StrCat("sequence '", id, "' failed its checksum scrub; delete and re-send it"));
  }
  TouchLocked(s.get());
  return s;
}

namespace {
// Layer `layer` of `s`, whose lock the caller holds (null while nothing was appended to it);
// INVALID_ARGUMENT outside the model's layers.
absl::StatusOr<LayerCache*> LayerAt(const StoreImpl::Sequence& s,
                                    int layer) ABSL_NO_THREAD_SAFETY_ANALYSIS {
  const int layers = s.model->manifest.layers;
  if (layer < 0 || layer >= layers) {
    return absl::InvalidArgumentError(absl::StrCat("layer ", layer, " must be in 0..", layers - 1));
  }
  return s.layers[layer].get();
}

// The layer a read (Score, Readout, Attend) reads: one that holds tokens (FAILED_PRECONDITION
// otherwise), its token count in *tokens.
absl::StatusOr<LayerCache*> ReadLayer(const StoreImpl::Sequence& s, const std::string& sequence_id,
                                      int layer, int64_t* tokens) ABSL_NO_THREAD_SAFETY_ANALYSIS {
  ASSIGN_OR_RETURN(LayerCache * cache, LayerAt(s, layer));
  if (cache == nullptr || cache->tokens() == 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("layer ", layer, " of sequence '", sequence_id, "' holds no tokens"));
  }
  *tokens = cache->tokens();
  return cache;
}

// The one check of a read's query-side shape: `field` (queries, weights) of q_heads rows per
// KV head group and, when q_dim >= 0, head_dim columns.
absl::Status CheckQueryShape(const BasisManifest& m, const char* field, int q_heads,
                             int64_t q_dim) {
  if (q_heads < 1 || q_heads % m.kv_heads != 0) {
    return absl::InvalidArgumentError(absl::StrCat(field, ".shape[0] (q_heads) ", q_heads,
                                                   " must be a multiple of kv_heads ", m.kv_heads));
  }
  if (q_dim >= 0 && q_dim != m.head_dim) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, " head_dim ", q_dim, " must equal the model's head_dim ", m.head_dim));
  }
  return absl::OkStatus();
}
}  // namespace

absl::StatusOr<int64_t> StoreImpl::Score(const LayerRef& at, const ReadRows& q, float scale,
                                         bool corrections_only, std::vector<float>* out) {
  ASSIGN_OR_RETURN(std::shared_ptr<Sequence> s, Find(at.tenant, at.sequence_id, at.basis_version));
  ReaderMutexLock l(&s->mu);
  int64_t tokens = 0;
  ASSIGN_OR_RETURN(LayerCache * cache, ReadLayer(*s, at.sequence_id, at.layer, &tokens));
  RETURN_IF_ERROR(CheckQueryShape(s->model->manifest, "queries", q.q_heads, q.width));
  out->assign(static_cast<size_t>(q.q_heads) * q.n_q * tokens, 0.0f);
  RETURN_IF_ERROR(cache->Score(q.data, q.q_heads, q.n_q, out->data(), scale, corrections_only));
  return tokens;
}

absl::StatusOr<int64_t> StoreImpl::Readout(const LayerRef& at, const ReadRows& p, bool as_logits,
                                           std::vector<float>* out) {
  ASSIGN_OR_RETURN(std::shared_ptr<Sequence> s, Find(at.tenant, at.sequence_id, at.basis_version));
  ReaderMutexLock l(&s->mu);
  int64_t tokens = 0;
  ASSIGN_OR_RETURN(LayerCache * cache, ReadLayer(*s, at.sequence_id, at.layer, &tokens));
  const BasisManifest& m = s->model->manifest;
  RETURN_IF_ERROR(CheckQueryShape(m, "weights", p.q_heads, -1));
  if (p.width != tokens) {
    return absl::FailedPreconditionError(
        absl::StrCat("weights.shape[2] ", p.width, " must equal the tokens cached in layer ",
                     at.layer, " of sequence '", at.sequence_id, "' (", tokens, ")"));
  }
  const float* weights = p.data;
  std::vector<float> soft;
  if (as_logits) {
    soft.resize(static_cast<size_t>(p.q_heads) * p.n_q * p.width);
    for (int64_t r = 0; r < int64_t{p.q_heads} * p.n_q; ++r) {
      Softmax(p.data + r * p.width, p.width, soft.data() + r * p.width);
    }
    weights = soft.data();
  }
  out->assign(static_cast<size_t>(p.q_heads) * p.n_q * m.head_dim, 0.0f);
  RETURN_IF_ERROR(cache->Readout(weights, p.q_heads, p.n_q, out->data()));
  return tokens;
}

absl::StatusOr<int64_t> StoreImpl::Attend(const LayerRef& at, const ReadRows& q,
                                          const AttendOptions& ao, std::vector<float>* out) {
  ASSIGN_OR_RETURN(std::shared_ptr<Sequence> s, Find(at.tenant, at.sequence_id, at.basis_version));
  // Observing attends update the window's A^2 statistics: exclusive.
  std::optional<MutexLock> wl;
  std::optional<ReaderMutexLock> rl;
  if (ao.observe) {
    wl.emplace(&s->mu);
  } else {
    rl.emplace(&s->mu);
  }
  int64_t tokens = 0;
  ASSIGN_OR_RETURN(LayerCache * cache, ReadLayer(*s, at.sequence_id, at.layer, &tokens));
  const BasisManifest& m = s->model->manifest;
  RETURN_IF_ERROR(CheckQueryShape(m, "queries", q.q_heads, q.width));
  if (ao.causal_offset < -1 || ao.causal_offset >= tokens) {
    return absl::InvalidArgumentError(absl::StrCat("causal_offset ", ao.causal_offset,
                                                   " must be in 0..", tokens - 1, " (or absent)"));
  }
  out->assign(static_cast<size_t>(q.q_heads) * q.n_q * m.head_dim, 0.0f);
  AttendOptions with_backend = ao;
  if (with_backend.backend == nullptr) with_backend.backend = opts_.attend_backend;
  RETURN_IF_ERROR(cache->Attend(q.data, q.q_heads, q.n_q, with_backend, out->data()));
  return tokens;
}

absl::StatusOr<RangeRead> StoreImpl::ReadRange(
    const LayerRef& at, TokenRange range,
    const std::function<absl::Status(const LayerCache* cache, int64_t from, int64_t end,
                                     RangeRead* found)>& read) {
  if (range.from < 0) {
    return absl::InvalidArgumentError(absl::StrCat("from ", range.from, " must be >= 0"));
  }
  ASSIGN_OR_RETURN(std::shared_ptr<Sequence> s, Find(at.tenant, at.sequence_id, at.basis_version));
  ReaderMutexLock l(&s->mu);
  ASSIGN_OR_RETURN(LayerCache * cache, LayerAt(*s, at.layer));
  RangeRead found;
  if (cache == nullptr) {
    RETURN_IF_ERROR(read(nullptr, 0, 0, &found));
    return found;
  }
  const int64_t T = cache->tokens();
  found.tokens = T;
  const int64_t end = range.to < 0 ? T : std::min(range.to, T);
  found.first = std::min(range.from, end);
  if (found.first == 0 && end == T) RETURN_IF_ERROR(cache->VerifyAll());  // all before any
  RETURN_IF_ERROR(read(cache, found.first, end, &found));  // verifies every block it reads
  return found;
}

absl::StatusOr<RangeRead> StoreImpl::Decode(const LayerRef& at, TokenRange range,
                                            std::vector<float>* keys, std::vector<float>* values) {
  return ReadRange(at, range, [&](const LayerCache* cache, int64_t a, int64_t b, RangeRead*) {
    if (cache != nullptr) return cache->Decode(a, b, keys, values);
    keys->clear();
    values->clear();
    return absl::OkStatus();
  });
}

absl::StatusOr<RangeRead> StoreImpl::DecodeAs(const LayerRef& at, TokenRange range, DType dtype,
                                              std::vector<uint8_t>* keys,
                                              std::vector<uint8_t>* values) {
  return ReadRange(at, range, [&](const LayerCache* cache, int64_t a, int64_t b, RangeRead*) {
    if (cache != nullptr) return cache->DecodeAs(a, b, dtype, keys, values);
    keys->clear();
    values->clear();
    return absl::OkStatus();
  });
}

absl::StatusOr<RangeRead> StoreImpl::ReadEncoded(const LayerRef& at, TokenRange range, DType dtype,
                                                 EncodedGroups* groups, std::vector<uint8_t>* keys,
                                                 std::vector<uint8_t>* values) {
  *groups = EncodedGroups{};
  keys->clear();
  values->clear();
  return ReadRange(
      at, range,
      [&](const LayerCache* cache, int64_t a, int64_t b, RangeRead* found) -> absl::Status {
        if (cache == nullptr || a == b) return absl::OkStatus();
        const int64_t G = cache->options().key_group, E = cache->encoded_tokens();
        if (a < E) {
          found->first = a / G * G;
          RETURN_IF_ERROR(cache->ExportGroups(a / G, std::min(E, b + G - 1) / G, groups));
        }
        if (b > E) {
          RETURN_IF_ERROR(cache->DecodeAs(std::max(a, E), b, dtype, keys, values));
        }
        return absl::OkStatus();
      });
}

absl::Status StoreImpl::VerifyLayer(const LayerRef& at) {
  ASSIGN_OR_RETURN(std::shared_ptr<Sequence> s, Find(at.tenant, at.sequence_id, at.basis_version));
  ReaderMutexLock l(&s->mu);
  ASSIGN_OR_RETURN(LayerCache * cache, LayerAt(*s, at.layer));
  return cache == nullptr ? absl::OkStatus() : cache->VerifyAll();
}

absl::StatusOr<SequenceInfo> StoreImpl::Describe(const std::string& tenant,
                                                 const std::string& sequence_id) {
  ASSIGN_OR_RETURN(std::shared_ptr<Sequence> s, Find(tenant, sequence_id, 0));
  SequenceInfo info;
  info.model = s->model;
  info.codec = s->codec;
  ReaderMutexLock l(&s->mu);
  for (size_t l = 0; l < s->hashes.size(); ++l) {
    info.layer_tokens.push_back(s->Length(static_cast<int>(l)));
  }
  MutexLock g(&mu_);
  info.bytes = s->bytes;
  return info;
}

absl::StatusOr<int64_t> StoreImpl::Delete(const std::string& tenant,
                                          const std::string& sequence_id) {
  MutexLock l(&mu_);
  auto t = tenants_.find(tenant);
  if (t != tenants_.end()) {
    auto it = t->second->seqs.find(sequence_id);
    if (it != t->second->seqs.end()) {
      std::shared_ptr<Sequence> s = it->second;
      const int64_t bytes = s->bytes;
      UnlinkLocked(s.get(), /*drop=*/false);
      return bytes;
    }
  }
  return absl::NotFoundError(absl::StrCat("sequence '", sequence_id, "' not found"));
}

UsageStats StoreImpl::TenantUsage(const std::string& tenant) const {
  UsageStats u;
  MutexLock l(&mu_);
  auto t = tenants_.find(tenant);
  if (t == tenants_.end()) return u;
  u.evictions = t->second->evictions;
  u.expirations = t->second->expirations;
  u.shared_tokens = t->second->shared_tokens;
  u.prefix_blocks = t->second->prefixes.entries();
  u.prefix_bytes = t->second->prefixes.bytes();
  u.retained_bytes = t->second->prefixes.retained_bytes();
  for (const auto& [id, s] : t->second->seqs) {
    ++u.sequences;
    u.tokens += s->tokens;
    u.bytes += s->bytes;
    u.blocks += s->blocks;
    u.elements += s->elements;
    u.size += s->size;
  }
  u.bytes += t->second->prefixes.bytes();
  return u;
}

UsageStats StoreImpl::TotalUsage() const {
  UsageStats u;
  MutexLock l(&mu_);
  u.evictions = evictions_;
  u.expirations = expirations_;
  for (const auto& [name, t] : tenants_) {
    u.shared_tokens += t->shared_tokens;
    u.prefix_blocks += t->prefixes.entries();
    u.prefix_bytes += t->prefixes.bytes();
    u.retained_bytes += t->prefixes.retained_bytes();
  }
  for (const Sequence* s : lru_) {
    ++u.sequences;
    u.tokens += s->tokens;
    u.blocks += s->blocks;
    u.elements += s->elements;
    u.size += s->size;
  }
  u.bytes = used_bytes_;
  return u;
}

std::vector<std::pair<std::string, UsageStats>> StoreImpl::AllTenants() const {
  std::vector<std::string> names;
  {
    MutexLock l(&mu_);
    for (const auto& [name, t] : tenants_) names.push_back(name);
  }
  std::vector<std::pair<std::string, UsageStats>> out;
  for (const auto& n : names) out.emplace_back(n, TenantUsage(n));
  return out;
}

int64_t StoreImpl::LiveSequences(const std::string& model, int version) const {
  MutexLock l(&mu_);
  int64_t n = 0;
  for (const Sequence* s : lru_) {
    n += s->model->manifest.model == model && s->model->manifest.version == version;
  }
  return n;
}

int64_t StoreImpl::Sweep() {
  if (opts_.ttl <= absl::ZeroDuration()) return 0;
  MutexLock l(&mu_);
  const absl::Time cutoff = opts_.now() - opts_.ttl;
  int64_t n = 0;
  while (!lru_.empty() && lru_.back()->last_used < cutoff) {
    Sequence* s = lru_.back();
    ++tenants_[s->tenant]->expirations;
    ++expirations_;
    UnlinkLocked(s, /*drop=*/false);
    ++n;
  }
  for (auto& [name, t] : tenants_) DropRetainedLocked(*t, 0, cutoff);
  return n;
}

Store::Dropped StoreImpl::DropAll() {
  Dropped d;
  // Destroyed once the store's lock is released, not under it (as evicted sequences are).
  std::vector<std::shared_ptr<Sequence>> gone;
  {
    MutexLock l(&mu_);
    const int64_t before = used_bytes_;
    for (auto& [name, t] : tenants_) {
      for (const auto& [id, s] : t->seqs) gone.push_back(s);
    }
    // drop=true: the groups only they held go with them; what is left is retained.
    for (const auto& s : gone) UnlinkLocked(s.get(), /*drop=*/true);
    for (auto& [name, t] : tenants_) DropRetainedLocked(*t, 0);
    d.sequences = static_cast<int64_t>(gone.size());
    d.bytes = before - used_bytes_;
  }
  return d;
}

int64_t StoreImpl::Scrub() {
  std::vector<std::shared_ptr<Sequence>> all;
  {
    MutexLock l(&mu_);
    for (const auto& [name, t] : tenants_) {
      for (const auto& [id, s] : t->seqs) all.push_back(s);
    }
  }
  int64_t bad = 0;
  for (const auto& s : all) {
    ReaderMutexLock l(&s->mu);
    for (const auto& c : s->layers) {
      if (c && !c->VerifyAll().ok()) {
        s->corrupt.store(true);
        ++bad;
        break;
      }
    }
  }
  // Retained prefix groups (held by no sequence, so not verified above): a corrupted one is
  // dropped with its extensions, so that no later attach can take it.
  MutexLock l(&mu_);
  for (auto& [name, t] : tenants_) {
    const std::vector<PrefixKey> corrupt = t->prefixes.CorruptRetained();
    for (const PrefixKey& k : corrupt) DropPrefixLocked(*t, k);
    retained_scrub_drops_ += static_cast<int64_t>(corrupt.size());
  }
  return bad;
}

LayerCache* StoreImpl::LayerForTest(const std::string& tenant, const std::string& sequence_id,
                                    int layer) {
  absl::StatusOr<std::shared_ptr<Sequence>> s = Find(tenant, sequence_id, 0);
  if (!s.ok()) return nullptr;
  ReaderMutexLock l(&(*s)->mu);
  if (layer < 0 || layer >= static_cast<int>((*s)->layers.size())) return nullptr;
  return (*s)->layers[layer].get();
}

}  // namespace kvq::core
