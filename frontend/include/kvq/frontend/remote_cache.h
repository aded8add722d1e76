// RemoteCache: the AttentionCache of one sequence held by kvq servers, through the C++ client
// library (kvq_client), as a serving frontend uses the service.
//
// Per forward call and layer, AppendAndAttend sends the chunk's post-RoPE keys and values
// (explicit start position, rounded to fp16 as CodecCache rounds them) and then asks for the
// chunk's attention. Codes on the wire (Options::codes, on by default where the model's codes
// are known: RemoteModel::codes): each layer keeps a client::LayerEncoder, and an append whose
// new rows complete groups goes as those groups' HeadQ codes plus the rows after them (a
// prefill chunk), one that completes none as fp16 rows (a decode step: the server encodes the
// groups it completes into the same bytes). Either way the server holds the same blocks, so
// reads do not depend on the form. Rows go as fp16 for the A^2 value policy (its widths follow
// what the server observes), keys-only configurations, and sequences started by AttachPrefix.
// The chunk's attention:
//   * kv configurations: Attend (score, softmax and readout fused server-side, causal offset
//     = the chunk's start; observe=true only for the A^2 value policy, whose widths come from
//     the readouts the server observes, exactly as CodecCache's fused path does);
//   * keys-only configurations (values kept fp16): Score on the server, then the causal
//     softmax and the readout over fp16 values kept here, as CodecCache's keys-only path does.
// Queries travel as fp32, outputs come back as fp32, so the only difference from the
// in-process CodecCache is float summation order.
//
// Batching across sequences: caches that share one RemoteBatcher are decoded in lockstep by
// one thread each (the LlamaModel driver runs one sequence per call). Each AppendAndAttend
// parks its request in the batcher; when every joined cache has one parked, the last one to
// arrive sends ONE PutBlocks message holding all their appends and ONE Attend (or Score)
// call holding all their items, then wakes the others. Within one token, layer l+1's query
// depends on layer l's output, so batches run across sequences, never across layers.
//
// The sequence is created by its first append (model, basis version and every codec field
// explicit, so the server's model defaults do not matter). Not thread-safe per cache; a
// RemoteBatcher is shared by the threads of its caches.
//
// Prefix sharing (Options::share; docs/API.md "Prefix sharing"): every append carries the
// token ids of its tokens (given with SetTokenIds / AddTokenIds before the forward pass
// reaches them), so the server seals the sequence's whole groups of G tokens, indexes them per
// tenant and stores each group once; and AttachPrefix starts an empty sequence from the
// tenant's index without data (every layer at once), after which the forward pass runs only
// over the tokens the server lacked, their attention reading the attached groups through the
// server. An attached group is the bytes another request stored for the same ids, so reads
// equal a self-prefilled sequence's exactly when the K/V of those tokens are the same bytes:
// a deterministic forward pass over the same tokens cut into the same chunks (llama.h).
#pragma once

#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kvq/client/client.h"
#include "kvq/client/codes.h"
#include "kvq/core/basis.h"
#include "kvq/core/codec.h"
#include "kvq/frontend/attention_cache.h"
#include "kvq/v1/kvq.pb.h"

namespace kvq::frontend {

// A model entry on the servers that sequences name at creation.
struct RemoteModel {
  std::string model;
  int version = 1;
  // Its encoder and decoder (from GetBasis) when codes go on the wire; null: rows only, for
  // the reason in rows_reason (not asked for, or the server does not take this client's
  // block-format versions).
  std::shared_ptr<const client::ModelCodes> codes;
  std::string rows_reason;
};

// Registers the model (with `basis`, or without one when basis is null: rank-0 codecs only)
// on every server of the client. `name` overrides the entry name (default: the basis
// manifest's model, or "kvq-frontend-<layers>x<kv_heads>x<head_dim>" without a basis).
// Idempotent: an identical entry already registered is used as is; a different entry under
// the same (name, version) is ALREADY_EXISTS (register under another name). codes: also fetch
// the entry's basis (GetBasis) for codes on the wire, when the server's block-format versions
// overlap this client's (ModelInfo.block_version_min/max).
absl::StatusOr<RemoteModel> RegisterRemoteModel(client::Client& client, const CacheShape& shape,
                                                const core::ModelBasis* basis,
                                                const std::string& name = "", bool codes = true);

// Counters of a batcher (all its caches together).
struct RemoteStats {
  // flushes: one read call each (an Attend, or for keys-only a Score, whose items carry
  // their appends)
  int64_t batches = 0;
  int64_t attach_rpcs = 0;      // AttachPrefix PutBlocks calls (retries included)
  int64_t tokens_attached = 0;  // per layer, summed over the caches' AttachPrefix calls
  int64_t items = 0;            // (sequence, layer) items sent
  int64_t put_rpcs = 0, attend_rpcs = 0, score_rpcs = 0;
  int64_t appends_in_attend = 0;  // appends carried by Attend / Score items (no PutBlocks)
  int64_t appends_in_codes = 0;   // of those, appends sent as HeadQ codes (+ rows after them)
  double put_seconds = 0;         // wall time inside PutBlocks calls
  double read_seconds = 0;        // wall time inside Attend / Score calls
  int64_t bytes_sent = 0;         // serialized request bytes
  double rpc_seconds() const { return put_seconds + read_seconds; }
};

class RemoteCache;

// Lockstep batching of several caches' per-layer requests into one PutBlocks message and
// one Attend / Score call. Thread-safe.
class RemoteBatcher {
 public:
  explicit RemoteBatcher(client::Client* client) : client_(client) {}
  RemoteStats stats() const;

  // Internal, used by RemoteCache.
  struct Request {
    bool has_append = true;  // false: every row is held already (attached); attend only
    v1::Append append;
    bool codes = false;  // the append carries encoded groups
    bool score = false;  // keys-only: Score instead of Attend
    v1::AttendItem attend;
    v1::ScoreItem score_item;
    v1::Tensor result;  // Attend outputs or Score logits
    absl::Status status;
  };
  void Join();
  void Leave();
  absl::Status Run(Request* r);
  void RecordAttach(double seconds, int64_t bytes, int64_t tokens_attached);

 private:
  void FlushLocked();
  client::Client* client_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  int active_ = 0;
  uint64_t generation_ = 0;
  std::vector<Request*> pending_;
  RemoteStats stats_;
};

class RemoteCache : public AttentionCache {
 public:
  struct Options {
    std::string sequence_id;
    RemoteModel model;
    core::CodecOptions codec;  // as CodecCache gets it (head_dim set)
    bool keys_only = false;    // values fp16, read out here (CodecCache keys_only)
    // Prefix sharing: every append carries its tokens' ids (SetTokenIds), AttachPrefix works.
    bool share = false;
    // Codes on the wire where model.codes allows them (see the top of this file).
    bool codes = true;
  };
  // batcher: shared with the other caches decoded in lockstep, or null (a private one).
  // The cache joins the batcher now and leaves it in Finish() or its destructor.
  static absl::StatusOr<std::unique_ptr<RemoteCache>> Create(client::Client* client,
                                                             RemoteBatcher* batcher,
                                                             const CacheShape& shape,
                                                             Options options);
  ~RemoteCache() override;

  // Unlike the other caches, start may lie before tokens(layer) when the rows from start on
  // are held already (attached, AttachPrefix): those rows' K/V are not sent again (the held
  // ones are used), their queries attend as usual. This lets a frontend resume after an
  // attach at the start of the chunk that holds the attach point, so that every new row is
  // computed in exactly the chunk it would be computed in when prefilling from token 0
  // (PrefillRemote): the BLAS row results depend on the chunk's shape, not only on its rows.
  absl::Status AppendAndAttend(int layer, const float* k, const float* v, int64_t start, int n,
                               const float* q, float* out) override;
  int64_t tokens(int layer) const override { return tokens_[layer]; }
  // Same encode schedule as the server's LayerCache (and CodecCache): a group of G tokens is
  // encoded once more than R + G - 1 wait at arrival precision.
  int64_t NextEncodeBoundary(int64_t tokens) const override;
  int64_t EncodeGroup() const override { return o_.codec.key_group; }

  // Leaves the batcher (so that the other caches stop waiting for this one) and, when
  // delete_sequence, drops the sequence on the server. Idempotent.
  absl::Status Finish(bool delete_sequence = true);
  const std::string& sequence_id() const { return o_.sequence_id; }
  RemoteBatcher& batcher() { return *batcher_; }

  // share: the token ids of the sequence from position 0 (SetTokenIds replaces, AddTokenIds
  // extends, e.g. with each decoded token). An append of tokens whose ids were not given
  // fails (FAILED_PRECONDITION) before anything is sent. Ignored without share.
  void SetTokenIds(const int32_t* ids, int64_t n);
  void AddTokenIds(const int32_t* ids, int64_t n);
  int64_t token_ids_given() const { return static_cast<int64_t>(ids_.size()); }

  // share, on a cache holding no token: attaches the longest indexed run of whole groups of
  // the first `max_tokens` given ids (-1: all given) from the tenant's prefix index, for
  // every layer in one PutBlocks message without data (this creates the sequence). Returns
  // the tokens attached per layer: a multiple of G, possibly 0; every layer then holds that
  // many and the forward pass continues there. The forward pass advances all layers
  // together, so when the server's answers differ between layers (part of the index was
  // evicted meanwhile) the sequence is dropped and the attach repeated up to the shortest.
  // Keys-only configurations cannot attach (their values live in the frontend):
  // FAILED_PRECONDITION. The call goes straight to the server, outside the batcher.
  absl::StatusOr<int64_t> AttachPrefix(int64_t max_tokens = -1);

 private:
  RemoteCache(client::Client* client, RemoteBatcher* batcher, const CacheShape& s, Options o)
      : client_(client), batcher_(batcher), s_(s), o_(std::move(o)) {}
  // Codes on the wire: feeds the append's fp16 rows [at, at + m) of `layer` to its encoder and
  // rewrites req->append in codes when they complete groups (start then before `at`).
  absl::Status Encode(int layer, int64_t at, int m, RemoteBatcher::Request* req);
  client::Client* client_;
  std::unique_ptr<RemoteBatcher> own_batcher_;
  RemoteBatcher* batcher_;
  CacheShape s_;
  Options o_;
  v1::CodecSettings wire_codec_;
  bool joined_ = false, finished_ = false;
  bool created_ = false;  // an append or attach reached the server (Finish deletes it)
  std::vector<int64_t> tokens_;
  std::vector<uint32_t> ids_;                // share: token ids from position 0
  std::vector<std::vector<float>> dense_v_;  // keys_only: per layer [tokens][kv_heads][d]
  // Codes on the wire: per layer, the encoder of the rows sent so far (null: rows only; made
  // by the layer's first append at token 0, dropped when an append fails).
  bool encode_ = false;
  std::vector<std::unique_ptr<client::LayerEncoder>> encoders_;
};

}  // namespace kvq::frontend
