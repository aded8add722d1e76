// The compressed KV cache of one attention layer of one sequence: encoded blocks of G tokens
// per KV head, plus the full-precision window (the incomplete group and the R most recent
// tokens) kept in the dtype it arrived in. Score, readout and attend read both.
//
// Shapes: keys/values [kv_heads][n][d]; queries [q_heads][n_q][d] fp32 contiguous with
// q_heads a multiple of kv_heads (query head h reads KV head h / (q_heads / kv_heads)).
// Logits and attention weights are [q_heads][n_q][tokens()].
//
// Thread safety: const methods may run concurrently; Append/Attend(observe) need exclusion.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kvq/core/attend_options.h"
#include "kvq/core/codec.h"
#include "kvq/core/encoded_groups.h"
#include "kvq/core/sealed_block.h"
#include "kvq/core/tensor.h"

namespace kvq::core {

// Checks that every element of `t` ([heads][n][d]) is finite and within
// +-kMaxStorableMagnitude (codec.h), naming the first that is not as name[h, j, c]. Append
// checks its own rows; a caller applying several appends checks them all first with it.
absl::Status CheckStorable(const TensorView& t, absl::string_view name);

struct SizeReport {
  int64_t tokens = 0;              // cached tokens per head
  int64_t encoded_tokens = 0;      // tokens in encoded blocks
  int64_t window_tokens = 0;       // tokens held at arrival precision
  int64_t elements_per_token = 0;  // kv_heads * head_dim (of the first shape summed)
  // Element counts (tokens x kv_heads x head_dim), which stay right when reports of
  // different shapes are summed: the bit figures divide by these.
  int64_t elements = 0, encoded_elements = 0;
  int64_t key_block_bytes = 0, value_block_bytes = 0;
  int64_t key_window_bytes = 0, value_window_bytes = 0;
  // The attention sinks' fp16 rows (CodecOptions::fp16_sinks), held for the life of the cache.
  int64_t key_sink_bytes = 0, value_sink_bytes = 0;
  // Of the block bytes above, those in sealed blocks (which a store may share between
  // sequences and count once).
  int64_t sealed_block_bytes = 0;
  // Steady state: 8 * block bytes / encoded elements.
  double k_bits_steady() const;
  double v_bits_steady() const;
  // At this context: 8 * (block + window + sink bytes) / all cached elements.
  double k_bits_effective() const;
  double v_bits_effective() const;
  int64_t total_bytes() const {
    return key_block_bytes + value_block_bytes + key_window_bytes + value_window_bytes +
           key_sink_bytes + value_sink_bytes;
  }
  SizeReport& operator+=(const SizeReport& o);
};

// Queries sent with an append so that the A^2 value policy can weigh the new tokens before
// they are encoded (e.g. the queries of the appended positions themselves). Layout
// [q_heads][n][d] fp32; query i sees cached tokens [0, causal_offset + i] (-1: all).
struct ProbeQueries {
  const float* q = nullptr;
  int q_heads = 0;
  int n = 0;
  int64_t causal_offset = -1;
};

// What every sequence's LayerCache of one model layer and codec reads and never changes: the
// decode basis, the encoder's transposed projection and metric rounding's factors. A store
// builds them once per (model entry, layer, codec) and shares them (Store::LayerTables), so
// a sequence carries none of its own (for SmolLM2 with metric rounding they are 1.6 MB a
// sequence otherwise).
struct LayerCodecTables {
  std::vector<float> basis;     // [kv_heads][d][rank] U (or the decode basis B); empty: rank 0
  std::vector<float> basis_t;   // [kv_heads][rank][d] U^T (or A^T), for encoding
  std::vector<float> rounding;  // [kv_heads][d][d] metric rounding factors, or empty
  std::vector<float> value_rounding;  // [kv_heads][d][d] value metric rounding factors, or empty
  size_t bytes() const {
    return 4 * (basis.size() + basis_t.size() + rounding.size() + value_rounding.size());
  }
};
// The arguments as LayerCache's own constructor takes them (null basis with o.rank > 0: no
// side code).
std::shared_ptr<const LayerCodecTables> MakeLayerCodecTables(const CodecOptions& o, int kv_heads,
                                                             const float* basis,
                                                             const float* encode_basis,
                                                             const float* query_moment,
                                                             const float* value_metric = nullptr);

// How a cache's reads treat its blocks: a reader's policy, not part of the codec (LevelDB's
// ReadOptions). verify_checksums: every block a score, readout, attend or range decode touches
// is checked against its checksum first (DATA_LOSS on a mismatch); off, blocks are checked
// only when read out whole (Decode of every token, VerifyAll, the store's scrub). The store
// keeps it on; in-process evaluation, whose blocks never leave its own memory, turns it off
// for speed (checksums guard storage, not arithmetic).
struct ReadPolicy {
  bool verify_checksums = true;
};

class LayerCache {
 public:
  // basis: [kv_heads][d][rank] (row-major U per head) or null when o.rank == 0. Copied.
  // pool: where the encoded blocks live (null: host memory); it must outlive the cache and
  // every sealed block the cache made. The window stays in host memory.
  // encode_basis: the encode basis A of an oblique pair, same layout (side coefficients are
  // A^T e; basis then is the decode basis B), or null: A = U.
  // query_moment: [kv_heads][d][d] E[q q^T] per head, for CodecOptions::metric_rounding
  // (null: nearest rounding).
  // value_metric: [kv_heads][d][d] per head, M = sum over the KV head's query heads of
  // W_o,q^T W_o,q (ModelBasis::value_metric), or null. Non-null: each value token's codes are
  // rounded channel by channel with error feedback in M (the metric its error reaches the
  // layer output through) instead of to nearest; scales, zero points and the block format stay
  // the same. An encoder experiment of the evaluation tools (kvq-eval's -vmr; it did not pay,
  // docs/CODEC.md), not a codec setting: the store never passes it.
  LayerCache(const CodecOptions& o, int kv_heads, const float* basis, BytePool* pool = nullptr,
             const float* encode_basis = nullptr, const float* query_moment = nullptr,
             const float* value_metric = nullptr);
  // The same with tables built by MakeLayerCodecTables for the same codec and kv_heads
  // (shared with other caches, never copied).
  LayerCache(const CodecOptions& o, int kv_heads, std::shared_ptr<const LayerCodecTables> tables,
             BytePool* pool = nullptr);
  const std::shared_ptr<const LayerCodecTables>& tables() const { return tables_; }

  const CodecOptions& options() const { return opts_; }
  const ReadPolicy& read_policy() const { return read_; }
  void set_read_policy(ReadPolicy p) { read_ = p; }
  // Where the blocks are written and read when they are in memory the CPU reaches only by
  // copies (BytePool::cpu_readable false: device memory): on `ops`, where they lie, when it
  // reads the pool and its block ops support the codec. Groups are encoded there (only their
  // rows cross; not for metric rounding), and Score, Readout, Decode / DecodeAs and VerifyAll
  // read there (no block copied back; not for corrections-only scores). Dense-and-sparse
  // codecs, and every cache with it null, encode on the CPU and read through copies (CpuView).
  // The store sets it to its attend backend. ops must outlive the cache.
  void set_block_ops(const AttendBackend* ops) { block_ops_ = ops; }
  int kv_heads() const { return kv_heads_; }
  int64_t tokens() const { return tokens_; }

  // Appends tokens [start, start + n). k and v are [kv_heads][n][d] views of any dtype and
  // strides; start must equal tokens() (the store handles re-sends). probe_weights:
  // optional [kv_heads][n] A^2 weights predicted by the frontend (probe queries).
  absl::Status Append(const TensorView& k, const TensorView& v, int64_t start,
                      const float* probe_weights = nullptr);
  // The same, with probe queries: after the tokens join the window and before any group is
  // encoded, the probes attend over the whole cache and their p^2 is recorded on the window
  // tokens (as earlier readouts are). Only affects the A^2 value policy.
  absl::Status Append(const TensorView& k, const TensorView& v, int64_t start,
                      const ProbeQueries& probes);

  // Logits: out[h][i][t] = scale * (q . k_base + U^T q . z_hat) over every cached token
  // (scale * q . k for the fp16 sinks and window tokens).
  // corrections_only: only the HeadQ term (for frontends that score the base themselves);
  // FAILED_PRECONDITION once fp16 sinks are encoded (their blocks hold stand-ins).
  absl::Status Score(const float* q, int q_heads, int n_q, float* out, float scale = 0.0f,
                     bool corrections_only = false) const;
  // out[h][i][:] = sum_t p[h][i][t] v_hat_t ; p [q_heads][n_q][tokens()].
  absl::Status Readout(const float* p, int q_heads, int n_q, float* out) const;
  // Fused score + softmax + readout; out [q_heads][n_q][d]. ao.parts > 1 splits the tokens
  // (see AttendOptions); the parts only read the cache, the A^2 observation (ao.observe) is
  // recorded by the calling thread after the merge.
  absl::Status Attend(const float* q, int q_heads, int n_q, const AttendOptions& ao, float* out);
  // The token boundaries a split Attend into `parts` uses: p + 1 ascending values from 0 to
  // tokens(), p = min(parts, encoded groups) (at least 1); part k reads key groups
  // [floor(nb k / p), floor(nb (k + 1) / p)) of the nb encoded groups, the last part also
  // the full-precision window. Depends only on tokens(), the encoded groups and parts.
  std::vector<int64_t> AttendPartBounds(int parts) const;

  // Records attention weights computed elsewhere (a frontend that attends locally over
  // decoded K/V) as A^2 statistics for the window tokens, exactly as an observing Attend does.
  // p: [q_heads][n_q][tokens()], each row a softmax over the tokens it saw.
  absl::Status Observe(const float* p, int q_heads, int n_q);

  // Keys as attention sees them and decoded values, [kv_heads][tokens()][d] fp32.
  absl::Status Decode(std::vector<float>* keys, std::vector<float>* values) const;
  // Tokens [from, to) only, [kv_heads][to - from][d]: reads (and verifies) only the blocks
  // the range touches. OUT_OF_RANGE unless 0 <= from <= to <= tokens().
  absl::Status Decode(int64_t from, int64_t to, std::vector<float>* keys,
                      std::vector<float>* values) const;
  // The same rows in `dtype` (kF32, kF16 or kBF16: what GetBlocks sends), [kv_heads][to -
  // from][d] elements of DTypeSize(dtype) bytes each, every value the fp32 decode's rounded to
  // nearest even. Decoded a group at a time through an L1-sized scratch, so that only the
  // output's own bytes go to memory (half of the fp32 decode's for fp16).
  absl::Status DecodeAs(int64_t from, int64_t to, DType dtype, std::vector<uint8_t>* keys,
                        std::vector<uint8_t>* values) const;
  // Verifies every block's checksum (scrub).
  absl::Status VerifyAll() const;

  SizeReport Size() const;
  // What the cache takes besides the block and window bytes Size() counts: the object, its
  // heads and their bookkeeping vectors (and the window's unused capacity). The block
  // vectors' reserve is not included (docs/API.md: stored bytes are counted).
  int64_t OverheadBytes() const;
  // What OverheadBytes() is at least for a new cache of kv_heads heads, before its first
  // append (the object and its heads): what a store reserves for a layer an append creates.
  static int64_t NewOverheadBytes(int kv_heads);

  // Prefix sharing. A cache stores its leading encoded groups as SealedBlocks while sealing
  // is on and it holds no unsealed block yet; once a group is encoded unsealed (sealing
  // off), every later group is unsealed too. Sealing is off by default.
  void set_sealing(bool on) { sealing_ = on; }
  const std::vector<SealedBlockPtr>& sealed() const { return sealed_; }
  // True when every cached token is in a sealed block (no unsealed block, empty window):
  // the only state in which AttachSealed may extend the cache.
  bool AllSealed() const;
  // Appends encoded groups made by a cache with the same options and basis (the caller
  // guarantees it, e.g. by a hash over model, basis and codec settings). Requires
  // AllSealed(). Each block's layout and headers are checked; nothing changes on error.
  absl::Status AttachSealed(std::span<const SealedBlockPtr> blocks);
  // Replaces sealed block b by an identical-by-construction block (same tokens, options and
  // basis) that another cache made, so that both share one copy.
  absl::Status ReplaceSealed(int64_t b, SealedBlockPtr block);

  // Codes in and out (PutBlocks and GetBlocks in codes). Tokens [0, encoded_tokens()) are in
  // encoded groups, the rest in the full-precision window.
  int64_t encoded_tokens() const { return encoded_; }
  // Copies groups [g0, g1) out, each block's checksum and the sinks' verified first (DATA_LOSS
  // on a mismatch), with the sinks' rows when g0 == 0. OUT_OF_RANGE unless 0 <= g0 <= g1 <=
  // encoded groups.
  absl::Status ExportGroups(int64_t g0, int64_t g1, EncodedGroups* out) const;
  // Appends a run encoded elsewhere with the same options and basis (a client's encoder),
  // which the caller has checked with CheckEncodedGroups: run.first_group must be
  // encoded_tokens() / G. Window rows the run covers are replaced by its blocks (the sender's
  // encoding of rows it sent before); tokens() grows to the run's end when it was shorter. The
  // blocks are sealed under the same rule as encoded ones. Nothing changes on error
  // (RESOURCE_EXHAUSTED when the block pool cannot hold them).
  absl::Status AppendGroups(const EncodedGroupsView& run);

  // The fp16 sinks' rows once the first group is encoded (CodecOptions::fp16_sinks), else null.
  const std::shared_ptr<const SinkRows>& sinks() const { return sinks_; }

  // Raw access to the unsealed blocks, for golden-file tests and fault injection (their bytes
  // only where the pool is CPU-readable).
  Bytes& key_blocks(int h) { return heads_[h].kblocks; }
  Bytes& value_blocks(int h) { return heads_[h].vblocks; }
  BytePool* byte_pool() const { return pool_; }

 private:
  struct Head {
    explicit Head(BytePool* pool) : kblocks(pool), vblocks(pool) {}
    Bytes kblocks, vblocks;           // concatenated blocks
    std::vector<size_t> voffsets;     // start of each value block (variable size)
    std::vector<uint8_t> kwin, vwin;  // window tokens at arrival dtype
    DType win_dtype = DType::kF32;
    std::vector<float> a2_sum;      // per window token: sum of p^2 observed
    std::vector<int32_t> a2_reads;  // per window token: number of observations
    std::vector<float> probe;       // per window token: probe weight (or -1)
  };
  // Rows to encode that have not joined the window: an append into an empty window whose
  // input is stored as is encodes its whole groups straight from the caller's rows.
  struct InputRows {
    const uint8_t* k;
    const uint8_t* v;
    int64_t kstride, vstride;  // bytes between rows
    DType dtype;
    const float* probe;  // [n] probe weights of this head, or null
  };
  // Encodes the `count` oldest whole groups of head h's window, or those of `input` when
  // given (encoded_ is updated by the caller once every head is done).
  absl::Status EncodeGroups(int h, int64_t count, const InputRows* input = nullptr);
  // The append path for an empty window and input stored as is (see AppendImpl).
  absl::Status EncodeInput(const TensorView& k, const TensorView& v, int64_t n, DType to,
                           int64_t ready, const float* probe_weights,
                           const std::function<void(int)>& keep_rest,
                           const std::function<absl::Status()>& validate);
  absl::Status AppendImpl(const TensorView& k, const TensorView& v, int64_t start,
                          const float* probe_weights, const ProbeQueries* probes);
  // Decode / DecodeAs into kd, vd ([kv_heads][to - from][d] of dtype, sized by the caller).
  absl::Status DecodeInto(int64_t from, int64_t to, DType dtype, uint8_t* kd, uint8_t* vd) const;
  absl::Status ScoreHead(int h, const float* q, int rows, float scale, bool corr_only,
                         float* out) const;
  absl::Status ReadoutHead(int h, const float* p, int rows, float* out) const;
  // The same over key groups [b0, b1) (the sinks with group 0), plus the window when
  // `window`: scores into out [rows][stride] from token b0 * G on, readout of p [rows][stride]
  // (same token order) into out [rows][d].
  absl::Status ScoreRange(int h, const float* q, int rows, float scale, bool corr_only, int64_t b0,
                          int64_t b1, bool window, float* out, int64_t stride) const;
  absl::Status ReadoutRange(int h, const float* p, int64_t stride, int rows, int64_t b0, int64_t b1,
                            bool window, float* out) const;
  // One part of a split Attend: tokens [bounds[k], bounds[k + 1]) for every query row.
  absl::Status AttendPart(const float* q, int q_heads, int n_q, const AttendOptions& ao,
                          float scale, const std::vector<int64_t>& bounds, int k, float* m,
                          float* l, float* o, float* window_p) const;
  absl::Status AttendSplit(const float* q, int q_heads, int n_q, const AttendOptions& ao,
                           float scale, float* out);
  // Attend on ao.backend (cache_attend_backend.cc): its partial over the encoded blocks merged
  // with the fp16 sinks' and the window's, computed here. *used false (nothing done) when the
  // backend cannot take this read: the caller attends on the CPU kernels.
  absl::Status AttendOnBackend(const float* q, int q_heads, int n_q, const AttendOptions& ao,
                               float scale, float* out, bool* used);
  // Checks the checksums of key and value blocks [b0, b1) of KV heads [h0, h1) on the
  // backend, where they lie; a block that fails is DATA_LOSS with the CPU reader's message.
  absl::Status VerifyOnBackend(const AttendBackend& backend, int h0, int h1, int64_t b0,
                               int64_t b1) const;
  // The block ops (set_block_ops) when this cache's reads of whole blocks take them, else
  // null; EncodesOn the same for its encodes.
  const AttendBackend* BlocksOn() const;
  const AttendBackend* EncodesOn() const;
  // EncodeGroups' half on the block ops: `ready` groups of head h whose rows (fp32, the sinks'
  // stand-ins in place) and value widths (per-token codecs) the caller has prepared.
  absl::Status EncodeOnBackend(const AttendBackend& ops, int h, int64_t ready, const float* k,
                               const float* v, const uint8_t* widths);
  // The backend's halves of ScoreRange, ReadoutRange and DecodeInto over blocks [b0, b1) of
  // head h (cache_attend_backend.cc), checksums verified where the blocks lie.
  absl::Status ScoreOnBackend(const AttendBackend& dev, int h, const float* q, const float* uq,
                              int rows, float scale, int64_t b0, int64_t b1, float* out,
                              int64_t stride) const;
  absl::Status ReadoutOnBackend(const AttendBackend& dev, int h, const float* p, int64_t stride,
                                int rows, int64_t b0, int64_t b1, int masked, float* out) const;
  // Decodes blocks [b0, b1) of head h to fp32 rows k, v [(b1 - b0) * G][d].
  absl::Status DecodeOnBackend(const AttendBackend& dev, int h, int64_t b0, int64_t b1, float* k,
                               float* v) const;
  // The fp16 sinks' partial (partial_attention.h) of KV head h's `rows` query rows.
  void SinkPartial(const SinkRows& sinks, int h, const float* q, int rows, float scale, float* m,
                   float* l, float* o) const;
  // After a merge of P parts of R rows whose last is the window's (wp [R][W]: its tokens'
  // exp(s - m)), records the window tokens' normalized weights as A^2 statistics, as an
  // unsplit Attend records its softmax.
  void RecordWindowWeights(const float* m, const float* l, int P, int64_t R, int n_q,
                           const AttendOptions& ao, const float* wp);
  void WindowToFloat(const Head& hd, bool keys, float* out) const;
  // Key / value block b of head h: the sealed blocks first, then the unsealed ones.
  std::span<const uint8_t> KeyBlock(int h, int64_t b) const;
  std::span<const uint8_t> ValueBlock(int h, int64_t b) const;
  // The same where the CPU can read them (CpuView: a copy in *scratch when the blocks are in
  // memory the CPU does not read). Every CPU read of a block goes through these.
  absl::StatusOr<std::span<const uint8_t>> CpuKeyBlock(int h, int64_t b,
                                                       std::vector<uint8_t>* scratch) const;
  absl::StatusOr<std::span<const uint8_t>> CpuValueBlock(int h, int64_t b,
                                                         std::vector<uint8_t>* scratch) const;
  absl::Status CheckSealed(const SealedBlock& blk) const;

  CodecOptions opts_;
  ReadPolicy read_;
  const AttendBackend* block_ops_ = nullptr;
  int kv_heads_;
  BytePool* pool_;
  std::shared_ptr<const LayerCodecTables> tables_;  // never null
  std::vector<Head> heads_;
  int64_t tokens_ = 0;
  int64_t encoded_ = 0;                 // tokens per head in blocks
  std::vector<SealedBlockPtr> sealed_;  // the leading encoded groups, when sealed
  bool sealing_ = false;
  // Groups being sealed by the current append (filled head by head).
  std::vector<std::shared_ptr<SealedBlock>> building_;
  size_t kblock_bytes_;
  // The fp16 sinks (null until the first group is encoded, or without fp16_sinks), and those
  // the current append is collecting head by head.
  std::shared_ptr<const SinkRows> sinks_;
  std::shared_ptr<SinkRows> building_sinks_;
  // Copies the sinks' rows out of the first group's [G][d] rows of head h and puts the
  // stand-in (row S) in their place.
  void HoldSinks(int h, float* keys, float* values);
  // The sinks a read must apply (null when none are encoded), verified when `verify`.
  absl::StatusOr<const SinkRows*> ReadSinks(bool verify) const;
  absl::Status CheckSinksOf(const SealedBlock& blk, bool first) const;
};

}  // namespace kvq::core
