// Where the encoded blocks' part of an Attend runs, and the reads of blocks the CPU reaches
// only by copies (device memory). LayerCache::Attend hands an AttendBackend
// the layer's encoded key and value blocks (their addresses in the store's BytePool) with the
// queries; the backend answers every query row's partial softmax over them (partial_attention.h:
// the merged maximum m, sum l and normalized output), which the cache merges with its own
// partials over the fp16 sinks and the full-precision window by log-sum-exp (MergePartials).
// Without a backend the cache attends on the CPU kernels, as it always has. Which reads take
// the backend and what stays on the CPU: docs/CODEC.md, "Attend backends".
#pragma once

#include <atomic>
#include <cstdint>
#include <span>

#include "absl/status/status.h"
#include "kvq/core/byte_pool.h"
#include "kvq/kernels/cuda.h"
#include "kvq/kernels/cuda_checksum.h"
#include "kvq/kernels/cuda_codec.h"

namespace kvq::core {

class AttendBackend {
 public:
  virtual ~AttendBackend() = default;
  // "cuda" or "cuda-host": what start-up logs, Stats and metrics call it.
  virtual const char* name() const = 0;
  // The attend of kernels/cuda.h with every array (the block pointer arrays, item_blocks, q,
  // uq, out, out_max, out_sum, error_flags) in host memory and the blocks where the store
  // keeps them (memory this backend reads); splits 0 lets the backend choose; the workspace
  // is the backend's own. Synchronous; may be called from many threads at once. UNAVAILABLE
  // when the device cannot run it, INVALID_ARGUMENT for params the kernel does not support.
  absl::Status AttendBlocks(const kernels::cuda::AttendParams& p) const;
  // Whether it reads blocks in `pool`'s kind of memory (the GPU: device and pinned memory,
  // never pageable host memory, where a read would fault the device's context). A cache whose
  // pool it cannot read fails its attends with FAILED_PRECONDITION rather than hand it those.
  virtual bool CanRead(kernels::Pool pool) const = 0;
  // Calls of AttendBlocks so far (for metrics, and for tests that must know it served).
  int64_t calls() const { return calls_.load(std::memory_order_relaxed); }
  // Checks the blocks' checksums where they lie (kernels/cuda_checksum.h: one verdict a block,
  // kVerifyOk or why not), so that a read with ReadPolicy::verify_checksums needs no copy of them:
  // `blocks` and `sizes` in host memory, the blocks in memory this backend reads. Synchronous;
  // UNAVAILABLE when the device cannot run it.
  absl::Status VerifyBlocks(std::span<const uint8_t* const> blocks, std::span<const uint64_t> sizes,
                            uint8_t* verdicts) const;
  // Calls of VerifyBlocks so far.
  int64_t verify_calls() const { return verify_calls_.load(std::memory_order_relaxed); }
  // The block codec's read ops (kernels/cuda_codec.h) with every array in host memory and the
  // blocks in memory this backend reads, so that a store's Score, Readout and decodes of blocks
  // the CPU reads only by copies copy none back (LayerCache::set_block_ops).
  // Synchronous; UNAVAILABLE when the device cannot run them, INVALID_ARGUMENT for params the
  // ops do not support. A block whose header is not the codec's sets error_flags (the op's
  // contract), which the caller turns into DATA_LOSS.
  // The encode ops (kernels/cuda_codec.h): rows, bases and widths in host memory, out[b] in
  // memory this backend reads (where the store keeps its blocks), so that only the rows cross
  // to the device (LayerCache::set_block_ops).
  absl::Status EncodeKeys(const kernels::cuda::EncodeKeyParams& p) const;
  absl::Status EncodeValues(const kernels::cuda::EncodeValueParams& p) const;
  absl::Status DecodeKeys(const kernels::cuda::DecodeKeyParams& p) const;
  absl::Status DecodeValues(const kernels::cuda::DecodeValueParams& p) const;
  absl::Status ScoreBlocks(const kernels::cuda::ScoreBlocksParams& p) const;
  absl::Status ReadoutBlocks(const kernels::cuda::ReadoutBlocksParams& p) const;
  // Calls of those six so far.
  int64_t block_op_calls() const { return block_op_calls_.load(std::memory_order_relaxed); }

 protected:
  // Return a kernels/cuda.h error code (0: done).
  virtual int Run(const kernels::cuda::AttendParams& p) const = 0;
  virtual int RunVerify(const kernels::cuda::VerifyParams& p) const = 0;
  virtual int RunEncodeKeys(const kernels::cuda::EncodeKeyParams& p) const = 0;
  virtual int RunEncodeValues(const kernels::cuda::EncodeValueParams& p) const = 0;
  virtual int RunDecodeKeys(const kernels::cuda::DecodeKeyParams& p) const = 0;
  virtual int RunDecodeValues(const kernels::cuda::DecodeValueParams& p) const = 0;
  virtual int RunScore(const kernels::cuda::ScoreBlocksParams& p) const = 0;
  virtual int RunReadout(const kernels::cuda::ReadoutBlocksParams& p) const = 0;

 private:
  // An error code of a Run* as a status naming this backend and `op`.
  absl::Status Outcome(int code, const char* op) const;
  mutable std::atomic<int64_t> calls_{0}, verify_calls_{0}, block_op_calls_{0};
};

// The CUDA attend (kernels::cuda::AttendFromHost): blocks in device memory or pinned host
// memory. UNAVAILABLE in builds without CUDA and on machines without a device.
const AttendBackend* CudaAttendBackend();
// The CUDA attend's own thread-block programs run on the CPU (kernels::cuda::AttendOnHost, and
// the block ops' and checksum's *OnHost stand-ins): the device's arithmetic, block parsing,
// splits and merge, on any machine. It stands in for the CUDA backend where there is no GPU
// (tests, CI), so that a store given it takes every step a store on a GPU takes; it is no
// faster than the CPU kernels (far slower: one thread plays every GPU thread in turn). Tests
// derive from it to inject a fault into one op.
class HostStandInBackend : public AttendBackend {
 public:
  const char* name() const override;
  bool CanRead(kernels::Pool pool) const override;

 protected:
  int Run(const kernels::cuda::AttendParams& p) const override;
  int RunVerify(const kernels::cuda::VerifyParams& p) const override;
  int RunEncodeKeys(const kernels::cuda::EncodeKeyParams& p) const override;
  int RunEncodeValues(const kernels::cuda::EncodeValueParams& p) const override;
  int RunDecodeKeys(const kernels::cuda::DecodeKeyParams& p) const override;
  int RunDecodeValues(const kernels::cuda::DecodeValueParams& p) const override;
  int RunScore(const kernels::cuda::ScoreBlocksParams& p) const override;
  int RunReadout(const kernels::cuda::ReadoutBlocksParams& p) const override;
};
// The process's HostStandInBackend.
const AttendBackend* HostAttendBackend();

// Whether `backend` answers for blocks in `pool`: encodes a small layer (2 KV heads, head_dim
// 32, 3 groups of 32 tokens and a window of 5) into `pool`, attends over it on `backend` and
// on the CPU kernels and compares (within 1e-3 of the values' largest magnitude: the two sum in
// different orders, and the CPU's AVX-512 int16 paths round weights; a wrong kernel misses by
// far more). Where the CPU reads `pool` only by copies (device memory), what a store then runs
// on the backend too (LayerCache::set_block_ops): the same layer encoded on it, scored and
// decoded on it, against the CPU-encoded layer's reads through copies (within 1e-3 and 1e-5 of
// their largest magnitudes).
// The error says why not: UNAVAILABLE (no device), INTERNAL (it ran and disagreed, or was not
// used).
absl::Status ProbeAttendBackend(const AttendBackend& backend, BytePool* pool);

}  // namespace kvq::core
