// The block store: tenants, sequences and their per-layer caches, capacity and eviction
// (the model registry they are pinned to: registry.h). No gRPC here: the server translates
// to and from it.
//
// * A tenant is a namespace: a sequence id means a different sequence in each tenant, and no
//   call taking a tenant ever reads, reports or evicts another tenant's data beyond what the
//   eviction rule below allows.
// * A sequence is created by its first append, which names a model (and optionally a basis
//   version; 0 = the latest at that moment). It is pinned to that version for its life:
//   registering a new version never changes it, and a read naming another version fails
//   with FAILED_PRECONDITION.
// * Appends carry their start position. Every stored token keeps a 64-bit hash of the bytes
//   it arrived as (8 bytes per token and layer, counted in the usage), so a re-sent range is
//   compared token by token: identical bytes are a duplicate (accepted, nothing changes),
//   different bytes are ALREADY_EXISTS, and a start beyond the stored length is
//   FAILED_PRECONDITION. Appends straddling the end store only the new suffix.
// * A batch of appends (one PutBlocks message) is validated whole before anything is stored.
// * Capacity: usage is the bytes of the codes, the full-precision window and the token
//   hashes. When a write would exceed the capacity or its tenant's quota, least-recently-used
//   whole sequences are evicted (whole sequences, so no suffix outlives its prefix). Over
//   the quota, the writing tenant's own LRU sequences go. Over the capacity, the LRU
//   sequence among tenants holding more than an equal share (capacity / active tenants)
//   goes first, then the writer's own; a tenant within its equal share is never evicted by
//   another. A write that still cannot fit fails with RESOURCE_EXHAUSTED and evicts and
//   stores nothing.
//
// * Prefix sharing (inside a tenant only): an append may carry the token ids of its tokens.
//   While every append of a layer carries them, the layer's encoded groups are sealed
//   blocks indexed by a chained 128-bit hash: XXH3-128 over (previous key, the group's G
//   token ids), starting from a seed over model, basis version and fingerprint, codec
//   settings and layer. A sealed group whose key is already indexed is replaced by the
//   indexed block (stored once, counted once, held by reference). An append at the end of a
//   layer whose every token is sealed first takes the longest indexed run of whole groups
//   from the index instead of encoding it (at most the groups the append would have encoded
//   anyway, so the window R stays at arrival precision); an append with token ids and no
//   keys or values attaches that run only, and reports how far it got.
// * Retained prefixes: when a sequence is deleted or expires, its indexed blocks stay as a
//   prefix cache (StoreOptions::retain_prefixes) until room is needed or they idle past the
//   TTL. Under pressure they go first, least recently used first and each with every block
//   that extends it (never a suffix without its prefix); they may go even when the write
//   that needed the room then fails, being a cache. An evicted sequence's blocks that no
//   other sequence uses go with it.
//
// Thread safety: every method may be called concurrently. Each sequence has its own lock
// (reads share it; appends and observing Attends take it exclusively).
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "kvq/core/basis.h"
#include "kvq/core/byte_pool.h"
#include "kvq/core/cache.h"
#include "kvq/core/codec.h"
#include "kvq/core/registry.h"
#include "kvq/core/tensor.h"
#include "kvq/kernels/device.h"

namespace kvq::core {

struct StoreOptions {
  // Where every sequence's encoded blocks live (SharedBytePool(kPinned) for pinned host
  // memory); null: host memory. Must outlive the store. Windows stay in host memory.
  BytePool* byte_pool = nullptr;
  // Where Attend's part over the encoded blocks runs (attend_backend.h; AttendOptions::backend
  // when a call names none): the CUDA attend for a GPU store, its host stand-in in tests;
  // null: the CPU kernels. It must read memory of byte_pool's kind and outlive the store.
  const AttendBackend* attend_backend = nullptr;
  // Total bytes of all tenants; 0 = unlimited (not recommended outside tests).
  int64_t capacity_bytes = 0;
  // Bytes one tenant may hold; 0 = no per-tenant limit (only the capacity).
  int64_t tenant_quota_bytes = 0;
  // Sequences untouched for this long are dropped by Sweep(); zero = never.
  absl::Duration ttl = absl::ZeroDuration();
  // Largest number of tokens one layer of one sequence may hold (a sanity limit).
  int64_t max_tokens_per_layer = int64_t{1} << 20;
  // Keep the indexed prefix blocks of deleted and expired sequences (see above).
  bool retain_prefixes = true;
  // Clock, replaceable in tests.
  std::function<absl::Time()> now = [] { return absl::Now(); };
};

// One positioned append: tokens [start, start + n) of `layer` of a sequence. Views stay
// owned by the caller for the duration of the call.
struct AppendSpec {
  std::string sequence_id;
  int layer = 0;
  int64_t start = 0;
  TensorView keys;                       // [kv_heads][n][head_dim]
  TensorView values;                     // [kv_heads][n][head_dim], same dtype as keys
  const float* probe_weights = nullptr;  // [kv_heads][n] or null
  // Encoded groups (a client's encoder, encoded_groups.h), or null. With them the append holds
  // their groups from `start` on (a multiple of G; the run's first_group is ignored, and groups < 0
  // means as many as its sizes hold), then the rows of keys and values (which may then be absent)
  // after them. The run must start at or before the layer's encoded end: groups the layer holds
  // already must be the same bytes (else ALREADY_EXISTS), window rows the run covers are replaced
  // by it (the sender's encoding of rows it sent). It must be the first append of its layer in a
  // batch. Checked whole (CheckEncodedGroups) before anything is stored.
  const EncodedGroupsView* encoded = nullptr;
  // Token ids of the n tokens (or empty): enables prefix sharing. With keys and values
  // absent (rank 0), an attach: the ids name the tokens to take from the prefix index.
  std::span<const uint32_t> token_ids;
  // Creation (ignored for an existing sequence unless set, then checked):
  std::string model;
  int basis_version = 0;
  bool has_codec = false;  // codec below overrides the model's defaults (creation only)
  CodecOptions codec;
};

struct AppendOutcome {
  int64_t tokens_written = 0;
  int64_t tokens_duplicate = 0;
  // Tokens taken from the prefix index instead of being encoded (included in neither
  // count above).
  int64_t tokens_shared = 0;
  // (sequence, layer) -> tokens after the batch.
  std::vector<std::tuple<std::string, int, int64_t>> lengths;
};

// A prompt to match against a tenant's prefix index (Store::IndexedPrefixTokens): the
// creation fields of the sequence it would be attached to (AppendSpec's) and its token ids.
struct PrefixProbe {
  std::string model;
  int basis_version = 0;
  bool has_codec = false;
  CodecOptions codec;
  std::span<const uint32_t> token_ids;
};

struct SequenceInfo {
  std::shared_ptr<const ModelEntry> model;
  CodecOptions codec;
  std::vector<int64_t> layer_tokens;
  int64_t bytes = 0;
};

struct UsageStats {
  int64_t sequences = 0;
  int64_t tokens = 0;  // per head, summed over layers and sequences
  int64_t bytes = 0;
  int64_t blocks = 0;  // encoded blocks (one per G tokens, KV head and K or V)
  int64_t evictions = 0;
  int64_t expirations = 0;
  // Prefix index: indexed blocks and their bytes (counted once however many sequences hold
  // them; included in `bytes`), of which retained (held by no sequence); tokens taken from
  // the index since start.
  int64_t prefix_blocks = 0;
  int64_t prefix_bytes = 0;
  int64_t retained_bytes = 0;
  int64_t shared_tokens = 0;
  // Byte sums over everything counted (valid across models of different shapes).
  SizeReport size;
  int64_t elements = 0;  // cached K (or V) elements: tokens x kv_heads x head_dim
  // Effective bits per element at this moment, 0 when empty: blocks, window and the fp16
  // sink rows (16 bits per element, once per sequence), as SizeReport::k_bits_effective and
  // docs/CODEC.md count them and `bytes` holds them.
  double k_bits() const {
    return elements ? 8.0 * (size.key_block_bytes + size.key_window_bytes + size.key_sink_bytes) /
                          elements
                    : 0.0;
  }
  double v_bits() const {
    return elements
               ? 8.0 * (size.value_block_bytes + size.value_window_bytes + size.value_sink_bytes) /
                     elements
               : 0.0;
  }
};

// The layer a read reads: a sequence of the tenant, and the basis version it must be pinned to
// (0: any). The strings are the caller's; they must outlive the call.
struct LayerRef {
  const std::string& tenant;
  const std::string& sequence_id;
  int layer = 0;
  int basis_version = 0;
};

// A range of a layer's tokens: [from, to), to < 0 meaning the layer's end.
struct TokenRange {
  int64_t from = 0;
  int64_t to = -1;
};

// What a range read found: the layer's length, and the position of the first token returned.
struct RangeRead {
  int64_t tokens = 0;
  int64_t first = 0;
};

// A read's rows, fp32 [q_heads][n_q][width]: queries (width head_dim) or attention weights
// (width the layer's tokens).
struct ReadRows {
  const float* data = nullptr;
  int q_heads = 0;
  int n_q = 0;
  int64_t width = 0;
};

class StoreImpl;

class Store {
 public:
  Store(StoreOptions opts, Registry* registry);
  ~Store();
  Store(const Store&) = delete;
  Store& operator=(const Store&) = delete;

  const StoreOptions& options() const;

  // Validates every append, then applies them in order. Error messages start with
  // "appends[i]" (the index in `batch`) and name the field and the limit.
  absl::Status Append(const std::string& tenant, const std::vector<AppendSpec>& batch,
                      AppendOutcome* outcome);

  // The reads. Each reads one layer (`at`) that holds tokens, under the sequence's reader
  // lock (Attend with observe: its writer lock), and returns how many tokens it read (T).
  //
  // Score: logits of the queries q ([q_heads][n_q][head_dim]) over every cached token,
  // out [q_heads][n_q][T].
  absl::StatusOr<int64_t> Score(const LayerRef& at, const ReadRows& q, float scale,
                                bool corrections_only, std::vector<float>* out);
  // Readout: the rows' weights p ([q_heads][n_q][width], width the layer's tokens) over the
  // values, softmaxed first when as_logits; out [q_heads][n_q][head_dim].
  absl::StatusOr<int64_t> Readout(const LayerRef& at, const ReadRows& p, bool as_logits,
                                  std::vector<float>* out);
  // Attend: score, softmax and readout fused; out [q_heads][n_q][head_dim].
  absl::StatusOr<int64_t> Attend(const LayerRef& at, const ReadRows& q, const AttendOptions& ao,
                                 std::vector<float>* out);
  // The range reads. Each reads tokens [range.from, range.to) of one layer (`at`; to < 0: to
  // the end; both clamped to the layer's tokens) under the sequence's reader lock, and returns
  // the layer's length and the position of the first token returned (RangeRead). Only the
  // blocks the range touches are read, and each is verified first (DATA_LOSS on a mismatch);
  // a range of the whole layer verifies every block before reading any. A layer never
  // appended reads as empty.
  //
  // Decode: keys as attention sees them and decoded values, [kv_heads][n][d] fp32 each.
  absl::StatusOr<RangeRead> Decode(const LayerRef& at, TokenRange range, std::vector<float>* keys,
                                   std::vector<float>* values);
  // DecodeAs: the same in `dtype` (kF32, kF16 or kBF16), each value the fp32 decode's rounded
  // to nearest even (LayerCache::DecodeAs): decoded straight into the bytes GetBlocks sends,
  // with no fp32 copy of the range in between.
  absl::StatusOr<RangeRead> DecodeAs(const LayerRef& at, TokenRange range, DType dtype,
                                     std::vector<uint8_t>* keys, std::vector<uint8_t>* values);
  // ReadEncoded: the range in codes (GetBlocks in codes): the encoded groups it touches,
  // copied out (and the sinks' rows with group 0), then the window rows it touches in `dtype`
  // (as DecodeAs). `first` is `from` rounded down to its group's start when it falls in an
  // encoded group.
  absl::StatusOr<RangeRead> ReadEncoded(const LayerRef& at, TokenRange range, DType dtype,
                                        EncodedGroups* groups, std::vector<uint8_t>* keys,
                                        std::vector<uint8_t>* values);
  // Every block of the layer's checksum (DATA_LOSS on a mismatch), reading none out: what a
  // reader that will take the whole layer in parts checks before sending the first.
  absl::Status VerifyLayer(const LayerRef& at);

  absl::StatusOr<SequenceInfo> Describe(const std::string& tenant, const std::string& sequence_id);
  // The tokens an attach of probe.token_ids to a new sequence would take from the tenant's
  // prefix index now, in every layer (the fewest over layers; whole groups, never the
  // window), read-only: nothing is held, touched or created. Errors name the probe's fields
  // as an append's creation fields are named ("model", "codec.rank", ...).
  absl::StatusOr<int64_t> IndexedPrefixTokens(const std::string& tenant, const PrefixProbe& probe);
  // Returns the bytes freed; NOT_FOUND when the tenant has no such sequence.
  absl::StatusOr<int64_t> Delete(const std::string& tenant, const std::string& sequence_id);

  UsageStats TenantUsage(const std::string& tenant) const;
  UsageStats TotalUsage() const;
  // Per-tenant usage (for metrics only; never returned to a tenant).
  std::vector<std::pair<std::string, UsageStats>> AllTenants() const;
  // Live sequences pinned to (model, version), all tenants.
  int64_t LiveSequences(const std::string& model, int version) const;

  // Drops sequences idle longer than the TTL; returns how many.
  int64_t Sweep();
  // What DropAll took away.
  struct Dropped {
    int64_t sequences = 0;
    int64_t bytes = 0;  // sequences and prefix index together
  };
  // Drops every sequence of every tenant and every prefix-index group (held or retained), as
  // if the store had restarted: afterwards reads of any sequence are NOT_FOUND and no append
  // can attach an old prefix. For a shard that has been cut off and may hold stale copies
  // (kvq-server --drop-after-probe-gap). Counted apart from evictions and expirations.
  // A write in flight meanwhile finishes on its unlinked sequence (as after a Delete); one
  // that starts after the drop creates a new sequence.
  Dropped DropAll();
  // Verifies every stored block's checksum; returns the number of sequences that failed
  // (they are kept: reads of them fail with DATA_LOSS). Retained prefix groups that fail are
  // dropped (with their extensions) and counted in RetainedScrubDrops().
  int64_t Scrub();
  int64_t RetainedScrubDrops() const;

  // Test seam: the LRU-list steps the last eviction plan took (linear in the sequences).
  int64_t LastEvictionPlanStepsForTest() const;
  // Test seam: the layer cache of a sequence (null when absent). Not for production use.
  LayerCache* LayerForTest(const std::string& tenant, const std::string& sequence_id, int layer);

 private:
  std::unique_ptr<StoreImpl> impl_;  // core/src/store/store_impl.h: the locks, maps and LRU list
};

}  // namespace kvq::core
