// CUDA launchers of the kernel ops: raw device pointers, sizes, strides and a stream (a
// cudaStream_t passed as void*, null: the default stream). Each returns a cudaError_t value
// (0 on success). Defined in CUDA builds (KVQ_HAVE_CUDA) only, except AttendUnsupported and
// AttendOnHost (every build) and AttendFromHost (kErrorNoDevice without CUDA); the header
// itself includes no CUDA header, so that host code (core's attend backends, the CPU tests of
// attend_math.h) can name the params.
#pragma once

#include <cstddef>
#include <cstdint>

#include "kvq/format/block_format.h"

namespace kvq::kernels::cuda {

// score_codes of kernels.h: out[i*os + t] = (accumulate ? out : 0)
//   + mult * sum_c q[i*qs + c] * (scale_c * code(c, t) + zero_c); scale/zero fp16 [n_ch].
int ScoreCodes(const uint8_t* codes, int bits, int n_ch, int tokens, const uint16_t* scale,
               const uint16_t* zero, const float* q, int64_t qs, int n_q, float mult,
               bool accumulate, float* out, int64_t os, void* stream);

// The fused decode attend over encoded HeadQ blocks (core/include/kvq/core/codec.h layout),
// flash-decoding style. One launch serves `items` independent (sequence, KV head) pairs, each
// with `rows` query rows (the query heads that share the KV head, times their queries, all
// seeing every token: a decode step) and its own run of key and value blocks. Each item's
// blocks are split into `splits` ranges of whole blocks (range k: blocks
// [floor(n k / S), floor(n (k + 1) / S)), LayerCache::AttendPartBounds' rule), each range
// computes a partial (max, sum, unnormalized output; core/partial_attention.h) in one thread
// block, and a second kernel merges the partials by log-sum-exp in range order.
//
// Results per (item, row): out the normalized attention output over the item's blocks, out_max
// and out_sum the merged partial's m and l, so that the unnormalized partial (m, l, out * l)
// merges with the CPU's over the full-precision window and the fp16 sinks by MergePartials.
// A row that saw no token (every item's block count 0) gets m = -inf, l = 0, out = 0.
//
// Scores: scale * (q . k_base + uq . z_hat), k_base and z_hat dequantized from the
// codes (fp16 scale and zero point, codes LSB-first), exactly the terms of ScoreKeyBlock.
// Rotated blocks (CodecOptions::rotate_keys / rotate_values) cost the kernel nothing: the
// caller passes q = H q for rotated keys (uq stays U^T q of the unrotated query) and rotates
// the merged output back (HadamardRotateRows) for rotated values; the header flags must
// match codec.rotate_keys / codec.rotate_values.
//
// Checksums are not verified here (the fused path reads each byte once; a store that wants
// ReadPolicy::verify_checksums verifies on the CPU or on a scrub). Headers are checked against the
// params when error_flags is given: a block whose header disagrees sets kAttendHeaderMismatch.
struct AttendParams {
  // The codec of every block: head_dim a multiple of 32, at most 256; every other field as
  // BlockCodecUnsupported (cuda_codec.h) allows. The header flags of each block must match
  // rotate_keys / rotate_values.
  format::BlockCodec codec;

  int items = 0;   // (sequence, KV head) pairs in this launch, >= 1
  int rows = 0;    // query rows per item, 1..16
  int blocks = 0;  // blocks of every item, or the most any item has when item_blocks is given
  const int* item_blocks = nullptr;  // device [items]: each item's block count (<= blocks)
  // Device arrays of device pointers, [items][block_stride]: item i's block b at
  // key_blocks[i * block_stride + b]. Blocks may sit at any byte address; the kernel reads the
  // aligned 16-byte words that cover each, so memory must be readable up to the 16-byte
  // boundary after a block's end (an allocation ending within a block's last word needs slack).
  const uint8_t* const* key_blocks = nullptr;
  const uint8_t* const* value_blocks = nullptr;
  int64_t block_stride = 0;   // >= blocks
  const float* q = nullptr;   // device [items][rows][d]
  const float* uq = nullptr;  // device [items][rows][rank] = U^T q; null when rank == 0
  float scale = 0.0f;         // softmax scale, e.g. 1/sqrt(d)
  // Tokens [0, masked_prefix) of each item's first block get no weight: the stand-ins of fp16
  // sinks (CodecOptions::fp16_sinks), whose exact rows the CPU attends to. 0..G-1.
  int masked_prefix = 0;

  // Ranges per item; 0: enough to fill the GPU (AttendSplits). At most `blocks` are used.
  int splits = 0;
  // Device scratch for the partials, at least AttendWorkspaceBytes(*this) bytes.
  void* workspace = nullptr;
  size_t workspace_bytes = 0;

  float* out = nullptr;        // device [items][rows][d]
  float* out_max = nullptr;    // device [items][rows]
  float* out_sum = nullptr;    // device [items][rows]
  int* error_flags = nullptr;  // device int, OR-ed with kAttend* flags; null: no header checks

  // Which thread-block program runs (kAttendCudaCores or kAttendTensorCores); kAttendAuto
  // takes the one measured faster, today the CUDA-core one for every shape (docs/BENCHMARKS.md,
  // "GPU: the tensor-core attend": on an H100 the tensor-core program ran at 0.50-0.92x of it
  // with 4 query rows and 0.98-1.08x with 8).
  int program = 0;
};
// AttendParams::program.
inline constexpr int kAttendAuto = 0;
// Both products of each block on the tensor cores (mma.sync bf16, fp32 sums; queries and
// weights carried as two bf16 each, so that outputs stay within about 2^-17 relative of the
// fp32 program's: cuda_math_test's tolerance 2e-5 of max|v| against 4e-6): at most 8 query
// rows, value_group a multiple of 16, a device of compute capability 8.0 or later.
inline constexpr int kAttendTensorCores = 1;
// One fp32 FMA per code and query row on the CUDA cores: every supported codec and row count.
inline constexpr int kAttendCudaCores = 2;
inline constexpr int kAttendHeaderMismatch = 1;
inline constexpr int kAttendMaxRows = 16;

// Why the params are outside what the kernel supports (naming the field and its limit), or
// null when they are supported. Checks sizes and pointers only, never device memory.
const char* AttendUnsupported(const AttendParams& p);
// Whether supported params run the tensor-core program (program kAttendTensorCores).
bool AttendOnTensorCores(const AttendParams& p);
// The ranges per item a launch uses: p.splits when given, else enough thread blocks to fill
// the current device (at least two waves), each range at least 4 blocks; clamped to
// [1, max(1, blocks)].
int AttendSplits(const AttendParams& p);
// Workspace bytes a launch with these params needs: 4 * items * splits * rows * (d + 2).
size_t AttendWorkspaceBytes(const AttendParams& p);
// Launches the attend and the merge on `stream`. cudaErrorInvalidValue (1) when
// AttendUnsupported names a reason or the workspace is too small.
int Attend(const AttendParams& p, void* stream);

// cudaErrorNoDevice: what AttendFromHost answers where there is no device (or no CUDA build).
inline constexpr int kErrorNoDevice = 100;
// The SM count of the device AttendOnHost stands in for (an H200's): its splits of 0 choose
// as Attend would there with one resident thread block per SM.
inline constexpr int kHostStandInSms = 132;

// Attend with every pointer in host memory: the blocks, the pointer arrays, q, uq and the
// results. Copies p's arrays (key_blocks, value_blocks, item_blocks, q, uq) to device
// scratch held per calling thread, launches on that thread's default stream
// (cudaStreamPerThread), copies out, out_max, out_sum and error_flags back and waits. The
// blocks themselves are read where they are: device memory, or pinned host memory (which a
// device reads in place). p.workspace is not read (the scratch holds the partials).
// kErrorNoDevice without a CUDA build or device.
int AttendFromHost(const AttendParams& p);

// The same attend on the CPU, every pointer in host memory: attend_math.h's thread-block
// programs, each phase for every thread of every thread block in turn, then the merge, the
// very code the GPU runs between its barriers. The GPU attend's stand-in wherever there is
// none (core's host attend backend; the CPU tests). splits 0 chooses as Attend on a device of
// kHostStandInSms SMs would with one resident thread block per SM; p.workspace is not read
// (its own, filled with NaN as device garbage would be). 1 when AttendUnsupported names a
// reason.
int AttendOnHost(const AttendParams& p);

// Baseline: reads `bytes` bytes at `data` (16-byte aligned) with 16-byte loads, XOR-reducing
// them into sink[0] (device uint32) so that no load can be dropped: the memory bandwidth a
// kernel reading the same bytes could reach.
int StreamRead(const void* data, size_t bytes, uint32_t* sink, void* stream);

// Baseline: dense fp16 decode attention over the same tokens, flash-decoding with splits.
// k, v: device fp16 [items][tokens][d], 16-byte aligned (d a multiple of 32, at most 256);
// q: [items][rows][d] fp32; out [items][rows][d] normalized; workspace as Attend's
// (DenseAttendWorkspaceBytes). Tokens go in chunks of 4096 / d (16 KiB of K and V); splits
// 0: as AttendSplits would choose for that many blocks.
struct DenseAttendParams {
  int head_dim = 0, items = 0, rows = 0;
  int64_t tokens = 0;
  const uint16_t* k = nullptr;
  const uint16_t* v = nullptr;
  const float* q = nullptr;
  float scale = 0.0f;
  int splits = 0;
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
  float* out = nullptr;
};
int DenseAttendSplits(const DenseAttendParams& p);
size_t DenseAttendWorkspaceBytes(const DenseAttendParams& p);
int DenseAttend(const DenseAttendParams& p, void* stream);

}  // namespace kvq::kernels::cuda
