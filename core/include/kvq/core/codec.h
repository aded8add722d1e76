// The HeadQ block codec: one block holds G consecutive tokens of one KV head.
//
// Keys:   KIVI-like asymmetric quantization per channel over the G tokens (fp16 scale and
//         zero point per channel), plus the HeadQ side code: the residual e = k - k_base
//         projected on the head's query basis U (d x r), c = U^T e, quantized per
//         coefficient over the G tokens (fp16 scale and zero point, 4 or 8 bits).
// Values: asymmetric quantization per token over groups of `value_group` channels. Bits
//         per token are uniform, or chosen per token by the A^2 policy
//         (core/src/codec/value_policy.h).
//
// The block bytes (header, checksum, key and value payloads, the dense-and-sparse list) are
// defined once, in kvq/format/block_format.h; every byte is counted in the bits-per-element
// figures.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kvq/core/byte_pool.h"
#include "kvq/format/block_format.h"

namespace kvq::core {

// The largest key or value magnitude an append accepts: the fp16 maximum, since each group's
// zero point is its minimum stored in fp16 (a larger element would make it infinite and the
// whole group decode to Inf/NaN). Within it every scale and zero point of a block is finite.
inline constexpr float kMaxStorableMagnitude = format::kHalfMax;
// The most attention sinks a codec keeps at fp16 (CodecOptions::fp16_sinks): fewer than the
// smallest group, so that every first group keeps a row to stand in for them.
inline constexpr int kMaxFp16Sinks = 16;
// The most value scale groups per head (CodecOptions::value_group): the kernels' limit.
inline constexpr int kMaxValueGroups = 64;

enum class ValuePolicy : uint8_t {
  kUniform = 0,  // every token at value_bits
  kA2 = 1,       // per-token bits in {1,2,3,4} from A^2 weights, mean <= value_budget
};

// A sequence's codec: every setting a model's codec.json and the wire's CodecSettings carry
// (described once, in codec_schema.h), plus head_dim from the model. Three kinds, grouped
// below: the block format, the sequence layout and the encoder policy. How reads treat blocks
// is not a codec setting (ReadPolicy, cache.h), nor are the evaluation tools' controls (the
// wrong-sign test and value metric rounding: frontend's EvalConfig).
struct CodecOptions {
  // --- The block format: what fixes every block's bytes (BlockCodecOf gives the format
  // layer's view of them); readers need exactly these.
  // Head dimension d (1..512).
  int head_dim = 64;
  // Key base code bits: 2, 3, 4 or 8.
  int key_bits = 2;
  // G: tokens per key group and per block: 32, 64 or 128. Larger G amortizes the per-channel
  // scale and zero point (32 bits per channel per group: 1 bit/element at G=32, 0.25 at 128)
  // at the price of coarser per-channel ranges; HeadQ's side code repairs part of that.
  int key_group = 32;
  // HeadQ rank r (0..head_dim). 0 = KIVI-like base only (no side code).
  int rank = 0;
  // Side-code bits per coefficient: 4 or 8.
  int side_bits = 8;
  // Value bits for the uniform policy: 1, 2, 3, 4 or 8.
  int value_bits = 2;
  // Channels per value scale group (the last group of a head may be shorter): 1..head_dim,
  // with at most kMaxValueGroups (64) groups per head, so at least ceil(head_dim / 64): 2 at
  // head_dim 128, 8 at 512. The limit is the kernels': the encoder keeps a token's scales and
  // zero points in a fixed array of 64, and the GPU attend stages a block's (8 * G * groups
  // bytes of shared memory: 64 KiB at G = 128 and 64 groups).
  // 32 at d=64 costs 1 bit/element of fp16 scale+zero; head_dim costs 0.5 at d=64.
  int value_group = 32;
  ValuePolicy value_policy = ValuePolicy::kUniform;
  // A fixed orthogonal rotation (the normalized Walsh-Hadamard matrix H, head_dim a power of
  // two) applied to each key / value token before quantization: it spreads outlier channels
  // over all channels, so per-token value groups and per-channel key ranges see flatter
  // data. Scores use H q against rotated keys (q . k = Hq . Hk), readouts rotate the
  // partial output back; HeadQ's basis lives in the rotated coordinates (H U), so U^T q and
  // the side code are unchanged. Blocks so encoded carry version 3 and a flag.
  bool rotate_keys = false;
  bool rotate_values = false;
  // Dense-and-sparse (KVQuant, format::kFlagSparse): per mille of each key (value) block's G x d
  // elements kept exactly beside the codes, 0..100 (a fixed count a block, SparseCount). Which
  // ones: the elements at the ends of their quantization ranges (a key channel over the block's
  // tokens; a value token's channel group) whose removal shrinks those ranges most (TrimOutliers);
  // they are clamped into the remaining range for the codes and their exact values restored on
  // every read through a delta. Costs 32 bits an element. Not with a rotation of the same tensor
  // (it spreads outliers before they are seen); the fp16 sinks' stand-in rows are never chosen.
  int sparse_keys = 0;
  int sparse_values = 0;

  // --- The sequence layout: what a sequence keeps outside its blocks.
  // Attention sinks kept exact: positions [0, fp16_sinks) of a sequence (0..16) are stored
  // at fp16 beside its first key and value blocks (LayerCache's SinkRows), and those blocks
  // encode a stand-in in their place (the group's first row after them), so that the sinks'
  // outlier keys and values do not widen the ranges of the whole first group. Reads use the
  // exact rows; their bytes are counted with the sequence (16 bits per element, once).
  int fp16_sinks = 0;
  // R: the most recent tokens kept at the precision they arrived in, besides the
  // incomplete group. Tokens are encoded a group at a time once more than R + G - 1 wait.
  int window = 0;

  // --- The encoder policy: how codes are chosen; blocks read the same whatever it is.
  // A^2 policy: mean code bits per value element in a block (1.0..4.0), plus the 2-bit
  // per-token width tag. Tokens with higher A^2 weight get more bits.
  float value_budget = 2.0f;
  // A^2 policy: the first `sink_tokens` positions of a sequence always get 4 bits
  // (attention sinks carry large, persistent A^2 weight).
  int sink_tokens = 4;
  // Encoder only (blocks read the same): round each key's base codes channel by channel with
  // error feedback (GPTQ's rule) so that the error is small in the model's query metric
  // E[q q^T] rather than per channel; needs the basis's query moment (else nearest rounding).
  bool metric_rounding = false;

  absl::Status Validate() const;
  bool per_token_value_bits() const { return value_policy == ValuePolicy::kA2; }
  int value_groups() const { return (head_dim + value_group - 1) / value_group; }
  // A short human-readable summary, e.g. "k2g32 r4s8 v2g32 R0".
  std::string ToString() const;
};

// The fields that fix the codec's block layout (value_bits 0 under the A^2 policy; the sparse
// entry counts of SparseCount): what the block format and the kernels take.
format::BlockCodec BlockCodecOf(const CodecOptions& o);

// Entries of a key (keys true) or value block's dense-and-sparse list: the codec's per mille of
// its G x d elements, rounded to nearest.
int SparseCount(const CodecOptions& o, bool keys);

// Bytes of one encoded key block (fixed for given options).
size_t KeyBlockBytes(const CodecOptions& o);
// Bytes of one encoded value block with uniform bits; for kA2 the maximum is returned by
// MaxValueBlockBytes and the actual size depends on the chosen widths.
size_t ValueBlockBytes(const CodecOptions& o);
size_t MaxValueBlockBytes(const CodecOptions& o);

// What the dense-and-sparse encoder needs beyond the rows (CodecOptions::sparse_keys /
// sparse_values); null: the block's first rows are real and keys decode with U (basis_t
// transposed).
struct SparseEncode {
  const float* decode_basis = nullptr;  // keys: B [d][r] that reads decode with (oblique pair)
  int skip_rows = 0;  // rows [0, skip_rows) are never kept exact (the fp16 sinks' stand-ins)
};

// keys: [G][d] fp32 token-major, row stride `ld` elements. basis: U as [d][r] row-major
// (orthonormal columns), may be null only when o.rank == 0. Appends the block to `out`.
// ByteVec: std::vector<uint8_t> (a cache encodes into host memory, then appends the bytes to
// its pool's Bytes, which may be device memory), for all three encoders.
template <class ByteVec>
absl::Status EncodeKeyBlock(const CodecOptions& o, const float* keys, int64_t ld,
                            const float* basis, ByteVec* out);
// The same with U given transposed, [r][d] (a cache keeps it per head instead of transposing
// the basis for every block).
// rounding: null (nearest rounding) or the metric factor of KeyRoundingFactor: the base
// codes are then chosen by MetricRound.
template <class ByteVec>
// sparse: see SparseEncode (used when o.sparse_keys > 0).
absl::Status EncodeKeyBlockT(const CodecOptions& o, const float* keys, int64_t ld,
                             const float* basis_t, ByteVec* out, const float* rounding = nullptr,
                             const SparseEncode* sparse = nullptr);

// The factor metric rounding uses for one head: the upper Cholesky factor of H^-1 [d][d]
// row-major, H = P^T M P + damping, M = E[q q^T] [d][d] and P = I - B A^T the part of a key
// error the side code leaves (decode basis B, encode basis A, [d][r] each; r = 0: P = I).
// rotated: the factor for keys rotated by H (CodecOptions::rotate_keys), H M H and H B, H A.
std::vector<float> KeyRoundingFactor(const float* moment, int d, const float* decode_basis,
                                     const float* encode_basis, int r, bool rotated);

// values: [G][d] fp32, row stride ld. bits_per_token: [G] widths in {1,2,3,4} (kA2) or
// null (uniform value_bits). Appends the block to `out`.
// rounding: null (nearest rounding) or the factor of ValueRoundingFactor: each token's codes
// are then chosen by error feedback in the value metric (the same scales and zero points).
template <class ByteVec>
absl::Status EncodeValueBlock(const CodecOptions& o, const float* values, int64_t ld,
                              const uint8_t* bits_per_token, ByteVec* out,
                              const float* rounding = nullptr,
                              const SparseEncode* sparse = nullptr);

// The factor value metric rounding uses for one head: the upper Cholesky factor of
// (M + damping)^-1 [d][d] row-major, M the head's value metric [d][d] (ModelBasis::
// value_metric). rotated: for values rotated by H (CodecOptions::rotate_values), of H M H.
std::vector<float> ValueRoundingFactor(const float* metric, int d, bool rotated);

// A parsed, validated block. Pointers point into the caller's bytes.
struct KeyBlockView {
  int bits = 0, side_bits = 0, tokens = 0, head_dim = 0, rank = 0;
  bool rotated = false;             // keys stored as H k (see CodecOptions::rotate_keys)
  const uint16_t* scale = nullptr;  // [d] fp16
  const uint16_t* zero = nullptr;   // [d] fp16
  const uint8_t* codes = nullptr;   // [d][tokens*bits/8]
  const uint16_t* side_scale = nullptr;
  const uint16_t* side_zero = nullptr;
  const uint8_t* side_codes = nullptr;  // [r][tokens*side_bits/8]
  const uint8_t* sparse = nullptr;      // dense-and-sparse entries (format::kFlagSparse), or null
  int sparse_count = 0;
};

struct ValueBlockView {
  int bits = 0;  // 0: per-token widths
  int tokens = 0, head_dim = 0, value_group = 0;
  bool rotated = false;              // values stored as H v (see CodecOptions::rotate_values)
  const uint8_t* payload = nullptr;  // first token record: fp16 scale[ng] | zero[ng] | codes
  uint8_t token_bits[128] = {};      // width of each token (<= 128 tokens per block)
  const uint8_t* sparse = nullptr;   // dense-and-sparse entries (format::kFlagSparse), or null
  int sparse_count = 0;
};

// Checks magic, version, kind, every field against `o` (when `o` is given), the size, and
// (when verify) the checksum. A corrupted or truncated block is an error, never garbage:
// DATA_LOSS for checksum/size mismatch, INVALID_ARGUMENT for an incompatible layout.
absl::StatusOr<KeyBlockView> ParseKeyBlock(std::span<const uint8_t> block, const CodecOptions& o,
                                           bool verify);
absl::StatusOr<ValueBlockView> ParseValueBlock(std::span<const uint8_t> block,
                                               const CodecOptions& o, bool verify);
// Parses the blocks of one sequence on a read (score, readout, attend). The header that every
// block of codec `o` carries and its hash are formed once, so a block of the expected size
// whose header matches byte for byte needs only its checksum (when verify); any other block
// (A^2 widths, a corruption) goes through ParseKeyBlock /
// ParseValueBlock, so verdicts and error messages are theirs. `o` must outlive the reader.
class BlockReader {
 public:
  BlockReader(const CodecOptions& o, bool verify);
  absl::Status Key(std::span<const uint8_t> block, KeyBlockView* v) const;
  absl::Status Value(std::span<const uint8_t> block, ValueBlockView* v) const;

 private:
  bool Matches(std::span<const uint8_t> block, const uint8_t* head, uint64_t head_hash,
               size_t size) const;

  const CodecOptions& o_;
  bool verify_;
  bool value_fast_;  // uniform value widths: every value block has one size and header
  uint8_t key_head_[12], value_head_[12];
  uint64_t key_hash_, value_hash_;
  size_t key_bytes_, value_bytes_;
  KeyBlockView key_view_;      // the fields; the fast path sets the pointers
  ValueBlockView value_view_;  // the same for values
};

// Verifies only the checksum and the header (for scrubs and whole-block reads).
absl::Status VerifyBlock(std::span<const uint8_t> block);

// Scores n_q queries against one key block:
//   out[i*out_stride + t] = scale * (q_i . k_base_t + uq_i . z_hat_t)
// q: [n_q][d]; uq: [n_q][r] = U^T q_i (computed once per query), may be null when r == 0.
// include_base = false gives only the HeadQ correction term.
// q_rotated: q is already H q (HadamardRotateRows) for a rotated block, so that a caller
// scoring many blocks rotates its queries once instead of once per block; ignored for a
// block that is not rotated. uq stays U^T q of the unrotated queries either way.
void ScoreKeyBlock(const KeyBlockView& b, const float* q, const float* uq, int n_q, float scale,
                   float* out, int64_t out_stride, bool include_base = true,
                   bool q_rotated = false);

// out[i*out_stride + c] += sum_t p[i*p_stride + t] * v_hat_t[c]
// out_rotated: for a rotated block, accumulate in the rotated coordinates instead,
// out += sum_t p_t (H v_hat_t), leaving the caller to rotate the sum back once (H is linear,
// so sum_b H x_b = H sum_b x_b) instead of rotating each block's partial output; ignored for
// a block that is not rotated.
void ReadoutValueBlock(const ValueBlockView& b, const float* p, int64_t p_stride, int n_q,
                       float* out, int64_t out_stride, bool out_rotated = false);

// x <- H x for each row of x [n][d] (row stride ld), H the normalized Walsh-Hadamard matrix
// (d a power of two). H is symmetric and orthogonal, so the same call also undoes it.
void HadamardRotateRows(float* x, int64_t ld, int n, int d);

// Keys as attention sees them: k_base + U z_hat (gives exactly the HeadQ scores, up to
// rounding). out: [tokens][d]. basis may be null when rank == 0.
void DecodeKeyBlock(const KeyBlockView& b, const float* basis, float* out);
// The same keys as channel rows, out [d][tokens] (out[c * tokens + t]), bit for bit
// DecodeKeyBlock's values transposed, with no transpose pass (for a destination that keeps keys by
// channel, such as vLLM's CPU cache). False (out untouched) for a block with a dense-and-sparse
// list.
bool DecodeKeyBlockByChannel(const KeyBlockView& b, const float* basis, float* out);
void DecodeValueBlock(const ValueBlockView& b, float* out);

// Base code only (no side code), for metrics and tests.
void DecodeKeyBase(const KeyBlockView& b, float* out);

}  // namespace kvq::core
