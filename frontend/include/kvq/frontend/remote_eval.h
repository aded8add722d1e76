// Perplexity with the KV cache held by kvq servers, decoding token by token as a serving
// frontend does (kvq-eval --kv remote=ADDR).
//
// Same protocol and numbers as EvaluatePerplexity (perplexity.h): windows of L tokens, each a
// fresh sequence, the second half scored. The difference is the path: every window is decoded
// one token per forward call (n = 1), so that each query sees exactly what a decoding
// frontend's query sees, and per step and layer the new token's K and V are appended
// (PutBlocks) and its attention read (Attend; Score for keys-only configurations) through
// RemoteCache. Up to `batch` windows are decoded at once, one thread each, in lockstep through
// one RemoteBatcher: one PutBlocks message and one Attend call per layer step carry all of
// them. Its perplexity equals the in-process decode-faithful run's up to float summation
// order (the server's fused attend vs local BLAS).
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "kvq/client/client.h"
#include "kvq/frontend/perplexity.h"
#include "kvq/frontend/remote_cache.h"

namespace kvq::frontend {

struct RemoteEvalOptions {
  client::Client* client = nullptr;
  // Windows decoded concurrently (one thread each, batched per layer step).
  int batch = 8;
  // Sequence ids are <prefix>-<config>-w<window>; unique per run by default (pid and time).
  std::string sequence_prefix;
  // Model entry names: the basis manifest's model, plus "-random" / "-centred" / "-resw" for
  // the control bases (each is its own registry entry). Empty: defaults.
  std::string model_name;
  // Delete each window's sequence when it is done.
  bool delete_sequences = true;
  // false (default): token by token, one forward call per token, as a serving frontend
  // decodes. true: the in-process driver's decode-faithful chunks (ForwardDecodeFaithful:
  // chunks cut at the encode boundaries), so that every K/V bit the server encodes is the
  // bit the in-process run encodes. Both give each query the cache it would see while
  // decoding; they differ only in float rounding of the forward pass (BLAS over n rows vs
  // one), which low-bit rounding decisions amplify (see docs/RESULTS.md).
  bool chunks = false;
  // true (and chunks false): each window's unscored first half in one forward call (a prompt's
  // prefill, whose K/V go as HeadQ codes with codes on), then token by token.
  bool prefill = false;
  // Prefix sharing (kvq-eval --kv remote=ADDR,share): every append carries its token ids,
  // and each window first attaches whatever the tenant's prefix index holds of its unscored
  // first half (whole groups of G; tokens [0, L/2) need no logits), then runs the forward
  // pass from there. Windows of one text rarely share a prefix; a second run over the same
  // text on the same server attaches what the first one left (retained prefixes).
  bool share = false;
  // Codes on the wire (RemoteCache::Options::codes) where the server takes them.
  bool codes = true;
};

struct RemoteEvalStats {
  int64_t decode_steps = 0;     // tokens decoded (one forward call of one token), all windows
  int64_t tokens_attached = 0;  // share: tokens per layer taken from the prefix index
  int64_t lockstep_steps = 0;   // batched steps (one token of every window in the batch)
  double decode_seconds = 0;    // wall time of the decoding loops
  RemoteStats rpc;              // summed over batches
  double k_bits_server = 0, v_bits_server = 0;  // effective bits the server reported (Stats)
  RemoteModel model;
  double steps_per_second() const { return decode_seconds > 0 ? decode_steps / decode_seconds : 0; }
  double rpc_share() const { return decode_seconds > 0 ? rpc.rpc_seconds() / decode_seconds : 0; }
};

// One request's prefill through a RemoteCache, as a serving frontend runs it: with `attach`
// (the cache made with share) the longest indexed run of whole groups of the tokens that
// need no logits (positions < min(logits_from, n - 1): the last token always runs, its
// logits are the first output) is attached from the tenant's prefix index, then the forward
// pass runs over the rest in decode-faithful chunks (ForwardDecodeFaithful), every query
// attending through the server over the attached groups too. It resumes at the start of the
// chunk that holds the attach point (up to G - 1 attached rows recomputed, not re-sent), so
// that each new row is computed in the same chunk as in a prefill from token 0: the logits
// are then bit for bit those of prefilling everything, whenever the attached groups hold the
// bytes this prefill would have computed (their first request ran the same chunks over the
// same tokens). The cache must be empty; the token ids are given to it here. logits: rows
// [logits_from, n), [n - logits_from][vocab].
struct RemotePrefill {
  int64_t attached = 0;        // tokens per layer taken from the index
  double attach_seconds = 0;   // the attach call(s)
  double forward_seconds = 0;  // the forward pass over the rest (PutBlocks + Attend inside)
};
absl::StatusOr<RemotePrefill> PrefillRemote(const LlamaModel& model, RemoteCache* cache,
                                            const int32_t* tokens, int n, int logits_from,
                                            std::vector<float>* logits, bool attach);

// config must not be dense (the server always encodes). The result's bit figures: k_bits_ctx
// and v_bits_ctx from the server's Stats at the end of each batch (effective, window
// included; 16 for keys-only values), steady-state figures computed from the codec options.
absl::StatusOr<PerplexityResult> EvaluatePerplexityRemote(
    const LlamaModel& model, const std::vector<int32_t>& tokens, int windows, int window_len,
    const EvalConfig& config, BasisSet* bases, const RemoteEvalOptions& options,
    RemoteEvalStats* stats, const std::function<void(int window)>& on_window = nullptr);

}  // namespace kvq::frontend
