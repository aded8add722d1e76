// The block codec's ops on the GPU, beside the fused attend of cuda.h: encode fp32 keys and
// values into HeadQ blocks (core/include/kvq/core/codec.h layout, the same bytes as core's
// encoder on the scalar reference kernels), decode blocks back to fp32 rows (GetBlocks), score
// queries over a run of key blocks and read out weights over a run of value blocks.
//
// Each op has a launcher (CUDA builds: raw device pointers, a cudaStream_t passed as void*, a
// cudaError_t value back) and a stand-in that runs the very same thread-block programs
// (kernels/cuda/codec_math.h) on the CPU with every pointer in host memory (every build): the
// CPU tests hold the stand-ins to core's codec, the device check holds the launchers to the
// stand-ins. No CUDA header here, so host code can name the params.
//
// What the GPU encoder leaves to the CPU: metric rounding of keys or values (sequential error
// feedback per token; a codec with it encodes on the CPU), the A^2 policy's choice of widths
// (the caller passes them) and fp16 sinks' stand-in rows (the caller passes the rows to encode).
#pragma once

#include <cstddef>
#include <cstdint>

#include "kvq/format/block_format.h"

namespace kvq::kernels::cuda {

// The codec fields the block ops read (kvq/format/block_format.h).
using format::BlockCodec;

// Why the codec is outside what the block ops support (naming the field and its limit), or
// null.
const char* BlockCodecUnsupported(const BlockCodec& c);
// Bytes of one key block, and of one value block with uniform widths (per-token widths: the
// largest, every token at 4 bits), as core's KeyBlockBytes / MaxValueBlockBytes.
size_t KeyBlockSize(const BlockCodec& c);
size_t ValueBlockSize(const BlockCodec& c);

// Encodes `blocks` key blocks: block b from keys[b] (G rows of d fp32, row stride ld) with the
// head's basis basis_t[b] (U^T, [rank][d], unrotated; null entries allowed when rank == 0)
// into out[b] (KeyBlockSize bytes). Keys within core::kMaxStorableMagnitude, as appends are.
struct EncodeKeyParams {
  BlockCodec codec;
  int blocks = 0;
  const float* const* keys = nullptr;  // [blocks] pointers
  int64_t ld = 0;
  const float* const* basis_t = nullptr;  // [blocks] pointers
  uint8_t* const* out = nullptr;          // [blocks] pointers
  void* workspace = nullptr;              // EncodeKeyWorkspaceBytes
  size_t workspace_bytes = 0;
};
size_t EncodeKeyWorkspaceBytes(const EncodeKeyParams& p);

// Encodes `blocks` value blocks: block b from values[b] (G rows, stride ld), token widths
// widths[b] ([G], 1..4) when the codec's value_bits is 0 (else ignored), into out[b] (core's
// size for those widths: at most ValueBlockSize).
struct EncodeValueParams {
  BlockCodec codec;
  int blocks = 0;
  const float* const* values = nullptr;
  int64_t ld = 0;
  const uint8_t* const* widths = nullptr;
  uint8_t* const* out = nullptr;
  void* workspace = nullptr;  // EncodeValueWorkspaceBytes
  size_t workspace_bytes = 0;
};
size_t EncodeValueWorkspaceBytes(const EncodeValueParams& p);

// Decodes key blocks to the keys attention sees, k_base + U z_hat (core's
// DecodeKeyBlock, bit for bit): out[b] [G][ld]. basis[b]: U [d][rank] (unrotated); with a null
// basis pointer (or rank 0) the base code alone. The block's header must match the codec
// (kind, bits, sizes, rotation): a mismatch sets kBlockHeaderMismatch in *error_flags and
// leaves that block's rows unwritten.
struct DecodeKeyParams {
  BlockCodec codec;
  int blocks = 0;
  const uint8_t* const* in = nullptr;
  const float* const* basis = nullptr;
  float* const* out = nullptr;
  int64_t ld = 0;
  int* error_flags = nullptr;  // device int, OR-ed; may be null
};
// Value blocks to fp32 rows (core's DecodeValueBlock, bit for bit).
struct DecodeValueParams {
  BlockCodec codec;
  int blocks = 0;
  const uint8_t* const* in = nullptr;
  float* const* out = nullptr;
  int64_t ld = 0;
  int* error_flags = nullptr;
};
inline constexpr int kBlockHeaderMismatch = 1;

// Scores of n_q queries over a run of key blocks (core's ScoreKeyBlock per block):
//   out[i * out_stride + b * G + t] = scale * (q_i . k_base_t + uq_i . z_hat_t).
// q [n_q][d]: already H q when the codec rotates keys (as the attend takes it); uq [n_q][rank]
// = U^T q of the unrotated query (null when rank == 0).
struct ScoreBlocksParams {
  BlockCodec codec;
  int blocks = 0;
  const uint8_t* const* key_blocks = nullptr;
  int n_q = 0;
  const float* q = nullptr;
  const float* uq = nullptr;
  float scale = 1.0f;
  float* out = nullptr;
  int64_t out_stride = 0;
  int* error_flags = nullptr;
};
// Readout over a run of value blocks (core's ReadoutValueBlock per block, in block order):
//   out[i * out_stride + c] += sum_b sum_t p[i * p_stride + b * G + t] * v_hat_bt[c].
// For a codec that rotates values the sum is left in the rotated coordinates (H applied to
// the blocks' rows): the caller rotates it back once (core's HadamardRotateRows), as the
// attend's caller does.
struct ReadoutBlocksParams {
  BlockCodec codec;
  int blocks = 0;
  const uint8_t* const* value_blocks = nullptr;
  int n_q = 0;
  const float* p = nullptr;
  int64_t p_stride = 0;
  float* out = nullptr;
  int64_t out_stride = 0;
  int* error_flags = nullptr;
};

// The stand-ins (every build; host pointers). Each returns 0, or 1 (cudaErrorInvalidValue)
// when the codec is unsupported, a count is out of range or the workspace is too small.
int EncodeKeysOnHost(const EncodeKeyParams& p);
int EncodeValuesOnHost(const EncodeValueParams& p);
int DecodeKeysOnHost(const DecodeKeyParams& p);
int DecodeValuesOnHost(const DecodeValueParams& p);
int ScoreBlocksOnHost(const ScoreBlocksParams& p);
int ReadoutBlocksOnHost(const ReadoutBlocksParams& p);

// The encode ops with the rows, bases, widths and pointer arrays in host memory and out[b]
// where a store keeps its blocks (device memory, or pinned host memory): only the rows cross
// to the device, the blocks are written where they will lie. The arrays are copied to device
// scratch held per calling thread (workspace and workspace_bytes are not read: the scratch
// holds it), the op runs on cudaStreamPerThread and the call waits. Return codes as below.
int EncodeKeysFromHost(const EncodeKeyParams& p);
int EncodeValuesFromHost(const EncodeValueParams& p);

// The read ops with every array in host memory and the blocks where a store keeps them
// (device memory, or pinned host memory a device reads in place): a store's reads of blocks
// it does not copy back (core's AttendBackend). The pointer arrays, bases, queries and weights
// are copied to device scratch held per calling thread, the op runs on cudaStreamPerThread,
// the results (the rows out[b] [G][ld]: d columns of each row; scores; readouts, which
// accumulate into out as the op does) and error_flags are copied back, and the call waits.
// 1 (cudaErrorInvalidValue) as the stand-ins; kErrorNoDevice (cuda.h) without a CUDA build
// or device; every build.
int DecodeKeysFromHost(const DecodeKeyParams& p);
int DecodeValuesFromHost(const DecodeValueParams& p);
int ScoreBlocksFromHost(const ScoreBlocksParams& p);
int ReadoutBlocksFromHost(const ReadoutBlocksParams& p);

// The launchers (CUDA builds only; device pointers, pointer arrays in device memory).
int EncodeKeys(const EncodeKeyParams& p, void* stream);
int EncodeValues(const EncodeValueParams& p, void* stream);
int DecodeKeys(const DecodeKeyParams& p, void* stream);
int DecodeValues(const DecodeValueParams& p, void* stream);
int ScoreBlocks(const ScoreBlocksParams& p, void* stream);
int ReadoutBlocks(const ReadoutBlocksParams& p, void* stream);

}  // namespace kvq::kernels::cuda
