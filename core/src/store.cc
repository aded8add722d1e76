// The block store: sequences per tenant, positioned idempotent appends, LRU eviction.
#include "kvq/core/store.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <deque>
#include <new>
#include <optional>
#include <set>

#include "absl/strings/str_cat.h"
#include "kvq/core/eviction_planner.h"
#include "kvq/core/field_error.h"
#include "kvq/core/metrics.h"
#include "kvq/core/status.h"
#include "prefix_index.h"
#include "xxhash.h"

namespace kvq::core {

struct Store::Sequence {
  std::string tenant, id;
  std::shared_ptr<const ModelEntry> model;
  CodecOptions codec;

  Mutex mu;
  std::vector<std::unique_ptr<LayerCache>> layers ABSL_GUARDED_BY(mu);
  // Per layer, per stored token: hash of the bytes it arrived as, for idempotent re-sends.
  // The tokens of indexed (sealed) groups keep theirs in the prefix index instead (the hashes
  // of the sequence that first stored the group): hashes[l] holds tokens from
  // hash_base[l] = (indexed groups) x G on. Length(l) is the layer's token count.
  std::vector<std::vector<uint64_t>> hashes ABSL_GUARDED_BY(mu);
  std::vector<int64_t> hash_base ABSL_GUARDED_BY(mu);
  int64_t Length(int layer) const ABSL_SHARED_LOCKS_REQUIRED(mu) {
    return hash_base[layer] + static_cast<int64_t>(hashes[layer].size());
  }
  // Per layer: prefix-sharing state.
  struct LayerPrefix {
    bool open = true;                   // every append so far carried token ids
    PrefixKey seed;                     // the chain's root (PrefixSeed), set at creation
    std::vector<PrefixKey> block_keys;  // key of each sealed group
    std::vector<uint32_t> pending_ids;  // ids of the tokens after the sealed groups
  };
  std::vector<LayerPrefix> prefix ABSL_GUARDED_BY(mu);
  bool dtype_set ABSL_GUARDED_BY(mu) = false;
  DType dtype ABSL_GUARDED_BY(mu) = DType::kF32;
  std::atomic<bool> corrupt{false};

  // Guarded by Store::mu_.
  std::vector<PrefixKey> node_keys;  // prefix-index entries this sequence holds
  int64_t bytes = 0;
  int64_t tokens = 0;
  int64_t blocks = 0;
  int64_t elements = 0;
  SizeReport size;
  absl::Time last_used;
  std::list<Sequence*>::iterator lru;
  bool linked = false;
};

struct Store::Tenant {
  absl::flat_hash_map<std::string, std::shared_ptr<Sequence>> seqs;
  int64_t bytes = 0;  // stored + reserved, prefix index included
  int64_t evictions = 0;
  int64_t expirations = 0;
  PrefixIndex prefixes;  // its bytes are in `bytes` (and the store's used bytes)
  int64_t shared_tokens = 0;
};

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

// The first `rank` columns of one layer of a basis-shaped tensor (U, or an oblique pair's
// encode basis A: the leading columns of a pair are the lower-rank pair), [kv][d][rank];
// empty when the tensor is (no basis, not oblique) or rank is 0.
std::vector<float> LayerBasis(const ModelEntry& m, const std::vector<float>& tensor, int layer,
                              int rank) {
  if (rank == 0 || !m.has_basis || tensor.empty()) return {};
  const int kv = m.manifest.kv_heads, d = m.manifest.head_dim, R = m.manifest.rank;
  std::vector<float> out(static_cast<size_t>(kv) * d * rank);
  for (int h = 0; h < kv; ++h) {
    const float* u = tensor.data() + m.basis.HeadOffset(layer, h);
    for (int i = 0; i < d; ++i) {
      for (int j = 0; j < rank; ++j) {
        out[(static_cast<size_t>(h) * d + i) * rank + j] = u[i * R + j];
      }
    }
  }
  return out;
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
// server renames to its wire path.
absl::Status AppendError(absl::StatusCode code, size_t i, absl::string_view rest) {
  return FieldError(code, absl::StrCat("appends[", i, "]"), rest);
}

std::string Shape(const TensorView& t) {
  std::string s = "[";
  for (int i = 0; i < t.rank; ++i) absl::StrAppend(&s, i ? "," : "", t.shape[i]);
  return s + "]";
}

}  // namespace

Store::Store(StoreOptions opts, Registry* registry) : opts_(std::move(opts)), registry_(registry) {}

Store::~Store() {
  MutexLock l(&mu_);
  lru_.clear();
  tenants_.clear();
}

void Store::TouchLocked(Sequence* s) {
  s->last_used = opts_.now();
  if (s->linked) lru_.splice(lru_.begin(), lru_, s->lru);
}

void Store::UnlinkLocked(Sequence* s, bool drop) {
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

void Store::ReleasePrefixLocked(Tenant& t, const PrefixKey& key, bool drop) {
  if (t.prefixes.Release(key) && (drop || !opts_.retain_prefixes)) DropPrefixLocked(t, key);
}

int64_t Store::DropPrefixLocked(Tenant& t, const PrefixKey& key) {
  const int64_t freed = t.prefixes.Drop(key);
  t.bytes -= freed;
  used_bytes_ -= freed;
  return freed;
}

int64_t Store::DropRetainedLocked(Tenant& t, int64_t need, absl::Time older_than) {
  const int64_t freed = t.prefixes.DropRetained(need, older_than);
  t.bytes -= freed;
  used_bytes_ -= freed;
  return freed;
}

absl::Status Store::ReserveLocked(const std::string& tenant, int64_t bytes,
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

std::shared_ptr<const LayerCodecTables> Store::LayerTables(const ModelEntry& model, int layer,
                                                           const CodecOptions& codec) {
  // What the tables depend on: the entry's tensors (name, version, fingerprint) and the
  // codec fields that shape them.
  const std::string key = absl::StrCat(model.manifest.model, "/", model.manifest.version, "/",
                                       model.manifest.fingerprint, "/", layer, "/", codec.head_dim,
                                       ",", codec.rank, ",", codec.rotate_keys, ",",
                                       codec.metric_rounding);
  MutexLock l(&tables_mu_);
  if (auto held = tables_[key].lock()) return held;
  std::vector<float> basis = LayerBasis(model, model.basis.u, layer, codec.rank);
  std::vector<float> encode = LayerBasis(model, model.basis.encode, layer, codec.rank);
  const float* moment = model.basis.query_moment_head(layer, 0);
  std::shared_ptr<const LayerCodecTables> t = MakeLayerCodecTables(
      codec, model.manifest.kv_heads, basis.empty() ? nullptr : basis.data(),
      encode.empty() ? nullptr : encode.data(), codec.metric_rounding ? moment : nullptr);
  tables_[key] = t;
  // Forget the tables no cache holds any more (retired versions, finished codecs).
  absl::erase_if(tables_, [](const auto& kv) { return kv.second.expired(); });
  return t;
}

// What a sequence takes besides its codes, windows and arrival hashes, counted against
// capacity and quota so that many tiny sequences cannot take memory the count does not see:
// the object and its strings, the per-layer vectors and caches (with malloc's 16-byte header
// per heap block), and an estimate of the tenant map's slot and the LRU node (kIndexBytes).
int64_t SequenceOverheadBytes(const Store::Sequence& s) ABSL_NO_THREAD_SAFETY_ANALYSIS {
  constexpr int64_t kIndexBytes = 96;
  auto held = [](const auto& v) -> int64_t {
    return v.capacity() ? static_cast<int64_t>(v.capacity() * sizeof(v[0])) + 16 : 0;
  };
  int64_t b = kIndexBytes + static_cast<int64_t>(sizeof(Store::Sequence)) + 16 + held(s.tenant) +
              held(s.id) + held(s.layers) + held(s.hashes) + held(s.hash_base) + held(s.prefix) +
              held(s.node_keys);
  // The hashes' capacity is counted with the sequence's data (Remeasure); here their headers.
  for (const auto& h : s.hashes) b += h.capacity() ? 16 : 0;
  for (const auto& p : s.prefix) b += held(p.block_keys) + held(p.pending_ids);
  for (const auto& l : s.layers)
    if (l) b += l->OverheadBytes();
  return b;
}

void Store::Remeasure(Sequence* s, int64_t reserved) {
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
  if (t == tenants_.end()) return;
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
}

absl::Status Store::IndexSealed(const std::string& tenant, Sequence* s, int layer) {
  Sequence::LayerPrefix& lp = s->prefix[layer];
  LayerCache& cache = *s->layers[layer];
  const int G = s->codec.key_group;
  MutexLock g(&mu_);
  // Evicted by another writer while this append ran: it is going away, index nothing.
  if (!s->linked) return absl::OkStatus();
  Tenant& T = *tenants_[tenant];
  const absl::Time now = opts_.now();
  while (lp.block_keys.size() < cache.sealed().size()) {
    const size_t b = lp.block_keys.size();
    if (lp.pending_ids.size() < static_cast<size_t>(G)) {
      return absl::InternalError(absl::StrCat("layer ", layer, ": group ", b,
                                              " sealed without its token ids"));
    }
    const PrefixKey prev = b > 0 ? lp.block_keys[b - 1] : lp.seed;
    const PrefixKey key = ChainKey(prev, lp.pending_ids.data(), G);
    lp.pending_ids.erase(lp.pending_ids.begin(), lp.pending_ids.begin() + G);
    if (const PrefixIndex::Entry* e = T.prefixes.Find(key)) {
      // The same tokens, model, basis and codec settings: hold the indexed copy instead.
      RETURN_IF_ERROR(cache.ReplaceSealed(static_cast<int64_t>(b), e->block));
      T.prefixes.Hold(key);
      T.prefixes.Touch(key, now);
      T.shared_tokens += G;
    } else {
      const auto& hashes = s->hashes[layer];  // starts at group b (hash_base = b * G)
      const int64_t bytes =
          T.prefixes.Insert(key, b > 0 ? std::optional<PrefixKey>(prev) : std::nullopt,
                            cache.sealed()[b], std::span<const uint64_t>(hashes.data(), G), now);
      T.bytes += bytes;
      used_bytes_ += bytes;
    }
    s->node_keys.push_back(key);
    lp.block_keys.push_back(key);
    // The group's arrival hashes now live in the index (and their room is given back once
    // most of it is unused: it is counted against the tenant).
    auto& h = s->hashes[layer];
    h.erase(h.begin(), h.begin() + G);
    if (h.capacity() > 2 * h.size() + 64) h.shrink_to_fit();
    s->hash_base[layer] += G;
  }
  return absl::OkStatus();
}

namespace {
// The sequences one append holds: locked in address order (two appends never wait on each
// other in a cycle) and unlocked in reverse when it goes out of scope, on every path.
class SequenceLocks {
 public:
  explicit SequenceLocks(std::vector<Store::Sequence*> seqs) ABSL_NO_THREAD_SAFETY_ANALYSIS
      : seqs_(std::move(seqs)) {
    std::sort(seqs_.begin(), seqs_.end());
    for (Store::Sequence* s : seqs_) s->mu.Lock();
  }
  ~SequenceLocks() ABSL_NO_THREAD_SAFETY_ANALYSIS {
    for (auto it = seqs_.rbegin(); it != seqs_.rend(); ++it) (*it)->mu.Unlock();
  }
  SequenceLocks(const SequenceLocks&) = delete;
  SequenceLocks& operator=(const SequenceLocks&) = delete;
  const std::vector<Store::Sequence*>& held() const { return seqs_; }

 private:
  std::vector<Store::Sequence*> seqs_;
};
}  // namespace

absl::Status Store::Append(const std::string& tenant, const std::vector<AppendSpec>& batch,
                           AppendOutcome* outcome) {
  *outcome = AppendOutcome{};
  if (batch.empty()) return absl::OkStatus();
  for (int attempt = 0;; ++attempt) {
    // 1. Find or prepare every sequence the batch names.
    std::vector<std::string> ids;
    absl::flat_hash_map<std::string, std::shared_ptr<Sequence>> seqs;
    absl::flat_hash_map<std::string, bool> fresh;
    for (size_t i = 0; i < batch.size(); ++i) {
      const std::string& id = batch[i].sequence_id;
      if (id.empty() || id.size() > 256) {
        return AppendError(absl::StatusCode::kInvalidArgument, i,
                           absl::StrCat(".sequence_id must be 1..256 bytes (got ", id.size(), ")"));
      }
      if (seqs.count(id)) continue;
      {
        MutexLock l(&mu_);
        auto t = tenants_.find(tenant);
        if (t != tenants_.end()) {
          auto s = t->second->seqs.find(id);
          if (s != t->second->seqs.end()) seqs[id] = s->second;
        }
      }
      if (!seqs.count(id)) {
        const AppendSpec& a = batch[i];
        if (a.model.empty()) {
          return AppendError(absl::StatusCode::kNotFound, i,
                             absl::StrCat(": sequence '", id,
                                          "' does not exist; the append that creates it must name a model"));
        }
        absl::StatusOr<std::shared_ptr<const ModelEntry>> m =
            registry_->Get(a.model, a.basis_version);
        if (!m.ok()) {
          return AppendError(m.status().code(), i, absl::StrCat(".model: ", m.status().message()));
        }
        auto s = std::make_shared<Sequence>();
        s->tenant = tenant;
        s->id = id;
        s->model = *m;
        s->codec = a.has_codec ? a.codec : (*m)->codec;
        s->codec.head_dim = (*m)->manifest.head_dim;
        if (s->codec.rank > (*m)->manifest.rank) {
          return AppendError(absl::StatusCode::kInvalidArgument, i,
                             absl::StrCat(".codec.rank ", s->codec.rank, " exceeds the basis rank ",
                                          (*m)->manifest.rank, " of model '", a.model, "'"));
        }
        if (absl::Status st = s->codec.Validate(); !st.ok()) {
          return AppendError(absl::StatusCode::kInvalidArgument, i, absl::StrCat(".codec: ", st.message()));
        }
        if (s->codec.metric_rounding && (*m)->basis.query_moment.empty()) {
          return AppendError(absl::StatusCode::kFailedPrecondition, i,
                             absl::StrCat(".codec.metric_rounding needs query moments, which model '",
                                          a.model, "' version ", (*m)->manifest.version,
                                          " was registered without"));
        }
        s->layers.resize((*m)->manifest.layers);
        s->hashes.resize((*m)->manifest.layers);
        s->hash_base.assign((*m)->manifest.layers, 0);
        s->prefix.resize((*m)->manifest.layers);
        for (int l = 0; l < (*m)->manifest.layers; ++l) {
          s->prefix[l].seed = PrefixSeed(**m, s->codec, l);
        }
        seqs[id] = s;
        fresh[id] = true;
      }
      ids.push_back(id);
    }

    // 2. Lock every sequence, in address order, until this attempt ends (whatever leaves it).
    std::vector<Sequence*> to_lock;
    for (auto& [id, s] : seqs) to_lock.push_back(s.get());
    const SequenceLocks locks(std::move(to_lock));
    const std::vector<Sequence*>& locked = locks.held();

    // 3. Validate the whole batch, simulating the lengths it produces.
    struct Plan {
      int64_t from = 0, n = 0;  // new tokens: [from, from + n) of the append's own range
      std::vector<uint64_t> new_hashes;
      // The first `attach.size()` groups of the new tokens come from the prefix index.
      std::vector<SealedBlockPtr> attach;
      std::vector<PrefixKey> attach_keys;
    };
    std::vector<Plan> plans(batch.size());
    absl::flat_hash_map<std::pair<Sequence*, int>, std::vector<uint64_t>> pending;
    int64_t estimate = 0;
    absl::Status bad;
    for (size_t i = 0; i < batch.size() && bad.ok(); ++i) {
      const AppendSpec& a = batch[i];
      Sequence* s = seqs[a.sequence_id].get();
      const BasisManifest& m = s->model->manifest;
      auto fail = [&](absl::StatusCode code, auto&&... parts) {
        bad = AppendError(code, i, absl::StrCat(parts...));
      };
      if (!a.model.empty() && a.model != m.model) {
        fail(absl::StatusCode::kFailedPrecondition, ".model '", a.model, "': sequence '",
             a.sequence_id, "' belongs to model '", m.model, "'");
        break;
      }
      if (a.basis_version != 0 && a.basis_version != m.version) {
        fail(absl::StatusCode::kFailedPrecondition, ".basis_version ", a.basis_version,
             ": sequence '", a.sequence_id, "' is pinned to version ", m.version, " of '", m.model,
             "'");
        break;
      }
      if (a.layer < 0 || a.layer >= m.layers) {
        fail(absl::StatusCode::kInvalidArgument, ".layer ", a.layer, " must be in 0..",
             m.layers - 1, " (model '", m.model, "' has ", m.layers, " layers)");
        break;
      }
      const TensorView *k = &a.keys, *v = &a.values;
      const bool attach_only = k->rank == 0 && v->rank == 0;
      const int G = s->codec.key_group;
      if (attach_only) {
        if (a.token_ids.empty() || a.token_ids.size() > static_cast<size_t>(kMaxAppendTokens)) {
          fail(absl::StatusCode::kInvalidArgument, ": keys and values are absent, so token_ids "
               "(1..", kMaxAppendTokens, " ids) must name the tokens to attach from the prefix "
               "index (got ", a.token_ids.size(), ")");
          break;
        }
        if (a.start % G != 0) {
          fail(absl::StatusCode::kInvalidArgument, ".start ", a.start,
               ": an attach (token_ids without keys and values) starts at a multiple of the "
               "group size G = ", G);
          break;
        }
        if (a.probe_weights != nullptr) {
          fail(absl::StatusCode::kInvalidArgument,
               ".probe_weights: an attach carries no tokens to weigh");
          break;
        }
      } else if (k->rank != 3 || k->shape[0] != m.kv_heads || k->shape[2] != m.head_dim ||
          k->shape[1] < 1 || k->shape[1] > kMaxAppendTokens) {
        fail(absl::StatusCode::kInvalidArgument, ".keys.shape ", Shape(*k),
             " must be [kv_heads=", m.kv_heads, ", n in 1..", kMaxAppendTokens,
             ", head_dim=", m.head_dim, "]");
        break;
      }
      if (attach_only) {
        // checked above
      } else if (v->rank != 3 || v->shape[0] != k->shape[0] || v->shape[1] != k->shape[1] ||
          v->shape[2] != k->shape[2]) {
        fail(absl::StatusCode::kInvalidArgument, ".values.shape ", Shape(*v),
             " must equal keys.shape ", Shape(*k));
        break;
      }
      if (!attach_only && v->dtype != k->dtype) {
        fail(absl::StatusCode::kInvalidArgument, ".values.dtype ", DTypeName(v->dtype),
             " must equal keys.dtype ", DTypeName(k->dtype));
        break;
      }
      if (!attach_only && batch.size() > 1) {
        // Each cache rejects bad rows without change, but only for its own append: with more
        // than one, every element is checked here so that a bad one leaves none applied.
        absl::Status rows = CheckStorable(*k, "keys");
        if (rows.ok()) rows = CheckStorable(*v, "values");
        if (!rows.ok()) {
          fail(absl::StatusCode::kInvalidArgument, " (layer ", a.layer, "): ", rows.message());
          break;
        }
      }
      if (!attach_only && !a.token_ids.empty() &&
          a.token_ids.size() != static_cast<size_t>(k->shape[1])) {
        fail(absl::StatusCode::kInvalidArgument, ".token_ids has ", a.token_ids.size(),
             " ids; it must be empty or hold one id per appended token (", k->shape[1], ")");
        break;
      }
      if (!attach_only && s->dtype_set && k->dtype != s->dtype) {
        fail(absl::StatusCode::kInvalidArgument, ".keys.dtype ", DTypeName(k->dtype),
             " differs from the dtype sequence '", a.sequence_id, "' arrived in (",
             DTypeName(s->dtype), ")");
        break;
      }
      const int64_t n = attach_only ? static_cast<int64_t>(a.token_ids.size()) : k->shape[1];
      auto& pend = pending[{s, a.layer}];
      const std::vector<uint64_t>& stored = s->hashes[a.layer];
      const int64_t base = s->hash_base[a.layer];
      const int64_t len = base + static_cast<int64_t>(stored.size() + pend.size());
      if (a.start < 0 || a.start > len) {
        fail(a.start < 0 ? absl::StatusCode::kInvalidArgument
                         : absl::StatusCode::kFailedPrecondition,
             ".start ", a.start, " must be in 0..", len, " (layer ", a.layer, " of sequence '",
             a.sequence_id, "' holds ", len, " tokens; appends leave no gaps)");
        break;
      }
      Plan& p = plans[i];
      const Sequence::LayerPrefix& lp = s->prefix[a.layer];
      int64_t overlap = std::min(n, len - a.start);
      if (attach_only) {
        // A re-sent attach: the overlapped groups must be sealed with the same keys.
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
          fail(absl::StatusCode::kAlreadyExists, ".token_ids[", g * G, "..]: tokens from ",
               a.start + g * G, " of layer ", a.layer, " of sequence '", a.sequence_id,
               "' are stored, but not as sealed groups of these ids");
          break;
        }
      } else {
        // Tokens of indexed groups compare with the index's hashes (under the store lock).
        std::optional<MutexLock> index_lock;
        const Tenant* T = nullptr;
        if (overlap > 0 && a.start < base) {
          index_lock.emplace(&mu_);
          auto t = tenants_.find(tenant);
          if (t != tenants_.end()) T = t->second.get();
        }
        for (int64_t t = 0; t < overlap; ++t) {
          const int64_t pos = a.start + t;
          uint64_t have = 0;
          if (pos < base) {
            const PrefixIndex::Entry* node =
                T != nullptr ? T->prefixes.Find(lp.block_keys[pos / G]) : nullptr;
            have = node != nullptr ? node->hashes[pos % G] : ~TokenHash(*k, *v, t);
          } else {
            const int64_t i = pos - base;
            have = i < static_cast<int64_t>(stored.size()) ? stored[i] : pend[i - stored.size()];
          }
          if (have != TokenHash(*k, *v, t)) {
            fail(absl::StatusCode::kAlreadyExists, ": token ", pos, " of layer ", a.layer,
                 " of sequence '", a.sequence_id,
                 "' is already stored with different contents (re-sends must be identical)");
            break;
          }
        }
        if (!bad.ok()) break;
      }
      p.from = overlap;
      p.n = n - overlap;
      // Groups from the prefix index: only at the end of a layer whose every token is sealed
      // (and nothing earlier in this message touched it); for data, at most the groups the
      // append would encode itself.
      const LayerCache* cache = s->layers[a.layer].get();
      if (p.n > 0 && !a.token_ids.empty() && lp.open && pend.empty() && a.start + overlap == len &&
          (cache == nullptr || cache->AllSealed())) {
        // Attach or data alike: only groups that a sequence holding these n tokens would
        // have encoded itself; the last R (the window) and the incomplete group stay for the
        // frontend to send with data, at arrival precision.
        const int64_t most = std::max<int64_t>(0, (p.n - s->codec.window) / G);
        const PrefixKey prev = lp.block_keys.empty() ? lp.seed : lp.block_keys.back();
        MutexLock g(&mu_);
        auto t = tenants_.find(tenant);
        if (t != tenants_.end()) {
          // Pinned: no reservation may drop them before they are attached.
          PrefixIndex::Run run =
              t->second->prefixes.HoldRun(prev, a.token_ids.subspan(p.from), G, most);
          p.attach = std::move(run.blocks);
          p.attach_keys = std::move(run.keys);
          if (attach_only) p.new_hashes = std::move(run.hashes);
        }
      }
      if (attach_only) p.n = static_cast<int64_t>(p.attach.size()) * G;
      if (len + p.n > opts_.max_tokens_per_layer) {
        fail(absl::StatusCode::kResourceExhausted, ": layer ", a.layer, " would hold ", len + p.n,
             " tokens; the limit is ", opts_.max_tokens_per_layer);
        break;
      }
      if (!attach_only) {
        for (int64_t t = p.from; t < n; ++t) p.new_hashes.push_back(TokenHash(*k, *v, t));
      }
      pend.insert(pend.end(), p.new_hashes.begin(), p.new_hashes.end());
      outcome->tokens_duplicate += overlap;
      const int64_t shared = static_cast<int64_t>(p.attach.size()) * G;
      if (!attach_only) {
        estimate += GrowthEstimate(s->codec, m.kv_heads, k->dtype, len + shared, len + p.n);
      }
      estimate += shared * static_cast<int64_t>(sizeof(uint64_t));
      if (a.probe_weights == nullptr) continue;
      for (int64_t j = 0; j < m.kv_heads * n; ++j) {
        if (!(a.probe_weights[j] >= 0.0f)) {
          fail(absl::StatusCode::kInvalidArgument, ".probe_weights[", j,
               "] must be finite and >= 0");
          break;
        }
      }
    }
    // Releases the prefix-index entries pinned above (a failed or retried attempt).
    auto unpin_locked = [&](size_t from_item, size_t to_item = SIZE_MAX) {
      auto t = tenants_.find(tenant);
      if (t == tenants_.end()) return;
      for (size_t i = from_item; i < std::min(to_item, plans.size()); ++i) {
        for (const PrefixKey& k : plans[i].attach_keys) {
          ReleasePrefixLocked(*t->second, k, /*drop=*/false);
        }
        plans[i].attach_keys.clear();
      }
    };
    auto unpin = [&](size_t from_item) {
      MutexLock g(&mu_);
      unpin_locked(from_item);
    };
    if (!bad.ok()) {
      unpin(0);
      *outcome = AppendOutcome{};
      return bad;
    }

    // 4. Insert new sequences and reserve room. Sequences evicted for it are destroyed
    // (their memory freed) after the store's lock is released.
    std::vector<std::shared_ptr<Sequence>> evicted;
    {
      MutexLock l(&mu_);
      bool raced = false;
      auto& tp = tenants_[tenant];
      if (!tp) tp = std::make_unique<Tenant>();
      for (auto& [id, s] : seqs) {
        auto it = tp->seqs.find(id);
        if (fresh.count(id) ? it != tp->seqs.end() : (it == tp->seqs.end() || it->second != s)) {
          raced = true;  // created, deleted or evicted concurrently
        }
      }
      if (raced) {
        unpin_locked(0);
        if (attempt < 3) continue;
        return absl::AbortedError("sequences changed concurrently; retry the append");
      }
      absl::Status st = ReserveLocked(tenant, estimate, locked, &evicted);
      if (!st.ok()) {
        unpin_locked(0);
        *outcome = AppendOutcome{};
        return st;
      }
      for (auto& [id, s] : seqs) {
        if (!fresh.count(id)) continue;
        tp->seqs[id] = s;
        lru_.push_front(s.get());
        s->lru = lru_.begin();
        s->linked = true;
      }
      for (auto& [id, s] : seqs) TouchLocked(s.get());
    }
    evicted.clear();  // their memory back, outside the store's lock

    // 5. Apply. A failed item stops the batch there (the items before it stay applied; a
    // LayerCache append that fails changes nothing, its block pool reserved up front).
    absl::Status applied;
    size_t item = 0;
    try {
      for (size_t i = 0; i < batch.size() && applied.ok(); ++i) {
        item = i;
        const AppendSpec& a = batch[i];
        const Plan& p = plans[i];
        Sequence* s = seqs[a.sequence_id].get();
        if (p.n == 0) continue;
        auto& cache = s->layers[a.layer];
        if (!cache) {
          const ModelEntry& model = *s->model;
          cache = std::make_unique<LayerCache>(s->codec, model.manifest.kv_heads,
                                               LayerTables(model, a.layer, s->codec), opts_.byte_pool);
        }
        Sequence::LayerPrefix& lp = s->prefix[a.layer];
        if (a.token_ids.empty()) {
          lp.open = false;
          lp.pending_ids.clear();
        }
        cache->set_sealing(lp.open);
        const int G = s->codec.key_group;
        const int64_t shared = static_cast<int64_t>(p.attach.size()) * G;
        if (!p.attach.empty()) {
          applied = cache->AttachSealed(p.attach);
          if (!applied.ok()) {
            unpin(i);
            applied = AppendError(absl::StatusCode::kInternal, i,
                                  absl::StrCat(": prefix block rejected: ", applied.message()));
            break;
          }
          lp.block_keys.insert(lp.block_keys.end(), p.attach_keys.begin(), p.attach_keys.end());
          s->hash_base[a.layer] += shared;  // their arrival hashes are the index's
          MutexLock g(&mu_);
          if (!s->linked) {
            unpin_locked(i, i + 1);  // evicted meanwhile by another writer: hold nothing
            continue;
          }
          s->node_keys.insert(s->node_keys.end(), p.attach_keys.begin(), p.attach_keys.end());
          Tenant& T = *tenants_[tenant];
          const absl::Time now = opts_.now();
          for (const PrefixKey& k : p.attach_keys) T.prefixes.Touch(k, now);
          T.shared_tokens += shared;
        }
        const int64_t data_n = p.n - shared;
        if (data_n > 0) {
          const int64_t from = p.from + shared;
          std::vector<float> probe;
          if (a.probe_weights) {
            const int64_t n = a.keys.shape[1];
            for (int64_t h = 0; h < a.keys.shape[0]; ++h) {
              probe.insert(probe.end(), a.probe_weights + h * n + from, a.probe_weights + h * n + n);
            }
          }
          if (lp.open) {
            lp.pending_ids.insert(lp.pending_ids.end(), a.token_ids.begin() + from,
                                  a.token_ids.end());
          }
          applied = cache->Append(SliceTokens(a.keys, from, data_n),
                                  SliceTokens(a.values, from, data_n), a.start + from,
                                  probe.empty() ? nullptr : probe.data());
          if (!applied.ok()) {
            unpin(i + 1);
            applied = AppendError(applied.code(), i,
                                  absl::StrCat(" (layer ", a.layer, "): ", applied.message()));
            break;
          }
          s->dtype = a.keys.dtype;
          s->dtype_set = true;
        }
        // Attached tokens' hashes are the index's; the rest are the sequence's own.
        auto& h = s->hashes[a.layer];
        h.insert(h.end(), p.new_hashes.begin() + shared, p.new_hashes.end());
        if (lp.open) {
          applied = IndexSealed(tenant, s, a.layer);
          if (!applied.ok()) {
            unpin(i + 1);
            break;
          }
        }
        outcome->tokens_written += data_n;
        outcome->tokens_shared += shared;
      }
    } catch (const std::bad_alloc&) {
      // Host memory itself ran out mid-append (no pool reservation covers the window and the
      // bookkeeping): the sequence of that item may hold half of it, so it is marked corrupt
      // (its reads fail with DATA_LOSS until it is deleted) rather than served.
      seqs[batch[item].sequence_id]->corrupt.store(true);
      applied = AppendError(absl::StatusCode::kResourceExhausted, item,
                            absl::StrCat(": out of memory while storing it; sequence '",
                                         batch[item].sequence_id,
                                         "' is marked corrupt (delete and re-send it)"));
    }
    int64_t reserved = estimate;
    for (Sequence* s : locked) {
      Remeasure(s, reserved);
      reserved = 0;
    }
    if (!applied.ok()) {
      // No partial sequence: one this batch created and left empty goes again.
      MutexLock l(&mu_);
      for (auto& [id, sp] : seqs) {
        Sequence* q = sp.get();
        if (!fresh.count(id)) continue;
        bool empty = true;
        for (size_t l2 = 0; l2 < q->layers.size(); ++l2)
          empty &= q->Length(static_cast<int>(l2)) == 0;
        if (empty) UnlinkLocked(q, /*drop=*/true);
      }
    }
    std::set<std::pair<std::string, int>> seen;
    for (const AppendSpec& a : batch) {
      if (!seen.insert({a.sequence_id, a.layer}).second) continue;
      Sequence* s = seqs[a.sequence_id].get();
      outcome->lengths.emplace_back(a.sequence_id, a.layer,
                                    s->Length(a.layer));
    }
    return applied;
  }
}

absl::StatusOr<std::shared_ptr<Store::Sequence>> Store::Find(const std::string& tenant,
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

#define KVQ_READ_PROLOGUE()                                                                 \
  const BasisManifest& m = s->model->manifest;                                              \
  if (layer < 0 || layer >= m.layers) {                                                     \
    return absl::InvalidArgumentError(                                                      \
        absl::StrCat("layer ", layer, " must be in 0..", m.layers - 1));                    \
  }                                                                                         \
  LayerCache* cache = s->layers[layer].get();                                               \
  if (cache == nullptr || cache->tokens() == 0) {                                           \
    return absl::FailedPreconditionError(                                                   \
        absl::StrCat("layer ", layer, " of sequence '", sequence_id, "' holds no tokens")); \
  }                                                                                         \
  *tokens = cache->tokens()

absl::Status Store::Score(const std::string& tenant, const std::string& sequence_id, int layer,
                          int basis_version, const float* q, int q_heads, int n_q, int q_dim,
                          float scale, bool corrections_only, std::vector<float>* out,
                          int64_t* tokens) {
  ASSIGN_OR_RETURN(std::shared_ptr<Sequence> s, Find(tenant, sequence_id, basis_version));
  ReaderMutexLock l(&s->mu);
  KVQ_READ_PROLOGUE();
  if (q_heads < 1 || q_heads % m.kv_heads != 0) {
    return absl::InvalidArgumentError(absl::StrCat("queries.shape[0] (q_heads) ", q_heads,
                                                   " must be a multiple of kv_heads ", m.kv_heads));
  }
  if (q_dim != m.head_dim) {
    return absl::InvalidArgumentError(
        absl::StrCat("queries head_dim ", q_dim, " must equal the model's head_dim ", m.head_dim));
  }
  out->assign(static_cast<size_t>(q_heads) * n_q * *tokens, 0.0f);
  return cache->Score(q, q_heads, n_q, out->data(), scale, corrections_only);
}

absl::Status Store::Readout(const std::string& tenant, const std::string& sequence_id, int layer,
                            int basis_version, const float* p, int q_heads, int n_q,
                            int64_t p_tokens, bool as_logits, std::vector<float>* out,
                            int64_t* tokens) {
  ASSIGN_OR_RETURN(std::shared_ptr<Sequence> s, Find(tenant, sequence_id, basis_version));
  ReaderMutexLock l(&s->mu);
  KVQ_READ_PROLOGUE();
  if (q_heads < 1 || q_heads % m.kv_heads != 0) {
    return absl::InvalidArgumentError(absl::StrCat("weights.shape[0] (q_heads) ", q_heads,
                                                   " must be a multiple of kv_heads ", m.kv_heads));
  }
  if (p_tokens != *tokens) {
    return absl::FailedPreconditionError(
        absl::StrCat("weights.shape[2] ", p_tokens, " must equal the tokens cached in layer ",
                     layer, " of sequence '", sequence_id, "' (", *tokens, ")"));
  }
  std::vector<float> soft;
  if (as_logits) {
    soft.resize(static_cast<size_t>(q_heads) * n_q * p_tokens);
    for (int64_t r = 0; r < int64_t{q_heads} * n_q; ++r) {
      Softmax(p + r * p_tokens, p_tokens, soft.data() + r * p_tokens);
    }
    p = soft.data();
  }
  out->assign(static_cast<size_t>(q_heads) * n_q * m.head_dim, 0.0f);
  return cache->Readout(p, q_heads, n_q, out->data());
}

absl::Status Store::Attend(const std::string& tenant, const std::string& sequence_id, int layer,
                           int basis_version, const float* q, int q_heads, int n_q, int q_dim,
                           const AttendOptions& ao, std::vector<float>* out, int64_t* tokens) {
  ASSIGN_OR_RETURN(std::shared_ptr<Sequence> s, Find(tenant, sequence_id, basis_version));
  // Observing attends update the window's A^2 statistics: exclusive.
  std::optional<MutexLock> wl;
  std::optional<ReaderMutexLock> rl;
  if (ao.observe) {
    wl.emplace(&s->mu);
  } else {
    rl.emplace(&s->mu);
  }
  KVQ_READ_PROLOGUE();
  if (q_heads < 1 || q_heads % m.kv_heads != 0) {
    return absl::InvalidArgumentError(absl::StrCat("queries.shape[0] (q_heads) ", q_heads,
                                                   " must be a multiple of kv_heads ", m.kv_heads));
  }
  if (q_dim != m.head_dim) {
    return absl::InvalidArgumentError(
        absl::StrCat("queries head_dim ", q_dim, " must equal the model's head_dim ", m.head_dim));
  }
  if (ao.causal_offset < -1 || ao.causal_offset >= *tokens) {
    return absl::InvalidArgumentError(absl::StrCat("causal_offset ", ao.causal_offset,
                                                   " must be in 0..", *tokens - 1, " (or absent)"));
  }
  out->assign(static_cast<size_t>(q_heads) * n_q * m.head_dim, 0.0f);
  return cache->Attend(q, q_heads, n_q, ao, out->data());
}

absl::Status Store::Decode(const std::string& tenant, const std::string& sequence_id, int layer,
                           int basis_version, std::vector<float>* keys, std::vector<float>* values,
                           int64_t* tokens) {
  int64_t first = 0;
  return Decode(tenant, sequence_id, layer, basis_version, 0, -1, keys, values, tokens, &first);
}

namespace {
// Layer `layer` of `s`, whose lock the caller holds (null while nothing was appended to it);
// INVALID_ARGUMENT outside the model's layers.
absl::StatusOr<LayerCache*> LayerAt(const Store::Sequence& s, int layer)
    ABSL_NO_THREAD_SAFETY_ANALYSIS {
  const int layers = s.model->manifest.layers;
  if (layer < 0 || layer >= layers) {
    return absl::InvalidArgumentError(absl::StrCat("layer ", layer, " must be in 0..", layers - 1));
  }
  return s.layers[layer].get();
}
}  // namespace

absl::Status Store::Decode(const std::string& tenant, const std::string& sequence_id, int layer,
                           int basis_version, int64_t from, int64_t to, std::vector<float>* keys,
                           std::vector<float>* values, int64_t* tokens, int64_t* first) {
  if (from < 0) return absl::InvalidArgumentError(absl::StrCat("from ", from, " must be >= 0"));
  ASSIGN_OR_RETURN(std::shared_ptr<Sequence> s, Find(tenant, sequence_id, basis_version));
  ReaderMutexLock l(&s->mu);
  ASSIGN_OR_RETURN(LayerCache* cache, LayerAt(*s, layer));
  if (cache == nullptr) {
    *tokens = 0;
    *first = 0;
    keys->clear();
    values->clear();
    return absl::OkStatus();
  }
  const int64_t T = cache->tokens();
  *tokens = T;
  const int64_t end = to < 0 ? T : std::min(to, T);
  *first = std::min(from, end);
  if (*first == 0 && end == T) RETURN_IF_ERROR(cache->VerifyAll());  // all before any
  return cache->Decode(*first, end, keys, values);  // verifies every block it reads
}

absl::Status Store::VerifyLayer(const std::string& tenant, const std::string& sequence_id,
                                int layer, int basis_version) {
  ASSIGN_OR_RETURN(std::shared_ptr<Sequence> s, Find(tenant, sequence_id, basis_version));
  ReaderMutexLock l(&s->mu);
  ASSIGN_OR_RETURN(LayerCache* cache, LayerAt(*s, layer));
  return cache == nullptr ? absl::OkStatus() : cache->VerifyAll();
}

absl::StatusOr<SequenceInfo> Store::Describe(const std::string& tenant,
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

absl::StatusOr<int64_t> Store::Delete(const std::string& tenant, const std::string& sequence_id) {
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

UsageStats Store::TenantUsage(const std::string& tenant) const {
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

UsageStats Store::TotalUsage() const {
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

std::vector<std::pair<std::string, UsageStats>> Store::AllTenants() const {
  std::vector<std::string> names;
  {
    MutexLock l(&mu_);
    for (const auto& [name, t] : tenants_) names.push_back(name);
  }
  std::vector<std::pair<std::string, UsageStats>> out;
  for (const auto& n : names) out.emplace_back(n, TenantUsage(n));
  return out;
}

int64_t Store::LiveSequences(const std::string& model, int version) const {
  MutexLock l(&mu_);
  int64_t n = 0;
  for (const Sequence* s : lru_) {
    n += s->model->manifest.model == model && s->model->manifest.version == version;
  }
  return n;
}

int64_t Store::Sweep() {
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

int64_t Store::Scrub() {
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

LayerCache* Store::LayerForTest(const std::string& tenant, const std::string& sequence_id,
                                int layer) {
  absl::StatusOr<std::shared_ptr<Sequence>> s = Find(tenant, sequence_id, 0);
  if (!s.ok()) return nullptr;
  ReaderMutexLock l(&(*s)->mu);
  if (layer < 0 || layer >= static_cast<int>((*s)->layers.size())) return nullptr;
  return (*s)->layers[layer].get();
}

}  // namespace kvq::core
